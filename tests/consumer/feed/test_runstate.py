"""A feed's state (consumer/feed/runstate.py): plain JSON values holding the input position's bit
arrays, and the state of the format before still taken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stoker.consumer.feed.checkpoint import legacy_fingerprint, plan_identity
from stoker.consumer.plan import EpochPlanner
from stoker.consumer.position import InputPosition
from stoker.consumer.feed.runstate import FeedStateError, feed_state, position_of
from stoker.shared.config import BatchingConfig, DataConfig, FeaturesConfig
from stoker.consumer.index.index import build_index
from tests.factories import make_dataset, make_samples

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


def test_a_feed_state_with_the_plan_fingerprint_of_the_form_before_still_resumes() -> None:
    planner, position = _trained()
    identity = plan_identity(planner, "data-1")
    state = {**feed_state(9, position, identity), "plan": legacy_fingerprint(planner)}
    again, step = position_of(state, identity, planner)
    assert step == 9 and again.state_dict() == position.state_dict()
    other = EpochPlanner(make_samples(30, seed=4), BATCHING)  # other clips: another plan of either form
    with pytest.raises(FeedStateError, match="another epoch plan"):
        position_of({**state, "plan": legacy_fingerprint(other)}, identity, planner)
    with pytest.raises(FeedStateError, match="another epoch plan"):
        position_of({**state, "plan": plan_identity(other, "data-1")["fingerprint"]}, identity, planner)


def test_the_plan_identity_over_a_fresh_index_is_the_one_over_its_cache_file(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    make_dataset(tmp_path / "data", count=12)
    data, features = DataConfig(path=str(tmp_path / "data")), FeaturesConfig()
    cold, warm = build_index(data, features), build_index(data, features)
    assert (cold.stats.cache, warm.stats.cache) == ("miss", "hit")
    assert cold.samples.stored_in is None and warm.samples.stored_in is not None  # made; read from its header
    fingerprints = [plan_identity(EpochPlanner(index.samples, BATCHING), "d")["fingerprint"] for index in (cold, warm)]
    held_out = [plan_identity(EpochPlanner(index.samples.take(range(1, 12)), BATCHING), "d")["fingerprint"]
                for index in (cold, warm)]
    assert fingerprints[0] == fingerprints[1] and held_out[0] == held_out[1] != fingerprints[0]
