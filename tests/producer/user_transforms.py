"""Users' transforms for the tests (``transforms.user = tests.producer.user_transforms:NAME``)."""

from __future__ import annotations

import numpy as np

HOP = 256  # features.hop_length of the tests


def energy(audio, sample_rate_hz, text, sample_id, speaker, language, metadata):
    """A declared field per frame (energy:float32:T:0) and one per token (marks:int32:L:-1)."""
    frames = 1 + len(audio) // HOP
    padded = np.pad(audio, (0, frames * HOP - len(audio)))
    return {"energy": np.sqrt((padded.reshape(frames, HOP) ** 2).mean(axis=1)).astype(np.float32),
            "marks": np.arange(len(text) + 1, dtype=np.int32)}


def halve(audio, **_):
    return (audio * 0.5).astype(np.float32)


def raises(audio, sample_id, **_):
    raise ValueError(f"no pitch for {sample_id}")


def wrong_dtype(audio, **_):
    return audio.astype(np.float64)


def wrong_shape(audio, text, **_):
    return {"energy": np.zeros(3, np.float32), "marks": np.arange(len(text) + 1, dtype=np.int32)}
