"""The feed's own work per step in the trainer process, by CPU time (``python -m stoker.benchmarks.feedstep``):
the target "the trainer process only trains", measured where wall-clock step times are too noisy.

Two figures, each way in a process of its own:

feed      ``stoker.Feed(framework=F)`` with one producer on generated clips (benchmarks/data.py):
          the first ``--steps`` steps of a run of ``--budget`` epochs. The loop's "step" sleeps
          ``--hold-ms`` (no CPU, so the producer keeps the queue full and the figure is the
          feed's alone). Per step, the loop thread's
          CPU time (``time.thread_time``) inside ``next(feed)`` (hand-out, the confirmation of
          the step before, a flush every trainer.log_every_steps) and ``feed.step_done``; its
          mean over the steps after WARMUP_STEPS (flushes included) and median (without them),
          in microseconds; beside them the CPU of the process's other threads per step (ZeroMQ's
          I/O thread, a stager; before the loop's thread received, a receiver thread), waiting
          excluded throughout (a blocked thread uses none).
position  the input position's bookkeeping alone, in one process: every planned batch of the
          epochs of ``--steps`` steps recorded as the feed records it (handed out, then confirmed: ``InputPosition.record``
          twice, each batch whole as the coordinator process says where the checkout knows
          ``EpochPlanner.is_whole``, and ``update_complete`` after each, for a run of ``--budget``
          epochs), CPU microseconds per batch.

A feed child whose spec says ``neighbour`` runs until its stdin closes and prints STEADY_LINE
once past its warm-up steps: the pipeline's load beside another process's step
(benchmarks/contention.py).

Each runs ``--repeats`` times per framework and batch size, in turns; the table gives the
median and range over the repeats. ``--tree DIR`` (repeatable) also runs another checkout of
stoker (the directory holding its ``stoker`` package, which must hold this module too: the
commit that added it or a later one) in the same turns.

    python -m stoker.benchmarks.feedstep [--framework torch --framework numpy] [--batch-size 8 --batch-size 32]
        [--repeats 3] [--steps 80] [--clips 128] [--hold-ms 30] [--budget 1000] [--tree DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import select
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import stoker
from .common import BenchError, machine_info, report, table, tree_child
from .corpus import make_clips
from ..consumer.plan import EpochPlanner
from ..consumer.position import InputPosition
from ..shared import config as config_mod
from ..consumer.index.index import build_index
from ..shared.proc import PACKAGE_PARENT

RESULT_PREFIX = "FEEDSTEP-RESULT "
# A neighbour (spec "neighbour") says this once past its warm-up steps: its load is steady.
STEADY_LINE = "FEEDSTEP-STEADY"
FRAMEWORKS = ("torch", "numpy")
BATCH_SIZES = (8, 32)
CLIPS = 128
STEPS = 80
HOLD_MS = 30.0
# The epoch budget of the run whose position the position figure keeps (a TTS run trains for hundreds).
BUDGET = 1000
REPEATS = 3
# Steps left out at the start of a feed run: the first batches, staging's first calls, imports.
WARMUP_STEPS = 5


# ---------------------------------------------------------------- the children
def _feed_child(spec: dict[str, Any]) -> dict[str, Any]:
    work = Path(spec["work"])
    feed = stoker.Feed(framework=spec["framework"], data=spec["data"], producers=1, batch_size=spec["batch_size"],
                       epochs=spec["budget"], run_dir=str(work / "run"), model_start_delay=0.0, log_level="WARNING",
                       set={"trainer.val_clips": 0, "data.index_cache": "off", "trainer.checkpoint_every_steps": 0})
    hold = spec["hold_ms"] / 1e3
    clock = time.thread_time
    steps: list[list[float]] = []  # per step: CPU in next(), CPU in step_done(), wall in next()
    marks: list[tuple[float, float]] = []  # (process CPU, loop thread CPU) at each step's start
    neighbour = spec.get("neighbour", False)
    with feed:
        batches = iter(feed)
        while not (_told_to_stop() if neighbour else len(steps) >= spec["steps"]):
            marks.append((time.process_time(), clock()))
            wall, cpu = time.perf_counter(), clock()
            try:
                next(batches)
            except StopIteration:
                break
            taken, wall = clock() - cpu, time.perf_counter() - wall
            time.sleep(hold)
            cpu = clock()
            feed.step_done(loss=0.0)
            steps.append([taken, clock() - cpu, wall])
            if neighbour and len(steps) == WARMUP_STEPS:
                print(STEADY_LINE, flush=True)
    return {"steps": steps, "marks": marks}


def _told_to_stop() -> bool:
    """A neighbour runs until its parent closes its stdin (readable: at its end)."""
    return bool(select.select([sys.stdin], [], [], 0)[0])


def _position_child(spec: dict[str, Any]) -> dict[str, Any]:
    cfg = config_mod.load(None, {"data.path": spec["data"], "batching.batch_size": spec["batch_size"],
                                 "trainer.val_clips": 0, "data.index_cache": "off"})
    index = build_index(cfg.data, cfg.features, cfg.text)
    planner = EpochPlanner(index.samples, cfg.batching)
    batches = []
    for epoch in range(spec["epochs"]):
        for b in planner.plan(epoch):
            clips = list(map(int, b.clips))
            whole = b.index if hasattr(planner, "is_whole") and planner.is_whole(epoch, b.index, clips) else None
            batches.append((epoch, list(b.ids), clips, {} if whole is None else {"whole": whole}))
    rejections = {"rejected_epochs": ()} if hasattr(planner, "is_whole") else {}  # the coordinator's: none
    per_batch = []
    for _ in range(spec["passes"]):
        handed, trained = InputPosition(planner), InputPosition(planner)
        cpu = time.process_time()
        for epoch, ids, clips, whole in batches:
            handed.record(epoch, ids, None, clips, **whole)
            handed.update_complete(spec["budget"], lambda e: 0, **rejections)
            trained.record(epoch, ids, None, clips, **whole)
            trained.update_complete(spec["budget"], lambda e: 0, **rejections)
        per_batch.append((time.process_time() - cpu) / len(batches))
        if len(trained.complete) != spec["epochs"]:
            raise BenchError(f"{len(trained.complete)} of {spec['epochs']} epochs complete after the plan")
    return {"per_batch_s": per_batch, "batches": len(batches)}


def child_main(spec: dict[str, Any]) -> dict[str, Any]:
    return _feed_child(spec) if spec["kind"] == "feed" else _position_child(spec)


def summarize_feed(raw: dict[str, Any]) -> dict[str, Any]:
    """µs of CPU per step after WARMUP_STEPS: the loop thread's in the feed (mean, median) and
    the other threads'; the wait share of next()."""
    steps, marks = raw["steps"][WARMUP_STEPS:], raw["marks"][WARMUP_STEPS:]
    if len(steps) < 2:
        raise BenchError(f"{len(raw['steps'])} steps: too few after {WARMUP_STEPS} warm-up steps")
    feed = [(taken + done) * 1e6 for taken, done, _ in steps]
    process = marks[-1][0] - marks[0][0]
    loop = marks[-1][1] - marks[0][1]
    spans = len(marks) - 1
    return {"steps": len(steps), "feed_us_mean": statistics.fmean(feed), "feed_us_median": statistics.median(feed),
            "next_us_median": statistics.median(s[0] * 1e6 for s in steps),
            "step_done_us_median": statistics.median(s[1] * 1e6 for s in steps),
            "other_threads_us": (process - loop) / spans * 1e6,
            "wait_ms_median": statistics.median(s[2] * 1e3 for s in steps)}


