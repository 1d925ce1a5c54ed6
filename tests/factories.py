"""Small factories for fake data: LJSpeech-layout datasets and collated batches."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import numpy as np
import soundfile

from stoker.shared.dataset.layouts import COLUMNS_AUTO
from stoker.shared.mel import pad_values

if TYPE_CHECKING:
    from stoker.shared.dataset.agreement import Reference

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


# Token ids of fake batches are drawn below this (about an English character vocabulary).
TOKEN_IDS = 38


def make_batch(batch_size: int = 4, max_tokens: int = 16, max_frames: int = 32, n_mels: int = 80,
               valid: int | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """A collated batch with ``valid`` real rows (the rest empty), as producers send them."""
    from stoker.shared.batch import SCHEMA, batch_dims, collate
    from stoker.shared.config import FeaturesConfig

    rng = np.random.default_rng(seed)
    valid = batch_size if valid is None else valid
    tokens = [rng.integers(2, TOKEN_IDS, size=rng.integers(2, max_tokens + 1)).astype(np.int32) for _ in range(valid)]
    mels = [rng.standard_normal((int(rng.integers(1, max_frames + 1)), n_mels)).astype(np.float32)
            for _ in range(valid)]
    return collate([{"tokens": t, "mel": m} for t, m in zip(tokens, mels)],
                   batch_dims(batch_size, (max_tokens, max_frames), n_mels), pad_values(SCHEMA, FeaturesConfig(), "off"))


def make_samples(count: int = 100, seed: int = 0, max_tokens: int = 150, max_frames: int = 800,
                 prefix: str = "S") -> list:
    """``count`` index samples (shared.dataset.Sample) of random text and mel lengths."""
    from stoker.shared.dataset.types import Sample

    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        frames = int(rng.integers(20, max_frames + 1))
        samples.append(Sample(id=f"{prefix}{i:05d}", text=sentence(i), num_tokens=int(rng.integers(2, max_tokens + 1)),
                              num_frames=frames, duration_s=frames * 256 / 22050))
    return samples


def add_clip(root: Path, sample_id: str, duration_s: float, rate_hz: int = 22050, text: str | None = None,
             channels: int = 1, seed: int = 0, subtype: str | None = None, suffix: str = ".wav",
             metadata: bool = True) -> Path:
    """Write one more clip ``wavs/<sample_id><suffix>`` (format from the suffix: wav, flac,
    ogg) and append its metadata line unless ``metadata`` is False; return its path."""
    wavs = root / "wavs"
    wavs.mkdir(parents=True, exist_ok=True)
    path = wavs / f"{sample_id}{suffix}"
    subtype = subtype or {".wav": "PCM_16", ".flac": "PCM_16", ".ogg": "VORBIS"}[suffix]
    soundfile.write(str(path), tone(duration_s, rate_hz, seed=seed, channels=channels), rate_hz, subtype=subtype)
    text = sentence(seed) if text is None else text
    if metadata:
        append_metadata(root, [f"{sample_id}|{text}|{text}"])
    return path


def truncate_wav(path: Path, keep_fraction: float = 0.25) -> tuple[int, int]:
    """Cut a PCM WAV short inside its sample data, keeping its header (which then claims
    more bytes than the file holds, as a copy interrupted halfway does). Returns
    (declared data bytes, data bytes kept)."""
    raw = path.read_bytes()
    at = raw.index(b"data")
    declared = int.from_bytes(raw[at + 4:at + 8], "little")
    kept = int(declared * keep_fraction) & ~1
    path.write_bytes(raw[:at + 8 + kept])
    return declared, kept


@dataclass
class FaultyDataset:
    """A dataset holding every fault the reader must reject, beside valid clips of every kind.

    ``valid``: ids that must be trained, each exactly once per epoch.
    ``index_rejections``: (id, exact reason) the index gives, the file and metadata line
    named. ``loose_rejections``: (id, start, end) of reasons with libsndfile's own words
    in the middle. ``producer_rejections``: id -> start of the reason a producer gives
    (faults only decoding reveals: a FLAC corrupted in the middle, header and tail intact).
    Run with ``data.max_audio_s = max_audio_s``, so that LONG is overlong.
    """

    root: Path
    valid: list[str]
    index_rejections: list[tuple[str, str]]
    loose_rejections: list[tuple[str, str, str]]
    producer_rejections: dict[str, str]
    max_audio_s: float = 2.5


def make_faulty_dataset(root: Path, good: int = 8) -> FaultyDataset:
    """Valid wav/flac/ogg/stereo/16 kHz/plain-``id|text`` clips plus one clip or line per fault."""
    valid = make_dataset(root, count=good)
    add_clip(root, "STEREO", 1.1, channels=2, seed=101)
    add_clip(root, "RATE16K", 0.9, rate_hz=16000, seed=102)
    add_clip(root, "FLACCLIP", 1.2, suffix=".flac", seed=103)
    add_clip(root, "OGGCLIP", 1.0, suffix=".ogg", seed=104)
    add_clip(root, "PLAIN", 0.8, seed=105, metadata=False)
    append_metadata(root, ["PLAIN|Only two fields on this line."])
    valid += ["STEREO", "RATE16K", "FLACCLIP", "OGGCLIP", "PLAIN"]
    line = good + 5
    exact: list[tuple[str, str]] = []
    loose: list[tuple[str, str, str]] = []

    def next_line() -> int:
        nonlocal line
        line += 1
        return line

    append_metadata(root, ["GONE|A clip whose audio file is not there.|A clip whose audio file is not there."])
    exact.append(("GONE", f"audio file missing: wavs/GONE.wav (metadata line {next_line()})"))
    (root / "wavs" / "ZERO.wav").write_bytes(b"")
    append_metadata(root, ["ZERO|An empty audio file.|An empty audio file."])
    exact.append(("ZERO", f"audio file empty: wavs/ZERO.wav (metadata line {next_line()})"))
    declared, kept = truncate_wav(add_clip(root, "CUT", 1.5, seed=106))
    exact.append(("CUT", f"audio file truncated: wavs/CUT.wav: holds {kept} of the {declared} sample bytes its "
                         f"header declares (metadata line {next_line()})"))
    (root / "wavs" / "JUNK.wav").write_text("this is a text file, not audio\n" * 10, encoding="utf-8")
    append_metadata(root, ["JUNK|A text file named like audio.|A text file named like audio."])
    loose.append(("JUNK", "audio file unreadable: wavs/JUNK.wav: ", f" (metadata line {next_line()})"))
    append_metadata(root, ["NOPIPE this line has no separator at all"])
    exact.append(("NOPIPE this line has no separator at all",
                  f"malformed metadata line {next_line()}: 1 field, expected id|text|normalized_text or id|text"))
    add_clip(root, "MUTE", 1.0, seed=107, metadata=False)
    append_metadata(root, ["MUTE||"])
    exact.append(("MUTE", f"empty text on metadata line {next_line()}"))
    add_clip(root, "LATIN", 1.0, seed=108, metadata=False)
    append_metadata(root, [b"LATIN|caf\xe9 au lait|caf\xe9 au lait"])
    exact.append(("LATIN", f"metadata line {next_line()} is not valid UTF-8 (byte 0xe9 at column 10)"))
    append_metadata(root, [f"{valid[0]}|The same id a second time.|The same id a second time."])
    exact.append((valid[0], f"duplicate id on metadata line {next_line()} (first on line 1)"))
    add_clip(root, "LONG", 3.0, seed=109)
    exact.append(("LONG", f"clip of 3.00 s longer than data.max_audio_s=2.5 s: wavs/LONG.wav "
                          f"(metadata line {next_line()})"))
    flac = add_clip(root, "CUTFLAC", 1.5, suffix=".flac", seed=110)
    raw = flac.read_bytes()
    flac.write_bytes(raw[:len(raw) // 2])  # STREAMINFO intact: only decoding the tail finds the cut
    exact.append(("CUTFLAC", "audio file truncated: wavs/CUTFLAC.flac: the stream ends before sample 33075 its "
                             f"header announces (metadata line {next_line()})"))
    bad = bytearray(add_clip(root, "BADFLAC", 1.5, suffix=".flac", seed=111).read_bytes())
    bad[len(bad) // 3:len(bad) // 3 + 64] = b"\xff" * 64  # header and tail intact: only decoding finds it
    (root / "wavs" / "BADFLAC.flac").write_bytes(bytes(bad))
    next_line()
    return FaultyDataset(root, valid, exact, loose, {"BADFLAC": "audio file unreadable: wavs/BADFLAC.flac: "})


def fake_reference(sha256: str = "", root: Path = Path("/nowhere")) -> "Reference":
    """The trainer's side of the dataset agreement without a metadata file: its SHA-256 made up
    (default: :func:`fake_sha256` of "trainer")."""
    from stoker.shared.dataset.agreement import Reference

    return Reference(root, "metadata.csv", stored_sha256=sha256 or fake_sha256("trainer"))


def fake_sha256(what: str) -> str:
    return hashlib.sha256(what.encode()).hexdigest()


def copy_described(sha256: str = "") -> dict:
    """The HELLO ``dataset`` of a producer pointed at a copy of metadata.csv with that SHA-256
    (default: :func:`fake_reference`'s)."""
    return {"metadata_file": "metadata.csv", "columns": COLUMNS_AUTO, "sha256": sha256 or fake_sha256("trainer")}


@dataclass
class ShardSet:
    """Tar shards made by :func:`make_shards`: ``clips`` id -> (text, speaker, language) of every
    usable clip, ``members`` id -> (shard file name, audio member name), ``paths`` the shards."""

    root: Path
    clips: dict[str, tuple[str, str, str]]
    members: dict[str, tuple[str, str]]
    paths: list[Path]


def _add_member(tar, name: str, data: bytes) -> None:
    import io
    import tarfile

    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _clip_bytes(duration_s: float, seed: int, fmt: str, rate_hz: int = 22050) -> bytes:
    import io

    buffer = io.BytesIO()
    soundfile.write(buffer, tone(duration_s, rate_hz, seed=seed), rate_hz, format=fmt.upper(), subtype="PCM_16")
    return buffer.getvalue()


def make_shards(root: Path, shards: int = 3, per_shard: int = 6, prefix: str = "SH", name: str = "train",
                durations: bool = False) -> ShardSet:
    """WebDataset-style shards ``root/NAME-000.tar``...: per clip ``clips/ID.flac`` (every third
    ``.wav``) and its text, as ``ID.txt`` or (every other clip) ``ID.json`` with a speaker and a
    language (and, with ``durations``, the duration). Clips are 0.6 to 1.7 s of :func:`tone`."""
    import json
    import tarfile

    root.mkdir(parents=True, exist_ok=True)
    clips: dict[str, tuple[str, str, str]] = {}
    members: dict[str, tuple[str, str]] = {}
    paths = []
    n = 0
    for s in range(shards):
        path = root / f"{name}-{s:03d}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for _ in range(per_shard):
                sample_id, text = f"{prefix}{n:04d}", sentence(n, words=3 + n % 7)
                fmt = "wav" if n % 3 == 0 else "flac"
                duration = 0.6 + 0.1 * (n % 12)
                audio = _clip_bytes(duration, n, fmt)
                _add_member(tar, f"clips/{sample_id}.{fmt}", audio)
                if n % 2:
                    speaker, language = f"spk{n % 3}", "en"
                    obj = {"text": text, "speaker": speaker, "language": language}
                    if durations:
                        obj["duration"] = round(duration, 6)
                    _add_member(tar, f"clips/{sample_id}.json", json.dumps(obj).encode())
                else:
                    speaker, language = "default", "en"
                    _add_member(tar, f"clips/{sample_id}.txt", text.encode())
                clips[sample_id] = (text, speaker, language)
                members[sample_id] = (path.name, f"clips/{sample_id}.{fmt}")
                n += 1
        paths.append(path)
    return ShardSet(root, clips, members, paths)


def add_shard(root: Path, file_name: str, members: dict[str, bytes]) -> Path:
    """One more shard of the given members (name -> bytes), e.g. faulty ones."""
    import tarfile

    path = root / file_name
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members.items():
            _add_member(tar, name, data)
    return path


def clip_member(seed: int, duration_s: float = 1.0, fmt: str = "flac") -> bytes:
    """The bytes of one clip file (``fmt``: flac or wav), for :func:`add_shard`."""
    return _clip_bytes(duration_s, seed, fmt)


def loose_copy(shards: ShardSet, root: Path) -> Path:
    """The clips of ``shards`` as an LJSpeech-layout dataset (the same audio bytes, as
    ``wavs/ID.flac``/``.wav``; id|text|text lines): the same dataset as loose files."""
    import tarfile

    wavs = root / "wavs"
    wavs.mkdir(parents=True, exist_ok=True)
    lines = []
    for path in shards.paths:
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                base = member.name.rpartition("/")[2]
                stem, _, suffix = base.partition(".")
                if stem in shards.clips and suffix in ("flac", "wav"):
                    (wavs / base).write_bytes(tar.extractfile(member).read())
                    text = shards.clips[stem][0]
                    lines.append(f"{stem}|{text}|{text}")
    (root / "metadata.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root
