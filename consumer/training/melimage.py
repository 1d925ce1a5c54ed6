"""Mel spectrograms as images: for TensorBoard (predicted vs target) and ``run.py synth``.

A mel ``[T, F]`` becomes an RGB image ``[F, T, 3]`` (uint8): time runs left to right, low
frequencies at the bottom, values mapped through a viridis-like colour scale between the
given floor and ceiling. PNG files are written with zlib alone, no imaging library.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

# Viridis at five stops (dark blue -> green -> yellow); linear interpolation between them.
_STOPS = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], np.float32)
# Rows of white between stacked spectrograms.
SEPARATOR_ROWS = 2


def colorize(mel: np.ndarray, low: float | None = None, high: float | None = None) -> np.ndarray:
    """``[T, F]`` log-mel -> ``[F, T, 3]`` uint8, low frequencies at the bottom."""
    mel = np.asarray(mel, np.float32)
    if mel.ndim != 2:
        raise ValueError(f"expected a mel [T, F], got shape {mel.shape}")
    low = float(np.min(mel)) if low is None else low
    high = float(np.max(mel)) if high is None else high
    scaled = np.clip((mel - low) / max(high - low, 1e-6), 0.0, 1.0) * (len(_STOPS) - 1)
    below = np.minimum(np.floor(scaled).astype(np.int64), len(_STOPS) - 2)
    frac = (scaled - below)[..., None]
    rgb = _STOPS[below] * (1 - frac) + _STOPS[below + 1] * frac  # [T, F, 3]
    return np.ascontiguousarray(rgb.transpose(1, 0, 2)[::-1]).astype(np.uint8)


def comparison(predicted: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Target above prediction, one colour scale (the target's range), as ``[2F+2, T, 3]``."""
    low, high = float(np.min(target)), float(np.max(target))
    top, bottom = colorize(target, low, high), colorize(predicted, low, high)
    gap = np.full((SEPARATOR_ROWS, top.shape[1], 3), 255, np.uint8)
    return np.concatenate([top, gap, bottom], axis=0)


def write_png(path: str | Path, rgb: np.ndarray) -> None:
    """Write an ``[H, W, 3]`` uint8 image as an 8-bit RGB PNG."""
    rgb = np.ascontiguousarray(rgb, np.uint8)
    height, width, channels = rgb.shape
    if channels != 3:
        raise ValueError(f"expected [H, W, 3], got {rgb.shape}")

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    # Each scanline starts with filter type 0 (none).
    raw = np.concatenate([np.zeros((height, 1), np.uint8), rgb.reshape(height, width * 3)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB, no interlace
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6))
            + chunk(b"IEND", b""))
    Path(path).write_bytes(data)
