"""A ``stoker.Feed``'s state for ``torch.distributed.checkpoint`` (``Feed.stateful()``): a
``Stateful`` that DCP saves and loads, also into a feed that has not started. docs/FEED.md,
PyTorch, is the user's side."""

from __future__ import annotations

import json
from typing import Any, Callable

from .feed_staging import FeedError
from .shared.cluster import Cluster, worker_dir_name

# The key of a feed's state where the job has one trainer.
SINGLE_KEY = "state"


def state_key(cluster: Cluster | None) -> str:
    """Each trainer worker's own key (``worker-R``): DCP keeps one copy of a value that every rank
    saves under one key, which would give every rank the first rank's position."""
    return worker_dir_name(cluster.index) if cluster is not None and cluster.size > 1 else SINGLE_KEY


class DistributedState:
    """The feed's state as one JSON string under its worker's key. One string, not the feed's
    nested state: ``dcp.load`` asks for the state first, to know what to read, and a feed that
    has not started knows its key but not the shape of what was saved."""

    def __init__(self, state: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None],
                 started: Callable[[], bool], key: str) -> None:
        self._state, self._load, self._started, self.key = state, load, started, key

    def state_dict(self) -> dict[str, str]:
        """What ``dcp.save`` writes; before the feed started, what ``dcp.load`` fills (the key)."""
        return {self.key: json.dumps(self._state()) if self._started() else ""}

    def load_state_dict(self, state: dict[str, str]) -> None:
        """The feed goes on from the saved state (FeedError, one line: none under this worker's key)."""
        saved = state.get(self.key, "")
        if not saved:
            raise FeedError(f"the checkpoint holds no feed state under {self.key!r}: it was saved before its "
                            "feed started, or by a job of other trainer workers")
        self._load(json.loads(saved))
