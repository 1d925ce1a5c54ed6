"""Where a batch is staged, measured on the CPU (``python -m stoker.benchmarks.staging``): a stager
thread beside a step that holds the interpreter, against the thread that asks for a batch, between
steps (consumer/buffer.py, ``BatchQueue.use_staging``, a staging ``on_request`` or not).

On a GPU host PyTorch's staging is a few calls per array (each copy queued on a side stream) and
a launch-bound step is the interpreter launching kernels, each launch letting go of the
interpreter and taking it back. The CPU stands in for both: the step is ``--ops`` tiny torch ops
(each lets go of the interpreter too), the staging ``--calls`` small torch calls per array of a
batch of speech-like arrays. The queue is the feed's (``BatchQueue``, capacity 3), and a batch
arrives at each request (its pump), as the descriptors do, so with the queue full the batch
staged is the one handed out two steps later. The ways, in one process, in turns:

    none      nothing staged: the step alone
    thread    a stager thread stages each batch as it arrives, while the step runs
    request   the asking thread stages each batch that arrived, before it looks for one

Per way and round (``--rounds``, ``--steps`` steps each, the first WARMUP_STEPS left out): the
median step time and the median time between steps (the request); per way the medians over the
rounds, with their ranges; ratios thread / none and request / none of the step.

    python -m stoker.benchmarks.staging [--rounds 6] [--steps 60] [--ops 1500] [--calls 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from .common import machine_info, ratio, report, spread, table
from ..consumer.buffer import BatchQueue, QueuedBatch
from ..consumer.feed.frameworks import FunctionStaging

WAYS = ("none", "thread", "request")
WARMUP_STEPS = 5
CAPACITY = 3
WAIT_S = 10.0
# A batch of 8 clips: 160 tokens, 880 frames of 80 mels (the shapes of benchmarks/contention.py's largest).
BATCH_SHAPES = {"tokens": ((8, 160), np.int32), "token_lengths": ((8,), np.int32), "mel": ((8, 880, 80), np.float32),
                "mel_lengths": ((8,), np.int32), "row_mask": ((8,), np.float32)}


def make_batch() -> dict[str, np.ndarray]:
    return {name: np.zeros(shape, dtype) for name, (shape, dtype) in BATCH_SHAPES.items()}


def make_stage(torch: Any, calls: int, threads: set[str]) -> Callable[[dict[str, np.ndarray]], dict[str, Any]]:
    """``calls`` small torch calls per array, each letting go of the interpreter as a queued copy does;
    the name of each thread it ran in goes into ``threads``."""
    def stage(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        threads.add(threading.current_thread().name)
        out = {}
        for name, array in arrays.items():
            tensor = torch.from_numpy(array)
            for _ in range(calls):  # a few values: the call's own cost, as queueing a copy costs the host
                out[name] = tensor.view(-1)[:16].clone()
        return out
    return stage


def make_step(torch: Any, ops: int) -> Callable[[], None]:
    """``ops`` tiny torch ops: a step whose time is the interpreter's, as a launch-bound one's is."""
    x = torch.ones(8)

    def step() -> None:
        y = x
        for _ in range(ops):
            y = y * 1.0001
    return step


def run_way(way: str, torch: Any, steps: int, ops: int, calls: int) -> dict[str, Any]:
    """``steps`` steps fed through a BatchQueue staged ``way``; the medians after the warm-up, in ms,
    and the threads that staged."""
    queue = BatchQueue(CAPACITY)
    threads: set[str] = set()
    if way != "none":
        staging = FunctionStaging(make_stage(torch, calls, threads), "bench")
        staging.on_request = way == "request"
        queue.use_staging(staging)
    lease = iter(range(1 << 30))
    slots = [make_batch() for _ in range(2 * CAPACITY + 1)]  # arrays made once, as the feed's slots are

    def pump(_wait_s: float) -> None:  # a batch arrives at each request while there is room
        if len(queue) < CAPACITY:
            n = next(lease)
            queue.put(QueuedBatch(lease=n, epoch=0, index=n, ids=[], arrays=slots[n % len(slots)], producer="bench"))

    queue.pump = pump
    step = make_step(torch, ops)
    step_s, between_s = [], []
    try:
        for _ in range(steps):
            asked = time.perf_counter()
            if queue.get(WAIT_S) is None:
                raise RuntimeError(f"no batch within {WAIT_S} s ({way})")
            begun = time.perf_counter()
            step()
            step_s.append(time.perf_counter() - begun)
            between_s.append(begun - asked)
    finally:
        queue.close()
    return {"step_ms": statistics.median(step_s[WARMUP_STEPS:]) * 1e3,
            "between_ms": statistics.median(between_s[WARMUP_STEPS:]) * 1e3, "staged_in": sorted(threads)}


def run(rounds: int, steps: int, ops: int, calls: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)  # the step is one interpreter's work
    per_round: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    for n in range(rounds):
        for way in WAYS[n % len(WAYS):] + WAYS[:n % len(WAYS)]:  # each way first in a round in turn
            per_round[way].append(run_way(way, torch, steps, ops, calls))
    ways = {way: {figure: spread([r[figure] for r in rows]) for figure in ("step_ms", "between_ms")}
            for way, rows in per_round.items()}
    none = ways["none"]["step_ms"]["median"]
    return {"machine": machine_info(), "torch": torch.__version__,
            "plan": {"rounds": rounds, "steps": steps, "ops": ops, "calls": calls, "capacity": CAPACITY},
            "ways": ways, "rounds": per_round,
            "step_vs_none": {way: ratio(ways[way]["step_ms"]["median"], none) for way in ("thread", "request")}}


def render(result: dict[str, Any]) -> str:
    rows = []
    for way, figures in result["ways"].items():
        step, between = figures["step_ms"], figures["between_ms"]
        vs = result["step_vs_none"].get(way)
        rows.append([way, f"{step['median']:.2f} ({step['min']:.2f}-{step['max']:.2f})",
                     f"{between['median']:.3f} ({between['min']:.3f}-{between['max']:.3f})",
                     "-" if vs is None else f"{vs['value']:.3f}"])
    plan = result["plan"]
    return (f"where a batch is staged: {plan['rounds']} rounds of {plan['steps']} steps, a step of {plan['ops']} torch "
            f"ops, {plan['calls']} calls per array to stage (median over the rounds, their range)\n"
            + table(["way", "step ms", "between steps ms", "step / none"], rows))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.staging", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ops", type=int, default=1500, help="tiny torch ops a step")
    parser.add_argument("--calls", type=int, default=2, help="torch calls per array to stage a batch")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = run(args.rounds, args.steps, args.ops, args.calls)
    return report(render(result), result, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
