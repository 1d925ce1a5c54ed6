"""The scheduler's figures for summary.json and the trainer's thread: messages dropped by
reason, leases re-issued, clips missed and rejected per epoch, each producer's batches, and
the failovers of producers that went holding leases. Kept under one lock, since the trainer's
thread reads them while the coordinator's writes.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any

from .leases import Lease
from .peers import ProducerStats
from ..plan import PlannedBatch
from ...shared import wire

log = logging.getLogger("consumer.coordinator")


@dataclass
class Failover:
    """A producer that left or died holding leases, and how fast its work moved on."""

    producer: str
    status: str
    leases: int
    silent_s: float  # from its last message to being declared gone
    last_heard_unix: float
    declared_unix: float
    reissued: int = 0
    reissued_unix: float | None = None  # when the last of its batches was leased to another

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        done = self.reissued_unix
        out["reissue_after_last_heard_s"] = round(done - self.last_heard_unix, 3) if done else None
        out["reissue_after_declared_s"] = round(done - self.declared_unix, 3) if done else None
        return out


class Figures:
    """The figures (module docstring); ``producers`` are the peers' (consumer/coordinator/peers.py),
    ``lock`` guards them all."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.producers: dict[str, ProducerStats] = {}
        self.dropped: collections.Counter[str] = collections.Counter()
        self.reissued = 0
        self.missed = 0
        self.failovers: list[Failover] = []
        self._epoch_rejected: collections.Counter[int] = collections.Counter()
        # (epoch, index) of a batch put back from a gone producer -> its failover, until leased again.
        self._orphans: dict[tuple[int, int], Failover] = {}

    def count(self, reason: str, detail: str = "") -> None:
        """A message dropped for ``reason``."""
        with self.lock:
            self.dropped[reason] += 1
            first = self.dropped[reason] == 1
        # The first of each reason is worth a warning; repeats (a flood) only at debug level.
        log.log(logging.WARNING if first else logging.DEBUG, "dropped a message (%s) %s; further ones are "
                "counted in summary.json", reason, detail)

    def rejected(self, epoch: int, count: int) -> None:
        """``count`` clips of ``epoch`` rejected (a validation pass's count in no epoch)."""
        if epoch >= 0:
            with self.lock:
                self._epoch_rejected[epoch] += count

    def rejected_in_epoch(self, epoch: int) -> int:
        """Samples of ``epoch`` rejected while the run went on (they will not be trained)."""
        with self.lock:
            return self._epoch_rejected[epoch]

    def reissue(self, count: int) -> None:
        with self.lock:
            self.reissued += count

    def failover(self, failover: Failover) -> None:
        with self.lock:
            self.failovers.append(failover)

    def lacks(self, name: str, count: int) -> None:
        """Producer ``name`` lacks ``count`` clips so far."""
        with self.lock:
            stats = self.producers.get(name)
            if stats is not None:
                stats.lacks = count

    def orphaned(self, batch: PlannedBatch, failover: Failover | None) -> None:
        """``batch`` was put back from the gone producer of ``failover`` (None: not from one)."""
        if failover is not None:
            self._orphans[(batch.epoch, batch.index)] = failover

    def leased(self, name: str, batch: PlannedBatch, after_join_s: float, now_unix: float) -> None:
        """``batch`` was leased to producer ``name`` ``after_join_s`` after it joined (at
        ``now_unix``): a gone producer's batch counts as re-issued for its failover."""
        orphan = self._orphans.pop((batch.epoch, batch.index), None)
        with self.lock:
            stats = self.producers.get(name)
            if stats is not None and stats.first_lease_ms is None:
                stats.first_lease_ms = round(after_join_s * 1e3, 3)
            if orphan is not None:
                orphan.reissued += 1
                orphan.reissued_unix = now_unix

    def error(self, name: str, text: str) -> None:
        with self.lock:
            self.producers[name].last_error = text

    def delivered(self, name: str, msg: wire.Batch, lease: Lease, delivered: int, rejected: int,
                  missed: int) -> None:
        """The delivering producer's figures for its BATCH."""
        cache = msg.cache or {}
        with self.lock:
            stats = self.producers[name]
            stats.batches += 1
            stats.samples += delivered
            stats.rejected += rejected
            stats.misses += missed
            self.missed += missed
            if msg.prep_ms is not None:
                stats.prep_ms_total += msg.prep_ms
            # Time the prepared batch waited for its credit: high when the trainer is the limit.
            stats.credit_wait_ms_total += max(0.0, lease.credited_t - lease.ready_t) * 1e3
            stats.cache_hits += cache.get("hits", 0)
            stats.cache_computed += cache.get("computed", 0)
            stats.cache_stale += cache.get("stale", 0)
            stats.cache_corrupt += cache.get("corrupt", 0)
            stats.read_retries += msg.read_retries or 0
            stats.model_runs += cache.get("model_runs", 0)
            stats.model_hits += cache.get("model_hits", 0)

    def snapshot(self, refusals: list[dict[str, str]]) -> dict[str, Any]:
        """The figures for summary.json; ``refusals``: the producers refused (peers.py)."""
        with self.lock:
            return {
                "producers": [p.to_json() for p in self.producers.values()],
                "rejected_messages": dict(self.dropped),
                "reissued_leases": self.reissued,
                "missed_samples": self.missed,
                "refused_producers": list(refusals),
                "failovers": [f.to_json() for f in self.failovers],
            }
