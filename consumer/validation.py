"""Held-out validation clips: which ones, and their batches.

``trainer.val_clips`` clips (at most a tenth of the dataset, so a small dataset is not
emptied) are held out of every epoch plan when the trainer has a loss to validate. The
choice is a pure function of the sample ids and ``batching.seed`` (a hash order), so a
resumed run, or another host, holds out the same clips.

The consumer prepares their batches itself, once, at start, with the producers' own
code (``producer.worker.BatchMaker``: same reader, features and collation) on the CPU,
so the validation loss is measured on exactly what training batches look like. Shapes
(dimension legend in producer/collate.py): B = up to ``batching.batch_size`` rows, L and
T the longest held-out clip rounded up to ``tokens_multiple`` / ``frames_multiple``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from consumer.plan import round_up
from shared import wire
from shared.config import Config
from shared.dataset import Sample

log = logging.getLogger(__name__)

# Hold out at most this share of the clips, so that a tiny dataset keeps its training data.
MAX_VAL_SHARE = 0.1


def split(samples: Sequence[Sample], count: int, seed: int) -> tuple[list[Sample], list[Sample]]:
    """(training samples, held-out samples): ``count`` clips, at most a tenth, by hash order."""
    n = min(count, int(len(samples) * MAX_VAL_SHARE))
    if n <= 0:
        return list(samples), []

    def rank(s: Sample) -> bytes:
        return hashlib.blake2b(f"{seed}|{s.id}".encode(), digest_size=8).digest()

    held = {s.id for s in sorted(samples, key=rank)[:n]}
    return [s for s in samples if s.id not in held], [s for s in samples if s.id in held]


def make_batches(samples: Sequence[Sample], root: Path, cfg: Config) -> list[dict[str, np.ndarray]]:
    """The held-out clips as padded batches; clips that cannot be read here are left out (logged)."""
    if not samples:
        return []
    from producer.worker import BatchMaker

    # The numpy backend (same definition as the TF one, within 1e-4): on the CPU, leaving the
    # model GPU to the trainer.
    features = dataclasses.replace(cfg.features, backend="numpy")
    b = cfg.batching
    maker = BatchMaker(root, {s.id: s.text for s in samples}, features, b.batch_size, None, "validation",
                       files={s.id: s.audio for s in samples if s.audio})
    batches = []
    for start in range(0, len(samples), b.batch_size):
        chunk = samples[start:start + b.batch_size]
        shape = (round_up(max(s.num_tokens for s in chunk), b.tokens_multiple),
                 round_up(max(s.num_frames for s in chunk), b.frames_multiple))
        lease = {"lease": 0, "epoch": -1, "index": start // b.batch_size, "ids": [s.id for s in chunk],
                 "shape": shape}
        msg = wire.decode(maker.make(lease))
        for problem in msg["rejected"] + msg["missed"]:
            log.warning("validation clip %s left out: %s", problem["id"], problem["reason"])
        if msg["ids"]:
            rows = len(msg["ids"])
            # Keep only the filled rows: B is the number of clips, the shape stays fixed per batch.
            batches.append({k: np.array(v[:rows]) for k, v in msg.arrays.items()})
    return batches


def describe(batches: Sequence[dict[str, np.ndarray]]) -> str:
    clips = sum(len(b["mel_lengths"]) for b in batches)
    frames = sum(int(b["mel_lengths"].sum()) for b in batches)
    return f"{clips} held-out clips ({frames} frames) in {len(batches)} batch(es)"

