"""Parquet datasets for the tests, written by the Hugging Face ``datasets`` library as a user's
corpus is: rows of ``audio`` (the Audio feature's ``{bytes, path}``), text, speaker and language
columns, in row groups; and the faults a corpus may hold (a corrupt row group, undecodable audio)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import soundfile

from tests.factories import clip_member, sentence


@dataclass
class ParquetSet:
    """Files made by :func:`make_parquet`: ``clips`` id -> (text, speaker, language) of every row,
    ``audio`` id -> its encoded bytes, ``rows`` id -> (file name, row group, row in it), ``paths``
    the files."""

    root: Path
    clips: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    audio: dict[str, bytes] = field(default_factory=dict)
    rows: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    paths: list[Path] = field(default_factory=list)


def write_parquet(path: Path, columns: dict[str, list[Any]], row_group: int, audio: str = "audio") -> Path:
    """``columns`` as one Parquet file by ``datasets`` (``audio``: the column cast to its Audio
    feature), ``row_group`` rows to a row group."""
    from datasets import Audio, Dataset

    data = Dataset.from_dict(columns)
    if audio:
        data = data.cast_column(audio, Audio())
    path.parent.mkdir(parents=True, exist_ok=True)
    data.to_parquet(str(path), batch_size=row_group)
    return path


def make_parquet(root: Path, files: int = 2, per_file: int = 8, row_group: int = 4, prefix: str = "PQ",
                 name: str = "train", ids: bool = True, durations: bool = True,
                 names: tuple[str, str, str] = ("text", "speaker_id", "language")) -> ParquetSet:
    """``files`` Parquet files ``root/NAME-000.parquet``... of ``per_file`` rows each: an ``id``
    column (unless ``ids`` is false), the audio (flac, every third wav, 0.6 to 1.7 s of tone), the
    text, speaker and language columns ``names``, and a ``duration`` column (with ``durations``)."""
    made = ParquetSet(root)
    n = 0
    for f in range(files):
        file_name = f"{name}-{f:03d}.parquet"
        columns: dict[str, list[Any]] = {"audio": []}
        for key in (("id",) if ids else ()) + names + (("duration",) if durations else ()):
            columns[key] = []
        for r in range(per_file):
            fmt = "wav" if n % 3 == 0 else "flac"
            duration = 0.6 + 0.1 * (n % 12)
            data = clip_member(n, duration, fmt)
            sample_id = f"{prefix}{n:04d}" if ids else f"{name}-{f:03d}_{r}"
            text, speaker, language = sentence(n, words=3 + n % 7), f"spk{n % 3}", "en"
            columns["audio"].append({"bytes": data, "path": f"{sample_id}.{fmt}"})
            if ids:
                columns["id"].append(sample_id)
            for key, value in zip(names, (text, speaker, language)):
                columns[key].append(value)
            if durations:
                columns["duration"].append(_seconds(data))
            made.clips[sample_id] = (text, speaker, language)
            made.audio[sample_id] = data
            made.rows[sample_id] = (file_name, r // row_group, r % row_group)
            n += 1
        made.paths.append(write_parquet(root / file_name, columns, row_group))
    return made


def _seconds(data: bytes) -> float:
    import io

    return soundfile.info(io.BytesIO(data)).duration


def corrupt_row_group(path: Path, group: int) -> None:
    """Overwrite the page headers of every column chunk of row group ``group`` with garbage: its
    rows cannot be read, the other groups' can."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata.row_group(group)
    data = bytearray(path.read_bytes())
    for c in range(meta.num_columns):
        offset = meta.column(c).data_page_offset
        data[offset:offset + 12] = b"\xff" * 12
    path.write_bytes(bytes(data))


def loose_copy(made: ParquetSet, root: Path) -> Path:
    """The clips of ``made`` as an LJSpeech-layout dataset (the same audio bytes as ``wavs/ID.*``)."""
    wavs = root / "wavs"
    wavs.mkdir(parents=True, exist_ok=True)
    lines = []
    for sample_id, data in made.audio.items():
        suffix = "wav" if data[:4] == b"RIFF" else "flac"
        (wavs / f"{sample_id}.{suffix}").write_bytes(data)
        text = made.clips[sample_id][0]
        lines.append(f"{sample_id}|{text}|{text}")
    (root / "metadata.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root
