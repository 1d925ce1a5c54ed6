"""The feed in a user's loop against stoker's own trainer, and Keras fit on the feed against
fit on a plain tf.data pipeline (``python -m stoker.benchmarks.feed``).

Every run is its own process, trains the ``tiny`` model on the CPU on the demo data
(batch 16, 2 producers or 2 parallel calls, warm-up delay 0) for ``steps`` steps, and
the runs alternate within each repetition:

1. Cost of the feed. The same work three ways, the same step (stoker's KerasTrainer:
   one traced graph per bucket shape plus the update graph, traced before the first
   step):

   trainer     ``python run.py --model tiny``: stoker's own training loop
   feed loop   ``stoker.Feed`` in the user's loop: ``for batch in feed:
               feed.step_done(loss=trainer.step(batch)[0])``
   feed fit    ``model.fit(feed.as_dataset().repeat(), callbacks=[feed.callback()])`` with the
               same model and loss, written as a user writes it for fit (``compute_loss``);
               Keras' own step, one trace

   Figure: steps/s after warm-up and the first SETTLING_STEPS steps by the wall clock, from
   the first of those steps' end to the last one's (metrics.jsonl's ``t``, written by the
   same code in all three when a step is confirmed), so that what each loop does between
   steps counts alike: stoker's trainer's bookkeeping, Keras' loop and callbacks. Shown
   beside it: steps over their summed wait and step time, which leaves out the trainer's
   work between steps but not fit's (fit's steps run from one confirmation to the next).
   Target: feed loop and feed fit >= 0.98 x trainer, by the wall clock.

2. Fit on the feed against fit on tf.data. The same Keras model and ``compute_loss``,
   ``fit`` on ``feed.as_dataset()`` and on benchmarks/alternatives.py's tf.data pipeline
   (``from_tensor_slices(plan).map(read + TF-op log-mel + pad, AUTOTUNE).prefetch``, the
   same planned batches). So that both waits are measured at the same point, the tf.data
   pipeline is read through the same ``from_generator`` shim as the feed's dataset, a
   generator timing each ``next()``: the feed's wait is its metrics.jsonl ``wait_ms``,
   tf.data's is that generator's. Both pipelines start when fit is called (the tf.data
   iterator is made then, so it prefetches while Keras traces, as the feed's producers
   work meanwhile). Figures: the data wait share (wait / (wait + step)) after the first
   batch; the first batch: how long fit's first step waited for it once Keras had traced
   (for the feed its warm-up and its first row's wait); and, for the record, the time from
   the pipeline's creation to the end of fit's first step, tracing included. Target: the
   feed's wait share lower and its first batch earlier.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import stoker
from .common import (CHILD_TIMEOUT_S, DEMO_DATA, QUIET_ENV, SETTLING_STEPS, STOKER, BenchError, ratio,
                                      report, spread, table)
from .alternatives import plan_batches, tf_dataset
from ..consumer.training import tts
from ..consumer.training.trainer import ModelTrainer, make_trainer
from ..shared.config import Config, DataConfig, FeaturesConfig
from ..consumer.index.index import build_index
from ..shared.metrics import wait_share

log = logging.getLogger(__name__)

TARGET_RATIO = 0.98
RESULT_PREFIX = "FEED-RESULT "
BATCH_SIZE = 16
PRODUCERS = 2
KINDS = ("trainer", "feed loop", "feed fit", "tf.data fit")


@dataclass
class FeedPlan:
    steps: int = 80
    repetitions: int = 2
    data: str = str(DEMO_DATA)

    @classmethod
    def quick(cls) -> "FeedPlan":
        return cls(steps=30, repetitions=1)


# ---------------------------------------------------------------- the children
def _options(run_dir: Path, steps: int, data: str) -> dict[str, Any]:
    return {"data": data, "producers": PRODUCERS, "batch_size": BATCH_SIZE, "steps": steps, "run_dir": str(run_dir),
            "model_start_delay": 0.0, "log_level": "WARNING",
            "set": {"trainer.val_every_steps": 10 ** 9, "trainer.checkpoint_every_steps": 0}}


def _fit_model(vocab_size: int, n_mels: int, cfg: Any) -> Any:
    """The tiny model for fit: its output and stoker's loss (consumer/training/tts.objective) through
    ``compute_loss``, Adam, float32 and no XLA as stoker's trainer on the CPU."""
    import keras
    import tensorflow as tf

    net = tts.build_model("tiny", vocab_size, n_mels)
    t = cfg.trainer

    class Fit(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def call(self, batch: Any, training: bool = False) -> Any:
            return self.net(batch, training=training)

        def compute_loss(self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None,
                         training: bool = True) -> Any:
            numerator, valid, _ = tts.objective(tf, tts.outputs_of(y_pred), x, t.l2_weight, t.length_loss_weight)
            return numerator / valid

    model = Fit()
    model.compile(optimizer=keras.optimizers.Adam(t.learning_rate), jit_compile=False)
    return model


def _first_step_callback(started: float, out: dict[str, Any]) -> Any:
    """A Keras callback noting the seconds from ``started`` to the end of the first step."""
    import keras

    class FirstStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            out.setdefault("first_step_s", time.monotonic() - started)

    return FirstStep()


def child_main(kind: str, run_dir: Path, steps: int, data: str) -> dict[str, Any]:
    import tensorflow as tf

    options = _options(run_dir, steps, data)
    out: dict[str, Any] = {}
    if kind == "feed loop":
        feed = stoker.Feed(**options)
        trainer = make_trainer(feed.cfg, "/CPU:0", feed.shapes, steps, feed.vocabulary.size)
        assert isinstance(trainer, ModelTrainer)  # a Keras model
        trainer.prepare(feed.shapes)  # as stoker's trainer does
        with feed:
            for batch in feed:
                feed.step_done(loss=trainer.step(batch)[0])
        return out
    if kind == "feed fit":
        feed = stoker.Feed(**options)
        model = _fit_model(feed.vocabulary.size, feed.n_mels, feed.cfg)
        started = time.monotonic()
        with feed:
            model.fit(feed.as_dataset().repeat(), epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0,
                      callbacks=[feed.callback(), _first_step_callback(started, out)])
        return out
    if kind == "tf.data fit":
        vocab = build_index(DataConfig(path=data, index_cache="off"), FeaturesConfig()).vocabulary
        assert vocab is not None
        model = _fit_model(vocab.size, FeaturesConfig().n_mels, Config())
        started = time.monotonic()
        pipeline = tf_dataset(plan_batches(Path(data), steps), FeaturesConfig(), tf.data.AUTOTUNE).prefetch(
            tf.data.AUTOTUNE)
        running = iter(pipeline)  # started now, so that it works while Keras traces, as the feed's producers do
        rows: list[dict[str, float]] = []
        spec = {k: tf.TensorSpec(v.shape, v.dtype) for k, v in pipeline.element_spec.items()}
        shim = tf.data.Dataset.from_generator(lambda: iter_timed(running, rows), output_signature=spec)
        model.fit(shim, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0,
                  callbacks=[_first_step_callback(started, out)])
        out["rows"] = [{"wait_ms": r["wait_ms"], "step_ms": r["step_ms"]} for r in rows]
        return out
    raise BenchError(f"unknown kind {kind}")


def iter_timed(iterator: Any, rows: list[dict[str, float]]) -> Any:
    """Each element of ``iterator``, noting how long the trainer waited for it and how long it
    held it (until it asked for the next), as the feed's step rows measure them."""
    while True:
        asked = time.monotonic()
        if rows:
            rows[-1]["step_ms"] = (asked - rows[-1]["got"]) * 1e3
        try:
            batch = next(iterator)
        except StopIteration:
            return
        got = time.monotonic()
        rows.append({"wait_ms": (got - asked) * 1e3, "got": got, "step_ms": 0.0})
        yield batch


# ---------------------------------------------------------------- the parent
def _run(kind: str, plan: FeedPlan, work: Path, rep: int) -> dict[str, Any]:
    run_dir = work / f"{kind.replace(' ', '-').replace('.', '')}-{rep}"
    if kind == "trainer":
        argv = [*STOKER, "--model", "tiny", "--steps", str(plan.steps), "--producers",
                str(PRODUCERS), "--batch-size", str(BATCH_SIZE), "--model-start-delay", "0", "--run-dir",
                str(run_dir), "--data", plan.data, "--log-level", "WARNING", "--set", "trainer.val_every_steps=1000000000",
                "--set", "trainer.checkpoint_every_steps=0"]
    else:
        argv = [sys.executable, "-m", "stoker.benchmarks.feed", "--child", kind, "--run-dir", str(run_dir),
                "--steps", str(plan.steps), "--data", plan.data]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                          env={**os.environ, **QUIET_ENV})
    if done.returncode != 0:
        raise BenchError(f"{kind} failed ({done.returncode}): {done.stderr[-2000:]}")
    child = {}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            child = json.loads(line[len(RESULT_PREFIX):])
    if kind == "tf.data fit":
        rows = child["rows"][1:-1]  # after the first batch; the last one's step is cut off by the end
        return {"wait_frac": wait_share(rows), "first_step_s": child["first_step_s"],
                "first_wait_s": child["rows"][0]["wait_ms"] / 1e3}
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    steady = metrics[SETTLING_STEPS:]
    busy_s = sum(r["wait_ms"] + r["step_ms"] for r in steady) / 1e3
    # The same steps by the wall clock, from the first one's end to the last one's: what each
    # loop does between steps (stoker's trainer: its bookkeeping; fit: Keras') counted alike.
    wall_s = steady[-1]["t"] - steady[0]["t"]
    out = {"steps_per_s": len(steady) / busy_s, "wall_steps_per_s": (len(steady) - 1) / wall_s,
           "wait_frac": summary["data_wait_frac"], "steps": summary["steps"]}
    if kind == "feed fit":
        out["wait_frac"] = wait_share(metrics[1:-1])
        out["first_step_s"] = child["first_step_s"]
        out["first_wait_s"] = summary["warmup_s"] + metrics[0]["wait_ms"] / 1e3  # warm-up, then the first batch
    return out


