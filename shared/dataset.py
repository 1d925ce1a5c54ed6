"""The dataset index: which clips exist, how long they are, and which were rejected.

Layout (LJSpeech): ``DIR/metadata.csv`` with one ``id|text|normalized_text`` line per
clip (a plain ``id|text`` line is accepted too; the last field is the text used), and
the audio in ``DIR/wavs/<id>.<suffix>``: any format libsndfile reads (wav, flac, ogg,
...; :data:`AUDIO_SUFFIXES` in order of preference when an id has several files).

The index reads only metadata and audio *headers* (``soundfile.info``, plus a RIFF chunk
walk that catches truncated WAV files), never decodes audio, so the consumer can plan
an epoch before any producer has started. Producers read the same metadata with
:func:`read_metadata` and find the same files with :func:`scan_audio`.

Every clip that cannot be used becomes a :class:`Rejection` with a precise reason
naming the file and the metadata line; the run records them in ``rejected.jsonl`` and
counts them in summary.json. Nothing a dataset holds makes indexing raise, except a
dataset that cannot be used at all (:class:`DatasetError`).

Index cache
-----------
A built index is stored (``data.index_cache``; see :func:`index_cache_file`) under a
key: a SHA-256 over the metadata bytes, the name, size and mtime of every audio file,
the config keys the index depends on (:func:`index_config`) and :data:`INDEX_FORMAT`.
A matching cache file is loaded instead of building (no header is read). On any
change the index is derived again, reusing what is still valid: header facts of audio
files whose name, size and mtime are unchanged, and token counts of unchanged texts;
only changed or new files are read. A cache file that fails its checksum or cannot be
parsed is ignored (logged) and rebuilt from scratch. Headers are read by
``data.index_workers`` processes when the work would outlast starting them
(:data:`PARALLEL_MIN_SECONDS`).

Dataset agreement
-----------------
A producer on another host must read the same dataset as the trainer. Both sides
compute a :class:`DatasetScan` from the metadata (parsed by shared/layouts.py's
:func:`parse_entries`, the one metadata reader) and the audio listing of
:func:`list_audio` (no audio is decoded; 13,100 LJSpeech clips take well under a second)
and compare two fingerprints:

    metadata  sha256 of ``id TAB text TAB speaker TAB language LF`` per metadata entry,
              sorted by id (line order, the unused middle column and malformed lines do
              not count)
    audio     sha256 of ``id TAB byte-size LF`` per audio file present, sorted by id

Paths and modification times are left out on purpose: a copy on another host lives
under another directory and ``cp``/``scp`` reset mtimes, yet it is the same data.
Byte sizes catch a resampled, re-encoded or truncated copy cheaply. A producer may lack
some audio files (an unfinished copy): it lists them in its HELLO, the trainer checks
the rest of the index against its own and never gives that producer those samples
(:func:`check_agreement`). The trainer's scan comes with its index
(:attr:`DatasetIndex.scan`), derived from the bytes and listing the index was keyed on.
"""

from __future__ import annotations

import array
import collections
import concurrent.futures
import dataclasses
import gc
import hashlib
import logging
import math
import multiprocessing
import os
import stat as stat_module
import struct
import tempfile
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping, NamedTuple, Sequence

from shared.config import DataConfig, FeaturesConfig, TextConfig
from shared.errors import UserError
from shared.layouts import (COLUMNS_AUTO, MIX_ID_SEPARATOR, Entry, LayoutError, Rejection, is_manifest, is_mix,
                            pack_mix, parse_entries, parse_mix_spec, unpack_mix)
from shared.runfiles import write_atomic
from shared.text import LANGUAGES, LOST_EXAMPLES, Frontend, TextError, Units, Vocabulary, make_frontend

log = logging.getLogger(__name__)

DEMO_DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "demo"
AUDIO_DIR = "wavs"
AUDIO_SUFFIX = ".wav"  # the LJSpeech suffix, named in "missing" reasons
# Suffixes of formats libsndfile reads, in order of preference when one id has several.
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aiff", ".aif", ".aifc", ".au", ".w64",
                  ".rf64", ".caf")

# Bump when the cache layout or any rule that derives the index from its inputs changes.
INDEX_FORMAT = 4
# Cache files start with this magic, then the SHA-256 of the msgpack payload that follows.
INDEX_CACHE_MAGIC = b"STKIDX02"
# "" in data.index_cache: the dataset's own hidden directory, else the user cache dir.
DATASET_CACHE_DIR = ".stoker"
INDEX_CACHE_OFF = "off"
FEATURE_CACHE_AUTO = "auto"
# Header reads are shared with spawned helper processes only when the work would take
# this long in one process: a helper needs ~0.5 s to start (a fresh interpreter importing
# numpy and this package), so shorter work is done sooner alone.
PARALLEL_MIN_SECONDS = 2.0
# Clips whose metadata names no speaker are this speaker's.
DEFAULT_SPEAKER = "default"
# A dataset where more than this share of the clips is rejected for one cause ends the run
# with one line naming the cause and the setting that fixes it (a wrong front-end,
# language or column mapping rejects nearly everything).
MOSTLY_REJECTED_FRAC = 0.5
# Estimated cost of one item, to apply that rule before reading anything (measured on a
# 2-core VM): a WAV header walk, a libsndfile header read, a FLAC header plus the decode
# of its last block, and one text's tokenization.
WAV_HEADER_S = 50e-6
OTHER_HEADER_S = 100e-6
FLAC_HEADER_S = 400e-6
TEXT_S = 10e-6
PHONEMES_S = 400e-6  # one sentence through espeak-ng
# Headers per task handed to a worker: large enough to amortise the task overhead,
# small enough that the last tasks balance the load.
CHUNK_ITEMS = 1000
# Texts through the phonemizer cost ~8x a header: smaller chunks, so the last ones still balance.
PHONEME_CHUNK_ITEMS = 250
# A RIFF header (fmt, LIST, fact chunks) nearly always fits in this; larger chunks are
# skipped by seeking, not read.
RIFF_PROBE_BYTES = 4096
# RIFF/RF64 data sizes that mean "unknown, read to the end" (streamed writers).
RIFF_UNKNOWN_SIZES = (0, 0xFFFFFFFF)
# Longest libsndfile message kept in a reason.
MAX_DETAIL_CHARS = 160


