"""Parquet files as a dataset: each row a clip, its audio the encoded bytes of a column, read a
row group at a time with pyarrow (the ``parquet`` extra).

A Hugging Face dataset of speech is Parquet files whose ``audio`` column is the ``Audio``
feature's struct ``{bytes, path}`` (the clip's encoded file: any format libsndfile reads), beside
columns of text, speaker and language. ``--data`` names them as it names tar shards
(shared/dataset/shards.py): one ``.parquet`` file, a directory of them (and no metadata file), a
glob or brace pattern, or any of these as a URL (fsspec: shared/dataset/storage.py). The dataset's
root and "metadata file" are the directory (a cache directory for a URL) and the pattern, as for
shards; its format (corpus/parquet.py) is a sharded one as theirs is, so the index, the dataset
agreement and the producers take a Parquet dataset as a shard dataset, through the manifest its
listing makes.

The listing (:func:`list_file`, one file's; cached beside the index as the shards' is, its rules'
version shards.PARQUET_LISTING_FORMAT) reads each
file's footer and, a row group at a time, every column but the audio: a JSON line per row
(shared/dataset/parquet_layout.py, which maps the columns to a clip's id, text, speaker, language and
duration by ``data.columns`` or their usual names). A row's audio is its **locator**
``FILE.parquet#GROUP:ROW`` (:data:`shared.dataset.parquet_layout.ROW_LOCATOR`); where the audio column is
a string column of paths instead (or the struct's bytes are null), the file that path names,
relative to the Parquet file's directory (a loose file, read as a manifest's). The audio column:
the first struct column with a binary ``bytes`` field, else a binary column named as in
:data:`AUDIO_COLUMNS`, else a string column so named (paths).

The index takes a row's duration from its duration column, reading no audio; a row without one
is measured from its audio's header, read from the bytes (:func:`probe_row`). A producer reads its
lease's rows a row group at a time (:class:`RowReader`: each group's audio column once, a few
groups kept), the lease's rows grouped by file and row group as a shard dataset's by shard
(consumer/shard_order.py).

Faults are rejections, never crashes: a file whose footer cannot be read (one rejection naming
the file), a row group whose columns cannot be read (a rejection per row, naming the row, its row
group and file; its ids the rows' default ones, ``STEM_ROW``, as its id column cannot be read), a
row whose audio does not decode (rejected by the index when it reads the header, by the producer
when it decodes the clip, naming the row and file).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import posixpath
import threading
from pathlib import Path
from typing import Any, Iterable, Iterator

import orjson

from ..dataset.probe import probe_bytes
from ..dataset.storage import MAX_OPEN_FILES, StorageError, first_line, is_url, open_file, shown
from ..dataset.types import AudioFile, AudioProbe, DatasetError, Shard, ShardListing
from .layouts import Rejection
from .parquet_layout import ROW_LOCATOR, row_where

log = logging.getLogger(__name__)


# Names of an audio column that is not a struct: binary (the encoded file) or a string (its path).
AUDIO_COLUMNS = ("audio", "audio_filepath", "path", "file", "file_name")


# The audio columns of row groups a reader keeps (the encoded bytes, not decoded audio), in bytes:
# consecutive leases of a window read the same few row groups (batching.shard_window, 4 by default)
# and the index's header reads go through a file in order; a bound, as datasets writes row groups
# of up to 100 MB. The last group read is kept whatever its size.
KEPT_GROUP_BYTES = 256 << 20


def pyarrow_modules() -> tuple[Any, Any]:
    """(pyarrow, pyarrow.parquet); DatasetError (one line) where pyarrow is not installed."""
    try:
        import pyarrow  # the parquet extra's: only a Parquet dataset needs it
        import pyarrow.parquet  # (as above)
    except ImportError:
        raise DatasetError("reading Parquet files needs pyarrow: pip install 'stoker[parquet]'") from None
    return pyarrow, pyarrow.parquet


def _path(root: Path | None, name: str) -> str:
    return name if is_url(name) or root is None or Path(name).is_absolute() else str(root / name)


def audio_column(schema: Any) -> tuple[str, str, str] | None:
    """(column, the path of its bytes, the path of its paths) of a schema's audio column (module
    docstring); "" where it has none of one; None where the schema has no audio column."""
    pa, _ = pyarrow_modules()
    binary = (pa.types.is_binary, pa.types.is_large_binary)
    text = (pa.types.is_string, pa.types.is_large_string)
    for field in schema:
        kind = field.type
        if pa.types.is_struct(kind):
            children = {kind.field(n).name: kind.field(n).type for n in range(kind.num_fields)}
            if "bytes" in children and any(is_(children["bytes"]) for is_ in binary):
                named = "path" in children and any(is_(children["path"]) for is_ in text)
                paths = f"{field.name}.path" if named else ""
                return field.name, f"{field.name}.bytes", paths
    for want, make in ((binary, lambda n: (n, n, "")), (text, lambda n: (n, "", n))):
        for name in AUDIO_COLUMNS:
            if name in schema.names and any(is_(schema.field(name).type) for is_ in want):
                return make(name)
    return None


def _scalar(kind: Any) -> bool:
    pa, _ = pyarrow_modules()
    return any(is_(kind) for is_ in (pa.types.is_string, pa.types.is_large_string, pa.types.is_integer,
                                     pa.types.is_floating, pa.types.is_boolean))


def scalar_columns(schema: Any, audio: str) -> list[str]:
    """The columns a listing line holds of each row: every scalar one but the audio column ``audio``."""
    return [f.name for f in schema if f.name != audio and _scalar(f.type)]


@contextlib.contextmanager
def parquet_file(root: Path | None, name: str) -> Iterator[Any]:
    """The ``pyarrow.parquet.ParquetFile`` of ``name`` (relative to ``root``, or a URL), open while in use."""
    _, pq = pyarrow_modules()
    with open_file(_path(root, name)) as handle:
        yield pq.ParquetFile(handle)


def stem(name: str) -> str:
    """A Parquet file's name without its directory and suffix: its rows' default ids' start."""
    base = name.rpartition("/")[2]
    return base[:-len(".parquet")] if base.lower().endswith(".parquet") else base


