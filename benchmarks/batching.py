"""Frame-budget batches against fixed-row batches (``python -m stoker.benchmarks.batching``).

The data: a generated LJSpeech-like corpus of 13,100 clip lengths, 1 to 10 s (a Beta(2.6,
1.6) draw on that range, mean 6.6 s, more long clips than short ones, as LJSpeech's
histogram), about 15 characters per second of speech (+-15%), at the default features
(22,050 Hz, hop 256: 86 frames per second). No audio is read: the plan is a pure function of
the lengths.

Two figures, both measured in this run:

1. Padding. The epoch plan of today's default (4 equal-count buckets of 16 rows) and of a
   frame budget (``--max-frames N`` with 8 buckets, N = the default plan's largest batch,
   16 rows x its longest T, so both need the same peak memory): ``frames_useful_frac``
   (valid frames / frames computed), the number of shapes, the spread of the frames
   computed per batch (rows x T) and of the valid frames per batch (all but the partial
   batch of each bucket must lie within +-10% of N).
   Targets: frames_useful_frac >= 0.97 with at most 8 shapes.
   Against the plan before leftover clips moved up (each bucket's last batch filled with
   empty rows, computed here from the same buckets before the move,
   consumer/plan.group_buckets): frames_useful_frac of the plan of only real rows, and of
   the same plan with ``batching.fixed_rows`` (its one short batch padded), each no worse
   than that plan's by more than 0.01.
2. Throughput at the same memory budget. The tiny model trains on the CPU on a batch of
   each bucket shape of both plans (after tracing and warm-up steps, the median of timed
   steps per shape); an epoch's time is the sum over its planned batches of their shape's
   step time, so samples/s = clips / epoch time for each plan. Reported as the ratio
   frame budget / fixed rows (expected above 1: fewer padded frames computed).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from .common import ratio, report, spread, table
from .trainer import TOKEN_IDS, _batch
from ..consumer.plan import EpochPlanner, group_buckets
from ..consumer.training.trainer import KerasTrainer
from ..shared import config as config_mod
from ..shared.config import BatchingConfig, FeaturesConfig
from ..shared.dataset.types import Sample

log = logging.getLogger(__name__)

LJSPEECH_CLIPS = 13_100
MIN_S, MAX_S = 1.0, 10.0
# Beta shape of the durations on [MIN_S, MAX_S]: mean 0.62 of the range (6.6 s, LJSpeech's
# mean), skewed towards long clips as LJSpeech's histogram is.
BETA_A, BETA_B = 2.6, 1.6
CHARS_PER_S = 15.0  # LJSpeech: about 100 characters in 6.6 s
CHARS_JITTER = 0.15
FIXED_BUCKETS, FIXED_ROWS = 4, 16  # today's default (batching.num_buckets, batch_size)
BUDGET_BUCKETS = 8  # the target's "at most 8 shapes"
TARGET_USEFUL_FRAC = 0.97
EMPTY_ROWS_TOLERANCE = 0.01  # the plan of real rows may compute at most this fraction fewer useful frames
TARGET_SHAPES = 8
FRAMES_TOLERANCE = 0.10  # frames per batch within +-10% of the budget


@dataclass
class BatchingPlan:
    clips: int = LJSPEECH_CLIPS
    seed: int = 0
    steps_per_shape: int = 5  # timed steps per bucket shape (after warm-up)
    warmup_steps: int = 2
    throughput: bool = True  # the tiny-model measurement (TensorFlow; the padding figures need none)

    @classmethod
    def quick(cls) -> "BatchingPlan":
        # The padding figures only: tracing the tiny model for 12 shapes would take --quick past its minutes.
        return cls(throughput=False)


def ljspeech_like(clips: int = LJSPEECH_CLIPS, seed: int = 0) -> list[Any]:
    """Samples (shared/dataset.Sample) with LJSpeech-like lengths and no audio."""
    f = FeaturesConfig()
    rng = np.random.default_rng(seed)
    seconds = MIN_S + (MAX_S - MIN_S) * rng.beta(BETA_A, BETA_B, size=clips)
    chars = np.maximum(2, np.round(seconds * CHARS_PER_S * (1 + CHARS_JITTER * rng.uniform(-1, 1, clips))))
    samples = []
    for n, (s, c) in enumerate(zip(seconds, chars)):
        frames = 1 + int(s * f.sample_rate_hz) // f.hop_length
        samples.append(Sample(f"LJ{n:05d}", "", int(c) + 1, frames, float(s)))
    return samples


def plan_figures(samples: Sequence[Any], cfg: Any) -> dict[str, Any]:
    """Padding and frames per batch of one epoch's plan (epoch 0)."""
    planner = EpochPlanner(samples, cfg)
    frames = {s.id: s.num_frames for s in samples}
    plan = planner.plan(0)
    valid_per_batch = [sum(frames[i] for i in b.ids) for b in plan]
    computed = [b.rows * b.shape[1] for b in plan]
    # Each bucket's partial batch (the one with fewest clips) is left out of the +-10% check.
    partial = {}
    for n, b in enumerate(plan):
        if b.bucket not in partial or len(b.ids) < len(plan[partial[b.bucket]].ids):
            partial[b.bucket] = n
    budget = cfg.max_frames

    def within(values: list[int]) -> float | None:
        full = [v for n, v in enumerate(values) if n not in set(partial.values())]
        return (sum(1 for v in full if abs(v - budget) <= FRAMES_TOLERANCE * budget) / len(full)
                if budget and full else None)

    valid = sum(valid_per_batch)
    fixed_rows = EpochPlanner(samples, replace(cfg, fixed_rows=True)).plan(0)
    return {"shapes": [list(s) for s in planner.shapes], "batches": len(plan),
            "frames_useful_frac": valid / sum(computed), "frames_valid": valid, "frames_computed": sum(computed),
            "frames_useful_frac_fixed_rows": valid / sum(b.rows * b.shape[1] for b in fixed_rows),
            "frames_useful_frac_empty_rows": empty_rows_useful_frac(samples, cfg),
            "frames_per_batch": spread(computed), "valid_frames_per_batch": spread(valid_per_batch),
            "within_10pct_frac": within(computed), "valid_within_10pct_frac": within(valid_per_batch),
            "plan": [(b.rows, *b.shape) for b in plan]}