class DatasetError(UserError):
    """The dataset as a whole cannot be used (missing, unreadable, no usable clip)."""


class Sample(NamedTuple):
    """One usable clip: enough to plan batches without decoding audio.

    A NamedTuple, not a frozen dataclass: a warm index load makes one per clip, and a
    tuple is built several times faster.
    """

    id: str
    text: str
    num_tokens: int  # including EOS
    num_frames: int  # mel frames at the configured rate and hop
    duration_s: float
    audio: str = ""  # file name in the audio directory ("" for synthetic samples)
    line: int = 0  # metadata line
    language: str = ""  # language code (the metadata's, else text.language)
    speaker: str = ""  # speaker name (the metadata's, else DEFAULT_SPEAKER)
    units: str = ""  # what the text front-end made of the text (Vocabulary.encode gives the ids)


class AudioFile(NamedTuple):
    """One file of the audio directory, as listed (no header read)."""

    name: str
    size: int
    mtime_ns: int


class AudioProbe(NamedTuple):
    """What an audio header says, or why the file cannot be used.

    ``error`` names the fault ("audio file truncated"), "" when the file is usable;
    ``detail`` says more where there is more to say (libsndfile's message, byte counts).
    """

    frames: int = 0
    rate: int = 0
    channels: int = 0
    error: str = ""
    detail: str = ""


@dataclass
class IndexStats:
    """How the index was obtained: for logs, summary.json and the cache tests."""

    cache: str = "off"  # hit | miss | stale | corrupt | off
    cache_file: str = ""
    headers_read: int = 0  # audio headers read this time
    headers_reused: int = 0  # header facts taken from the previous cache
    texts_tokenized: int = 0
    workers: int = 1
    read_s: float = 0.0  # reading headers and sending texts through the front-end: the parallel stage
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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


@dataclass
class DatasetIndex:
    """The usable samples and the rejections of a dataset.

    ``fingerprint`` is the index cache key (it tracks the config too); ``scan`` is the
    dataset as seen on this host for dataset agreement, derived on first use from the
    metadata bytes and audio listing the index was built from (a warm cache load does
    not pay for parsing the metadata unless a scan is wanted).
    """

    root: Path
    samples: list[Sample]
    rejected: list[Rejection]
    fingerprint: str
    stats: IndexStats = field(default_factory=IndexStats)
    metadata_file: str = "metadata.csv"
    columns: str = COLUMNS_AUTO
    vocabulary: Vocabulary | None = None  # None only for indexes made without a front-end (tests)
    lost: dict[str, Any] = field(default_factory=dict)  # lost characters: see LostReport.to_json
    _scan: DatasetScan | None = field(default=None, repr=False)
    _scan_inputs: tuple[bytes, dict[str, AudioFile]] | None = field(default=None, repr=False)

    @property
    def scan(self) -> DatasetScan:
        if self._scan is None:
            if self._scan_inputs is not None:
                metadata, audio = self._scan_inputs
                self._scan = scan_from(self.root, self.metadata_file, metadata, audio, self.columns)
                self._scan_inputs = None
            else:
                self._scan = scan_dataset(self.root, self.metadata_file, self.columns)
        return self._scan

    def by_id(self) -> dict[str, Sample]:
        return {s.id: s for s in self.samples}


# ----------------------------------------------------------------------- the layout


def resolve_root(path: str) -> Path:
    """The dataset directory a user named, or the embedded demo set for ''."""
    root = Path(path).expanduser() if path else DEMO_DATA_DIR
    if not root.exists():
        raise DatasetError(f"dataset directory {root} does not exist")
    if not root.is_dir():
        raise DatasetError(f"dataset path {root} is not a directory")
    return root.resolve()


def locate(path: str, metadata_file: str) -> tuple[Path, str]:
    """(root, metadata file) of what ``--data`` names: a dataset directory, or a mix file
    (``*.yaml``, shared/layouts.py), whose directory is the root its datasets are found from."""
    given = Path(path).expanduser() if path else None
    if given is not None and is_mix(given.name):
        if not given.is_file():
            raise DatasetError(f"mix file {given} does not exist")
        return given.resolve().parent, given.name
    return resolve_root(path), metadata_file


def audio_path(root: Path, sample_id: str, name: str | None = None) -> Path:
    """Where a clip's audio is: ``name`` (relative to the dataset, or absolute), by default ``wavs/<id>.wav``."""
    return root / relative_audio(sample_id, name)


def relative_audio(sample_id: str, name: str | None = None) -> str:
    """The audio path named in reasons and stored in the index: ``name``, by default ``wavs/<id>.wav``."""
    return name or f"{AUDIO_DIR}/{sample_id}{AUDIO_SUFFIX}"


def scan_audio(root: Path) -> dict[str, AudioFile]:
    """Every audio file of ``root/wavs`` by id (its name without the suffix), named ``wavs/<file>``.

    One directory listing (sizes and mtimes come with it); when an id has files with
    several suffixes, the first in :data:`AUDIO_SUFFIXES` wins. A missing directory
    gives an empty map (each clip is then rejected as missing).
    """
    rank = {suffix: i for i, suffix in enumerate(AUDIO_SUFFIXES)}
    directory = root / AUDIO_DIR
    chosen: dict[str, tuple[int, str]] = {}  # stem -> (suffix rank, file name)
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                name = entry.name
                stem, dot, suffix = name.rpartition(".")
                order = rank.get("." + suffix.lower()) if dot and stem else None
                if order is None or not entry.is_file():
                    continue
                previous = chosen.get(stem)
                if previous is None or order < previous[0]:
                    chosen[stem] = (order, name)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError as exc:
        raise DatasetError(f"cannot list {directory}: {exc.strerror}") from None
    # stat relative to the directory's descriptor: no path to resolve per file (the
    # per-file stat is most of a warm index load, and unavoidable: mtimes are the key)
    found: dict[str, AudioFile] = {}
    fd = os.open(directory, os.O_RDONLY)
    try:
        stat = os.stat
        for stem, (_, name) in chosen.items():
            try:
                st = stat(name, dir_fd=fd)
            except OSError:
                continue  # vanished while listing: the clip is reported missing
            found[stem] = AudioFile(f"{AUDIO_DIR}/{name}", st.st_size, st.st_mtime_ns)
    finally:
        os.close(fd)
    return found


