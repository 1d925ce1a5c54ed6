"""The scheduler on a virtual clock, with scripted producers that speak to it through events:
the bench of the scheduler's tests (test_scheduler.py, test_leases.py, test_credits.py,
test_replan.py, test_peers.py)."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from stoker.consumer.buffer import BatchQueue
from stoker.consumer.coordinator.leases import ValidationSet
from stoker.consumer.plan import EpochPlanner, validation_batches
from stoker.consumer.coordinator.scheduler import Scheduler
from stoker.shared import wire
from stoker.shared.dataset.types import Sample
from tests.consumer.harness import hello_of, make_config, samples
from tests.factories import make_batch


IDS = {s.id for s in samples(12)}


class Bench:
    """A scheduler with a queue, and scripted producers that speak to it through events."""

    def __init__(self, max_epochs: int | None = 1, dataset: Any = None, count: int = 12, workers: int = 1,
                 worker: int = 0, held: list[Sample] = (), fixed_rows: bool = False, shards: int = 0,
                 **pipeline: Any) -> None:
        """``count`` clips; ``workers``/``worker``: the plan is that trainer worker's share;
        ``held``: held-out clips, leased in validation passes into ``val_queue``; ``fixed_rows``:
        batches keep their bucket's rows (row_mask on); ``shards``: the clips are members of this
        many tar shards (batches grouped by shard: consumer/shard_order.py)."""
        self.cfg = make_config(**pipeline)
        self.cfg = dataclasses.replace(self.cfg, batching=dataclasses.replace(self.cfg.batching, fixed_rows=fixed_rows))
        self.queue = BatchQueue(self.cfg.pipeline.buffer_size)
        self.val_queue = BatchQueue(2)
        self.rejected: list = []
        clips = samples(count)
        if shards:
            clips = [c._replace(audio=f"s-{n % shards}.tar#{c.id}.flac@{512 * n}+512") for n, c in enumerate(clips)]
        planner = EpochPlanner(clips, self.cfg.batching, workers=workers, worker=worker)
        validation = ValidationSet(validation_batches(held, planner), self.val_queue) if held else None
        self.scheduler = Scheduler(self.cfg, planner, self.queue, max_epochs=max_epochs,
                                   on_rejected=self.rejected.extend, dataset=dataset, validation=validation)
        self.now = 0.0
        self.inbox: dict[bytes, list[Any]] = collections.defaultdict(list)  # shared/wire.py's messages
        self.frames: dict[bytes, list[list[Any]]] = collections.defaultdict(list)  # each message's frames
        self.held: dict[bytes, dict[int, wire.Lease]] = collections.defaultdict(dict)  # leases by producer

    def send(self, who: bytes, msg: wire.Body, arrays: dict[str, np.ndarray] | None = None, fd: int = -1) -> None:
        self.send_frames(who, msg.encode(arrays), fd)

    def send_frames(self, who: bytes, frames: list[Any], fd: int = -1) -> None:
        self.scheduler.on_message(who, frames, self.now, fd)
        self._collect()

    def _collect(self) -> None:
        """The scheduler's messages, as a producer reads them (a REFUSE of another version: only its frames)."""
        for identity, msg, version in self.scheduler.take_outbox():
            frames = msg.encode(version=version)
            self.frames[identity].append(frames)
            if version == wire.PROTOCOL_VERSION:
                self.inbox[identity].append(wire.read(frames)[0])

    def take(self, who: bytes, kind: str) -> list[Any]:
        """The messages of ``kind`` sent to ``who`` since the last take, removed."""
        got = [m for m in self.inbox[who] if m.KIND == kind]
        self.inbox[who] = [m for m in self.inbox[who] if m.KIND != kind]
        return got

    def hello(self, who: bytes, fd: int = -1, **fields: Any) -> None:
        self.send(who, hello_of(who.decode(), **fields), fd=fd)

    def deliver(self, who: bytes, lease: wire.Lease, missed: list[str] = ()) -> None:
        ids = [i for i in lease.ids if i not in missed]
        shape = lease.shape
        rows = lease.rows if self.scheduler.planner.fixed_rows else len(ids)  # as a producer collates
        arrays = make_batch(rows, shape[0], shape[1], self.cfg.features.n_mels, valid=len(ids))
        if "row_mask" in self.scheduler.schema.names:
            arrays["row_mask"] = (np.arange(rows) < len(ids)).astype(np.float32)
        self.send(who, wire.Batch(lease.lease, lease.epoch, lease.index, tuple(ids),
                                  missed=tuple(wire.Entry(i, "no file") for i in missed)), arrays)

    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.scheduler.tick(self.now)
        self._collect()

    def take_items(self, queue: BatchQueue) -> list[Any]:
        """The trainer takes every batch of ``queue`` (each take frees a slot)."""
        items = []
        while (got := queue.get(0)) is not None:
            items.append(got[0])
            self.scheduler.on_free(self.now)
            self._collect()
        return items

    def drain_queue(self) -> list[str]:
        """The trainer takes every queued batch (each take frees a slot); the ids trained."""
        trained = []
        while (got := self.queue.get(0)) is not None:
            trained += got[0].ids
            self.scheduler.on_free(self.now)
            self._collect()
        return trained

    def work(self, who: bytes, missing: set[str] = frozenset()) -> int:
        """``who`` makes every lease it holds ready and delivers every credited one; the
        batches it delivered."""
        delivered = 0
        for lease in self.take(who, wire.LEASE):
            self.held[who][lease.lease] = lease
            self.send(who, wire.Ready(lease.lease))
        for credit in self.take(who, wire.CREDIT):
            lease = self.held[who].pop(credit.lease)
            self.deliver(who, lease, missed=[i for i in lease.ids if i in missing])
            delivered += 1
        return delivered

    def credited(self, who: bytes) -> wire.Lease:
        """``who`` joins, takes its one lease (lease_ahead=1), says it is READY and gets the
        CREDIT: the lease, ready to be delivered."""
        self.hello(who)
        lease, = self.take(who, wire.LEASE)
        self.send(who, wire.Ready(lease.lease))
        assert len(self.take(who, wire.CREDIT)) == 1
        return lease
