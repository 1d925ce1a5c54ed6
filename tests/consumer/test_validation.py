"""Held-out validation clips (consumer/validation.py)."""

from __future__ import annotations

import numpy as np

from stoker.consumer import validation
from stoker.shared import config as config_mod
from stoker.shared.dataset import build_index
from tests.factories import make_dataset, make_samples


def test_split_is_deterministic_and_bounded() -> None:
    samples = make_samples(100)
    train, held = validation.split(samples, 4, seed=1)
    assert len(held) == 4 and len(train) == 96
    assert {s.id for s in train}.isdisjoint(s.id for s in held)
    assert sorted(validation.split(list(reversed(samples)), 4, seed=1)[1]) == sorted(held)  # order does not matter...
    assert validation.split(samples, 4, seed=2)[1] != held  # ...the seed does
    assert len(validation.split(samples, 50, seed=1)[1]) == 10  # at most a tenth
    assert validation.split(samples[:9], 4, seed=1) == (samples[:9], [])  # too few clips to spare any
    assert validation.split(samples, 0, seed=1) == (samples, [])


def test_batches_are_collated_like_training_batches(tmp_path) -> None:
    make_dataset(tmp_path / "data", count=30)
    cfg = config_mod.load(None, {"data.path": str(tmp_path / "data"), "batching.batch_size": 4})
    index = build_index(cfg.data, cfg.features)
    _, held = validation.split(index.samples, 6, seed=0)
    assert len(held) == 3
    batches = validation.make_batches(held, index.root, cfg, index.vocabulary)
    assert len(batches) == 1
    b = batches[0]
    assert b["tokens"].shape[0] == 3 and b["tokens"].dtype == np.int32
    # each row holds its clip's ids as the run's vocabulary encodes its text
    for row, length in enumerate(b["token_lengths"]):
        decoded = index.vocabulary.decode(b["tokens"][row, :length])
        assert decoded in {s.units for s in held}
    assert b["mel"].shape[1] % cfg.batching.frames_multiple == 0 and b["mel"].shape[2] == cfg.features.n_mels
    assert sorted(b["mel_lengths"]) == sorted(s.num_frames for s in held)
    assert "3 held-out clips" in validation.describe(batches)


def test_an_unreadable_clip_is_left_out(tmp_path, caplog) -> None:
    make_dataset(tmp_path / "data", count=20)
    cfg = config_mod.load(None, {"data.path": str(tmp_path / "data")})
    index = build_index(cfg.data, cfg.features)
    _, held = validation.split(index.samples, 2, seed=0)
    (index.root / "wavs" / f"{held[0].id}.wav").unlink()
    batches = validation.make_batches(held, index.root, cfg, index.vocabulary)
    assert sum(len(b["mel_lengths"]) for b in batches) == 1
    assert f"validation clip {held[0].id} left out" in caplog.text
