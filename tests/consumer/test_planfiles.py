"""A host's epoch plans in files every process maps (consumer/planfiles.py): made once,
the same plans and shares as planned in each process, a position over them resumed exactly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgpack
import numpy as np
import pytest

from stoker.benchmarks.position import BATCHING, once_each, train_part
from stoker.consumer import plan as plan_module
from stoker.consumer import planfiles
from stoker.consumer.plan import EpochPlanner, stored_buckets
from stoker.consumer.planfiles import PlanFiles
from stoker.consumer.position import InputPosition
from stoker.shared.dataset.table import SampleTable
from tests.factories import make_samples

CLIPS = 3000


@pytest.fixture(scope="module")
def table() -> SampleTable:
    return SampleTable.from_samples(make_samples(CLIPS, seed=5))


def _filed(table, directory: Path, world: int = 1, worker: int = 0) -> EpochPlanner:
    return EpochPlanner(table, BATCHING, workers=world, worker=worker, files=PlanFiles(directory))


def _never(*_: object) -> None:
    raise AssertionError("planned again, not mapped from the file")


@pytest.mark.parametrize("world", [1, 4])
def test_the_first_process_plans_an_epoch_and_every_other_maps_the_same_plan(table, tmp_path: Path, world: int,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    first = _filed(table, tmp_path, world, 0).plan(1)
    assert len(list(tmp_path.glob(f"*{planfiles.BUCKETS}.plan"))) == 1 and len(list(tmp_path.glob("*.plan"))) == 2
    monkeypatch.setattr(EpochPlanner, "_global_plan", _never)
    monkeypatch.setattr(plan_module, "make_buckets", _never)
    for worker in range(world):  # every rank (and the coordinator process) of the host: mapped, no plan made
        mapped = _filed(table, tmp_path, world, worker).plan(1)
        assert not mapped.clips.flags.writeable  # the file's pages, not a copy
        monkeypatch.undo()
        alone = EpochPlanner(table, BATCHING, workers=world, worker=worker).plan(1)
        monkeypatch.setattr(EpochPlanner, "_global_plan", _never)
        monkeypatch.setattr(plan_module, "make_buckets", _never)
        assert np.array_equal(mapped.clips, first.clips) and np.array_equal(mapped.clips, alone.clips)
        assert np.array_equal(mapped.sizes(), alone.sizes()) and mapped == alone
        rows = np.arange(-1, CLIPS + 1)
        assert np.array_equal(mapped.batch_of(rows), alone.batch_of(rows))


def test_a_position_over_mapped_plans_resumes_exactly_the_rest(table, tmp_path: Path) -> None:
    planner = _filed(table, tmp_path, 2, 1)
    position = InputPosition(planner)
    trained = train_part(position, 0, np.random.default_rng(1))
    saved = msgpack.unpackb(msgpack.packb(position.state_dict(), use_bin_type=True), raw=False)
    alone = EpochPlanner(table, BATCHING, workers=2, worker=1)  # a process that plans for itself
    again = InputPosition.from_state_dict(saved, alone)
    plan = alone.plan(0)
    assert once_each(trained, again.untrained(0), plan.clips[plan.share()[0]], CLIPS)
    assert again.state_dict() == position.state_dict()


def test_a_damaged_plan_file_is_planned_again_and_old_epochs_removed(table, tmp_path: Path) -> None:
    planner = _filed(table, tmp_path)
    made = planner.plan(0).clips.copy()
    path = planner.files.path(f"{planner.global_key}-0")
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0xFF
    path.write_bytes(bytes(raw))
    again = _filed(table, tmp_path)
    assert np.array_equal(again.plan(0).clips, made)
    last = planfiles.EPOCHS_KEPT_BEHIND + 2
    for epoch in range(1, last + 1):
        again.plan(epoch)
    kept = sorted(int(p.stem.rpartition("-")[2]) for p in tmp_path.glob("*.plan") if planfiles.BUCKETS not in p.name)
    assert kept == list(range(last - planfiles.EPOCHS_KEPT_BEHIND, last + 1))


def test_an_unwritable_directory_plans_in_the_process(table, tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    planner = _filed(table, blocked / "plans")
    assert planner.plan(0) == EpochPlanner(table, BATCHING).plan(0)


def test_buckets_handed_over_are_the_planners_own(table) -> None:
    """The coordinator process takes the trainer process's buckets (its start file): the same
    plan key and epochs, none made again."""
    made = EpochPlanner(table, BATCHING, workers=2, worker=1)
    members = np.concatenate([b.members for b in made.buckets]).astype(np.int32)
    shapes = [[b.max_tokens, b.max_frames, b.rows, len(b.members)] for b in made.buckets]
    taken = EpochPlanner(table, BATCHING, workers=2, worker=1, buckets=stored_buckets(table, shapes, members))
    assert taken.buckets == made.buckets and taken.key == made.key and taken.global_key == made.global_key
    assert taken.plan(3) == made.plan(3) and taken.shapes == made.shapes
    with pytest.raises(ValueError, match="bucket members"):
        stored_buckets(table, shapes, members[:-1])


def test_the_buckets_file_is_keyed_by_the_clips_lengths_and_the_config(table, tmp_path: Path) -> None:
    """Another batching config, or another split, finds buckets of its own, not the first's."""
    first = _filed(table, tmp_path)
    other = EpochPlanner(table, dataclasses.replace(BATCHING, num_buckets=BATCHING.num_buckets + 1),
                         files=PlanFiles(tmp_path))
    split = _filed(table, tmp_path, world=2)
    assert len(list(tmp_path.glob(f"*{planfiles.BUCKETS}.plan"))) == 3
    for planner, cfg, world in ((first, BATCHING, 1), (other, other.cfg, 1), (split, BATCHING, 2)):
        assert planner.buckets == plan_module.make_buckets(table, cfg, world)


def test_rows_outside_an_empty_plan_have_no_batch(tmp_path: Path) -> None:
    empty = EpochPlanner(SampleTable.from_samples([]), BATCHING, files=PlanFiles(tmp_path)).plan(0)
    assert len(empty) == 0 and empty.batch_of(np.array([-1, 0, 5])).tolist() == [-1, -1, -1]
    assert empty.batch_of_row(0) == -1