# ---------------------------------------------------------------- the parent
def _child(spec: dict[str, Any], tree: Path, log_path: Path) -> dict[str, Any]:
    return tree_child("stoker.benchmarks.feedstep", spec, tree, log_path, RESULT_PREFIX)


def run(frameworks: Sequence[str], batch_sizes: Sequence[int], repeats: int, steps: int, clips: int,
        hold_ms: float, budget: int, trees: Sequence[Path], log: Callable[[str], None]) -> dict[str, Any]:
    """``repeats`` turns of every tree's feed (per framework and batch size) and position figure."""
    work = Path(tempfile.mkdtemp(prefix="stoker-bench-feedstep-"))
    feeds: dict[str, list[dict[str, Any]]] = {}
    positions: dict[str, list[float]] = {}
    try:
        make_clips(work / "clips", clips)
        base = {"data": str(work / "clips"), "hold_ms": hold_ms}
        n = 0
        for turn in range(repeats):
            for tree in trees:
                for size in batch_sizes:
                    n += 1
                    epochs = -(-steps * size // clips)
                    spec = {**base, "kind": "position", "batch_size": size, "epochs": epochs, "passes": 5,
                            "budget": budget}
                    raw = _child(spec, tree, work / f"{n}.log")
                    positions.setdefault(f"{tree}|{size}", []).append(statistics.median(raw["per_batch_s"]) * 1e6)
                    for framework in frameworks:
                        n += 1
                        spec = {**base, "kind": "feed", "framework": framework, "batch_size": size,
                                "steps": steps, "budget": budget, "work": str(work / str(n))}
                        figures = summarize_feed(_child(spec, tree, work / f"{n}.log"))
                        feeds.setdefault(f"{tree}|{framework}|{size}", []).append(figures)
                        log(f"turn {turn + 1}/{repeats} {tree} {framework} batch {size}: "
                            f"{figures['feed_us_mean']:.0f} µs of CPU a step in the feed (mean), "
                            f"{figures['other_threads_us']:.0f} µs in other threads, "
                            f"next() {figures['wait_ms_median']:.2f} ms median")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"machine": machine_info(), "repeats": repeats, "steps": steps, "clips": clips, "hold_ms": hold_ms,
            "budget": budget,
            "warmup_steps": WARMUP_STEPS, "trees": [str(t) for t in trees], "feed": feeds, "position": positions}


