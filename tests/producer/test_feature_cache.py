"""The feature cache: exact enough, verified on every read, rebuilt exactly where it must be."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from stoker.producer.feature_cache import FeatureCache, cache_dir_name, dequantize, quantize
from stoker.producer.features import log_mel_spectrogram_numpy
from stoker.producer.batches import BatchMaker, Prepared
from stoker.shared import wire
from stoker.shared.config import FeaturesConfig
from stoker.shared.dataset.corpus.registry import read_metadata
from stoker.shared.dataset.files import scan_audio
from tests.factories import make_dataset, tone

FEATURES = FeaturesConfig(backend="numpy")
CLIPS = 6
BATCH = 8
SHAPE = (64, 160)  # (L, T): room for every clip of make_dataset


def _mel(seconds: float = 1.0, seed: int = 0) -> np.ndarray:
    return log_mel_spectrogram_numpy(tone(seconds, seed=seed), FEATURES, dtype=np.float32)


def _bound(mel: np.ndarray) -> float:
    """The documented worst case: half a quantisation step, plus float32 rounding."""
    return (float(mel.max()) - float(mel.min())) / 65535 / 2 + 4e-6


# ----------------------------------------------------------------------- entries


def test_quantisation_error_is_within_the_documented_bound() -> None:
    mel = _mel()
    lo, step, codes = quantize(mel)
    back = dequantize(lo, step, codes)
    assert codes.dtype == np.uint16 and back.dtype == np.float32 and back.shape == mel.shape
    assert np.max(np.abs(back - mel)) <= _bound(mel)
    assert back.min() == mel.min()  # silence (the clip's minimum) comes back exactly
    flat = np.full((3, 4), -2.5, np.float32)
    np.testing.assert_array_equal(dequantize(*quantize(flat)), flat)


def test_roundtrip_and_counts(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path, FEATURES, Path("/data/set"))
    mel = _mel()
    assert cache.get("A", "A.wav", 100, 5) is None
    assert cache.put("A", "A.wav", 100, 5, mel)
    got = cache.get("A", "A.wav", 100, 5)
    assert got is not None and got.shape == mel.shape and np.max(np.abs(got - mel)) <= _bound(mel)
    assert (cache.counts.misses, cache.counts.hits, cache.counts.written) == (1, 1, 1)
    assert (cache.dir / "config.json").exists()
    assert cache.path("A").stat().st_size == 56 + mel.size * 2  # header + uint16 payload
    assert not [p for p in cache.dir.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("changed", [("A.wav", 101, 5), ("A.wav", 100, 6), ("A.flac", 100, 5)])
def test_a_changed_audio_file_makes_the_entry_stale(tmp_path: Path, changed: tuple) -> None:
    cache = FeatureCache(tmp_path, FEATURES, Path("/data/set"))
    cache.put("A", "A.wav", 100, 5, _mel())
    assert cache.get("A", *changed) is None
    assert (cache.counts.stale, cache.counts.corrupt, cache.counts.hits) == (1, 0, 0)


@pytest.mark.parametrize("damage", ["flip-payload", "flip-header", "truncate", "extend", "garbage", "empty"])
def test_a_damaged_entry_is_detected(tmp_path: Path, damage: str, caplog) -> None:
    cache = FeatureCache(tmp_path, FEATURES, Path("/data/set"))
    cache.put("A", "A.wav", 100, 5, _mel())
    blob = bytearray(cache.path("A").read_bytes())
    if damage == "flip-payload":
        blob[len(blob) - 7] ^= 0x01
    elif damage == "flip-header":
        blob[30] ^= 0x01  # inside `step`
    elif damage == "truncate":
        blob = blob[:-2]
    elif damage == "extend":
        blob += b"\0\0"
    elif damage == "garbage":
        blob = bytearray(b"x" * 200)
    else:
        blob = bytearray()
    cache.path("A").write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING, logger="stoker.producer.feature_cache"):
        assert cache.get("A", "A.wav", 100, 5) is None
    assert (cache.counts.corrupt, cache.counts.hits) == (1, 0)
    assert any("corrupt" in r.getMessage() for r in caplog.records)


def test_directory_is_keyed_by_the_features_config_and_dataset() -> None:
    root = Path("/data/set")
    base = cache_dir_name(FEATURES, root)
    assert cache_dir_name(dataclasses.replace(FEATURES, backend="tf"), root) == base  # same definition
    assert cache_dir_name(dataclasses.replace(FEATURES, n_mels=64), root) != base
    assert cache_dir_name(dataclasses.replace(FEATURES, fmax_hz=7600.0), root) != base
    assert cache_dir_name(FEATURES, Path("/data/other")) != base


def test_an_unwritable_cache_is_logged_once_and_computing_goes_on(tmp_path: Path, caplog) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file, not a directory")
    cache = FeatureCache(blocked, FEATURES, Path("/data/set"))
    with caplog.at_level(logging.WARNING, logger="stoker.producer.feature_cache"):
        assert not cache.put("A", "A.wav", 1, 1, _mel())
        assert not cache.put("B", "B.wav", 1, 1, _mel())
    assert cache.counts.write_errors == 1
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1


# ----------------------------------------------------------------------- in a producer


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, list[str]]:
    root = tmp_path / "data"
    return root, make_dataset(root, count=CLIPS)


def _maker(root: Path, cache_dir: Path | None, features: FeaturesConfig = FEATURES) -> BatchMaker:
    entries, _ = read_metadata(root)
    files = {k: v.name for k, v in scan_audio(root).items()}
    return BatchMaker(root, {e.id: e.text for e in entries}, features, None, "p0", files=files,
                      feature_cache=str(cache_dir) if cache_dir else "")


def _make(maker: BatchMaker, ids: list[str]) -> Prepared:
    return maker.make(wire.Lease(1, 0, 0, tuple(ids), SHAPE, BATCH, tuple((2, 3, 1) for _ in ids)))


def _assert_close(cached: Prepared, computed: Prepared) -> None:
    for name in ("tokens", "token_lengths", "mel_lengths"):
        np.testing.assert_array_equal(cached.arrays[name], computed.arrays[name])
    mel = computed.arrays["mel"]
    assert np.max(np.abs(cached.arrays["mel"] - mel)) <= _bound(mel)


def test_second_epoch_reads_every_clip_from_the_cache(dataset, tmp_path: Path) -> None:
    root, ids = dataset
    plain = _make(_maker(root, None), ids)
    assert plain.batch.cache is None
    maker = _maker(root, tmp_path / "cache")
    first = _make(maker, ids)
    assert first.batch.cache == {"hits": 0, "misses": CLIPS, "stale": 0, "corrupt": 0, "written": CLIPS,
                              "write_errors": 0, "computed": CLIPS}
    np.testing.assert_array_equal(first.arrays["mel"], plain.arrays["mel"])  # computing is unchanged
    second = _make(_maker(root, tmp_path / "cache"), ids)  # a new producer, as in a later run
    assert second.batch.cache["hits"] == CLIPS and second.batch.cache["misses"] == 0
    assert list(second.batch.ids) == list(first.batch.ids) == ids
    _assert_close(second, plain)


def test_touching_a_wav_recomputes_that_clip_only(dataset, tmp_path: Path) -> None:
    root, ids = dataset
    _make(_maker(root, tmp_path / "cache"), ids)
    wav = root / "wavs" / f"{ids[2]}.wav"
    st = wav.stat()
    os.utime(wav, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    maker = _maker(root, tmp_path / "cache")
    batch = _make(maker, ids)
    assert (batch.batch.cache["hits"], batch.batch.cache["stale"], batch.batch.cache["written"]) == (CLIPS - 1, 1, 1)
    assert _make(maker, ids).batch.cache["hits"] == CLIPS  # rewritten


def test_a_corrupt_entry_is_recomputed_counted_and_rewritten(dataset, tmp_path: Path) -> None:
    root, ids = dataset
    maker = _maker(root, tmp_path / "cache")
    computed = _make(maker, ids)
    entry = maker.cache.path(ids[4])
    blob = bytearray(entry.read_bytes())
    blob[-3] ^= 0xFF
    entry.write_bytes(bytes(blob))
    again = _make(_maker(root, tmp_path / "cache"), ids)
    assert (again.batch.cache["hits"], again.batch.cache["corrupt"], again.batch.cache["written"]) == (CLIPS - 1, 1, 1)
    # Recomputed (counted above, and rewritten): one clip computed alone can differ from the same clip
    # computed in a batch of six by a rounding, as BLAS blocks a matrix product by its size.
    np.testing.assert_allclose(again.arrays["mel"][4], computed.arrays["mel"][4], rtol=0, atol=1e-5)
    assert _make(_maker(root, tmp_path / "cache"), ids).batch.cache["hits"] == CLIPS


def test_a_features_config_change_recomputes_everything(dataset, tmp_path: Path) -> None:
    root, ids = dataset
    _make(_maker(root, tmp_path / "cache"), ids)
    other = dataclasses.replace(FEATURES, fmax_hz=7000.0)
    assert _make(_maker(root, tmp_path / "cache", other), ids).batch.cache["misses"] == CLIPS
    assert _make(_maker(root, tmp_path / "cache"), ids).batch.cache["hits"] == CLIPS  # the first still there


def test_unreadable_clip_is_rejected_with_a_cache_too(dataset, tmp_path: Path) -> None:
    root, ids = dataset
    (root / "wavs" / f"{ids[1]}.wav").write_bytes(b"garbage that is not audio")
    batch = _make(_maker(root, tmp_path / "cache"), ids)
    assert list(batch.batch.ids) == [i for i in ids if i != ids[1]]
    assert batch.batch.rejected[0].reason.startswith(f"audio file unreadable: wavs/{ids[1]}.wav: ")
    assert batch.batch.cache["written"] == batch.batch.cache["computed"] == CLIPS - 1
