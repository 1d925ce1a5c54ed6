"""Each log-mel channel's mean and standard deviation over a dataset (``transforms.mel_norm``).

Producers add up, per batch, each channel's sum and sum of squares over the valid frames of
the log-mel as the feature definition makes it (before any normalisation), and send them
with the batch; the trainer adds the batches up. A run that trains a whole epoch (such as
``python run.py precompute``) then knows the dataset's statistics and writes them to
``RUN_DIR/mel_stats.json`` and beside the dataset's index cache, under a key of everything
the log-mel depends on (:func:`stats_key`). A run with ``transforms.mel_norm: dataset``
finds them there (or refuses to start, naming precompute), copies them into its run
directory (synth and export undo the normalisation with them) and hands them to the
producers, which train on ``(mel - mean) / std``; padding keeps its value.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .config import TRANSFORMS_REVISION
from .mel import features_key

# A channel that never varies (an empty filter, a silent band) is divided by this, not by 0.
MIN_STD = 1e-3
# Hex digits of the statistics key: the settings' SHA-256, shortened.
KEY_HEX = 16


def stats_key(features: Any, transforms: Any, dataset_fingerprint: str) -> str:
    """What a dataset's mel statistics depend on: the feature definition, the transforms
    before the mel (not mel_norm itself) and the dataset."""
    feats = features_key(features)
    chain = {k: v for k, v in dataclasses.asdict(transforms).items() if k not in ("mel_norm", "fields")}
    if transforms.trim_db > 0 or transforms.normalize != "off":
        chain["revision"] = TRANSFORMS_REVISION
    text = json.dumps({"features": feats, "transforms": chain, "dataset": dataset_fingerprint}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_HEX]


@dataclass
class MelStats:
    """Running sums over valid frames: per channel, the sum and the sum of squares."""

    total: np.ndarray
    squares: np.ndarray
    frames: int = 0

    @classmethod
    def empty(cls, n_mels: int) -> "MelStats":
        return cls(np.zeros(n_mels), np.zeros(n_mels), 0)

    @classmethod
    def of_batch(cls, mel: np.ndarray, lengths: np.ndarray) -> "MelStats":
        """The sums of a batch's valid frames: mel [B, T, F], lengths [B]."""
        mask = np.arange(mel.shape[1])[None, :] < np.asarray(lengths)[:, None]
        valid = mel[mask].astype(np.float64)  # [V, F]
        return cls(valid.sum(axis=0), np.square(valid).sum(axis=0), int(valid.shape[0]))

    def add(self, other: "MelStats") -> None:
        self.total += other.total
        self.squares += other.squares
        self.frames += other.frames

    def to_fields(self) -> dict[str, Any]:
        """As a BATCH message carries them."""
        return {"sum": self.total.tolist(), "sumsq": self.squares.tolist(), "frames": self.frames}

    @classmethod
    def from_fields(cls, fields: Any, n_mels: int) -> "MelStats | None":
        """From a BATCH message's field; None when malformed (a peer's garbage is not trusted)."""
        try:
            total = np.asarray(fields["sum"], np.float64)
            squares = np.asarray(fields["sumsq"], np.float64)
            frames = int(fields["frames"])
        except (KeyError, TypeError, ValueError):
            return None
        if total.shape != (n_mels,) or squares.shape != (n_mels,) or frames < 0 or not (
                np.all(np.isfinite(total)) and np.all(np.isfinite(squares))):
            return None
        return cls(total, squares, frames)

    def mean_std(self) -> tuple[np.ndarray, np.ndarray]:
        mean = self.total / max(self.frames, 1)
        var = np.maximum(self.squares / max(self.frames, 1) - np.square(mean), 0.0)
        return mean.astype(np.float32), np.maximum(np.sqrt(var), MIN_STD).astype(np.float32)

    def to_json(self, key: str) -> dict[str, Any]:
        mean, std = self.mean_std()
        return {"key": key, "frames": self.frames, "mean": mean.tolist(), "std": std.tolist()}


def load(data: Mapping[str, Any], n_mels: int) -> tuple[np.ndarray, np.ndarray]:
    """(mean, std) float32 [F] from a mel_stats.json's content; ValueError when unusable."""
    mean = np.asarray(data.get("mean"), np.float32)
    std = np.asarray(data.get("std"), np.float32)
    if mean.shape != (n_mels,) or std.shape != (n_mels,) or not np.all(std > 0):
        raise ValueError(f"mel statistics of {list(mean.shape)} and {list(std.shape)} channels, expected {n_mels}")
    return mean, std


def minmax(mel: np.ndarray, lengths: np.ndarray) -> None:
    """``transforms.mel_norm: clip_minmax``: each row's valid frames of a batch [B, T, F] as
    ``(mel - min) / (max - min)`` over the clip (every frame and channel), in place, so in
    [0, 1]; a constant clip becomes 0; padding stays."""
    for row, length in enumerate(np.asarray(lengths)):
        valid = mel[row, :int(length)]
        if not valid.size:
            continue
        low, high = valid.min(), valid.max()
        np.subtract(valid, low, out=valid)
        if high > low:
            np.divide(valid, high - low, out=valid)


def normalize(mel: np.ndarray, lengths: np.ndarray, mean: np.ndarray, std: np.ndarray) -> None:
    """``(mel - mean) / std`` over the valid frames of a batch [B, T, F], in place (padding stays)."""
    mask = np.arange(mel.shape[1])[None, :] < np.asarray(lengths)[:, None]
    mel[mask] = (mel[mask] - mean) / std
