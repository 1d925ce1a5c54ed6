"""The feed's step against the same step with no pipeline, on the CPU, with a step that holds the
interpreter (``python -m stoker.benchmarks.contention``): the target "the trainer process only
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

A third way, ``beside``, splits the feed's cost in two: replay again, while a neighbour process
runs the same pipeline (benchmarks/feedstep.py's feed child: the same clips, batch and
producer, its step asleep for the round's replay step). Every process of the feed way runs,
only not in the step's process, so feed / beside is what sharing the trainer's process costs
(its interpreter, its core) and beside / replay what the pipeline's other processes cost the
machine (cores, caches and memory shared with the step).

    python -m stoker.benchmarks.contention [--rounds 3] [--hold-ops 3000] [--tree DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from .common import BenchError, machine_info, report, table, tree_child, tree_command
from .corpus import make_clips
from .feedstep import STEADY_LINE
from .gpu import CPU_DIM, RESULT_PREFIX, SIZES, summarize_run
from ..shared.proc import PACKAGE_PARENT

CLIPS = 96
BATCH_SIZE = 8
EPOCHS = 3
WARMUP_STEPS = 4
HOLD_OPS = 3000
# The neighbour feed reaches its steady load (producer started, warm-up steps) within this; it ends
# within it once told.
STEADY_TIMEOUT_S = 120.0
# The neighbour's epoch budget: more than any replay lasts (it stops when told).
NEIGHBOUR_EPOCHS = 10_000


def _child(spec: dict[str, Any], tree: Path, log_path: Path) -> dict[str, Any]:
    """One gpu.py child of ``tree``'s stoker; its summary (summarize_run)."""
    return summarize_run(tree_child("stoker.benchmarks.gpu", spec, tree, log_path, RESULT_PREFIX), WARMUP_STEPS)


def _beside(spec: dict[str, Any], hold_ms: float, work: Path) -> dict[str, Any]:
    """Replay while a neighbour feeds batches to a step asleep for ``hold_ms`` (module docstring)."""
    neighbour = {"kind": "feed", "neighbour": True, "framework": "torch", "data": spec["data"],
                 "batch_size": spec["batch_size"], "budget": NEIGHBOUR_EPOCHS, "hold_ms": hold_ms, "steps": 0,
                 "work": str(work / "neighbour")}
    with neighbour_feed(neighbour, work.parent / f"{work.name}.neighbour.log"):
        return _child({**spec, "kind": "replay"}, PACKAGE_PARENT, work.parent / f"{work.name}.log")


@contextlib.contextmanager
def neighbour_feed(spec: dict[str, Any], log_path: Path) -> Iterator[subprocess.Popen]:
    """benchmarks/feedstep.py's feed child as a neighbour (``spec["neighbour"]``), its load steady
    when this enters; told to stop (its stdin closed) on exit, and BenchError if it failed."""
    argv, env = tree_command("stoker.benchmarks.feedstep", spec, PACKAGE_PARENT)
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, env=env)
        try:
            _await_line(proc, STEADY_LINE, STEADY_TIMEOUT_S)
            yield proc
        finally:
            try:
                proc.communicate(timeout=STEADY_TIMEOUT_S)  # closes its stdin: the neighbour stops
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    if proc.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise BenchError(f"the neighbour feed exited with status {proc.returncode}:\n{tail}")


