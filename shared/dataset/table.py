"""The samples of an index as columns: numpy arrays of the numbers, and the strings (id, text,
audio locator, units) as UTF-8 blobs with offsets, read one clip at a time.

A :class:`SampleTable` is a read-only sequence of :class:`~shared.dataset.types.Sample`: it
makes a Sample only for the clip asked for, so a table of ten million clips held by the
coordinator costs its columns (about 40 bytes a clip) and the pages of the blobs it reads,
which a warm load maps from the index cache (shared/dataset/cache.py) instead of reading.
Planning reads the columns (:meth:`SampleTable.column`), never a Sample per clip.
"""

from __future__ import annotations

import codecs
import os
from typing import Any, BinaryIO, Iterable, Iterator, Mapping, Sequence, Sized, overload

import numpy as np

from ..dataset.types import Sample

# The numeric columns and their types. ``speaker`` and ``language`` are codes into the
# table's name lists (a dataset has few of them).
NUMBER_COLUMNS: dict[str, Any] = {"num_tokens": np.int32, "num_frames": np.int32, "duration_s": np.float64,
                                  "line": np.int64, "speaker": np.int32, "language": np.int32}


# Optional numeric columns: each clip's audio file as the index listed it (byte size and mtime,
# files.UNMEASURED where it was not looked at), which a lease carries so that a producer finds a
# file changed since indexing when it reads it (agreement.stamp_problem). Only an index built
# from a listing of its files has them.
FILE_COLUMNS: dict[str, Any] = {"file_size": np.int64, "file_mtime_ns": np.int64}


# The string columns, each a blob of UTF-8 (file names may hold undecodable bytes: surrogateescape)
# and int64 offsets, one more than the clips.
STRING_COLUMNS = ("id", "text", "audio", "units")


ENCODING_ERRORS = "surrogateescape"


# FNV-1a, 64 bits: the hash of a clip id in the map of ids (SampleTable.find_rows).
FNV_OFFSET = 14695981039346656037
FNV_PRIME = np.uint64(1099511628211)


# Bytes below this are ASCII: a blob of them sorts in bytes order as its strings do.
ASCII_END = 128


# Strings up to this many bytes are joined on a grid of one row a string (SampleTable.joined):
# a few passes in C; longer ones byte by byte, so that one long string does not widen every row.
JOIN_GRID_BYTES = 64


# Of a blob left in a file (FileBlob), more strings than this at once are read with the whole blob.
FILE_READ_STRINGS = 4096


# Strings read at a time when a column's prefixes are numbered (SampleTable.prefix_numbers): some
# tens of MB of locators and the arrays over their bytes.
PREFIX_SCAN_ROWS = 1 << 20


# Ids are hashed (and made keys) this many at a time (a few arrays of this length at once).
ID_HASH_CHUNK = 1 << 20


# The section of the rows in id order (SampleTable.id_order).
ID_ORDER_SECTION = "r.id_order"


# The section of each clip's shard or row group, numbered (consumer/index/groups.py), where the
# index stored it (SampleTable.stored_groups).
GROUPS_SECTION = "g.groups"


# The units not stored when they equal the texts (a front-end that keeps the text as it is).
UNITS_AS_TEXT = ("units", "text")


