"""What every process knows of the mel convention without computing a mel (``features:``).

The framing (how many frames a clip of N samples has, and the shortest clip it accepts), the
value of digital silence under the configured log (what padded frames take), the user's mel
function (``features.user``) and the key of everything a mel depends on. The index plans
from :func:`num_frames`, producers pad with :func:`mel_pad_value`, and the feature cache and
the mel statistics are keyed by :func:`features_key`; producer/features.py computes the
mels themselves (its docstring has the definition).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import logging
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .batch import MEL_PAD, BatchSchema
from .config import FeaturesConfig
from .errors import UserError
from .userfn import import_function

# features.padding: centred frames (the clip padded by n_fft // 2 on both sides, reflected or
# with zeros), or frames from sample 0 with zeros after the end, or only the frames that fit.
CENTRED_PADDINGS = ("reflect", "constant")
PAD_END = "end"
NO_PADDING = "none"
# HiFi-GAN's: the clip reflected by (n_fft - hop_length) // 2 on both sides, only whole frames.
REFLECT_OVERLAP = "reflect_overlap"
# Hex digits of a module source's SHA-256 that name the user's mel function's version.
VERSION_HEX = 12
# The settings added after the first definition: at today's values (the defaults) they are left
# out of features_key, so that the feature caches and mel statistics made before stay valid.
CONVENTION_FIELDS = ("mel_scale", "filter_norm", "padding", "power", "log", "log_offset", "top_db", "user",
                     "window", "bin_power_offset", "bin_power_floor", "db_norm", "db_ref_level", "db_min_level",
                     "db_max_abs")
# Not part of what a mel depends on: the backend computes the same definition, and a convention's
# name only fills in the settings, which are keyed themselves.
UNKEYED_FIELDS = ("backend", "convention")
# Seconds of digital silence the user's mel function is given to learn the padding value.
SILENCE_PROBE_S = 0.5

# Slaney's mel scale (Auditory Toolbox, and librosa with htk=False).
_SLANEY_F_SP_HZ = 200.0 / 3.0  # Hz per mel in the linear part
_SLANEY_MIN_LOG_HZ = 1000.0  # where the scale switches from linear to logarithmic
_SLANEY_MIN_LOG_MEL = _SLANEY_MIN_LOG_HZ / _SLANEY_F_SP_HZ  # = 15 mel at 1 kHz
_SLANEY_LOGSTEP = math.log(6.4) / 27.0  # 27 mel per factor 6.4 above 1 kHz
# The HTK mel scale (librosa with htk=True, tf.signal): mel = 2595 log10(1 + f / 700 Hz).
_HTK_MEL_FACTOR = 2595.0
_HTK_BREAK_HZ = 700.0

logger = logging.getLogger(__name__)


class MelFunctionError(UserError):
    """features.user cannot be used (its module does not import, or it has no such function)."""


def hz_to_mel(hz: np.ndarray, scale: str = "slaney") -> np.ndarray:
    """Slaney (or, for any other ``scale``, HTK) mel of frequencies ``hz`` (any shape, float64)."""
    hz = np.asarray(hz, dtype=np.float64)
    if scale != "slaney":
        return _HTK_MEL_FACTOR * np.log10(1.0 + hz / _HTK_BREAK_HZ)
    mel = hz / _SLANEY_F_SP_HZ
    log_part = hz >= _SLANEY_MIN_LOG_HZ
    mel = np.where(
        log_part,
        _SLANEY_MIN_LOG_MEL + np.log(np.maximum(hz, _SLANEY_MIN_LOG_HZ) / _SLANEY_MIN_LOG_HZ) / _SLANEY_LOGSTEP,
        mel,
    )
    return mel


def mel_to_hz(mel: np.ndarray, scale: str = "slaney") -> np.ndarray:
    """Inverse of :func:`hz_to_mel` (any shape, float64)."""
    mel = np.asarray(mel, dtype=np.float64)
    if scale != "slaney":
        return _HTK_BREAK_HZ * (10.0 ** (mel / _HTK_MEL_FACTOR) - 1.0)
    hz = _SLANEY_F_SP_HZ * mel
    log_part = mel >= _SLANEY_MIN_LOG_MEL
    return np.where(
        log_part,
        _SLANEY_MIN_LOG_HZ * np.exp(_SLANEY_LOGSTEP * (np.maximum(mel, _SLANEY_MIN_LOG_MEL) - _SLANEY_MIN_LOG_MEL)),
        hz,
    )


def filterbank_weights(cfg: FeaturesConfig) -> np.ndarray:
    """producer/features.py ``mel_filterbank``'s triangles, float64 [F, M], unchecked."""
    fft_hz = np.fft.rfftfreq(cfg.n_fft, d=1.0 / cfg.sample_rate_hz)  # [F]
    scale = cfg.mel_scale
    mel_edges = np.linspace(hz_to_mel(cfg.fmin_hz, scale), hz_to_mel(cfg.fmax_hz, scale), cfg.n_mels + 2)
    edges_hz = mel_to_hz(mel_edges, scale)  # [M + 2]
    # The triangles are linear in Hz (librosa), or in mel for tf.signal's filters.
    edges, points = (mel_edges, hz_to_mel(fft_hz, scale)) if scale == "tf" else (edges_hz, fft_hz)
    widths = np.diff(edges)  # [M + 1]
    ramps = edges[:, None] - points[None, :]  # [M + 2, F]
    lower = -ramps[:-2] / widths[:-1, None]  # rising edge, [M, F]
    upper = ramps[2:] / widths[1:, None]  # falling edge, [M, F]
    weights = np.maximum(0.0, np.minimum(lower, upper))  # [M, F]
    if cfg.filter_norm == "slaney":
        weights *= (2.0 / (edges_hz[2:] - edges_hz[:-2]))[:, None]  # Slaney area normalisation
    empty = np.flatnonzero(weights.max(axis=1) <= 0.0)
    if empty.size:
        logger.warning("mel filterbank: %d of %d filters cover no FFT bin (channels %s); "
                       "use fewer n_mels or a larger n_fft", empty.size, cfg.n_mels, empty.tolist()[:10])
    return np.ascontiguousarray(weights.T)


