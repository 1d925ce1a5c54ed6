"""Each clip's shard (tar shards) or row group (Parquet), numbered in name order: the unit by
which the epoch order groups its leases (consumer/shard_order.py). A pure function of
the index, so an index build stores it in the cache (table.GROUPS_SECTION) and a warm start reads it
rather than scanning every clip's locator again (docs/design/scheduling.md, "Leases by shard").
"""

from __future__ import annotations

import numpy as np

from ...shared.dataset.corpus.address import IN_SHARDS, Row, address_of
from ...shared.dataset.table import SampleTable
from ...shared.dataset.parquet_layout import GROUP_END

# What ends a shard's name in a member's locator (shared/dataset/shards.py: SHARD.tar#MEMBER@OFFSET+SIZE).
SHARD_MARK = ".tar#"
# Locators are read this many at a time when the shards are numbered (a few tens of MB of strings).
SHARD_SCAN_ROWS = 1 << 20


def shard_numbers(table: SampleTable) -> np.ndarray | None:
    """Each clip's shard (by table row), numbered in name order; None unless every clip is a
    shard's member. Those the index stored where it has them; otherwise the first clip's audio tells loose files at once; otherwise each locator's
    shard is the part before its last ``.tar#`` (SHARD_MARK), read SHARD_SCAN_ROWS clips at a
    time, and the first locator of each shard is checked whole (corpus/address.py; a member
    whose locator is malformed is rejected when a producer reads it)."""
    stored = table.stored_groups()
    if stored is not None:
        return _renumbered(stored)
    first = address_of(table.string("audio", 0)) if len(table) else None
    if not isinstance(first, IN_SHARDS):
        return None
    if isinstance(first, Row):
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
                    if not isinstance(address_of(audio), IN_SHARDS):
                        return None
                    code = codes[last] = len(codes)
            numbers[row] = code
    return _in_name_order(codes, numbers)


def row_group_numbers(table: SampleTable) -> np.ndarray | None:
    """Each clip's Parquet row group (shared/dataset/parquet_layout.py: a row's locator up to its last
    ``:``, its file and group), numbered in name order, so that a window of
    ``batching.shard_window`` "shards" is as many row groups; None unless every clip is a row's."""
    found = table.prefix_numbers("audio", ord(GROUP_END))  # a pass in C over the locators' bytes
    if found is None:
        return None
    names, numbers = found
    if not all(isinstance(address_of(table.string("audio", row)), Row) for row in np.unique(numbers, return_index=True)[1].tolist()):
        return None  # a clip of each group checked whole
    return _in_name_order(dict(zip(names, range(len(names)))), numbers)


def _in_name_order(codes: dict[str, int], numbers: np.ndarray) -> np.ndarray:
    """Each row's number renumbered so that the names ``codes`` numbered in order of first sight
    are numbered in name order."""
    in_name_order = np.empty(len(codes), np.int64)
    in_name_order[[codes[name] for name in sorted(codes)]] = np.arange(len(codes))
    return in_name_order[numbers]


def number_groups(table: SampleTable) -> None:
    """A whole table's groups numbered once and kept with it: its later :func:`shard_numbers`
    reads them and its sections store them (GROUPS_SECTION); nothing for clips that are not all
    shards' members or rows."""
    numbers = shard_numbers(table)
    if numbers is not None:
        table.keep_groups(numbers)


def _renumbered(numbers: np.ndarray) -> np.ndarray:
    """``numbers`` renumbered 0.. over the ones present, in the same order (a view's groups among
    those of its whole table)."""
    if not len(numbers):
        return numbers
    present = np.zeros(int(numbers.max()) + 1, bool)
    present[numbers] = True
    return (np.cumsum(present) - 1)[numbers]
