"""Trainer benchmark: what the trainer's input side costs, and that nothing retraces.

1. Input-side overhead. The same Keras model (``tiny`` by default, on the CPU here), the
   same batches (the demo plan's bucket shapes, batch 16), timed two ways in one process:

   baseline (``memory``)  batches already staged as tensors in memory; the loop only steps
   candidate (``queue``)  the consumer's real input side: a feeder thread puts host numpy
                          batches into a capacity-3 ``BatchQueue`` as soon as a slot is free
                          (the producers are never the bottleneck here), the queue's stager
                          thread copies each onto the device while the step runs, and the
                          loop takes them with ``get()``: dequeue + staging, nothing else

   Both resolve their losses every ``log_every`` steps, as the training loop does.
   Overhead = median queue time per step / median memory time per step - 1; target
   <= 0.02. Repetitions alternate which goes first; each repetition's own figure is kept.

2. Retraces after warm-up. A fresh trainer is prepared for the plan's bucket shapes
   (``prepare()``, as the consumer does during warm-up), then trained ``retrace_steps``
   steps on batches in the order of real epoch plans; the traces counted after warm-up
   must be 0. (Batch 4 here: the count does not depend on B, and it keeps 1,000 steps
   to a minute on 2 cores.)

The resume target (kill -9 mid-epoch, then ``--resume``: every planned batch trained, none
twice since the checkpoint) is a test, ``tests/test_resume.py``, not a timing.

Run alone: ``python -m stoker.benchmarks.trainer [--quick]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .common import BenchError, ratio, report, spread, table
from ..consumer.feed import validation
from ..consumer.buffer import BatchQueue, QueuedBatch
from ..consumer.plan import EpochPlanner
from ..consumer.training.trainer import KerasTrainer
from ..shared import config as config_mod
from ..shared.batch import SCHEMA, batch_dims, collate
from ..shared.config import FeaturesConfig
from ..shared.dataset.files import DEMO_DATA_DIR
from ..consumer.index.index import build_index
from ..shared.text import FIRST_SYMBOL_ID
from ..shared.mel import pad_values

log = logging.getLogger(__name__)

TARGET_OVERHEAD = 0.02
# Rows of real text per batch (the rest of the bucket length is padding), as in the demo data.
FILL = 0.85
# Token ids of the synthetic batches: about an English character vocabulary's size.
TOKEN_IDS = 38
# No wait for a queued batch lasts longer than this; a stuck feeder fails the measurement.
GET_TIMEOUT_S = 30.0


@dataclass
class TrainerPlan:
    model: str = "tiny"
    batch_size: int = 16
    # Many short measurements rather than a few long ones: on this shared 2-core machine a
    # step's time drifted between 125 and 151 ms from one 16-second block to the next, which
    # three blocks a side could not tell from a 2% overhead. Alternating 8 + 8 blocks of 50
    # steps (about 7 s each) exposes both sides to the same drift, and their medians to less.
    steps: int = 50  # timed steps per measurement
    warmup_steps: int = 5  # untimed steps before each measurement (the trainer is traced already)
    repetitions: int = 8
    log_every: int = 25
    retrace_steps: int = 1000
    retrace_batch_size: int = 4

    @classmethod
    def quick(cls) -> "TrainerPlan":
        return cls(steps=40, repetitions=2, retrace_steps=200)


def _demo_setup(batch_size: int) -> tuple[Any, Any]:
    """The resolved default config (CPU, this batch size) and the demo dataset's planner."""
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # the CPU figure the targets ask for

    cfg = config_mod.load(None, {"data.path": str(DEMO_DATA_DIR), "batching.batch_size": batch_size})
    index = build_index(cfg.data, cfg.features)
    train, _ = validation.split(index.samples, cfg.trainer.val_clips, cfg.batching.seed)
    return cfg, EpochPlanner(train, cfg.batching)


def _batch(batch_size: int, tokens: int, frames: int, n_mels: int, seed: int) -> dict[str, np.ndarray]:
    """A host batch of a bucket's shape, rows filled to about FILL of it (as producers send)."""
    rng = np.random.default_rng(seed)
    toks = [rng.integers(FIRST_SYMBOL_ID, TOKEN_IDS, size=max(2, int(tokens * FILL))).astype(np.int32) for _ in range(batch_size)]
    mels = [(rng.standard_normal((max(1, int(frames * FILL)), n_mels)) - 5.0).astype(np.float32)
            for _ in range(batch_size)]
    return collate([{"tokens": t, "mel": m} for t, m in zip(toks, mels)],
                   batch_dims(batch_size, (tokens, frames), n_mels), pad_values(SCHEMA, FeaturesConfig(), "off"))


def _make_trainer(cfg: Any, shapes: list[tuple[int, int, int]], model: str) -> Any:
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, model=model))
    trainer = KerasTrainer(cfg, "/CPU:0", shapes, total_batches=None, vocab_size=TOKEN_IDS)
    trainer.prepare(shapes)
    return trainer


def _time_memory(trainer: Any, staged: list[Any], steps: int, warmup: int, log_every: int) -> float:
    """Seconds per step with batches already on the device."""
    handles = [trainer.step(staged[i % len(staged)]) for i in range(warmup)]
    trainer.resolve(handles)
    began = time.perf_counter()
    handles = []
    for i in range(steps):
        handles.append(trainer.step(staged[i % len(staged)]))
        if len(handles) == log_every:
            trainer.resolve(handles)
            handles = []
    trainer.resolve(handles)
    return (time.perf_counter() - began) / steps


