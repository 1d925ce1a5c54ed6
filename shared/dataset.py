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
compute a :class:`DatasetScan` from the metadata (parsed by :func:`parse_metadata`, the
one metadata reader) and the audio directory listing of :func:`scan_audio` (no audio is
decoded; 13,100 LJSpeech clips take well under a second) and compare two fingerprints:

    metadata  sha256 of ``id TAB text LF`` per metadata entry, sorted by id (the text a
              producer tokenizes; line order, the unused middle column and malformed
              lines do not count)
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
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping, NamedTuple, Sequence

from shared.config import DataConfig, FeaturesConfig
from shared.text import SYMBOLS, count_tokens

log = logging.getLogger(__name__)

DEMO_DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "demo"
AUDIO_DIR = "wavs"
AUDIO_SUFFIX = ".wav"  # the LJSpeech suffix, named in "missing" reasons
# Suffixes of formats libsndfile reads, in order of preference when one id has several.
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aiff", ".aif", ".aifc", ".au", ".w64",
                  ".rf64", ".caf")

# Bump when the cache layout or any rule that derives the index from its inputs changes.
INDEX_FORMAT = 3
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
# Estimated cost of one item, to apply that rule before reading anything (measured on a
# 2-core VM): a WAV header walk, a libsndfile header read, a FLAC header plus the decode
# of its last block, and one text's tokenization.
WAV_HEADER_S = 50e-6
OTHER_HEADER_S = 100e-6
FLAC_HEADER_S = 400e-6
TEXT_S = 10e-6
# Headers per task handed to a worker: large enough to amortise the task overhead,
# small enough that the last tasks balance the load.
CHUNK_ITEMS = 1000
# A RIFF header (fmt, LIST, fact chunks) nearly always fits in this; larger chunks are
# skipped by seeking, not read.
RIFF_PROBE_BYTES = 4096
# RIFF/RF64 data sizes that mean "unknown, read to the end" (streamed writers).
RIFF_UNKNOWN_SIZES = (0, 0xFFFFFFFF)
# Longest libsndfile message kept in a reason.
MAX_DETAIL_CHARS = 160


class DatasetError(Exception):
    """The dataset as a whole cannot be used (missing, unreadable, no usable clip)."""


@dataclass(frozen=True)
class Entry:
    """One metadata line: the id, the text to speak, and where it came from."""

    id: str
    text: str
    line: int


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


@dataclass(frozen=True)
class Rejection:
    id: str
    reason: str
    producer: str = "index"  # who rejected it: "index" (consumer) or a producer name
    line: int | None = None  # metadata line, where one applies
    file: str | None = None  # dataset-relative audio file, where one applies

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "reason": self.reason, "producer": self.producer}
        if self.line is not None:
            out["line"] = self.line
        if self.file is not None:
            out["file"] = self.file
        return out


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

    @property
    def fingerprint(self) -> str:
        """Both fingerprints as one short string, for logs and summary.json."""
        return f"{self.metadata_fp[:8]}{self.audio_fp[:8]}"

    def describe(self) -> dict[str, Any]:
        """The ``dataset`` field of a producer's HELLO."""
        return {"metadata_file": self.metadata_file, "metadata": self.metadata_fp, "audio": self.audio_fp,
                "entries": len(self.entries), "missing": self.missing[:MAX_MISSING_IDS],
                "missing_count": len(self.missing)}


@dataclass(frozen=True)
class Agreement:
    """The trainer's verdict on a producer's dataset: refused (``reason``) or accepted."""

    ok: bool
    reason: str = ""
    lacks: frozenset[str] = frozenset()  # ids this producer has no audio for
    metadata_file: str = ""  # set when the producer read another metadata file than the trainer


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
    _scan: DatasetScan | None = field(default=None, repr=False)
    _scan_inputs: tuple[bytes, dict[str, AudioFile]] | None = field(default=None, repr=False)

    @property
    def scan(self) -> DatasetScan:
        if self._scan is None:
            if self._scan_inputs is not None:
                metadata, audio = self._scan_inputs
                self._scan = scan_from(self.root, self.metadata_file, metadata, audio)
                self._scan_inputs = None
            else:
                self._scan = scan_dataset(self.root, self.metadata_file)
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


