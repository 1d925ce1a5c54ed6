"""Reading one clip: any format libsndfile reads, downmixed to mono, resampled.

The result has exactly :func:`shared.dataset.expected_samples` samples, so the mel
frame count a producer computes always equals the one the consumer planned with.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shared.dataset import expected_samples


class AudioError(Exception):
    """A clip that cannot be used; ``str(exc)`` is the rejection reason."""


class AudioMissing(AudioError):
    """The clip's file is not on this host; another host may have it."""


def load_audio(path: Path, target_rate_hz: int) -> np.ndarray:
    """Return mono float32 audio at ``target_rate_hz``; raise :class:`AudioError`."""
    import soundfile

    try:
        audio, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except FileNotFoundError:
        raise AudioMissing(f"audio file missing: {path.name}") from None
    except Exception as exc:  # libsndfile raises LibsndfileError/RuntimeError for corrupt data
        if not Path(path).exists():  # soundfile reports a missing file as LibsndfileError, not FileNotFoundError
            raise AudioMissing(f"audio file missing: {path.name}") from None
        raise AudioError(f"unreadable audio {path.name}: {str(exc).splitlines()[0][:160]}") from None
    if audio.shape[0] == 0:
        raise AudioError(f"audio file has no samples: {path.name}")
    mono = audio.mean(axis=1, dtype=np.float32) if audio.shape[1] > 1 else audio[:, 0]
    if not np.all(np.isfinite(mono)):
        raise AudioError(f"audio contains NaN or inf: {path.name}")
    want = expected_samples(mono.shape[0], rate, target_rate_hz)
    if rate != target_rate_hz:
        import soxr

        mono = soxr.resample(mono, rate, target_rate_hz, quality="HQ").astype(np.float32, copy=False)
        if mono.shape[0] < want:
            mono = np.pad(mono, (0, want - mono.shape[0]))
        mono = mono[:want]
    return np.ascontiguousarray(mono, dtype=np.float32)
