"""Small factories for fake data: LJSpeech-layout datasets and collated batches."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import numpy as np
import soundfile

if TYPE_CHECKING:
    from shared.dataset import DatasetScan

WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing "
         "near an old stone bridge under grey autumn skies").split()


def tone(duration_s: float, rate_hz: int = 22050, seed: int = 0, channels: int = 1) -> np.ndarray:
    """A deterministic voiced-like signal: a few harmonics with vibrato and a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(duration_s * rate_hz)) / rate_hz
    f0 = 110 + 40 * rng.random()
    phase = 2 * np.pi * np.cumsum(f0 * (1 + 0.03 * np.sin(2 * np.pi * 5 * t))) / rate_hz
    audio = sum(np.sin(k * phase) / k for k in range(1, 6)) * 0.2 + 0.01 * rng.standard_normal(t.size)
    audio = audio.astype(np.float32)
    if channels > 1:
        audio = np.stack([audio] * channels, axis=1)
    return audio


def sentence(seed: int, words: int = 8) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, size=words)).capitalize() + "."


def make_dataset(root: Path, count: int = 24, durations: Iterable[float] | None = None,
                 rate_hz: int = 22050, prefix: str = "T") -> list[str]:
    """Write ``count`` clips and metadata.csv under ``root``; return the ids in order."""
    wavs = root / "wavs"
    wavs.mkdir(parents=True, exist_ok=True)
    durations = list(durations) if durations is not None else [0.6 + 0.1 * (i % 12) for i in range(count)]
    ids, lines = [], []
    for i, duration in enumerate(durations[:count]):
        sample_id = f"{prefix}{i:04d}"
        soundfile.write(str(wavs / f"{sample_id}.wav"), tone(duration, rate_hz, seed=i), rate_hz, subtype="PCM_16")
        text = sentence(i, words=3 + i % 7)
        lines.append(f"{sample_id}|{text}|{text}")
        ids.append(sample_id)
    (root / "metadata.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return ids


def append_metadata(root: Path, lines: Iterable[str | bytes]) -> None:
    with open(root / "metadata.csv", "ab") as f:
        for line in lines:
            f.write((line.encode("utf-8") if isinstance(line, str) else line) + b"\n")


def make_batch(batch_size: int = 4, max_tokens: int = 16, max_frames: int = 32, n_mels: int = 80,
               valid: int | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """A collated batch with ``valid`` real rows (the rest empty), as producers send them."""
    from producer.collate import collate

    rng = np.random.default_rng(seed)
    valid = batch_size if valid is None else valid
    tokens = [rng.integers(2, 30, size=rng.integers(2, max_tokens + 1)).astype(np.int32) for _ in range(valid)]
    mels = [rng.standard_normal((int(rng.integers(1, max_frames + 1)), n_mels)).astype(np.float32)
            for _ in range(valid)]
    return collate(tokens, mels, batch_size, max_tokens, max_frames, n_mels, float(np.log(1e-5)))


def make_samples(count: int = 100, seed: int = 0, max_tokens: int = 150, max_frames: int = 800,
                 prefix: str = "S") -> list:
    """``count`` index samples (shared.dataset.Sample) of random text and mel lengths."""
    from shared.dataset import Sample

    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        frames = int(rng.integers(20, max_frames + 1))
        samples.append(Sample(id=f"{prefix}{i:05d}", text=sentence(i), num_tokens=int(rng.integers(2, max_tokens + 1)),
                              num_frames=frames, duration_s=frames * 256 / 22050))
    return samples


def add_clip(root: Path, sample_id: str, duration_s: float, rate_hz: int = 22050, text: str | None = None,
             channels: int = 1, seed: int = 0, subtype: str = "PCM_16") -> Path:
    """Write one more clip ``wavs/<sample_id>.wav`` and append its metadata line; return its path."""
    wavs = root / "wavs"
    wavs.mkdir(parents=True, exist_ok=True)
    path = wavs / f"{sample_id}.wav"
    soundfile.write(str(path), tone(duration_s, rate_hz, seed=seed, channels=channels), rate_hz, subtype=subtype)
    text = sentence(seed) if text is None else text
    append_metadata(root, [f"{sample_id}|{text}|{text}"])
    return path


def fake_scan(ids: Iterable[str], missing: Iterable[str] = ()) -> "DatasetScan":
    """A trainer's dataset scan without files: entries with some text, made-up audio sizes."""
    from shared.dataset import DatasetScan, Entry, audio_fingerprint, metadata_fingerprint

    entries = [Entry(i, f"text of {i}", n + 1) for n, i in enumerate(ids)]
    lacking = set(missing)
    sizes = {e.id: 1000 + n for n, e in enumerate(entries) if e.id not in lacking}
    return DatasetScan(root=Path("/nowhere"), metadata_file="metadata.csv", entries=entries, malformed=[],
                       sizes=sizes, missing=sorted(lacking), metadata_fp=metadata_fingerprint(entries),
                       audio_fp=audio_fingerprint(sizes))


def describe_copy(scan: "DatasetScan", lacking: Iterable[str] = ()) -> dict:
    """The HELLO ``dataset`` of a host whose copy of ``scan`` lacks the files ``lacking``."""
    from shared.dataset import audio_fingerprint

    gone = sorted(set(lacking) | set(scan.missing))
    return {**scan.describe(), "audio": audio_fingerprint(scan.sizes, without=gone), "missing": gone,
            "missing_count": len(gone)}