def audio_path(root: Path, sample_id: str, name: str | None = None) -> Path:
    """Where a clip's audio is: ``wavs/<name>``, by default ``wavs/<id>.wav``."""
    return root / AUDIO_DIR / (name or f"{sample_id}{AUDIO_SUFFIX}")


def relative_audio(sample_id: str, name: str | None = None) -> str:
    """The dataset-relative path named in reasons: ``wavs/<name>``."""
    return f"{AUDIO_DIR}/{name or sample_id + AUDIO_SUFFIX}"


def scan_audio(root: Path) -> dict[str, AudioFile]:
    """Every audio file of ``root/wavs`` by id (its name without the suffix).

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
            found[stem] = AudioFile(name, st.st_size, st.st_mtime_ns)
    finally:
        os.close(fd)
    return found


def _utf8_problem(raw: bytes) -> str:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"byte 0x{raw[exc.start]:02x} at column {exc.start + 1}"
    return ""


def parse_metadata(raw: bytes) -> tuple[list[Entry], list[Rejection]]:
    """Parse metadata bytes; malformed lines become rejections, never exceptions."""
    if raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark (Windows editors) is not part of the id
        raw = raw[3:]
    entries: list[Entry] = []
    rejected: list[Rejection] = []
    first_line: dict[str, int] = {}
    for number, line_bytes in enumerate(raw.splitlines(), start=1):
        if not line_bytes.strip():
            continue
        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError:
            head = line_bytes.split(b"|", 1)[0].strip()
            try:
                sample_id = head.decode("utf-8") if head else ""
            except UnicodeDecodeError:
                sample_id = ""
            rejected.append(Rejection(sample_id or f"line:{number}",
                                      f"metadata line {number} is not valid UTF-8 ({_utf8_problem(line_bytes)})",
                                      line=number))
            continue
        parts = line.split("|")
        sample_id = parts[0].strip()
        problem = ""
        if len(parts) not in (2, 3):
            problem = f"{len(parts)} field{'s' if len(parts) != 1 else ''}, expected id|text|normalized_text or id|text"
        elif not sample_id:
            problem = "empty id"
        elif "/" in sample_id or "\\" in sample_id or sample_id.startswith("."):
            problem = f"id {sample_id!r} is not a plain file name"
        if problem:
            rejected.append(Rejection(sample_id or f"line:{number}", f"malformed metadata line {number}: {problem}",
                                      line=number))
            continue
        if sample_id in first_line:
            rejected.append(Rejection(sample_id, f"duplicate id on metadata line {number} "
                                                 f"(first on line {first_line[sample_id]})", line=number))
            continue
        first_line[sample_id] = number
        text = parts[-1].strip() or parts[1].strip()
        entries.append(Entry(sample_id, text, number))
    return entries, rejected


def read_metadata_bytes(root: Path, metadata_file: str = "metadata.csv") -> bytes:
    meta = root / metadata_file
    try:
        return meta.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"{meta} not found (expected LJSpeech layout: metadata.csv and wavs/)") from None
    except IsADirectoryError:
        raise DatasetError(f"{meta} is a directory, not a metadata file") from None
    except OSError as exc:
        raise DatasetError(f"cannot read {meta}: {exc.strerror}") from None


def read_metadata(root: Path, metadata_file: str = "metadata.csv") -> tuple[list[Entry], list[Rejection]]:
    """Parse ``root/metadata_file``; malformed lines become rejections, never exceptions."""
    return parse_metadata(read_metadata_bytes(root, metadata_file))


# ----------------------------------------------------------------------- agreement


def _digest(lines: Iterable[str]) -> str:
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode("utf-8"))
    return digest.hexdigest()[:FINGERPRINT_HEX]


def metadata_fingerprint(entries: Iterable[Entry]) -> str:
    return _digest(f"{e.id}\t{e.text}\n" for e in sorted(entries, key=lambda e: e.id))


def audio_fingerprint(sizes: Mapping[str, int], without: Collection[str] = ()) -> str:
    return _digest(f"{i}\t{sizes[i]}\n" for i in sorted(sizes) if i not in without)


def scan_from(root: Path, metadata_file: str, metadata: bytes, audio: Mapping[str, AudioFile]) -> DatasetScan:
    """The scan of metadata bytes and an audio listing (:func:`scan_audio`) already read."""
    entries, malformed = parse_metadata(metadata)
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
                       metadata_sha256=hashlib.sha256(metadata).hexdigest())


def scan_dataset(root: Path, metadata_file: str = "metadata.csv") -> DatasetScan:
    """Read the metadata and list the audio files; raise DatasetError if unreadable."""
    return scan_from(root, metadata_file, read_metadata_bytes(root, metadata_file), scan_audio(root))


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
    if described["metadata_file"] != reference.metadata_file:
        return Agreement(False, f"producer on {host} read {described['metadata_file']!r}; the trainer reads "
                                f"{reference.metadata_file!r}", metadata_file=reference.metadata_file)
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


def _work_items(root: str, items: Sequence[tuple[str | None, int, str | None]]) -> list[tuple[tuple | None, int | None]]:
    """Read headers and count tokens: [(audio name or None, its size, text or None)] -> [(probe, tokens)].

    Runs in worker processes (so it takes and returns plain tuples) and in-process.
    """
    base = os.path.join(root, AUDIO_DIR)
    join = os.path.join
    out: list[tuple[tuple | None, int | None]] = []
    for name, size, text in items:
        probe = _probe_tuple(probe_audio(join(base, name), size)) if name is not None else None
        tokens = count_tokens(text) if text is not None else None
        out.append((probe, tokens))
    return out


def _estimated_seconds(items: Sequence[tuple[str | None, int, str | None]]) -> float:
    """What :func:`_work_items` would take in one process, from the file suffixes alone."""
    total = 0.0
    for name, _, text in items:
        if name is not None:
            suffix = name.rpartition(".")[2].lower()
            total += WAV_HEADER_S if suffix == "wav" else FLAC_HEADER_S if suffix == "flac" else OTHER_HEADER_S
        if text is not None:
            total += TEXT_S
    return total


def _run_items(root: Path, items: list[tuple[str | None, int, str | None]],
               workers: int) -> tuple[list[tuple[tuple | None, int | None]], int]:
    """:func:`_work_items` over all items, in ``workers`` processes (this one included)."""
    if workers <= 1 or len(items) < 2 or _estimated_seconds(items) < PARALLEL_MIN_SECONDS:
        return _work_items(str(root), items), 1
    chunks = [items[i:i + CHUNK_ITEMS] for i in range(0, len(items), CHUNK_ITEMS)]
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
                    running[pool.submit(_work_items, str(root), chunks[n])] = n

            top_up()
            while todo:  # this process works from the back while the helpers start and work from the front
                n = todo.pop()
                results[n] = _work_items(str(root), chunks[n])
                for future in [f for f in running if f.done()]:
                    results[running.pop(future)] = future.result()
                top_up()
            for future in concurrent.futures.as_completed(list(running)):
                results[running.pop(future)] = future.result()
    except Exception as exc:  # a broken pool (e.g. a script without a __main__ guard) must not stop indexing
        log.warning("parallel header reading failed (%s: %s); reading the rest in this process",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        helpers = 0
        for n, chunk in enumerate(results):
            if chunk is None:
                results[n] = _work_items(str(root), chunks[n])
    return [item for chunk in results for item in (chunk or [])], helpers + 1


# ----------------------------------------------------------------------- the cache


def index_config(data: DataConfig, features: FeaturesConfig) -> dict[str, Any]:
    """Everything the index depends on besides the files: part of the cache key."""
    return {
        "format": INDEX_FORMAT, "vocabulary": list(SYMBOLS),
        "metadata_file": data.metadata_file, "min_audio_s": data.min_audio_s, "max_audio_s": data.max_audio_s,
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


def _write_atomic(path: Path, blob: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _write_cache(candidates: list[Path], blob: bytes) -> Path | None:
    """Write to the first candidate that accepts it; log a fall-back; never raise."""
    for n, path in enumerate(candidates):
        try:
            _write_atomic(path, blob)
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


_SAMPLE_FIELDS = ("id", "text", "num_tokens", "num_frames", "duration_s", "audio", "line")
_REJECTION_FIELDS = ("id", "reason", "line", "file")
_PROBE_FIELDS = ("name", "size", "mtime_ns", "frames", "rate", "channels", "error", "detail")


def _from_payload(payload: dict[str, Any]) -> tuple[list[Sample], list[Rejection]]:
    s = payload["samples"]
    samples = list(map(Sample, s["id"], s["text"], s["num_tokens"], s["num_frames"], s["duration_s"], s["audio"],
                       s["line"]))
    r = payload["rejected"]
    rejected = [Rejection(i, reason, "index", line, file)
                for i, reason, line, file in zip(r["id"], r["reason"], r["line"], r["file"])]
    return samples, rejected


# ----------------------------------------------------------------------- building


def build_index(data: DataConfig, features: FeaturesConfig) -> DatasetIndex:
    """The index of ``data.path``: from the cache when nothing changed, else built and cached."""
    # Building creates a few small objects per clip and frees none of them: the cyclic
    # collector would walk the growing heap again and again (a 100,000-item index took
    # 40% longer per item than a 13,100-item one). Nothing here makes reference cycles.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _build_index(data, features)
    finally:
        if enabled:
            gc.enable()


def _build_index(data: DataConfig, features: FeaturesConfig) -> DatasetIndex:
    started = time.perf_counter()
    root = resolve_root(data.path)
    metadata = read_metadata_bytes(root, data.metadata_file)
    audio = scan_audio(root)
    config = index_config(data, features)
    key = index_key(metadata, audio, config)
    candidates = index_cache_file(root, data)
    cache_path, payload, state = _read_cache(candidates, key) if candidates else (None, None, "off")
    stats = IndexStats(cache=state)
    if state == "hit" and payload is not None:
        try:
            samples, rejected = _from_payload(payload)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("index cache %s is unusable (%s); rebuilding the index", cache_path, exc)
            payload, stats.cache = None, "corrupt"
        else:
            stats.cache_file = str(cache_path)
            return _finish(root, samples, rejected, key, stats, started, log_rejections=False,
                           scan_inputs=(data.metadata_file, metadata, audio))
    entries, rejected = parse_metadata(metadata)
    old_probes: dict[str, tuple] = {}
    old_tokens: dict[str, int] = {}
    if payload is not None:
        try:
            p = payload["probes"]
            old_probes = {name: row for name, *row in zip(*(p[f] for f in _PROBE_FIELDS))}
            old_tokens = dict(zip(payload["samples"]["text"], payload["samples"]["num_tokens"]))
            old_tokens.update(zip(payload["other_tokens"]["text"], payload["other_tokens"]["n"]))
        except (KeyError, TypeError, ValueError):
            old_probes, old_tokens = {}, {}
    probes: dict[str, AudioProbe] = {}
    todo: list[tuple[str | None, int, str | None]] = []
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
        text = entry.text if entry.text not in old_tokens else None
        if name is not None or text is not None:
            todo.append((name, size, text))
    results, stats.workers = _run_items(root, todo, max(1, _workers(data)))
    tokens = dict(old_tokens)
    for (name, _, text), (probe, count) in zip(todo, results):
        if name is not None and probe is not None:
            probes[name] = AudioProbe(*probe)
            stats.headers_read += 1
        if text is not None and count is not None:
            tokens[text] = count
            stats.texts_tokenized += 1
    samples, rejected = _apply_rules(entries, rejected, audio, probes, tokens, data, features)
    if candidates:
        used = {a.name for a in audio.values()}
        probe_rows = [(name, audio_file.size, audio_file.mtime_ns, *_probe_tuple(probes[name]))
                      for audio_file in audio.values() for name in (audio_file.name,) if name in probes and name in used]
        # Token counts of texts that are not a sample's (their clip was rejected), so that a
        # later re-derivation tokenizes only texts that changed.
        sample_texts = {s.text for s in samples}
        other = {e.text: tokens[e.text] for e in entries if e.text not in sample_texts and e.text in tokens}
        payload_out = {
            "format": INDEX_FORMAT, "key": key, "root": str(root), "config": config,
            "samples": _columns(samples, _SAMPLE_FIELDS),
            "rejected": _columns(rejected, _REJECTION_FIELDS),
            "probes": {f: [row[i] for row in probe_rows] for i, f in enumerate(_PROBE_FIELDS)},
            "other_tokens": {"text": list(other), "n": list(other.values())},
        }
        written = _write_cache(candidates, _pack(payload_out))
        stats.cache_file = str(written) if written else ""
    return _finish(root, samples, rejected, key, stats, started, log_rejections=True,
                   scan_inputs=(data.metadata_file, metadata, audio))


def _workers(data: DataConfig) -> int:
    if data.index_workers > 0:
        return data.index_workers
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _apply_rules(entries: list[Entry], rejected: list[Rejection], audio: dict[str, AudioFile],
                 probes: dict[str, AudioProbe], tokens: dict[str, int], data: DataConfig,
                 features: FeaturesConfig) -> tuple[list[Sample], list[Rejection]]:
    """Turn parsed metadata, header facts and token counts into samples and rejections."""
    rejected = list(rejected)
    samples: list[Sample] = []
    shortest = features.n_fft // 2 + 1  # reflect centre padding needs this many samples
    for entry in entries:
        place = f"metadata line {entry.line}"
        count = tokens.get(entry.text, 0)
        if count == 0:
            detail = ": nothing left after normalisation" if entry.text else ""
            rejected.append(Rejection(entry.id, f"empty text on {place}{detail}", line=entry.line))
            continue
        if count > data.max_tokens:
            rejected.append(Rejection(entry.id, f"text of {count} tokens exceeds data.max_tokens={data.max_tokens} "
                                                f"({place})", line=entry.line))
            continue
        file = audio.get(entry.id)
        if file is None:
            where = relative_audio(entry.id)
            rejected.append(Rejection(entry.id, f"audio file missing: {where} ({place})", line=entry.line, file=where))
            continue
        where = relative_audio(entry.id, file.name)
        probe = probes[file.name]
        if probe.error:
            detail = f": {probe.detail}" if probe.detail else ""
            rejected.append(Rejection(entry.id, f"{probe.error}: {where}{detail} ({place})", line=entry.line,
                                      file=where))
            continue
        duration = probe.frames / probe.rate
        if duration > data.max_audio_s or duration < data.min_audio_s:
            bound = (f"longer than data.max_audio_s={data.max_audio_s:g}" if duration > data.max_audio_s
                     else f"shorter than data.min_audio_s={data.min_audio_s:g}")
            rejected.append(Rejection(entry.id, f"clip of {duration:.2f} s {bound} s: {where} ({place})",
                                      line=entry.line, file=where))
            continue
        n = expected_samples(probe.frames, probe.rate, features.sample_rate_hz)
        if n < shortest:
            rejected.append(Rejection(entry.id, f"clip of {n} samples at {features.sample_rate_hz} Hz is shorter "
                                                f"than n_fft/2+1 = {shortest}: {where} ({place})",
                                      line=entry.line, file=where))
            continue
        samples.append(Sample(entry.id, entry.text, count, 1 + n // features.hop_length, duration, file.name,
                              entry.line))
    return samples, rejected


def _finish(root: Path, samples: list[Sample], rejected: list[Rejection], key: str, stats: IndexStats,
            started: float, log_rejections: bool,
            scan_inputs: tuple[str, bytes, dict[str, AudioFile]]) -> DatasetIndex:
    stats.seconds = time.perf_counter() - started
    if log_rejections:
        for r in rejected:
            log.warning("rejected %s: %s", r.id, r.reason)
    log.info("index of %s: %d clips usable, %d rejected (cache %s, %d headers read, %d reused, %d worker(s), "
             "%.2f s)", root, len(samples), len(rejected), stats.cache, stats.headers_read, stats.headers_reused,
             stats.workers, stats.seconds)
    if not samples:
        raise DatasetError(f"dataset {root} has no usable clip ({len(rejected)} rejected)")
    metadata_file, metadata, audio = scan_inputs
    return DatasetIndex(root=root, samples=samples, rejected=rejected, fingerprint=key[:16], stats=stats,
                        metadata_file=metadata_file, _scan_inputs=(metadata, audio))
