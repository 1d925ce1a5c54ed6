"""Producer transforms: what happens to a clip's waveform before its log-mel.

In this order, each off by default (``transforms.*`` in the config):

1. **the user's transforms** (``transforms.user``: ``package.module:function``, comma-separated),
   each called as ``fn(audio=float32 [N], sample_rate_hz=int, text=str, sample_id=str,
   speaker=int, language=int, metadata=dict)``. It returns None (nothing changed), a float32
   1-D array (a changed waveform), or a dict that may hold ``"audio"`` (a changed waveform)
   and the arrays of the batch fields the run declares in ``transforms.fields`` (for example
   durations [L], pitch and energy [T]; each checked against its declaration).
2. **trim** (``trim_db``): leading and trailing frames whose RMS is more than ``trim_db``
   below the clip's loudest frame are cut (librosa.effects.trim's rule, on the mel's frames:
   frame t of ``n_fft`` samples centred on sample t x hop, zero-padded at the edges; the clip
   keeps samples [first loud frame x hop, (last loud frame + 1) x hop)).
3. **normalize**: ``peak`` scales the clip so that its largest sample is ``peak_dbfs``;
   ``loudness`` so that its integrated loudness (ITU-R BS.1770-4, K-weighted and gated, with
   pyloudnorm) is ``loudness_lufs``, then limits the peak to 0 dBFS. Silence stays silence.
4. **pre-emphasis** (``preemphasis`` a): y[n] = x[n] - a x[n-1], y[0] = x[0].

A clip a transform cannot handle (a user transform that raises or returns the wrong dtype or
shape) is rejected with the transform's error; the producer goes on. The whole chain (these
settings and each user module's version: its ``__version__``, else a hash of its source) is
part of the producers' agreement with the trainer and of the feature cache's key
(:func:`chain_key`), so a changed chain never serves stale mels.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from stoker.shared.batch import Field
from stoker.shared.config import FeaturesConfig, TransformsConfig, parse_declared_fields
from stoker.shared.errors import UserError

# A clip whose largest sample is below this is silent: no gain can be computed for it.
SILENCE_PEAK = 1e-8
# BS.1770 measures loudness over 400 ms blocks: a shorter clip has no integrated loudness and
# is normalised by its peak instead (to loudness_lufs + this, the level of a full-scale sine).
LOUDNESS_MIN_S = 0.4
SINE_LUFS_OFFSET = -3.01
# ITU-R BS.1770-4's gating: 400 ms blocks overlapping by 75%, an absolute gate and a relative one.
BLOCK_S = 0.4
BLOCK_OVERLAP = 0.75
ABSOLUTE_GATE_LUFS = -70.0
RELATIVE_GATE_LU = 10.0
# Hex digits of a module source's SHA-256 that name its version when it has no __version__.
VERSION_HEX = 12


class TransformError(Exception):
    """One clip failed a transform; ``str(exc)`` is the rejection reason."""


class TransformSetupError(UserError):
    """The transform chain cannot be set up (a user module missing); one line for the user."""


def trim_silence(audio: np.ndarray, top_db: float, features: FeaturesConfig) -> np.ndarray:
    """The clip without its leading and trailing silence (module docstring, step 2)."""
    if top_db <= 0 or len(audio) == 0:
        return audio
    n_fft, hop = features.n_fft, features.hop_length
    rms = np.sqrt(_window_sums(np.square(np.pad(audio, n_fft // 2)), n_fft, hop) / n_fft)
    peak = rms.max()
    if peak <= 0:
        return audio
    loud = np.flatnonzero(20 * np.log10(np.maximum(rms, 1e-20) / peak) > -top_db)
    start, end = int(loud[0]) * hop, min(len(audio), (int(loud[-1]) + 1) * hop)
    return audio[start:end]


def _window_sums(squares: np.ndarray, width: int, step: int) -> np.ndarray:
    """Sums of ``squares`` over the windows of ``width`` samples starting every ``step`` (the
    last one that fits entirely), in float64. When the width is a multiple of the step, from
    sums per step (one pass, no long cumulative sum); else from a cumulative sum."""
    count = (len(squares) - width) // step + 1
    if count <= 0:
        return np.zeros(0)
    if width % step == 0:
        k = width // step
        chunks = squares[:(count + k - 1) * step].reshape(-1, step).sum(axis=1, dtype=np.float64)
        running = np.concatenate([[0.0], np.cumsum(chunks)])
        return running[k:k + count] - running[:count]
    running = np.concatenate([[0.0], np.cumsum(squares, dtype=np.float64)])
    starts = np.arange(count) * step
    return running[starts + width] - running[starts]


def peak_normalize(audio: np.ndarray, peak_dbfs: float) -> np.ndarray:
    peak = float(np.max(np.abs(audio))) if len(audio) else 0.0
    if peak < SILENCE_PEAK:
        return audio
    return (audio * (10 ** (peak_dbfs / 20) / peak)).astype(np.float32)


@functools.lru_cache(maxsize=8)
def _k_weighting(rate_hz: int) -> np.ndarray:
    """BS.1770's K-weighting at ``rate_hz`` as second-order sections: the high shelf (+4 dB
    above 1.5 kHz) and the high pass (38 Hz), designed as pyloudnorm designs them."""
    from pyloudnorm import IIRfilter

    stages = (IIRfilter(4.0, 1 / math.sqrt(2), 1500.0, rate_hz, "high_shelf"),
              IIRfilter(0.0, 0.5, 38.0, rate_hz, "high_pass"))
    return np.array([np.concatenate([s.passband_gain * s.b / s.a[0], s.a / s.a[0]]) for s in stages])


def loudness(audio: np.ndarray, rate_hz: int) -> float:
    """Integrated loudness in LUFS (ITU-R BS.1770-4: K-weighting, 400 ms blocks overlapping by
    75%, the absolute gate at -70 LUFS and the relative gate 10 LU below); -inf for silence.
    pyloudnorm's Meter computes the same, block by block in Python; this is it vectorised."""
    from scipy.signal import sosfilt

    # Filtered in float32 (the clip's own precision): the loudness differs from float64's by
    # under 1e-5 LU, and the filter pass is the measurement's main cost.
    weighted = sosfilt(_k_weighting(rate_hz).astype(np.float32), audio.astype(np.float32, copy=False))
    block = BLOCK_S * rate_hz
    blocks = int(round((len(audio) / rate_hz - BLOCK_S) / (BLOCK_S * (1 - BLOCK_OVERLAP)))) + 1
    step = BLOCK_S * (1 - BLOCK_OVERLAP) * rate_hz
    if float(step).is_integer() and float(block).is_integer():
        # A last block that runs past the end sums what there is (pyloudnorm's slice): zeros beyond.
        squares = np.square(weighted, dtype=np.float64)
        short = (blocks - 1) * int(step) + int(block) - len(squares)
        if short > 0:
            squares = np.concatenate([squares, np.zeros(short)])
        z = _window_sums(squares, int(block), int(step))[:blocks] / block
    else:  # block bounds as BS.1770 rounds them at this rate
        steps = np.arange(blocks) * (1 - BLOCK_OVERLAP)
        lower, upper = (BLOCK_S * steps * rate_hz).astype(int), (BLOCK_S * (steps + 1) * rate_hz).astype(int)
        squares = np.concatenate([[0.0], np.cumsum(np.square(weighted, dtype=np.float64))])
        z = (squares[np.minimum(upper, len(weighted))] - squares[np.minimum(lower, len(weighted))]) / block
    with np.errstate(divide="ignore"):
        level = -0.691 + 10 * np.log10(z)
        gated = z[level >= ABSOLUTE_GATE_LUFS]
        if not len(gated):
            return float("-inf")
        relative = -0.691 + 10 * np.log10(gated.mean()) - RELATIVE_GATE_LU
        kept = z[(level > relative) & (level > ABSOLUTE_GATE_LUFS)]
        return float(-0.691 + 10 * np.log10(kept.mean())) if len(kept) else float("-inf")


