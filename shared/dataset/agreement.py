"""Dataset agreement: what one host sees of a dataset (:class:`DatasetScan`: metadata and
audio fingerprints, stored with the index), what a producer on another host says of its copy
when joining (:func:`describe_copy`: the metadata's SHA-256, no parse and no audio listing),
the trainer's verdict on it (:func:`check_agreement`), and the per-file check at reading time
(:func:`file_sizes` on the trainer, :func:`size_problem` on the producer; on the trainer's host,
each file against the index's size and mtime: :func:`stamp_problem`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..dataset.corpus.address import File, address_of
from ..dataset.corpus.registry import format_of
from ..dataset.files import UNMEASURED
from ..dataset.types import AudioFile
from .layouts import COLUMNS_AUTO, Entry, Rejection

# Fingerprints are this many hex digits of sha256: 64 bits, ample to tell datasets apart.
FINGERPRINT_HEX = 16


@dataclass(frozen=True)
class DatasetScan:
    """What one host sees of a dataset: metadata entries and audio file sizes."""

    root: Path
    metadata_file: str
    entries: list[Entry]
    malformed: list[Rejection]  # metadata lines that are not entries
    sizes: dict[str, int]  # audio byte size of every entry whose file exists
    missing: list[str]  # entry ids without an audio file, sorted
    metadata_fp: str
    audio_fp: str
    files: dict[str, str] = field(default_factory=dict)  # audio file name by id (see scan_audio)
    metadata_sha256: str = ""  # of the metadata bytes as read, "" when not known
    columns: str = COLUMNS_AUTO  # data.columns the metadata was parsed with

    @property
    def fingerprint(self) -> str:
        """Both fingerprints as one short string, for logs and summary.json."""
        return f"{self.metadata_fp[:8]}{self.audio_fp[:8]}"


@dataclass(frozen=True)
class Agreement:
    """The trainer's verdict on a producer's dataset: refused (``reason``) or accepted."""

    ok: bool
    reason: str = ""
    metadata_file: str = ""  # set when the producer read another metadata file than the trainer
    columns: str | None = None  # set with metadata_file: the data.columns to read it with


def _digest(lines: Iterable[str]) -> str:
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode("utf-8"))
    return digest.hexdigest()[:FINGERPRINT_HEX]


def metadata_fingerprint(entries: Iterable[Entry]) -> str:
    return _digest(f"{e.id}\t{e.text}\t{e.speaker}\t{e.language}\n" for e in sorted(entries, key=lambda e: e.id))


def audio_fingerprint(sizes: Mapping[str, int]) -> str:
    return _digest(f"{i}\t{sizes[i]}\n" for i in sorted(sizes))


def fingerprints(entries: list[Entry], audio: Mapping[str, AudioFile], metadata_sha256: str) -> dict[str, Any]:
    """What the index stores of the trainer's scan (:class:`DatasetScan`'s fingerprints, the count of
    ids without audio, the metadata's SHA-256), so that a warm run has them without parsing the
    metadata: {"metadata", "audio", "missing", "metadata_sha256"}."""
    sizes = {e.id: audio[e.id].size if e.duration is None else UNMEASURED for e in entries
             if e.id in audio or e.duration is not None}
    return {"metadata": metadata_fingerprint(entries), "audio": audio_fingerprint(sizes),
            "missing": len(entries) - len(sizes), "metadata_sha256": metadata_sha256}


def scan_from(root: Path, metadata_file: str, metadata: bytes, audio: Mapping[str, AudioFile],
              columns: str = COLUMNS_AUTO) -> DatasetScan:
    """The scan of metadata bytes and an audio listing (:func:`scan_audio`) already read."""
    entries, malformed = format_of(metadata_file).parse(metadata, columns)
    return _scan(root, metadata_file, entries, malformed, audio, hashlib.sha256(metadata).hexdigest(), columns)


def _scan(root: Path, metadata_file: str, entries: list[Entry], malformed: list[Rejection],
          audio: Mapping[str, AudioFile], metadata_sha256: str, columns: str) -> DatasetScan:
    sizes: dict[str, int] = {}
    files: dict[str, str] = {}
    missing: list[str] = []
    for entry in entries:
        file = audio.get(entry.id) if entry.duration is None else AudioFile(entry.audio, UNMEASURED, UNMEASURED)
        if file is None:  # absent, or not reachable here (a dangling link): missing on this host
            missing.append(entry.id)
        else:
            sizes[entry.id] = file.size
            files[entry.id] = file.name
    return DatasetScan(root=root, metadata_file=metadata_file, entries=entries, malformed=malformed, sizes=sizes,
                       missing=sorted(missing), metadata_fp=metadata_fingerprint(entries),
                       audio_fp=audio_fingerprint(sizes), files=files,
                       metadata_sha256=metadata_sha256, columns=columns)


def scan_dataset(root: Path, metadata_file: str = "metadata.csv", columns: str = COLUMNS_AUTO) -> DatasetScan:
    """Read the metadata and list the audio files; raise DatasetError if unreadable."""
    fmt = format_of(metadata_file)
    listing = fmt.listing(root, metadata_file, columns)
    if listing.raw is not None:  # read whole: parsed as read (as scan_from does)
        entries, malformed = fmt.parse(listing.raw, columns)
    else:  # a mix's parts, read again in turn
        entries, malformed = fmt.clips(root, metadata_file, columns)
    return _scan(root, metadata_file, entries, malformed, listing.audio, listing.sha256.hex(), columns)


def metadata_sha256(root: Path, metadata_file: str = "metadata.csv") -> str:
    """The SHA-256 the trainer's index stores of its metadata (:func:`fingerprints`), of this
    host's copy: a metadata file hashed a piece at a time (never parsed nor held whole), a mix's
    blob of every dataset's metadata; for tar shards, of their names and byte sizes (one stat
    per shard, or one listing at a URL: their members are not read). DatasetError if unreadable."""
    return format_of(metadata_file).sha256(root, metadata_file)


def describe_copy(root: Path, metadata_file: str = "metadata.csv", columns: str = COLUMNS_AUTO) -> dict[str, Any]:
    """The ``dataset`` of the HELLO of a producer on another host: the metadata file it was
    pointed at, the data.columns it reads it with, and its :func:`metadata_sha256`. Its audio
    files are checked one by one when read (:func:`size_problem`)."""
    return {"metadata_file": metadata_file, "columns": columns, "sha256": metadata_sha256(root, metadata_file)}


def deferred(metadata_file: str, columns: str = COLUMNS_AUTO) -> dict[str, Any]:
    """The ``dataset`` of the HELLO of a producer that reads no metadata (one the trainer's
    launcher starts on its own host: the same files): the leases carry its clips' texts and
    audio locators, and each clip is checked when read (its duration against the index's)."""
    return {"deferred": True, "metadata_file": metadata_file, "columns": columns}


def is_deferred(described: Any) -> bool:
    """Whether a HELLO's ``dataset`` is :func:`deferred`'s."""
    return isinstance(described, dict) and described.get("deferred") is True


@dataclass
class Reference:
    """The trainer's side of the agreement: its dataset's root, metadata file and data.columns,
    and the metadata SHA-256 its index stores (:func:`fingerprints`). A shard dataset's
    :meth:`Format.sha256` (corpus/tar.py) is made when a producer on another host first joins."""

    root: Path
    metadata_file: str
    columns: str = COLUMNS_AUTO
    stored_sha256: str = ""
    _sha256: str | None = field(default=None, repr=False)

    @classmethod
    def of(cls, index: Any) -> "Reference":
        """The reference of a DatasetIndex (consumer/index/index.py; its fingerprints:
        :attr:`DatasetIndex.agreement`)."""
        return cls(index.root, index.metadata_file, index.columns, index.agreement["metadata_sha256"])

    def sha256(self) -> str:
        """What a producer's :func:`describe_copy` must say."""
        if self._sha256 is None:
            fmt = format_of(self.metadata_file)
            self._sha256 = fmt.sha256(self.root, self.metadata_file) if fmt.sharded else self.stored_sha256
        return self._sha256

    def sizes(self, files: Mapping[str, str]) -> dict[str, int]:
        """:func:`file_sizes` of the trainer's copy."""
        return file_sizes(self.root, files)


def file_sizes(root: Path, files: Mapping[str, str]) -> dict[str, int]:
    """The byte size of each clip's audio file here, by id (``files``: its name relative to
    ``root``, or absolute), which a lease to a producer on another host carries: one stat each.
    Left out: tar shard members (their shards' sizes are agreed at joining: corpus/tar.py),
    files at URLs (the same object for every host) and files absent here."""
    sizes: dict[str, int] = {}
    for sample_id, name in files.items():
        address = address_of(name)
        if not isinstance(address, File):
            continue
        try:
            sizes[sample_id] = os.stat(root / address.path).st_size  # a cut's: its recording's
        except OSError:
            continue
    return sizes


def size_problem(name: str, size: int, expected: int | None) -> str:
    """Why a producer's audio file is not the trainer's ("" when its byte size is the one its lease
    names, or the lease names none): a resampled, re-encoded or truncated copy."""
    if expected is None or size == expected:
        return ""
    return (f"{name} is {size} bytes on this host and {expected} on the trainer (a resampled, re-encoded or "
            "truncated copy?)")


def stamp_problem(name: str, st: os.stat_result | None, indexed: tuple[int, int] | None) -> str:
    """Why a clip's audio file on the trainer's host is not the one the index measured ("" when its
    size and mtime are the index's, or the lease names none): rewritten (``st``: its stat now) or
    deleted (``st`` None) since the index was built. The index's duration and frame count are of
    the file it measured: such a clip is rejected, not trained with them."""
    if indexed is None:
        return ""
    size, mtime_ns = indexed
    if st is None:
        return f"audio file missing: {name} (deleted since the index was built)"
    if st.st_size != size:
        return f"{name} changed since the index was built (size {size} -> {st.st_size})"
    if st.st_mtime_ns != mtime_ns:
        return f"{name} changed since the index was built (same size {size}, mtime {mtime_ns} -> {st.st_mtime_ns})"
    return ""


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def check_agreement(reference: Reference, described: Any, host: str) -> Agreement:
    """Does a producer's HELLO ``dataset`` (:func:`describe_copy`) match ``reference``?

    Accepted: a producer reading no metadata (:func:`deferred`), or one pointed at a copy of the
    trainer's metadata file, byte for byte (tar shards: the same shard names and sizes). Refused
    otherwise, with a reason that names the host and says what differs; one that read another
    metadata file (or with other data.columns) is told the trainer's, to describe that instead.
    Its audio files are not compared here but when read: a lease names each clip's byte size.
    """
    if is_deferred(described):
        return Agreement(True)  # reads no metadata: each clip is checked when read (:func:`deferred`)
    if not isinstance(described, dict) or not all(_is_str(described.get(k)) for k in ("metadata_file", "sha256")):
        return Agreement(False, f"producer on {host} did not describe its dataset (a stoker without dataset "
                                "agreement?)")
    columns = described.get("columns", COLUMNS_AUTO)
    if described["metadata_file"] != reference.metadata_file or columns != reference.columns:
        return Agreement(False, f"producer on {host} read {described['metadata_file']!r} (columns {columns!r}); the "
                                f"trainer reads {reference.metadata_file!r} (columns {reference.columns!r})",
                         metadata_file=reference.metadata_file, columns=reference.columns)
    expected = reference.sha256()
    if described["sha256"] != expected:
        return Agreement(False, f"dataset on {host} does not match the trainer's: {reference.metadata_file} differs "
                                f"(SHA-256 {described['sha256'][:FINGERPRINT_HEX]} there, "
                                f"{expected[:FINGERPRINT_HEX]} on the trainer); point --data at a copy of the "
                                "trainer's dataset")
    return Agreement(True)
