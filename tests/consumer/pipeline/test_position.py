"""The input position: what a checkpoint saves of the epoch plans trained, and what a resume
leases from it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stoker.consumer.pipeline.plan import EpochPlanner
from stoker.consumer.pipeline.position import InputPosition
from stoker.shared.config import BatchingConfig
from tests.factories import make_samples


def _cfg(**kw) -> BatchingConfig:
    return BatchingConfig(**{"batch_size": 16, "num_buckets": 4, "frames_multiple": 16, "tokens_multiple": 8,
                             "seed": 1234, **kw})


def test_position_marks_an_epoch_complete_when_every_sample_is_trained_or_rejected() -> None:
    samples = make_samples(40, seed=21)
    planner = EpochPlanner(samples, _cfg(batch_size=8))
    position = InputPosition(planner)
    plan = planner.plan(0)
    for batch in plan[:-1]:
        position.record(0, batch.ids)
    rejected = {0: 0}
    assert position.update_complete(1, rejected.get) == 0
    assert position.trained(0) == 40 - len(plan[-1].ids)
    rejected[0] = len(plan[-1].ids)  # the last batch's clips were all rejected meanwhile
    assert position.update_complete(1, rejected.get) == 1 and position.complete == {0}
    assert position.trained(0) == planner.samples_per_epoch
    # The state round-trips through JSON; a fresh epoch opens where the last one ended.
    again = InputPosition.from_state_dict(json.loads(json.dumps(position.state_dict())), planner)
    assert again.complete == {0} and again.first_open() == 1 and again.remaining(planner.plan(1)) == planner.plan(1)
    copy = position.copy()
    copy.record(1, plan[0].ids)
    assert position.trained(1) == 0 and copy.trained(1) == len(plan[0].ids)


def test_a_workers_position_counts_planned_batches_taken_even_empty_ones() -> None:
    samples = make_samples(9, seed=21)
    planner = EpochPlanner(samples, _cfg(batch_size=4, num_buckets=1), workers=2, worker=1)
    plan = planner.plan(0)  # 9 clips in global batches of 8: the second's share for worker 1 is empty
    assert [len(b.ids) for b in plan] == [4, 0]
    position = InputPosition(planner)
    assert [b.index for b in position.remaining(plan)] == [0, 1]
    position.record(0, plan[0].ids[:3], index=plan[0].index)  # one of its clips was rejected: still done
    assert [b.index for b in position.remaining(plan)] == [1] and position.update_complete(1, lambda e: 0) == 0
    position.record(0, [], index=plan[1].index)
    assert position.remaining(plan) == [] and position.update_complete(1, lambda e: 0) == 1
    again = InputPosition.from_state_dict(position.state_dict(), planner)
    assert again.complete == {0}


@pytest.mark.parametrize("fixed", [False, True], ids=["real-rows", "fixed-rows"])
def test_a_partly_trained_batch_resumes_with_only_its_untrained_rows(fixed: bool) -> None:
    """On resume a planned batch cut to its untrained clips keeps index, bucket and shape; its
    B is those clips (only real rows) unless rows are fixed."""
    samples = make_samples(40, seed=21)
    planner = EpochPlanner(samples, _cfg(batch_size=8, fixed_rows=fixed))
    position = InputPosition(planner)
    plan = planner.plan(0)
    position.record(0, plan[0].ids[:3])
    position.record(0, plan[1].ids, clips=plan[1].clips)  # rows given by the batch, or looked up: the same
    state = position.state_dict()
    assert state["open"]["0"] == {"done": [plan[1].index], "ids": sorted(plan[0].ids[:3])}  # named by id
    again = InputPosition.from_state_dict(state, planner)
    left = again.remaining(plan)
    assert position.copy().remaining(plan) == left and position.copy().state_dict() == state
    assert [b.index for b in left] == [0] + [b.index for b in plan[2:]]
    cut = left[0]
    assert cut.ids == plan[0].ids[3:] and (cut.bucket, cut.shape) == (plan[0].bucket, plan[0].shape)
    assert cut.rows == (8 if fixed else 5)
    assert sorted([*plan[0].ids[:3], *plan[1].ids, *(i for b in left for i in b.ids)]) == sorted(s.id for s in samples)


def _delivery(rng: np.random.Generator, planner: EpochPlanner, epoch: int) -> tuple[int, list[int]]:
    """A random batch as the coordinator could deliver it: a planned batch whole, part of one,
    with rows twice, with rows of another batch or outside the table, or rows in another order."""
    plan = planner.plan(epoch)
    index = int(rng.integers(len(plan)))
    rows = list(plan[index].clips)
    kind = rng.integers(6)
    if kind == 1:
        rows = rows[:int(rng.integers(1, len(rows) + 1))]
    elif kind == 2:
        rows = rows + [rows[int(rng.integers(len(rows)))]]
    elif kind == 3:
        rows = rows[1:] + [int(rng.choice(list(plan[int(rng.integers(len(plan)))].clips)))]
    elif kind == 4:
        rows = rows[1:] + [int(rng.choice([-1, len(planner.table), len(planner.table) + 7]))]
    rng.shuffle(rows)
    return index, rows


@pytest.mark.parametrize("seed", range(6))
def test_a_batch_counted_whole_leaves_the_position_as_counting_each_row_does(seed: int, caplog) -> None:
    """InputPosition.record with ``whole`` (EpochPlanner.is_whole said so) against row by row: the
    same state, counts and warnings, through partial batches, duplicates, strays and repeats."""
    rng = np.random.default_rng(seed)
    planner = EpochPlanner(make_samples(60, seed=seed), _cfg(batch_size=int(rng.choice([4, 8, 16]))))
    fast, rows_only = InputPosition(planner), InputPosition(planner)
    wholes = 0
    for _ in range(120):
        epoch = int(rng.integers(3))
        index, rows = _delivery(rng, planner, epoch)
        ids = [planner.table.string("id", r) if 0 <= r < len(planner.table) else f"NOT{r}" for r in rows]
        whole = index if planner.is_whole(epoch, index, rows) else None
        wholes += whole is not None
        caplog.clear()
        fast.record(epoch, ids, None, rows, whole)
        told = [r.getMessage() for r in caplog.records]
        caplog.clear()
        rows_only.record(epoch, ids, None, rows)
        assert [r.getMessage() for r in caplog.records] == told
        assert fast.state_dict() == rows_only.state_dict()
        assert fast.trained_counts() == rows_only.trained_counts()
        assert [fast.done_batches(e) for e in range(3)] == [rows_only.done_batches(e) for e in range(3)]
    assert wholes  # the fast way was taken


def test_is_whole_wants_every_clip_of_the_batch_once() -> None:
    planner = EpochPlanner(make_samples(40, seed=3), _cfg(batch_size=8))
    batch = planner.plan(1)[2]
    rows = list(batch.clips)
    assert planner.is_whole(1, 2, rows) and planner.is_whole(1, 2, rows[::-1])
    assert not planner.is_whole(1, 2, rows[1:]) and not planner.is_whole(1, 2, rows[1:] + rows[:1] * 2)
    assert not planner.is_whole(1, 3, rows) and not planner.is_whole(1, len(planner.plan(1)), rows)
    assert not planner.is_whole(1, 2, [])
    planner.plan(2), planner.plan(3)  # epoch 1's plan no longer kept: not made again to answer
    assert not planner.is_whole(1, 2, rows)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_update_complete_looking_at_begun_and_rejected_epochs_only_marks_what_a_full_scan_does(seed: int,
                                                                                           workers: int) -> None:
    """The epochs complete, against the rule applied to every epoch of the budget."""
    rng = np.random.default_rng(seed)
    planner = EpochPlanner(make_samples(30, seed=seed), _cfg(batch_size=8), workers=workers, worker=workers - 1)
    budget = 12
    position = InputPosition(planner)
    rejected: dict[int, int] = {}

    def complete(epoch: int) -> bool:
        if workers > 1:
            return len(position.done_batches(epoch)) == len(planner.plan(epoch))
        return position.trained(epoch) + rejected.get(epoch, 0) >= planner.samples_in(epoch)

    for _ in range(80):
        epoch = int(rng.integers(budget + 2))
        if rng.random() < 0.3:  # rejections, some of a whole epoch nothing of which was trained
            rejected[epoch] = min(planner.samples_in(epoch), rejected.get(epoch, 0) + int(rng.integers(1, 40)))
        else:
            plan = planner.plan(epoch)
            batch = plan[int(rng.integers(len(plan)))]
            position.record(epoch, batch.ids, batch.index if workers > 1 else None, batch.clips)
        expected = position.complete | {e for e in range(budget) if complete(e)}
        assert position.update_complete(budget, lambda e: rejected.get(e, 0), list(rejected)) == len(expected)
        assert position.complete == expected
