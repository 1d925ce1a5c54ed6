"""The log-mel spectrogram: the one definition used for training data and at inference.

Every producer computes its training features here, and a user synthesising with a trained
model must compute the same ones: by default librosa's ``melspectrogram(..., center=True,
pad_mode="reflect", power=1.0, htk=False, norm="slaney")`` then ``log(max(mel, log_floor))``,
the ``features`` settings (shared/config.py ``FeaturesConfig``) selecting the other common
conventions; docs/design/features.md, "The feature definition", writes it out step by step. Here
:func:`log_mel_spectrogram_numpy` (the float64 reference), :class:`MelComputer` (the
producer's batched computation, TensorFlow or numpy, or the user's ``features.user``) and
:func:`log_mel_spectrogram` (the public function). TensorFlow is imported inside the
functions that need it, so importing this module does not pay for it.

Shapes in the docstrings below: ``N`` samples of a clip, ``B`` clips in one batched
computation, ``T`` frames (``num_frames(N, cfg)``), ``F`` rfft bins (``n_fft // 2 + 1``),
``M`` mel channels (``n_mels``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from ..shared.config import TENSORFLOW, FeaturesConfig
from ..shared.mel import (PAD_END, REFLECT_OVERLAP, filterbank_weights, log_scale,
                          min_num_samples, num_frames, side_pad, silence_value, user_mel_function)
from ..shared.mel import hz_to_mel as _hz_to_mel, mel_to_hz as _mel_to_hz  # noqa: F401 (the tests' names)
from ..shared.tfsetup import require_tensorflow, tensorflow_installed

logger = logging.getLogger(__name__)

# The TF path works in float32: the precision of the audio and of the features the model
# consumes; float64 is only worth it for the reference.
_TF_DTYPE = np.float32

# The numpy backend transforms this many frames at a time: 128 x 1024 float32 frames are
# 512 KiB, so a block and its spectrum stay in a core's cache.
_NUMPY_BLOCK_ROWS = 128
# The numpy backend applies the filterbank in groups of bands, each over only the rfft bins its
# filters reach: a filter is non-zero over a few bins, so one dense [bins, n_mels] product is
# mostly zeros (8 groups: a third of the product's time at 80 bands, benchmarks/transforms.py).
_FILTER_GROUPS = 8

# How many MelComputers log_mel_spectrogram keeps (one per distinct FeaturesConfig): a
# process normally uses one config; a few more cover tests and notebooks.
_CACHED_COMPUTERS = 8


# ---------------------------------------------------------------------------- helpers


def _check_cfg(cfg: FeaturesConfig) -> None:
    if cfg.win_length > cfg.n_fft:
        raise ValueError(f"win_length ({cfg.win_length}) must not exceed n_fft ({cfg.n_fft})")
    if cfg.n_fft <= 0 or cfg.hop_length <= 0 or cfg.win_length <= 0 or cfg.n_mels <= 0:
        raise ValueError("n_fft, hop_length, win_length and n_mels must be positive")
    if cfg.log_floor < 0 or cfg.log_offset < 0 or max(cfg.log_floor, cfg.log_offset) <= 0:
        raise ValueError(f"need log_floor >= 0 and log_offset >= 0, one positive; got {cfg.log_floor}, "
                         f"{cfg.log_offset}")


def centered_window(cfg: FeaturesConfig) -> np.ndarray:
    """The analysis window, float64 [n_fft]: Hann of win_length, periodic (or symmetric for
    ``window: hann_symmetric``), centred."""
    _check_cfg(cfg)
    k = np.arange(cfg.win_length, dtype=np.float64)
    period = cfg.win_length - 1 if cfg.window == "hann_symmetric" and cfg.win_length > 1 else cfg.win_length
    hann = 0.5 - 0.5 * np.cos(2.0 * np.pi * k / period)
    window = np.zeros(cfg.n_fft, dtype=np.float64)
    start = (cfg.n_fft - cfg.win_length) // 2
    window[start:start + cfg.win_length] = hann
    return window


def _as_clip(audio: Any, cfg: FeaturesConfig, dtype: Any, what: str = "audio") -> np.ndarray:
    """Validate one mono clip [N] and return it as ``dtype``."""
    array = np.asarray(audio)
    if array.ndim != 1:
        raise ValueError(f"{what} must be mono, shape [num_samples]; got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"{what} must be floating point (samples in [-1, 1]); got dtype {array.dtype}")
    needed = min_num_samples(cfg)
    if array.shape[0] < needed:
        raise ValueError(
            f"{what} has {array.shape[0]} samples; the log-mel needs at least {needed} "
            f"({1000.0 * needed / cfg.sample_rate_hz:.1f} ms at {cfg.sample_rate_hz} Hz) with padding "
            f"{cfg.padding}; reject such clips")
    return array.astype(dtype, copy=False)


def _framing_pads(num_samples: int, cfg: FeaturesConfig) -> tuple[int, int]:
    """Samples (before, after) the clip that framing adds (step 1): n_fft // 2 each side when
    centred, (n_fft - hop_length) // 2 for reflect_overlap; when padding at the end, the zeros
    its last frame needs; else none."""
    if cfg.padding == PAD_END:
        return 0, max(0, (num_frames(num_samples, cfg) - 1) * cfg.hop_length + cfg.n_fft - num_samples)
    return side_pad(cfg), side_pad(cfg)


def _pad_for_framing(clip: np.ndarray, cfg: FeaturesConfig) -> np.ndarray:
    """Step 1: [N] -> the padded signal its frames are cut from."""
    before, after = _framing_pads(clip.shape[0], cfg)
    return np.pad(clip, (before, after), mode="reflect" if _reflected(cfg) else "constant")


def _reflected(cfg: FeaturesConfig) -> bool:
    """Whether step 1 pads with the clip's reflection (else with zeros)."""
    return cfg.padding in ("reflect", REFLECT_OVERLAP)


