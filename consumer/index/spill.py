"""A build's pieces spilled to disk and read back a block at a time: each piece's arrays in a run
file of its own (the index cache's format, shared/dataset/cache.py) and a k-way merge of the
pieces' sorted keys whose memory is a block per piece, however large the corpus; a run's
sections given back from its end as its reader is done with them (:meth:`Run.release`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ...shared.dataset.cache import CachedIndex, open_index, write_index


# What the merge reads of all the runs at once, shared out among them: the larger, the fewer
# rounds (each a sort in C), the more memory.
MERGE_BUDGET_BYTES = 64 << 20


# A run never reads fewer keys than this at a time, however many runs share the budget.
MIN_BLOCK_ROWS = 256


def spill_dir(candidates: Sequence[Path]) -> Path:
    """A new directory for a build's run files: beside the index cache where one can be made
    (the disk the cache file goes to, not a temporary file system in memory), else the system's."""
    for path in candidates:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return Path(tempfile.mkdtemp(prefix=".spill-", dir=path.parent))
        except OSError:
            continue
    return Path(tempfile.mkdtemp(prefix="stoker-spill-"))


def remove_spill(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def write_run(path: Path, header: dict[str, Any], arrays: dict[str, Any]) -> None:
    """A piece's arrays (numpy arrays or bytes) as the run file ``path``."""
    with open(path, "wb") as f:
        write_index(f, header, arrays)


class Run:
    """A run file read with ``pread`` a slice at a time: its pages stay the kernel's, not this
    process's (a mapped file's pages read count as its memory)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        cached: CachedIndex = open_index(path, check=False)
        self.header = cached.header
        self._table = cached.header["sections"]
        self._start = cached.start
        assert cached.reader is not None
        self._file = cached.reader

    def close(self) -> None:
        self._file.close()

    def release(self, name: str) -> None:
        """Give back the disk of section ``name`` and of every section after it in the file: the
        file cut short at its start (they are not read again; a file laid out in the reverse of
        the order its reader is done with its sections shrinks as it is read)."""
        os.truncate(self.path, self._start + self._table[name][0])

    def raw(self, name: str, first: int = 0, stop: int | None = None) -> bytes:
        """Bytes ``first:stop`` of section ``name``."""
        offset, nbytes, _ = self._table[name]
        stop = nbytes if stop is None else min(stop, nbytes)
        return os.pread(self._file.fileno(), max(0, stop - first), self._start + offset + first)

    def array(self, name: str, dtype: Any, first: int = 0, stop: int | None = None) -> np.ndarray:
        """Items ``first:stop`` of the array section ``name``."""
        size = np.dtype(dtype).itemsize
        return np.frombuffer(self.raw(name, first * size, None if stop is None else stop * size), dtype)

    def length(self, name: str, dtype: Any) -> int:
        return self._table[name][1] // np.dtype(dtype).itemsize

    def strings(self, name: str, first: int = 0, stop: int | None = None) -> tuple[np.ndarray, bytes]:
        """Strings ``first:stop`` of the string column ``name`` (sections ``name.o``, ``name.s``):
        their offsets from 0 and their bytes."""
        offsets = self.array(f"{name}.o", np.int64, first, None if stop is None else stop + 1)
        blob = self.raw(f"{name}.s", int(offsets[0]), int(offsets[-1])) if len(offsets) else b""
        return offsets - (offsets[0] if len(offsets) else 0), blob


def merged(runs: Sequence[Run], name: str, dtypes: Sequence[Any], target: Any,
           row_bytes: int) -> Iterator[tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]]:
    """The keys of section ``name`` of every run (each sorted, stably; run ``k``'s of
    ``dtypes[k]``, compared as ``target``) merged, a round at a time: (the spans' keys laid end to
    end, their order, the spans: (run, first, stop) in run order). Equal keys come in run order,
    then in their run's order, as a stable sort of the runs laid end to end puts them.
    ``row_bytes``: what a row costs the caller's reads, to size the blocks (:data:`MERGE_BUDGET_BYTES`)."""
    target = np.dtype(target)
    lengths = [run.length(name, dtype) for run, dtype in zip(runs, dtypes)]
    block = max(MIN_BLOCK_ROWS, MERGE_BUDGET_BYTES // max(1, len(runs) * (row_bytes + target.itemsize)))

    def read(k: int, first: int) -> np.ndarray:
        return runs[k].array(name, dtypes[k], first, min(first + block, lengths[k])).astype(target, copy=False)

    at = [0] * len(runs)  # the next key of each run
    base = [0] * len(runs)  # where each run's buffer starts
    buffers = [read(k, 0) for k in range(len(runs))]
    while True:
        active = [k for k in range(len(runs)) if at[k] < lengths[k]]
        if not active:
            return
        # The least last key of a buffer that does not hold the rest of its run (the first run
        # holding it, on a tie): every key before it, in every run, is in a buffer.
        limit, least = None, -1
        for k in active:
            if base[k] + len(buffers[k]) < lengths[k] and (limit is None or buffers[k][-1] < limit):
                limit, least = buffers[k][-1], k
        spans, keys = [], []
        for k in active:
            local = buffers[k][at[k] - base[k]:]
            # Keys equal to the limit: the least run's all (its later ones follow them), an earlier
            # run's all (its buffer goes past the limit), a later run's none (they come after).
            take = len(local) if limit is None else int(np.searchsorted(local, limit, "right" if k <= least else "left"))
            if take:
                spans.append((k, at[k], at[k] + take))
                keys.append(local[:take])
                at[k] += take
            if at[k] - base[k] == len(buffers[k]) and at[k] < lengths[k]:
                base[k] = at[k]
                buffers[k] = read(k, at[k])
        joined = np.concatenate(keys)
        yield joined, np.argsort(joined, kind="stable"), spans


def span_strings(runs: Sequence[Run], name: str, spans: list[tuple[int, int, int]]) -> tuple[np.ndarray, bytes]:
    """The strings of column ``name`` of the spans, laid end to end: (offsets from 0, bytes)."""
    parts = [runs[k].strings(name, first, stop) for k, first, stop in spans]
    offsets = np.zeros(sum(len(o) - 1 for o, _ in parts) + 1, np.int64)
    row = base = 0
    for piece, blob in parts:
        offsets[row + 1:row + len(piece)] = piece[1:] + base
        row, base = row + len(piece) - 1, base + len(blob)
    return offsets, b"".join(blob for _, blob in parts)


def gathered(offsets: np.ndarray, blob: bytes, rows: np.ndarray) -> bytes:
    """The bytes of strings ``rows`` of (offsets, blob), one after another: the blob as it is
    where the rows are all of them in order (ids in file order often are), else one join of
    slices (lines of some hundred bytes: fewer steps than gathering byte by byte)."""
    if not len(rows):
        return b""
    if len(rows) == len(offsets) - 1 and bool((rows == np.arange(len(rows))).all()):
        return bytes(memoryview(blob)[int(offsets[0]):int(offsets[-1])])
    view = memoryview(blob)
    bounds = offsets.tolist()
    return b"".join([view[bounds[r]:bounds[r + 1]] for r in rows.tolist()])