def _beside(name: str, path: str) -> str:
    """A path column's ``path`` as the dataset names it: relative to the Parquet file ``name``'s directory."""
    directory = name.rpartition("/")[0]
    if is_url(path) or path.startswith("/") or not directory:
        return path
    return f"{directory}/{path}" if is_url(name) else posixpath.normpath(f"{directory}/{path}")


def list_file(root: Path, shard: Shard, listing: ShardListing) -> None:
    """Add one Parquet file's rows to ``listing`` (module docstring): a line per row, the rows'
    locators as its audio files (the file's size and stamp), its faults as rejections. Ids are
    checked when the lines are read (shared/dataset/parquet_layout.py), as data.columns names them."""
    pa, _ = pyarrow_modules()
    name, rows_of = shard.name, stem(shard.name)
    first = 0
    try:
        with parquet_file(root, name) as parquet:
            found = audio_column(parquet.schema_arrow)
            if found is None:
                listing.rejected.append(Rejection(f"file:{name}", f"Parquet file {shown(name)} has no audio column (a "
                                                                  f"struct of bytes and path, or one named "
                                                                  f"{'/'.join(AUDIO_COLUMNS)})"))
                return
            column, bytes_path, paths_path = found
            others = scalar_columns(parquet.schema_arrow, column)
            metadata = parquet.metadata
            for group in range(metadata.num_row_groups):
                rows = metadata.row_group(group).num_rows
                try:
                    _list_group(parquet, name, rows_of, group, first, (bytes_path, paths_path), others, shard,
                                listing)
                except (OSError, pa.ArrowException) as exc:
                    reason = f"row group {group} of {shown(name)} cannot be read: {_message(exc)}"
                    listing.rejected.extend(Rejection(f"{rows_of}_{first + r}", f"row {r} of {reason}",
                                                      file=f"{name}#{group}:{r}", kind="unreadable-audio")
                                            for r in range(rows))
                first += rows
    except (OSError, StorageError, pa.ArrowException) as exc:
        listing.rejected.append(Rejection(f"file:{name}", f"Parquet file {shown(name)} cannot be read: "
                                                          f"{_message(exc)}"))


