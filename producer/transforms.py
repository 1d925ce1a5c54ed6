"""Producer transforms: what happens to a clip before its log-mel.

In this order, each off by default (``transforms.*``): the trim of the samples
(``trim_margin_s``, ``trim_samples_db``: Coqui TTS's, on loading), the user's transforms
(``transforms.user``), trim (``trim_db``), normalize (peak or loudness) and pre-emphasis. Trim
and loudness are measured on the frames the log-mel is computed from, so the mel of the cut,
scaled clip is its mel cut and scaled (:meth:`Chain.finish`). A clip a transform cannot handle
is rejected with the transform's error; the chain's settings and versions key the feature
cache and the producers' agreement (:func:`chain_key`). docs/design/features.md, "Producer transforms",
has each step's rule.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .features import centered_window, min_num_samples, num_frames
from ..shared.batch import Field
from ..shared.config import TRANSFORMS_REVISION, FeaturesConfig, TransformsConfig, parse_declared_fields
from ..shared.errors import UserError
from ..shared.mel import NO_PADDING, frame_centre, source_version
from ..shared.userfn import import_function

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
# The same gates in block energy (-0.691 + 10 log10(z) is a block's loudness): no log per block.
ABSOLUTE_GATE_Z = 10 ** ((ABSOLUTE_GATE_LUFS + 0.691) / 10)
RELATIVE_GATE_FACTOR = 10 ** (-RELATIVE_GATE_LU / 10)


# The settings added with the trim of the samples: left out of chain_key at their defaults (off),
# so that the feature caches made before them stay valid.
SAMPLE_TRIM_FIELDS = ("trim_margin_s", "trim_samples_db")


class TransformError(Exception):
    """One clip failed a transform; ``str(exc)`` is the rejection reason."""


class TransformSetupError(UserError):
    """The transform chain cannot be set up (a user module missing); one line for the user."""


@dataclass(frozen=True)
class Cut:
    """What steps 2 and 3 do to one clip: keep samples [start, end), which are frames
    [first, first + frames) of its mel, and scale them by ``gain``."""

    start: int
    end: int
    first: int
    frames: int
    gain: float


@functools.lru_cache(maxsize=8)
def _k_weighting(rate_hz: int) -> np.ndarray:
    """BS.1770's K-weighting at ``rate_hz`` as second-order sections: the high shelf (+4 dB
    above 1.5 kHz) and the high pass (38 Hz), designed as pyloudnorm designs them."""
    from pyloudnorm import IIRfilter

    stages = (IIRfilter(4.0, 1 / math.sqrt(2), 1500.0, rate_hz, "high_shelf"),
              IIRfilter(0.0, 0.5, 38.0, rate_hz, "high_pass"))
    return np.array([np.concatenate([s.passband_gain * s.b / s.a[0], s.a / s.a[0]]) for s in stages])


def spectral_weights(features: FeaturesConfig) -> np.ndarray:
    """float64 [F, 2]: the weights ``MelComputer.analyse`` turns a frame's power spectrum
    |X[f]|^2 into (column 0) the energy of its windowed samples (Parseval for an rfft: bins
    other than DC and Nyquist stand for two) and (column 1) that energy K-weighted (the
    filters' power response at each bin's frequency)."""
    from scipy.signal import sosfreqz

    n_fft, rate = features.n_fft, features.sample_rate_hz
    hz = np.fft.rfftfreq(n_fft, 1.0 / rate)
    twice = np.full(len(hz), 2.0)
    twice[0] = 1.0
    if n_fft % 2 == 0:
        twice[-1] = 1.0
    _, response = sosfreqz(_k_weighting(rate), worN=hz, fs=rate)
    return np.stack([twice / n_fft, twice * np.abs(response) ** 2 / n_fft], axis=1)


@functools.lru_cache(maxsize=8)
def _frame_overlap(features: FeaturesConfig) -> float:
    """How many times the frames count a sample on average: sum of the squared window over
    the hop (1.5 for a Hann window of n_fft at hop n_fft / 4, the same at every sample)."""
    return float(np.sum(centered_window(features) ** 2) / features.hop_length)


def trim_bounds(energy: np.ndarray, num_samples: int, top_db: float, features: FeaturesConfig) -> tuple[int, int]:
    """Samples [start, end) that step 2 keeps of a clip whose frames have ``energy`` [T]: from
    the first loud frame's hop to the last one's (centred frames, or frames padded at the end),
    or to the last one's end (frames without padding), so that the samples kept have exactly
    the loud frames (``num_frames``)."""
    peak = float(energy.max()) if len(energy) else 0.0
    if top_db <= 0 or peak <= 0:
        return 0, num_samples
    loud = np.flatnonzero(energy > peak * 10 ** (-top_db / 10))
    hop, first, last = features.hop_length, int(loud[0]), int(loud[-1])
    end = last * hop + features.n_fft if features.padding == NO_PADDING else (last + 1) * hop
    return first * hop, min(num_samples, end)


def frame_loudness(weighted: np.ndarray, num_samples: int, features: FeaturesConfig) -> float:
    """Integrated loudness in LUFS (step 3) of a clip of ``num_samples`` samples whose frames
    (frame t centred on sample t x hop) have the K-weighted energies ``weighted`` [T]; -inf for
    silence. Blocks as BS.1770 lays them (pyloudnorm's count; a last block past the end holds
    what there is); a block's energy is the sum over the frames, frame t standing for the hop
    of samples around its centre, a frame the block's edge cuts counted in proportion, divided
    by how often the frames count a sample (:func:`_frame_overlap`). The gates are compared
    in energy, not in LUFS: the same tests without a logarithm per block."""
    rate = features.sample_rate_hz
    blocks = int(round((num_samples / rate - BLOCK_S) / (BLOCK_S * (1 - BLOCK_OVERLAP)))) + 1
    if blocks <= 0:
        return float("-inf")
    whole, part = _block_edges(blocks, features)  # [2, blocks]: frames before each edge, and the cut one's share
    count = len(weighted)
    running = np.zeros(count + 1)
    np.cumsum(weighted, out=running[1:])
    energy = np.append(weighted, np.float32(0))  # a frame index past the end stands for nothing
    at = np.minimum(whole, count)
    before = running[at] + part * energy[at]
    z = (before[1] - before[0]) / (_frame_overlap(features) * BLOCK_S * rate)
    gated = z[z >= ABSOLUTE_GATE_Z]
    if not len(gated):
        return float("-inf")
    kept = z[(z > gated.mean() * RELATIVE_GATE_FACTOR) & (z > ABSOLUTE_GATE_Z)]
    return -0.691 + 10 * math.log10(kept.mean()) if len(kept) else float("-inf")


@functools.lru_cache(maxsize=1024)
def _block_edges(blocks: int, features: FeaturesConfig) -> tuple[np.ndarray, np.ndarray]:
    """Where the first ``blocks`` BS.1770 blocks start and end on the frame grid: per edge
    (row 0 the starts, row 1 the ends) the number of whole frames before it and the share of
    the frame it cuts. Frame t stands for the hop of samples around its centre c + t x hop
    (c = ``frame_centre``: 0 for centred frames)."""
    rate, hop = features.sample_rate_hz, features.hop_length
    starts = np.arange(blocks) * (BLOCK_S * (1 - BLOCK_OVERLAP) * rate)
    position = np.maximum((np.stack([starts, starts + BLOCK_S * rate]) - frame_centre(features)) / hop + 0.5, 0.0)
    whole = np.floor(position).astype(np.int64)
    return whole, position - whole


def _peak(audio: np.ndarray) -> float:
    return max(float(audio.max()), -float(audio.min())) if len(audio) else 0.0


def peak_gain(peak: float, peak_dbfs: float) -> float:
    """The gain that brings a clip's largest sample ``peak`` to ``peak_dbfs``; 1 for silence."""
    return 1.0 if peak < SILENCE_PEAK else 10 ** (peak_dbfs / 20) / peak


