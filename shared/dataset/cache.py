"""The index cache: where it lives, its key, and its file format; the feature cache's directory.

A cache file is sections, each with its xxh3-64 checksum, then a small checksummed msgpack
header (the key, the config, the rejections, the vocabulary, a table of sections) at its end, so
that a build can stream its sections into the file before it knows the header (:class:`IndexWriter`):
the numeric columns and string blobs of the samples and their rows in id order
(shared/dataset/table.py), mapped read-only when loaded, and a msgpack section of what a later
rebuild can reuse (read only then).
"""

from __future__ import annotations

import array
import hashlib
import logging
import mmap
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Mapping, Sequence

import msgpack
import numpy as np
import xxhash

from ..config import DataConfig, FeaturesConfig, TextConfig
from ..dataset.table import FileBlob
from ..dataset.types import AudioFile
from .layouts import Rejection
from ..runfiles import replacing
from ..text import Frontend
from ..vocab import Vocabulary

log = logging.getLogger(__name__)


# Bump when the cache layout or any rule that derives the index from its inputs changes.
INDEX_FORMAT = 10  # 10: the header after the sections (a build streams them)


# Cache files start and end with this magic; before the last, the header's SHA-256 and length.
INDEX_CACHE_MAGIC = b"STKIDX04"


# What files of earlier formats start with: such a file is rebuilt, said as that, never read.
OLD_MAGICS = (b"STKIDX03", b"STKIDX02", b"STKIDX01")


# Sections start at multiples of this many bytes: every numpy type is aligned in the mapped file.
SECTION_ALIGN = 64


# A header longer than this is not one this code wrote (it holds the rejections and the
# vocabulary, not the samples); reading stops there rather than allocating what a damaged
# length field says.
MAX_HEADER_BYTES = 1 << 30


# Sections are checked this much of the mapped file at a time, each piece's pages let go of once
# hashed (a warm load of 10 M clips hashes ~1 GB: it would otherwise all count as the process's memory).
CHECK_CHUNK_BYTES = 8 << 20


# "" in data.index_cache: the dataset's own hidden directory, else the user cache dir.
DATASET_CACHE_DIR = ".stoker"


INDEX_CACHE_OFF = "off"


FEATURE_CACHE_AUTO = "auto"


def index_config(data: DataConfig, features: FeaturesConfig, text: TextConfig, frontend: Frontend,
                 vocabulary: Vocabulary | None = None) -> dict[str, Any]:
    """Everything the index depends on besides the files: part of the cache key."""
    return {
        "format": INDEX_FORMAT, "frontend": frontend.name, "engine": frontend.cache_key(),
        "language": text.language,
        "max_lost_frac": text.max_lost_frac, "vocabulary": vocabulary.fingerprint if vocabulary else "",
        "columns": data.columns, "metadata_file": data.metadata_file, "min_audio_s": data.min_audio_s,
        "max_audio_s": data.max_audio_s,
        "max_tokens": data.max_tokens, "sample_rate_hz": features.sample_rate_hz, "n_fft": features.n_fft,
        "hop_length": features.hop_length, "padding": features.padding,
    }


def index_key(metadata: bytes, audio: dict[str, AudioFile], config: dict[str, Any]) -> str:
    """SHA-256 over the metadata bytes, every audio file's name, size and mtime, and the config."""
    return index_key_of(hashlib.sha256(metadata).digest(), audio, config)


def index_key_of(metadata_sha256: bytes, audio: dict[str, AudioFile], config: dict[str, Any]) -> str:
    """:func:`index_key` of metadata known by its SHA-256 (a manifest never held whole)."""
    digest = hashlib.sha256()
    digest.update(repr(sorted(config.items())).encode())
    digest.update(metadata_sha256)
    files = [audio[stem] for stem in sorted(audio)]
    digest.update("\0".join([f.name for f in files]).encode("utf-8", "surrogateescape"))
    digest.update(array.array("q", [f.size for f in files]).tobytes())
    digest.update(array.array("q", [f.mtime_ns for f in files]).tobytes())
    return digest.hexdigest()


def remote_root(pattern: str) -> Path:
    """The local directory standing for a dataset at a URL: where its index and feature caches live."""
    return user_cache_dir() / "remote" / hashlib.sha256(pattern.encode("utf-8")).hexdigest()[:16]


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/stoker`` or ``~/.cache/stoker``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "stoker"