def _list_group(parquet: Any, name: str, stem: str, group: int, first: int, audio: tuple[str, str],
                others: list[str], shard: Shard, listing: ShardListing) -> None:
    """One row group's lines: its columns but the audio (and the audio's paths where its bytes may be null)."""
    bytes_path, paths_path = audio
    stats = parquet.metadata.row_group(group).column(_leaf(parquet, bytes_path)).statistics if bytes_path else None
    every_row = stats is not None and stats.has_null_count and stats.null_count == 0
    wanted = others + ([paths_path] if paths_path and not every_row else [])
    if bytes_path and not every_row:
        wanted.append(bytes_path)  # which rows have bytes: the column itself (a rare layout)
    table = parquet.read_row_group(group, columns=wanted) if wanted else None
    count = parquet.metadata.row_group(group).num_rows
    values = {n: table.column(n).to_pylist() for n in others} if table is not None else {}
    has_bytes = [True] * count if every_row else (_flat(table, bytes_path, lambda v: v is not None) if bytes_path
                                                   else [False] * count)
    paths = _flat(table, paths_path, lambda v: v) if paths_path and not every_row else [None] * count
    for r in range(count):
        if has_bytes[r]:
            audio = f"{name}#{group}:{r}"
            listing.audio[audio] = AudioFile(audio, shard.size, shard.mtime_ns)
        elif paths[r]:
            audio = _beside(name, paths[r])
        else:
            listing.rejected.append(Rejection(f"{stem}_{first + r}", f"row {r} of row group {group} of {shown(name)} "
                                                                     f"has no audio (no bytes, no path)",
                                              file=f"{name}#{group}:{r}", kind="missing-audio"))
            continue
        columns = {n: values[n][r] for n in others if values[n][r] is not None}
        listing.lines.append(orjson.dumps({"audio_filepath": audio, "row": f"{stem}_{first + r}",
                                           "columns": columns}).decode("utf-8"))


def _message(exc: BaseException) -> str:
    """An exception as a reason names it: its type and first line, without control characters (Arrow's
    messages may quote the corrupt bytes)."""
    return f"{type(exc).__name__}: " + "".join(c if c.isprintable() else "?" for c in first_line(exc)).strip("? ")


def _leaf(parquet: Any, path: str) -> int:
    """The leaf column number of a column path (``audio.bytes``) in the file's Parquet schema."""
    schema = parquet.metadata.schema
    return next(n for n in range(len(schema)) if schema.column(n).path == path)


def _flat(table: Any, path: str, keep: Any) -> list[Any]:
    """``keep`` of each value of column path ``path`` (``audio.bytes``: a struct's field) of a table."""
    top, _, child = path.partition(".")
    column = table.column(top).combine_chunks()
    return [keep(v) for v in (column.field(child) if child else column).to_pylist()]


