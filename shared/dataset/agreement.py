"""Dataset agreement: what one host sees of a dataset (:class:`DatasetScan`: metadata and
audio fingerprints) and the trainer's verdict on a producer's copy (:func:`check_agreement`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping

from ..dataset.files import AUDIO_DIR, UNMEASURED, list_audio, read_metadata_bytes
from ..dataset.types import AudioFile
from ..layouts import COLUMNS_AUTO, Entry, Rejection
from ..mixes import parse_entries

# A host may lack at most this many audio files and still produce: the ids travel in
# its HELLO (about 20 bytes each, far below wire.MAX_HEADER_BYTES), and a copy missing
# more is an unfinished copy or the wrong directory, better refused with a clear reason.
MAX_MISSING_IDS = 1024


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

    def describe(self) -> dict[str, Any]:
        """The ``dataset`` field of a producer's HELLO."""
        return {"metadata_file": self.metadata_file, "columns": self.columns, "metadata": self.metadata_fp,
                "audio": self.audio_fp,
                "entries": len(self.entries), "missing": self.missing[:MAX_MISSING_IDS],
                "missing_count": len(self.missing)}


@dataclass(frozen=True)
class Agreement:
    """The trainer's verdict on a producer's dataset: refused (``reason``) or accepted."""

    ok: bool
    reason: str = ""
    lacks: frozenset[str] = frozenset()  # ids this producer has no audio for
    metadata_file: str = ""  # set when the producer read another metadata file than the trainer
    columns: str | None = None  # set with metadata_file: the data.columns to read it with


def _digest(lines: Iterable[str]) -> str:
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode("utf-8"))
    return digest.hexdigest()[:FINGERPRINT_HEX]


def metadata_fingerprint(entries: Iterable[Entry]) -> str:
    return _digest(f"{e.id}\t{e.text}\t{e.speaker}\t{e.language}\n" for e in sorted(entries, key=lambda e: e.id))


def audio_fingerprint(sizes: Mapping[str, int], without: Collection[str] = ()) -> str:
    return _digest(f"{i}\t{sizes[i]}\n" for i in sorted(sizes) if i not in without)


def fingerprints(entries: list[Entry], audio: Mapping[str, AudioFile], metadata: bytes) -> dict[str, Any]:
    """What the index stores of the trainer's scan (:class:`DatasetScan`'s fingerprints, the count of
    ids without audio, the metadata's SHA-256), so that a warm run has them without parsing the
    metadata: {"metadata", "audio", "missing", "metadata_sha256"}."""
    sizes = {e.id: audio[e.id].size if e.duration is None else UNMEASURED for e in entries
             if e.id in audio or e.duration is not None}
    return {"metadata": metadata_fingerprint(entries), "audio": audio_fingerprint(sizes),
            "missing": len(entries) - len(sizes), "metadata_sha256": hashlib.sha256(metadata).hexdigest()}


def deferred(metadata_file: str, columns: str = COLUMNS_AUTO) -> dict[str, Any]:
    """The ``dataset`` of the HELLO of a producer that reads no metadata (one the trainer's
    launcher starts on its own host: the same files): the leases carry its clips' texts and
    audio locators, and each clip is checked when read (its duration against the index's)."""
    return {"deferred": True, "metadata_file": metadata_file, "columns": columns}


def is_deferred(described: Any) -> bool:
    """Whether a HELLO's ``dataset`` is :func:`deferred`'s."""
    return isinstance(described, dict) and described.get("deferred") is True


def scan_from(root: Path, metadata_file: str, metadata: bytes, audio: Mapping[str, AudioFile],
              columns: str = COLUMNS_AUTO) -> DatasetScan:
    """The scan of metadata bytes and an audio listing (:func:`scan_audio`) already read."""
    entries, malformed = parse_entries(metadata, metadata_file, columns)
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
                       metadata_sha256=hashlib.sha256(metadata).hexdigest(), columns=columns)


def scan_dataset(root: Path, metadata_file: str = "metadata.csv", columns: str = COLUMNS_AUTO) -> DatasetScan:
    """Read the metadata and list the audio files; raise DatasetError if unreadable."""
    metadata = read_metadata_bytes(root, metadata_file)
    return scan_from(root, metadata_file, metadata, list_audio(root, metadata_file, metadata, columns), columns)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def check_agreement(reference: DatasetScan, described: Any, host: str) -> Agreement:
    """Does a producer's HELLO ``dataset`` (:meth:`DatasetScan.describe`) match ``reference``?

    Accepted: same metadata, and every audio file the producer has is the trainer's (same
    byte size); files it lacks are returned in ``lacks``. Refused otherwise, with a reason
    that names the host and says what differs. A producer having a file the trainer lacks
    is refused too: the trainer cannot check that file against anything.
    """
    if is_deferred(described):
        return Agreement(True)  # reads no metadata: each clip is checked when read (:func:`deferred`)
    fields = {"metadata_file": str, "metadata": str, "audio": str, "entries": int, "missing_count": int}
    if (not isinstance(described, dict) or not _is_str_list(described.get("missing"))
            or not all(isinstance(described.get(k), t) and not isinstance(described.get(k), bool)
                       for k, t in fields.items())):
        return Agreement(False, f"producer on {host} did not describe its dataset (a stoker without dataset "
                                "agreement?)")
    columns = described.get("columns", COLUMNS_AUTO)
    if described["metadata_file"] != reference.metadata_file or columns != reference.columns:
        return Agreement(False, f"producer on {host} read {described['metadata_file']!r} (columns {columns!r}); the "
                                f"trainer reads {reference.metadata_file!r} (columns {reference.columns!r})",
                         metadata_file=reference.metadata_file, columns=reference.columns)
    where = f"dataset on {host} does not match the trainer's"
    if described["metadata"] != reference.metadata_fp:
        return Agreement(False, f"{where}: {reference.metadata_file} differs ({described['entries']} entries, "
                                f"fingerprint {described['metadata'][:8]} there; {len(reference.entries)} entries, "
                                f"fingerprint {reference.metadata_fp[:8]} on the trainer); point --data at a copy "
                                "of the trainer's dataset")
    lacks = set(described["missing"])
    count = described["missing_count"]
    if count > MAX_MISSING_IDS or count != len(lacks):
        return Agreement(False, f"{where}: {count} of {len(reference.entries)} audio files are missing on {host} "
                                f"(at most {MAX_MISSING_IDS} may be); finish copying the dataset")
    known = {e.id for e in reference.entries}
    if not lacks <= known:
        return Agreement(False, f"{where}: it lists missing ids that are not in the metadata")
    extra = sorted(set(reference.missing) - lacks)
    if extra:
        return Agreement(False, f"{where}: {host} has {len(extra)} audio files the trainer lacks "
                                f"(e.g. {extra[0]}), so they cannot be checked; complete the trainer's copy")
    expected = (reference.audio_fp if lacks == set(reference.missing)
                else audio_fingerprint(reference.sizes, without=lacks))
    if described["audio"] != expected:
        return Agreement(False, f"{where}: audio files in {AUDIO_DIR}/ differ in size (fingerprint "
                                f"{described['audio'][:8]} there, {expected[:8]} expected); a resampled or "
                                "re-encoded copy?")
    return Agreement(True, lacks=frozenset(lacks - set(reference.missing)))