def _name_hash(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogateescape")).hexdigest()[:16]


def index_cache_file(root: Path, data: DataConfig) -> list[Path]:
    """Where the index cache may live, in order of preference (empty: caching is off).

    ``data.index_cache``: "" tries ``DATASET/.stoker/`` first and falls back to the user
    cache dir (a read-only dataset); "off" disables the cache; a directory is used as
    given. Outside the dataset, the file name includes a hash of the dataset path.
    """
    setting = data.index_cache.strip()
    if setting.lower() == INDEX_CACHE_OFF:
        return []
    meta_tag = _name_hash(data.metadata_file)
    outside = f"index-{_name_hash(str(root), data.metadata_file)}.idx"
    if setting:
        return [Path(setting).expanduser() / outside]
    return [root / DATASET_CACHE_DIR / f"index-{meta_tag}.idx", user_cache_dir() / "index" / outside]


def mel_stats_file(root: Path, data: DataConfig, key: str) -> Path | None:
    """Where the mel statistics of a dataset under the settings ``key`` (a hash) are kept,
    beside the index cache (None: caching is off)."""
    candidates = index_cache_file(root, data)
    return candidates[0].with_name(f"mel-stats-{key}.json") if candidates else None


def feature_cache_dir(setting: str, root: Path) -> str:
    """The directory ``data.feature_cache`` names, absolute: "" (off), "auto", or a path.

    "auto" is ``DATASET/.stoker/features`` when the dataset directory is writable, else
    ``~/.cache/stoker/features`` (logged).
    """
    setting = setting.strip()
    if not setting:
        return ""
    if setting.lower() != FEATURE_CACHE_AUTO:
        return str(Path(setting).expanduser().resolve())
    inside = root / DATASET_CACHE_DIR / "features"
    try:
        inside.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=inside)
        os.close(fd)
        os.unlink(probe)
        return str(inside)
    except OSError as exc:
        fallback = user_cache_dir() / "features"
        log.info("cannot write the feature cache in %s (%s); using %s", inside, exc.strerror or exc, fallback)
        return str(fallback)


@dataclass
class CachedIndex:
    """An index cache file as read: its header (the key, the config, the rejections, the
    vocabulary, the section table) and its sections, views of the file mapped read-only.
    ``file``: the whole mapped file; ``start``: where its sections begin."""

    header: dict[str, Any]
    sections: dict[str, memoryview]
    file: memoryview = field(default_factory=lambda: memoryview(b""))
    start: int = 0
    checked: bool = False
    reader: BinaryIO | None = None  # the file open for reading (a descriptor of its own): FileBlob's

    def blob(self, name: str) -> FileBlob | memoryview:
        """Section ``name`` left in the file, read a slice at a time (:class:`FileBlob`), or its
        mapped view where the file is not open for that."""
        if self.reader is None:
            return self.sections[name]
        offset, nbytes, _ = self.header["sections"][name]
        return FileBlob(self.reader, self.start + offset, nbytes)

    def unpack(self, name: str) -> Any:
        """A msgpack section; ValueError when it cannot be parsed."""
        try:
            return msgpack.unpackb(self.sections[name], raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several types for bad data
            raise ValueError(f"bad section {name} ({type(exc).__name__})") from None

    def check(self) -> "CachedIndex":
        """Every section with its padding against its checksum; ValueError on a mismatch. Hashed
        from the mapping :data:`CHECK_CHUNK_BYTES` at a time, each piece's pages let go of after:
        only the pages a run reads later become its memory."""
        if self.checked:
            return self
        for offset, nbytes, checksum in self.header["sections"].values():
            first, end = self.start + offset, self.start + offset + nbytes + -nbytes % SECTION_ALIGN
            digest = xxhash.xxh3_64()
            for at in range(first, end, CHECK_CHUNK_BYTES):
                digest.update(self.file[at:min(end, at + CHECK_CHUNK_BYTES)])
                _let_go(self.file, at, min(end, at + CHECK_CHUNK_BYTES))
            if digest.intdigest() != checksum:
                raise ValueError("checksum mismatch")
        self.checked = True
        return self


def _let_go(file: memoryview, start: int, end: int) -> None:
    """Drop the whole pages of bytes [start, end) of a mapped file from this process: clean pages
    of a file, read again from the page cache if touched."""
    mapped = file.obj
    if isinstance(mapped, mmap.mmap) and hasattr(mapped, "madvise"):  # madvise: not on every platform
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        last = end // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            mapped.madvise(mmap.MADV_DONTNEED, first, last - first)


def _buffer(data: bytes | np.ndarray | memoryview) -> memoryview:
    return memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)


