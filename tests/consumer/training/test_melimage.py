"""Mel images (consumer/training/melimage.py): orientation, colours, and a PNG any reader accepts."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from stoker.consumer.training import melimage


def test_colorize_orientation_and_range() -> None:
    mel = np.zeros((5, 3), np.float32)
    mel[:, 0] = 1.0  # the lowest mel channel is loud
    rgb = melimage.colorize(mel)
    assert rgb.shape == (3, 5, 3) and rgb.dtype == np.uint8
    assert (rgb[-1] == [253, 231, 37]).all()  # bottom row: low frequencies, brightest colour
    assert (rgb[0] == [68, 1, 84]).all()
    with pytest.raises(ValueError):
        melimage.colorize(np.zeros(4))


def test_comparison_stacks_target_over_prediction() -> None:
    target = np.linspace(-10, 0, 40, dtype=np.float32).reshape(8, 5)
    image = melimage.comparison(target, target)
    assert image.shape == (2 * 5 + melimage.SEPARATOR_ROWS, 8, 3)
    assert (image[:5] == image[5 + melimage.SEPARATOR_ROWS:]).all()


def test_png_decodes_to_the_same_pixels(tmp_path) -> None:
    rgb = np.random.default_rng(0).integers(0, 256, size=(7, 11, 3), dtype=np.uint8)
    path = tmp_path / "x.png"
    melimage.write_png(path, rgb)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, pos = {}, 8
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0] == zlib.crc32(kind + body)
        chunks[kind] = body
        pos += 12 + length
    width, height = struct.unpack(">II", chunks[b"IHDR"][:8])
    assert (width, height) == (11, 7)
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(7, 1 + 11 * 3)
    assert (rows[:, 0] == 0).all()
    assert (rows[:, 1:].reshape(7, 11, 3) == rgb).all()
