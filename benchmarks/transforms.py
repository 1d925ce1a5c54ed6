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

Then each feature convention (``features.convention``, shared/conventions.py) against stoker's
default mel on the same clips, in the same run, the ways' passes in a rotating order:

    mel       the convention's log-mel of the clips (read and resampled to its rate before
              timing), against the default one's: its features cost per clip (target 1.2 x),
              and per frame (a convention at 24 kHz makes 24000 / 22050 as many frames a clip)
    producer  one producer pass over the epoch with the convention's settings (its transforms
              too: Coqui's trim, MyXTTS's per-clip scaling), against the default settings'

These are timed in CPU seconds of this process (``time.process_time``), which a busy host
inflates far less than the wall clock.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .common import ratio, report, spread, table
from .corpus import plan_leases
from ..producer.audio import load_audio
from ..producer.batches import BatchMaker
from ..producer.features import MelComputer
from ..shared.config import Config, FeaturesConfig, TransformsConfig, from_dict
from ..shared.conventions import CONVENTIONS
from ..shared.dataset.corpus.registry import read_metadata
from ..shared.dataset.files import DEMO_DATA_DIR, scan_audio

TARGET_RATIO = 1.2
TRANSFORMS = {"trim_db": 40.0, "normalize": "loudness", "loudness_lufs": -23.0}


@dataclass
class TransformsPlan:
    repetitions: int = 5
    conventions: tuple[str, ...] = tuple(CONVENTIONS)  # measured against the default mel

    @classmethod
    def quick(cls) -> "TransformsPlan":
        return cls(repetitions=3)


DEFAULT = "default"  # stoker's own mel, the conventions' baseline
# A convention's passes are short (a mel pass of the demo clips: ~0.1 s of CPU): three times the
# plan's repetitions, so that two ways of the same work (hifigan and matcha) agree within a few %.
CONVENTION_REPEATS = 3


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


def _convention_config(name: str) -> Config:
    """The config of convention ``name`` (the default one for DEFAULT), numpy backend."""
    features: dict[str, Any] = {"backend": "numpy"} if name == DEFAULT else {"convention": name, "backend": "numpy"}
    return from_dict({"features": features})


def _convention_ways(cfg: Config) -> tuple[tuple[MelComputer, list[np.ndarray]], tuple[Any, list[Any]]]:
    """A convention's two ways: its mel computer with the demo clips at its rate, and a
    producer's batch maker with its leases (the same clips, planned at its frame rate)."""
    files = {k: v.name for k, v in scan_audio(DEMO_DATA_DIR).items()}
    entries, _ = read_metadata(DEMO_DATA_DIR)
    clips = [load_audio(DEMO_DATA_DIR / files[e.id], cfg.features.sample_rate_hz) for e in entries]
    maker = BatchMaker(DEMO_DATA_DIR, {e.id: e.text for e in entries}, cfg.features, None, "bench", files=files,
                       transforms=cfg.transforms)
    return (MelComputer(cfg.features), clips), (maker, plan_leases(DEMO_DATA_DIR, features=cfg.features))


def _mel_pass(computer: MelComputer, clips: list[np.ndarray]) -> tuple[float, int]:
    started = time.process_time()
    computer(clips)
    return time.process_time() - started, len(clips)


def _cpu_pass(maker: Any, leases: list[Any]) -> tuple[float, int]:
    started = time.process_time()
    _, clips = _pass(maker, leases)
    return time.process_time() - started, clips


