"""The dataset index: which clips exist, how long they are, and which were rejected.

LJSpeech layout: ``DIR/metadata.csv`` with one ``id|text|normalized_text`` line per clip
(a plain ``id|text`` line is accepted too; the last field is the text used), and the
audio in ``DIR/wavs/<id>.wav``. The index reads only metadata and audio *headers*
(soundfile.info), never decodes audio, so the consumer can plan an epoch before any
producer has started. Producers read the same metadata with :func:`read_metadata`.

Every clip that cannot be used becomes a :class:`Rejection` with a precise reason; the
run records them in ``rejected.jsonl`` and counts them in summary.json.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

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


@dataclass
class DatasetIndex:
    root: Path
    samples: list[Sample]
    rejected: list[Rejection]
    fingerprint: str

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


def expected_samples(num_samples: int, source_rate_hz: int, target_rate_hz: int) -> int:
    """Length of a clip after resampling; producers pad or trim to exactly this."""
    if source_rate_hz == target_rate_hz:
        return num_samples
    return int(math.ceil(num_samples * target_rate_hz / source_rate_hz))


def build_index(data: DataConfig, features: FeaturesConfig) -> DatasetIndex:
    """Read metadata and audio headers; return usable samples and rejections."""
    import soundfile  # here, so that processes which never index don't load libsndfile

    root = resolve_root(data.path)
    entries, rejected = read_metadata(root, data.metadata_file)
    samples: list[Sample] = []
    digest = hashlib.sha256()
    digest.update(repr((features.sample_rate_hz, features.hop_length)).encode())
    for entry in entries:
        path = audio_path(root, entry.id)
        tokens = encode_text(entry.text)
        if len(tokens) == 0:
            rejected.append(Rejection(entry.id, f"empty text on metadata line {entry.line}"))
            continue
        if len(tokens) > data.max_tokens:
            rejected.append(Rejection(entry.id, f"text of {len(tokens)} tokens exceeds data.max_tokens={data.max_tokens}"))
            continue
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            rejected.append(Rejection(entry.id, f"audio file missing: {path.name}"))
            continue
        if stat.st_size == 0:
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
        digest.update(f"{entry.id}|{entry.text}|{info.frames}|{info.samplerate}\n".encode())
    for r in rejected:
        log.warning("rejected %s: %s", r.id, r.reason)
    if not samples:
        raise DatasetError(f"dataset {root} has no usable clip ({len(rejected)} rejected)")
    return DatasetIndex(root=root, samples=samples, rejected=rejected, fingerprint=digest.hexdigest()[:16])
