"""One pool of producers for the torchrun ranks of a host (pipeline.producers_per: host).

Every local rank's feed binds its own endpoint and writes it in its worker directory
(``listening.json``: the endpoint, the rank's pid and that process's start time); local rank
0 reads the files of its host's ranks (torchrun numbers them RANK - LOCAL_RANK on), each
once the process it names is alive, so a file an earlier attempt left behind is never taken,
and starts the pool with a link to every endpoint. docs/design/training.md, "torchrun ranks",
has the story.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .shared.cluster import TORCHRUN, Cluster, worker_dir_name
from .shared.errors import UserError
from .shared.runfiles import LISTENING, write_json
from .shared.runlock import process_start

log = logging.getLogger("stoker")

# Local rank 0 waits this long for every rank of its host to bind (they start together:
# their feeds' dataset index and plan come first).
PEER_WAIT_S = 300.0
# How often local rank 0 looks for the files not found yet.
LOOK_EVERY_S = 0.05


class PoolError(UserError):
    """A rank of this host never said where its trainer listens; one line for the user."""


@dataclass(frozen=True)
class HostPool:
    """The ranks of this host and where they write their endpoints (``job_dir``/worker-R)."""

    job_dir: Path
    rank: int
    local_rank: int
    local_size: int

    @classmethod
    def of(cls, cluster: Cluster | None, producers_per: str, run_dir: Path) -> "HostPool | None":
        """The pool this rank takes part in: torchrun with several ranks on this host and
        pipeline.producers_per host; None otherwise (each trainer its own producers)."""
        if (producers_per != "host" or cluster is None or cluster.source != TORCHRUN or cluster.local_rank is None
                or cluster.local_size is None or cluster.local_size < 2):
            return None
        return cls(run_dir.parent, cluster.index, cluster.local_rank, cluster.local_size)

    @property
    def starts(self) -> bool:
        """This rank starts the pool (local rank 0); the others' trainers are served by it."""
        return self.local_rank == 0

    def ranks(self) -> range:
        """The global ranks of this host, local rank 0 first."""
        first = self.rank - self.local_rank
        return range(first, first + self.local_size)

    def file(self, rank: int) -> Path:
        return self.job_dir / worker_dir_name(rank) / LISTENING

    def publish(self, endpoint: str) -> None:
        """Say where this rank's trainer listens (written whole: a temporary file renamed)."""
        pid = os.getpid()
        write_json(self.file(self.rank), {"endpoint": endpoint, "pid": pid, "started": process_start(pid)})

    def endpoints(self, wait_s: float = PEER_WAIT_S) -> list[str]:
        """Every local rank's endpoint, in rank order, once each has published it from a live
        process; PoolError (one line) after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        found: dict[int, str] = {}
        while True:
            for rank in self.ranks():
                if rank not in found:
                    endpoint = live_endpoint(self.file(rank))
                    if endpoint is not None:
                        found[rank] = endpoint
            if len(found) == self.local_size:
                log.info("one producer pool for the %d ranks of this host: %s", self.local_size,
                         ", ".join(found[r] for r in self.ranks()))
                return [found[r] for r in self.ranks()]
            if time.monotonic() >= deadline:
                missing = [r for r in self.ranks() if r not in found]
                raise PoolError(f"pipeline.producers_per host: rank {missing[0]} of this host did not bind its "
                                f"stoker.Feed within {wait_s:g} s (no {LISTENING} of a live process in "
                                f"{self.file(missing[0]).parent}): every rank makes its feed, with the same "
                                f"run directory and pipeline.producers_per")
            time.sleep(LOOK_EVERY_S)  # a poll of files other processes write, with a deadline


def live_endpoint(path: Path) -> str | None:
    """The endpoint ``path`` names, if the process that wrote it is alive (the same pid and
    start time); None for no file yet, a file being replaced or an earlier attempt's."""
    try:
        said = json.loads(path.read_text(encoding="utf-8"))
        endpoint, pid, started = str(said["endpoint"]), int(said["pid"]), float(said["started"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.debug("%s is not readable yet: %s", path, exc)
        return None
    return endpoint if process_start(pid) == started else None  # else gone: an earlier attempt's
