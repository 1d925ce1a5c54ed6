"""Tests for producer/features.py: the one log-mel definition and its implementations.

Relative error, as used throughout: ``max|exp(a) - exp(b)| / max|exp(b)|`` over the whole
spectrogram, i.e. computed on the *linear* mel magnitudes (the log-mels exponentiated),
with ``b`` the float64 numpy reference. Comparing the logs directly would amplify
float32 rounding in near-silent bins (a 1e-7 absolute error on a 1e-5 magnitude is a
1e-2 error after the log) without saying anything about the features that matter.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from stoker.producer import features
from stoker.producer.features import (
    MelComputer,
    centered_window,
    log_mel_spectrogram,
    log_mel_spectrogram_numpy,
    mel_filterbank,
    num_frames,
    pad_value,
)
from stoker.shared import mel as shared_mel
from stoker.shared.config import FeaturesConfig
from stoker.shared.tfsetup import TensorFlowMissing

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_WAV = REPO_ROOT / "data" / "demo" / "wavs" / "DEMO-0004.wav"
CFG = FeaturesConfig()
TF_CFG = dataclasses.replace(CFG, backend="tf")
MAX_RELATIVE_ERROR = 1e-4  # float32 vs float64: ~1e-7 expected, 1e-4 leaves a wide margin
BATCH_TOLERANCE = 1e-6  # batched vs one-by-one TF results (identical in practice)
LIBROSA_TOLERANCE = 1e-3
IMPORT_TIMEOUT_S = 120  # a cold interpreter importing numpy and the config, with margin
SEED = 1234


def relative_error(log_mel: np.ndarray, reference_log_mel: np.ndarray) -> float:
    """max|exp(a) - exp(b)| / max|exp(b)|: the error on linear mel magnitudes."""
    a = np.exp(np.asarray(log_mel, dtype=np.float64))
    b = np.exp(np.asarray(reference_log_mel, dtype=np.float64))
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def chirp_with_noise(seconds: float = 2.0, cfg: FeaturesConfig = CFG) -> np.ndarray:
    """A linear chirp 50 Hz -> 8 kHz plus white noise, float32 [N] (deterministic)."""
    rng = np.random.default_rng(SEED)
    sr = cfg.sample_rate_hz
    t = np.arange(int(seconds * sr)) / sr
    f0, f1 = 50.0, 8000.0
    phase = 2.0 * np.pi * (f0 * t + 0.5 * (f1 - f0) / seconds * t**2)
    signal = 0.5 * np.sin(phase) + 0.02 * rng.standard_normal(t.shape[0])
    return signal.astype(np.float32)


@pytest.fixture(scope="module")
def tf_computer() -> MelComputer:
    return MelComputer(TF_CFG)


# ------------------------------------------------------------------ definition pieces


def test_filterbank_shape_and_values() -> None:
    fb = mel_filterbank(CFG)
    assert fb.shape == (CFG.n_fft // 2 + 1, CFG.n_mels)
    assert fb.dtype == np.float64
    assert np.all(fb >= 0.0)
    assert np.all(fb.max(axis=0) > 0.0), "every filter must cover at least one FFT bin"
    assert np.all(fb[np.fft.rfftfreq(CFG.n_fft, 1.0 / CFG.sample_rate_hz) > CFG.fmax_hz] == 0.0)
    peaks = fb.argmax(axis=0)
    assert np.all(np.diff(peaks) >= 0), "filters must be ordered by frequency"


def test_filterbank_is_slaney_area_normalised() -> None:
    # A triangle of height 2 / (f_right - f_left) has unit area in Hz; for filters much
    # wider than an FFT bin the sampled sum times the bin spacing is close to that.
    fb = mel_filterbank(CFG)
    bin_hz = CFG.sample_rate_hz / CFG.n_fft
    areas = fb.sum(axis=0) * bin_hz
    np.testing.assert_allclose(areas[40:], 1.0, rtol=0.03)


def test_slaney_mel_scale_anchor_points() -> None:
    # Slaney: 3 mel per 200 Hz up to 1 kHz (15 mel), then 27 mel per factor 6.4.
    np.testing.assert_allclose(features._hz_to_mel(np.array([0.0, 200.0, 1000.0, 6400.0])), [0.0, 3.0, 15.0, 42.0])
    hz = np.array([0.0, 300.0, 999.0, 1000.0, 4321.0, 11025.0])
    np.testing.assert_allclose(features._mel_to_hz(features._hz_to_mel(hz)), hz, rtol=1e-12, atol=1e-9)


def test_window_is_periodic_hann_centred() -> None:
    cfg = dataclasses.replace(CFG, win_length=800)
    window = features.centered_window(cfg)
    assert window.shape == (CFG.n_fft,)
    start = (CFG.n_fft - 800) // 2
    assert np.all(window[:start] == 0.0) and np.all(window[start + 800:] == 0.0)
    k = np.arange(800)
    np.testing.assert_allclose(window[start:start + 800], 0.5 - 0.5 * np.cos(2 * np.pi * k / 800))


@pytest.mark.parametrize("num_samples", [513, 1000, 22050, 22050 * 3 + 17, 256 * 40])
def test_num_frames_matches_definition(num_samples: int) -> None:
    assert num_frames(num_samples, CFG) == 1 + num_samples // CFG.hop_length
    audio = np.zeros(num_samples, dtype=np.float32)
    assert log_mel_spectrogram_numpy(audio, CFG).shape == (num_frames(num_samples, CFG), CFG.n_mels)


def test_pad_value_is_log_of_floor_and_what_silence_gives() -> None:
    assert pad_value(CFG) == pytest.approx(math.log(CFG.log_floor))
    silence = log_mel_spectrogram_numpy(np.zeros(4000, dtype=np.float32), CFG)
    assert np.all(silence == pad_value(CFG))


# --------------------------------------------------------------------------- accuracy


def test_numpy_float32_matches_float64_reference() -> None:
    audio = chirp_with_noise()
    reference = log_mel_spectrogram_numpy(audio, CFG, dtype=np.float64)
    single = log_mel_spectrogram_numpy(audio, CFG, dtype=np.float32)
    assert single.dtype == np.float32 and reference.dtype == np.float64
    assert single.shape == reference.shape == (num_frames(audio.shape[0], CFG), CFG.n_mels)
    assert relative_error(single, reference) <= MAX_RELATIVE_ERROR


def test_tf_matches_numpy_reference_on_chirp() -> None:
    audio = chirp_with_noise()
    reference = log_mel_spectrogram_numpy(audio, CFG)
    result = log_mel_spectrogram(audio, CFG)
    assert result.dtype == np.float32
    assert result.shape == reference.shape
    assert relative_error(result, reference) <= MAX_RELATIVE_ERROR


def test_tf_matches_numpy_reference_on_demo_wav() -> None:
    audio, rate = sf.read(str(DEMO_WAV), dtype="float32")
    assert rate == CFG.sample_rate_hz
    reference = log_mel_spectrogram_numpy(audio, CFG)
    result = log_mel_spectrogram(audio, CFG)
    assert result.shape == reference.shape
    assert relative_error(result, reference) <= MAX_RELATIVE_ERROR


@pytest.mark.parametrize("win_length", [800, 513])
def test_win_length_shorter_than_n_fft(win_length: int) -> None:
    cfg = dataclasses.replace(CFG, win_length=win_length)
    audio = chirp_with_noise(1.0, cfg)
    reference = log_mel_spectrogram_numpy(audio, cfg)
    assert relative_error(log_mel_spectrogram(audio, cfg), reference) <= MAX_RELATIVE_ERROR
    assert relative_error(log_mel_spectrogram_numpy(audio, cfg, dtype=np.float32), reference) <= MAX_RELATIVE_ERROR
    # a shorter window is a different feature, not the same one
    assert relative_error(log_mel_spectrogram_numpy(audio, CFG), reference) > 1e-2


# --------------------------------------------------------------------------- batching


def test_batch_equals_per_clip_results(tf_computer: MelComputer) -> None:
    audio = chirp_with_noise(2.0)
    rng = np.random.default_rng(SEED)
    lengths = [513, 700, 5000, 22050, 22050 + 129, audio.shape[0], 1024 + 255]
    clips = [audio[rng.integers(0, audio.shape[0] - n + 1):][:n] for n in lengths]
    batched = tf_computer(clips)
    assert len(batched) == len(clips)
    for clip, result in zip(clips, batched):
        assert result.dtype == np.float32
        assert result.shape == (num_frames(clip.shape[0], CFG), CFG.n_mels)
        np.testing.assert_allclose(result, log_mel_spectrogram(clip, CFG), rtol=0, atol=BATCH_TOLERANCE)
        # the last frames use the clip's own reflect padding, not the batch's zero padding
        assert relative_error(result, log_mel_spectrogram_numpy(clip, CFG)) <= MAX_RELATIVE_ERROR


def test_tf_function_is_traced_once(tf_computer: MelComputer) -> None:
    audio = chirp_with_noise(1.0)
    for sizes in ([600], [600, 9000], [20000, 513, 4000]):
        tf_computer([audio[:n] for n in sizes])
    assert tf_computer._tf_function().experimental_get_tracing_count() == 1


def test_numpy_backend_matches_the_reference_and_batches_like_tf() -> None:
    cfg = dataclasses.replace(CFG, backend="numpy")
    audio = chirp_with_noise(2.0)
    clips = [audio[:600], audio, audio[:3000], audio[:513], audio[7:30000]]
    computer = MelComputer(cfg)
    results = computer(clips)
    for clip, result in zip(clips, results):
        assert result.dtype == np.float32 and result.shape == (num_frames(clip.shape[0], CFG), CFG.n_mels)
        assert relative_error(result, log_mel_spectrogram_numpy(clip, CFG)) <= MAX_RELATIVE_ERROR
        np.testing.assert_allclose(result, computer([clip])[0], rtol=0, atol=BATCH_TOLERANCE)
        np.testing.assert_allclose(result, log_mel_spectrogram(clip, CFG), rtol=0, atol=1e-4)
    assert computer([]) == []


@pytest.mark.parametrize("backend", ["tf", "numpy"])
def test_analyse_gives_the_mel_before_its_log_and_weighted_frame_powers(backend: str) -> None:
    cfg = dataclasses.replace(CFG, backend=backend)
    audio = chirp_with_noise(1.0)
    clips = [audio[:3000], audio]
    weights = np.stack([np.ones(CFG.n_fft // 2 + 1), np.linspace(0.0, 1.0, CFG.n_fft // 2 + 1)], axis=1)
    computer = MelComputer(cfg, weights=weights)
    for clip, (mel, powers) in zip(clips, computer.analyse(clips)):
        assert relative_error(np.log(np.maximum(mel, CFG.log_floor)), log_mel_spectrogram_numpy(clip, CFG)) \
            <= MAX_RELATIVE_ERROR
        padded = np.pad(clip.astype(np.float64), CFG.n_fft // 2, mode="reflect")
        frames = np.lib.stride_tricks.sliding_window_view(padded, CFG.n_fft)[::CFG.hop_length]
        power = np.abs(np.fft.rfft(frames * centered_window(CFG), axis=-1)) ** 2  # [T, F], float64
        np.testing.assert_allclose(powers, power @ weights, rtol=1e-4, atol=1e-6 * float(np.max(power @ weights)))
    assert MelComputer(cfg).analyse(clips)[0][1] is None  # no weights, no powers
    with pytest.raises(ValueError, match="spectral weights must be"):
        MelComputer(cfg, weights=np.ones((10, 2)))


def test_explicit_device_placement(replica_devices: list[str]) -> None:
    """The log-mel ops run on the device given (a producer passes its data GPU), not on
    TensorFlow's default one: here the CPU's second logical device, which nothing picks unasked."""
    import tensorflow as tf

    device = replica_devices[1]
    audio = chirp_with_noise(1.0)
    computer = MelComputer(TF_CFG, device=device)
    (result,) = computer([audio])
    np.testing.assert_allclose(result, log_mel_spectrogram(audio, CFG), rtol=0, atol=BATCH_TOLERANCE)
    wanted = tf.DeviceSpec.from_string(device)
    kinds = ("RFFT", "MatMul", "Log")  # the framing's transform, the filterbank, the log
    placed = {(op.type, tf.DeviceSpec.from_string(op.device))
              for op in computer._tf_function().get_concrete_function().graph.get_operations() if op.type in kinds}
    assert placed == {(kind, wanted) for kind in kinds}, placed


def test_empty_batch(tf_computer: MelComputer) -> None:
    assert tf_computer([]) == []


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("backend", ["tf", "numpy"])
def test_short_clip_raises(backend: str, tf_computer: MelComputer) -> None:
    cfg = dataclasses.replace(CFG, backend=backend)
    too_short = np.zeros(CFG.n_fft // 2, dtype=np.float32)
    computer = tf_computer if backend == "tf" else MelComputer(cfg)
    with pytest.raises(ValueError, match="at least"):
        computer([np.zeros(4000, dtype=np.float32), too_short])
    with pytest.raises(ValueError, match="at least"):
        log_mel_spectrogram_numpy(too_short, cfg)
    with pytest.raises(ValueError, match="at least"):
        log_mel_spectrogram(too_short, cfg)
    assert computer([np.zeros(CFG.n_fft // 2 + 1, dtype=np.float32)])[0].shape == (3, CFG.n_mels)


def test_bad_audio_raises() -> None:
    with pytest.raises(ValueError, match="mono"):
        log_mel_spectrogram_numpy(np.zeros((2, 4000), dtype=np.float32), CFG)
    with pytest.raises(ValueError, match="floating"):
        log_mel_spectrogram_numpy(np.zeros(4000, dtype=np.int16), CFG)


def test_import_does_not_import_tensorflow() -> None:
    code = "import stoker.producer.features, sys; assert 'tensorflow' not in sys.modules"
    completed = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                               timeout=IMPORT_TIMEOUT_S)
    assert completed.returncode == 0, completed.stderr


# ---------------------------------------------------------------------------- librosa


def _librosa_log_mel(audio: np.ndarray, cfg: FeaturesConfig) -> np.ndarray:
    """librosa's melspectrogram with the parameters of the definition, then the same log."""
    import librosa
    mel = librosa.feature.melspectrogram(
        y=audio.astype(np.float64), sr=cfg.sample_rate_hz, n_fft=cfg.n_fft, hop_length=cfg.hop_length,
        win_length=cfg.win_length, window="hann", center=True, pad_mode="reflect", power=1.0,
        n_mels=cfg.n_mels, fmin=cfg.fmin_hz, fmax=cfg.fmax_hz, htk=False, norm="slaney")  # [M, T]
    return np.log(np.maximum(mel.T, cfg.log_floor))


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(CFG, win_length=800, n_mels=64, fmin_hz=40.0)],
                         ids=["default", "win800-mels64-fmin40"])