def run_conventions(conventions: Sequence[str], repetitions: int, say: Any) -> dict[str, Any]:
    """Each of ``conventions``' features cost per clip against the default mel's, measured
    interleaved (module docstring); a ratio per convention and way, the target on the mel's."""
    names = [DEFAULT, *conventions]
    ways = {name: _convention_ways(_convention_config(name)) for name in names}
    frames = {name: sum(m.shape[0] for m in ways[name][0][0](ways[name][0][1])) for name in names}
    for mel, producer in ways.values():
        _mel_pass(*mel)
        _pass(*producer)  # warm
    per_clip: dict[str, dict[str, list[float]]] = {n: {"mel": [], "producer": []} for n in names}
    for rep in range(repetitions):
        for name in names[rep % len(names):] + names[:rep % len(names)]:  # each rep in another order
            for way, (timed, args) in (("mel", (_mel_pass, ways[name][0])), ("producer", (_cpu_pass, ways[name][1]))):
                seconds, clips = timed(*args)
                per_clip[name][way].append(seconds / clips * 1e3)
    base = {way: statistics.median(per_clip[DEFAULT][way]) for way in ("mel", "producer")}
    out: dict[str, Any] = {"ms_per_clip": {n: {w: spread(v) for w, v in ways_.items()} for n, ways_ in per_clip.items()},
                           "frames": frames, "ratios": {}, "targets": []}
    for name in conventions:
        costs = {w: ratio(statistics.median(per_clip[name][w]), base[w]) for w in ("mel", "producer")}
        costs["mel_per_frame"] = ratio(costs["mel"]["value"], frames[name] / frames[DEFAULT])
        out["ratios"][name] = costs
        value = costs["mel"]["value"]
        out["targets"].append({"what": f"convention {name}: log-mel CPU per clip / the default's", "value": value,
                               "limit": TARGET_RATIO, "met": value <= TARGET_RATIO, "ratio": costs["mel"]})
        say(f"convention {name}: mel x{value:.3f} (x{costs['mel_per_frame']['value']:.3f} per frame), "
            f"producer x{costs['producer']['value']:.3f}")
    return out


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
    conventions = run_conventions(plan.conventions, CONVENTION_REPEATS * plan.repetitions, say)
    return {"clips": clips, "transforms": {**TRANSFORMS, "mel_norm": "dataset"},
            "plain_ms_per_clip": spread(per_clip["plain"]), "transformed_ms_per_clip": spread(per_clip["transformed"]),
            "conventions": conventions,
            "targets": [{"what": "producer per clip with trim + loudness + mel normalisation / plain",
                         "value": cost["value"], "limit": TARGET_RATIO, "met": cost["value"] <= TARGET_RATIO,
                         "ratio": cost}, *conventions["targets"]]}


def render(result: dict[str, Any]) -> str:
    rows = [[name, f"{result[key]['median']:.3f}", f"{result[key]['min']:.3f}", f"{result[key]['max']:.3f}"]
            for name, key in (("plain", "plain_ms_per_clip"), ("trim + loudness + mel norm",
                                                               "transformed_ms_per_clip"))]
    lines = [table(["producer", "ms/clip median", "min", "max"], rows)]
    conventions = result.get("conventions")
    if conventions:
        figures = conventions["ms_per_clip"]
        rows = []
        for name in figures:
            r = conventions["ratios"].get(name)
            rows.append([name, _ms(figures[name]["mel"]), f"{r['mel']['value']:.3f}" if r else "",
                         f"{r['mel_per_frame']['value']:.3f}" if r else "", _ms(figures[name]["producer"]),
                         f"{r['producer']['value']:.3f}" if r else ""])
        lines += ["", "CPU ms per clip, median [min,max]; x the default's",
                  table(["features", "mel", "x default", "per frame", "producer pass", "x default"], rows)]
    lines += [f"  {t['what']}: {t['value']:.3f} (limit {t['limit']:g}) {'met' if t['met'] else 'NOT met'}"
              for t in result["targets"]]
    return "\n".join(lines)


def _ms(figure: dict[str, Any]) -> str:
    return f"{figure['median']:.3f} [{figure['min']:.3f},{figure['max']:.3f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.transforms")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    result = run(TransformsPlan.quick() if args.quick else TransformsPlan(), log_fn=print)
    return report(render(result), result, args.out)


if __name__ == "__main__":
    sys.exit(main())
