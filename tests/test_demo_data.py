"""The embedded demo dataset (data/demo) is complete and in the advertised format."""

from __future__ import annotations

from pathlib import Path

import soundfile as sf

DEMO_DIR = Path(__file__).resolve().parent.parent / "data" / "demo"
NUM_CLIPS = 64
SAMPLE_RATE_HZ = 22050
MIN_DURATION_S = 1.5
MAX_DURATION_S = 5.0
MAX_TOTAL_BYTES = 7_000_000  # keep the committed set small


def _rows() -> list[list[str]]:
    lines = (DEMO_DIR / "metadata.csv").read_text(encoding="utf-8").splitlines()
    return [line.split("|") for line in lines]


def test_metadata_has_64_rows_of_3_fields() -> None:
    rows = _rows()
    assert len(rows) == NUM_CLIPS
    assert all(len(row) == 3 for row in rows)
    assert [row[0] for row in rows] == [f"DEMO-{i:04d}" for i in range(1, NUM_CLIPS + 1)]
    assert all(row[1].strip() and row[2].strip() for row in rows)
    assert not any(ch.isdigit() for row in rows for ch in row[2])  # numbers spelled out


def test_every_wav_exists_with_the_right_format() -> None:
    for clip_id, _, _ in _rows():
        path = DEMO_DIR / "wavs" / f"{clip_id}.wav"
        assert path.is_file(), path
        info = sf.info(str(path))
        assert info.samplerate == SAMPLE_RATE_HZ, path
        assert info.channels == 1, path
        assert info.subtype == "PCM_16", path
        assert MIN_DURATION_S <= info.frames / info.samplerate <= MAX_DURATION_S, path


def test_demo_set_is_small() -> None:
    total = sum(p.stat().st_size for p in DEMO_DIR.rglob("*") if p.is_file())
    assert total < MAX_TOTAL_BYTES
