"""producer/transforms.py: the built-in steps, the user's transforms and their declared fields."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from stoker.producer.features import MelComputer, log_mel_spectrogram_numpy
from stoker.producer.transforms import (Chain, TransformError, TransformSetupError, frame_loudness, preemphasize,
                                        spectral_weights)
from stoker.producer.batches import BatchMaker
from stoker.shared import wire
from stoker.shared.batch import schema_for
from stoker.shared.config import FeaturesConfig, TransformsConfig
from stoker.shared.dataset.corpus.registry import read_metadata
from stoker.shared.dataset.files import scan_audio
from tests.factories import make_dataset
from tests.producer.test_features import MAX_RELATIVE_ERROR, relative_error

FEATURES = FeaturesConfig(backend="numpy")
RATE = FEATURES.sample_rate_hz
HOP = FEATURES.hop_length
USER = "tests.producer.user_transforms"
DECLARED = "energy:float32:T:0,marks:int32:L:-1"
# How far the loudness read from the mel's frames may be from BS.1770 measured on the samples
# (pyloudnorm): EBU Tech 3341 allows a meter 0.1 LU; speech and bursty noise stay within this.
FRAME_LOUDNESS_LU = 0.05


def _sine(seconds: float, rate: int = RATE, hz: float = 1000.0, level: float = 1.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (level * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def _finish(transforms: TransformsConfig, clip: np.ndarray, features: FeaturesConfig = FEATURES):
    chain = Chain(transforms, features)
    return chain.finish([chain(clip, "", "A", 0, 0, {}).audio], MelComputer(features, weights=chain.weights))[0]


def _frame_powers(clip: np.ndarray, features: FeaturesConfig) -> np.ndarray:
    computer = MelComputer(features, weights=spectral_weights(features))
    return computer.analyse([clip])[0][1]


def _bursty_noise(seconds: float, rate: int, seed: int) -> np.ndarray:
    """Noise whose level jumps every 2,000 samples, over a tone: block edges cut loud and quiet parts."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    levels = np.repeat(rng.uniform(0, 1, n // 2000 + 1) ** 3, 2000)[:n]
    tone = 0.05 * np.sin(2 * np.pi * rng.uniform(50, 8000) * np.arange(n) / rate)
    return (0.1 * rng.standard_normal(n) * levels + tone).astype(np.float32)