@pytest.mark.slow  # processes or sockets
def test_matches_librosa(cfg: FeaturesConfig) -> None:
    audio = chirp_with_noise(cfg=cfg)
    expected = _librosa_log_mel(audio, cfg)
    for ours in (log_mel_spectrogram_numpy(audio, cfg), log_mel_spectrogram(audio, cfg)):
        assert ours.shape == expected.shape
        assert relative_error(ours, expected) <= LIBROSA_TOLERANCE


def test_filterbank_matches_librosa() -> None:
    import librosa
    np.testing.assert_allclose(mel_filterbank(CFG), librosa.filters.mel(
        sr=CFG.sample_rate_hz, n_fft=CFG.n_fft, n_mels=CFG.n_mels, fmin=CFG.fmin_hz, fmax=CFG.fmax_hz,
        htk=False, norm="slaney").T, rtol=1e-5, atol=1e-9)


def test_public_function_is_the_tf_path_whatever_the_backend() -> None:
    audio = chirp_with_noise(1.0)
    expected = MelComputer(TF_CFG)([audio])[0]
    for backend in ("numpy", "auto", "tf"):
        result = log_mel_spectrogram(audio, dataclasses.replace(CFG, backend=backend))
        np.testing.assert_array_equal(result, expected)
    assert features._cached_computer(TF_CFG).cfg.backend == "tf"


