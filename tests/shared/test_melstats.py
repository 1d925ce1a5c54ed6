"""shared/melstats.py: the sums producers send, the statistics they make, the normalisation."""

from __future__ import annotations

import numpy as np
import pytest

from stoker.shared.config import FeaturesConfig, TransformsConfig
from stoker.shared.melstats import MIN_STD, MelStats, load, normalize, stats_key


def _batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    mel = rng.normal(-5.0, 2.0, size=(3, 7, 4)).astype(np.float32)
    lengths = np.array([7, 3, 0], np.int32)
    mel[1, 3:] = -11.5  # padding, never counted
    mel[2] = -11.5
    return mel, lengths


def test_statistics_over_valid_frames_of_several_batches_equal_numpy() -> None:
    (a, la), (b, lb) = _batch(1), _batch(2)
    stats = MelStats.empty(4)
    for mel, lengths in ((a, la), (b, lb)):
        stats.add(MelStats.from_fields(MelStats.of_batch(mel, lengths).to_fields(), 4))  # through the wire form
    valid = np.concatenate([a[0], a[1, :3], b[0], b[1, :3]]).astype(np.float64)
    mean, std = stats.mean_std()
    assert stats.frames == 20
    np.testing.assert_allclose(mean, valid.mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(std, valid.std(axis=0), rtol=1e-4)
    constant = MelStats.of_batch(np.ones((1, 5, 4), np.float32), np.array([5]))
    assert (constant.mean_std()[1] == np.float32(MIN_STD)).all()  # no division by zero


@pytest.mark.parametrize("garbage", [None, {"sum": [1, 2], "sumsq": [1, 2, 3, 4], "frames": 3},
                                     {"sum": [1] * 4, "sumsq": [float("nan")] * 4, "frames": 3},
                                     {"sum": [1] * 4, "sumsq": [1] * 4, "frames": -1}, {"sum": "x"}])
def test_malformed_sums_from_a_peer_are_refused(garbage) -> None:
    assert MelStats.from_fields(garbage, 4) is None


def test_normalize_touches_valid_frames_only() -> None:
    mel, lengths = _batch(3)
    before = mel.copy()
    mean, std = np.array([1, 2, 3, 4], np.float32), np.array([2, 2, 4, 4], np.float32)
    normalize(mel, lengths, mean, std)
    np.testing.assert_allclose(mel[0], (before[0] - mean) / std, rtol=1e-6)
    np.testing.assert_allclose(mel[1, :3], (before[1, :3] - mean) / std, rtol=1e-6)
    np.testing.assert_array_equal(mel[1, 3:], before[1, 3:])
    np.testing.assert_array_equal(mel[2], before[2])
    with pytest.raises(ValueError, match="expected 4"):
        load({"mean": [0.0] * 3, "std": [1.0] * 3}, 4)


def test_the_key_follows_what_the_mel_depends_on() -> None:
    f, t = FeaturesConfig(), TransformsConfig()
    key = stats_key(f, t, "data1")
    assert key == stats_key(FeaturesConfig(backend="tf"), TransformsConfig(mel_norm="dataset"), "data1")
    others = {stats_key(FeaturesConfig(n_mels=64), t, "data1"), stats_key(f, TransformsConfig(trim_db=30), "data1"),
              stats_key(f, t, "data2")}
    assert len({key, *others}) == 4


def test_a_new_definition_of_the_measuring_transforms_changes_only_their_keys(monkeypatch) -> None:
    from stoker.shared import melstats

    f, plain, trimmed = FeaturesConfig(), TransformsConfig(), TransformsConfig(trim_db=30)
    before = stats_key(f, plain, "data1"), stats_key(f, trimmed, "data1")
    monkeypatch.setattr(melstats, "TRANSFORMS_REVISION", melstats.TRANSFORMS_REVISION + 1)
    assert stats_key(f, plain, "data1") == before[0]
    assert stats_key(f, trimmed, "data1") != before[1]
