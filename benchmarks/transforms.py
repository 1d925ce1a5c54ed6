"""The cost of producer transforms (``python -m stoker.benchmarks.transforms``).

One producer's batch maker (producer.batches.BatchMaker, numpy backend, no feature cache)
prepares every batch of the demo data's epoch plan, in this process, two ways:

    plain        the log-mel as defined, nothing else
    transformed  trim (40 dB) + loudness normalisation (-23 LUFS, ITU-R BS.1770) + mel
                 normalisation (a dataset's mean and std)

Each measurement is one pass over the epoch (read, resample, transform, log-mel, pad,
encode the BATCH frames); passes of the two alternate so that both see the same machine,
and the figure per way is the median over repetitions. The target: the transformed
producer costs at most 1.2 x the plain one per clip (reported as transformed / plain).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .common import ratio, report, spread, table
from .corpus import plan_leases
from ..producer.batches import BatchMaker
from ..shared.config import FeaturesConfig, TransformsConfig
from ..shared.dataset import DEMO_DATA_DIR, read_metadata, scan_audio

TARGET_RATIO = 1.2
TRANSFORMS = {"trim_db": 40.0, "normalize": "loudness", "loudness_lufs": -23.0}


@dataclass
class TransformsPlan:
    repetitions: int = 5

    @classmethod
    def quick(cls) -> "TransformsPlan":
        return cls(repetitions=3)


def _maker(transformed: bool) -> tuple[Any, list[dict[str, Any]]]:
    features = FeaturesConfig(backend="numpy")
    entries, _ = read_metadata(DEMO_DATA_DIR)
    files = {k: v.name for k, v in scan_audio(DEMO_DATA_DIR).items()}
    mel_norm = (np.full(features.n_mels, -6.0, np.float32), np.full(features.n_mels, 2.5, np.float32))
    maker = BatchMaker(DEMO_DATA_DIR, {e.id: e.text for e in entries}, features, None, "bench", files=files,
                       transforms=TransformsConfig(**TRANSFORMS) if transformed else None,
                       mel_norm=mel_norm if transformed else None)
    return maker, plan_leases(DEMO_DATA_DIR)


def _pass(maker: Any, leases: list[Any]) -> tuple[float, int]:
    started = time.perf_counter()
    clips = 0
    for lease in leases:
        prepared = maker.make(lease)
        prepared.batch.encode(prepared.arrays)
        clips += len(prepared.batch.ids)
    return time.perf_counter() - started, clips


def run(plan: TransformsPlan, log_fn: Any = None) -> dict[str, Any]:
    say = log_fn or (lambda text: None)
    makers = {name: _maker(name == "transformed") for name in ("plain", "transformed")}
    for maker, leases in makers.values():
        _pass(maker, leases)  # warm: file cache, numpy and scipy set up
    per_clip: dict[str, list[float]] = {"plain": [], "transformed": []}
    clips = 0
    for rep in range(plan.repetitions):
        for name in (("plain", "transformed") if rep % 2 == 0 else ("transformed", "plain")):
            seconds, clips = _pass(*makers[name])
            per_clip[name].append(seconds / clips * 1e3)
    plain, transformed = (statistics.median(per_clip[n]) for n in ("plain", "transformed"))
    cost = ratio(transformed, plain)
    say(f"transforms: {plain:.2f} ms/clip plain, {transformed:.2f} ms/clip with trim + loudness + mel norm "
        f"(x{cost['value']:.3f})")
    return {"clips": clips, "transforms": {**TRANSFORMS, "mel_norm": "dataset"},
            "plain_ms_per_clip": spread(per_clip["plain"]), "transformed_ms_per_clip": spread(per_clip["transformed"]),
            "targets": [{"what": "producer per clip with trim + loudness + mel normalisation / plain",
                         "value": cost["value"], "limit": TARGET_RATIO, "met": cost["value"] <= TARGET_RATIO,
                         "ratio": cost}]}


def render(result: dict[str, Any]) -> str:
    rows = [[name, f"{result[key]['median']:.3f}", f"{result[key]['min']:.3f}", f"{result[key]['max']:.3f}"]
            for name, key in (("plain", "plain_ms_per_clip"), ("trim + loudness + mel norm",
                                                               "transformed_ms_per_clip"))]
    t = result["targets"][0]
    return "\n".join([table(["producer", "ms/clip median", "min", "max"], rows),
                      f"  {t['what']}: {t['value']:.3f} (limit {t['limit']:g}) {'met' if t['met'] else 'NOT met'}"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.transforms")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    result = run(TransformsPlan.quick() if args.quick else TransformsPlan(), log_fn=print)
    return report(render(result), result, args.out)


if __name__ == "__main__":
    sys.exit(main())
