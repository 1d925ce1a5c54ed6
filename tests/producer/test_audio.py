"""Tests for producer/audio.py: mono downmix, resampling to the planned length, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile

from stoker.producer.audio import AudioError, load_audio
from stoker.shared.dataset.probe import expected_samples
from tests.factories import tone

RATE = 22050


def _write(path: Path, audio: np.ndarray, rate: int, subtype: str = "FLOAT") -> Path:
    soundfile.write(str(path), audio, rate, subtype=subtype)
    return path


def test_mono_at_target_rate_is_unchanged(tmp_path: Path) -> None:
    audio = tone(0.5, RATE, seed=1)
    out = load_audio(_write(tmp_path / "a.wav", audio, RATE), RATE)
    assert out.dtype == np.float32 and out.ndim == 1 and out.flags.c_contiguous
    np.testing.assert_array_equal(out, audio)


def test_stereo_is_downmixed_to_the_mean(tmp_path: Path) -> None:
    left = tone(0.4, RATE, seed=2)
    right = tone(0.4, RATE, seed=3)
    out = load_audio(_write(tmp_path / "s.wav", np.stack([left, right], axis=1), RATE), RATE)
    assert out.shape == left.shape
    np.testing.assert_allclose(out, (left + right) / 2, atol=1e-6)


def test_identical_channels_downmix_to_the_channel(tmp_path: Path) -> None:
    stereo = tone(0.3, RATE, seed=4, channels=2)
    out = load_audio(_write(tmp_path / "s.wav", stereo, RATE, subtype="PCM_16"), RATE)
    reference, _ = soundfile.read(str(tmp_path / "s.wav"), dtype="float32")
    np.testing.assert_array_equal(out, reference[:, 0])


@pytest.mark.parametrize("seconds", [0.5, 1.2345, 1.0 / 16000 * 77])
@pytest.mark.parametrize("source_rate", [16000, 44100, 8000])
def test_resampled_to_exactly_expected_samples(tmp_path: Path, seconds: float, source_rate: int) -> None:
    audio = tone(seconds, source_rate, seed=5)
    out = load_audio(_write(tmp_path / "r.wav", audio, source_rate, subtype="PCM_16"), RATE)
    assert out.dtype == np.float32 and out.ndim == 1
    assert out.shape[0] == expected_samples(audio.shape[0], source_rate, RATE)


def test_resampling_preserves_the_signal(tmp_path: Path) -> None:
    t = np.arange(16000) / 16000
    sine = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    out = load_audio(_write(tmp_path / "sine.wav", sine, 16000), RATE)
    assert out.shape[0] == 22050
    expected = 0.5 * np.sin(2 * np.pi * 440 * np.arange(22050) / RATE)
    # Away from the edges the resampled sine matches the analytic one closely.
    np.testing.assert_allclose(out[500:-500], expected[500:-500], atol=5e-3)


def test_stereo_and_resampled(tmp_path: Path) -> None:
    stereo = tone(0.75, 16000, seed=6, channels=2)
    out = load_audio(_write(tmp_path / "sr.wav", stereo, 16000), RATE)
    assert out.ndim == 1 and out.shape[0] == expected_samples(stereo.shape[0], 16000, RATE)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(AudioError, match="audio file missing: nope.wav"):
        load_audio(tmp_path / "nope.wav", RATE)


def test_not_audio(tmp_path: Path) -> None:
    path = tmp_path / "junk.wav"
    path.write_bytes(b"definitely not a RIFF file" * 10)
    with pytest.raises(AudioError, match="junk.wav") as info:
        load_audio(path, RATE)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("keep", [0, 12, 30, 44])
def test_truncated_file(tmp_path: Path, keep: int) -> None:
    good = _write(tmp_path / "full.wav", tone(0.5, RATE, seed=7), RATE, subtype="PCM_16")
    cut = tmp_path / "cut.wav"
    cut.write_bytes(good.read_bytes()[:keep])
    with pytest.raises(AudioError, match="cut.wav"):
        load_audio(cut, RATE)


def test_wav_cut_inside_its_samples_is_rejected_with_what_it_holds(tmp_path: Path) -> None:
    """A WAV whose header declares more sample bytes than the file holds (a copy cut short) is
    refused with both counts, not trained on in part."""
    good = _write(tmp_path / "full.wav", tone(0.5, RATE, seed=8), RATE, subtype="PCM_16")
    raw = good.read_bytes()
    cut = tmp_path / "cut.wav"
    cut.write_bytes(raw[:raw.index(b"data") + 8 + 2 * 1000])
    declared = 2 * int(0.5 * RATE)
    with pytest.raises(AudioError, match=f"^audio file truncated: cut.wav: holds 2000 of the {declared} sample "
                                         "bytes its header declares$"):
        load_audio(cut, RATE)


def test_streamed_wav_cut_short_decodes_what_is_there(tmp_path: Path) -> None:
    """A WAV written to a pipe declares no data size (0xFFFFFFFF): its samples run to the end of
    the file, so a cut one decodes to exactly the samples it holds."""
    good = _write(tmp_path / "full.wav", tone(0.5, RATE, seed=8), RATE, subtype="PCM_16")
    raw = bytearray(good.read_bytes())
    at = raw.index(b"data")
    raw[at + 4:at + 8] = (0xFFFFFFFF).to_bytes(4, "little")
    cut = tmp_path / "cut.wav"
    cut.write_bytes(bytes(raw[:at + 8 + 2 * 1000]))
    reference, _ = soundfile.read(str(good), dtype="float32")
    np.testing.assert_array_equal(load_audio(cut, RATE), reference[:1000])


def test_non_finite_samples(tmp_path: Path) -> None:
    audio = tone(0.2, RATE, seed=9)
    audio[100] = np.nan
    with pytest.raises(AudioError, match="NaN or inf: nan.wav"):
        load_audio(_write(tmp_path / "nan.wav", audio, RATE), RATE)