def _mid(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def render(result: dict[str, Any]) -> str:
    rows = []
    for key, runs in result["feed"].items():
        tree, framework, size = key.split("|")
        rows.append([tree, framework, size, runs[0]["steps"], _mid([r["feed_us_mean"] for r in runs]),
                     _mid([r["feed_us_median"] for r in runs]), _mid([r["next_us_median"] for r in runs]),
                     _mid([r["step_done_us_median"] for r in runs]), _mid([r["other_threads_us"] for r in runs])])
    head = (f"{result['repeats']} repeats, {result['clips']} clips, the first {result['steps']} steps of a run of "
            f"{result['budget']} epochs, 1 producer, a step of {result['hold_ms']:g} ms asleep; CPU µs per step after "
            f"{result['warmup_steps']}, median (range) over the repeats")
    position = [[*key.split("|"), _mid(values)] for key, values in result["position"].items()]
    return "\n\n".join([head, table(["tree", "framework", "batch", "steps", "feed mean", "feed median", "next()",
                                     "step_done()", "other threads"], rows),
                        f"the input position alone (a run of {result['budget']} epochs): recorded handed out and "
                        f"confirmed, CPU µs per planned batch",
                        table(["tree", "batch", "µs per batch"], position)])


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["child"]:
        print(RESULT_PREFIX + json.dumps(child_main(json.loads(args[1]))), flush=True)
        return 0
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.feedstep", description=__doc__.splitlines()[0])
    parser.add_argument("--framework", action="append", choices=FRAMEWORKS)
    parser.add_argument("--batch-size", type=int, action="append")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--clips", type=int, default=CLIPS)
    parser.add_argument("--hold-ms", type=float, default=HOLD_MS)
    parser.add_argument("--budget", type=int, default=BUDGET, help="the position figure's run's epochs")
    parser.add_argument("--tree", action="append", type=Path, help="another checkout's feed too (repeatable)")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    ns = parser.parse_args(args)
    trees = [*(t.resolve() for t in ns.tree or []), PACKAGE_PARENT]
    try:
        result = run(ns.framework or FRAMEWORKS, ns.batch_size or BATCH_SIZES, ns.repeats, ns.steps, ns.clips,
                     ns.hold_ms, ns.budget, trees, lambda text: print(text, file=sys.stderr, flush=True))
    except BenchError as exc:
        print(f"feedstep benchmark failed: {exc}", file=sys.stderr)
        return 1
    return report(render(result), result, ns.out)


if __name__ == "__main__":
    sys.exit(main())
