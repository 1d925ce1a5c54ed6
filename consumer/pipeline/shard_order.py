"""Epoch order for a dataset of tar shards (shared/dataset/shards.py): batches grouped by shard,
so that a producer reads a few shards at a time, while the order is still shuffled.

Each epoch (a pure function of the seed and the epoch, as every plan):

1. the shards are put in a random order and cut into *windows* of ``batching.shard_window``
   shards (the last may be smaller);
2. within each bucket, its clips are shuffled, then ordered by their shard's window (a
   stable sort: random within a window), and cut into batches of the bucket's rows;
3. the batches are trained window by window, in a random order within each window (batches
   of every bucket mixed), the windows in the shards' random order.

So a batch holds the clips of the ``shard_window`` shards of its window (one more where a
bucket's batch straddles two windows), the batches of one stretch of the epoch come from
those few shards, which a producer keeps open (shared/dataset/storage.py), and from epoch to
epoch the shards meet in other windows and other orders. The buckets, shapes, and the set of
clips of every epoch are the plan's (consumer/pipeline/plan.py); only which clips share a batch
and the batches' order differ, so every clip is still in exactly one batch per epoch.

Mixing, measured by :func:`top_shard_share` (the mean share of a batch's clips that come from
its most common shard): 1.0 would be a batch from one shard; a plan shuffled across every shard
of a many-shard dataset is near 1 / (the rows); this order is about 1 / ``shard_window`` and
above (docs/DESIGN.md gives the figures of the planner's unit test).
"""

from __future__ import annotations

import collections
from typing import Mapping, Sequence

import numpy as np

from stoker.shared.dataset.shards import is_locator, shard_of


def shard_indices(samples: Sequence[object]) -> dict[str, int] | None:
    """Each clip's shard, numbered in name order; None unless every clip is a shard's member."""
    audio = [getattr(s, "audio", "") for s in samples]
    if not audio or not all(is_locator(a) for a in audio):
        return None
    names = {name: n for n, name in enumerate(sorted({shard_of(a) for a in audio}))}
    return {getattr(s, "id"): names[shard_of(a)] for s, a in zip(samples, audio)}


def grouped_chunks(buckets: Sequence[tuple[int, tuple[str, ...]]], shards: Mapping[str, int], window: int,
                   rng: np.random.Generator) -> list[tuple[int, tuple[str, ...]]]:
    """The epoch's batches in training order, as (bucket position, clip ids), from ``buckets``
    as (rows, clip ids) (module docstring)."""
    count = max(shards.values()) + 1
    rank = np.empty(count, np.int64)
    rank[rng.permutation(count)] = np.arange(count)
    windows = rank // max(1, window)  # shard number -> its window this epoch
    keyed: list[tuple[int, float, int, tuple[str, ...]]] = []
    for position, (rows, sample_ids) in enumerate(buckets):
        ids = list(sample_ids)
        rng.shuffle(ids)
        ids.sort(key=lambda i: windows[shards[i]])
        for start in range(0, len(ids), rows):
            chunk = tuple(ids[start:start + rows])
            keyed.append((int(windows[shards[chunk[0]]]), float(rng.random()), position, chunk))
    keyed.sort(key=lambda k: (k[0], k[1]))
    return [(position, chunk) for _, _, position, chunk in keyed]


def top_shard_share(batches: Sequence[Sequence[str]], shards: Mapping[str, int]) -> float:
    """The mean, over batches, of the share of a batch's clips from its most common shard."""
    shares = [collections.Counter(shards[i] for i in ids).most_common(1)[0][1] / len(ids) for ids in batches if ids]
    return float(np.mean(shares)) if shares else 0.0
