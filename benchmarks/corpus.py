"""The benchmarks' generated corpora, made in the run that measures them: LJSpeech-layout
datasets (tiny WAV files for the index, LJSpeech-like clips for the producers), the same clips
packed as users download them (WebDataset-style tar shards, Parquet as Hugging Face ``datasets``
writes an Audio column, a lhotse Shar directory), and the leases a run plans from any of them."""

from __future__ import annotations

import gzip
import io
import json
import random
import struct
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import soundfile

from ..consumer.coordinator.lease_tables import TokenTable
from ..consumer.plan import EpochPlanner
from ..shared import wire
from ..shared.config import BatchingConfig, DataConfig, FeaturesConfig
from ..shared.dataset.corpus.registry import read_metadata
from ..shared.dataset.files import scan_audio
from ..consumer.index.index import build_index
from ..shared.dataset.parquet import pyarrow_modules

# Clips packed into tar shards of this many (8 shards of ~2.3 MB for 64 clips), in this directory
# beside the clips' own.
CLIPS_PER_SHARD = 8
SHARDS_DIR = "shards"
# ... and into Parquet files of this many clips (row groups of CLIPS_PER_SHARD), in this directory.
CLIPS_PER_PARQUET_FILE = 32
PARQUET_DIR = "parquet"
# ... and into a lhotse Shar directory of shards of CLIPS_PER_SHARD cuts, in this directory.
SHAR_DIR = "shar"
# Generated index items: tiny real WAV files (header + 0.25 s of 8 kHz 16-bit silence).
INDEX_RATE_HZ = 8000
INDEX_SECONDS = 0.25
# LJSpeech's clip durations: mean 6.6 s, sd ~2.2 s, between 1.1 and 10.1 s.
CLIP_MEAN_S, CLIP_SD_S, CLIP_MIN_S, CLIP_MAX_S = 6.6, 2.2, 1.1, 10.1
BATCH_SIZE = 16
WORDS = ("the prisoner was taken to newgate where he remained until his trial at the old bailey in "
         "september of that year when the jury found him guilty and the court sentenced him to death "
         "but the sentence was afterwards commuted to transportation for life").split()


def _wav_bytes(rate_hz: int, seconds: float) -> bytes:
    """A complete 16-bit mono PCM WAV file of silence."""
    frames = int(rate_hz * seconds)
    data = frames * 2
    header = b"RIFF" + struct.pack("<I", 36 + data) + b"WAVE" + b"fmt " + struct.pack(
        "<IHHIIHH", 16, 1, 1, rate_hz, rate_hz * 2, 2, 16) + b"data" + struct.pack("<I", data)
    return header + b"\0" * data


def make_index_dataset(root: Path, items: int, seed: int = 0) -> float:
    """Metadata plus ``items`` tiny WAV files; returns the seconds it took."""
    started = time.perf_counter()
    rng = random.Random(seed)
    wavs = root / "wavs"
    wavs.mkdir(parents=True, exist_ok=True)
    blob = _wav_bytes(INDEX_RATE_HZ, INDEX_SECONDS)
    lines = []
    for i in range(items):
        sample_id = f"LJ{i // 1000:03d}-{i % 1000:04d}"
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 24))).capitalize() + "."
        lines.append(f"{sample_id}|{text}|{text}")
        with open(wavs / f"{sample_id}.wav", "wb") as f:
            f.write(blob)
    (root / "metadata.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return time.perf_counter() - started


def make_clips(root: Path, count: int, seed: int = 0) -> None:
    """``count`` LJSpeech-like clips (voiced-like tones) with texts of matching length."""
    rng = np.random.default_rng(seed)
    wavs = root / "wavs"
    wavs.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(count):
        seconds = float(np.clip(rng.normal(CLIP_MEAN_S, CLIP_SD_S), CLIP_MIN_S, CLIP_MAX_S))
        t = np.arange(int(seconds * 22050)) / 22050
        f0 = 100 + 60 * rng.random()
        phase = 2 * np.pi * np.cumsum(f0 * (1 + 0.05 * np.sin(2 * np.pi * 3 * t))) / 22050
        audio = sum(np.sin(k * phase) / k for k in range(1, 8)) * 0.15 + 0.005 * rng.standard_normal(t.size)
        sample_id = f"CLIP{i:04d}"
        soundfile.write(str(wavs / f"{sample_id}.wav"), audio.astype(np.float32), 22050, subtype="PCM_16")
        words = max(2, int(seconds * 2.6))  # LJSpeech: ~15 characters per second
        text = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words)).capitalize() + "."
        lines.append(f"{sample_id}|{text}|{text}")
    (root / "metadata.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")


