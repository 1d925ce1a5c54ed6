"""Users' mel functions for the tests (``features.user = tests.producer.user_mels:NAME``)."""

from __future__ import annotations

import numpy as np

HOP = 256  # features.hop_length of the tests
N_MELS = 80


def frame_levels(audio, sample_rate_hz):
    """log(x + 1e-3) of each hop's mean square, the same in every channel: [1 + N // HOP, N_MELS]."""
    frames = 1 + len(audio) // HOP
    padded = np.pad(audio, (0, frames * HOP - len(audio)))
    level = np.log((padded.reshape(frames, HOP) ** 2).mean(axis=1) + 1e-3)
    return np.repeat(level[:, None], N_MELS, axis=1).astype(np.float32)


def one_frame_short(audio, sample_rate_hz):
    return frame_levels(audio, sample_rate_hz)[:-1]


def raises(audio, sample_rate_hz):
    """Fails on every clip but digital silence (whose mel gives the padding value)."""
    if np.any(audio):
        raise RuntimeError(f"no mel for {len(audio)} samples")
    return frame_levels(audio, sample_rate_hz)