def _guarded(cfg: FeaturesConfig) -> bool:
    """Whether step 4 takes each bin's |X|^2 as max(|X|^2 + bin_power_offset, bin_power_floor)."""
    return bool(cfg.bin_power_offset or cfg.bin_power_floor)


def _guard_in_place(power: np.ndarray, cfg: FeaturesConfig) -> np.ndarray:
    """Step 4's guard on bin powers |X|^2, in place: max(|X|^2 + offset, floor); returns ``power``."""
    if cfg.bin_power_offset:
        np.add(power, power.dtype.type(cfg.bin_power_offset), out=power)
    if cfg.bin_power_floor:
        np.maximum(power, power.dtype.type(cfg.bin_power_floor), out=power)
    return power


def _log_in_place(mel: np.ndarray, cfg: FeaturesConfig) -> np.ndarray:
    """Step 7's elementwise part on mel values [..., M] of float ``mel``'s dtype, in place:
    ``scale * ln(max(mel + log_offset, log_floor))``; returns ``mel``."""
    if cfg.log_offset:
        np.add(mel, mel.dtype.type(cfg.log_offset), out=mel)
    if cfg.log_floor:
        np.maximum(mel, mel.dtype.type(cfg.log_floor), out=mel)
    np.log(mel, out=mel)
    if cfg.log != "ln":
        np.multiply(mel, mel.dtype.type(log_scale(cfg)), out=mel)
    return mel


def _clamp_top_db(mel: np.ndarray, cfg: FeaturesConfig) -> np.ndarray:
    """Step 7's per-clip part on one clip's log-mel [T, M], in place: values below the clip's
    maximum minus ``top_db`` raised to it (librosa's power_to_db top_db), then the fixed dB
    range of ``db_norm`` (shared/mel.py ``db_normalised``); returns ``mel``."""
    if cfg.top_db > 0 and mel.size:
        np.maximum(mel, mel.dtype.type(mel.max() - cfg.top_db), out=mel)
    if cfg.db_norm != "off":
        m, low, kind = cfg.db_max_abs, cfg.db_min_level, mel.dtype.type
        np.subtract(mel, kind(cfg.db_ref_level + low), out=mel)
        np.multiply(mel, kind(2.0 * m / -low), out=mel)
        np.subtract(mel, kind(m), out=mel)
        np.clip(mel, kind(-m), kind(m), out=mel)
    return mel


