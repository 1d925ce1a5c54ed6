"""Epoch order for a dataset of tar shards or Parquet row groups: batches grouped by shard,
so that a producer reads a few shards at a time, while the order is still shuffled.

A pure function of the seed and the epoch over the plan's buckets (consumer/pipeline/plan.py);
:func:`top_shard_share` measures how well it mixes. The order and its figures:
docs/DESIGN.md, Leases by shard.
"""

from __future__ import annotations

import collections
from typing import Mapping, Sequence

import numpy as np

from ...shared.dataset import SampleTable
from ...shared.dataset.shards import is_locator
from ...shared.parquet_layout import GROUP_END, is_row


# What ends a shard's name in a member's locator (shared/dataset/shards.py: SHARD.tar#MEMBER@OFFSET+SIZE).
SHARD_MARK = ".tar#"
# Locators are read this many at a time when the shards are numbered (a few tens of MB of strings).
SHARD_SCAN_ROWS = 1 << 20


def shard_numbers(table: SampleTable) -> np.ndarray | None:
    """Each clip's shard (by table row), numbered in name order; None unless every clip is a
    shard's member. The first clip's audio tells loose files at once; otherwise each locator's
    shard is the part before its last ``.tar#`` (SHARD_MARK), read SHARD_SCAN_ROWS clips at a
    time, and the first locator of each shard is checked whole (:func:`is_locator`; a member
    whose locator is malformed is rejected when a producer reads it)."""
    if not len(table) or not is_locator(table.string("audio", 0)):
        return None
    if is_row(table.string("audio", 0)):
        return row_group_numbers(table)
    codes: dict[str, int] = {}  # shard name -> its number in the order first seen
    numbers = np.empty(len(table), np.int64)
    for first in range(0, len(table), SHARD_SCAN_ROWS):
        stop = min(len(table), first + SHARD_SCAN_ROWS)
        last, code = "", -1
        for row, audio in enumerate(table.strings_between("audio", first, stop), start=first):
            if not (audio.startswith(last) and audio[len(last):len(last) + 1] == "#"
                    and audio.find(SHARD_MARK, len(last)) < 0):  # another shard than the row before's
                cut = audio.rfind(SHARD_MARK)
                if cut < 0:
                    return None
                last = audio[:cut + len(SHARD_MARK) - 1]
                code = codes.get(last, -1)
                if code < 0:
                    if not is_locator(audio):
                        return None
                    code = codes[last] = len(codes)
            numbers[row] = code
    return _in_name_order(codes, numbers)


def row_group_numbers(table: SampleTable) -> np.ndarray | None:
    """Each clip's Parquet row group (shared/parquet_layout.py: a row's locator up to its last
    ``:``, its file and group), numbered in name order, so that a window of
    ``batching.shard_window`` "shards" is as many row groups; None unless every clip is a row's."""
    found = table.prefix_numbers("audio", ord(GROUP_END))  # a pass in C over the locators' bytes
    if found is None:
        return None
    names, numbers = found
    if not all(is_row(table.string("audio", row)) for row in np.unique(numbers, return_index=True)[1].tolist()):
        return None  # a clip of each group checked whole
    return _in_name_order(dict(zip(names, range(len(names)))), numbers)


def _in_name_order(codes: dict[str, int], numbers: np.ndarray) -> np.ndarray:
    """Each row's number renumbered so that the names ``codes`` numbered in order of first sight
    are numbered in name order."""
    in_name_order = np.empty(len(codes), np.int64)
    in_name_order[[codes[name] for name in sorted(codes)]] = np.arange(len(codes))
    return in_name_order[numbers]


def grouped_batches(buckets: Sequence[tuple[int, np.ndarray]], shards: np.ndarray, window: int,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The epoch's batches in training order from ``buckets`` as (rows, clips): (the clips
    batch after batch, each batch's size, each batch's bucket position) (docs/DESIGN.md, Leases by shard)."""
    count = int(shards.max()) + 1
    rank = np.empty(count, np.int64)
    rank[rng.permutation(count)] = np.arange(count)
    windows = rank // max(1, window)  # shard number -> its window this epoch
    parts, sizes, positions, first_windows = [], [], [], []
    for position, (rows, members) in enumerate(buckets):
        clips = members.copy()
        rng.shuffle(clips)
        clips = clips[np.argsort(windows[shards[clips]], kind="stable")]
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