def run(plan: FeedPlan | None = None, log_fn: Any = None) -> dict[str, Any]:
    plan = plan or FeedPlan()
    say = log_fn or log.info
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory(prefix="stoker-bench-feed-") as tmp:
        for rep in range(plan.repetitions):
            kinds = KINDS if rep % 2 == 0 else tuple(reversed(KINDS))
            for kind in kinds:
                started = time.monotonic()
                results[kind].append(_run(kind, plan, Path(tmp), rep))
                say(f"feed: {kind} repetition {rep + 1}: {results[kind][-1]} ({time.monotonic() - started:.0f} s)")
    med = {k: {key: statistics.median(r[key] for r in rows) for key in rows[0] if rows[0][key] is not None}
           for k, rows in results.items()}
    trainer = med["trainer"]["wall_steps_per_s"]
    loop = ratio(med["feed loop"]["wall_steps_per_s"], trainer, target=TARGET_RATIO)
    loop["target_met"] = loop["value"] >= TARGET_RATIO
    fit = ratio(med["feed fit"]["wall_steps_per_s"], trainer, target=TARGET_RATIO)
    fit["target_met"] = fit["value"] >= TARGET_RATIO
    feed_wait, tfdata_wait = med["feed fit"]["wait_frac"], med["tf.data fit"]["wait_frac"]
    feed_first, tfdata_first = med["feed fit"]["first_wait_s"], med["tf.data fit"]["first_wait_s"]
    return {
        "plan": {"steps": plan.steps, "repetitions": plan.repetitions, "batch_size": BATCH_SIZE,
                 "producers": PRODUCERS, "model": "tiny", "device": "CPU"},
        "runs": results,
        "steps_per_s": {k: spread([r["steps_per_s"] for r in results[k]]) for k in KINDS if k != "tf.data fit"},
        "busy_vs_trainer": {k: med[k]["steps_per_s"] / med["trainer"]["steps_per_s"] for k in ("feed loop", "feed fit")},
        "feed_loop_vs_trainer": loop,
        "feed_fit_vs_trainer": fit,
        "fit_wait_frac": {"feed": feed_wait, "tf.data": tfdata_wait, "target_met": feed_wait < tfdata_wait},
        "fit_first_wait_s": {"feed": feed_first, "tf.data": tfdata_first, "target_met": feed_first < tfdata_first},
        "fit_first_step_s": {"feed": med["feed fit"]["first_step_s"], "tf.data": med["tf.data fit"]["first_step_s"]},
        "targets": [
            {"what": "steps/s, tiny model: feed iteration / stoker's trainer", "value": loop["value"], "ratio": loop,
             "limit": TARGET_RATIO, "met": loop["target_met"]},
            {"what": "steps/s, tiny model: as_dataset() + fit / stoker's trainer", "value": fit["value"], "ratio": fit,
             "limit": TARGET_RATIO, "met": fit["target_met"]},
            {"what": "fit's data wait share: feed - tf.data (below 0)", "value": feed_wait - tfdata_wait,
             "limit": 0.0, "met": feed_wait < tfdata_wait},
            {"what": "fit's wait for its first batch, s: feed - tf.data (below 0)", "value": feed_first - tfdata_first,
             "limit": 0.0, "met": feed_first < tfdata_first},
        ],
    }