# ------------------------------------------------------------------------- public API


def mel_filterbank(cfg: FeaturesConfig) -> np.ndarray:
    """The triangular mel filters of step 5, float64 [F, M].

    ``F = n_fft // 2 + 1`` rfft bins, ``M = n_mels`` channels; identical to
    ``librosa.filters.mel(sr, n_fft, n_mels, fmin, fmax, htk=mel_scale == "htk",
    norm="slaney" if filter_norm == "slaney" else None).T`` for ``mel_scale`` slaney and htk,
    and for ``tf`` (unnormalised) to ``tf.signal.linear_to_mel_weight_matrix(n_mels, F,
    sample_rate_hz, fmin_hz, fmax_hz)``. Logs a warning if a filter covers no rfft bin (too
    many mels for this n_fft).
    """
    _check_cfg(cfg)
    return filterbank_weights(cfg)


def pad_value(cfg: FeaturesConfig) -> float:
    """Log-mel value of padded frames: digital silence's (shared/mel.py ``silence_value``),
    ``ln(log_floor)`` by default."""
    return silence_value(cfg)


def log_mel_spectrogram_numpy(
    audio: np.ndarray, cfg: FeaturesConfig = FeaturesConfig(), dtype: Any = np.float64
) -> np.ndarray:
    """Reference log-mel in plain numpy: [N] -> [T, M] of ``dtype``.

    Frames are built explicitly (a strided view of the padded clip) and transformed with
    ``np.fft.rfft``; every step runs in ``dtype`` (numpy >= 2 keeps float32 FFTs in single
    precision). Raises ValueError for a clip shorter than :func:`min_num_samples` or one
    that is not 1-D floating point. ``features.user`` is not this definition: see
    :class:`MelComputer`.
    """
    clip = _as_clip(audio, cfg, dtype)
    padded = _pad_for_framing(clip, cfg)
    frames = np.lib.stride_tricks.sliding_window_view(padded, cfg.n_fft)[:: cfg.hop_length]  # [T, n_fft]
    expected = num_frames(clip.shape[0], cfg)
    if frames.shape[0] != expected:  # the definition and num_frames must agree
        raise AssertionError(f"framing produced {frames.shape[0]} frames, num_frames says {expected}")
    window = centered_window(cfg).astype(dtype)
    bins = np.fft.rfft(frames * window, n=cfg.n_fft, axis=-1)  # [T, F]
    power = _guard_in_place((bins.real ** 2 + bins.imag ** 2).astype(dtype), cfg)  # |X|^2, guarded
    spectrum = power if cfg.power == 2 else np.sqrt(power)  # [T, F]
    mel = spectrum.astype(dtype, copy=False) @ mel_filterbank(cfg).astype(dtype)  # [T, M]
    return _clamp_top_db(_log_in_place(np.array(mel, dtype=dtype), cfg), cfg)


class UserMelError(ValueError):
    """features.user failed on one clip, or returned the wrong shape: the clip's rejection reason."""


