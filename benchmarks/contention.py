"""The feed's step against the same step with no pipeline, on the CPU, with a step that holds the
interpreter (``python -m stoker.benchmarks.contention``): issue 33's "the trainer process only
trains", where a GPU host is not at hand.

It runs the GPU benchmark's children (benchmarks/gpu.py: ``replay``, the step on batches held
in memory, and ``feed``, ``stoker.Feed(framework="torch")`` with one producer) in turns,
``--rounds`` times, so that a shared machine's changing load falls on each way alike. The step
is gpu.py's CPU step (the small model at width 32, one torch thread, plus ``--hold-ops`` tiny
torch ops: interpreter-bound as a kernel-launching step is); batches of 8 of short-enough
clips leave the producer idle most of the time and the queue full. Per bucket shape: each
round's median step of each way, and feed / replay of the same round (its median and
spread over the rounds). ``--tree DIR`` (repeatable) also runs the feed of another checkout
of stoker (the directory holding its ``stoker`` package), e.g. the commit before a change,
in the same rounds.

    python -m stoker.benchmarks.contention [--rounds 3] [--hold-ops 3000] [--tree DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from .common import BenchError, machine_info, report, table, tree_child
from .data import make_clips
from .gpu import CPU_DIM, RESULT_PREFIX, SIZES, summarize_run
from ..shared.proc import PACKAGE_PARENT

CLIPS = 96
BATCH_SIZE = 8
EPOCHS = 3
WARMUP_STEPS = 4
HOLD_OPS = 3000


def _child(spec: dict[str, Any], tree: Path, log_path: Path) -> dict[str, Any]:
    """One gpu.py child of ``tree``'s stoker; its summary (summarize_run)."""
    return summarize_run(tree_child("stoker.benchmarks.gpu", spec, tree, log_path, RESULT_PREFIX), WARMUP_STEPS)


def run(rounds: int, hold_ops: int, trees: Sequence[Path], log: Callable[[str], None]) -> dict[str, Any]:
    """``rounds`` turns of replay and each tree's feed; per way and shape, each round's median step."""
    work = Path(tempfile.mkdtemp(prefix="stoker-bench-contention-"))
    size = dataclasses.replace(SIZES["small"], dim=CPU_DIM, heads=min(SIZES["small"].heads, 4))
    ways = {"replay": PACKAGE_PARENT, **{f"feed {tree}": tree for tree in trees}}
    steps: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    try:
        make_clips(work / "clips", CLIPS)
        base = {"data": str(work / "clips"), "batch_size": BATCH_SIZE, "epochs": EPOCHS, "device": "cpu",
                "size": dataclasses.asdict(size), "hold_ops": hold_ops, "name": "small", "producers": 1}
        for n in range(rounds):
            for i, (way, tree) in enumerate(ways.items()):
                spec = {**base, "kind": way.split()[0], "work": str(work / f"{n}-{i}")}
                summary = _child(spec, tree, work / f"{n}-{i}.log")
                steps[way].append({shape: s["median"] for shape, s in summary["step_ms"].items()})
                log(f"round {n + 1}/{rounds} {way}: {summary['samples_per_s']:.1f} samples/s, "
                    f"wait share {summary['wait_share']:.4f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    shapes = sorted(set.intersection(*(set(r) for runs in steps.values() for r in runs)))
    ratios = {way: {shape: [r[shape] / p[shape] for r, p in zip(runs, steps["replay"])] for shape in shapes}
              for way, runs in steps.items() if way != "replay"}
    return {"machine": machine_info(), "rounds": rounds, "hold_ops": hold_ops, "clips": CLIPS,
            "batch_size": BATCH_SIZE, "epochs": EPOCHS, "trees": [str(t) for t in trees], "steps_ms": steps,
            "feed_vs_replay": ratios}


def render(result: dict[str, Any]) -> str:
    rows = []
    for way, shapes in result["feed_vs_replay"].items():
        for shape, values in shapes.items():
            replay = statistics.median(r[shape] for r in result["steps_ms"]["replay"])
            feed = statistics.median(r[shape] for r in result["steps_ms"][way])
            rows.append([way, shape, f"{replay:.1f}", f"{feed:.1f}", f"{statistics.median(values):.3f}",
                         f"{min(values):.3f} - {max(values):.3f}"])
    head = (f"{result['rounds']} rounds, {result['hold_ops']} tiny ops per step, batch {result['batch_size']}, "
            f"{result['clips']} clips x {result['epochs']} epochs, 1 producer")
    return head + "\n\n" + table(["way", "shape", "replay ms", "feed ms", "feed/replay (median)", "spread"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.contention", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hold-ops", type=int, default=HOLD_OPS)
    parser.add_argument("--tree", action="append", type=Path, help="another checkout's feed too (repeatable)")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    ns = parser.parse_args(argv)
    trees = [*(t.resolve() for t in ns.tree or []), PACKAGE_PARENT]
    try:
        result = run(ns.rounds, ns.hold_ops, trees, lambda text: print(text, file=sys.stderr, flush=True))
    except BenchError as exc:
        print(f"contention benchmark failed: {exc}", file=sys.stderr)
        return 1
    return report(render(result), result, ns.out)


if __name__ == "__main__":
    sys.exit(main())
