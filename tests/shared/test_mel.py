"""shared/mel.py: the framing, the value of silence, the user's mel function and the features key."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from stoker.producer.feature_cache import FORMAT_VERSION, cache_dir_name
from stoker.shared import mel
from stoker.shared.config import ConfigError, FeaturesConfig, TransformsConfig, load
from stoker.shared.melstats import stats_key

ROOT = Path("/data/set")
USER_MODULE = '''
import numpy as np

def levels(audio, sample_rate_hz):
    frames = 1 + len(audio) // 256
    return np.full((frames, 80), {value}, np.float32)
'''


def test_default_keys_are_todays() -> None:
    # The settings added with the conventions stay out of the key at their defaults: the feature
    # caches and mel statistics made before them are still found.
    before = {"sample_rate_hz": 22050, "n_fft": 1024, "hop_length": 256, "win_length": 1024, "n_mels": 80,
              "fmin_hz": 0.0, "fmax_hz": 8000.0, "log_floor": 1e-05}
    assert mel.features_key(FeaturesConfig()) == before
    text = json.dumps({"format": FORMAT_VERSION, "features": before, "dataset": str(ROOT)}, sort_keys=True)
    assert cache_dir_name(FeaturesConfig(), ROOT) == hashlib.sha256(text.encode()).hexdigest()[:16]


@pytest.mark.parametrize("change", [dict(mel_scale="htk"), dict(filter_norm="none"), dict(padding="end"),
                                    dict(power=2.0), dict(log="log10"), dict(log_offset=1e-6),
                                    dict(log="db", top_db=80.0)])
def test_every_setting_keys_the_cache_and_the_statistics(change: dict) -> None:
    base, other = FeaturesConfig(), FeaturesConfig(**change)
    assert cache_dir_name(other, ROOT) != cache_dir_name(base, ROOT)
    assert stats_key(other, TransformsConfig(), "d") != stats_key(base, TransformsConfig(), "d")


def test_the_users_function_is_keyed_by_its_source(tmp_path: Path, monkeypatch) -> None:
    module = tmp_path / "my_mels.py"
    module.write_text(USER_MODULE.format(value=-3.0))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_mels", raising=False)
    features = FeaturesConfig(user="my_mels:levels")
    mel.user_mel_function.cache_clear()
    first = (cache_dir_name(features, ROOT), stats_key(features, TransformsConfig(), "d"))
    assert mel.silence_value(features) == -3.0 and mel.mel_pad_value(features, "off") == -3.0
    module.write_text(USER_MODULE.format(value=-4.0))  # edited, not renamed
    mel.user_mel_function.cache_clear()  # as a new producer process imports it
    second = (cache_dir_name(features, ROOT), stats_key(features, TransformsConfig(), "d"))
    assert first[0] != second[0] and first[1] != second[1]
    mel.user_mel_function.cache_clear()


@pytest.mark.parametrize("spec, message", [("no_such_module_x:fn", "cannot import no_such_module_x"),
                                           ("tests.producer.user_mels:absent", "has no function absent")])
def test_a_users_function_that_cannot_be_loaded_is_one_line(spec: str, message: str) -> None:
    from stoker.producer.features import MelComputer

    with pytest.raises(mel.MelFunctionError, match=message) as caught:
        MelComputer(FeaturesConfig(user=spec, backend="numpy"))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("features, value", [
    (FeaturesConfig(), math.log(1e-5)),
    (FeaturesConfig(log_floor=0.0, log_offset=1e-6), math.log(1e-6)),
    (FeaturesConfig(log="log10", log_floor=1e-10), -10.0),
    (FeaturesConfig(log="db", power=2.0, log_floor=1e-10, top_db=80.0), -100.0),
    (FeaturesConfig(log="db", power=1.0, log_floor=1e-5), -100.0),
])
def test_silence_is_the_log_of_the_offset_or_floor(features: FeaturesConfig, value: float) -> None:
    assert mel.silence_value(features) == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("padding, frames", [("reflect", [1 + n // 256 for n in (513, 1024, 5000)]),
                                             ("constant", [1 + n // 256 for n in (513, 1024, 5000)]),
                                             ("end", [3, 4, 20]), ("none", [0, 1, 16])])
def test_num_frames(padding: str, frames: list[int]) -> None:
    features = FeaturesConfig(padding=padding)
    assert [mel.num_frames(n, features) for n in (513, 1024, 5000)] == frames
    assert mel.frame_centre(features) == (0 if padding in ("reflect", "constant") else 512)
    many = np.arange(0, 5000, 7)  # the array form (a manifest's chunked index build) agrees clip for clip
    assert mel.num_frames_of(many, features).tolist() == [mel.num_frames(n, features) for n in many.tolist()]


@pytest.mark.parametrize("overrides, message", [
    ({"features.mel_scale": "mfcc"}, "features.mel_scale must be one of slaney, htk, tf"),
    ({"features.filter_norm": "l2"}, "features.filter_norm must be one of slaney, none"),
    ({"features.padding": "edge"}, "features.padding must be one of reflect, constant, end, none"),
    ({"features.log": "log2"}, "features.log must be one of ln, log10, db"),
    ({"features.power": 1.5}, "features.power must be 1"),
    ({"features.log_floor": 0.0}, "one of them positive"),
    ({"features.log_offset": -1.0}, "log_offset >= 0"),
    ({"features.top_db": 80.0}, "features.top_db clamps decibels"),
    ({"features.user": "not a spec"}, "features.user must be package.module:function"),
    ({"features.user": "m:f", "transforms.trim_db": 30.0}, "cannot be combined with transforms.trim_db"),
    ({"features.padding": "none", "batching.fields": "audio"}, "batching.fields audio needs features.padding"),
    ({"transforms.mel_norm": "minmax"}, "transforms.mel_norm must be one of off, dataset, clip_minmax"),
])
def test_bad_conventions_are_one_line(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        load(None, overrides)
    assert "\n" not in str(caught.value)


def test_a_users_mel_convention_loads() -> None:
    cfg = load(None, {"features.mel_scale": "tf", "features.filter_norm": "none", "features.padding": "end",
                      "features.log_floor": 0.0, "features.log_offset": 1e-6, "transforms.mel_norm": "clip_minmax"})
    assert mel.mel_pad_value(cfg.features, cfg.transforms.mel_norm) == 0.0
    assert dataclasses.asdict(cfg.features)["padding"] == "end"
    assert np.isclose(mel.silence_value(cfg.features), math.log(1e-6))