class MelComputer:
    """Log-mels of several clips at once, with the configured backend.

    ``MelComputer(cfg, device)(clips)`` maps a list of B mono clips (each [N_i], floating
    point, samples in [-1, 1]) to a list of B float32 arrays [T_i, M], with
    ``T_i = num_frames(N_i, cfg)``; each result equals that clip's unbatched log-mel.

    Backend ``"tf"``: each clip is padded on its own as step 1 pads it (in numpy, so the end
    of a short clip is reflected, not zero padded) into a segment rounded up to a
    multiple of ``hop_length``; the segments are laid end to end in one signal [S], and
    one ``tf.function`` (input signature ``TensorSpec([None], float32)``, so it is traced
    once) frames, windows, FFTs and projects all of it to [R, M], under
    ``tf.device(device)`` when ``device`` is given (e.g. ``"/GPU:0"``). Because every
    segment starts on the hop grid, clip i's frames are rows ``first_i .. first_i + T_i``
    of the result: no clip is padded to the longest one, so a batch costs what its clips
    cost (plus at most ``n_fft / hop_length`` discarded rows per clip, where frames
    straddle two segments). Only the rfft bins some mel filter uses are kept before the
    magnitude and the projection (bins above ``fmax_hz`` have zero weight).

    Backend ``"numpy"``: the same concatenated layout and bin range, framed as a strided
    view and transformed in blocks of :data:`_NUMPY_BLOCK_ROWS` frames (window, rfft with
    scipy's pocketfft in float32, magnitude, projection), so a block stays in cache;
    ``device`` is ignored. Backend ``"auto"`` becomes one of the two in the constructor
    (:func:`resolve_backend`).

    With spectral ``weights`` [F, W], :meth:`analyse` also returns each frame's power
    spectrum weighted by them, computed from the same FFT (the producer transforms measure
    a clip's levels with it), and the mel before its log.

    With ``features.user`` (``package.module:function``) the computer calls that function on
    each clip instead, ``fn(audio float32 [N], sample_rate_hz) -> [T, M]``, and raises
    :class:`UserMelError` (the clip's rejection reason) when its result is not float32-castable
    [num_frames(N), n_mels] of finite values; the function cannot :meth:`analyse`.

    Raises ValueError, naming the clip, for a clip shorter than :func:`min_num_samples`
    (callers should reject those when indexing).
    """

    def __init__(self, cfg: FeaturesConfig, device: str | None = None, weights: np.ndarray | None = None) -> None:
        _check_cfg(cfg)
        cfg = resolve_backend(cfg)
        if cfg.backend not in ("tf", "numpy"):
            raise ValueError(f"features backend must be 'auto', 'tf' or 'numpy', got {cfg.backend!r}")
        if cfg.backend == "tf":
            require_tensorflow("features.backend tf (TensorFlow ops in the producers)")
        bins = cfg.n_fft // 2 + 1
        if weights is not None and (weights.ndim != 2 or weights.shape[0] != bins):
            raise ValueError(f"spectral weights must be [n_fft // 2 + 1, W] = [{bins}, W], got {list(weights.shape)}")
        self.cfg = cfg
        self.device = device
        self.weights = None if weights is None else np.ascontiguousarray(weights, dtype=np.float32)  # [F, W]
        self._user = user_mel_function(cfg.user)[0] if cfg.user else None
        self._filterbank = mel_filterbank(cfg)  # float64 [F, M]
        self._window = centered_window(cfg)  # float64 [n_fft]
        self._tf_fns: dict[bool, Callable[[Any], Any]] = {}  # per analyse: the log-mel, or (mel, powers)
        self._np_parts: tuple[np.ndarray, int, int, list[_FilterGroup]] | None = None
        self._build_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MelComputer(backend={self.cfg.backend!r}, device={self.device!r})"

    def __call__(self, clips: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Log-mels of ``clips`` ([N_i] each) -> list of float32 [T_i, M]."""
        if self._user is not None:
            return [self._user_mel(_as_clip(c, self.cfg, np.float32, f"clip {i}")) for i, c in enumerate(clips)]
        done = self._call_numpy(clips, analyse=False) if self.cfg.backend == "numpy" \
            else self._call_tf(clips, analyse=False)
        return [_clamp_top_db(mel, self.cfg) for mel, _ in done]

    def _user_mel(self, clip: np.ndarray) -> np.ndarray:
        """features.user's mel of one clip, checked: float32 [num_frames(N), n_mels], finite."""
        cfg = self.cfg
        try:
            mel = np.asarray(self._user(clip, cfg.sample_rate_hz))
        except Exception as exc:  # the user's function: its error is the clip's rejection reason
            raise UserMelError(f"features.user {cfg.user}: {type(exc).__name__}: {exc}") from None
        want = (num_frames(clip.shape[0], cfg), cfg.n_mels)
        if mel.shape != want or not np.issubdtype(mel.dtype, np.floating) or not np.all(np.isfinite(mel)):
            raise UserMelError(f"features.user {cfg.user} returned {mel.dtype} {list(mel.shape)}; expected finite "
                               f"float32 {list(want)} for {clip.shape[0]} samples (padding {cfg.padding})")
        return mel.astype(np.float32, copy=False)

    def analyse(self, clips: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Per clip, the mel magnitudes *before the log* (step 6 of the definition), float32
        [T_i, M], and, when the computer has spectral ``weights`` [F, W], each frame's weighted
        power: ``P[t, w] = sum_f |X[t, f]|^2 weights[f, w]`` over every rfft bin (X the
        windowed frame's rfft, step 4 before the magnitude), float32 [T_i, W]; else None.
        Producer transforms measure a clip's levels this way from the frames its mel is
        made of (producer/transforms.py), so measuring costs no second pass over the audio."""
        if self._user is not None:
            raise ValueError("a features.user mel function has no spectrum to analyse")
        if self.cfg.backend == "numpy":
            return self._call_numpy(clips, analyse=True)
        return self._call_tf(clips, analyse=True)

    def log_in_place(self, mel: np.ndarray) -> np.ndarray:
        """Step 7 of the definition on one clip's float32 mel (from :meth:`analyse`), in place:
        the log of ``max(mel + log_offset, log_floor)`` and the clip's top_db clamp; returns ``mel``."""
        return _clamp_top_db(_log_in_place(mel, self.cfg), self.cfg)

    # -- numpy backend

    def _call_numpy(self, clips: Sequence[np.ndarray], analyse: bool) -> list[tuple[np.ndarray, np.ndarray | None]]:
        if len(clips) == 0:
            return []
        cfg = self.cfg
        checked = [_as_clip(c, cfg, np.float32, f"clip {i}") for i, c in enumerate(clips)]
        signal, first_rows, frame_counts = _concatenate_for_framing(checked, cfg)
        frames = np.lib.stride_tricks.sliding_window_view(signal, cfg.n_fft)[:: cfg.hop_length]  # [R, n_fft] view
        if self._np_parts is None:
            low, high = _filterbank_support(self._filterbank)
            self._np_parts = (self._window.astype(np.float32), low, high, _filter_groups(self._filterbank, low, high))
        window, low, high, groups = self._np_parts
        rfft = _rfft()
        out = np.empty((frames.shape[0], cfg.n_mels), dtype=np.float32)  # [R, M]
        weights = self.weights if analyse else None
        squared = cfg.power == 2  # the mel of |X|^2, else of |X|
        guarded = _guarded(cfg)  # |X|^2 offset or floored before the power
        powers = np.empty((frames.shape[0], weights.shape[1]), dtype=np.float32) if weights is not None else None
        block_rows = min(_NUMPY_BLOCK_ROWS, frames.shape[0])
        buffer = np.empty((block_rows, cfg.n_fft), dtype=np.float32)
        # Magnitudes (and powers) are written into buffers reused by every block: a fresh array per
        # block costs more than the arithmetic. Analysing needs every bin's, the mel only its filters'.
        magnitudes = np.empty((block_rows, cfg.n_fft // 2 + 1 if weights is not None else high - low), np.float32)
        power = np.empty_like(magnitudes) if weights is not None else None
        for start in range(0, frames.shape[0], _NUMPY_BLOCK_ROWS):  # blocks that stay in cache
            rows = frames[start:start + _NUMPY_BLOCK_ROWS]
            b, end = rows.shape[0], start + rows.shape[0]
            block = np.multiply(rows, window, out=buffer[:b])  # [b, n_fft] windowed frames
            spectrum = rfft(block)  # [b, F]
            if power is None:
                magnitude = np.abs(spectrum[:, low:high], out=magnitudes[:b])  # [b, high - low]
                if squared or guarded:
                    np.square(magnitude, out=magnitude)
                if guarded:
                    _guard_in_place(magnitude, cfg)
                    if not squared:
                        np.sqrt(magnitude, out=magnitude)
            else:
                np.abs(spectrum, out=magnitudes[:b])  # [b, F]
                np.matmul(np.square(magnitudes[:b], out=power[:b]), weights, out=powers[start:end])
                if guarded:
                    magnitude = _guard_in_place(power[:b, low:high], cfg)  # the weighted powers are made
                    if not squared:
                        magnitude = np.sqrt(magnitude, out=magnitudes[:b, low:high])
                else:
                    magnitude = (power if squared else magnitudes)[:b, low:high]
            for first, last, bins, weights_g in groups:  # magnitude's columns are the bins from low on
                np.matmul(magnitude[:, bins], weights_g, out=out[start:end, first:last])
        if not analyse:
            _log_in_place(out, cfg)
        return [(out[row:row + count], None if powers is None else powers[row:row + count])
                for row, count in zip(first_rows, frame_counts)]

    # -- TensorFlow backend

    def _call_tf(self, clips: Sequence[np.ndarray], analyse: bool) -> list[tuple[np.ndarray, np.ndarray | None]]:
        if len(clips) == 0:
            return []
        checked = [_as_clip(c, self.cfg, _TF_DTYPE, f"clip {i}") for i, c in enumerate(clips)]
        signal, first_rows, frame_counts = _concatenate_for_framing(checked, self.cfg)
        fn = self._tf_function(analyse)
        with self._device_scope():
            result = fn(signal)  # [R, M], or ([R, M], [R, W] or None) when analysing
        mel, powers = (result[0].numpy(), result[1].numpy() if len(result) > 1 else None) if analyse \
            else (result.numpy(), None)
        return [(mel[row:row + count], None if powers is None else powers[row:row + count])
                for row, count in zip(first_rows, frame_counts)]

    def _device_scope(self) -> contextlib.AbstractContextManager[Any]:
        if self.device is None:
            return contextlib.nullcontext()
        import tensorflow as tf

        return tf.device(self.device)

    def _tf_function(self, analyse: bool = False) -> Callable[[Any], Any]:
        with self._build_lock:
            if analyse not in self._tf_fns:
                self._tf_fns[analyse] = self._build_tf_function(analyse)
            return self._tf_fns[analyse]

    def _build_tf_function(self, analyse: bool) -> Callable[[Any], Any]:
        import tensorflow as tf

        cfg = self.cfg
        window = self._window.astype(_TF_DTYPE)  # [n_fft]
        low, high = _filterbank_support(self._filterbank)
        filterbank = self._filterbank[low:high].astype(_TF_DTYPE)  # [high - low, M]
        weights = self.weights if analyse else None
        squared = cfg.power == 2  # the mel of |X|^2, else of |X|
        guarded, bin_offset, bin_floor = _guarded(cfg), float(cfg.bin_power_offset), float(cfg.bin_power_floor)
        log_offset, log_floor, scale = float(cfg.log_offset), float(cfg.log_floor), log_scale(cfg)
        device_scope = self._device_scope

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
        def concatenated_log_mel(signal: Any) -> Any:
            """[S] concatenated centre-padded clips -> [R, M] log-mel of every frame of S; when
            analysing, ([R, M] mel magnitudes, [R, W] weighted powers) or ([R, M],)."""
            with device_scope():
                frames = tf.signal.frame(signal, cfg.n_fft, cfg.hop_length, pad_end=False)  # [R, n_fft]
                spectrum = tf.signal.rfft(frames * tf.constant(window), fft_length=[cfg.n_fft])  # [R, F]
                if weights is None and not squared and not guarded:
                    magnitude = tf.abs(spectrum[:, low:high])  # [R, high - low]: bins every filter ignores dropped
                else:
                    power = tf.square(tf.math.real(spectrum)) + tf.square(tf.math.imag(spectrum))  # [R, F]
                    used = power[:, low:high]
                    if guarded:
                        used = tf.maximum(used + bin_offset, bin_floor)
                    magnitude = used if squared else tf.sqrt(used)
                mel = tf.linalg.matmul(magnitude, tf.constant(filterbank))  # [R, M]
                if not analyse:
                    if log_offset:
                        mel = mel + log_offset
                    if log_floor:
                        mel = tf.maximum(mel, log_floor)
                    return tf.math.log(mel) if scale == 1.0 else tf.math.log(mel) * scale
                if weights is None:
                    return (mel,)
                return mel, tf.linalg.matmul(power, tf.constant(weights))

        logger.debug("built the %s tf.function (device=%s)", "analysis" if analyse else "log-mel", self.device)
        return concatenated_log_mel


def gpu_visible() -> bool:
    """Whether this process was given a GPU: ``CUDA_VISIBLE_DEVICES`` names one.

    The launcher sets the variable for every child before TensorFlow loads (an empty
    value for the CPU), so this answers without importing TensorFlow.
    """
    value = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return bool(value) and not value.startswith("-")


def resolve_backend(cfg: FeaturesConfig, has_gpu: bool | None = None, framework: str = TENSORFLOW) -> FeaturesConfig:
    """``backend="auto"`` made concrete: "tf" in a process with a GPU, where TensorFlow is
    installed, for a run whose batches go to TensorFlow (``framework``: trainer.framework);
    else "numpy".

    On a GPU the TensorFlow ops run on the data device; on a CPU the numpy backend
    (pocketfft through scipy, single precision, cache-sized blocks) computes the same
    definition about twice as fast as TensorFlow's CPU kernels (whose complex
    magnitude alone costs as much as the FFT) and spares the producer importing
    TensorFlow, as does a run for PyTorch, JAX or numpy, whose environment may have no
    TensorFlow at all. Explicit "tf" or "numpy" are kept.
    """
    if cfg.backend != "auto":
        return cfg
    gpu = gpu_visible() if has_gpu is None else has_gpu
    use_tf = gpu and framework == TENSORFLOW and tensorflow_installed()
    return dataclasses.replace(cfg, backend="tf" if use_tf else "numpy")


def preload() -> None:
    """Import what the numpy backend's first batch would (scipy.fft), ahead of it: a producer
    started before its trainer is bound does this while it waits."""
    _rfft()


@functools.lru_cache(maxsize=1)
def _rfft() -> Callable[[np.ndarray], np.ndarray]:
    """rfft along the last axis, allowed to overwrite its input: scipy.fft when scipy is
    installed (pocketfft in single precision, several times faster than numpy 2's
    float32 rfft), else numpy.fft: the same transform."""
    try:
        import scipy.fft
    except ImportError:
        logger.info("scipy is not installed: the numpy backend uses numpy.fft (slower)")
        return functools.partial(np.fft.rfft, axis=-1)
    return functools.partial(scipy.fft.rfft, axis=-1, overwrite_x=True)


class _FilterGroup(NamedTuple):
    """Bands [first, last) of the filterbank, over the rfft bins ``bins`` (counted from the support's low bin)."""

    first: int
    last: int
    bins: slice
    weights: np.ndarray  # float32 [bins, last - first]


def _filter_groups(filterbank: np.ndarray, low: int, high: int) -> list[_FilterGroup]:
    """The filterbank [F, M] in up to _FILTER_GROUPS groups of consecutive bands, each cut to the
    bins of its support [low, high) its filters reach (all of them for a group of zero filters)."""
    groups = []
    edges = np.linspace(0, filterbank.shape[1], min(_FILTER_GROUPS, filterbank.shape[1]) + 1).astype(int)
    for first, last in zip(edges[:-1].tolist(), edges[1:].tolist()):
        lo, hi = _filterbank_support(filterbank[:, first:last])
        lo, hi = max(lo, low), min(hi, high)
        groups.append(_FilterGroup(first, last, slice(lo - low, hi - low),
                                   np.ascontiguousarray(filterbank[lo:hi, first:last], dtype=np.float32)))
    return groups


def _filterbank_support(filterbank: np.ndarray) -> tuple[int, int]:
    """The rfft bins [low, high) where some filter is non-zero; the others add nothing."""
    used = np.flatnonzero(filterbank.any(axis=1))
    if used.size == 0:
        return 0, filterbank.shape[0]
    return int(used[0]), int(used[-1]) + 1


def _concatenate_for_framing(clips: Sequence[np.ndarray],
                             cfg: FeaturesConfig) -> tuple[np.ndarray, list[int], list[int]]:
    """Lay B clips end to end so that one framing of the whole yields every clip's frames.

    Each clip is padded on its own as step 1 pads it (its edges are reflected, not its
    neighbour's samples; zeros are the signal's own) into a segment whose length is rounded
    up to a multiple of ``hop_length``; segments are concatenated into one signal [S].
    Framing S with ``hop_length`` then puts clip i's frame t at row ``first_rows[i] + t``:
    every frame is computed once, with no padding to the longest clip. Rows that straddle
    two segments (at most ``n_fft / hop_length`` per clip) are computed and ignored.
    Returns (signal [S], first_rows [B], frame_counts [B]).
    """
    hop = cfg.hop_length
    lengths = [c.shape[0] for c in clips]
    counts = [num_frames(n, cfg) for n in lengths]
    pads = [_framing_pads(n, cfg) for n in lengths]
    segment_lengths = [-(-max(before + n + after, (t - 1) * hop + cfg.n_fft) // hop) * hop
                       for n, t, (before, after) in zip(lengths, counts, pads)]
    starts = np.concatenate([[0], np.cumsum(segment_lengths)]).astype(np.int64)
    total = max(int(starts[-1]), cfg.n_fft)
    signal = np.zeros(total, dtype=_TF_DTYPE)
    reflect = _reflected(cfg)
    for clip, n, start, (half, _) in zip(clips, lengths, starts[:-1], pads):
        start = int(start)
        signal[start + half:start + half + n] = clip
        if reflect:
            signal[start:start + half] = clip[half:0:-1]  # reflect: x[half] .. x[1]
            signal[start + half + n:start + 2 * half + n] = clip[n - 2:n - 2 - half:-1] if n - 2 - half >= 0 \
                else clip[n - 2::-1][:half]  # reflect: x[n-2] .. x[n-1-half]
    return signal, [int(s) // hop for s in starts[:-1]], counts


@functools.lru_cache(maxsize=_CACHED_COMPUTERS)
def _cached_computer(cfg: FeaturesConfig) -> MelComputer:
    return MelComputer(cfg)


def log_mel_spectrogram(audio: np.ndarray, cfg: FeaturesConfig = FeaturesConfig()) -> np.ndarray:
    """Log-mel spectrogram of one mono clip: [N] float audio at ``cfg.sample_rate_hz`` -> float32 [T, M].

    The definition is docs/design/features.md, "The feature definition"; ``T = num_frames(N, cfg)``, ``M = n_mels``.
    Where TensorFlow is installed this runs the TensorFlow path (a :class:`MelComputer`,
    cached per config), whatever ``cfg.backend`` says: the code producers run on the data
    device, placed on TensorFlow's default device (a visible GPU, else the CPU); without
    TensorFlow, the numpy backend (the same definition). Raises ValueError for a clip
    that is not 1-D floating point or is shorter than :func:`min_num_samples`.
    """
    backend = "tf" if tensorflow_installed() else "numpy"
    chosen = cfg if cfg.backend == backend else dataclasses.replace(cfg, backend=backend)
    return _cached_computer(chosen)([_as_clip(audio, chosen, _TF_DTYPE)])[0]
