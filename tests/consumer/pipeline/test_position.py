"""The input position: what a checkpoint saves of the epoch plans trained, and what a resume
leases from it."""

from __future__ import annotations

import json

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
