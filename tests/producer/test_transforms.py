"""producer/transforms.py: the built-in steps, the user's transforms and their declared fields."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from stoker.producer.transforms import (Chain, TransformError, TransformSetupError, loudness, loudness_normalize,
                                 peak_normalize, preemphasize, trim_silence)
from stoker.producer.batches import BatchMaker
from stoker.shared.batch import schema_for
from stoker.shared.config import FeaturesConfig, TransformsConfig
from stoker.shared.dataset import read_metadata, scan_audio
from tests.factories import make_dataset

FEATURES = FeaturesConfig(backend="numpy")
RATE = FEATURES.sample_rate_hz
HOP = FEATURES.hop_length
USER = "tests.producer.user_transforms"
DECLARED = "energy:float32:T:0,marks:int32:L:-1"


def _sine(seconds: float, rate: int = RATE, hz: float = 1000.0, level: float = 1.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (level * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def test_trim_cuts_silence_on_the_frame_grid() -> None:
    silence = np.zeros(40 * HOP, np.float32)
    tone = _sine(2.0)[:100 * HOP]
    clip = np.concatenate([silence, tone, silence])
    trimmed = trim_silence(clip, 40.0, FEATURES)
    # Frames are centred on t x hop and n_fft long: the first loud frame starts n_fft/2 before the tone.
    half = FEATURES.n_fft // 2 // HOP
    assert len(trimmed) == (100 + 2 * half - 1) * HOP
    start = (40 - half + 1) * HOP
    np.testing.assert_array_equal(trimmed, clip[start:start + len(trimmed)])
    assert trim_silence(clip, 0.0, FEATURES) is clip  # off
    assert len(trim_silence(np.zeros(1000, np.float32), 40.0, FEATURES)) == 1000  # silence stays


def test_peak_normalisation_reaches_the_target_peak() -> None:
    out = peak_normalize(_sine(0.5, level=0.1), -1.0)
    assert float(np.abs(out).max()) == pytest.approx(10 ** (-1 / 20), rel=1e-6)
    assert not peak_normalize(np.zeros(100, np.float32), -1.0).any()


def test_loudness_of_a_full_scale_sine_and_normalisation() -> None:
    # ITU-R BS.1770's calibration: a 0 dBFS 1 kHz sine measures -3.01 LUFS.
    assert loudness(_sine(3.0, 48000), 48000) == pytest.approx(-3.01, abs=0.1)
    quiet = _sine(3.0, level=0.01) + np.float32(0.001) * _sine(3.0, hz=300)
    out = loudness_normalize(quiet, RATE, -23.0)
    assert loudness(out, RATE) == pytest.approx(-23.0, abs=0.1)
    assert float(np.abs(out).max()) <= 1.0


def test_preemphasis_values() -> None:
    x = np.array([1.0, 2.0, 0.5, -1.0], np.float32)
    np.testing.assert_allclose(preemphasize(x, 0.97), [1.0, 2.0 - 0.97, 0.5 - 1.94, -1.0 - 0.485], rtol=1e-6)
    assert preemphasize(x, 0.0) is x


def test_the_chain_runs_user_transforms_first_then_the_built_in_steps() -> None:
    chain = Chain(TransformsConfig(user=f"{USER}:halve", normalize="peak", peak_dbfs=-6.0), FEATURES)
    out = chain(_sine(0.5, level=0.2), "", "A", 0, 0, {})
    assert float(np.abs(out.audio).max()) == pytest.approx(10 ** (-6 / 20), rel=1e-6)
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


def _maker(root: Path, transforms: TransformsConfig, cache: Path | None = None) -> BatchMaker:
    entries, _ = read_metadata(root)
    files = {k: v.name for k, v in scan_audio(root).items()}
    return BatchMaker(root, {e.id: e.text for e in entries}, FEATURES, None, "p0", files=files,
                      schema=schema_for("", transforms.fields), transforms=transforms,
                      feature_cache=str(cache or ""))


def _lease(ids: list[str], texts: dict[str, str]) -> dict:
    return {"lease": 1, "epoch": 0, "index": 0, "ids": ids, "shape": [96, 160], "rows": 4,
            "tokens": [list(range(2, len(texts[i]) + 2)) + [1] for i in ids]}


def test_a_user_transform_adds_declared_fields_to_the_batch(tmp_path: Path) -> None:
    root = tmp_path / "data"
    ids = make_dataset(root, count=3)
    texts = {e.id: e.text for e in read_metadata(root)[0]}
    transforms = TransformsConfig(user=f"{USER}:energy", fields=DECLARED)
    made = _maker(root, transforms).make(_lease(ids, texts))
    arrays = made.arrays
    assert made.fields["ids"] == ids and arrays["energy"].shape == (4, 160) and arrays["marks"].shape == (4, 96)
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
    assert (arrays["marks"][3] == -1).all()  # the empty row


def test_a_raising_transform_rejects_its_clips_and_a_wrong_shape_too(tmp_path: Path) -> None:
    root = tmp_path / "data"
    ids = make_dataset(root, count=2)
    texts = {e.id: e.text for e in read_metadata(root)[0]}
    made = _maker(root, TransformsConfig(user=f"{USER}:raises")).make(_lease(ids, texts))
    assert made.fields["ids"] == []
    assert [r["reason"] for r in made.fields["rejected"]] == [
        f"transform {USER}:raises: ValueError: no pitch for {i}" for i in ids]
    shaped = _maker(root, TransformsConfig(user=f"{USER}:wrong_shape", fields=DECLARED)).make(_lease(ids, texts))
    assert shaped.fields["ids"] == [] and all(
        r["reason"].startswith("transform field energy is float32 [3]; declared float32 [T]")
        for r in shaped.fields["rejected"])


def test_transformed_mels_are_cached_under_their_chain(tmp_path: Path) -> None:
    root = tmp_path / "data"
    ids = make_dataset(root, count=2)
    texts = {e.id: e.text for e in read_metadata(root)[0]}
    transforms = TransformsConfig(trim_db=30.0, normalize="peak")
    maker = _maker(root, transforms, cache=tmp_path / "cache")
    first = maker.make(_lease(ids, texts))
    again = maker.make(_lease(ids, texts))
    assert again.fields["cache"]["hits"] == 2
    np.testing.assert_allclose(first.arrays["mel"], again.arrays["mel"], atol=0.01)
    plain = _maker(root, TransformsConfig(), cache=tmp_path / "cache").make(_lease(ids, texts))
    assert plain.fields["cache"]["hits"] == 0  # another chain: not served the transformed mels
    assert math.isfinite(float(plain.arrays["mel"].max()))


@pytest.mark.parametrize("rate, seconds", [(22050, 0.41), (22050, 3.3), (48000, 1.0), (16000, 7.9)])
def test_the_vectorised_loudness_equals_pyloudnorms_meter(rate: int, seconds: float) -> None:
    import pyloudnorm

    rng = np.random.default_rng(rate)
    n = int(seconds * rate)
    x = (rng.standard_normal(n) * np.linspace(0.01, 0.3, n)).astype(np.float32)
    # abs: stoker filters in float32, pyloudnorm in float64 (1e-5 LU is 0.0001% in level)
    assert loudness(x, rate) == pytest.approx(pyloudnorm.Meter(rate).integrated_loudness(x.astype(np.float64)),
                                              abs=1e-5)
    assert loudness(np.zeros(n, np.float32), rate) == float("-inf")