def _time_queue(trainer: Any, host: list[dict[str, np.ndarray]], steps: int, warmup: int, log_every: int) -> float:
    """Seconds per step through the consumer's queue with device staging."""
    total = warmup + steps
    free = threading.Event()
    queue = BatchQueue(3, staging=trainer.staging(), on_free=free.set)
    stop = threading.Event()
    failure: list[BaseException] = []

    def feed() -> None:
        try:
            for i in range(total):
                while len(queue) >= queue.capacity:
                    if stop.is_set():
                        return
                    free.wait(1.0)
                    free.clear()
                queue.put(QueuedBatch(lease=i, epoch=0, index=i, ids=[], arrays=host[i % len(host)], producer="feed"))
        except BaseException as exc:  # reported by the measuring thread
            failure.append(exc)

    feeder = threading.Thread(target=feed, name="feeder", daemon=True)
    feeder.start()
    try:
        handles: list[Any] = []
        began = 0.0
        for i in range(total):
            if i == warmup:
                trainer.resolve(handles)
                handles = []
                began = time.perf_counter()
            got = queue.get(GET_TIMEOUT_S)
            if got is None:
                raise BenchError(f"no batch from the feeder in {GET_TIMEOUT_S:g} s ({failure or 'no error'})")
            handles.append(trainer.step(got[0].arrays))
            if len(handles) == log_every:
                trainer.resolve(handles)
                handles = []
        trainer.resolve(handles)
        return (time.perf_counter() - began) / steps
    finally:
        stop.set()
        queue.close()
        feeder.join(5.0)


def measure_overhead(plan: TrainerPlan) -> dict[str, Any]:
    cfg, planner = _demo_setup(plan.batch_size)
    shapes = planner.shapes
    trainer = _make_trainer(cfg, shapes, plan.model)
    host = [_batch(rows, tokens, frames, cfg.features.n_mels, seed=i)
            for i, (rows, tokens, frames) in enumerate(shapes)]
    staged = [trainer.stage(b) for b in host]
    memory, queued = [], []
    for rep in range(plan.repetitions):
        order = ("memory", "queue") if rep % 2 == 0 else ("queue", "memory")
        for kind in order:
            if kind == "memory":
                memory.append(_time_memory(trainer, staged, plan.steps, plan.warmup_steps, plan.log_every))
            else:
                queued.append(_time_queue(trainer, host, plan.steps, plan.warmup_steps, plan.log_every))
    ratios = [q / m - 1.0 for q, m in zip(queued, memory)]
    overhead = statistics.median(queued) / statistics.median(memory) - 1.0
    return {
        "model": plan.model, "batch_size": plan.batch_size, "shapes": [list(s) for s in shapes],
        "params": trainer.param_count, "steps": plan.steps,
        "memory_step_ms": spread([m * 1e3 for m in memory]), "queue_step_ms": spread([q * 1e3 for q in queued]),
        # value = numerator / denominator - 1: the share the input side adds to a step
        "overhead": {**ratio(statistics.median(queued), statistics.median(memory)), "value": overhead,
                     "per_repetition": [round(r, 5) for r in ratios]},
        "target": TARGET_OVERHEAD, "met": overhead <= TARGET_OVERHEAD,
    }


def measure_retraces(plan: TrainerPlan) -> dict[str, Any]:
    cfg, planner = _demo_setup(plan.retrace_batch_size)
    shapes = planner.shapes
    trainer = _make_trainer(cfg, shapes, plan.model)
    after_warmup = trainer.stats()["traces"]
    host = {shape: _batch(*shape, cfg.features.n_mels, seed=i) for i, shape in enumerate(shapes)}
    staged = {shape: trainer.stage(batch) for shape, batch in host.items()}
    order: list[tuple[int, int, int]] = []
    epoch = 0
    while len(order) < plan.retrace_steps:
        order.extend((b.rows, *b.shape) for b in planner.plan(epoch))
        epoch += 1
    began = time.perf_counter()
    handles = []
    for shape in order[:plan.retrace_steps]:
        handles.append(trainer.step(staged[shape]))
        if len(handles) == plan.log_every:
            trainer.resolve(handles)
            handles = []
    trainer.resolve(handles)
    stats = trainer.stats()
    retraces = stats["traces"] - after_warmup
    return {"steps": plan.retrace_steps, "epochs": epoch, "bucket_shapes": len(shapes),
            "traces_at_warmup": after_warmup, "traces_after_warmup": retraces, "retraces_logged": stats["retraces"],
            "seconds": round(time.perf_counter() - began, 2), "target": 0, "met": retraces == 0}


def run(plan: TrainerPlan) -> dict[str, Any]:
    return {"overhead": measure_overhead(plan), "retraces": measure_retraces(plan)}


def render(result: dict[str, Any]) -> str:
    o, r = result["overhead"], result["retraces"]
    rows = [
        ["input side (dequeue + staging) vs in-memory tensors",
         f"{o['queue_step_ms']['median']:.1f} / {o['memory_step_ms']['median']:.1f} ms per step",
         f"{100 * o['overhead']['value']:+.2f}%", f"<= {100 * o['target']:.0f}%", "met" if o["met"] else "NOT met"],
        [f"traces after warm-up over {r['steps']} steps ({r['bucket_shapes']} bucket shapes)",
         f"{r['traces_at_warmup']} at warm-up", str(r["traces_after_warmup"]), "0", "met" if r["met"] else "NOT met"],
    ]
    return table(["trainer", "measured", "figure", "target", ""], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.trainer", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="", help="also write the result as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = run(TrainerPlan.quick() if args.quick else TrainerPlan())
    return report(render(result), result, args.out)


if __name__ == "__main__":
    sys.exit(main())
