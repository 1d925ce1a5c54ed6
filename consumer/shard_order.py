"""Epoch order for a dataset of tar shards or Parquet row groups: batches grouped by shard,
so that a producer reads a few shards at a time, while the order is still shuffled.

A pure function of the seed and the epoch over the plan's buckets (consumer/plan.py);
:func:`top_shard_share` measures how well it mixes. The order and its figures:
docs/design/scheduling.md, "Leases by shard".
"""

from __future__ import annotations

import collections
from typing import Mapping, Sequence

import numpy as np


def grouped_batches(buckets: Sequence[tuple[int, np.ndarray]], shards: np.ndarray, window: int,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The epoch's batches in training order from ``buckets`` as (rows, clips): (the clips
    batch after batch, each batch's size, each batch's bucket position) (docs/design/scheduling.md, "Leases by shard")."""
    count = int(shards.max()) + 1
    rank = np.empty(count, np.int64)
    rank[rng.permutation(count)] = np.arange(count)
    windows = rank // max(1, window)  # shard number -> its window this epoch
    parts, sizes, positions, first_windows = [], [], [], []
    for position, (rows, members) in enumerate(buckets):
        clips = members.copy()
        rng.shuffle(clips)
        keys = windows[shards[clips]]
        # a stable sort of small numbers is a radix sort in numpy: several times faster, the same order
        clips = clips[np.argsort(keys.astype(np.uint16) if count <= 1 << 16 else keys, kind="stable")]
        starts = np.arange(0, len(clips), rows)
        parts.append(clips)
        sizes.append(np.minimum(rows, len(clips) - starts))
        positions.append(np.full(len(starts), position, np.int64))
        first_windows.append(windows[shards[clips[starts]]])
    size, window_of = np.concatenate(sizes), np.concatenate(first_windows)
    order = np.lexsort((rng.random(len(size)), window_of))  # by window, in a random order within it
    return gather_batches(np.concatenate(parts), size, order), size[order], np.concatenate(positions)[order]


def gather_batches(clips: np.ndarray, sizes: np.ndarray, order: np.ndarray) -> np.ndarray:
    """``clips`` (batches of ``sizes`` one after the other) with the batches put in ``order``."""
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    taken = sizes[order]
    ends = np.cumsum(taken)
    within = np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - taken, taken)
    return clips[np.repeat(starts[order], taken) + within]


def top_shard_share(batches: Sequence[Sequence[str]], shards: Mapping[str, int]) -> float:
    """The mean, over batches, of the share of a batch's clips from its most common shard."""
    shares = [collections.Counter(shards[i] for i in ids).most_common(1)[0][1] / len(ids) for ids in batches if ids]
    return float(np.mean(shares)) if shares else 0.0