def centred(features: FeaturesConfig) -> bool:
    """Whether frame t is centred on sample t x hop_length (else it starts there)."""
    return features.padding in CENTRED_PADDINGS


def side_pad(features: FeaturesConfig) -> int:
    """Samples framing adds on each side of a clip before its first frame: n_fft // 2 when
    centred, (n_fft - hop_length) // 2 for ``reflect_overlap``, else 0 (``end`` pads after only)."""
    if centred(features):
        return features.n_fft // 2
    return (features.n_fft - features.hop_length) // 2 if features.padding == REFLECT_OVERLAP else 0


def num_frames(num_samples: int, features: FeaturesConfig) -> int:
    """Frame count T of a clip of ``num_samples`` samples under ``features.padding``:
    centred, ``1 + (N + 2 (n_fft // 2) - n_fft) // hop`` (``1 + N // hop`` for an even n_fft);
    ``end``, ``ceil(N / hop)`` (tf.signal.frame's pad_end); ``none``, ``1 + (N - n_fft) // hop``
    (0 when N < n_fft); ``reflect_overlap``, ``1 + (N + 2 side_pad - n_fft) // hop``
    (``N // hop`` when n_fft - hop is even)."""
    n, hop = int(num_samples), features.hop_length
    if features.padding == PAD_END:
        return -(-n // hop)
    padded = n + 2 * side_pad(features)
    if padded < features.n_fft:
        return 0
    return 1 + (padded - features.n_fft) // hop


def num_frames_of(num_samples: np.ndarray, features: FeaturesConfig) -> np.ndarray:
    """:func:`num_frames` of many clips at once (an integer array in, int64 frame counts out)."""
    n, hop = np.asarray(num_samples, np.int64), features.hop_length
    if features.padding == PAD_END:
        return -(-n // hop)
    padded = n + 2 * side_pad(features)
    return np.where(padded < features.n_fft, 0, 1 + (padded - features.n_fft) // hop)


def min_num_samples(features: FeaturesConfig) -> int:
    """The shortest clip the framing accepts: ``n_fft // 2 + 1`` for reflect padding (a
    reflection needs that many), ``n_fft`` without padding (one whole frame), for
    ``reflect_overlap`` enough for both (its pad + 1, and one whole frame), else 1."""
    if features.padding == "reflect":
        return features.n_fft // 2 + 1
    if features.padding == REFLECT_OVERLAP:
        pad = side_pad(features)
        return max(pad + 1, features.n_fft - 2 * pad)
    return features.n_fft if features.padding == NO_PADDING else 1


def frame_centre(features: FeaturesConfig) -> int:
    """The sample frame 0 is centred on (frame t: this + t x hop_length)."""
    return features.n_fft // 2 - side_pad(features)


def log_scale(features: FeaturesConfig) -> float:
    """The factor of the natural log that ``features.log`` is: 1 (ln), 1 / ln 10 (log10), or
    (20 / power) / ln 10 (dB: 10 log10 of a power, 20 log10 of a magnitude)."""
    if features.log == "ln":
        return 1.0
    if features.log == "log10":
        return 1.0 / math.log(10.0)
    return 20.0 / features.power / math.log(10.0)


def silence_value(features: FeaturesConfig) -> float:
    """The log-mel of digital silence: ``log(max(log_offset, log_floor))`` in the configured log
    (every value of a silent clip, which top_db leaves as it is); under a bin power guard
    (``bin_power_offset``, ``bin_power_floor``), where silence is each channel's filter sum
    times the guarded bins, its lowest channel's; for a user's function the lowest value it
    gives :data:`SILENCE_PROBE_S` of zeros. Then ``db_norm``."""
    if features.user:
        fn, _ = user_mel_function(features.user)
        try:
            mel = np.asarray(fn(np.zeros(int(SILENCE_PROBE_S * features.sample_rate_hz), np.float32),
                                features.sample_rate_hz), np.float64)
        except Exception as exc:  # the user's function: what it raised, in one line
            raise MelFunctionError(f"features.user {features.user} fails on digital silence (whose mel pads): "
                                   f"{type(exc).__name__}: {exc}") from None
        finite = mel[np.isfinite(mel)]
        if not finite.size:
            raise MelFunctionError(f"features.user {features.user} gives no finite value for digital silence, "
                                   f"which padded frames take")
        return float(finite.min())
    guard = max(features.bin_power_offset, features.bin_power_floor) ** (features.power / 2.0)
    lowest = guard * float(filterbank_weights(features).sum(axis=0).min()) if guard else 0.0
    value = log_scale(features) * math.log(max(lowest + features.log_offset, features.log_floor))
    return float(db_normalised(value, features))


def db_normalised(values: Any, features: FeaturesConfig) -> Any:
    """``features.db_norm`` on log-mel values in dB (a number or an array, returned anew):
    symmetric, ``clip(2 m (v - ref - min) / -min - m, -m, m)`` with ref = db_ref_level, min =
    db_min_level, m = db_max_abs (Coqui TTS's AudioProcessor.normalize); off, as they are."""
    if features.db_norm == "off":
        return values
    m, low = features.db_max_abs, features.db_min_level
    return np.clip((values - features.db_ref_level - low) * (2.0 * m / -low) - m, -m, m)


def mel_pad_value(features: FeaturesConfig, mel_norm: str) -> float:
    """What padded mel frames hold: the value of silence (:func:`silence_value`), or 0 when each
    clip is scaled to [0, 1] (``transforms.mel_norm: clip_minmax``, where silence is the 0 of a
    clip that has any). Under ``dataset`` normalisation the padding keeps silence's value."""
    return 0.0 if mel_norm == "clip_minmax" else silence_value(features)


@functools.lru_cache(maxsize=8)
def user_mel_function(spec: str) -> tuple[Callable[..., Any], str]:
    """(function, version) of ``package.module:function``: the version is the first hex digits of
    the SHA-256 of the module's source, so an edited function keys new cache entries.
    MelFunctionError (one line) when the module does not import or lacks the function."""
    fn, module = import_function(spec, "features.user", MelFunctionError)
    return fn, source_version(module.__name__)


def source_version(module_name: str) -> str:
    """``sha256:`` and the first :data:`VERSION_HEX` hex digits of the SHA-256 of an imported
    module's source file ("unknown" for a module without one)."""
    origin = getattr(importlib.util.find_spec(module_name), "origin", None)
    if not origin or not Path(origin).is_file():
        return "unknown"
    return "sha256:" + hashlib.sha256(Path(origin).read_bytes()).hexdigest()[:VERSION_HEX]


def features_key(features: FeaturesConfig) -> dict[str, Any]:
    """Everything a clip's mel depends on: every features setting but ``backend`` (both compute
    the same definition; the :data:`CONVENTION_FIELDS` only where they differ from their
    defaults; not ``convention``, which only fills them in) and, with ``features.user``, the
    version of the function's module."""
    default = FeaturesConfig()
    key = {k: v for k, v in dataclasses.asdict(features).items()
           if k not in UNKEYED_FIELDS and not (k in CONVENTION_FIELDS and v == getattr(default, k))}
    if features.user:
        key["user_version"] = user_mel_function(features.user)[1]
    return key


def pad_values(schema: BatchSchema, features: FeaturesConfig, mel_norm: str) -> dict[str, float]:
    """Each field's padding value as a number, the mel's (MEL_PAD) that of silence under the
    run's ``features`` and ``transforms.mel_norm``."""
    mel = mel_pad_value(features, mel_norm)
    return {f.name: mel if f.pad == MEL_PAD else float(f.pad) for f in schema.fields}