class SampleTable(Sequence[Sample]):
    """The samples of an index, columnar (module docstring). ``numbers``: the arrays of
    :data:`NUMBER_COLUMNS`; ``strings``: per name of :data:`STRING_COLUMNS`, (offsets, blob);
    ``speakers``, ``languages``: the names the codes stand for."""

    def __init__(self, numbers: Mapping[str, np.ndarray], strings: Mapping[str, tuple[np.ndarray, Any]],
                 speakers: Sequence[str], languages: Sequence[str], rows: np.ndarray | None = None,
                 id_order: np.ndarray | None = None) -> None:
        self._numbers = dict(numbers)
        self._strings = {name: (offsets, blob if isinstance(blob, FileBlob) else memoryview(blob))
                         for name, (offsets, blob) in strings.items()}
        self.speakers = list(speakers)
        self.languages = list(languages)
        self._rows = rows  # a view's rows of the stored columns (None: all of them, in order)
        self._len = len(rows) if rows is not None else len(self._numbers["num_frames"])
        self._id_rows: tuple[np.ndarray, np.ndarray] | None = None  # (sorted id hashes, their rows)
        self._ids: list[str] | None = None
        self._id_order = id_order  # rows by clip id (id_order): the builder's, when it sorted the ids
        # The index cache file (a CachedIndex) whose mapping holds these columns, None where they are
        # in memory: another process maps that file rather than getting a copy of the columns.
        self.stored_in: Any = None
        self._groups: np.ndarray | None = None  # each stored clip's group, as the index stored it

    @classmethod
    def from_samples(cls, samples: Iterable[Sample]) -> "SampleTable":
        rows = list(samples)
        speakers = sorted({s.speaker for s in rows})
        languages = sorted({s.language for s in rows})
        speaker_code = {name: n for n, name in enumerate(speakers)}
        language_code = {name: n for n, name in enumerate(languages)}
        numbers = {
            "num_tokens": np.fromiter((s.num_tokens for s in rows), np.int32, len(rows)),
            "num_frames": np.fromiter((s.num_frames for s in rows), np.int32, len(rows)),
            "duration_s": np.fromiter((s.duration_s for s in rows), np.float64, len(rows)),
            "line": np.fromiter((s.line for s in rows), np.int64, len(rows)),
            "speaker": np.fromiter((speaker_code[s.speaker] for s in rows), np.int32, len(rows)),
            "language": np.fromiter((language_code[s.language] for s in rows), np.int32, len(rows)),
        }
        strings = {name: pack_strings([getattr(s, name) for s in rows]) for name in STRING_COLUMNS}
        return cls(numbers, strings, speakers, languages)

    # ------------------------------------------------------------ the sequence of Samples
    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, n: int) -> Sample: ...

    @overload
    def __getitem__(self, n: slice) -> list[Sample]: ...

    def __getitem__(self, n: int | slice) -> Sample | list[Sample]:
        if isinstance(n, slice):
            return [self[i] for i in range(*n.indices(self._len))]
        if n < 0:
            n += self._len
        if not 0 <= n < self._len:
            raise IndexError(n)
        num = self._numbers
        n = int(self._rows[n]) if self._rows is not None else n
        text = self._stored
        return Sample(text("id", n), text("text", n), int(num["num_tokens"][n]), int(num["num_frames"][n]),
                      float(num["duration_s"][n]), text("audio", n), int(num["line"][n]),
                      self.languages[num["language"][n]], self.speakers[num["speaker"][n]], text("units", n))

    def __iter__(self) -> Iterator[Sample]:
        return (self[n] for n in range(self._len))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SampleTable | list | tuple):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking sequence semantics, as a list

    def __repr__(self) -> str:
        return f"SampleTable({self._len} clips)"

    # ------------------------------------------------------------ columns
    def column(self, name: str) -> np.ndarray:
        """One numeric column (:data:`NUMBER_COLUMNS`, or :data:`FILE_COLUMNS` where :meth:`has`), read-only."""
        col = self._numbers[name]
        return col if self._rows is None else col[self._rows]

    def keep_groups(self, numbers: np.ndarray) -> None:
        """Keep each clip's group number (of a whole table), as an index stores them."""
        if self._rows is not None or len(numbers) != self._len:
            raise ValueError("groups are kept for a whole table, one per clip")
        self._groups = numbers

    def stored_groups(self) -> np.ndarray | None:
        """Each clip's shard or row group number as the index stored it (of the whole table: a
        view's clips may not use every number); None where it stored none."""
        if self._groups is None:
            return None
        return self._groups if self._rows is None else self._groups[self._rows]

    def has(self, name: str) -> bool:
        """Whether the table holds the numeric column ``name`` (an optional one: :data:`FILE_COLUMNS`)."""
        return name in self._numbers

    def with_files(self, sizes: np.ndarray, mtimes_ns: np.ndarray) -> "SampleTable":
        """This whole table with :data:`FILE_COLUMNS`: each clip's audio file size and mtime, in row order."""
        if self._rows is not None or len(sizes) != self._len or len(mtimes_ns) != self._len:
            raise ValueError("file columns of another length than the table's")
        numbers = {**self._numbers, "file_size": np.asarray(sizes, np.int64),
                   "file_mtime_ns": np.asarray(mtimes_ns, np.int64)}
        return SampleTable(numbers, self._strings, self.speakers, self.languages, id_order=self._id_order)

    def string(self, name: str, n: int) -> str:
        """Clip ``n``'s string ``name`` (:data:`STRING_COLUMNS`)."""
        if self._rows is not None:
            n = int(self._rows[n])
        return self._stored(name, n)

    def _stored(self, name: str, n: int) -> str:
        offsets, blob = self._strings[name]
        return bytes(blob[offsets[n]:offsets[n + 1]]).decode("utf-8", ENCODING_ERRORS)

    def strings(self, name: str, rows: Iterable[int] | None = None) -> list[str]:
        """String ``name`` of clips ``rows`` (default: every clip), in order."""
        offsets, blob = self._strings[name]
        if rows is None:
            rows = range(self._len)
        if isinstance(blob, FileBlob) and (not isinstance(rows, Sized) or len(rows) > FILE_READ_STRINGS):
            blob = memoryview(bytes(blob))  # read once rather than a read per string
        if self._rows is not None:
            rows = self._rows[np.fromiter(rows, np.int64)].tolist()
        elif isinstance(rows, range):
            bounds = offsets.tolist()  # one conversion: indexing a numpy array per clip costs more
            if rows == range(self._len) and self._len and np.frombuffer(buffer_of(blob), np.uint8).max() < ASCII_END:
                whole = bytes(blob).decode("ascii")  # a character a byte: slices of one string
                return [whole[bounds[n]:bounds[n + 1]] for n in rows]
            return [bytes(blob[bounds[n]:bounds[n + 1]]).decode("utf-8", ENCODING_ERRORS) for n in rows]
        return [bytes(blob[offsets[n]:offsets[n + 1]]).decode("utf-8", ENCODING_ERRORS) for n in rows]

    def strings_between(self, name: str, first: int, stop: int) -> list[str]:
        """String ``name`` of clips ``first`` to ``stop`` (exclusive), in order: one read of their
        bytes (a blob left in the file: only theirs), for a pass over every clip a piece at a time."""
        if self._rows is not None:
            return self.strings(name, range(first, stop))
        offsets, blob = self._strings[name]
        bounds = offsets[first:stop + 1]
        base = int(bounds[0]) if len(bounds) else 0
        piece = bytes(blob[base:int(bounds[-1])]) if len(bounds) else b""
        cuts = (bounds - base).tolist()
        if piece.isascii():  # a character a byte: slices of one string
            text = piece.decode("ascii")
            return [text[cuts[n]:cuts[n + 1]] for n in range(len(cuts) - 1)]
        return [piece[cuts[n]:cuts[n + 1]].decode("utf-8", ENCODING_ERRORS) for n in range(len(cuts) - 1)]

    def prefix_numbers(self, name: str, sep: int) -> tuple[list[str], np.ndarray] | None:
        """Each clip's string ``name`` up to its last byte ``sep`` (a Parquet row's locator up to
        its row: its file and row group), numbered: (the distinct prefixes, each clip's number
        into them). The strings are read PREFIX_SCAN_ROWS at a time, and a clip's prefix is
        compared with the clip's before it in C: a prefix is decoded once a run of clips that
        share it. None when a clip's string has no ``sep``."""
        offsets, blob = self._strings[name]
        stored = len(offsets) - 1
        numbers = np.empty(stored, np.int64)
        codes: dict[bytes, int] = {}
        for first in range(0, stored, PREFIX_SCAN_ROWS):
            bounds = offsets[first:min(stored, first + PREFIX_SCAN_ROWS) + 1]
            base = int(bounds[0])
            raw = np.frombuffer(bytes(blob[base:int(bounds[-1])]), np.uint8)
            starts, ends = bounds[:-1] - base, bounds[1:] - base
            seps = np.flatnonzero(raw == sep)
            last = np.searchsorted(seps, ends) - 1  # the last sep before each string's end
            if (last < 0).any() or (seps[np.maximum(last, 0)] < starts).any():
                return None
            cuts = seps[last]
            new = _new_runs(raw, starts, cuts - starts)
            runs = [codes.setdefault(raw[starts[r]:cuts[r]].tobytes(), len(codes)) for r in np.flatnonzero(new)]
            numbers[first:first + len(starts)] = np.asarray(runs, np.int64)[np.cumsum(new) - 1]
        if self._rows is not None:
            numbers = numbers[self._rows]
        used, numbers = np.unique(numbers, return_inverse=True)  # only the prefixes of this table's clips
        names = [key.decode("utf-8", ENCODING_ERRORS) for key in codes]
        return [names[n] for n in used.tolist()], numbers.reshape(-1).astype(np.int64)

    def joined(self, name: str, rows: np.ndarray, sep: bytes) -> bytes:
        """The UTF-8 of string ``name`` of clips ``rows``, ``sep`` between them: the bytes of
        ``sep.join(...)`` gathered in C, without a string per clip."""
        offsets, blob = self._strings[name]
        stored = self._rows[rows] if self._rows is not None else np.asarray(rows, np.int64)
        if not len(stored):
            return b""
        raw = np.frombuffer(buffer_of(blob), np.uint8)
        starts = offsets[stored]
        lengths = offsets[stored + 1] - starts
        widest = int(lengths.max())
        if widest <= JOIN_GRID_BYTES:  # a grid of every string's bytes, the separator after it, then the real ones
            grid = np.empty((len(stored), widest + len(sep)), np.uint8)
            columns = np.arange(widest)
            grid[:, widest:] = np.frombuffer(sep, np.uint8)
            if int(lengths.min()) == widest:  # strings of one length (ids often are): every byte is one
                grid[:, :widest] = raw[starts[:, None] + columns]
                return grid.tobytes()[:-len(sep) or None]
            real = columns < lengths[:, None]
            grid[:, :widest][real] = raw[(starts[:, None] + columns)[real]]
            keep = np.concatenate([real, np.ones((len(stored), len(sep)), bool)], axis=1)
            return grid[keep].tobytes()[:-len(sep) or None]
        lengths = lengths + len(sep)  # each string with the separator after it
        ends = np.cumsum(lengths)
        # Byte k of the output comes from the blob (or the separator) at the string's start + its offset in it.
        within = np.arange(int(ends[-1])) - np.repeat(ends - lengths, lengths)
        source = np.repeat(starts, lengths) + within
        out = np.empty(len(source), np.uint8)
        is_sep = within >= np.repeat(lengths - len(sep), lengths)
        out[~is_sep] = raw[source[~is_sep]]
        if sep:
            out[is_sep] = np.tile(np.frombuffer(sep, np.uint8), len(stored))
        return out[:len(out) - len(sep)].tobytes()

    def ids(self) -> list[str]:
        """Every clip's id, in order: decoded once and kept (the plan's buckets and batches hold
        these very strings, and :meth:`row_of` maps them)."""
        if self._ids is None:
            self._ids = self.strings("id")
        return self._ids

    def id_keys(self) -> np.ndarray | None:
        """Every clip's id as fixed-width bytes (numpy ``S``, zero-padded), in order, for sorting by
        id in C; None when bytes order is not str order: an id with an undecodable byte (a
        surrogate escape) or a NUL (lost in the padding). Otherwise UTF-8 orders as the code
        points do. Made from the blob, without a bytes object per id."""
        offsets, blob = self._strings["id"]
        if not sorts_as_str(buffer_of(blob)):
            return None
        return fixed_width(offsets, np.frombuffer(buffer_of(blob), np.uint8), self._rows)

    def id_order(self) -> np.ndarray:
        """The rows ordered by clip id (Python's str order; equal ids in row order), as int64: the
        planner's canonical order, so that a plan does not depend on the metadata's line order.
        Stored in the index cache (a section, :meth:`sections`) and mapped on a warm load; made
        once on demand for a table made otherwise (a view, :meth:`from_samples`)."""
        if self._id_order is None:
            keys = self.id_keys()
            if keys is not None:  # bytes order is str order: a sort in C (adaptive: ids in order cost a pass)
                order = np.argsort(keys, kind="stable")
            else:
                ids = self.ids()
                order = np.array(sorted(range(len(ids)), key=ids.__getitem__), np.int64)
            self._id_order = order.astype(np.int64, copy=False)
        return self._id_order

    def hashes(self, name: str, prefix: bytes = b"") -> np.ndarray:
        """Every clip's 64-bit FNV-1a of ``prefix`` + the UTF-8 of its string ``name``, in C."""
        offsets, blob = self._strings[name]
        rows = self._rows if self._rows is not None else np.arange(self._len)
        return hash_strings(offsets, np.frombuffer(buffer_of(blob), np.uint8), rows, prefix)

    def row_of(self, sample_id: str) -> int:
        """The row of a clip id; KeyError when the table has none."""
        (row,) = self.find_rows([sample_id])
        if row < 0:
            raise KeyError(sample_id)
        return row

    def find_rows(self, ids: Sequence[str]) -> list[int]:
        """The rows of clip ids, -1 for an id the table lacks. The map is a sorted array of the
        ids' 64-bit hashes (made on first use: 16 bytes a clip, where a dict of the ids would
        take some 100), each hit checked against the id itself."""
        if self._id_rows is None:
            offsets, blob = self._strings["id"]
            rows = self._rows if self._rows is not None else np.arange(self._len)
            hashes = hash_strings(offsets, np.frombuffer(buffer_of(blob), np.uint8), rows)
            order = np.argsort(hashes, kind="stable")
            self._id_rows = (hashes[order], order)
        hashes, order = self._id_rows
        q_offsets, q_blob = pack_strings(ids)
        wanted = hash_strings(q_offsets, np.frombuffer(q_blob, np.uint8), np.arange(len(ids)))
        found = []
        for sample_id, h, at in zip(ids, wanted.tolist(), np.searchsorted(hashes, wanted).tolist()):
            row = -1
            while at < len(hashes) and hashes[at] == h:
                if self.string("id", int(order[at])) == sample_id:
                    row = int(order[at])
                    break
                at += 1
            found.append(row)
        return found

    def take(self, rows: Sequence[int] | np.ndarray) -> "SampleTable":
        """A view of clips ``rows`` of this table, in that order (nothing is copied but the rows)."""
        picked = np.asarray(rows, np.int64)
        view = SampleTable(self._numbers, self._strings, self.speakers, self.languages,
                           self._rows[picked] if self._rows is not None else picked)
        view.stored_in, view._groups = self.stored_in, self._groups
        if self._ids is not None:
            view._ids = [self._ids[n] for n in picked.tolist()]  # the same strings, not decoded again
        increasing = not len(picked) or bool((picked[1:] > picked[:-1]).all())  # equal ids stay in row order
        if increasing and (self._id_order is not None or self._rows is None):  # the view's id order from this one's
            position = np.full(self._len, -1, np.int64)
            position[picked] = np.arange(len(picked))
            order = position[self.id_order()]
            view._id_order = order[order >= 0]
        return view

    def stored_rows(self, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """The rows of clips ``rows`` of this table in the whole table it is a view of (:meth:`whole`;
        ``rows`` themselves for a whole table): an index's clip positions, from a hold-out's view."""
        picked = np.asarray(rows, np.int64)
        return self._rows[picked] if self._rows is not None else picked

    def whole(self) -> "SampleTable":
        """The whole table this one is a view of (its columns, its clips' groups), or itself."""
        if self._rows is None:
            return self
        table = SampleTable(self._numbers, self._strings, self.speakers, self.languages)
        table.stored_in, table._groups = self.stored_in, self._groups
        return table

    # ------------------------------------------------------------ storage
    def sections(self) -> dict[str, bytes | np.ndarray]:
        """The arrays and blobs to store (:meth:`from_sections` reads them back); of a whole table.
        The clips' groups where they were kept (:meth:`keep_groups`); the rows in id order are stored (``r.id_order``: made here if not yet); units equal to
        the texts clip for clip (a front-end that keeps the text as it is) are not: the texts'
        sections serve both."""
        if self._rows is not None:
            raise ValueError("a view of a table is not stored")
        kinds = {**NUMBER_COLUMNS, **FILE_COLUMNS}
        out: dict[str, bytes | np.ndarray] = {f"n.{name}": np.ascontiguousarray(col, kinds[name])
                                             for name, col in self._numbers.items()}
        for name, (offsets, blob) in self._strings.items():
            if name == UNITS_AS_TEXT[0] and _same_strings((offsets, blob), self._strings[UNITS_AS_TEXT[1]]):
                continue
            out[f"o.{name}"] = np.ascontiguousarray(offsets, np.int64)
            out[f"s.{name}"] = buffer_of(blob)
        out[ID_ORDER_SECTION] = self.id_order()
        if self._groups is not None:
            out[GROUPS_SECTION] = self._groups
        return out

    @classmethod
    def from_sections(cls, sections: Mapping[str, Any], speakers: Sequence[str], languages: Sequence[str],
                      checksummed: bool = False) -> "SampleTable":
        """The table over stored sections (views of a mapped file, or blobs left in it: nothing is
        copied); ValueError when they do not fit together. ``checksummed``: the sections passed
        their checksums (they are what a table's :meth:`sections` wrote), so only their sizes
        are checked, not every offset and code (which would read them all in)."""
        numbers = {name: np.frombuffer(sections[f"n.{name}"], kind) for name, kind in NUMBER_COLUMNS.items()}
        numbers.update({name: np.frombuffer(sections[f"n.{name}"], kind) for name, kind in FILE_COLUMNS.items()
                        if f"n.{name}" in sections})
        count = len(numbers["num_frames"])
        strings = {}
        for name in STRING_COLUMNS:
            if name == UNITS_AS_TEXT[0] and f"s.{name}" not in sections and f"o.{name}" not in sections:
                strings[name] = strings[UNITS_AS_TEXT[1]]
                continue
            offsets = np.frombuffer(sections[f"o.{name}"], np.int64)
            blob = sections[f"s.{name}"]
            if len(offsets) != count + 1 or offsets[0] != 0 or offsets[-1] != len(blob) \
                    or (count and not checksummed and bool((offsets[1:] < offsets[:-1]).any())):
                raise ValueError(f"column {name} does not fit its blob")
            strings[name] = (offsets, blob)
        if any(len(col) != count for col in numbers.values()):
            raise ValueError("columns of different lengths")
        if count and not checksummed and (numbers["speaker"].max() >= len(speakers) or numbers["language"].max() >= len(languages)
                      or numbers["speaker"].min() < 0 or numbers["language"].min() < 0):
            raise ValueError("a speaker or language code outside its table")
        order = np.frombuffer(sections[ID_ORDER_SECTION], np.int64) if ID_ORDER_SECTION in sections else None
        if order is not None and len(order) != count:
            raise ValueError("the rows in id order are not the table's")
        table = cls(numbers, strings, speakers, languages, id_order=order)
        if GROUPS_SECTION in sections:
            table.keep_groups(np.frombuffer(sections[GROUPS_SECTION], np.int64))
        return table


class FileBlob:
    """A string column's bytes left in a file (the index cache), read with ``pread`` a slice at a
    time. A mapped file's pages that a process reads count in its resident memory, 64 KiB around
    each (the kernel maps what is cached near a fault), so reading the texts of a few clips
    here and there would make a long run's coordinator hold most of a blob; read, they stay
    the kernel's page cache."""

    def __init__(self, file: BinaryIO, offset: int, size: int) -> None:
        self._file = file  # kept open while the table lives
        self.offset, self.size = offset, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, part: slice) -> bytes:
        start, stop, _ = part.indices(self.size)
        return os.pread(self._file.fileno(), max(0, stop - start), self.offset + start)

    def __bytes__(self) -> bytes:
        return self[0:self.size]


