"""Batch planning: which samples form which batch, and in which padded shape.

Planning is separate from collation (shared/batch.py pads arrays) and from
serialization (shared/wire.py), as lhotse separates its samplers from collate_vectors.

Buckets: samples are sorted by mel length and cut into ``num_buckets`` groups of
(nearly) equal count; each group's bucket shape is (L, T) = (its longest text, its
longest clip), rounded up to ``tokens_multiple`` and ``frames_multiple``. Every batch
has exactly ``batch_size`` rows; a bucket's last, partial batch is filled with empty
rows (length 0) instead of dropping samples. So the trainer sees at most
``num_buckets`` distinct shapes, and every valid sample is in exactly one batch per epoch.

The plan of an epoch is a pure function of (index, config, epoch): batches within each
bucket and the order of batches are shuffled with a generator seeded by (seed, epoch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from shared.config import BatchingConfig
from shared.dataset import Sample
from shared.text import Vocabulary


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Bucket:
    index: int
    max_tokens: int  # L: padded token length of this bucket's batches
    max_frames: int  # T: padded mel length of this bucket's batches
    sample_ids: tuple[str, ...]


@dataclass(frozen=True)
class PlannedBatch:
    epoch: int
    index: int  # position within the epoch
    bucket: int
    ids: tuple[str, ...]
    shape: tuple[int, int]  # (L, T)


def make_buckets(samples: Sequence[Sample], cfg: BatchingConfig) -> list[Bucket]:
    """Group samples into at most ``cfg.num_buckets`` shape buckets by mel length."""
    if not samples:
        return []
    ordered = sorted(samples, key=lambda s: (s.num_frames, s.id))
    groups = [g for g in np.array_split(np.arange(len(ordered)), min(cfg.num_buckets, len(ordered))) if len(g)]
    buckets = []
    for i, group in enumerate(groups):
        members = [ordered[j] for j in group]
        buckets.append(Bucket(
            index=i,
            max_tokens=round_up(max(s.num_tokens for s in members), cfg.tokens_multiple),
            max_frames=round_up(max(s.num_frames for s in members), cfg.frames_multiple),
            sample_ids=tuple(s.id for s in members),
        ))
    return buckets


class EpochPlanner:
    """Deterministic epoch plans over fixed buckets."""

    def __init__(self, samples: Sequence[Sample], cfg: BatchingConfig) -> None:
        self.cfg = cfg
        self.buckets = make_buckets(samples, cfg)
        self.batches_per_epoch = sum(-(-len(b.sample_ids) // cfg.batch_size) for b in self.buckets)
        # Every valid sample is in every epoch; the coordinator may re-plan a missed one into
        # an extra batch, so an epoch is complete when all its samples are trained or rejected.
        self.samples_per_epoch = sum(len(b.sample_ids) for b in self.buckets)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return [(b.max_tokens, b.max_frames) for b in self.buckets]

    def plan(self, epoch: int) -> list[PlannedBatch]:
        rng = np.random.default_rng([self.cfg.seed, epoch])
        chunks: list[tuple[Bucket, tuple[str, ...]]] = []
        size = self.cfg.batch_size
        for bucket in self.buckets:
            ids = list(bucket.sample_ids)
            rng.shuffle(ids)
            for start in range(0, len(ids), size):
                chunks.append((bucket, tuple(ids[start:start + size])))
        order = rng.permutation(len(chunks))
        return [
            PlannedBatch(epoch=epoch, index=i, bucket=chunks[j][0].index, ids=chunks[j][1],
                         shape=(chunks[j][0].max_tokens, chunks[j][0].max_frames))
            for i, j in enumerate(order)
        ]


class TokenTable:
    """The token ids of each planned sample, as its lease carries them to a producer.

    The trainer tokenizes (its index holds each text's units, made once by the text
    front-end and cached), so a producer, here or on another host, needs no front-end,
    phonemizer or vocabulary of its own, and its tokens cannot differ from the index's.
    """

    def __init__(self, samples: Sequence[Sample], vocabulary: Vocabulary) -> None:
        self.vocabulary = vocabulary
        self._units = {s.id: s.units for s in samples}
        speakers = {name: n for n, name in enumerate(vocabulary.speakers)}
        languages = {code: n for n, code in enumerate(vocabulary.languages)}
        self._ids = {s.id: (speakers.get(s.speaker, 0), languages.get(s.language, 0)) for s in samples}

    def __call__(self, ids: Sequence[str]) -> list[list[int]]:
        return [self.vocabulary.encode(self._units[i]).tolist() for i in ids]

    def lease_fields(self, ids: Sequence[str]) -> dict[str, list[Any]]:
        """What a lease carries for its clips: token ids, speaker ids and language ids."""
        return {"tokens": self(ids), "speakers": [self._ids[i][0] for i in ids],
                "languages": [self._ids[i][1] for i in ids]}
