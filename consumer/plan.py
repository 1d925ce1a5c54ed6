"""Batch planning: which samples form which batch, and in which padded shape.

Planning is separate from collation (shared/batch.py pads arrays) and from
serialization (shared/wire.py), as lhotse separates its samplers from collate_vectors.

Buckets: each bucket has a shape (B, L, T) = (its rows, its longest text, its longest
clip), L and T rounded up to ``tokens_multiple`` and ``frames_multiple``. Two ways:

- Fixed rows (``max_frames`` 0, the default): samples are sorted by mel length and cut
  into ``num_buckets`` groups of (nearly) equal count; every batch has ``batch_size`` rows.
- Frame budget (``max_frames`` N > 0): every batch holds about N frames: a bucket of
  T frames has B = max(1, N // T) rows (short clips: many rows, long clips: few), so the
  memory a batch needs is about the same in every bucket. The bucket bounds are chosen to
  waste the fewest padded frames (:func:`frame_budget_bounds`: an exact dynamic program
  over the clips' rounded lengths), which puts more buckets where clips are dense.

A bucket's last, partial batch is filled with empty rows (length 0) instead of dropping
samples. So the trainer sees at most ``num_buckets`` distinct shapes, and every valid
sample is in exactly one batch per epoch.

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
    rows: int  # B: rows of this bucket's batches

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.rows, self.max_tokens, self.max_frames)


@dataclass(frozen=True)
class PlannedBatch:
    epoch: int
    index: int  # position within the epoch
    bucket: int
    ids: tuple[str, ...]
    shape: tuple[int, int]  # (L, T)
    rows: int  # B: the batch's rows (ids fill the first len(ids))


def rows_for(max_frames: int, cfg: BatchingConfig) -> int:
    """B of a bucket of ``max_frames`` (T): ``batch_size``, or under a frame budget N the most
    rows whose frames fit in N (at least one)."""
    if cfg.max_frames <= 0:
        return cfg.batch_size
    return max(1, cfg.max_frames // max_frames)


def frame_budget_bounds(frames: Sequence[int], cfg: BatchingConfig) -> list[int]:
    """The frame bounds (T of each bucket, ascending) that waste the fewest frames.

    The waste of a bucket of bound T holding clips of f_i frames is its padding,
    sum(T - f_i), plus the empty rows of its last, partial batch (B = N // T rows, so
    (-count mod B) x T frames). Bounds are multiples of ``frames_multiple`` at or above
    the clips' rounded lengths; over those m candidate values an exact dynamic program
    (cost of a bucket in O(1) from prefix sums) finds the best partition into at most
    ``num_buckets`` buckets in O(num_buckets x m^2), m <= longest clip / frames_multiple.
    """
    values, inverse = np.unique([round_up(int(f), cfg.frames_multiple) for f in frames], return_inverse=True)
    counts = np.bincount(inverse).astype(np.int64)
    sums = np.bincount(inverse, weights=np.asarray(frames, np.float64))
    cum_n = np.concatenate([[0], np.cumsum(counts)])
    cum_f = np.concatenate([[0.0], np.cumsum(sums)])
    m = len(values)
    k_max = min(cfg.num_buckets, m)
    rows = np.array([rows_for(int(v), cfg) for v in values], np.int64)

    def cost(starts: np.ndarray, end: int) -> np.ndarray:
        """Waste of buckets covering candidates starts..end (inclusive), bound values[end]."""
        n = cum_n[end + 1] - cum_n[starts]
        bound = float(values[end])
        return n * bound - (cum_f[end + 1] - cum_f[starts]) + ((-n) % rows[end]) * bound

    best = np.full((k_max + 1, m), np.inf)
    choice = np.zeros((k_max + 1, m), np.int64)
    for end in range(m):
        best[1, end] = cost(np.array([0]), end)[0]
    for k in range(2, k_max + 1):
        for end in range(k - 1, m):
            starts = np.arange(k - 1, end + 1)  # this bucket's first candidate
            total = best[k - 1, starts - 1] + cost(starts, end)
            j = int(np.argmin(total))
            best[k, end], choice[k, end] = total[j], starts[j]
    k = int(np.argmin(best[1:, m - 1])) + 1  # fewer buckets when more would not waste less
    bounds, end = [], m - 1
    while k >= 1:
        bounds.append(int(values[end]))
        start = choice[k, end] if k > 1 else 0
        end, k = start - 1, k - 1
    return bounds[::-1]


def make_buckets(samples: Sequence[Sample], cfg: BatchingConfig) -> list[Bucket]:
    """Group samples into at most ``cfg.num_buckets`` shape buckets by mel length."""
    if not samples:
        return []
    ordered = sorted(samples, key=lambda s: (s.num_frames, s.id))
    if cfg.max_frames > 0:
        bounds = frame_budget_bounds([s.num_frames for s in ordered], cfg)
        lengths = np.array([round_up(s.num_frames, cfg.frames_multiple) for s in ordered])
        edges = np.searchsorted(lengths, bounds, side="right")
        groups = [g for g in np.split(np.arange(len(ordered)), edges[:-1]) if len(g)]
    else:
        groups = [g for g in np.array_split(np.arange(len(ordered)), min(cfg.num_buckets, len(ordered))) if len(g)]
    buckets = []
    for i, group in enumerate(groups):
        members = [ordered[j] for j in group]
        frames = round_up(max(s.num_frames for s in members), cfg.frames_multiple)
        buckets.append(Bucket(
            index=i,
            max_tokens=round_up(max(s.num_tokens for s in members), cfg.tokens_multiple),
            max_frames=frames,
            sample_ids=tuple(s.id for s in members),
            rows=rows_for(frames, cfg),
        ))
    return buckets


class EpochPlanner:
    """Deterministic epoch plans over fixed buckets."""

    def __init__(self, samples: Sequence[Sample], cfg: BatchingConfig) -> None:
        self.cfg = cfg
        self.buckets = make_buckets(samples, cfg)
        self.batches_per_epoch = sum(-(-len(b.sample_ids) // b.rows) for b in self.buckets)
        # Every valid sample is in every epoch; the coordinator may re-plan a missed one into
        # an extra batch, so an epoch is complete when all its samples are trained or rejected.
        self.samples_per_epoch = sum(len(b.sample_ids) for b in self.buckets)

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """The batch shapes (B, L, T) of the buckets: all the trainer will see."""
        return [b.shape for b in self.buckets]

    def plan(self, epoch: int) -> list[PlannedBatch]:
        rng = np.random.default_rng([self.cfg.seed, epoch])
        chunks: list[tuple[Bucket, tuple[str, ...]]] = []
        for bucket in self.buckets:
            ids = list(bucket.sample_ids)
            rng.shuffle(ids)
            for start in range(0, len(ids), bucket.rows):
                chunks.append((bucket, tuple(ids[start:start + bucket.rows])))
        order = rng.permutation(len(chunks))
        return [
            PlannedBatch(epoch=epoch, index=i, bucket=chunks[j][0].index, ids=chunks[j][1],
                         shape=(chunks[j][0].max_tokens, chunks[j][0].max_frames), rows=chunks[j][0].rows)
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
