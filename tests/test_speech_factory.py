"""The espeak-ng speech factory the multilingual tests use (tests/speech.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile

from tests.speech import RATE_HZ, make_manifest_dataset, make_mixed_dataset, speak


def test_speech_is_speech() -> None:
    short, rate = speak("سلام.", "fa")
    long, _ = speak("امروز هوا آفتابی و کمی سرد است.", "fa")
    assert rate == RATE_HZ and short.dtype == np.float32
    assert len(long) > len(short) > rate // 10 and 0.05 < np.abs(long).max() <= 1.0
    with pytest.raises(RuntimeError, match="no voice 'zz-nope'"):
        speak("x", "zz-nope")


def test_factories_write_what_they_return(tmp_path) -> None:
    made = make_mixed_dataset(tmp_path / "mix", n=4)
    lines = (tmp_path / "mix" / "metadata.csv").read_text(encoding="utf-8").splitlines()
    assert {line.split("|")[0]: (line.split("|")[1], *line.split("|")[3:]) for line in lines} == made
    for sample_id in made:
        audio, rate = soundfile.read(str(tmp_path / "mix" / "wavs" / f"{sample_id}.wav"))
        assert rate == RATE_HZ and np.abs(audio).max() > 0.05
    manifest = make_manifest_dataset(tmp_path / "man", n=2)
    for line in (tmp_path / "man" / "manifest.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        info = soundfile.info(str(tmp_path / "man" / row["audio_filepath"]))
        assert abs(row["duration"] - info.frames / info.samplerate) < 1e-3
        assert (row["text"], row["speaker"], row["language"]) == manifest[row["audio_filepath"][6:-4]]
