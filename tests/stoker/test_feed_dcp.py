"""stoker/feed_dcp.py: a feed's state through torch.distributed.checkpoint (one process, no
process group) comes back whole into a feed that has not started, each trainer worker's under
its own key; a checkpoint with no state for this worker is one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stoker.feed_dcp import SINGLE_KEY, DistributedState, state_key
from stoker.feed_staging import FeedError
from stoker.shared.cluster import TORCHRUN, Cluster

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

SAVED = {"step": 7, "position": {"epochs": {"0": {"done": [0, 2], "partial": {"1": ["A", "B"]}}}}, "plan": "x"}


class FakeFeed:
    """A feed's state side: started with SAVED, or not started with nothing loaded yet."""

    def __init__(self, started: bool) -> None:
        self.started = started
        self.loaded: dict[str, Any] | None = None

    def stateful(self, key: str) -> DistributedState:
        return DistributedState(lambda: SAVED, self.load, lambda: self.started, key)

    def load(self, state: dict[str, Any]) -> None:
        self.loaded = state


def test_keys_one_per_trainer_worker() -> None:
    assert state_key(None) == SINGLE_KEY
    assert state_key(Cluster(size=1, index=0, source=TORCHRUN)) == SINGLE_KEY
    assert state_key(Cluster(size=2, index=1, source=TORCHRUN)) == "worker-1"


def test_a_saved_state_loads_into_a_feed_not_yet_started(tmp_path: Path) -> None:
    weights = torch.arange(4.0)
    dcp.save({"w": weights, "feed": FakeFeed(started=True).stateful("worker-1")}, checkpoint_id=tmp_path / "ckpt")
    later = FakeFeed(started=False)
    into = {"w": torch.zeros(4), "feed": later.stateful("worker-1")}
    dcp.load(into, checkpoint_id=tmp_path / "ckpt")
    assert later.loaded == SAVED and torch.equal(into["w"], weights)


def test_no_state_for_this_worker_is_one_line(tmp_path: Path) -> None:
    dcp.save({"feed": FakeFeed(started=False).stateful(SINGLE_KEY)}, checkpoint_id=tmp_path / "early")
    with pytest.raises(FeedError, match="no feed state under 'state': it was saved before its feed started"):
        dcp.load({"feed": FakeFeed(started=False).stateful(SINGLE_KEY)}, checkpoint_id=tmp_path / "early")