def test_trim_cuts_silence_on_the_frame_grid_and_slices_the_mel() -> None:
    silence = np.zeros(40 * HOP, np.float32)
    tone = _sine(2.0)[:100 * HOP]
    clip = np.concatenate([silence, tone, silence])
    done = _finish(TransformsConfig(trim_db=40.0), clip)
    # Frames are centred on t x hop and n_fft long: the first loud frame starts n_fft/2 before the tone.
    half = FEATURES.n_fft // 2 // HOP
    start = (40 - half + 1) * HOP
    assert (done.cut.start, done.cut.end) == (start, start + (100 + 2 * half - 1) * HOP)
    np.testing.assert_array_equal(done.audio, clip[done.cut.start:done.cut.end])
    frames = 1 + len(done.audio) // HOP
    assert done.mel.shape == (frames, FEATURES.n_mels)
    reference = log_mel_spectrogram_numpy(clip, FEATURES)[start // HOP:start // HOP + frames]
    assert relative_error(done.mel, reference) <= MAX_RELATIVE_ERROR
    silent = _finish(TransformsConfig(trim_db=40.0), np.zeros(1000, np.float32))
    assert len(silent.audio) == 1000  # silence stays


def test_peak_normalisation_reaches_the_target_peak_and_scales_the_mel() -> None:
    clip = _sine(0.5, level=0.1) + _sine(0.5, hz=300, level=0.05)
    done = _finish(TransformsConfig(normalize="peak", peak_dbfs=-1.0), clip)
    assert float(np.abs(done.audio).max()) == pytest.approx(10 ** (-1 / 20), rel=1e-5)
    assert relative_error(done.mel, log_mel_spectrogram_numpy(done.audio, FEATURES)) <= MAX_RELATIVE_ERROR
    assert not _finish(TransformsConfig(normalize="peak"), np.zeros(1000, np.float32)).audio.any()


def test_loudness_normalisation_reaches_the_target() -> None:
    import pyloudnorm

    quiet = _sine(3.0, level=0.01) + np.float32(0.001) * _sine(3.0, hz=300)
    done = _finish(TransformsConfig(normalize="loudness", loudness_lufs=-23.0), quiet)
    assert pyloudnorm.Meter(RATE).integrated_loudness(done.audio.astype(np.float64)) == pytest.approx(-23.0, abs=0.1)
    assert float(np.abs(done.audio).max()) <= 1.0
    assert relative_error(done.mel, log_mel_spectrogram_numpy(done.audio, FEATURES)) <= MAX_RELATIVE_ERROR
    loud = _finish(TransformsConfig(normalize="loudness", loudness_lufs=0.0), _sine(3.0, level=0.5))
    assert float(np.abs(loud.audio).max()) == pytest.approx(1.0, rel=1e-6)  # limited to 0 dBFS


@pytest.mark.parametrize("rate, seconds", [(22050, 0.41), (22050, 3.3), (48000, 1.0), (16000, 7.9)])
def test_the_loudness_read_from_the_frames_is_bs1770s(rate: int, seconds: float) -> None:
    import pyloudnorm

    features = dataclasses.replace(FEATURES, sample_rate_hz=rate, fmax_hz=min(FEATURES.fmax_hz, rate / 2))
    for seed in range(5):
        x = _bursty_noise(seconds, rate, seed)
        measured = frame_loudness(_frame_powers(x, features)[:, 1], len(x), features)
        assert measured == pytest.approx(pyloudnorm.Meter(rate).integrated_loudness(x.astype(np.float64)),
                                         abs=FRAME_LOUDNESS_LU)
    silence = np.zeros(int(seconds * rate), np.float32)
    assert frame_loudness(_frame_powers(silence, features)[:, 1], len(silence), features) == float("-inf")
    sine = _sine(seconds + 1.0, rate)
    assert frame_loudness(_frame_powers(sine, features)[:, 1], len(sine), features) == pytest.approx(
        pyloudnorm.Meter(rate).integrated_loudness(sine.astype(np.float64)), abs=FRAME_LOUDNESS_LU)
    if rate == 48000:  # ITU-R BS.1770's calibration: a 0 dBFS 1 kHz sine at 48 kHz measures -3.01 LUFS
        assert frame_loudness(_frame_powers(sine, features)[:, 1], len(sine), features) == pytest.approx(-3.01,
                                                                                                        abs=0.05)


def test_the_loudness_of_speech_read_from_the_frames() -> None:
    import pyloudnorm

    from stoker.producer.audio import load_audio
    from stoker.shared.dataset.files import DEMO_DATA_DIR

    for path in sorted((DEMO_DATA_DIR / "wavs").glob("*.wav"))[:16]:
        x = load_audio(path, RATE)
        assert frame_loudness(_frame_powers(x, FEATURES)[:, 1], len(x), FEATURES) == pytest.approx(
            pyloudnorm.Meter(RATE).integrated_loudness(x.astype(np.float64)), abs=0.02)


def test_preemphasis_applies_to_the_scaled_clip_before_the_cut() -> None:
    clip = np.concatenate([np.zeros(20 * HOP, np.float32), _sine(1.0, level=0.2, hz=2000.0)])
    done = _finish(TransformsConfig(trim_db=40.0, normalize="peak", peak_dbfs=-3.0, preemphasis=0.97), clip)
    scaled = preemphasize(clip * np.float32(done.cut.gain), 0.97)
    np.testing.assert_allclose(done.audio, scaled[done.cut.start:done.cut.end], atol=1e-6)
    first = done.cut.start // HOP
    reference = log_mel_spectrogram_numpy(scaled, FEATURES)[first:first + done.cut.frames]
    assert relative_error(done.mel, reference) <= MAX_RELATIVE_ERROR


def test_preemphasis_values() -> None:
    x = np.array([1.0, 2.0, 0.5, -1.0], np.float32)
    np.testing.assert_allclose(preemphasize(x, 0.97), [1.0, 2.0 - 0.97, 0.5 - 1.94, -1.0 - 0.485], rtol=1e-6)
    assert preemphasize(x, 0.0) is x


def test_the_chain_runs_user_transforms_first_then_the_built_in_steps() -> None:
    done = _finish(TransformsConfig(user=f"{USER}:halve", normalize="peak", peak_dbfs=-6.0), _sine(0.5, level=0.2))
    assert float(np.abs(done.audio).max()) == pytest.approx(10 ** (-6 / 20), rel=1e-5)
    assert done.cut.gain == pytest.approx(10 ** (-6 / 20) / 0.1, rel=1e-5)  # of the halved clip
    chain = Chain(TransformsConfig(user=f"{USER}:halve"), FEATURES)
    assert chain.key["versions"][f"{USER}:halve"].startswith("sha256:")


@pytest.mark.parametrize("name, reason", [
    ("raises", f"transform {USER}:raises: ValueError: no pitch for A"),
    ("wrong_dtype", f"transform {USER}:wrong_dtype returned a waveform of float64"),
])
def test_a_failing_transform_is_the_clips_rejection_reason(name: str, reason: str) -> None:
    chain = Chain(TransformsConfig(user=f"{USER}:{name}"), FEATURES)
    with pytest.raises(TransformError, match=reason.replace("(", r"\(")):
        chain(_sine(0.2), "", "A", 0, 0, {})


def test_a_missing_transform_module_is_one_line() -> None:
    with pytest.raises(TransformSetupError, match="cannot import no_such_module"):
        Chain(TransformsConfig(user="no_such_module:fn"), FEATURES)


def test_the_cache_key_follows_the_chain() -> None:
    from stoker.producer.feature_cache import cache_dir_name

    root = Path("/data/set")
    plain = cache_dir_name(FEATURES, root)
    trimmed = cache_dir_name(FEATURES, root, Chain(TransformsConfig(trim_db=40.0), FEATURES).key)
    louder = cache_dir_name(FEATURES, root, Chain(TransformsConfig(trim_db=30.0), FEATURES).key)
    assert len({plain, trimmed, louder}) == 3


# ----------------------------------------------------------------------- through the producer


def _maker(root: Path, transforms: TransformsConfig, cache: Path | None = None,
           fixed_rows: bool = False) -> BatchMaker:
    """``fixed_rows``: batches keep the lease's rows, the empty ones padded (row_mask on)."""
    entries, _ = read_metadata(root)
    files = {k: v.name for k, v in scan_audio(root).items()}
    return BatchMaker(root, {e.id: e.text for e in entries}, FEATURES, None, "p0", files=files,
                      schema=schema_for("row_mask" if fixed_rows else "", transforms.fields), transforms=transforms,
                      feature_cache=str(cache or ""), fixed_rows=fixed_rows)


def _lease(ids: list[str], texts: dict[str, str]) -> wire.Lease:
    return wire.Lease(1, 0, 0, tuple(ids), (96, 160), 4, tuple((*range(2, len(texts[i]) + 2), 1) for i in ids))


def test_a_user_transform_adds_declared_fields_to_the_batch(tmp_path: Path) -> None:
    root = tmp_path / "data"
    ids = make_dataset(root, count=3)
    texts = {e.id: e.text for e in read_metadata(root)[0]}
    transforms = TransformsConfig(user=f"{USER}:energy", fields=DECLARED)
    made = _maker(root, transforms, fixed_rows=True).make(_lease(ids, texts))
    arrays = made.arrays
    assert list(made.batch.ids) == ids and arrays["energy"].shape == (4, 160) and arrays["marks"].shape == (4, 96)
    from stoker.producer.audio import load_audio
    from tests.producer.user_transforms import energy

    for row, sample_id in enumerate(ids):
        wave = load_audio(root / "wavs" / f"{sample_id}.wav", RATE)
        want = energy(wave, RATE, texts[sample_id], sample_id, 0, 0, {})
        frames = arrays["mel_lengths"][row]
        np.testing.assert_array_equal(arrays["energy"][row, :frames], want["energy"])
        assert not arrays["energy"][row, frames:].any()  # padded with the declared 0
        marks = len(texts[sample_id]) + 1
        assert arrays["marks"][row, :marks].tolist() == list(range(marks))
        assert (arrays["marks"][row, marks:] == -1).all()  # padded with the declared -1
    assert (arrays["marks"][3] == -1).all() and arrays["row_mask"][3] == 0  # the empty row (fixed rows)


def test_declared_frame_fields_are_cut_with_the_mel(tmp_path: Path) -> None:
    import soundfile

    from stoker.producer.audio import load_audio
    from tests.producer.user_transforms import energy

    root = tmp_path / "data"
    ids = make_dataset(root, count=3)
    texts = {e.id: e.text for e in read_metadata(root)[0]}
    path = root / "wavs" / f"{ids[0]}.wav"
    quiet = np.zeros(int(0.3 * RATE), np.float32)
    soundfile.write(str(path), np.concatenate([quiet, load_audio(path, RATE), quiet]), RATE, subtype="PCM_16")
    transforms = TransformsConfig(user=f"{USER}:energy", fields=DECLARED, trim_db=30.0, normalize="peak")
    arrays = _maker(root, transforms).make(_lease(ids, texts)).arrays
    chain = Chain(transforms, FEATURES)
    computer = MelComputer(FEATURES, weights=chain.weights)
    for row, sample_id in enumerate(ids):
        wave = load_audio(root / "wavs" / f"{sample_id}.wav", RATE)
        done = chain.finish([wave], computer)[0]
        frames = int(arrays["mel_lengths"][row])
        assert frames == done.cut.frames and (done.cut.first > 0) == (row == 0)  # the padded clip is trimmed
        cut = energy(wave, RATE, texts[sample_id], sample_id, 0, 0, {})["energy"][done.cut.first:][:frames]
        np.testing.assert_array_equal(arrays["energy"][row, :frames], cut)
        np.testing.assert_allclose(arrays["mel"][row, :frames], done.mel, atol=1e-5)  # batched: float32 rounding


def test_a_raising_transform_rejects_its_clips_and_a_wrong_shape_too(tmp_path: Path) -> None:
    root = tmp_path / "data"
    ids = make_dataset(root, count=2)
    texts = {e.id: e.text for e in read_metadata(root)[0]}
    made = _maker(root, TransformsConfig(user=f"{USER}:raises")).make(_lease(ids, texts))
    assert list(made.batch.ids) == []
    assert [r.reason for r in made.batch.rejected] == [
        f"transform {USER}:raises: ValueError: no pitch for {i}" for i in ids]
    shaped = _maker(root, TransformsConfig(user=f"{USER}:wrong_shape", fields=DECLARED)).make(_lease(ids, texts))
    assert list(shaped.batch.ids) == [] and all(
        r.reason.startswith("transform field energy is float32 [3]; declared float32 [T]")
        for r in shaped.batch.rejected)


def test_transformed_mels_are_cached_under_their_chain(tmp_path: Path) -> None:
    root = tmp_path / "data"
    ids = make_dataset(root, count=2)
    texts = {e.id: e.text for e in read_metadata(root)[0]}
    transforms = TransformsConfig(trim_db=30.0, normalize="peak")
    maker = _maker(root, transforms, cache=tmp_path / "cache")
    first = maker.make(_lease(ids, texts))
    again = maker.make(_lease(ids, texts))
    assert again.batch.cache["hits"] == 2
    np.testing.assert_allclose(first.arrays["mel"], again.arrays["mel"], atol=0.01)
    plain = _maker(root, TransformsConfig(), cache=tmp_path / "cache").make(_lease(ids, texts))
    assert plain.batch.cache["hits"] == 0  # another chain: not served the transformed mels
    assert math.isfinite(float(plain.arrays["mel"].max()))


def test_a_new_definition_of_the_built_in_steps_changes_the_cache_key(monkeypatch) -> None:
    from stoker.producer import transforms

    key = Chain(TransformsConfig(trim_db=40.0), FEATURES).key
    monkeypatch.setattr(transforms, "TRANSFORMS_REVISION", transforms.TRANSFORMS_REVISION + 1)
    assert Chain(TransformsConfig(trim_db=40.0), FEATURES).key != key


@pytest.mark.parametrize("padding", ["constant", "end", "none"])
@pytest.mark.parametrize("power, log", [(1.0, "ln"), (2.0, "db")])
def test_trim_and_gain_follow_the_framing_and_the_power(padding: str, power: float, log: str) -> None:
    from stoker.shared.mel import num_frames

    features = dataclasses.replace(FEATURES, padding=padding, power=power, log=log, log_floor=1e-10)
    silence = np.zeros(40 * HOP, np.float32)
    clip = np.concatenate([silence, 0.1 * _sine(2.0)[:100 * HOP], silence])
    done = _finish(TransformsConfig(trim_db=40.0, normalize="peak", peak_dbfs=-1.0), clip, features)
    assert float(np.abs(done.audio).max()) == pytest.approx(10 ** (-1 / 20), rel=1e-5)
    assert done.mel.shape == (num_frames(len(done.audio), features), features.n_mels) == (done.cut.frames,
                                                                                          features.n_mels)
    scaled = clip * np.float32(done.cut.gain)  # the cut clip's mel is the scaled clip's, sliced
    reference = log_mel_spectrogram_numpy(scaled, features)[done.cut.first:done.cut.first + done.cut.frames]
    scale = 20.0 / power / math.log(10.0) if log == "db" else 1.0
    assert relative_error(done.mel / scale, reference / scale) <= MAX_RELATIVE_ERROR
    energy = _frame_powers(clip, features)[:, 0]  # every loud frame is kept, the silent ones are cut
    loud = np.flatnonzero(energy > energy.max() * 1e-4)
    centred = padding == "constant"  # and the frame centred on the cut's end
    assert (done.cut.first, done.cut.first + done.cut.frames - 1) == (loud[0], loud[-1] + centred)


@pytest.mark.parametrize("padding", ["end", "none"])
def test_the_loudness_read_from_uncentred_frames_is_bs1770s(padding: str) -> None:
    import pyloudnorm

    features = dataclasses.replace(FEATURES, padding=padding)
    for seed in range(3):
        x = _bursty_noise(3.3, RATE, seed)
        assert frame_loudness(_frame_powers(x, features)[:, 1], len(x), features) == pytest.approx(
            pyloudnorm.Meter(RATE).integrated_loudness(x.astype(np.float64)), abs=FRAME_LOUDNESS_LU)