class OldFormat(ValueError):
    """A cache file of an earlier format: rebuilt, not misread."""


# What ends a cache file: the header's SHA-256, its length and the magic.
TRAILER_BYTES = 32 + 8 + len(INDEX_CACHE_MAGIC)


Data = bytes | np.ndarray | memoryview


class IndexWriter:
    """A cache file written front to back: the magic, each section as it comes (whole or in
    chunks, each checksummed with its padding and aligned), then the header with the section
    table (name -> [offset from the data start, bytes, xxh3-64]) and the trailer."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.table: dict[str, list[int]] = {}
        self.offset = 0
        lead = INDEX_CACHE_MAGIC + bytes(-len(INDEX_CACHE_MAGIC) % SECTION_ALIGN)
        f.write(lead)
        self.start = len(lead)

    def add(self, name: str, data: Data | Iterable[Data]) -> None:
        """Section ``name``: one buffer, or an iterable of them written one after another."""
        digest = xxhash.xxh3_64()
        nbytes = 0
        for chunk in (data,) if isinstance(data, (bytes, np.ndarray, memoryview)) else data:
            view = _buffer(chunk)
            digest.update(view)
            self.f.write(view)
            nbytes += view.nbytes
        pad = bytes(-nbytes % SECTION_ALIGN)
        digest.update(pad)  # the padding checked too
        self.f.write(pad)
        self.table[name] = [self.offset, nbytes, digest.intdigest()]
        self.offset += nbytes + len(pad)

    def finish(self, header: dict[str, Any]) -> None:
        head = msgpack.packb({**header, "format": INDEX_FORMAT, "sections": self.table}, use_bin_type=True)
        self.f.write(head + hashlib.sha256(head).digest() + struct.pack("<Q", len(head)) + INDEX_CACHE_MAGIC)
        self.f.flush()


def write_index(f: BinaryIO, header: dict[str, Any], sections: Mapping[str, Data | Iterable[Data]]) -> None:
    """A cache file of ``header`` and ``sections`` (each a buffer or an iterable of them) to ``f``."""
    writer = IndexWriter(f)
    for name, data in sections.items():
        writer.add(name, data)
    writer.finish(header)


def open_index(path: Path, check: bool = True) -> CachedIndex:
    """A cache file's header and sections, mapped read-only; ValueError if it is not one, fails a
    checksum or does not hold what its header says (:class:`OldFormat`: one of an earlier format).
    ``check`` False: the sections are not hashed yet (:meth:`CachedIndex.check`, before they are
    used), so a file whose header tells it is not the one wanted costs only its header."""
    with open(path, "rb") as f:
        lead = f.read(len(INDEX_CACHE_MAGIC))
        if lead in OLD_MAGICS:
            raise OldFormat("of an earlier format")
        size = os.fstat(f.fileno()).st_size
        start = len(INDEX_CACHE_MAGIC) + -len(INDEX_CACHE_MAGIC) % SECTION_ALIGN
        if lead != INDEX_CACHE_MAGIC or size < start + TRAILER_BYTES:
            raise ValueError("not an index cache file of this version")
        f.seek(size - TRAILER_BYTES)
        trailer = f.read(TRAILER_BYTES)
        (length,) = struct.unpack("<Q", trailer[32:40])
        if trailer[40:] != INDEX_CACHE_MAGIC or length > min(MAX_HEADER_BYTES, size - start - TRAILER_BYTES):
            raise ValueError("cut short")
        f.seek(size - TRAILER_BYTES - length)
        head = f.read(length)
        if hashlib.sha256(head).digest() != trailer[:32]:
            raise ValueError("checksum mismatch")
        try:
            header = msgpack.unpackb(head, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several types for bad data
            raise ValueError(f"bad header ({type(exc).__name__})") from None
        if not isinstance(header, dict) or header.get("format") != INDEX_FORMAT:
            raise ValueError("unknown payload format")
        table = header.get("sections")
        if not isinstance(table, dict):
            raise ValueError("no section table")
        for name, (offset, nbytes, _) in table.items():
            if start + offset + nbytes + -nbytes % SECTION_ALIGN > size - TRAILER_BYTES - length:
                raise ValueError(f"section {name} is cut short")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        reader = os.fdopen(os.dup(f.fileno()), "rb")  # this very file, even if a new one takes its name
    view = memoryview(mapped)
    sections = {name: view[start + offset:start + offset + nbytes] for name, (offset, nbytes, _) in table.items()}
    cached = CachedIndex(header, sections, view, start, reader=reader)
    return cached.check() if check else cached


# The line a cache file of another key is rebuilt with (its metadata changed, or how the key is
# made: a mix's is of its parts' SHA-256s, no longer of all their bytes).
STALE_CACHE = "index cache %s is of other metadata or of an earlier key; rebuilding the index"


def read_cache(candidates: list[Path], key: str) -> tuple[Path | None, CachedIndex | None, str]:
    """The cache file for ``key`` if one exists: (path, its content, state).

    state: "hit" (a candidate holds this key), "stale" (the content returned is an older
    index, reusable in part), "corrupt" (a candidate failed its checksum and nothing
    else was usable) or "miss" (no cache file at all).
    """
    reusable: tuple[Path, CachedIndex] | None = None
    corrupt = False
    for path in candidates:
        try:
            cached = open_index(path, check=False)
            if cached.header.get("key") != key and reusable is not None:
                continue  # neither the one wanted nor the first reusable: its sections are not read
            cached.check()
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OldFormat:
            log.info("index cache %s is of an earlier stoker's format; rebuilding the index", path)
            continue
        except ValueError as exc:
            log.warning("index cache %s is corrupt (%s); rebuilding the index", path, exc)
            corrupt = True
            continue
        except OSError as exc:
            log.warning("cannot read index cache %s (%s); ignoring it", path, exc.strerror)
            continue
        if cached.header.get("key") == key:
            return path, cached, "hit"
        reusable = (path, cached)
    if reusable is not None:
        return reusable[0], reusable[1], "stale"
    return None, None, "corrupt" if corrupt else "miss"


def write_cache(candidates: list[Path], header: dict[str, Any],
                sections: Mapping[str, Data | Iterable[Data]]) -> Path | None:
    """:func:`write_index` to the first candidate that accepts it; log a fall-back; never raise."""
    return write_cache_with(candidates, lambda f: write_index(f, header, sections))


def write_cache_with(candidates: list[Path], write: Callable[[BinaryIO], None]) -> Path | None:
    """``write`` (a whole cache file, to a file open for writing and reading) to the first
    candidate that accepts it, called again for the next one after a failure; log a fall-back;
    never raise."""
    for n, path in enumerate(candidates):
        try:
            with replacing(path) as tmp:
                with open(tmp, "w+b") as f:
                    write(f)
        except OSError as exc:
            nxt = candidates[n + 1] if n + 1 < len(candidates) else None
            if nxt is not None:
                log.info("cannot write the index cache in %s (%s); using %s", path.parent,
                         exc.strerror or exc, nxt.parent)
            else:
                log.warning("cannot write the index cache %s (%s); the next run indexes again", path,
                            exc.strerror or exc)
            continue
        return path
    return None


def columns_of(rows: Iterable[Any], names: Sequence[str]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {n: [] for n in names}
    for row in rows:
        for n in names:
            out[n].append(getattr(row, n))
    return out


REJECTION_FIELDS = ("id", "reason", "line", "file", "kind")


PROBE_FIELDS = ("name", "size", "mtime_ns", "frames", "rate", "channels", "error", "detail")


UNITS_FIELDS = ("language", "text", "units", "lost")


def rejections_of(columns: dict[str, list[Any]]) -> list[Rejection]:
    return [Rejection(i, reason, "index", line, file, kind)
            for i, reason, line, file, kind in zip(*(columns[f] for f in REJECTION_FIELDS))]