def empty_rows_useful_frac(samples: Sequence[Any], cfg: Any) -> float:
    """frames_useful_frac of the plan before leftover clips moved up: the buckets by length
    alone, each one's last batch filled with empty rows (all ``rows`` x T computed)."""
    frames = {s.id: s.num_frames for s in samples}
    buckets = group_buckets(samples, cfg)
    computed = sum(-(-len(b.sample_ids) // b.rows) * b.rows * b.max_frames for b in buckets)
    return sum(frames.values()) / computed


def _step_times(shapes: Sequence[tuple[int, int, int]], plan: BatchingPlan) -> dict[tuple[int, int, int], float]:
    """Median seconds of one tiny-model training step of each shape (B, L, T), on the CPU."""
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

    cfg = config_mod.load(None, {})
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, model="tiny"))
    trainer = KerasTrainer(cfg, "/CPU:0", list(shapes), total_batches=None, vocab_size=TOKEN_IDS)
    trainer.prepare(list(shapes))
    times = {}
    for n, shape in enumerate(shapes):
        staged = trainer.stage(_batch(*shape, cfg.features.n_mels, seed=n))
        for _ in range(plan.warmup_steps):
            trainer.resolve([trainer.step(staged)])
        measured = []
        for _ in range(plan.steps_per_shape):
            t0 = time.perf_counter()
            trainer.resolve([trainer.step(staged)])
            measured.append(time.perf_counter() - t0)
        times[shape] = statistics.median(measured)
        log.info("step of shape %s: %.1f ms", shape, times[shape] * 1e3)
    return times


