"""The run's clip list (consumer/feed/clips.py): every clip by position, as the clip batch field
names it, held-out clips included, and the clips each epoch's plan trains."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.consumer.feed.clips import ClipList
from stoker.consumer.feed.prepared import PreparedRun
from stoker.shared import config as config_mod
from tests.factories import make_dataset
from tests.speech import make_train_eval_dataset


def prepared(tmp_path: Path, **keys: object) -> PreparedRun:
    cfg = config_mod.load(None, {"data.index_cache": "off", "features.backend": "numpy", "batching.batch_size": 4,
                                 **keys})
    return PreparedRun(cfg, tmp_path / "run", hold_out=True)


def test_positions_are_the_index_rows_and_an_epoch_plans_every_training_clip_once(tmp_path) -> None:
    ids = make_dataset(tmp_path / "data", count=24)
    run = prepared(tmp_path, **{"data.path": str(tmp_path / "data"), "trainer.val_clips": 2})
    clips = ClipList(run)
    assert len(clips) == 24 and [clips[p].id for p in range(24)] == [s.id for s in run.index.samples]
    held = clips.validation
    assert len(held) == 2 and [clips[p].id for p in held] == [s.id for s in run.val_samples]
    for epoch in (0, 1):
        planned = clips.epoch(epoch).tolist()
        assert len(planned) == len(set(planned)) == 22 and set(planned) | set(held) == set(range(24))
    assert clips.epoch(0).tolist() != clips.epoch(1).tolist()  # another order each epoch
    clip = clips[clips.position(ids[5])]
    sample = run.index.samples[clip.position]
    assert (clip.id, clip.text, clip.units, clip.audio, clip.duration_s) == (
        sample.id, sample.text, sample.units, sample.audio, sample.duration_s)
    assert clip.tokens.tolist() == run.vocabulary.encode(sample.units).tolist() and clip.tokens[-1] == 1
    assert all(clips[p].held_out for p in held) and clip.held_out == (clip.position in held)
    for wrong in (-1, 24):
        with pytest.raises(IndexError):
            clips[wrong]
    with pytest.raises(KeyError):
        clips.position("nope")


def test_the_eval_files_clips_come_after_the_index_and_are_held_out(tmp_path) -> None:
    make_train_eval_dataset(tmp_path / "data")
    run = prepared(tmp_path, **{"data.path": str(tmp_path / "data"), "data.metadata_file": "metadata_train.csv",
                                "data.eval_file": "metadata_eval.csv"})
    clips = ClipList(run)
    assert len(clips) == 8 and clips.validation == [6, 7] == run.val_positions
    assert [clips.position(s.id) for s in run.val_samples] == [6, 7]
    assert all(clips[p].held_out and clips[p].units for p in (6, 7))
    assert sorted(clips.epoch(0).tolist()) == list(range(6))
