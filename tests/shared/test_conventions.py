"""shared/conventions.py: each codebase's mel by name, against that codebase's own function.

Every convention is computed as a producer computes it (the clip loaded at the convention's
rate, the transforms' trim, MelComputer's numpy and TF backends) on the demo set's speech and
compared with the codebase's function: BigVGAN's ``meldataset.mel_spectrogram`` from its package
(HiFi-GAN's and Matcha-TTS's function is the same one), librosa's own ``effects.trim`` for Coqui
TTS's trim. Vocos, Coqui TTS, ESPnet and NeMo cannot be installed beside stoker's CPU torch
(each imports torchaudio, whose build here is a CUDA one, or requires CUDA bindings or a pinned
tool stack): their functions are written out below from their source files, named in each.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest

from stoker.producer.audio import load_audio
from stoker.producer.features import MelComputer, log_mel_spectrogram_numpy
from stoker.producer.transforms import Chain, trim_samples
from stoker.shared.config import ConfigError, FeaturesConfig, TransformsConfig, load
from stoker.shared.conventions import CONVENTIONS
from stoker.shared.mel import features_key, mel_pad_value
from stoker.shared.melstats import minmax

DEMO = Path(__file__).resolve().parents[2] / "data" / "demo" / "wavs"
# The goal: max abs difference in the log domain (the values the model and the vocoder take).
TOLERANCE = 1e-3
# How many more values than the codebase's own float32 run ours may have beyond the tolerance.
NOISE_MARGIN = 1.25


def settings(name: str, **overrides: object) -> tuple[FeaturesConfig, TransformsConfig]:
    cfg = load(None, {"features.convention": name, **{f"features.{k}": v for k, v in overrides.items()}})
    return cfg.features, cfg.transforms


@functools.cache
def speech(rate_hz: int) -> tuple[np.ndarray, ...]:
    """The demo set's clips as producers load them at ``rate_hz`` (float32, resampled by soxr),
    loaded once per rate for the module's tests; read-only, so that no test changes another's."""
    clips = tuple(load_audio(path, rate_hz) for path in sorted(DEMO.glob("*.wav")))
    for clip in clips:
        clip.flags.writeable = False
    return clips


@functools.cache
def theirs(name: str, double: bool) -> tuple[np.ndarray, ...]:
    """The codebase's function on every clip of :func:`speech` (in float64, or as it runs, float32),
    computed once per convention for the module's tests."""
    features = settings(name)[0]
    return tuple(REFERENCES[name](clip, features, double) for clip in speech(features.sample_rate_hz))


def ours(features: FeaturesConfig, transforms: TransformsConfig, clips: list[np.ndarray],
         backend: str = "numpy") -> list[np.ndarray]:
    """stoker's features [T, M] of each clip: the transforms' chain, then the mel (a producer's
    backend, float32; or ``backend="float64"``, the definition's float64 reference), then clip_minmax."""
    chain = Chain(transforms, features)
    loaded = [chain(c, "", "id", 0, 0, {}).audio if chain.active else c for c in clips]
    mels = [log_mel_spectrogram_numpy(c, features) for c in loaded] if backend == "float64" \
        else MelComputer(dataclasses.replace(features, backend=backend))(loaded)
    if transforms.mel_norm == "clip_minmax":
        batch = np.stack([np.pad(m, ((0, max(len(x) for x in mels) - len(m)), (0, 0))) for m in mels])
        minmax(batch, np.array([len(m) for m in mels]))
        mels = [row[:len(m)] for row, m in zip(batch, mels)]
    return mels


def worst(mine: list[np.ndarray], theirs: list[np.ndarray]) -> float:
    """The largest |difference| over every clip, after checking each clip's frame count."""
    for a, b in zip(mine, theirs, strict=True):
        assert a.shape == b.shape, (a.shape, b.shape)
    return max(float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in zip(mine, theirs))


def beyond(mine: list[np.ndarray], truth: list[np.ndarray]) -> tuple[float, int]:
    """(the largest |difference|, how many values differ by more than the tolerance) over every clip."""
    worst(mine, truth)  # the frame counts
    errors = [np.abs(a.astype(np.float64) - b) for a, b in zip(mine, truth, strict=True)]
    return max(float(e.max()) for e in errors), sum(int((e > TOLERANCE).sum()) for e in errors)