def make_clip_shards(root: Path, per_shard: int = CLIPS_PER_SHARD) -> Path:
    """The clips of :func:`make_clips` in ``root`` packed into tar shards beside it
    (``KEY.wav`` + ``KEY.txt`` members, in metadata order); returns their directory."""
    shards = root.parent / SHARDS_DIR
    shards.mkdir(parents=True, exist_ok=True)
    entries, _ = read_metadata(root)
    files = scan_audio(root)
    for n in range(0, len(entries), per_shard):
        with tarfile.open(shards / f"clips-{n // per_shard:04d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for entry in entries[n:n + per_shard]:
                tar.add(str(root / files[entry.id].name), arcname=f"{entry.id}.wav")
                text = entry.text.encode("utf-8")
                info = tarfile.TarInfo(f"{entry.id}.txt")
                info.size = len(text)
                tar.addfile(info, io.BytesIO(text))
    return shards


def make_clip_parquet(root: Path, per_group: int = CLIPS_PER_SHARD, per_file: int = CLIPS_PER_PARQUET_FILE) -> Path:
    """The clips of :func:`make_clips` in ``root`` as Parquet files beside it, laid out as
    ``datasets`` writes an Audio column (an ``audio`` struct of bytes and path, uncompressed and
    PLAIN-encoded, beside ``id`` and ``text``, snappy and dictionary-encoded); returns their directory."""
    pa, pq = pyarrow_modules()
    out = root.parent / PARQUET_DIR
    out.mkdir(parents=True, exist_ok=True)
    entries, _ = read_metadata(root)
    files = scan_audio(root)
    schema = pa.schema([("audio", pa.struct([("bytes", pa.binary()), ("path", pa.string())])), ("id", pa.string()),
                        ("text", pa.string())])
    for n in range(0, len(entries), per_file):
        part = entries[n:n + per_file]
        table = pa.table({"audio": [{"bytes": (root / files[e.id].name).read_bytes(), "path": files[e.id].name}
                                    for e in part],
                          "id": [e.id for e in part], "text": [e.text for e in part]}, schema=schema)
        pq.write_table(table, out / f"clips-{n // per_file:04d}.parquet", row_group_size=per_group,  # as datasets
                       compression={"audio.bytes": "none", "audio.path": "none", "id": "snappy", "text": "snappy"},
                       use_dictionary=["id", "text"], column_encoding={"audio.bytes": "PLAIN", "audio.path": "PLAIN"})
    return out


def make_clip_shar(root: Path, per_shard: int = CLIPS_PER_SHARD) -> Path:
    """The clips of :func:`make_clips` in ``root`` as a lhotse Shar directory beside it, laid out as
    ``CutSet.to_shar(fields={"recording": "wav"})`` writes one (``cuts.NNNNNN.jsonl.gz`` beside
    ``recording.NNNNNN.tar`` of ``ID.wav`` and ``ID.json`` members; no lhotse needed); returns its directory."""
    out = root.parent / SHAR_DIR
    out.mkdir(parents=True, exist_ok=True)
    entries, _ = read_metadata(root)
    files = scan_audio(root)
    for n in range(0, len(entries), per_shard):
        cuts = []
        with tarfile.open(out / f"recording.{n // per_shard:06d}.tar", "w") as tar:
            for entry in entries[n:n + per_shard]:
                path = root / files[entry.id].name
                info = soundfile.info(str(path))
                recording = {"id": entry.id, "sources": [{"type": "shar", "channels": [0], "source": ""}],
                             "sampling_rate": info.samplerate, "num_samples": info.frames,
                             "duration": info.frames / info.samplerate, "channel_ids": [0]}
                tar.add(str(path), arcname=f"{entry.id}.wav")
                manifest = json.dumps(recording).encode("utf-8") + b"\n"
                member = tarfile.TarInfo(f"{entry.id}.json")
                member.size = len(manifest)
                tar.addfile(member, io.BytesIO(manifest))
                cuts.append({"id": entry.id, "start": 0, "duration": recording["duration"], "channel": 0,
                             "supervisions": [{"id": f"{entry.id}-s", "recording_id": entry.id, "start": 0.0,
                                               "duration": recording["duration"], "channel": 0, "text": entry.text}],
                             "recording": recording, "type": "MonoCut"})
        lines = "".join(json.dumps(c) + "\n" for c in cuts).encode("utf-8")
        (out / f"cuts.{n // per_shard:06d}.jsonl.gz").write_bytes(gzip.compress(lines))
    return out


def plan_leases(root: Path, batch_size: int = BATCH_SIZE, features: FeaturesConfig | None = None) -> list[Any]:
    """The leases (shared/wire.py's Lease) of the first epoch's plan of ``root`` (its frames
    under ``features``, default the default mel's)."""
    index = build_index(DataConfig(path=str(root), index_cache="off"), features or FeaturesConfig())
    planner = EpochPlanner(index.samples, BatchingConfig(batch_size=batch_size))
    assert index.vocabulary is not None
    tokens = TokenTable(index.samples, index.vocabulary)
    return [wire.Lease(n, 0, b.index, tuple(b.ids), (b.shape[0], b.shape[1]), b.rows,
                       tuple(tuple(row) for row in tokens(b.ids))) for n, b in enumerate(planner.plan(0), start=1)]


def leases_of(planned: Any, tokens: TokenTable) -> list[wire.Lease]:
    """The lease the coordinator sends a producer on the trainer's host for each planned batch
    (consumer/coordinator/leases.py: the table's token ids, speakers, languages, texts, files,
    durations and the files' stamps), numbered from 1: what a baseline hands the producers'
    BatchMaker so that it does their work."""
    out = []
    for n, b in enumerate(planned, start=1):
        carried = tokens.lease_fields(b.ids, b.clips)
        out.append(wire.Lease(lease=n, epoch=b.epoch, index=b.index, ids=tuple(b.ids), shape=(b.shape[0], b.shape[1]),
                              rows=b.rows, tokens=tuple(tuple(row) for row in carried["tokens"]),
                              speakers=tuple(carried["speakers"]), languages=tuple(carried["languages"]),
                              texts=carried["texts"], files=carried["files"], durations=carried["durations"],
                              stamps=carried["stamps"]))
    return out
