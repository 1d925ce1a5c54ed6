"""Bytes of a dataset's files, on this host's file system or at an fsspec URL (``s3://``,
``gs://``, ``http(s)://``; s3fs for S3, the ``s3`` extra).

:class:`Reader` keeps a few shards open and reads members from them; a read at a URL goes
through a bounded read-ahead and is retried on a fresh handle when it fails in transit, each
retry counted in :data:`COUNTS`; :func:`shown` is a URL as a log may show it. The read-ahead,
the retries, credentials and stamps: docs/design/data.md, "Tar shards and object stores".
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import io
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterable

from ..dataset.types import DatasetError, Shard
from .layouts import is_url, shown  # a URL or a path of this host, a URL shown safely (shared/dataset/layouts.py)

log = logging.getLogger(__name__)


# Bytes fetched ahead of a read from an object store: a tar shard of short clips holds ~20
# members of ~200 kB in this, so consecutive members cost one request; a bound, so that a
# producer holding a few shards open holds a few such buffers.
READ_AHEAD_BYTES = 4 << 20


# A read failing in transit is tried again this many times (on a fresh handle), then the clip
# is rejected with the error: a flaky connection costs a retry, a dead store a rejection.
READ_RETRIES = 4


# Seconds before the first retry, doubled for each next one (0.1, 0.2, 0.4, 0.8: 1.5 s in all).
RETRY_BACKOFF_S = 0.1


# Files a reader keeps open: the shards a producer is reading from at once (batching.shard_window
# of them, for the plan's default window, plus one being left).
MAX_OPEN_FILES = 8


# Fields of fsspec's info() that name an object's version (S3's VersionId and ETag, GCS's
# generation and etag, an HTTP server's ETag), in order; a store that gives none of them is asked
# for a modification time (MTIME_FIELDS).
VERSION_FIELDS = ("VersionId", "generation", "ETag", "etag")


MTIME_FIELDS = ("LastModified", "updated", "mtime", "Last-Modified")


# An object's version stamp (object_version): this many bytes of a hash of its version fields,
# so that it is a non-negative int64, as a file's mtime_ns is where the feature cache keeps it.
STAMP_BYTES = 7


# Version lookups in flight at once (object_versions): a batch's clips each cost a round trip
# to the store, which overlap instead of adding up; a bound, as the store's connections are.
VERSION_LOOKUPS = 16


class StorageError(OSError):
    """A read that failed for good (after its retries); ``str(exc)`` is one line, no credentials."""


@dataclass
class ReadCounts:
    """What this process's reads did: retries of reads that failed in transit."""

    retries: int = 0


COUNTS = ReadCounts()


def url_fs(url: str) -> tuple[Any, str]:
    """(fsspec file system, path within it) of a URL; DatasetError-worthy failures raise StorageError."""
    import fsspec  # only datasets at a URL need it (an optional extra for some protocols)

    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise StorageError(f"cannot read {shown(url)}: {exc}") from None
    if hasattr(fs, "retries"):  # s3fs: this module retries, and counts (docs/design/data.md, "Tar shards and object stores")
        fs.retries = 1
    return fs, path


def transit_errors() -> tuple[type[BaseException], ...]:
    """The exceptions of a read that failed in transit (worth a retry on a fresh handle)."""
    errors: list[type[BaseException]] = [OSError, TimeoutError, EOFError]
    try:
        import aiohttp  # s3fs's and fsspec http's transport

        errors.append(aiohttp.ClientError)
    except ImportError:
        pass  # no aiohttp: no protocol that raises its errors is in use
    try:
        import botocore.exceptions  # s3fs's client, only for S3 URLs

        errors.append(botocore.exceptions.BotoCoreError)
    except ImportError:
        pass  # no botocore: no S3
    return tuple(errors)