def render(result: dict[str, Any]) -> str:
    rows = [[k, result["steps_per_s"][k]["median"]] for k in result["steps_per_s"]]
    lines = ["feed: the tiny model's steps/s after warm-up, over summed wait and step time (median of repetitions)",
             table(["run", "steps/s"], rows),
             f"by the wall clock: feed loop / trainer {result['feed_loop_vs_trainer']['value']:.3f}, "
             f"feed fit / trainer {result['feed_fit_vs_trainer']['value']:.3f} (target >= {TARGET_RATIO}); over "
             f"wait + step: feed loop / trainer {result['busy_vs_trainer']['feed loop']:.3f}, "
             f"feed fit / trainer {result['busy_vs_trainer']['feed fit']:.3f}",
             f"fit data wait share: feed {result['fit_wait_frac']['feed']:.4f}, tf.data "
             f"{result['fit_wait_frac']['tf.data']:.4f}; fit's wait for its first batch (after tracing): feed "
             f"{result['fit_first_wait_s']['feed']:.3f} s, tf.data {result['fit_first_wait_s']['tf.data']:.3f} s; "
             f"first step done after: feed {result['fit_first_step_s']['feed']:.2f} s, tf.data "
             f"{result['fit_first_step_s']['tf.data']:.2f} s"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.feed")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", choices=KINDS[1:], help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=str(DEMO_DATA), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = child_main(args.child, args.run_dir, args.steps, args.data)
        sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = run(FeedPlan.quick() if args.quick else FeedPlan())
    return report(render(result), result, args.out)


if __name__ == "__main__":
    sys.exit(main())