@pytest.mark.parametrize("visible, expected", [("", "numpy"), ("-1", "numpy"), ("0", "tf"), ("GPU-5d1c", "tf"),
                                               (None, "numpy")])
def test_auto_backend_is_tf_only_with_a_gpu(visible: str | None, expected: str, monkeypatch) -> None:
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert features.resolve_backend(CFG).backend == expected
    assert MelComputer(CFG).cfg.backend == expected
    assert features.resolve_backend(TF_CFG).backend == "tf"  # explicit choices are kept
    assert features.resolve_backend(CFG, has_gpu=True).backend == "tf"


@pytest.mark.parametrize("framework", ["torch", "jax", "numpy"])
def test_auto_backend_is_numpy_on_a_gpu_for_a_run_of_another_framework(framework: str) -> None:
    """The batches go to another framework than TensorFlow: no producer imports TensorFlow."""
    assert features.resolve_backend(CFG, has_gpu=True, framework=framework).backend == "numpy"
    assert features.resolve_backend(CFG, has_gpu=True, framework="tensorflow").backend == "tf"


def test_without_tensorflow_auto_is_numpy_the_public_function_computes_and_tf_is_one_line(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # as if not installed: find_spec says None
    assert features.resolve_backend(CFG, has_gpu=True).backend == "numpy"
    audio = chirp_with_noise(1.0)
    assert relative_error(log_mel_spectrogram(audio, CFG), log_mel_spectrogram_numpy(audio, CFG)) <= MAX_RELATIVE_ERROR
    with pytest.raises(TensorFlowMissing, match=r"^features.backend tf \(TensorFlow ops in the producers\) needs "
                                                  r"TensorFlow: pip install 'stoker\[tf\]'$"):
        MelComputer(TF_CFG)


def test_public_function_defaults_and_accepts_float64() -> None:
    audio = chirp_with_noise(1.0)
    result = log_mel_spectrogram(audio.astype(np.float64))
    assert result.dtype == np.float32 and result.shape == (num_frames(audio.shape[0], CFG), CFG.n_mels)
    assert relative_error(result, log_mel_spectrogram_numpy(audio, CFG)) <= MAX_RELATIVE_ERROR


# ------------------------------------------------------------------------ conventions

# One config per family of code bases (shared/config.py features.*): each checked against
# librosa's definition (and tf.signal's where it is tf's) on the numpy reference, on the
# numpy backend and on the TF backend, one clip at a time and batched.
CONVENTIONS = {
    "default": {},
    "htk-unnormalised-constant-power-log10": dict(mel_scale="htk", filter_norm="none", padding="constant", power=2.0,
                                                  log="log10", log_floor=1e-10),
    "slaney-unnormalised-uncentred-db-top80": dict(filter_norm="none", padding="none", log="db", top_db=80.0),
    "htk-slaney-end-power-db-offset": dict(mel_scale="htk", padding="end", power=2.0, log="db", log_floor=1e-10,
                                           log_offset=1e-4, top_db=60.0),
    "tf-end-ln-offset": dict(mel_scale="tf", filter_norm="none", padding="end", log_floor=0.0, log_offset=1e-6),
    "reflect-ln-offset-and-floor": dict(log_floor=1e-3, log_offset=1e-4, fmin_hz=40.0, n_mels=64),
}


def convention(name: str, **extra: object) -> FeaturesConfig:
    return dataclasses.replace(CFG, **{**CONVENTIONS[name], **extra})


def linear(log_mel: np.ndarray, cfg: FeaturesConfig) -> np.ndarray:
    """The mel values a log-mel of ``cfg`` is the log of (its log undone), float64."""
    return np.exp(np.asarray(log_mel, np.float64) / shared_mel.log_scale(cfg))


def convention_error(ours: np.ndarray, expected: np.ndarray, cfg: FeaturesConfig) -> float:
    """relative_error on the linear values of ``cfg``'s log."""
    a, b = linear(ours, cfg), linear(expected, cfg)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def librosa_convention(audio: np.ndarray, cfg: FeaturesConfig) -> np.ndarray:
    """``cfg``'s log-mel from librosa's pieces: melspectrogram (stft with center and pad_mode,
    filters.mel with htk and norm), tf.signal's filters for mel_scale tf, and power_to_db /
    amplitude_to_db for dB; padding at the end is librosa's uncentred stft of the clip
    zero-padded as tf.signal.frame(pad_end=True) pads it. [T, M] float64."""
    import librosa
    y = audio.astype(np.float64)
    if cfg.padding == "end":
        frames = -(-len(y) // cfg.hop_length)
        y = np.pad(y, (0, (frames - 1) * cfg.hop_length + cfg.n_fft - len(y)))
    stft = np.abs(librosa.stft(y, n_fft=cfg.n_fft, hop_length=cfg.hop_length, win_length=cfg.win_length,
                               window="hann", center=cfg.padding in ("reflect", "constant"),
                               pad_mode="reflect" if cfg.padding == "reflect" else "constant")) ** cfg.power
    if cfg.mel_scale == "tf":
        fb = tf_mel_matrix(cfg)
    else:
        fb = librosa.filters.mel(sr=cfg.sample_rate_hz, n_fft=cfg.n_fft, n_mels=cfg.n_mels, fmin=cfg.fmin_hz,
                                 fmax=cfg.fmax_hz, htk=cfg.mel_scale == "htk",
                                 norm="slaney" if cfg.filter_norm == "slaney" else None).T
    mel = (stft.T @ fb) + cfg.log_offset  # [T, M]
    if cfg.padding in ("reflect", "constant", "none") and cfg.mel_scale != "tf":  # the one-call form agrees
        whole = librosa.feature.melspectrogram(
            y=y, sr=cfg.sample_rate_hz, n_fft=cfg.n_fft, hop_length=cfg.hop_length, win_length=cfg.win_length,
            center=cfg.padding != "none", pad_mode="reflect" if cfg.padding == "reflect" else "constant",
            power=cfg.power, n_mels=cfg.n_mels, fmin=cfg.fmin_hz, fmax=cfg.fmax_hz, htk=cfg.mel_scale == "htk",
            norm="slaney" if cfg.filter_norm == "slaney" else None).T
        np.testing.assert_allclose(whole + cfg.log_offset, mel, rtol=1e-9, atol=1e-12)
    top_db = cfg.top_db or None
    if cfg.log == "db":
        to_db = librosa.power_to_db if cfg.power == 2 else librosa.amplitude_to_db
        return to_db(mel, ref=1.0, amin=cfg.log_floor, top_db=top_db)
    floored = np.maximum(mel, cfg.log_floor)
    return np.log(floored) if cfg.log == "ln" else np.log10(floored)


def tf_mel_matrix(cfg: FeaturesConfig) -> np.ndarray:
    import tensorflow as tf

    return tf.signal.linear_to_mel_weight_matrix(cfg.n_mels, cfg.n_fft // 2 + 1, cfg.sample_rate_hz, cfg.fmin_hz,
                                                 cfg.fmax_hz, dtype=tf.float64).numpy()


BATCH_LENGTHS = (1024, 5000, 22050 + 129)  # a clip of one whole frame, and others off the hop grid


@pytest.mark.parametrize("name", list(CONVENTIONS))
def test_convention_matches_librosa_numpy(name: str) -> None:
    cfg = convention(name, backend="numpy")
    audio = chirp_with_noise(1.0, cfg)
    expected = librosa_convention(audio, cfg)
    reference = log_mel_spectrogram_numpy(audio, cfg)
    assert reference.shape == expected.shape == (num_frames(len(audio), cfg), cfg.n_mels)
    assert convention_error(reference, expected, cfg) <= LIBROSA_TOLERANCE
    clips = [audio[:n] for n in BATCH_LENGTHS] + [audio]
    for clip, ours in zip(clips, MelComputer(cfg)(clips)):
        assert ours.dtype == np.float32 and ours.shape == (num_frames(len(clip), cfg), cfg.n_mels)
        assert convention_error(ours, log_mel_spectrogram_numpy(clip, cfg), cfg) <= MAX_RELATIVE_ERROR
    assert convention_error(MelComputer(cfg)([audio])[0], expected, cfg) <= LIBROSA_TOLERANCE


@pytest.mark.parametrize("name", list(CONVENTIONS))
def test_convention_tf_backend_matches_the_reference(name: str) -> None:
    cfg = convention(name, backend="tf")
    audio = chirp_with_noise(1.0, cfg)
    clips = [audio[:n] for n in BATCH_LENGTHS] + [audio]
    for clip, ours in zip(clips, MelComputer(cfg)(clips)):
        reference = log_mel_spectrogram_numpy(clip, cfg)
        assert ours.shape == reference.shape
        assert convention_error(ours, reference, cfg) <= MAX_RELATIVE_ERROR
    assert convention_error(log_mel_spectrogram(audio, cfg), librosa_convention(audio, cfg), cfg) \
        <= LIBROSA_TOLERANCE


@pytest.mark.parametrize("cfg", [convention("tf-end-ln-offset"), convention("htk-slaney-end-power-db-offset")],
                         ids=["magnitude", "power"])
def test_padding_at_the_end_is_tf_signal_stft_pad_end(cfg: FeaturesConfig) -> None:
    import tensorflow as tf

    audio = chirp_with_noise(1.0, cfg)[:22050 - 77]
    stft = tf.signal.stft(tf.constant(audio, tf.float64), cfg.n_fft, cfg.hop_length, cfg.n_fft, pad_end=True)
    spectrum = np.abs(stft.numpy()) ** cfg.power  # tf.signal's periodic Hann of n_fft
    assert spectrum.shape[0] == num_frames(len(audio), cfg) == -(-len(audio) // cfg.hop_length)
    ours = MelComputer(dataclasses.replace(cfg, mel_scale="tf", filter_norm="none", backend="numpy")).analyse([audio])
    np.testing.assert_allclose(ours[0][0], spectrum @ tf_mel_matrix(cfg), rtol=1e-3,
                               atol=1e-5 * float(np.max(spectrum @ tf_mel_matrix(cfg))))


@pytest.mark.parametrize("cfg", [convention("tf-end-ln-offset"), dataclasses.replace(CFG, fmin_hz=125.0,
                                                                                       fmax_hz=7600.0, n_mels=128)])
def test_tf_mel_scale_is_tf_signal_linear_to_mel_weight_matrix(cfg: FeaturesConfig) -> None:
    cfg = dataclasses.replace(cfg, mel_scale="tf", filter_norm="none")
    np.testing.assert_allclose(mel_filterbank(cfg), tf_mel_matrix(cfg), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("padding, shortest", [("reflect", 513), ("constant", 1), ("end", 1), ("none", 1024)])
def test_num_frames_and_shortest_clip_follow_the_padding(padding: str, shortest: int) -> None:
    cfg = dataclasses.replace(CFG, padding=padding, backend="numpy")
    assert features.min_num_samples(cfg) == shortest
    for n in (shortest, shortest + 1, 1023, 1024, 1025, 5000, 22050, 256 * 40):
        if n < shortest:
            continue
        frames = log_mel_spectrogram_numpy(np.zeros(n, np.float32), cfg).shape[0]
        assert frames == num_frames(n, cfg) == len(MelComputer(cfg)([np.zeros(n, np.float32)])[0])
        assert frames == {"end": -(-n // 256), "none": 1 + (n - 1024) // 256}.get(padding, 1 + n // 256)
    if shortest > 1:
        with pytest.raises(ValueError, match="at least"):
            log_mel_spectrogram_numpy(np.zeros(shortest - 1, np.float32), cfg)


@pytest.mark.parametrize("name", list(CONVENTIONS))
def test_pad_value_is_what_silence_gives(name: str) -> None:
    cfg = convention(name, backend="numpy")
    silence = log_mel_spectrogram_numpy(np.zeros(4000, np.float32), cfg)
    np.testing.assert_allclose(silence, pad_value(cfg), rtol=1e-12)
    np.testing.assert_allclose(MelComputer(cfg)([np.zeros(4000, np.float32)])[0], pad_value(cfg), rtol=1e-6)
    assert shared_mel.mel_pad_value(cfg, "clip_minmax") == 0.0
    assert shared_mel.mel_pad_value(cfg, "dataset") == shared_mel.mel_pad_value(cfg, "off") == pad_value(cfg)


def users_training_mel(audio: np.ndarray, rate_hz: int) -> np.ndarray:
    """The mel of a user's own TF trainer, written out in float64: a
    non-centred STFT padded at the end (tf.signal.stft(pad_end=True): periodic Hann of n_fft),
    the magnitude, HTK mel filters without area normalisation as tf.signal makes them (triangles
    linear in HTK mel), log(x + 1e-6), then each clip min-max scaled to [0, 1]."""
    n_fft, hop, n_mels, fmin, fmax = 1024, 256, 80, 0.0, 8000.0
    count = -(-len(audio) // hop)
    padded = np.pad(audio.astype(np.float64), (0, (count - 1) * hop + n_fft - len(audio)))
    frames = np.stack([padded[t * hop:t * hop + n_fft] for t in range(count)])
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    magnitude = np.abs(np.fft.rfft(frames * window, axis=-1))  # [T, 513]

    def mel(hz: np.ndarray) -> np.ndarray:
        return 1127.0 * np.log1p(np.asarray(hz) / 700.0)

    bins = mel(np.linspace(0.0, rate_hz / 2, n_fft // 2 + 1))[:, None]
    edges = np.linspace(mel(fmin), mel(fmax), n_mels + 2)
    lower, centre, upper = edges[:-2], edges[1:-1], edges[2:]
    weights = np.maximum(0.0, np.minimum((bins - lower) / (centre - lower), (upper - bins) / (upper - centre)))
    weights[0] = 0.0  # tf.signal zeroes the DC bin
    log_mel = np.log(magnitude @ weights + 1e-6)
    return (log_mel - log_mel.min()) / (log_mel.max() - log_mel.min())


USERS_FEATURES = dict(mel_scale="tf", filter_norm="none", padding="end", power=1.0, log="ln", log_floor=0.0,
                      log_offset=1e-6, top_db=0.0)  # with transforms.mel_norm: clip_minmax (docs/design/features.md, "Mel conventions")


def test_the_users_mel_is_reproduced() -> None:
    from stoker.shared.config import load
    from stoker.shared.melstats import minmax

    cfg = load(None, {**{f"features.{k}": v for k, v in USERS_FEATURES.items()},
                      "transforms.mel_norm": "clip_minmax"})
    audio = chirp_with_noise(1.0, cfg.features)[:20000]
    expected = users_training_mel(audio, cfg.features.sample_rate_hz)
    for ours, tolerance in ((log_mel_spectrogram_numpy(audio, cfg.features), 1e-9),
                            (MelComputer(dataclasses.replace(cfg.features, backend="numpy"))([audio])[0], 1e-4),
                            (log_mel_spectrogram(audio, cfg.features), 1e-4)):
        batch = np.full((2, len(ours) + 5, cfg.features.n_mels), 7.0, ours.dtype)
        batch[0, :len(ours)] = ours
        minmax(batch, np.array([len(ours), 0]))  # as producers scale each clip of a batch
        np.testing.assert_allclose(batch[0, :len(ours)], expected, rtol=0, atol=tolerance)
        assert np.all(batch[0, len(ours):] == 7.0) and np.all(batch[1] == 7.0)  # padding and empty rows stay
    assert shared_mel.mel_pad_value(cfg.features, cfg.transforms.mel_norm) == 0.0