def loudness_normalize(audio: np.ndarray, rate_hz: int, target_lufs: float) -> np.ndarray:
    if len(audio) < LOUDNESS_MIN_S * rate_hz:
        return peak_normalize(audio, target_lufs - SINE_LUFS_OFFSET)
    measured = loudness(audio, rate_hz)
    if not math.isfinite(measured):
        return audio
    out = audio * (10 ** ((target_lufs - measured) / 20))
    peak = float(np.max(np.abs(out)))
    if peak > 1.0:  # no clipping: a loud target for a peaky clip is met as far as 0 dBFS allows
        out = out / peak
    return out.astype(np.float32)


def preemphasize(audio: np.ndarray, coefficient: float) -> np.ndarray:
    if coefficient == 0 or len(audio) == 0:
        return audio
    out = np.empty_like(audio)
    out[0] = audio[0]
    out[1:] = audio[1:] - coefficient * audio[:-1]
    return out


def module_version(module: Any) -> str:
    """A module's ``__version__``, else the first hex digits of its source's SHA-256."""
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    origin = getattr(importlib.util.find_spec(module.__name__), "origin", None)
    if not origin:
        return "unknown"
    with open(origin, "rb") as f:
        return "sha256:" + hashlib.sha256(f.read()).hexdigest()[:VERSION_HEX]