def run(plan: BatchingPlan, log_fn: Any = None) -> dict[str, Any]:
    say = log_fn or log.info
    samples = ljspeech_like(plan.clips, plan.seed)
    fixed_cfg = BatchingConfig(batch_size=FIXED_ROWS, num_buckets=FIXED_BUCKETS)
    fixed = plan_figures(samples, fixed_cfg)
    budget = max(b * t for b, _, t in fixed["plan"])
    budget_cfg = BatchingConfig(num_buckets=BUDGET_BUCKETS, max_frames=budget)
    framed = plan_figures(samples, budget_cfg)
    say(f"batching: fixed rows {fixed['frames_useful_frac']:.4f} useful in {len(fixed['shapes'])} shapes; "
        f"frame budget {budget}: {framed['frames_useful_frac']:.4f} in {len(framed['shapes'])} shapes")
    for name, r in (("fixed rows", fixed), ("frame budget", framed)):
        say(f"batching: {name}: useful frac {r['frames_useful_frac']:.4f} (only real rows), "
            f"{r['frames_useful_frac_fixed_rows']:.4f} (batching.fixed_rows), "
            f"{r['frames_useful_frac_empty_rows']:.4f} (the plan of empty rows)")
    out: dict[str, Any] = {
        "clips": plan.clips, "budget_frames": budget, "fixed": fixed, "frame_budget": framed,
        "targets": [
            {"what": f"frames_useful_frac with a frame budget, <= {TARGET_SHAPES} shapes",
             "value": framed["frames_useful_frac"], "limit": TARGET_USEFUL_FRAC,
             "met": framed["frames_useful_frac"] >= TARGET_USEFUL_FRAC and len(framed["shapes"]) <= TARGET_SHAPES,
             "ratio": ratio(framed["frames_valid"], framed["frames_computed"])},
            {"what": "batches (all but each bucket's partial one) computing frames within +-10% of the budget",
             "value": framed["within_10pct_frac"], "limit": 1.0, "met": framed["within_10pct_frac"] == 1.0},
        ],
    }
    for name, r in (("fixed rows", fixed), ("frame budget", framed)):
        limit = r["frames_useful_frac_empty_rows"] - EMPTY_ROWS_TOLERANCE
        for mode in ("", "_fixed_rows"):
            value = r[f"frames_useful_frac{mode}"]
            out["targets"].append({
                "what": f"{name}: frames_useful_frac{' with batching.fixed_rows' if mode else ''}, no worse than "
                        f"the plan of empty rows ({r['frames_useful_frac_empty_rows']:.4f}) by {EMPTY_ROWS_TOLERANCE}",
                "value": value, "limit": limit, "met": value >= limit})
    if plan.throughput:
        shapes = sorted({tuple(s) for s in fixed["shapes"]} | {tuple(s) for s in framed["shapes"]})
        times = _step_times(shapes, plan)
        fixed_s = sum(times[tuple(s)] for s in fixed["plan"])
        framed_s = sum(times[tuple(s)] for s in framed["plan"])
        speed = ratio(plan.clips / framed_s, plan.clips / fixed_s)
        out["step_ms"] = {f"{b}x{l}x{t}": round(v * 1e3, 2) for (b, l, t), v in times.items()}
        out["samples_per_s"] = {"fixed": plan.clips / fixed_s, "frame_budget": plan.clips / framed_s,
                                "ratio": speed}
        out["targets"].append({"what": "samples/s, frame budget / fixed rows, same memory (tiny model, CPU)",
                               "value": speed["value"], "limit": 1.0, "met": speed["value"] > 1.0, "ratio": speed})
        say(f"batching: samples/s frame budget {plan.clips / framed_s:.1f} vs fixed {plan.clips / fixed_s:.1f} "
            f"(x{speed['value']:.3f})")
    for item in (fixed, framed):
        del item["plan"]
    return out


def render(result: dict[str, Any]) -> str:
    rows = []
    for name, key in (("fixed rows (4 x 16)", "fixed"), (f"frame budget {result['budget_frames']}", "frame_budget")):
        r = result[key]
        fpb = r["frames_per_batch"]
        sps = (result.get("samples_per_s") or {}).get(key)
        rows.append([name, len(r["shapes"]), r["batches"], f"{r['frames_useful_frac']:.4f}",
                     f"{r['frames_useful_frac_fixed_rows']:.4f}", f"{r['frames_useful_frac_empty_rows']:.4f}",
                     f"{fpb['min']:.0f} / {fpb['median']:.0f} / {fpb['max']:.0f}",
                     f"{sps:.1f}" if sps else "-"])
    text = table(["plan", "shapes", "batches", "useful frac", "fixed_rows", "empty-rows plan",
                  "frames/batch min/med/max", "samples/s"], rows)
    lines = [text]
    for t in result["targets"]:
        lines.append(f"  {t['what']}: {t['value']:.4f} (limit {t['limit']:g}) {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.batching")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-throughput", action="store_true", help="padding figures only (no TensorFlow)")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    plan = BatchingPlan.quick() if args.quick else BatchingPlan()
    plan.throughput = not args.no_throughput
    result = run(plan)
    return report(render(result), result, args.out)


if __name__ == "__main__":
    sys.exit(main())