def assert_as_close_as_its_own(name: str, mine: list[np.ndarray]) -> None:
    """Float32 features of the first clips of :func:`speech` against the codebase's function in
    float64: within the tolerance, but where its own float32 run is not either. Values at
    float32's rounding noise (a band the resampled speech leaves empty, 100 dB under the frame's
    peak) are determined by no float32 computation, the codebase's own included: there ours may
    not be farther from the float64 function than its own float32 run is, nor beyond the
    tolerance at many more values."""
    truth, own = theirs(name, True)[:len(mine)], theirs(name, False)[:len(mine)]
    (worst_mine, count_mine), (worst_own, count_own) = beyond(mine, truth), beyond(own, truth)
    assert worst_mine <= max(TOLERANCE, worst_own) and count_mine <= NOISE_MARGIN * count_own, \
        (worst_mine, count_mine, worst_own, count_own)


# ------------------------------------------------------------------- the codebases' functions


def bigvgan_mel(clip: np.ndarray, f: FeaturesConfig, double: bool = False) -> np.ndarray:
    """bigvgan's meldataset.mel_spectrogram (HiFi-GAN's; Matcha-TTS's matcha/utils/audio.py) -> [T, M];
    float32 only (its filters are float32 tensors)."""
    torch = pytest.importorskip("torch")
    meldataset = pytest.importorskip("bigvgan.meldataset")
    mel = meldataset.mel_spectrogram(torch.tensor(clip)[None], f.n_fft, f.n_mels, f.sample_rate_hz,
                                     f.hop_length, f.win_length, f.fmin_hz, f.fmax_hz)
    return mel[0].T.double().numpy()


def torch_stft(clip: np.ndarray, f: FeaturesConfig, double: bool, periodic: bool = True,
               pad_mode: str = "reflect") -> "torch.Tensor":
    """torch.stft(center=True) of a clip with torch.hann_window(win_length), [F, T] complex."""
    import torch

    kind = torch.float64 if double else torch.float32
    return torch.stft(torch.tensor(clip).to(kind), f.n_fft, f.hop_length, f.win_length,
                      torch.hann_window(f.win_length, periodic=periodic, dtype=kind), center=True, pad_mode=pad_mode,
                      return_complex=True)


def librosa_filters(f: FeaturesConfig, double: bool, **kwargs: object) -> "torch.Tensor":
    """librosa.filters.mel(sr, n_fft, n_mels, ...) as a torch tensor [M, F]."""
    import librosa
    import torch

    fb = librosa.filters.mel(sr=f.sample_rate_hz, n_fft=f.n_fft, n_mels=f.n_mels, **kwargs)
    return torch.from_numpy(fb).to(torch.float64 if double else torch.float32)


