"""The input position at scale: its saved size, save and restore time, and exactly once per epoch,
over the plan's arrays of a synthetic index of numeric columns only (no audio, no run).

For each size N (default 1,000,000 and 10,000,000 clips; 100,000,000 fits a machine of 24 GB):

- a SampleTable of N clips with mel lengths of 1 to 20 s and token counts (seeded), in id
  order; no string column (a clip's id is its row number, as the records below name it);
- exactly once (``exactly_once``): for world sizes 1, 2 and 8, every clip of epoch 0 is in
  exactly one batch of exactly one rank's share (EpochPlan.share), counted with numpy
  bincounts; and each global batch is the ranks' shares of it together;
- the position mid-epoch (``mid_epoch``): half the planned batches trained whole and
  PARTIAL_BATCHES more in part (the batches a producer delivered in parts); its state_dict
  packed with msgpack and written (fsynced) as a checkpoint writes position.msgpack, then read
  and restored over the same planner (whose plan of the epoch is kept, as the run's is); the
  restored position's rest (InputPosition.untrained) with the trained rows is every clip of
  the share exactly once, and it saves the same bytes again. REPEATS times each.

Beside them, what a restore also waits for when no plan is kept: the planner made (buckets)
and the epoch planned (its plan and row map). Targets at 10^8 clips: the saved position
<= 64 MB, its restore <= 5 s.

``python -m stoker.benchmarks.position [--sizes 1000000,10000000] [--repeats 3] [--json FILE]``
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np

from .common import BenchError, fmt, run_alone, spread, table
from ..consumer.plan import EpochPlanner
from ..consumer.position import InputPosition
from ..shared.config import BatchingConfig
from ..shared.dataset.table import SampleTable

SIZES = (1_000_000, 10_000_000)
WORLD_SIZES = (1, 2, 8)
REPEATS = 3
# Batches trained in part at the checkpoint, beside the half trained whole.
PARTIAL_BATCHES = 1000
# The batching of the plans: a real corpus's batch and bucket counts (no tar shards).
BATCHING = BatchingConfig(batch_size=32, num_buckets=8, seed=1234, shard_window=0)
# Mel frames a second and tokens a frame of the synthetic clips (a 12.5 ms hop, some 15 characters a second).
FRAMES_PER_S = 80
TOKENS_PER_FRAME = 0.19
TARGET_BYTES = 64 << 20
TARGET_RESTORE_S = 5.0
TARGET_CLIPS = 100_000_000


def synthetic_table(clips: int, seed: int = 0) -> SampleTable:
    """A table of ``clips`` clips of numeric columns only (mel frames, tokens), in id order."""
    rng = np.random.default_rng(seed)
    frames = rng.integers(FRAMES_PER_S, 20 * FRAMES_PER_S + 1, clips, dtype=np.int32)
    tokens = np.maximum(1, frames * TOKENS_PER_FRAME).astype(np.int32)
    return SampleTable({"num_frames": frames, "num_tokens": tokens}, {}, [], [],
                       id_order=np.arange(clips, dtype=np.int64))


def exactly_once(table: SampleTable, world: int, cfg: BatchingConfig = BATCHING, epoch: int = 0) -> dict[str, Any]:
    """How often each clip of ``epoch`` is in the ranks' shares of a world of ``world`` (each
    rank's EpochPlan.share), and whether each global batch is its ranks' shares together."""
    planner = EpochPlanner(table, cfg, workers=world, worker=0)
    plan = planner.plan(epoch)
    rows, batches = [], []
    for rank in range(world):
        place, batch = plan.share(rank)
        rows.append(plan.clips[place])
        batches.append(batch)
    counts = np.bincount(np.concatenate(rows), minlength=len(table))
    per_batch = np.bincount(np.concatenate(batches), minlength=len(plan))
    planned = np.zeros(len(table), bool)
    for bucket in planner.buckets:
        planned[bucket.members] = True
    return {"world": world, "clips": len(table), "planned": int(planned.sum()),
            "once": int(np.count_nonzero(counts[planned] == 1)), "not_once": int(np.count_nonzero(counts[planned] != 1)),
            "unplanned_in_a_share": int(np.count_nonzero(counts[~planned])),
            "batches": len(plan), "batches_whole": bool(np.array_equal(per_batch, np.diff(plan.starts)))}


def train_part(position: InputPosition, epoch: int, rng: np.random.Generator,
               partial: int = PARTIAL_BATCHES) -> np.ndarray:
    """Record half of the epoch's planned batches trained whole and ``partial`` more in part, as
    the trainer records them; the rows trained (this worker's share)."""
    planner = position.planner
    plan = planner.plan(epoch)
    place, batch = plan.share()
    order = rng.permutation(len(plan))
    whole, parts = order[:len(plan) // 2], order[len(plan) // 2:len(plan) // 2 + partial]
    for index in whole.tolist():
        position.record(epoch, (), index=index)
    trained = [plan.clips[place[np.isin(batch, whole)]]]
    for index in parts.tolist():
        mine = plan.clips[place[batch == index]] if planner.workers > 1 else \
            plan.clips[plan.starts[index]:plan.starts[index + 1]]
        if len(mine) < 2:
            continue
        rows = rng.choice(mine, int(rng.integers(1, len(mine))), replace=False)
        position.record(epoch, [str(r) for r in rows], clips=rows.tolist())
        trained.append(rows)
    return np.concatenate(trained)


def once_each(trained: np.ndarray, rest: np.ndarray, share: np.ndarray, clips: int) -> bool:
    """Whether the trained rows and the rest are every row of ``share`` exactly once, and no other."""
    counts = np.bincount(np.concatenate([trained, rest]).astype(np.int64), minlength=clips)
    expected = np.zeros(clips, np.int64)
    expected[share] = 1
    return bool(np.array_equal(counts, expected))


def mid_epoch(planner: EpochPlanner, repeats: int, epoch: int = 0, seed: int = 5) -> dict[str, Any]:
    """The position mid-epoch over ``planner``: saved bytes, save and restore times (module docstring)."""
    position = InputPosition(planner)
    trained = train_part(position, epoch, np.random.default_rng(seed))
    plan = planner.plan(epoch)
    share = plan.clips[plan.share()[0]]
    saves, restores, sizes = [], [], []
    with tempfile.TemporaryDirectory(prefix="stoker-position-") as work:
        path = Path(work) / "position.msgpack"
        for _ in range(repeats):
            began = time.perf_counter()
            packed = msgpack.packb(position.state_dict(), use_bin_type=True)
            with open(path, "wb") as f:
                f.write(packed)
                f.flush()
                os.fsync(f.fileno())
            saves.append(time.perf_counter() - began)
            sizes.append(len(packed))
            began = time.perf_counter()
            again = InputPosition.from_state_dict(msgpack.unpackb(path.read_bytes(), raw=False), planner)
            restores.append(time.perf_counter() - began)
            if not once_each(trained, again.untrained(epoch), share, len(planner.table)):
                raise BenchError(f"the restored position at {len(planner.table):,} clips does not leave exactly "
                                 "the untrained clips, each once")
            if msgpack.packb(again.state_dict(), use_bin_type=True) != packed:
                raise BenchError("the restored position saves other bytes than the one it was restored from")
            if again.trained(epoch) != len(trained):
                raise BenchError(f"the restored position counts {again.trained(epoch)} trained, not {len(trained)}")
    return {"bytes": max(sizes), "batches": len(plan), "trained": len(trained), "save_s": spread(saves),
            "restore_s": spread(restores)}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_size(clips: int, repeats: int, log: Callable[[str], None]) -> dict[str, Any]:
    began = time.perf_counter()
    table = synthetic_table(clips)
    made_s = time.perf_counter() - began
    log(f"{clips:,} clips: table made in {made_s:.1f} s")
    checks = []
    for world in WORLD_SIZES:
        checks.append(exactly_once(table, world))
        log(f"  world {world}: {checks[-1]}")
        if checks[-1]["not_once"] or checks[-1]["unplanned_in_a_share"] or not checks[-1]["batches_whole"]:
            raise BenchError(f"not exactly once at {clips:,} clips, world {world}: {checks[-1]}")
    began = time.perf_counter()
    planner = EpochPlanner(table, BATCHING)
    planner_s = time.perf_counter() - began
    began = time.perf_counter()
    planner.batch_sizes(0)
    plan_s = time.perf_counter() - began
    position = mid_epoch(planner, repeats)
    log(f"  position: {position['bytes']:,} bytes, save {position['save_s']['median']:.3f} s, restore "
        f"{position['restore_s']['median']:.3f} s (planner {planner_s:.1f} s, epoch plan {plan_s:.1f} s)")
    return {"clips": clips, "exactly_once": checks, "planner_s": planner_s, "epoch_plan_s": plan_s, **position,
            "peak_rss_mb": peak_rss_mb(), "command": f"python -m stoker.benchmarks.position --sizes {clips}"}


def run(sizes: tuple[int, ...] = SIZES, repeats: int = REPEATS,
        log: Callable[[str], None] | None = None) -> dict[str, Any]:
    log = log or (lambda text: None)
    rows = [run_size(n, repeats, log) for n in sizes]
    largest = rows[-1] if rows else None
    targets = []
    if largest is not None:
        factor = TARGET_CLIPS / largest["clips"]  # linear in the clips: bit arrays and one pass over them
        for what, value, limit in (("bytes", largest["bytes"], TARGET_BYTES),
                                   ("restore_s", largest["restore_s"]["median"], TARGET_RESTORE_S)):
            targets.append({"what": f"{what} at {TARGET_CLIPS:,} clips"
                                    + ("" if factor == 1 else f" (x{factor:g} from {largest['clips']:,})"),
                            "value": value * factor, "limit": limit, "met": value * factor <= limit})
    return {"sizes": rows, "batching": BATCHING.__dict__, "partial_batches": PARTIAL_BATCHES, "targets": targets}


def render(result: dict[str, Any]) -> str:
    rows = result["sizes"]
    figures = [("position bytes", lambda r: f"{r['bytes']:,}"),
               ("save s (median, min-max)", lambda r: _spread(r["save_s"])),
               ("restore s (median, min-max)", lambda r: _spread(r["restore_s"])),
               ("planner made s", lambda r: fmt(r["planner_s"], 2)),
               ("epoch planned s", lambda r: fmt(r["epoch_plan_s"], 2)),
               ("planned batches", lambda r: f"{r['batches']:,}"),
               ("exactly once (worlds)", lambda r: ", ".join(f"{c['world']}: {c['once']:,}/{c['planned']:,}"
                                                             for c in r["exactly_once"])),
               ("peak RSS MB", lambda r: fmt(r["peak_rss_mb"], 0))]
    body = [[name, *(get(r) for r in rows)] for name, get in figures]
    marks = [f"{'met' if t['met'] else 'NOT met'}: {t['what']} = {fmt(t['value'])} (limit {t['limit']:g})"
             for t in result["targets"]]
    return "\n".join([table(["figure", *(f"{r['clips']:,} clips" for r in rows)], body), *marks,
                      *(f"command: {r['command']}" for r in rows)])


def _spread(s: dict[str, Any]) -> str:
    return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.position")
    parser.add_argument("--sizes", help="clips per size, comma-separated (default 1000000,10000000)")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    sizes = tuple(int(n) for n in args.sizes.split(",") if n) if args.sizes else SIZES
    return run_alone("position", lambda log: run(sizes, args.repeats, log), render, args.json)


if __name__ == "__main__":
    sys.exit(main())