class RetryingFile(io.RawIOBase):
    """A file at a URL, read through fsspec with the bounded read-ahead; a read failing in
    transit is retried from the same position on a fresh handle (docs/design/data.md, "Tar shards
    and object stores").
    ``block_size``: the read-ahead; a reader of a few header bytes asks for little more."""

    def __init__(self, url: str, block_size: int = READ_AHEAD_BYTES) -> None:
        super().__init__()
        self.url = url
        self.block_size = block_size
        self._fs, self._path = url_fs(url)
        self._file: Any = None
        self._pos = 0
        self._errors = transit_errors()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self._pos = offset
        elif whence == io.SEEK_CUR:
            self._pos += offset
        else:
            self._pos = self._attempts(lambda f: f.size) + offset
        return self._pos

    def read(self, size: int = -1) -> bytes:
        def read(f: Any) -> bytes:
            f.seek(self._pos)
            return f.read(size)

        data = self._attempts(read)
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def _attempts(self, action: Callable[[Any], Any]) -> Any:
        for attempt in range(READ_RETRIES + 1):
            try:
                if self._file is None:
                    self._file = self._fs.open(self._path, "rb", block_size=self.block_size, cache_type="readahead")
                return action(self._file)
            except FileNotFoundError:
                raise
            except self._errors as exc:  # in transit: a fresh handle, after a pause
                self._drop()
                if attempt == READ_RETRIES:
                    raise StorageError(f"cannot read {shown(self.url)} at byte {self._pos}: {type(exc).__name__}: "
                                       f"{first_line(exc)} (after {READ_RETRIES} retries)") from None
                COUNTS.retries += 1
                log.warning("read of %s at byte %d failed (%s); retry %d of %d", shown(self.url), self._pos,
                            type(exc).__name__, attempt + 1, READ_RETRIES)
                time.sleep(RETRY_BACKOFF_S * 2 ** attempt)  # backing off from a struggling store
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _drop(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except self._errors:
                log.debug("closing %s failed after a failed read", shown(self.url))
            self._file = None

    def close(self) -> None:
        self._drop()
        super().close()


def first_line(exc: BaseException) -> str:
    """An exception's message, its first line (a message may carry a server's whole reply),
    with the URLs in it as :func:`shown` shows them."""
    text = str(exc).strip()
    return shown(text.splitlines()[0]) if text else ""


class Reader:
    """Reads byte ranges of files below ``root`` (or at URLs), keeping the last
    :data:`MAX_OPEN_FILES` open: a producer reads a shard's members one after the other
    through one handle. One thread reads (a producer's compute thread; the index's)."""

    def __init__(self, root: Path | None = None, max_open: int = MAX_OPEN_FILES) -> None:
        self.root = root
        self.max_open = max_open
        self._open: collections.OrderedDict[str, IO[bytes]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._ahead: dict[tuple[str, int, int], bytes] = {}  # read by prefetch, not yet asked for

    def prefetch(self, ranges: Iterable[tuple[str, int, int]]) -> None:
        """Read ``(name, offset, size)`` ranges in file and offset order (each file once, forward:
        what a read-ahead serves best), to be taken by :meth:`read` in any order. What was
        prefetched before and not taken is dropped. A range that cannot be read is left for its
        :meth:`read`, which says why."""
        self._ahead = {}
        for name, offset, size in sorted(set(ranges)):
            try:
                self._ahead[name, offset, size] = self.read(name, offset, size)
            except (FileNotFoundError, StorageError):
                continue  # its own read raises, with the reason

    def read(self, name: str, offset: int, size: int) -> bytes:
        """``size`` bytes of file ``name`` (relative to ``root``, absolute, or a URL) from ``offset``.

        Raises FileNotFoundError (not on this host) or StorageError (unreadable, or fewer bytes
        than asked: the file changed since it was indexed)."""
        ahead = self._ahead.pop((name, offset, size), None)
        if ahead is not None:
            return ahead
        with self._lock:
            try:
                handle = self._handle(name)
                handle.seek(offset)
                data = handle.read(size)
            except FileNotFoundError:
                self._close(name)
                raise
            except StorageError:
                self._close(name)
                raise
            except OSError as exc:
                self._close(name)
                raise StorageError(f"cannot read {shown(name)} at byte {offset}: {exc.strerror or exc}") from None
            if len(data) != size:
                raise StorageError(f"{shown(name)} holds {len(data)} of the {size} bytes from byte {offset} "
                                   f"(changed since it was indexed?)")
            return data

    def _handle(self, name: str) -> IO[bytes]:
        handle = self._open.get(name)
        if handle is not None:
            self._open.move_to_end(name)
            return handle
        handle = open_file(name if is_url(name) or self.root is None else str(self.root / name))
        self._open[name] = handle
        while len(self._open) > self.max_open:
            _, oldest = self._open.popitem(last=False)
            oldest.close()
        return handle

    def _close(self, name: str) -> None:
        handle = self._open.pop(name, None)
        if handle is not None:
            handle.close()

    def close(self) -> None:
        with self._lock:
            for name in list(self._open):
                self._close(name)


def read_url(url: str) -> bytes:
    """The whole file at ``url`` (a loose audio file, a manifest), read through
    :class:`RetryingFile`: a read failing in transit is retried and counted. Raises
    FileNotFoundError (no such file) or StorageError (unreadable after its retries)."""
    with RetryingFile(url) as f:
        return f.read()


def file_stamp(where: str) -> str:
    """What tells the file at ``where`` (a path here, or a URL) from another version of it without
    reading it: its byte size and modification time here; at a URL its size and the version or
    ETag the store's info() gives (else its modification time), one request. "" when there is
    no such file or the store gives no size or none of those (then only the content tells)."""
    if not is_url(where):
        try:
            st = os.stat(where)
        except OSError:
            return ""
        return f"size={st.st_size};mtime_ns={st.st_mtime_ns}"
    try:
        found = _url_version(where)
    except (FileNotFoundError, StorageError, ValueError, *transit_errors()) as exc:
        log.info("cannot look up %s (%s): its content is hashed instead", shown(where), type(exc).__name__)
        return ""
    return ";".join([f"size={found[0]}", *found[1]]) if found else ""


def object_version(url: str) -> tuple[int, int] | None:
    """(byte size, version stamp) of the object at ``url``, one request and no byte of its
    content: the stamp a hash of the version or ETag its store gives (else its modification
    time), as :func:`file_stamp` takes them, as a non-negative int64. None when there is no such
    object, the store cannot be asked now, or it tells no size or version."""
    try:
        found = _url_version(url)
    except (FileNotFoundError, StorageError, ValueError, *transit_errors()) as exc:
        log.debug("cannot look up %s (%s)", shown(url), type(exc).__name__)
        return None
    if found is None:
        return None
    digest = hashlib.sha256(";".join(found[1]).encode()).digest()
    return found[0], int.from_bytes(digest[:STAMP_BYTES], "little")


def object_versions(urls: Iterable[str]) -> dict[str, tuple[int, int] | None]:
    """:func:`object_version` of each of ``urls`` (each once), :data:`VERSION_LOOKUPS` at a time."""
    unique = sorted(set(urls))
    if len(unique) <= 1:
        return {url: object_version(url) for url in unique}
    with concurrent.futures.ThreadPoolExecutor(min(VERSION_LOOKUPS, len(unique))) as pool:
        return dict(zip(unique, pool.map(object_version, unique)))


def _url_version(url: str) -> tuple[int, list[str]] | None:
    """(size, ``NAME=VALUE`` of the version fields) that fsspec's info() gives of ``url``; None
    when it gives no size or none of them. Raises what the lookup raises."""
    fs, path = url_fs(url)
    fs.invalidate_cache(path)  # a listing cached by this process may be of an older version
    info = fs.info(path)
    tags = [f"{name}={info[name]}" for name in VERSION_FIELDS if info.get(name)] \
        or [f"{name}={info[name]}" for name in MTIME_FIELDS if info.get(name)]
    if info.get("size") is None or not tags:
        return None
    return int(info["size"]), tags


def open_file(path: str) -> IO[bytes]:
    """A binary file object of a local path, or of a URL (:class:`RetryingFile`)."""
    if not is_url(path):
        return open(path, "rb")
    return RetryingFile(path)  # type: ignore[return-value]


# A metadata file is hashed this much at a time, so that neither a producer nor a warm load holds it whole.
HASH_CHUNK_BYTES = 8 << 20


def file_sha256(where: str) -> str:
    """SHA-256 (hex) of a file here or at a URL, read a piece at a time (never held whole);
    OSError (StorageError at a URL) when it cannot be read."""
    digest = hashlib.sha256()
    with open_file(where) as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def remote_stat(url: str) -> tuple[int, int] | None:
    """(size, modification stamp) of the file at ``url``, or None when there is none; DatasetError
    when the store cannot be asked (no such bucket, no credentials, no connection)."""
    try:
        fs, path = url_fs(url)
        info = fs.info(path)
    except FileNotFoundError:
        return None
    except (ValueError, StorageError, *transit_errors()) as exc:
        raise DatasetError(f"cannot look up {shown(url)}: {type(exc).__name__}: {first_line(exc)}") from None
    if info.get("type", "file") != "file":
        return None
    return int(info.get("size") or 0), stamp_of(info)


def list_remote(url: str) -> list[Shard]:
    """The files directly in the directory at ``url`` (one listing, paged by the store), each
    named by its URL, with its size and modification stamp; none when there is no such
    directory. DatasetError when the store cannot be asked (as :func:`remote_stat`)."""
    try:
        fs, path = url_fs(url)
        infos = fs.ls(path.rstrip("/"), detail=True)
    except FileNotFoundError:
        return []
    except (ValueError, StorageError, *transit_errors()) as exc:
        raise DatasetError(f"cannot list {shown(url)}: {type(exc).__name__}: {first_line(exc)}") from None
    directory = url.rstrip("/")  # each file's URL: the directory's and its name (a store's own names vary)
    return [Shard(f"{directory}/{info['name'].rstrip('/').rpartition('/')[2]}", int(info.get("size") or 0),
                  stamp_of(info)) for info in infos if info.get("type", "file") == "file"]


def stamp_of(info: dict[str, Any]) -> int:
    """A remote file's modification stamp, as an integer (its ETag's hash when it has no time)."""
    when = info.get("LastModified") or info.get("mtime") or info.get("updated")
    if hasattr(when, "timestamp"):
        return int(when.timestamp() * 1e9)
    tag = str(info.get("ETag") or info.get("etag") or when or "")
    return int.from_bytes(hashlib.sha256(tag.encode()).digest()[:7], "little")