def loudness_gain(peak: float, weighted: np.ndarray, num_samples: int, features: FeaturesConfig,
                  target_lufs: float) -> float:
    """The gain that brings a clip to ``target_lufs`` (step 3), at most the one to 0 dBFS."""
    if num_samples < LOUDNESS_MIN_S * features.sample_rate_hz:
        return peak_gain(peak, target_lufs - SINE_LUFS_OFFSET)
    measured = frame_loudness(weighted, num_samples, features)
    if not math.isfinite(measured) or peak < SILENCE_PEAK:
        return 1.0
    return min(10 ** ((target_lufs - measured) / 20), 1.0 / peak)


def trim_samples(audio: np.ndarray, margin: int, top_db: float, features: FeaturesConfig) -> np.ndarray:
    """Step 0: ``margin`` samples cut off each end, then (``top_db`` > 0) the samples
    ``librosa.effects.trim(audio, top_db=top_db, frame_length=win_length, hop_length=hop_length)``
    keeps: RMS frames of win_length every hop_length, centred with zeros outside the clip, a
    frame loud when its ``10 log10(max(1e-10, mean square))`` exceeds the loudest one's minus
    ``top_db``; kept, the samples from the first loud frame's hop to the last one's end (or to
    the end of the clip). What Coqui TTS's AudioProcessor.trim_silence does on loading."""
    clip = audio[margin:len(audio) - margin]
    if top_db <= 0 or len(clip) == 0:
        return clip
    length, hop = features.win_length, features.hop_length
    squares = np.concatenate([[0.0], np.cumsum(np.square(clip, dtype=np.float64))])  # [N + 1]
    starts = np.arange(1 + len(clip) // hop) * hop - length // 2  # each frame's first sample
    mean_square = (squares[np.clip(starts + length, 0, len(clip))] - squares[np.clip(starts, 0, len(clip))]) / length
    db = 10.0 * np.log10(np.maximum(1e-10, mean_square))
    loud = np.flatnonzero(db - 10.0 * np.log10(max(1e-10, float(mean_square.max()))) > -top_db)
    if loud.size == 0:
        return clip[:0]
    return clip[int(loud[0]) * hop:min(len(clip), (int(loud[-1]) + 1) * hop)]


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
    return str(version) if version else source_version(module.__name__)


def load_user(specs: str) -> list[tuple[str, Callable[..., Any], str]]:
    """(spec, function, module version) of each user transform; TransformSetupError (one line)."""
    out = []
    for spec in (s.strip() for s in specs.split(",") if s.strip()):
        fn, module = import_function(spec, "transforms.user", TransformSetupError)
        out.append((spec, fn, module_version(module)))
    return out


def chain_key(cfg: TransformsConfig, versions: Mapping[str, str]) -> dict[str, Any]:
    """What the mel of a clip depends on besides the features: the settings and each user
    module's version (the feature cache's key and the producers' agreement); not the producer
    models, which run after the mel (their outputs have keys of their own: producer/models.py)."""
    default = TransformsConfig()
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("models", "model_fields")
                and not (k in SAMPLE_TRIM_FIELDS and v == getattr(default, k))}
    return {**settings, "versions": dict(versions), "revision": TRANSFORMS_REVISION}


