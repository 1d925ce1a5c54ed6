"""The espeak-ng speech factory the multilingual tests use (tests/speech.py)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import soundfile

from stoker.shared.dataset.types import DEFAULT_SPEAKER
from tests.speech import (ENGLISH, ENGLISH_DIGITS, PERSIAN, RATE_HZ, Description, make_english_digits_dataset,
                          make_manifest_dataset, make_mixed_dataset, make_persian_dataset, make_train_eval_dataset,
                          speak, write_clip)

REPO = Path(__file__).resolve().parents[1]
# espeak-ng's speech peaks at 0.5-0.8 with an RMS near 0.1; a silent or broken clip is far below both
MIN_PEAK = 0.1
MIN_RMS = 0.02
DURATION_TOLERANCE_S = 1e-3  # the manifest's duration against the file's frames / rate
LJSPEECH_COLUMNS = ("id", "text", "normalized_text")
MIXED_COLUMNS = (*LJSPEECH_COLUMNS, "speaker", "language")
MANIFEST_KEYS = {"audio_filepath", "text", "duration", "speaker", "language"}
OTHER_RATE_HZ = 16000  # a rate espeak-ng does not speak at: write_clip resamples


def _digest(audio: np.ndarray) -> str:
    return hashlib.sha256(audio.tobytes()).hexdigest()


def _assert_speech(audio: np.ndarray) -> None:
    assert audio.ndim == 1 and len(audio) > 0
    assert np.abs(audio).max() > MIN_PEAK and np.sqrt(np.mean(np.square(audio))) > MIN_RMS


def _read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 file whose every line ends in ``\\n``."""
    data = path.read_bytes()
    assert b"\r" not in data and data.endswith(b"\n")
    return data.decode("utf-8").splitlines()


def _read_metadata(path: Path, columns: tuple[str, ...]) -> list[dict[str, str]]:
    rows = []
    for line in _read_lines(path):
        fields = line.split("|")
        assert len(fields) == len(columns), line
        rows.append(dict(zip(columns, fields)))
    return rows


def _assert_clip(path: Path) -> float:
    """The clip at ``path`` is a readable, mono, 16-bit, RATE_HZ speech WAV; its duration."""
    assert path.is_file(), path
    info = soundfile.info(str(path))
    assert (info.samplerate, info.channels, info.subtype) == (RATE_HZ, 1, "PCM_16")
    audio, _ = soundfile.read(str(path), dtype="float32")
    _assert_speech(audio)
    return info.frames / info.samplerate


def test_speak_is_deterministic_and_grows_with_the_text() -> None:
    short, rate = speak("سلام.", "fa")
    long, long_rate = speak(PERSIAN[0], "fa")
    assert rate == long_rate == RATE_HZ and short.dtype == long.dtype == np.float32
    assert -1.0 <= long.min() and long.max() <= 1.0
    _assert_speech(short)
    _assert_speech(long)
    assert len(long) > 2 * len(short)
    speak(ENGLISH[0], "en-us")  # another voice and text in between leaves nothing behind
    for text, voice, first in (("سلام.", "fa", short), (PERSIAN[0], "fa", long)):
        again, _ = speak(text, voice)
        assert np.array_equal(again, first)
    english = speak(ENGLISH_DIGITS[0], "en-us")[0]
    assert np.array_equal(speak(ENGLISH_DIGITS[0], "en-us")[0], english)
    assert speak("Chapter 3.", "en-us")[0].shape[0] < len(english)


def test_speak_gives_the_same_samples_in_another_process() -> None:
    here = {_digest(speak(PERSIAN[1], "fa")[0]), _digest(speak(ENGLISH_DIGITS[1], "en-us")[0])}
    code = ("import hashlib; from tests.speech import speak, PERSIAN, ENGLISH_DIGITS\n"
            "for text, voice in ((PERSIAN[1], 'fa'), (ENGLISH_DIGITS[1], 'en-us')):\n"
            "    print(hashlib.sha256(speak(text, voice)[0].tobytes()).hexdigest())\n")
    there = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert set(there.stdout.split()) == here


def test_different_persian_sentences_sound_different() -> None:
    clips = [speak(text, "fa")[0] for text in PERSIAN]
    assert len({_digest(clip) for clip in clips}) == len(PERSIAN)
    for clip in clips:
        _assert_speech(clip)
    first, second = clips[:2]
    n = min(len(first), len(second))
    assert not np.allclose(first[:n], second[:n], atol=MIN_PEAK)


def test_an_unknown_voice_is_a_runtime_error_naming_it() -> None:
    with pytest.raises(RuntimeError, match="no voice 'zz-nope'"):
        speak("x", "zz-nope")
    _assert_speech(speak("x", "en")[0])  # and speech goes on


def test_speech_is_unaffected_by_phonemizer_in_the_same_process() -> None:
    from stoker.shared.text import load_espeak

    before = speak(PERSIAN[2], "fa")[0]
    backend = load_espeak()("fa", preserve_punctuation=True, with_stress=True)
    assert backend.phonemize([PERSIAN[2]])[0].strip()
    assert np.array_equal(speak(PERSIAN[2], "fa")[0], before)