class RowReader:
    """Reads rows' audio bytes by locator, a row group's audio column at a time, keeping the last
    groups read (:data:`KEPT_GROUP_BYTES`) and :data:`shared.dataset.storage.MAX_OPEN_FILES` files open (a
    producer's leases read a few row groups each, consecutive leases of a window the same ones;
    the index's header reads go through the file in order). Local files or URLs (through
    storage.py: reads retried and counted). One thread reads (a producer's compute thread)."""

    def __init__(self, root: Path | None) -> None:
        self.root = root
        self._files: collections.OrderedDict[str, tuple[Any, Any, str]] = collections.OrderedDict()
        self._groups: collections.OrderedDict[tuple[str, int], Any] = collections.OrderedDict()
        self._ahead: dict[str, bytes] = {}  # rows read by prefetch, not yet asked for
        self._lock = threading.Lock()

    def prefetch(self, names: Iterable[str]) -> None:
        """Read the rows ``names`` locates, their row groups in file and group order, each once
        (however many groups: a row's bytes are kept, not its group's), to be taken by
        :meth:`read` in any order. What was prefetched before and not taken is dropped. A row
        that cannot be read is left for its :meth:`read`, which says why."""
        self._ahead = {}
        matches = sorted((m["file"], int(m["group"]), int(m["row"]), m.string)
                         for m in map(ROW_LOCATOR.match, set(names)) if m is not None)
        for name in (name for *_, name in matches):
            try:
                self._ahead[name] = self.read(name)
            except (FileNotFoundError, StorageError):
                continue

    def read(self, name: str) -> bytes:
        """The audio bytes of the row ``name`` locates. Raises FileNotFoundError (no such file
        here) or StorageError (its file or row group unreadable, or no such row: changed since
        it was indexed)."""
        ahead = self._ahead.pop(name, None)
        if ahead is not None:
            return ahead
        match = ROW_LOCATOR.match(name)
        if match is None:
            raise ValueError(f"not a Parquet row's locator: {name!r}")
        column = self._group(match["file"], int(match["group"]))
        row = int(match["row"])
        if row >= len(column):
            raise StorageError(f"{row_where(name)}: the row group holds {len(column)} rows (changed since it "
                               f"was indexed?)")
        value = column[row]
        if not value.is_valid:
            raise StorageError(f"{row_where(name)} holds no audio bytes")
        return value.as_py()

    def _group(self, file: str, group: int) -> Any:
        pa, _ = pyarrow_modules()
        with self._lock:
            column = self._groups.get((file, group))
            if column is not None:
                self._groups.move_to_end((file, group))
                return column
            parquet, _, bytes_path = self._file(file)
            try:
                if group >= parquet.metadata.num_row_groups:
                    raise StorageError(f"{shown(file)} has {parquet.metadata.num_row_groups} row groups, not "
                                       f"{group + 1} (changed since it was indexed?)")
                table = parquet.read_row_group(group, columns=[bytes_path])
                top, _, child = bytes_path.partition(".")
                chunks = table.column(top)
                column = chunks.chunk(0) if chunks.num_chunks == 1 else chunks.combine_chunks()
                column = column.field(child) if child else column
            except (OSError, pa.ArrowException) as exc:
                if isinstance(exc, (StorageError, FileNotFoundError)):
                    raise
                raise StorageError(f"row group {group} of {shown(file)} cannot be read: {_message(exc)}") from None
            self._groups[(file, group)] = column
            while len(self._groups) > 1 and sum(c.nbytes for c in self._groups.values()) > KEPT_GROUP_BYTES:
                self._groups.popitem(last=False)
            return column

    def _file(self, file: str) -> tuple[Any, Any, str]:
        """(ParquetFile, its handle, its audio bytes' column path) of an open file."""
        pa, pq = pyarrow_modules()
        opened = self._files.get(file)
        if opened is not None:
            self._files.move_to_end(file)
            return opened
        handle = open_file(_path(self.root, file))
        try:
            parquet = pq.ParquetFile(handle)
            found = audio_column(parquet.schema_arrow)
        except (OSError, pa.ArrowException) as exc:
            handle.close()
            if isinstance(exc, (StorageError, FileNotFoundError)):
                raise
            raise StorageError(f"Parquet file {shown(file)} cannot be read: {_message(exc)}") from None
        if found is None or not found[1]:
            handle.close()
            raise StorageError(f"Parquet file {shown(file)} has no column of audio bytes")
        self._files[file] = opened = (parquet, handle, found[1])
        while len(self._files) > MAX_OPEN_FILES:
            _, (_, oldest, _) = self._files.popitem(last=False)
            oldest.close()
        return opened

    def close(self) -> None:
        with self._lock:
            for _, handle, _ in self._files.values():
                handle.close()
            self._files.clear()
            self._groups.clear()
            self._ahead = {}


_READERS: dict[str, RowReader] = {}  # this process's, by dataset root: the index's header reads, a producer's


def row_reader(root: Path | None) -> RowReader:
    """This process's :class:`RowReader` of the dataset at ``root``."""
    reader = _READERS.get(str(root))
    if reader is None:
        for old in _READERS.values():
            old.close()
        _READERS.clear()
        reader = _READERS[str(root)] = RowReader(root)
    return reader


def probe_row(root: Path, name: str) -> AudioProbe:
    """The audio header facts of the row ``name`` locates (its bytes read, not decoded), or why it cannot be used."""
    try:
        data = row_reader(root).read(name)
    except FileNotFoundError:
        file = ROW_LOCATOR.match(name)["file"]  # type: ignore[index]
        return AudioProbe(error="audio file missing", detail=f"no Parquet file {shown(file)}")
    except StorageError as exc:
        return AudioProbe(error="audio file unreadable", detail=str(exc))
    return probe_bytes(data)