def _await_line(proc: subprocess.Popen, line: str, timeout_s: float) -> None:
    """Read ``proc``'s stdout until ``line``; BenchError if it ends or ``timeout_s`` passes first."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen = b""
    while line.encode() not in seen.splitlines():
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            raise BenchError(f"the neighbour feed did not reach its steady load within {timeout_s:.0f} s")
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            raise BenchError(f"the neighbour feed ended (status {proc.wait()}) before its steady load")
        seen += chunk


def run(rounds: int, hold_ops: int, trees: Sequence[Path], beside: bool,
        log: Callable[[str], None]) -> dict[str, Any]:
    """``rounds`` turns of replay, each tree's feed and (``beside``) replay beside the pipeline;
    per way and shape, each round's median step."""
    work = Path(tempfile.mkdtemp(prefix="stoker-bench-contention-"))
    size = dataclasses.replace(SIZES["small"], dim=CPU_DIM, heads=min(SIZES["small"].heads, 4))
    ways = {"replay": PACKAGE_PARENT, **{f"feed {tree}": tree for tree in trees}}
    steps: dict[str, list[dict[str, float]]] = {way: [] for way in [*ways, *(["beside"] if beside else [])]}
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
                if way == "replay":
                    hold_ms = BATCH_SIZE / summary["samples_per_s"] * 1e3
            if beside:
                summary = _beside({**base, "work": str(work / f"{n}-beside")}, hold_ms, work / f"{n}-beside")
                steps["beside"].append({shape: s["median"] for shape, s in summary["step_ms"].items()})
                log(f"round {n + 1}/{rounds} replay beside the pipeline (its step asleep {hold_ms:.1f} ms): "
                    f"{summary['samples_per_s']:.1f} samples/s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    shapes = sorted(set.intersection(*(set(r) for runs in steps.values() for r in runs)))
    return {"machine": machine_info(), "rounds": rounds, "hold_ops": hold_ops, "clips": CLIPS,
            "batch_size": BATCH_SIZE, "epochs": EPOCHS, "trees": [str(t) for t in trees], "steps_ms": steps,
            "feed_vs_replay": _ratios(steps, "replay", shapes),
            "feed_vs_beside": _ratios({w: r for w, r in steps.items() if w != "replay"}, "beside", shapes)
            if beside else {}}


def _ratios(steps: dict[str, list[dict[str, float]]], base: str, shapes: list[str]) -> dict[str, dict[str, list[float]]]:
    """Per way other than ``base`` and shape: each round's median step over ``base``'s of that round."""
    return {way: {shape: [r[shape] / b[shape] for r, b in zip(runs, steps[base])] for shape in shapes}
            for way, runs in steps.items() if way != base}


def render(result: dict[str, Any]) -> str:
    head = (f"{result['rounds']} rounds, {result['hold_ops']} tiny ops per step, batch {result['batch_size']}, "
            f"{result['clips']} clips x {result['epochs']} epochs, 1 producer")
    parts = [head, _ratio_table(result, "feed_vs_replay", "replay")]
    if result["feed_vs_beside"]:
        parts += ["against replay beside the pipeline (the step's own process only)",
                  _ratio_table(result, "feed_vs_beside", "beside")]
    return "\n\n".join(parts)


def _ratio_table(result: dict[str, Any], key: str, base: str) -> str:
    rows = []
    for way, shapes in result[key].items():
        for shape, values in shapes.items():
            under = statistics.median(r[shape] for r in result["steps_ms"][base])
            over = statistics.median(r[shape] for r in result["steps_ms"][way])
            rows.append([way, shape, f"{under:.1f}", f"{over:.1f}", f"{statistics.median(values):.3f}",
                         f"{min(values):.3f} - {max(values):.3f}"])
    return table(["way", "shape", f"{base} ms", "way ms", f"way/{base} (median)", "spread"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.contention", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hold-ops", type=int, default=HOLD_OPS)
    parser.add_argument("--tree", action="append", type=Path, help="another checkout's feed too (repeatable)")
    parser.add_argument("--beside", action=argparse.BooleanOptionalAction, default=True,
                        help="also replay beside the pipeline in a neighbour process (default: yes)")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    ns = parser.parse_args(argv)
    trees = [*(t.resolve() for t in ns.tree or []), PACKAGE_PARENT]
    try:
        result = run(ns.rounds, ns.hold_ops, trees, ns.beside, lambda text: print(text, file=sys.stderr, flush=True))
    except BenchError as exc:
        print(f"contention benchmark failed: {exc}", file=sys.stderr)
        return 1
    return report(render(result), result, ns.out)


if __name__ == "__main__":
    sys.exit(main())
