"""The dataset index: which clips exist, how long they are, and which were rejected.

LJSpeech layout: ``DIR/metadata.csv`` with one ``id|text|normalized_text`` line per clip
(a plain ``id|text`` line is accepted too; the last field is the text used), and the
audio in ``DIR/wavs/<id>.wav``. The index reads only metadata and audio *headers*
(soundfile.info), never decodes audio, so the consumer can plan an epoch before any
producer has started. Producers read the same metadata with :func:`read_metadata`.

Every clip that cannot be used becomes a :class:`Rejection` with a precise reason; the
run records them in ``rejected.jsonl`` and counts them in summary.json.

Dataset agreement. A producer on another host must read the same dataset as the
trainer. Both sides compute a :class:`DatasetScan` from the metadata and a ``stat`` of
every audio file (no audio is decoded; 13,100 LJSpeech clips take well under a second)
and compare two fingerprints:

    metadata  sha256 of ``id TAB text LF`` per metadata entry, sorted by id (the text a
              producer tokenizes; line order, the unused middle column and malformed
              lines do not count)
    audio     sha256 of ``id TAB byte-size LF`` per audio file present, sorted by id

Paths and modification times are left out on purpose: a copy on another host lives
under another directory and ``cp``/``scp`` reset mtimes, yet it is the same data.
Byte sizes catch a resampled, re-encoded or truncated copy cheaply. A producer may lack
some audio files (an unfinished copy): it lists them in its HELLO, the trainer checks
the rest of the index against its own and never gives that producer those samples
(:func:`check_agreement`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping

from shared.config import DataConfig, FeaturesConfig
from shared.text import encode_text

log = logging.getLogger(__name__)

DEMO_DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "demo"
AUDIO_DIR = "wavs"
AUDIO_SUFFIX = ".wav"


class DatasetError(Exception):
    """The dataset as a whole cannot be used (missing, unreadable, no usable clip)."""


@dataclass(frozen=True)
class Entry:
    """One metadata line: the id, the text to speak, and where it came from."""

    id: str
    text: str
    line: int


@dataclass(frozen=True)
class Sample:
    """One usable clip: enough to plan batches without decoding audio."""

    id: str
    text: str
    num_tokens: int  # including EOS
    num_frames: int  # mel frames at the configured rate and hop
    duration_s: float


@dataclass(frozen=True)
class Rejection:
    id: str
    reason: str
    producer: str = "index"  # who rejected it: "index" (consumer) or a producer name

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "reason": self.reason, "producer": self.producer}


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
    root: Path
    samples: list[Sample]
    rejected: list[Rejection]
    scan: DatasetScan

    @property
    def fingerprint(self) -> str:
        return self.scan.fingerprint

    def by_id(self) -> dict[str, Sample]:
        return {s.id: s for s in self.samples}


def resolve_root(path: str) -> Path:
    """The dataset directory a user named, or the embedded demo set for ''."""
    root = Path(path).expanduser() if path else DEMO_DATA_DIR
    if not root.exists():
        raise DatasetError(f"dataset directory {root} does not exist")
    if not root.is_dir():
        raise DatasetError(f"dataset path {root} is not a directory")
    return root.resolve()


def audio_path(root: Path, sample_id: str) -> Path:
    return root / AUDIO_DIR / f"{sample_id}{AUDIO_SUFFIX}"


def read_metadata(root: Path, metadata_file: str = "metadata.csv") -> tuple[list[Entry], list[Rejection]]:
    """Parse the metadata file; malformed lines become rejections, never exceptions."""
    meta = root / metadata_file
    try:
        raw = meta.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"{meta} not found (expected LJSpeech layout: metadata.csv and wavs/)") from None
    except OSError as exc:
        raise DatasetError(f"cannot read {meta}: {exc.strerror}") from None
    if raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark (Windows editors) is not part of the id
        raw = raw[3:]
    entries: list[Entry] = []
    rejected: list[Rejection] = []
    seen: set[str] = set()
    for number, line_bytes in enumerate(raw.splitlines(), start=1):
        if not line_bytes.strip():
            continue
        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError:
            rejected.append(Rejection(f"line:{number}", f"metadata line {number} is not valid UTF-8"))
            continue
        parts = line.split("|")
        sample_id = parts[0].strip()
        if len(parts) not in (2, 3) or not sample_id or "/" in sample_id or sample_id.startswith("."):
            rejected.append(Rejection(sample_id or f"line:{number}",
                                      f"malformed metadata line {number}: expected id|text|normalized_text"))
            continue
        if sample_id in seen:
            rejected.append(Rejection(sample_id, f"duplicate id on metadata line {number}"))
            continue
        seen.add(sample_id)
        text = parts[-1].strip() or parts[1].strip()
        entries.append(Entry(sample_id, text, number))
    return entries, rejected


def _digest(lines: Iterable[str]) -> str:
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode("utf-8"))
    return digest.hexdigest()[:FINGERPRINT_HEX]


def metadata_fingerprint(entries: Iterable[Entry]) -> str:
    return _digest(f"{e.id}\t{e.text}\n" for e in sorted(entries, key=lambda e: e.id))


def audio_fingerprint(sizes: Mapping[str, int], without: Collection[str] = ()) -> str:
    return _digest(f"{i}\t{sizes[i]}\n" for i in sorted(sizes) if i not in without)


def scan_dataset(root: Path, metadata_file: str = "metadata.csv") -> DatasetScan:
    """Read the metadata and ``stat`` every audio file; raise DatasetError if unreadable."""
    entries, malformed = read_metadata(root, metadata_file)
    sizes: dict[str, int] = {}
    missing: list[str] = []
    for entry in entries:
        try:
            sizes[entry.id] = os.stat(audio_path(root, entry.id)).st_size
        except OSError:  # absent, or not reachable here (permissions, a dangling link): missing on this host
            missing.append(entry.id)
    return DatasetScan(root=root, metadata_file=metadata_file, entries=entries, malformed=malformed, sizes=sizes,
                       missing=sorted(missing), metadata_fp=metadata_fingerprint(entries),
                       audio_fp=audio_fingerprint(sizes))


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


def build_index(data: DataConfig, features: FeaturesConfig) -> DatasetIndex:
    """Read metadata and audio headers; return usable samples and rejections."""
    import soundfile  # here, so that processes which never index don't load libsndfile

    root = resolve_root(data.path)
    scan = scan_dataset(root, data.metadata_file)
    rejected = list(scan.malformed)
    samples: list[Sample] = []
    for entry in scan.entries:
        path = audio_path(root, entry.id)
        tokens = encode_text(entry.text)
        if len(tokens) == 0:
            rejected.append(Rejection(entry.id, f"empty text on metadata line {entry.line}"))
            continue
        if len(tokens) > data.max_tokens:
            rejected.append(Rejection(entry.id, f"text of {len(tokens)} tokens exceeds data.max_tokens={data.max_tokens}"))
            continue
        size = scan.sizes.get(entry.id)
        if size is None:
            rejected.append(Rejection(entry.id, f"audio file missing: {path.name}"))
            continue
        if size == 0:
            rejected.append(Rejection(entry.id, f"audio file empty: {path.name}"))
            continue
        try:
            info = soundfile.info(str(path))
        except Exception as exc:  # libsndfile reports every unreadable header as RuntimeError/LibsndfileError
            rejected.append(Rejection(entry.id, f"unreadable audio {path.name}: {str(exc).splitlines()[0][:160]}"))
            continue
        if info.frames <= 0 or info.samplerate <= 0:
            rejected.append(Rejection(entry.id, f"audio file has no samples: {path.name}"))
            continue
        duration = info.frames / info.samplerate
        if not data.min_audio_s <= duration <= data.max_audio_s:
            rejected.append(Rejection(
                entry.id, f"clip of {duration:.2f} s outside {data.min_audio_s}..{data.max_audio_s} s"))
            continue
        n = expected_samples(info.frames, info.samplerate, features.sample_rate_hz)
        if n < features.n_fft // 2 + 1:
            rejected.append(Rejection(entry.id, f"clip of {n} samples is shorter than n_fft/2+1"))
            continue
        frames = 1 + n // features.hop_length
        samples.append(Sample(entry.id, entry.text, len(tokens), frames, duration))
    for r in rejected:
        log.warning("rejected %s: %s", r.id, r.reason)
    if not samples:
        raise DatasetError(f"dataset {root} has no usable clip ({len(rejected)} rejected)")
    return DatasetIndex(root=root, samples=samples, rejected=rejected, scan=scan)
