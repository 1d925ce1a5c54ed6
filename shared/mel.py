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
# Hex digits of a module source's SHA-256 that name the user's mel function's version.
VERSION_HEX = 12
# The settings added after the first definition: at today's values (the defaults) they are left
# out of features_key, so that the feature caches and mel statistics made before stay valid.
CONVENTION_FIELDS = ("mel_scale", "filter_norm", "padding", "power", "log", "log_offset", "top_db", "user")
# Seconds of digital silence the user's mel function is given to learn the padding value.
SILENCE_PROBE_S = 0.5


class MelFunctionError(UserError):
    """features.user cannot be used (its module does not import, or it has no such function)."""


def centred(features: FeaturesConfig) -> bool:
    """Whether frame t is centred on sample t x hop_length (else it starts there)."""
    return features.padding in CENTRED_PADDINGS


def num_frames(num_samples: int, features: FeaturesConfig) -> int:
    """Frame count T of a clip of ``num_samples`` samples under ``features.padding``:
    centred, ``1 + (N + 2 (n_fft // 2) - n_fft) // hop`` (``1 + N // hop`` for an even n_fft);
    ``end``, ``ceil(N / hop)`` (tf.signal.frame's pad_end); ``none``, ``1 + (N - n_fft) // hop``
    (0 when N < n_fft)."""
    n, hop = int(num_samples), features.hop_length
    if features.padding == PAD_END:
        return -(-n // hop)
    padded = n + 2 * (features.n_fft // 2) if centred(features) else n
    if padded < features.n_fft:
        return 0
    return 1 + (padded - features.n_fft) // hop


def num_frames_of(num_samples: np.ndarray, features: FeaturesConfig) -> np.ndarray:
    """:func:`num_frames` of many clips at once (an integer array in, int64 frame counts out)."""
    n, hop = np.asarray(num_samples, np.int64), features.hop_length
    if features.padding == PAD_END:
        return -(-n // hop)
    padded = n + 2 * (features.n_fft // 2) if centred(features) else n
    return np.where(padded < features.n_fft, 0, 1 + (padded - features.n_fft) // hop)


def min_num_samples(features: FeaturesConfig) -> int:
    """The shortest clip the framing accepts: ``n_fft // 2 + 1`` for reflect padding (a
    reflection needs that many), ``n_fft`` without padding (one whole frame), else 1."""
    if features.padding == "reflect":
        return features.n_fft // 2 + 1
    return features.n_fft if features.padding == NO_PADDING else 1


def frame_centre(features: FeaturesConfig) -> int:
    """The sample frame 0 is centred on (frame t: this + t x hop_length)."""
    return 0 if centred(features) else features.n_fft // 2


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
    (every value of a silent clip, which top_db leaves as it is), or for a user's function the
    lowest value it gives :data:`SILENCE_PROBE_S` of zeros."""
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
    return log_scale(features) * math.log(max(features.log_offset, features.log_floor))


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
    defaults) and, with ``features.user``, the version of the function's module."""
    default = FeaturesConfig()
    key = {k: v for k, v in dataclasses.asdict(features).items()
           if k != "backend" and not (k in CONVENTION_FIELDS and v == getattr(default, k))}
    if features.user:
        key["user_version"] = user_mel_function(features.user)[1]
    return key


def pad_values(schema: BatchSchema, features: FeaturesConfig, mel_norm: str) -> dict[str, float]:
    """Each field's padding value as a number, the mel's (MEL_PAD) that of silence under the
    run's ``features`` and ``transforms.mel_norm``."""
    mel = mel_pad_value(features, mel_norm)
    return {f.name: mel if f.pad == MEL_PAD else float(f.pad) for f in schema.fields}
