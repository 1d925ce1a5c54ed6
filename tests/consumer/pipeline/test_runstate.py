"""A feed's state (consumer/pipeline/runstate.py): plain JSON values holding the input position's bit
arrays, and the state of the format before still taken."""

from __future__ import annotations

import json

import pytest

from stoker.consumer.pipeline.checkpoint import plan_identity
from stoker.consumer.pipeline.plan import EpochPlanner
from stoker.consumer.pipeline.position import InputPosition
from stoker.consumer.pipeline.runstate import FeedStateError, feed_state, position_of
from stoker.shared.config import BatchingConfig
from tests.factories import make_samples

BATCHING = BatchingConfig(batch_size=4, num_buckets=3, seed=7)


def _trained() -> tuple[EpochPlanner, InputPosition]:
    planner = EpochPlanner(make_samples(30, seed=3), BATCHING)
    position = InputPosition(planner)
    plan = planner.plan(0)
    for batch in plan[:3]:
        position.record(0, batch.ids)
    position.record(0, plan[3].ids[:1])
    return planner, position


def test_a_feed_state_is_json_and_resumes_the_same_position() -> None:
    planner, position = _trained()
    identity = plan_identity(planner, "data-1")
    state = json.loads(json.dumps(feed_state(9, position, identity)))  # what a user saves: JSON
    again, step = position_of(state, identity, planner)
    assert step == 9 and again.state_dict() == position.state_dict()
    assert again.remaining(planner.plan(0)) == position.remaining(planner.plan(0))


def test_a_feed_state_of_the_format_before_still_resumes() -> None:
    planner, position = _trained()
    identity = plan_identity(planner, "data-1")
    plan = planner.plan(0)
    old = {"format": 1, "step": 4, "plan": identity["fingerprint"], "dataset_fingerprint": "data-1",
           "batches_per_epoch": identity["batches_per_epoch"],
           "position": {"complete_below": 0, "complete": [], "open": {"0": {"done": [0, 1, 2],
                                                                            "ids": [plan[3].ids[0]]}}}}
    again, step = position_of(old, identity, planner)
    assert step == 4 and again.state_dict() == position.state_dict()


def test_a_feed_state_whose_position_is_not_one_is_one_line() -> None:
    planner, position = _trained()
    identity = plan_identity(planner, "data-1")
    state = feed_state(9, position, identity)
    with pytest.raises(FeedStateError, match="not the base64 of a saved position"):
        position_of({**state, "position": "not base64!"}, identity, planner)
    with pytest.raises(FeedStateError, match="formats 1 to 2"):
        position_of({**state, "format": 3}, identity, planner)