def _new_runs(raw: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Whether each string (``starts`` and ``lengths`` into ``raw``) differs from the one before
    it (the first: True): the strings as zero-padded rows of a sliding window over ``raw``,
    each compared with the row before."""
    width = max(1, int(lengths.max()) if len(lengths) else 1)
    padded = np.zeros(len(raw) + width, np.uint8)
    padded[:len(raw)] = raw
    keys = np.lib.stride_tricks.sliding_window_view(padded, width)[starts]
    keys[np.arange(width) >= lengths[:, None]] = 0
    rows = keys.view(f"S{width}").ravel()
    new = np.ones(len(starts), bool)
    new[1:] = (rows[1:] != rows[:-1]) | (lengths[1:] != lengths[:-1])
    return new


def buffer_of(blob: Any) -> Any:
    """A blob as a buffer (a FileBlob read whole)."""
    return bytes(blob) if isinstance(blob, FileBlob) else blob


def hash_strings(offsets: np.ndarray, blob: np.ndarray, rows: np.ndarray, prefix: bytes = b"") -> np.ndarray:
    """64-bit FNV-1a of ``prefix`` + each of the strings ``rows`` of (offsets, blob),
    ID_HASH_CHUNK at a time, a byte position of all of them per step."""
    start = FNV_OFFSET
    for byte in prefix:  # the state after the prefix, once
        start = ((start ^ byte) * int(FNV_PRIME)) & 0xFFFFFFFFFFFFFFFF
    out = np.empty(len(rows), np.uint64)
    for first in range(0, len(rows), ID_HASH_CHUNK):
        chunk = rows[first:first + ID_HASH_CHUNK]
        starts = offsets[chunk]
        lengths = offsets[chunk + 1] - starts
        h = np.full(len(chunk), start, np.uint64)
        for k in range(int(lengths.max()) if len(chunk) else 0):
            has = lengths > k
            byte = np.zeros(len(chunk), np.uint64)
            byte[has] = blob[starts[has] + k]
            h = np.where(has, (h ^ byte) * FNV_PRIME, h)
        out[first:first + len(chunk)] = h
    return out


def fixed_width(offsets: np.ndarray, raw: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """The strings ``rows`` (default: all, in order) of (offsets, blob bytes) as numpy ``S``, each
    zero-padded to the longest: the blob itself when every string is that long, else each
    string's bytes gathered as a row of a sliding window over the blob, those past its end zeroed
    (ID_HASH_CHUNK rows at a time)."""
    starts = offsets[:-1] if rows is None else offsets[rows]
    lengths = (offsets[1:] if rows is None else offsets[rows + 1]) - starts
    width = max(1, int(lengths.max()) if len(starts) else 1)
    if rows is None and len(starts) and int(lengths.min()) == width and offsets[0] == 0:
        return raw[:int(offsets[-1])].view(f"S{width}")  # ids of one length: the blob is the keys
    padded = np.zeros(len(raw) + width, np.uint8)
    padded[:len(raw)] = raw
    windows = np.lib.stride_tricks.sliding_window_view(padded, width)
    keys = np.empty((len(starts), width), np.uint8)
    beyond = np.arange(width)
    for first in range(0, len(starts), ID_HASH_CHUNK):
        block = windows[starts[first:first + ID_HASH_CHUNK]]
        block[beyond >= lengths[first:first + ID_HASH_CHUNK, None]] = 0
        keys[first:first + ID_HASH_CHUNK] = block
    return keys.view(f"S{width}").ravel()


def sorts_as_str(blob: Any) -> bool:
    """Whether strings of a blob, zero-padded to one width, sort in bytes order as Python sorts
    the strings: no NUL (lost in the padding) and UTF-8 as written, without a surrogate escape
    (an undecodable byte); UTF-8 orders as the code points do."""
    raw = np.frombuffer(blob, np.uint8)
    if not len(raw) or raw.max() < ASCII_END:
        return not len(raw) or raw.min() > 0
    try:
        codecs.utf_8_decode(blob, "strict", True)
    except UnicodeDecodeError:
        return False
    return raw.min() > 0


def _same_strings(a: tuple[np.ndarray, Any], b: tuple[np.ndarray, Any]) -> bool:
    """Whether two (offsets, blob) of a table hold the same strings."""
    if len(a[0]) != len(b[0]) or len(a[1]) != len(b[1]) or not np.array_equal(a[0], b[0]):
        return False
    first, second = (memoryview(buffer_of(blob)) for blob in (a[1], b[1]))
    whole = [blob.obj if isinstance(blob.obj, bytes) and len(blob.obj) == blob.nbytes else None
             for blob in (first, second)]
    if whole[0] is not None and whole[1] is not None:
        return whole[0] == whole[1]  # one memcmp (a built table's blobs)
    return all(np.array_equal(np.frombuffer(first[at:at + ID_HASH_CHUNK], np.uint8),
                              np.frombuffer(second[at:at + ID_HASH_CHUNK], np.uint8))
               for at in range(0, first.nbytes, ID_HASH_CHUNK))


def pack_strings(values: Sequence[str]) -> tuple[np.ndarray, bytes]:
    """(offsets, blob) of ``values``: UTF-8 one after the other, offsets[n]..offsets[n+1] the n-th."""
    joined = "".join(values)
    offsets = np.zeros(len(values) + 1, np.int64)
    if joined.isascii():  # a byte per character: no bytes object per value
        np.cumsum(np.fromiter(map(len, values), np.int64, len(values)), out=offsets[1:])
        return offsets, joined.encode("ascii")
    encoded = [v.encode("utf-8", ENCODING_ERRORS) for v in values]
    np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), out=offsets[1:])
    return offsets, b"".join(encoded)