def load_user(specs: str) -> list[tuple[str, Callable[..., Any], str]]:
    """(spec, function, module version) of each user transform; TransformSetupError (one line)."""
    out = []
    for spec in (s.strip() for s in specs.split(",") if s.strip()):
        module_name, _, function = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # the user's module: what it raised on import, in one line
            raise TransformSetupError(f"transforms.user {spec}: cannot import {module_name}: {type(exc).__name__}: "
                                      f"{exc} (is it on PYTHONPATH?)") from exc
        fn = getattr(module, function, None)
        if not callable(fn):
            raise TransformSetupError(f"transforms.user {spec}: {module_name} has no function {function}")
        out.append((spec, fn, module_version(module)))
    return out


def chain_key(cfg: TransformsConfig, versions: Mapping[str, str]) -> dict[str, Any]:
    """What the mel of a clip depends on besides the features: the settings and each user
    module's version (the feature cache's key and the producers' agreement)."""
    return {**dataclasses.asdict(cfg), "versions": dict(versions)}


@dataclass
class Transformed:
    audio: np.ndarray
    fields: dict[str, np.ndarray]  # the declared fields the user transforms returned


class Chain:
    """The transforms of a run, applied to one clip at a time (module docstring)."""

    def __init__(self, cfg: TransformsConfig, features: FeaturesConfig) -> None:
        self.cfg = cfg
        self.features = features
        self.user = load_user(cfg.user)
        self.declared: dict[str, Field] = {f.name: f for f in parse_declared_fields(cfg.fields)}
        self.versions = {spec: version for spec, _, version in self.user}

    @property
    def key(self) -> dict[str, Any]:
        return chain_key(self.cfg, self.versions)

    @property
    def active(self) -> bool:
        c = self.cfg
        return bool(self.user or c.trim_db > 0 or c.normalize != "off" or c.preemphasis)

    def __call__(self, audio: np.ndarray, text: str, sample_id: str, speaker: int, language: int,
                 metadata: Mapping[str, Any]) -> Transformed:
        """The clip transformed; TransformError (the rejection reason) when a step fails."""
        c, rate = self.cfg, self.features.sample_rate_hz
        fields: dict[str, np.ndarray] = {}
        for spec, fn, _ in self.user:
            try:
                result = fn(audio=audio, sample_rate_hz=rate, text=text, sample_id=sample_id, speaker=speaker,
                            language=language, metadata=dict(metadata))
            except Exception as exc:  # the user's transform: its error is the clip's rejection reason
                raise TransformError(f"transform {spec}: {type(exc).__name__}: {exc}") from None
            if isinstance(result, dict):
                unknown = sorted(set(result) - {"audio", *self.declared})
                if unknown:
                    raise TransformError(f"transform {spec} returned {unknown}, which transforms.fields does not "
                                         f"declare ({', '.join(self.declared) or 'none declared'})")
                fields.update({k: v for k, v in result.items() if k != "audio"})
                result = result.get("audio")
            if result is not None:
                audio = self._waveform(spec, result)
        if c.trim_db > 0:
            audio = trim_silence(audio, c.trim_db, self.features)
        if c.normalize == "peak":
            audio = peak_normalize(audio, c.peak_dbfs)
        elif c.normalize == "loudness":
            audio = loudness_normalize(audio, rate, c.loudness_lufs)
        audio = preemphasize(audio, c.preemphasis)
        missing = sorted(set(self.declared) - set(fields))
        if missing:
            raise TransformError(f"no transform returned the declared field(s) {missing}")
        return Transformed(audio, fields)

    @staticmethod
    def _waveform(spec: str, value: Any) -> np.ndarray:
        array = np.asarray(value)
        if array.ndim != 1 or array.dtype != np.float32 or not len(array):
            raise TransformError(f"transform {spec} returned a waveform of {array.dtype} {list(array.shape)}; "
                                 f"expected float32 [N], N > 0")
        if not np.all(np.isfinite(array)):
            raise TransformError(f"transform {spec} returned a waveform with NaN or inf")
        return array

    def check_fields(self, fields: Mapping[str, np.ndarray], tokens: int, frames: int) -> None:
        """Each declared field's dtype and shape for a clip of ``tokens`` tokens and ``frames``
        frames (L and T of the clip, F of the features); TransformError when one is off."""
        sizes = {"L": tokens, "T": frames, "F": self.features.n_mels}
        for name, field in self.declared.items():
            value = np.asarray(fields[name])
            want = tuple(sizes.get(d, -1) for d in field.dims[1:])
            if value.dtype.name != field.dtype or value.shape != want:
                raise TransformError(f"transform field {name} is {value.dtype.name} {list(value.shape)}; declared "
                                     f"{field.dtype} [{', '.join(field.dims[1:])}] = {list(want)} for this clip")