@dataclass
class Transformed:
    audio: np.ndarray
    fields: dict[str, np.ndarray]  # the declared fields the user transforms returned


@dataclass
class Finished:
    """A clip after steps 2 to 4: its waveform, its log-mel [T, M] and the cut that made them."""

    audio: np.ndarray | None
    mel: np.ndarray
    cut: Cut


class Chain:
    """The transforms of a run (docs/design/features.md, "Producer transforms"): ``chain(audio, ...)`` runs the user's
    transforms on one clip (and pre-emphasis, when nothing is measured); when the chain
    measures (:attr:`measures`: trim or normalize on), :meth:`finish` runs steps 2 to 4 on the
    clips of a batch and makes their log-mels."""

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
        return bool(self.user or self.measures or self.cfg.preemphasis or self.trims_samples)

    @property
    def trims_samples(self) -> bool:
        """Whether step 0 is on: a margin or the samples' silence cut before anything else."""
        return self.cfg.trim_margin_s > 0 or self.cfg.trim_samples_db > 0

    @property
    def measures(self) -> bool:
        """Whether steps 2 or 3 are on: the clip's levels are read from its mel's frames."""
        return self.cfg.trim_db > 0 or self.cfg.normalize != "off"

    @property
    def weights(self) -> np.ndarray | None:
        """The spectral weights a MelComputer needs for :meth:`finish` (None: not measuring)."""
        return spectral_weights(self.features) if self.measures else None

    def __call__(self, audio: np.ndarray, text: str, sample_id: str, speaker: int, language: int,
                 metadata: Mapping[str, Any]) -> Transformed:
        """The clip after the user's transforms (and pre-emphasis when the chain does not
        measure: else :meth:`finish` does it); TransformError (the rejection reason) when one fails."""
        rate = self.features.sample_rate_hz
        if self.trims_samples:
            audio = trim_samples(audio, int(rate * self.cfg.trim_margin_s), self.cfg.trim_samples_db, self.features)
            if len(audio) < min_num_samples(self.features):
                raise TransformError(f"{len(audio)} samples are left after trimming the silence (trim_margin_s, "
                                     f"trim_samples_db); the log-mel needs at least {min_num_samples(self.features)}")
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
                audio = self._waveform(spec, result, min_num_samples(self.features))
        missing = sorted(set(self.declared) - set(fields))
        if missing:
            raise TransformError(f"no transform returned the declared field(s) {missing}")
        if not self.measures:
            audio = preemphasize(audio, self.cfg.preemphasis)
        return Transformed(audio, fields)

    def cut(self, audio: np.ndarray, powers: np.ndarray) -> Cut:
        """Steps 2 and 3 for one clip [N] whose frames have the weighted powers [T, 2] of
        :func:`spectral_weights` (``MelComputer.analyse``)."""
        c, hop = self.cfg, self.features.hop_length
        start, end = trim_bounds(powers[:, 0], len(audio), c.trim_db, self.features)
        first, frames = start // hop, num_frames(end - start, self.features)
        gain = 1.0
        if c.normalize == "peak":
            gain = peak_gain(_peak(audio[start:end]), c.peak_dbfs)
        elif c.normalize == "loudness":
            gain = loudness_gain(_peak(audio[start:end]), powers[first:first + frames, 1], end - start,
                                 self.features, c.loudness_lufs)
        return Cut(start, end, first, frames, gain)

    def finish(self, clips: Sequence[np.ndarray], mels: Any, keep_audio: bool = True) -> list[Finished]:
        """Steps 2 to 4 and the log-mel of each clip (after :meth:`__call__`), with ``mels`` a
        producer.features.MelComputer made with :attr:`weights`: one analysis of the clips,
        a second of the emphasised clips only when pre-emphasis is on. Without ``keep_audio``
        the waveforms are not cut and scaled (Finished.audio is None): only the mels are needed."""
        analysed = mels.analyse(clips)
        cuts = [self.cut(clip, powers) for clip, (_, powers) in zip(clips, analysed)]
        a = self.cfg.preemphasis
        emphasised = [preemphasize(clip, a) for clip in clips] if a else list(clips)
        linear = [mel for mel, _ in mels.analyse(emphasised)] if a else [mel for mel, _ in analysed]
        done = []
        for clip, mel, cut in zip(emphasised, linear, cuts):
            gain = np.float32(cut.gain)
            kept = mel[cut.first:cut.first + cut.frames]  # a view of the analysis, ours to overwrite
            np.multiply(kept, gain ** np.float32(self.features.power), out=kept)  # the mel of |X|^power
            audio = np.multiply(clip[cut.start:cut.end], gain, dtype=np.float32) if keep_audio else None
            done.append(Finished(audio, mels.log_in_place(kept), cut))
        return done

    def cut_fields(self, fields: Mapping[str, np.ndarray], cut: Cut) -> dict[str, np.ndarray]:
        """The declared fields of a clip with their T dimension cut as its mel is."""
        out = dict(fields)
        for name, field in self.declared.items():
            if name in out and "T" in field.dims[1:]:
                axis = field.dims[1:].index("T")
                out[name] = np.take(np.asarray(out[name]), np.arange(cut.first, cut.first + cut.frames), axis=axis)
        return out

    @staticmethod
    def _waveform(spec: str, value: Any, shortest: int) -> np.ndarray:
        array = np.asarray(value)
        if array.ndim != 1 or array.dtype != np.float32 or len(array) < shortest:
            raise TransformError(f"transform {spec} returned a waveform of {array.dtype} {list(array.shape)}; "
                                 f"expected float32 [N], N >= {shortest} (the framing's shortest clip)")
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
