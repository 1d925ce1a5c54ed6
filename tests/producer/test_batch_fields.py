"""The optional batch fields a producer fills from audio: the waveform (``audio``) and the
log-mel of each clip's reference clip (``ref_mel``), with their lengths and paddings."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from stoker.producer.audio import load_audio
from stoker.producer.features import log_mel_spectrogram_numpy, pad_value
from stoker.producer.batches import BatchMaker
from stoker.shared import wire
from stoker.shared.batch import schema_for
from stoker.shared.config import FeaturesConfig
from stoker.shared.dataset.corpus.registry import read_metadata
from stoker.shared.dataset.files import scan_audio
from tests.factories import make_dataset

FEATURES = FeaturesConfig(backend="numpy")
SHAPE = (64, 160)  # (L, T): room for every clip of make_dataset
REF_FRAMES = 40  # shorter than every clip: references are cropped


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, list[str]]:
    root = tmp_path / "data"
    return root, make_dataset(root, count=5)


def _maker(root: Path, fields: str, cache: Path | None = None, fixed_rows: bool = False) -> BatchMaker:
    """A producer's batch maker; ``fixed_rows``: batches keep the lease's rows, row_mask on (as
    the coordinator's WELCOME says when the run's rows are fixed)."""
    entries, _ = read_metadata(root)
    files = {k: v.name for k, v in scan_audio(root).items()}
    return BatchMaker(root, {e.id: e.text for e in entries}, FEATURES, None, "p0", files=files,
                      schema=schema_for(f"{fields},row_mask" if fixed_rows else fields), ref_frames=REF_FRAMES,
                      feature_cache=str(cache or ""), fixed_rows=fixed_rows)


def _lease(ids: list[str], refs: list[str] | None = None, rows: int = 4) -> wire.Lease:
    return wire.Lease(1, 0, 0, tuple(ids), SHAPE, rows, tuple((2, 3, 1) for _ in ids),
                      refs=tuple(refs) if refs is not None else None)


def _mel(root: Path, sample_id: str) -> np.ndarray:
    audio = load_audio(root / "wavs" / f"{sample_id}.wav", FEATURES.sample_rate_hz)
    return log_mel_spectrogram_numpy(audio, FEATURES, dtype=np.float32)


def test_audio_is_the_waveform_padded_with_zeros(dataset) -> None:
    root, ids = dataset
    made = _maker(root, "audio", fixed_rows=True).make(_lease(ids[:3]))
    arrays = made.arrays
    assert arrays["audio"].shape == (4, SHAPE[1] * FEATURES.hop_length) and arrays["audio"].dtype == np.float32
    for row, sample_id in enumerate(made.batch.ids):
        wave = load_audio(root / "wavs" / f"{sample_id}.wav", FEATURES.sample_rate_hz)
        assert arrays["audio_lengths"][row] == len(wave)
        np.testing.assert_array_equal(arrays["audio"][row, :len(wave)], wave)
        assert not arrays["audio"][row, len(wave):].any()
        # The mel of the row is the mel of that waveform.
        frames = arrays["mel_lengths"][row]
        assert frames == 1 + len(wave) // FEATURES.hop_length
    assert arrays["audio_lengths"][3] == 0 and not arrays["audio"][3].any()
    assert arrays["row_mask"].tolist() == [1.0, 1.0, 1.0, 0.0]


def test_audio_is_read_even_when_the_feature_cache_holds_the_mel(dataset, tmp_path) -> None:
    root, ids = dataset
    maker = _maker(root, "audio", cache=tmp_path / "cache")
    first = maker.make(_lease(ids[:2]))
    again = maker.make(_lease(ids[:2]))
    assert again.batch.cache["hits"] == 2 and again.batch.cache["computed"] == 0
    np.testing.assert_array_equal(first.arrays["audio"], again.arrays["audio"])


def test_ref_mel_is_the_reference_clips_mel_cropped_around_its_middle(dataset) -> None:
    root, ids = dataset
    refs = [ids[4], ids[3], ids[0]]
    made = _maker(root, "ref_mel", fixed_rows=True).make(_lease(ids[:3], refs))
    arrays = made.arrays
    assert arrays["ref_mel"].shape == (4, REF_FRAMES, FEATURES.n_mels)
    for row, ref in enumerate(refs):
        full = _mel(root, ref)
        start = (len(full) - REF_FRAMES) // 2
        np.testing.assert_allclose(arrays["ref_mel"][row], full[start:start + REF_FRAMES], rtol=1e-4, atol=1e-4)
        assert arrays["ref_mel_lengths"][row] == REF_FRAMES
    assert arrays["ref_mel_lengths"][3] == 0
    np.testing.assert_array_equal(arrays["ref_mel"][3], np.float32(pad_value(FEATURES)))


def test_a_short_reference_is_padded(dataset, tmp_path) -> None:
    root, ids = dataset
    entries, _ = read_metadata(root)
    files = {k: v.name for k, v in scan_audio(root).items()}
    maker = BatchMaker(root, {e.id: e.text for e in entries}, FEATURES, None, "p0", files=files,
                       schema=schema_for("ref_mel"), ref_frames=400)
    arrays = maker.make(_lease(ids[:1], [ids[1]])).arrays
    full = _mel(root, ids[1])
    assert arrays["ref_mel_lengths"][0] == len(full) < 400
    np.testing.assert_allclose(arrays["ref_mel"][0, :len(full)], full, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(arrays["ref_mel"][0, len(full):], np.float32(pad_value(FEATURES)))


def test_a_missing_reference_misses_its_clip_and_a_broken_one_rejects_it(dataset) -> None:
    root, ids = dataset
    (root / "wavs" / f"{ids[4]}.wav").unlink()
    (root / "wavs" / f"{ids[3]}.wav").write_bytes(b"RIFF not really")
    maker = _maker(root, "ref_mel")
    made = maker.make(_lease(ids[:3], [ids[4], ids[3], ids[1]]))
    assert list(made.batch.ids) == [ids[2]]
    assert [m.id for m in made.batch.missed] == [ids[0]]
    assert made.batch.missed[0].reason.startswith(f"reference clip {ids[4]}: audio file missing")
    assert [r.id for r in made.batch.rejected] == [ids[1]]
    assert made.batch.rejected[0].reason.startswith(f"reference clip {ids[3]}: ")
    assert list(made.batch.ids) + [m.id for m in made.batch.missed] + [
        r.id for r in made.batch.rejected] == [ids[2], ids[0], ids[1]]  # every clip accounted for
    # Only the real row: B is the one clip delivered, its values those of a batch of it alone.
    alone = _maker(root, "ref_mel").make(_lease([ids[2]], [ids[1]], rows=1))
    assert made.arrays["mel_lengths"].shape == (1,) and made.arrays["mel_lengths"][0] > 0
    for name, array in alone.arrays.items():
        np.testing.assert_array_equal(made.arrays[name], array)


def test_a_rejected_clip_leaves_only_real_rows_or_with_fixed_rows_a_marked_empty_one(dataset) -> None:
    root, ids = dataset
    (root / "wavs" / f"{ids[1]}.wav").write_bytes(b"RIFF not really")
    real = _maker(root, "speaker_id").make(_lease(ids[:3]))
    fixed = _maker(root, "speaker_id", fixed_rows=True).make(_lease(ids[:3]))
    assert real.batch.ids == fixed.batch.ids == (ids[0], ids[2])
    assert real.arrays["mel"].shape[0] == 2 and (real.arrays["mel_lengths"] > 0).all() and "row_mask" not in real.arrays
    assert fixed.arrays["mel"].shape[0] == 4 and fixed.arrays["row_mask"].tolist() == [1.0, 1.0, 0.0, 0.0]
    for name, array in real.arrays.items():  # the real rows are the same either way; the rest is padding
        np.testing.assert_array_equal(fixed.arrays[name][:2], array)
    assert not fixed.arrays["mel_lengths"][2:].any() and not fixed.arrays["token_lengths"][2:].any()


def test_clip_holds_each_real_rows_lease_position_after_a_rejection_and_minus_one_on_empty_rows(dataset) -> None:
    root, ids = dataset
    (root / "wavs" / f"{ids[1]}.wav").write_bytes(b"RIFF not really")
    lease = dataclasses.replace(_lease(ids[:3]), positions=(40, 41, 42))
    real = _maker(root, "clip").make(lease)
    fixed = _maker(root, "clip", fixed_rows=True).make(lease)
    assert real.batch.ids == (ids[0], ids[2])
    assert real.arrays["clip"].dtype == np.int32 and real.arrays["clip"].tolist() == [40, 42]
    assert fixed.arrays["clip"].tolist() == [40, 42, -1, -1]  # the rejected clip's row went; empty rows are -1
    assert schema_for("clip,row_mask").check_rows(fixed.arrays, 2) == ""
    assert "clip" in schema_for("clip").check_rows({**real.arrays, "clip": np.array([40, -1], np.int32)}, 2)
    unplaced = _maker(root, "clip").make(_lease([ids[0], ids[2]]))  # a lease without positions
    assert unplaced.batch.ids == () and {e.reason for e in unplaced.batch.rejected} == {
        "the lease carries no clip position for this clip"}


def test_mel_norm_normalises_the_valid_frames_and_reports_the_raw_sums(dataset) -> None:
    from stoker.shared.melstats import MelStats

    root, ids = dataset
    plain = _maker(root, "ref_mel", fixed_rows=True).make(_lease(ids[:2], [ids[2], ids[3]]))  # empty rows too
    entries, _ = read_metadata(root)
    files = {k: v.name for k, v in scan_audio(root).items()}
    mean = np.linspace(-8, -4, FEATURES.n_mels).astype(np.float32)
    std = np.linspace(1, 3, FEATURES.n_mels).astype(np.float32)
    normed = BatchMaker(root, {e.id: e.text for e in entries}, FEATURES, None, "p0", files=files,
                        schema=schema_for("ref_mel,row_mask"), ref_frames=REF_FRAMES, mel_norm=(mean, std),
                        fixed_rows=True).make(
        _lease(ids[:2], [ids[2], ids[3]]))
    for name, lengths in (("mel", "mel_lengths"), ("ref_mel", "ref_mel_lengths")):
        for row in range(4):
            n = plain.arrays[lengths][row]
            np.testing.assert_allclose(normed.arrays[name][row, :n], (plain.arrays[name][row, :n] - mean) / std,
                                       rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(normed.arrays[name][row, n:], plain.arrays[name][row, n:])
    # The sums describe the mel as defined, not as normalised.
    assert normed.batch.mel_stats == plain.batch.mel_stats
    sums = MelStats.from_fields(plain.batch.mel_stats, FEATURES.n_mels)
    assert sums.frames == int(plain.arrays["mel_lengths"].sum())


def test_clip_minmax_scales_each_clip_to_0_1_and_pads_with_0(dataset) -> None:
    from stoker.shared.config import TransformsConfig

    root, ids = dataset
    plain = _maker(root, "ref_mel").make(_lease(ids[:2], [ids[2], ids[3]]))
    entries, _ = read_metadata(root)
    files = {k: v.name for k, v in scan_audio(root).items()}
    scaled = BatchMaker(root, {e.id: e.text for e in entries}, FEATURES, None, "p0", files=files,
                        schema=schema_for("ref_mel"), ref_frames=REF_FRAMES,
                        transforms=TransformsConfig(mel_norm="clip_minmax")).make(_lease(ids[:2], [ids[2], ids[3]]))
    for name, lengths in (("mel", "mel_lengths"), ("ref_mel", "ref_mel_lengths")):
        for row in range(2):
            n = plain.arrays[lengths][row]
            raw = plain.arrays[name][row, :n]
            np.testing.assert_allclose(scaled.arrays[name][row, :n], (raw - raw.min()) / (raw.max() - raw.min()),
                                       rtol=0, atol=1e-6)
        assert not np.isnan(scaled.arrays[name]).any()
        for row in range(len(scaled.arrays[lengths])):  # real rows only
            assert np.all(scaled.arrays[name][row, scaled.arrays[lengths][row]:] == 0.0)  # padding: 0
    assert scaled.batch.mel_stats == plain.batch.mel_stats  # the sums are of the mel as defined


def test_a_users_mel_function_makes_the_mels_and_its_silence_pads(dataset, tmp_path) -> None:
    import dataclasses

    from tests.producer.user_mels import frame_levels

    root, ids = dataset
    features = dataclasses.replace(FEATURES, user="tests.producer.user_mels:frame_levels")
    entries, _ = read_metadata(root)
    files = {k: v.name for k, v in scan_audio(root).items()}
    maker = BatchMaker(root, {e.id: e.text for e in entries}, features, None, "p0", files=files,
                       schema=schema_for(""), feature_cache=str(tmp_path / "cache"))
    for _ in range(2):  # computed, then read back from the feature cache
        batch = maker.make(_lease(ids[:2]))
        assert list(batch.batch.ids) == ids[:2] and batch.batch.rejected == ()
        for row, sample_id in enumerate(ids[:2]):
            audio = load_audio(root / "wavs" / f"{sample_id}.wav", FEATURES.sample_rate_hz)
            n = batch.arrays["mel_lengths"][row]
            np.testing.assert_allclose(batch.arrays["mel"][row, :n], frame_levels(audio, 22050), rtol=0, atol=1e-3)
            assert np.all(batch.arrays["mel"][row, n:] == np.float32(np.log(1e-3)))  # silence's value
    assert maker.cache.counts.hits == 2 and maker.cache.counts.written == 2


@pytest.mark.parametrize("name, reason", [
    ("one_frame_short", r"returned float32 \[(\d+), 80\]; expected finite float32 \[(\d+), 80\] for \d+ samples"),
    ("raises", r"RuntimeError: no mel for \d+ samples")])
def test_a_users_mel_function_that_fails_rejects_the_clip(dataset, name: str, reason: str) -> None:
    import dataclasses

    root, ids = dataset
    features = dataclasses.replace(FEATURES, user=f"tests.producer.user_mels:{name}")
    entries, _ = read_metadata(root)
    files = {k: v.name for k, v in scan_audio(root).items()}
    batch = BatchMaker(root, {e.id: e.text for e in entries}, features, None, "p0", files=files,
                       schema=schema_for("")).make(_lease(ids[:2]))
    assert list(batch.batch.ids) == [] and [r.id for r in batch.batch.rejected] == ids[:2]
    for rejected in batch.batch.rejected:
        assert rejected.reason.startswith(f"features.user tests.producer.user_mels:{name}")
        found = re.search(reason, rejected.reason)
        assert found and (not found.groups() or int(found[1]) + 1 == int(found[2]))