def test_write_clip_resamples_and_returns_the_file_duration(tmp_path: Path) -> None:
    spoken, rate = speak(ENGLISH[1], "en-us")
    duration = write_clip(tmp_path / "native" / "a.wav", ENGLISH[1], "en-us")
    assert duration == len(spoken) / rate == _assert_clip(tmp_path / "native" / "a.wav")
    resampled = write_clip(tmp_path / "b.wav", ENGLISH[1], "en-us", rate_hz=OTHER_RATE_HZ)
    info = soundfile.info(str(tmp_path / "b.wav"))
    assert (info.samplerate, info.subtype) == (OTHER_RATE_HZ, "PCM_16")
    assert resampled == info.frames / OTHER_RATE_HZ and abs(resampled - duration) < DURATION_TOLERANCE_S


@pytest.mark.parametrize(("factory", "prefix", "language", "sentences"), [
    (make_persian_dataset, "FA", "fa", PERSIAN),
    (make_english_digits_dataset, "EN", "en", ENGLISH_DIGITS),
])
def test_single_language_factories(tmp_path: Path, factory: Callable[..., Description], prefix: str, language: str,
                                   sentences: tuple[str, ...]) -> None:
    made = factory(tmp_path, n=5)
    rows = _read_metadata(tmp_path / "metadata.csv", LJSPEECH_COLUMNS)
    assert [row["id"] for row in rows] == [f"{prefix}-{i:04d}" for i in range(1, 6)]
    assert {row["id"]: (row["text"], DEFAULT_SPEAKER, language) for row in rows} == made
    assert all(row["normalized_text"] == row["text"] in sentences for row in rows)
    assert len({row["text"] for row in rows}) == len(rows)
    for row in rows:
        _assert_clip(tmp_path / "wavs" / f"{row['id']}.wav")
    if language == "en":
        assert all(any(ch.isdigit() for ch in row["text"]) for row in rows)
    else:
        assert all(any("\u0600" <= ch <= "\u06ff" for ch in row["text"]) for row in rows)


def test_mixed_factory(tmp_path: Path) -> None:
    made = make_mixed_dataset(tmp_path)
    rows = _read_metadata(tmp_path / "metadata.csv", MIXED_COLUMNS)
    assert [row["id"] for row in rows] == [f"MIX-{i:04d}" for i in range(1, 9)]
    assert {row["id"]: (row["text"], row["speaker"], row["language"]) for row in rows} == made
    assert all(row["normalized_text"] == row["text"] for row in rows)
    by_language = {language: [row for row in rows if row["language"] == language] for language in ("fa", "en")}
    assert len(by_language["fa"]) == len(by_language["en"]) == 4
    assert {row["speaker"] for row in by_language["fa"]} == {"spk_fa1", "spk_fa2"}
    assert {row["speaker"] for row in by_language["en"]} == {"spk_en1"}
    assert all(row["text"] in PERSIAN for row in by_language["fa"])
    assert all(row["text"] in ENGLISH for row in by_language["en"])
    for row in rows:
        _assert_clip(tmp_path / "wavs" / f"{row['id']}.wav")


def test_manifest_factory(tmp_path: Path) -> None:
    made = make_manifest_dataset(tmp_path)
    rows = [json.loads(line) for line in _read_lines(tmp_path / "manifest.jsonl")]
    assert len(rows) == len(made) == 6 and not (tmp_path / "wavs").exists()
    for row in rows:
        assert set(row) == MANIFEST_KEYS
        sample_id = Path(row["audio_filepath"]).stem
        assert row["audio_filepath"] == f"audio/{sample_id}.wav"
        assert made[sample_id] == (row["text"], row["speaker"], row["language"])
        assert row["text"] in (PERSIAN if row["language"] == "fa" else ENGLISH)
        assert abs(row["duration"] - _assert_clip(tmp_path / row["audio_filepath"])) < DURATION_TOLERANCE_S
    assert sorted(row["language"] for row in rows) == ["en"] * 3 + ["fa"] * 3


def test_train_eval_factory(tmp_path: Path) -> None:
    train, held = make_train_eval_dataset(tmp_path)
    files = {"metadata_train.csv": train, "metadata_eval.csv": held}
    for name, made in files.items():
        rows = _read_metadata(tmp_path / name, LJSPEECH_COLUMNS)
        assert {row["id"]: (row["text"], DEFAULT_SPEAKER, "en") for row in rows} == made
        for row in rows:
            _assert_clip(tmp_path / "wavs" / f"{row['id']}.wav")
    assert (len(train), len(held)) == (6, 2) and not set(train) & set(held)
    assert not {text for text, _, _ in train.values()} & {text for text, _, _ in held.values()}
    assert sorted(path.stem for path in (tmp_path / "wavs").iterdir()) == sorted([*train, *held])


def test_a_factory_writes_the_same_files_twice(tmp_path: Path) -> None:
    make_mixed_dataset(tmp_path / "a", n=4)
    make_mixed_dataset(tmp_path / "b", n=4)
    for name in ["metadata.csv", *(f"wavs/MIX-{i:04d}.wav" for i in range(1, 5))]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