def locate_audio(root: Path, entries: Iterable[Entry]) -> dict[str, AudioFile]:
    """The audio files a manifest names, by id: one stat each (a missing file is left out).

    ``AudioFile.name`` is the path as the manifest wrote it: relative to the dataset
    directory, or absolute.
    """
    found: dict[str, AudioFile] = {}
    for entry in entries:
        if not entry.audio:
            continue
        try:
            st = os.stat(root / entry.audio)
        except OSError:
            continue  # reported as missing, with the path
        if stat_module.S_ISREG(st.st_mode):
            found[entry.id] = AudioFile(entry.audio, st.st_size, st.st_mtime_ns)
    return found


def list_audio(root: Path, metadata_file: str, metadata: bytes, columns: str = COLUMNS_AUTO) -> dict[str, AudioFile]:
    """The audio of a dataset by id: the files a manifest names, or the listing of ``wavs/``;
    for a mix, each dataset's, by prefixed id, with paths from ``root``."""
    if is_manifest(metadata_file):
        entries, _ = parse_entries(metadata, metadata_file, columns)
        return locate_audio(root, entries)
    if not is_mix(metadata_file):
        return scan_audio(root)
    found: dict[str, AudioFile] = {}
    for part, directory, raw in unpack_mix(metadata):
        prefix = f"{part.name}{MIX_ID_SEPARATOR}"
        if is_manifest(part.metadata_file):
            entries, _ = parse_entries(raw, part.metadata_file, part.columns)
            listed = {prefix + i: AudioFile(f"{directory}/{a.name}" if not a.name.startswith("/") else a.name,
                                            a.size, a.mtime_ns)
                      for i, a in locate_audio(root / directory, entries).items()}
        else:
            listed = {prefix + i: AudioFile(f"{directory}/{a.name}", a.size, a.mtime_ns)
                      for i, a in scan_audio(root / directory).items()}
        found.update(listed)
    return found


def read_metadata_bytes(root: Path, metadata_file: str = "metadata.csv") -> bytes:
    """The bytes of ``root/metadata_file``; for a mix, the blob of every dataset's metadata."""
    if is_mix(metadata_file):
        return _read_mix(root, metadata_file)
    meta = root / metadata_file
    try:
        return meta.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"{meta} not found (expected LJSpeech layout: metadata.csv and wavs/)") from None
    except IsADirectoryError:
        raise DatasetError(f"{meta} is a directory, not a metadata file") from None
    except OSError as exc:
        raise DatasetError(f"cannot read {meta}: {exc.strerror}") from None


def _read_mix(root: Path, mix_file: str) -> bytes:
    try:
        parts = parse_mix_spec(_read(root / mix_file).decode("utf-8", "replace"), "metadata.csv", COLUMNS_AUTO)
    except LayoutError as exc:
        raise DatasetError(f"{root / mix_file}: {exc}") from None
    packed = []
    for part in parts:
        directory = Path(part.path).expanduser()
        where = directory if directory.is_absolute() else root / directory
        if not where.is_dir():
            raise DatasetError(f"{root / mix_file}: dataset {part.name}: {where} is not a directory")
        label = str(directory) if directory.is_absolute() else directory.as_posix().rstrip("/")
        packed.append((part, label, read_metadata_bytes(where, part.metadata_file)))
    return pack_mix(packed)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror}") from None


def read_metadata(root: Path, metadata_file: str = "metadata.csv",
                  columns: str = COLUMNS_AUTO) -> tuple[list[Entry], list[Rejection]]:
    """Parse ``root/metadata_file``; malformed lines become rejections, never exceptions."""
    return parse_entries(read_metadata_bytes(root, metadata_file), metadata_file, columns)


# ----------------------------------------------------------------------- agreement


def _digest(lines: Iterable[str]) -> str:
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode("utf-8"))
    return digest.hexdigest()[:FINGERPRINT_HEX]


def metadata_fingerprint(entries: Iterable[Entry]) -> str:
    return _digest(f"{e.id}\t{e.text}\t{e.speaker}\t{e.language}\n" for e in sorted(entries, key=lambda e: e.id))


def audio_fingerprint(sizes: Mapping[str, int], without: Collection[str] = ()) -> str:
    return _digest(f"{i}\t{sizes[i]}\n" for i in sorted(sizes) if i not in without)


def scan_from(root: Path, metadata_file: str, metadata: bytes, audio: Mapping[str, AudioFile],
              columns: str = COLUMNS_AUTO) -> DatasetScan:
    """The scan of metadata bytes and an audio listing (:func:`scan_audio`) already read."""
    entries, malformed = parse_entries(metadata, metadata_file, columns)
    sizes: dict[str, int] = {}
    files: dict[str, str] = {}
    missing: list[str] = []
    for entry in entries:
        file = audio.get(entry.id)
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


def expected_samples(num_samples: int, source_rate_hz: int, target_rate_hz: int) -> int:
    """Length of a clip after resampling; producers pad or trim to exactly this."""
    if source_rate_hz == target_rate_hz:
        return num_samples
    return int(math.ceil(num_samples * target_rate_hz / source_rate_hz))


# ----------------------------------------------------------------------- headers


class RiffFacts(NamedTuple):
    """What a RIFF/RF64 WAVE header says: whether the data is complete, and the length.

    ``frames`` is None when the fmt chunk is not plain PCM or IEEE float (or the data
    size is unknown): libsndfile then says how long the file is.
    """

    problem: str = ""
    frames: int | None = None
    rate: int = 0
    channels: int = 0


# WAVE format tags whose frame count is simply data bytes / block align (PCM, IEEE float);
# 0xFFFE (WAVE_FORMAT_EXTENSIBLE) names one of them in its sub-format GUID.
_PCM_TAG, _FLOAT_TAG, _EXTENSIBLE_TAG = 1, 3, 0xFFFE
_PLAIN_BITS = {_PCM_TAG: (8, 16, 24, 32), _FLOAT_TAG: (32, 64)}