def vocos_mel(clip: np.ndarray, f: FeaturesConfig, double: bool = False) -> np.ndarray:
    """vocos/feature_extractors.py MelSpectrogramFeatures: torchaudio.transforms.MelSpectrogram(
    sample_rate, n_fft, hop_length, n_mels, center=True, power=1) -- torch.stft (reflect,
    torch.hann_window), torchaudio.functional.melscale_fbanks(norm=None, mel_scale="htk"), whose
    triangles are librosa's with htk=True, norm=None -- then safe_log, log(clamp(x, 1e-5))."""
    import torch

    fb = librosa_filters(f, double, fmin=0.0, fmax=f.sample_rate_hz // 2, htk=True, norm=None)
    return torch.log(torch.clamp(fb @ torch_stft(clip, f, double).abs(), min=1e-5)).T.double().numpy()


def coqui_load_and_mel(clip: np.ndarray, f: FeaturesConfig, double: bool = False) -> np.ndarray:
    """TTS/utils/audio/processor.py AudioProcessor (BaseAudioConfig's defaults): load_wav's
    trim_silence (``wav[margin:-margin]``, margin = int(sr * 0.01), then librosa.effects.trim(
    top_db=45, frame_length=win_length, hop_length)), then melspectrogram: librosa.stft (center,
    reflect, hann), librosa.filters.mel(sr, n_fft, n_mels, fmin, fmax=None), numpy_transforms.
    amp_to_db (20 log10(max(1e-5, x))) and normalize (S - ref_level_db, (S - min_level_db) /
    -min_level_db, 2 max_norm S - max_norm, clipped to +-max_norm)."""
    import librosa

    margin = int(f.sample_rate_hz * 0.01)
    wav = clip[margin:-margin].astype(np.float64 if double else np.float32)
    wav = librosa.effects.trim(wav, top_db=45, frame_length=f.win_length, hop_length=f.hop_length)[0]
    spec = np.abs(librosa.stft(y=wav, n_fft=f.n_fft, hop_length=f.hop_length, win_length=f.win_length,
                               pad_mode="reflect", window="hann", center=True))
    basis = librosa.filters.mel(sr=f.sample_rate_hz, n_fft=f.n_fft, n_mels=f.n_mels, fmin=0.0, fmax=None,
                                dtype=np.float64 if double else np.float32)
    db = 20.0 * np.log10(np.maximum(1e-5, basis @ spec)) - 20.0
    normed = (db + 100.0) / 100.0
    return np.clip(8.0 * normed - 4.0, -4.0, 4.0).T.astype(np.float64)


def espnet_mel(clip: np.ndarray, f: FeaturesConfig, double: bool = False) -> np.ndarray:
    """espnet2/tts/feats_extract/log_mel_fbank.py LogMelFbank (espnet2/layers/stft.py Stft:
    torch.stft, center, reflect, torch.hann_window; input_amp = sqrt(clamp(re^2 + im^2, 1e-10)))
    and espnet2/layers/log_mel.py LogMel (librosa.filters.mel(sr, n_fft, n_mels, fmin 80, fmax
    7600, htk=False), clamp(mel, 1e-10), log10)."""
    import torch

    spec = torch.view_as_real(torch_stft(clip, f, double))
    amp = torch.sqrt(torch.clamp(spec[..., 0] ** 2 + spec[..., 1] ** 2, min=1e-10))
    fb = librosa_filters(f, double, fmin=80.0, fmax=7600.0, htk=False)
    return torch.clamp(fb @ amp, min=1e-10).log10().T.double().numpy()


def nemo_mel(clip: np.ndarray, f: FeaturesConfig, double: bool = False) -> np.ndarray:
    """nemo/collections/asr/parts/preprocessing/features.py FilterbankFeatures as FastPitch's
    config sets it (dither 0, preemph None, normalize None, mag_power 1, log_zero_guard_type add,
    1e-5): torch.stft(center=True, pad_mode="constant", window=torch.hann_window(win_length,
    periodic=False)), sqrt(re^2 + im^2), librosa.filters.mel(norm="slaney"), log(x + 1e-5)."""
    import torch

    spec = torch.view_as_real(torch_stft(clip, f, double, periodic=False, pad_mode="constant"))
    fb = librosa_filters(f, double, fmin=0.0, fmax=8000.0, norm="slaney")
    return torch.log(fb @ torch.sqrt(spec.pow(2).sum(-1)) + 1e-5).T.double().numpy()


def myxtts_mel(clip: np.ndarray, f: FeaturesConfig, double: bool = False) -> np.ndarray:
    """MyXTTS's: tf.signal.stft(pad_end=True), |X|, tf.signal.linear_to_mel_weight_matrix,
    log(mel + 1e-6), each clip min-max scaled to [0, 1]."""
    import tensorflow as tf

    kind = tf.float64 if double else tf.float32
    stft = tf.signal.stft(tf.constant(clip, kind), f.n_fft, f.hop_length, f.n_fft, pad_end=True)
    fb = tf.signal.linear_to_mel_weight_matrix(f.n_mels, f.n_fft // 2 + 1, f.sample_rate_hz, 0.0, 8000.0, dtype=kind)
    mel = tf.math.log(tf.matmul(tf.abs(stft), fb) + 1e-6).numpy().astype(np.float64)
    return (mel - mel.min()) / (mel.max() - mel.min())


REFERENCES = {"hifigan": bigvgan_mel, "bigvgan_24khz_100band": bigvgan_mel, "matcha": bigvgan_mel,
              "vocos": vocos_mel, "coqui": coqui_load_and_mel, "espnet": espnet_mel, "nemo": nemo_mel,
              "myxtts": myxtts_mel}


def test_every_convention_has_its_reference() -> None:
    assert set(REFERENCES) == set(CONVENTIONS)


@pytest.mark.parametrize("name", list(CONVENTIONS))
def test_convention_is_its_codebases_definition(name: str) -> None:
    # The float64 reference against the codebase's function in float64 (BigVGAN's: float32), every value.
    features, transforms = settings(name)
    clips = speech(features.sample_rate_hz)
    assert worst(ours(features, transforms, clips, backend="float64"), theirs(name, True)) <= TOLERANCE


@pytest.mark.parametrize("name", list(CONVENTIONS))
def test_convention_matches_its_codebase_on_speech(name: str) -> None:
    # What producers compute (float32) against the codebase's function as it runs (float32).
    features, transforms = settings(name)
    clips = speech(features.sample_rate_hz)
    assert_as_close_as_its_own(name, ours(features, transforms, clips))


@pytest.mark.slow  # TensorFlow
@pytest.mark.parametrize("name", list(CONVENTIONS))
def test_convention_tf_backend_matches_its_codebase(name: str) -> None:
    features, transforms = settings(name)
    clips = speech(features.sample_rate_hz)[:8]
    assert_as_close_as_its_own(name, ours(features, transforms, clips, backend="tf"))


def test_coquis_trim_is_librosas_on_every_clip() -> None:
    import librosa

    features, transforms = settings("coqui")
    margin = int(features.sample_rate_hz * transforms.trim_margin_s)
    for clip in speech(features.sample_rate_hz):
        expected = librosa.effects.trim(clip[margin:-margin], top_db=45, frame_length=features.win_length,
                                        hop_length=features.hop_length)[0]
        np.testing.assert_array_equal(trim_samples(clip, margin, transforms.trim_samples_db, features), expected)


@pytest.mark.parametrize("name", list(CONVENTIONS))
def test_padding_holds_the_value_of_silence(name: str) -> None:
    # Digital silence's lowest channel (ESPnet's floored bins make silence differ by channel).
    features, transforms = settings(name)
    silence = MelComputer(dataclasses.replace(features, backend="numpy"))([np.zeros(8000, np.float32)])[0]
    pad = mel_pad_value(features, transforms.mel_norm)
    assert pad == (0.0 if transforms.mel_norm == "clip_minmax" else pytest.approx(float(silence.min()), abs=1e-5))


def test_coquis_silence_is_its_lowest_value() -> None:
    assert mel_pad_value(settings("coqui")[0], "off") == -4.0


def test_every_key_stays_overridable_after_a_convention() -> None:
    cfg = load(None, {"features.convention": "hifigan", "features.n_mels": 128, "features.fmax_hz": 11025.0,
                      "transforms.trim_db": 30.0})
    assert (cfg.features.n_mels, cfg.features.fmax_hz, cfg.transforms.trim_db) == (128, 11025.0, 30.0)
    assert cfg.features.padding == "reflect_overlap" and cfg.features.bin_power_offset == 1e-9
    assert load(None, {"features.convention": "coqui", "transforms.trim_samples_db": 0.0}).transforms.trim_samples_db \
        == 0.0


def test_a_convention_is_keyed_by_its_settings_not_its_name() -> None:
    # hifigan and matcha are one definition: one feature cache; the saved config loads back the same.
    assert features_key(settings("hifigan")[0]) == features_key(settings("matcha")[0])
    assert features_key(settings("hifigan")[0]) != features_key(settings("bigvgan_24khz_100band")[0])
    assert features_key(FeaturesConfig()) == features_key(dataclasses.replace(FeaturesConfig(), convention="x"))


@pytest.mark.parametrize("overrides, message", [
    ({"features.convention": "tacotron"}, "features.convention must be one of hifigan, "),
    ({"features.convention": "coqui", "features.log": "ln"}, "features.db_norm symmetric maps decibels"),
    ({"features.convention": "vocos", "features.user": "m:f"}, "features.user replaces the mel"),
    ({"features.convention": "hifigan", "batching.fields": "audio"}, "with padding reflect_overlap"),
    ({"features.window": "hamming"}, "features.window must be one of hann, hann_symmetric"),
    ({"features.bin_power_floor": -1.0}, "bin_power_floor >= 0"),
    ({"transforms.trim_margin_s": -0.01}, "trim_margin_s >= 0"),
])
def test_what_a_convention_cannot_express_is_one_line(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        load(None, overrides)
    assert "\n" not in str(caught.value)


def test_a_clip_trimmed_to_nothing_is_rejected() -> None:
    from stoker.producer.transforms import TransformError

    features, transforms = settings("coqui")
    with pytest.raises(TransformError, match="left after trimming the silence"):
        Chain(transforms, features)(np.zeros(500, np.float32), "", "id", 0, 0, {})