def riff_facts(path: str | Path, size: int) -> RiffFacts | None:
    """Walk a WAVE file's chunks (seeking over their bodies); None if it is not RIFF WAVE.

    libsndfile silently clamps a WAV whose ``data`` chunk claims more bytes than the
    file holds (a copy cut short), so the ``data`` chunk's declared size is compared
    with the bytes that follow its header. For PCM and float data the length comes
    from the same walk (``data bytes // block align``, as libsndfile computes it), so
    the index need not open the file with libsndfile at all.
    """
    fd = os.open(path, os.O_RDONLY)  # os-level reads: no buffered file object per header
    try:
        buffer = os.pread(fd, RIFF_PROBE_BYTES, 0)
        base = 0  # file offset of buffer[0]
        if len(buffer) < 12 or buffer[:4] not in (b"RIFF", b"RF64", b"BW64") or buffer[8:12] != b"WAVE":
            return None
        ds64_data: int | None = None
        fmt: tuple[int, int, int, int, int] | None = None  # tag, channels, rate, block align, bits
        offset = 12
        while True:
            if offset + 8 > size:
                return RiffFacts(problem=f"the header ends at byte {size} without a data chunk")
            if offset + 8 > base + len(buffer):
                buffer, base = os.pread(fd, RIFF_PROBE_BYTES, offset), offset
            at = offset - base
            chunk, length = buffer[at:at + 4], struct.unpack_from("<I", buffer, at + 4)[0]
            if chunk == b"ds64" and at + 8 + 16 <= len(buffer):  # RF64: 64-bit riff and data sizes
                ds64_data = struct.unpack_from("<Q", buffer, at + 8 + 8)[0]
            elif chunk == b"fmt " and length >= 16 and at + 8 + 16 <= len(buffer):
                tag, channels, rate, _, align, bits = struct.unpack_from("<HHIIHH", buffer, at + 8)
                if tag == _EXTENSIBLE_TAG and length >= 40 and at + 8 + 26 <= len(buffer):
                    tag = struct.unpack_from("<H", buffer, at + 8 + 24)[0]  # first bytes of the sub-format GUID
                fmt = (tag, channels, rate, align, bits)
            elif chunk == b"data":
                if ds64_data is not None and length == 0xFFFFFFFF:
                    length = ds64_data
                elif length in RIFF_UNKNOWN_SIZES:
                    return RiffFacts()  # written by a streaming tool: the data runs to the end of the file
                held = size - (offset + 8)
                if held < length:
                    return RiffFacts(problem=f"holds {held} of the {length} sample bytes its header declares")
                if fmt is None:
                    return RiffFacts()
                tag, channels, rate, align, bits = fmt
                if bits not in _PLAIN_BITS.get(tag, ()) or channels < 1 or rate < 1 or align != channels * bits // 8:
                    return RiffFacts()
                return RiffFacts(frames=length // align, rate=rate, channels=channels)
            offset += 8 + length + (length & 1)  # chunks are padded to an even size
    finally:
        os.close(fd)


def riff_problem(path: Path, size: int) -> str:
    """Why a WAVE file's sample data is incomplete, or "" (also for files that are not WAVE)."""
    facts = riff_facts(path, size)
    return facts.problem if facts is not None else ""


def probe_audio(path: str | Path, size: int | None = None) -> AudioProbe:
    """Header facts of one audio file (no decoding), or the reason it cannot be used.

    ``size``: the file's size when the caller has just listed it (saves a stat).
    """
    try:
        if size is None:
            size = os.stat(path).st_size
        if size == 0:
            return AudioProbe(error="audio file empty")
        riff = riff_facts(path, size)
    except FileNotFoundError:
        return AudioProbe(error="audio file missing")
    except OSError as exc:
        return AudioProbe(error="audio file unreadable", detail=str(exc.strerror))
    if riff is not None and riff.problem:
        return AudioProbe(error="audio file truncated", detail=riff.problem)
    if riff is not None and riff.frames is not None:
        if riff.frames == 0:
            return AudioProbe(0, riff.rate, riff.channels, error="audio file has no samples",
                              detail="empty or truncated stream")
        return AudioProbe(riff.frames, riff.rate, riff.channels)  # plain PCM/float WAV: no libsndfile needed
    import soundfile  # here, so that processes which index only plain WAV files never load libsndfile

    try:
        info = soundfile.info(str(path))
    except Exception as exc:  # libsndfile reports every unreadable header as RuntimeError/LibsndfileError
        return AudioProbe(error="audio file unreadable", detail=libsndfile_message(exc))
    if info.frames <= 0 or info.samplerate <= 0:
        return AudioProbe(info.frames, info.samplerate, info.channels, error="audio file has no samples",
                          detail="empty or truncated stream")
    if info.format == "FLAC":
        problem = _flac_tail_problem(soundfile, path, info.frames)
        if problem:
            return AudioProbe(info.frames, info.samplerate, info.channels, error="audio file truncated",
                              detail=problem)
    return AudioProbe(info.frames, info.samplerate, info.channels)


def _flac_tail_problem(soundfile: Any, path: str | Path, frames: int) -> str:
    """Whether a FLAC stream really reaches the last sample its STREAMINFO announces.

    A FLAC file cut short keeps its header, so soundfile.info reports the full length;
    seeking to the last sample and decoding it (one block, ~0.3 ms) finds the cut.
    WAV needs no decoding (:func:`riff_problem`); Ogg has no total in its header, so a
    cut Ogg file reads as a shorter clip (or as one with no samples).
    """
    try:
        with soundfile.SoundFile(str(path)) as f:
            f.seek(frames - 1)
            got = f.read(1, dtype="float32", always_2d=True).shape[0]
    except Exception:  # libsndfile raises LibsndfileError/RuntimeError when the stream is cut
        got = 0
    if got != 1:
        return f"the stream ends before sample {frames} its header announces"
    return ""


def libsndfile_message(exc: BaseException) -> str:
    """libsndfile's own words for a failure, one short line, without the file path."""
    text = getattr(exc, "error_string", None) or str(exc) or type(exc).__name__
    line = str(text).strip().splitlines()[0] if str(text).strip() else type(exc).__name__
    if line.startswith("Error opening ") and ": " in line:
        line = line.rsplit(": ", 1)[1]
    for prefix in ("Error : ", "Error: "):
        if line.startswith(prefix):
            line = line[len(prefix):]
    return line[:MAX_DETAIL_CHARS]


def _probe_tuple(p: AudioProbe) -> tuple[int, int, int, str, str]:
    return tuple(p)  # type: ignore[return-value]


# A text work item: (language, text); its result: (units, lost characters).
TextKey = tuple[str, str]
Item = tuple["str | None", int, "TextKey | None"]
_FRONTENDS: dict[tuple[str, str], Frontend] = {}  # per process: a phonemizer backend is set up once


def _frontend(spec: tuple[str, str]) -> Frontend:
    frontend = _FRONTENDS.get(spec)
    if frontend is None:
        frontend = _FRONTENDS[spec] = make_frontend(*spec)
    return frontend


def _work_items(root: str, items: Sequence[Item], text_spec: tuple[str, str]) -> list[tuple[tuple | None,
                                                                                               tuple | None]]:
    """Read headers and make units: [(audio name or None, its size, (language, text) or None)]
    -> [(probe, (units, lost))].

    Runs in worker processes (so it takes and returns plain tuples) and in-process. Texts
    go to the front-end one list per language (a phonemizer call has a set-up cost).
    """
    join = os.path.join
    probes = [_probe_tuple(probe_audio(join(root, name), size)) if name is not None else None
              for name, size, _ in items]
    by_language: dict[str, list[int]] = collections.defaultdict(list)
    for n, (_, _, key) in enumerate(items):
        if key is not None:
            by_language[key[0]].append(n)
    units: list[tuple | None] = [None] * len(items)
    if by_language:
        frontend = _frontend(text_spec)
        for code, positions in by_language.items():
            made = frontend.units([items[n][2][1] for n in positions], code)  # type: ignore[index]
            for n, u in zip(positions, made):
                units[n] = (u.units, u.lost)
    return list(zip(probes, units))


def _estimated_seconds(items: Sequence[Item], text_s: float) -> float:
    """What :func:`_work_items` would take in one process, from the file suffixes alone."""
    total = 0.0
    for name, _, text in items:
        if name is not None:
            suffix = name.rpartition(".")[2].lower()
            total += WAV_HEADER_S if suffix == "wav" else FLAC_HEADER_S if suffix == "flac" else OTHER_HEADER_S
        if text is not None:
            total += text_s
    return total


def _run_items(root: Path, items: list[Item], workers: int,
               text_spec: tuple[str, str]) -> tuple[list[tuple[tuple | None, tuple | None]], int]:
    """:func:`_work_items` over all items, in ``workers`` processes (this one included)."""
    text_s = PHONEMES_S if text_spec[0] == "phonemes" else TEXT_S
    if workers <= 1 or len(items) < 2 or _estimated_seconds(items, text_s) < PARALLEL_MIN_SECONDS:
        return _work_items(str(root), items, text_spec), 1
    size = PHONEME_CHUNK_ITEMS if text_spec[0] == "phonemes" else CHUNK_ITEMS
    chunks = [items[i:i + size] for i in range(0, len(items), size)]
    results: list[list[Any] | None] = [None] * len(chunks)
    todo = collections.deque(range(len(chunks)))
    helpers = min(workers - 1, len(chunks) - 1)
    # Spawned, never forked: the caller may have imported TensorFlow.
    context = multiprocessing.get_context("spawn")
    try:
        with concurrent.futures.ProcessPoolExecutor(helpers, mp_context=context) as pool:
            running: dict[concurrent.futures.Future, int] = {}

            def top_up() -> None:
                while todo and len(running) < 2 * helpers:
                    n = todo.popleft()
                    running[pool.submit(_work_items, str(root), chunks[n], text_spec)] = n

            top_up()
            while todo:  # this process works from the back while the helpers start and work from the front
                n = todo.pop()
                results[n] = _work_items(str(root), chunks[n], text_spec)
                for future in [f for f in running if f.done()]:
                    results[running.pop(future)] = future.result()
                top_up()
            for future in concurrent.futures.as_completed(list(running)):
                results[running.pop(future)] = future.result()
    except TextError:
        raise  # the front-end itself failed (a user tokenizer's error): the same in this process
    except Exception as exc:  # a broken pool (e.g. a script without a __main__ guard) must not stop indexing
        log.warning("parallel header reading failed (%s: %s); reading the rest in this process",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        helpers = 0
        for n, chunk in enumerate(results):
            if chunk is None:
                results[n] = _work_items(str(root), chunks[n], text_spec)
    return [item for chunk in results for item in (chunk or [])], helpers + 1


# ----------------------------------------------------------------------- the cache


def index_config(data: DataConfig, features: FeaturesConfig, text: TextConfig, frontend: Frontend,
                 vocabulary: Vocabulary | None = None) -> dict[str, Any]:
    """Everything the index depends on besides the files: part of the cache key."""
    return {
        "format": INDEX_FORMAT, "frontend": frontend.name, "engine": frontend.engine(), "language": text.language,
        "max_lost_frac": text.max_lost_frac, "vocabulary": vocabulary.fingerprint if vocabulary else "",
        "columns": data.columns, "metadata_file": data.metadata_file, "min_audio_s": data.min_audio_s, "max_audio_s": data.max_audio_s,
        "max_tokens": data.max_tokens, "sample_rate_hz": features.sample_rate_hz, "n_fft": features.n_fft,
        "hop_length": features.hop_length,
    }


def index_key(metadata: bytes, audio: dict[str, AudioFile], config: dict[str, Any]) -> str:
    """SHA-256 over the metadata bytes, every audio file's name, size and mtime, and the config."""
    digest = hashlib.sha256()
    digest.update(repr(sorted(config.items())).encode())
    digest.update(hashlib.sha256(metadata).digest())
    files = [audio[stem] for stem in sorted(audio)]
    digest.update("\0".join([f.name for f in files]).encode("utf-8", "surrogateescape"))
    digest.update(array.array("q", [f.size for f in files]).tobytes())
    digest.update(array.array("q", [f.mtime_ns for f in files]).tobytes())
    return digest.hexdigest()


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
    outside = f"index-{_name_hash(str(root), data.metadata_file)}.msgpack"
    if setting:
        return [Path(setting).expanduser() / outside]
    return [root / DATASET_CACHE_DIR / f"index-{meta_tag}.msgpack", user_cache_dir() / "index" / outside]


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


def _pack(payload: dict[str, Any]) -> bytes:
    import msgpack

    body = msgpack.packb(payload, use_bin_type=True)
    return INDEX_CACHE_MAGIC + hashlib.sha256(body).digest() + body


def _unpack(blob: bytes) -> dict[str, Any]:
    """The payload of a cache file; ValueError if it is not one or fails its checksum."""
    import msgpack

    head = len(INDEX_CACHE_MAGIC)
    if len(blob) < head + 32 or blob[:head] != INDEX_CACHE_MAGIC:
        raise ValueError("not an index cache file of this version")
    body = blob[head + 32:]
    if hashlib.sha256(body).digest() != blob[head:head + 32]:
        raise ValueError("checksum mismatch")
    try:
        payload = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types for bad data
        raise ValueError(f"bad payload ({type(exc).__name__})") from None
    if not isinstance(payload, dict) or payload.get("format") != INDEX_FORMAT:
        raise ValueError("unknown payload format")
    return payload


def _read_cache(candidates: list[Path], key: str) -> tuple[Path | None, dict[str, Any] | None, str]:
    """The cache file for ``key`` if one exists: (path, payload, state).

    state: "hit" (a candidate holds this key), "stale" (the payload returned is an older
    index, reusable in part), "corrupt" (a candidate failed its checksum and nothing
    else was usable) or "miss" (no cache file at all).
    """
    reusable: tuple[Path, dict[str, Any]] | None = None
    corrupt = False
    for path in candidates:
        try:
            blob = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            log.warning("cannot read index cache %s (%s); ignoring it", path, exc.strerror)
            continue
        try:
            payload = _unpack(blob)
        except ValueError as exc:
            log.warning("index cache %s is corrupt (%s); rebuilding the index", path, exc)
            corrupt = True
            continue
        if payload.get("key") == key:
            return path, payload, "hit"
        if reusable is None:
            reusable = (path, payload)
    if reusable is not None:
        return reusable[0], reusable[1], "stale"
    return None, None, "corrupt" if corrupt else "miss"


def _write_cache(candidates: list[Path], blob: bytes) -> Path | None:
    """Write to the first candidate that accepts it; log a fall-back; never raise."""
    for n, path in enumerate(candidates):
        try:
            write_atomic(path, blob)
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


def _columns(rows: Iterable[Any], names: Sequence[str]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {n: [] for n in names}
    for row in rows:
        for n in names:
            out[n].append(getattr(row, n))
    return out


_SAMPLE_FIELDS = ("id", "text", "num_tokens", "num_frames", "duration_s", "audio", "line", "language", "speaker",
                  "units")
_REJECTION_FIELDS = ("id", "reason", "line", "file", "kind")
_PROBE_FIELDS = ("name", "size", "mtime_ns", "frames", "rate", "channels", "error", "detail")
_UNITS_FIELDS = ("language", "text", "units", "lost")


def _from_payload(payload: dict[str, Any]) -> tuple[list[Sample], list[Rejection]]:
    s = payload["samples"]
    samples = list(map(Sample, *(s[f] for f in _SAMPLE_FIELDS)))
    r = payload["rejected"]
    rejected = [Rejection(i, reason, "index", line, file, kind)
                for i, reason, line, file, kind in zip(*(r[f] for f in _REJECTION_FIELDS))]
    return samples, rejected


# ----------------------------------------------------------------------- building


def build_index(data: DataConfig, features: FeaturesConfig, text: TextConfig | None = None,
                vocabulary: Vocabulary | None = None) -> DatasetIndex:
    """The index of ``data.path``: from the cache when nothing changed, else built and cached.

    ``vocabulary``: a run's vocabulary to keep (``--resume``); texts with symbols it lacks,
    or languages and speakers outside its tables, are rejected. None: built from the data.
    Raises DatasetError when the dataset cannot be used and TextError when the text
    front-end cannot (both one line for the user).
    """
    # Building creates a few small objects per clip and frees none of them: the cyclic
    # collector would walk the growing heap again and again (a 100,000-item index took
    # 40% longer per item than a 13,100-item one). Nothing here makes reference cycles.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _build_index(data, features, text or TextConfig(), vocabulary)
    finally:
        if enabled:
            gc.enable()


def _build_index(data: DataConfig, features: FeaturesConfig, text: TextConfig,
                 fixed: Vocabulary | None) -> DatasetIndex:
    started = time.perf_counter()
    root, metadata_file = locate(data.path, data.metadata_file)
    data = dataclasses.replace(data, metadata_file=metadata_file)
    metadata = read_metadata_bytes(root, data.metadata_file)
    audio = list_audio(root, data.metadata_file, metadata, data.columns)
    frontend = _frontend((text.frontend, text.digits))
    if fixed is not None:
        problem = fixed.check_engine(frontend)
        if problem:
            raise TextError(f"cannot keep the run's vocabulary: {problem}")
    config = index_config(data, features, text, frontend, fixed)
    key = index_key(metadata, audio, config)
    candidates = index_cache_file(root, data)
    cache_path, payload, state = _read_cache(candidates, key) if candidates else (None, None, "off")
    stats = IndexStats(cache=state)
    scan_inputs = (data.metadata_file, metadata, audio)
    if state == "hit" and payload is not None:
        try:
            samples, rejected = _from_payload(payload)
            lost = dict(payload["lost"])
            vocab = fixed or Vocabulary.from_state_dict(payload["vocabulary"])
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("index cache %s is unusable (%s); rebuilding the index", cache_path, exc)
            payload, stats.cache = None, "corrupt"
        else:
            stats.cache_file = str(cache_path)
            return _finish(root, samples, rejected, key, stats, started, False, scan_inputs, data, vocab, lost)
    entries, rejected = parse_entries(metadata, data.metadata_file, data.columns)
    old_probes: dict[str, tuple] = {}
    old_units: dict[TextKey, Units] = {}
    if payload is not None:
        try:
            p = payload["probes"]
            old_probes = {name: row for name, *row in zip(*(p[f] for f in _PROBE_FIELDS))}
            u = payload["units"]
            # units are reused only from the same front-end with the same settings and versions
            if u["frontend"] == [frontend.name, frontend.engine()]:
                s = payload["samples"]
                old_units = {(lang, txt): Units(units) for lang, txt, units in zip(s["language"], s["text"],
                                                                                   s["units"])}
                old_units.update({(lang, txt): Units(units, lost)
                                  for lang, txt, units, lost in zip(*(u[f] for f in _UNITS_FIELDS))})
        except (KeyError, TypeError, ValueError):
            old_probes, old_units = {}, {}
    probes: dict[str, AudioProbe] = {}
    todo: list[Item] = []
    wanted: set[TextKey] = set()
    for entry in entries:
        file = audio.get(entry.id)
        name = None
        size = 0
        if file is not None and file.name not in probes:
            old = old_probes.get(file.name)
            if old is not None and old[0] == file.size and old[1] == file.mtime_ns:
                probes[file.name] = AudioProbe(*old[2:])
                stats.headers_reused += 1
            else:
                name, size = file.name, file.size
        text_key: TextKey | None = (entry.language or text.language, entry.text)
        if text_key in old_units or text_key in wanted or text_key[0] not in LANGUAGES:
            text_key = None
        else:
            wanted.add(text_key)
        if name is not None or text_key is not None:
            todo.append((name, size, text_key))
    read_started = time.perf_counter()
    results, stats.workers = _run_items(root, todo, max(1, _workers(data)), (text.frontend, text.digits))
    stats.read_s = time.perf_counter() - read_started
    units = dict(old_units)
    for (name, _, text_key), (probe, made) in zip(todo, results):
        if name is not None and probe is not None:
            probes[name] = AudioProbe(*probe)
            stats.headers_read += 1
        if text_key is not None and made is not None:
            units[text_key] = Units(*made)
            stats.texts_tokenized += 1
    samples, rejected, lost = _apply_rules(entries, rejected, audio, probes, units, data, features, text, frontend,
                                           fixed)
    vocab = fixed or _vocabulary(frontend, samples)
    if candidates:
        used = {a.name for a in audio.values()}
        probe_rows = [(name, audio_file.size, audio_file.mtime_ns, *_probe_tuple(probes[name]))
                      for audio_file in audio.values() for name in (audio_file.name,) if name in probes and name in used]
        # Units of every text of the metadata, so that a later re-derivation sends only texts
        # that changed through the front-end: the samples hold theirs; the rest (rejected
        # clips, and texts that lost characters) are listed apart.
        plain = {(s.language, s.text) for s in samples if not units[s.language, s.text].lost}
        keys = {(e.language or text.language, e.text) for e in entries} - plain
        unit_rows = [(lang, txt, units[lang, txt].units, units[lang, txt].lost) for lang, txt in keys
                     if (lang, txt) in units]
        payload_out = {
            "format": INDEX_FORMAT, "key": key, "root": str(root), "config": config,
            "samples": _columns(samples, _SAMPLE_FIELDS),
            "rejected": _columns(rejected, _REJECTION_FIELDS),
            "probes": {f: [row[i] for row in probe_rows] for i, f in enumerate(_PROBE_FIELDS)},
            "units": {"frontend": [frontend.name, frontend.engine()],
                      **{f: [row[i] for row in unit_rows] for i, f in enumerate(_UNITS_FIELDS)}},
            "lost": lost, "vocabulary": vocab.state_dict(),
        }
        written = _write_cache(candidates, _pack(payload_out))
        stats.cache_file = str(written) if written else ""
    return _finish(root, samples, rejected, key, stats, started, True, scan_inputs, data, vocab, lost)


def _vocabulary(frontend: Frontend, samples: Sequence[Sample]) -> Vocabulary:
    return Vocabulary.build(frontend, (s.units for s in samples), (s.language for s in samples),
                            (s.speaker for s in samples))


def _workers(data: DataConfig) -> int:
    if data.index_workers > 0:
        return data.index_workers
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# Rejection kinds (Rejection.kind): the cause shared by many clips of a dataset, and what fixes it.
KIND_HINTS = {
    "lost-text": "the text front-end cannot represent its text: check --language, --text-frontend, or allow "
                 "some loss with --set text.max_lost_frac=F",
    "empty-text": "its text is empty after normalisation: check data.columns (which field is the text) and "
                  "--language",
    "language": "its language is unknown: check the language column (data.columns) or --language",
    "vocabulary": "its language or speaker is not in the run's tables: resume only with the run's dataset",
    "too-many-tokens": "its text is longer than data.max_tokens allows: raise --set data.max_tokens=N",
    "missing-audio": "its audio file is missing: check --data (DIR/wavs/ID.wav) or the manifest's paths",
    "unreadable-audio": "its audio file cannot be read",
    "duration": "its duration is outside data.min_audio_s..data.max_audio_s",
}


def _apply_rules(entries: list[Entry], rejected: list[Rejection], audio: dict[str, AudioFile],
                 probes: dict[str, AudioProbe], units: dict[TextKey, Units], data: DataConfig,
                 features: FeaturesConfig, text: TextConfig, frontend: Frontend,
                 fixed: Vocabulary | None) -> tuple[list[Sample], list[Rejection], dict[str, Any]]:
    """Turn parsed metadata, header facts and units into samples, rejections and the lost-character report."""
    rejected = list(rejected)
    samples: list[Sample] = []
    report = LostReport()
    shortest = features.n_fft // 2 + 1  # reflect centre padding needs this many samples
    for entry in entries:
        place = f"metadata line {entry.line}"
        code = entry.language or text.language
        speaker = entry.speaker or DEFAULT_SPEAKER
        made = units.get((code, entry.text))
        if made is None:  # only a language outside LANGUAGES is never sent to the front-end
            rejected.append(Rejection(entry.id, f"unknown language code {code!r} ({place}; known: "
                                                f"{', '.join(sorted(LANGUAGES))})", line=entry.line, kind="language"))
            continue
        if fixed is not None:
            missing = fixed.missing(made.units)
            if missing:
                made = Units("".join(ch for ch in made.units if ch not in missing), made.lost + missing)
            if code not in fixed.languages or speaker not in fixed.speakers:
                what = f"language {code!r}" if code not in fixed.languages else f"speaker {speaker!r}"
                rejected.append(Rejection(entry.id, f"{what} is not in the run's tables ({place})", line=entry.line,
                                          kind="vocabulary"))
                continue
        if made.lost:
            report.add(entry.id, made.lost)
            if made.lost_frac > text.max_lost_frac:
                shown = ", ".join(f"{ch!r} U+{ord(ch):04X}" for ch in dict.fromkeys(made.lost))
                rejected.append(Rejection(entry.id, f"text loses {len(made.lost)} of {len(made.lost) + len(made.units)} "
                                                    f"characters the {text.frontend} front-end cannot represent "
                                                    f"({shown}; text.max_lost_frac={text.max_lost_frac:g}) ({place})",
                                          line=entry.line, kind="lost-text"))
                continue
        count = frontend.count(made.units)
        if count == 0:
            detail = ": nothing left after normalisation" if entry.text else ""
            rejected.append(Rejection(entry.id, f"empty text on {place}{detail}", line=entry.line, kind="empty-text"))
            continue
        if count > data.max_tokens:
            rejected.append(Rejection(entry.id, f"text of {count} tokens exceeds data.max_tokens={data.max_tokens} "
                                                f"({place})", line=entry.line, kind="too-many-tokens"))
            continue
        file = audio.get(entry.id)
        if file is None:
            where = relative_audio(entry.id, entry.audio or None)
            rejected.append(Rejection(entry.id, f"audio file missing: {where} ({place})", line=entry.line, file=where,
                                      kind="missing-audio"))
            continue
        where = relative_audio(entry.id, file.name)
        probe = probes[file.name]
        if probe.error:
            detail = f": {probe.detail}" if probe.detail else ""
            rejected.append(Rejection(entry.id, f"{probe.error}: {where}{detail} ({place})", line=entry.line,
                                      file=where, kind="unreadable-audio"))
            continue
        duration = probe.frames / probe.rate
        if duration > data.max_audio_s or duration < data.min_audio_s:
            bound = (f"longer than data.max_audio_s={data.max_audio_s:g}" if duration > data.max_audio_s
                     else f"shorter than data.min_audio_s={data.min_audio_s:g}")
            rejected.append(Rejection(entry.id, f"clip of {duration:.2f} s {bound} s: {where} ({place})",
                                      line=entry.line, file=where, kind="duration"))
            continue
        n = expected_samples(probe.frames, probe.rate, features.sample_rate_hz)
        if n < shortest:
            rejected.append(Rejection(entry.id, f"clip of {n} samples at {features.sample_rate_hz} Hz is shorter "
                                                f"than n_fft/2+1 = {shortest}: {where} ({place})",
                                      line=entry.line, file=where, kind="duration"))
            continue
        samples.append(Sample(entry.id, entry.text, count, 1 + n // features.hop_length, duration, file.name,
                              entry.line, code, speaker, made.units))
    return samples, rejected, report.to_json()


class LostReport:
    """Characters a front-end could not represent, per dataset: occurrences, clips, example ids."""

    def __init__(self) -> None:
        self.chars: dict[str, list[Any]] = {}  # char -> [occurrences, clips, example ids]
        self.clips = 0

    def add(self, sample_id: str, lost: str) -> None:
        self.clips += 1
        for ch, n in collections.Counter(lost).items():
            row = self.chars.setdefault(ch, [0, 0, []])
            row[0] += n
            row[1] += 1
            if len(row[2]) < LOST_EXAMPLES:
                row[2].append(sample_id)

    def to_json(self) -> dict[str, Any]:
        """``{"clips": N, "chars": [{"char", "code", "name", "count", "clips", "examples"}, ...]}``, most first."""
        rows = sorted(self.chars.items(), key=lambda kv: (-kv[1][0], kv[0]))
        return {"clips": self.clips, "chars": [
            {"char": ch, "code": f"U+{ord(ch):04X}", "name": unicodedata.name(ch, "").lower(), "count": count,
             "clips": clips, "examples": examples} for ch, (count, clips, examples) in rows]}


def _mostly_rejected(entries: int, rejected: Sequence[Rejection]) -> str:
    """One line naming the cause when one kind of rejection took most of the dataset, else ""."""
    kinds = collections.Counter(r.kind for r in rejected if r.kind)
    if not kinds or entries <= 0:
        return ""
    kind, count = kinds.most_common(1)[0]
    if count <= MOSTLY_REJECTED_FRAC * entries:
        return ""
    example = next(r for r in rejected if r.kind == kind)
    return (f"{count} of {entries} clips were rejected because {KIND_HINTS[kind]} (e.g. {example.id}: "
            f"{example.reason})")


def _finish(root: Path, samples: list[Sample], rejected: list[Rejection], key: str, stats: IndexStats,
            started: float, log_rejections: bool, scan_inputs: tuple[str, bytes, dict[str, AudioFile]],
            data: DataConfig, vocab: Vocabulary, lost: dict[str, Any]) -> DatasetIndex:
    stats.seconds = time.perf_counter() - started
    if log_rejections:
        for r in rejected:
            log.warning("rejected %s: %s", r.id, r.reason)
    if lost.get("chars"):
        shown = ", ".join(f"{c['char']!r} {c['code']} ({c['count']}x in {c['clips']} clips, e.g. "
                          f"{', '.join(c['examples'])})" for c in lost["chars"][:8])
        log.warning("%d clips of %s lose characters the %s front-end cannot represent: %s", lost["clips"], root,
                    vocab.frontend, shown)
    log.info("index of %s: %d clips usable, %d rejected (cache %s, %d headers read, %d reused, %d texts through "
             "the front-end, %d worker(s), %.2f s)", root, len(samples), len(rejected), stats.cache,
             stats.headers_read, stats.headers_reused, stats.texts_tokenized, stats.workers, stats.seconds)
    cause = _mostly_rejected(len(samples) + len(rejected), rejected)
    if not samples:
        raise DatasetError(f"dataset {root} has no usable clip ({len(rejected)} rejected)"
                           + (f": {cause}" if cause else ""))
    if cause:
        raise DatasetError(f"dataset {root}: {cause}")
    metadata_file, metadata, audio = scan_inputs
    return DatasetIndex(root=root, samples=samples, rejected=rejected, fingerprint=key[:16], stats=stats,
                        metadata_file=metadata_file, columns=data.columns, vocabulary=vocab, lost=lost,
                        _scan_inputs=(metadata, audio))
