"""The scheduler as a pure state machine: events in (a producer's messages, a free slot, the
clock, connection events), messages out. No sockets, no threads, no timeouts: time is the
number each event carries."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import msgpack
import numpy as np
import pytest

from stoker.consumer.pipeline.buffer import BatchQueue
from stoker.consumer.pipeline.lease_tables import TokenTable
from stoker.consumer.pipeline.plan import EpochPlanner, validation_batches
from stoker.consumer.pipeline.peers import DISCONNECT_GRACE_S
from stoker.consumer.pipeline.leases import ValidationSet
from stoker.consumer.pipeline.replan import MAX_LEASE_FAILURES
from stoker.consumer.pipeline.scheduler import Scheduler
from stoker.shared import wire
from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.shared.dataset import Reference, Sample, build_index, deferred, describe_copy
from tests.consumer.pipeline.harness import hello_of, lacking, make_config, samples
from tests.factories import copy_described, fake_reference, fake_sha256, make_batch, make_dataset

IDS = {s.id for s in samples(12)}


class Bench:
    """A scheduler with a queue, and scripted producers that speak to it through events."""

    def __init__(self, max_epochs: int | None = 1, dataset: Any = None, count: int = 12, workers: int = 1,
                 worker: int = 0, held: list[Sample] = (), fixed_rows: bool = False, shards: int = 0,
                 **pipeline: Any) -> None:
        """``count`` clips; ``workers``/``worker``: the plan is that trainer worker's share;
        ``held``: held-out clips, leased in validation passes into ``val_queue``; ``fixed_rows``:
        batches keep their bucket's rows (row_mask on); ``shards``: the clips are members of this
        many tar shards (batches grouped by shard: consumer/pipeline/shard_order.py)."""
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


def test_hello_gets_welcome_and_lease_ahead_leases() -> None:
    b = Bench()
    b.hello(b"p1")
    welcome, = b.take(b"p1", wire.WELCOME)
    assert welcome.producer_name == "p1" and welcome.config.features.n_mels == 8
    leases = b.take(b"p1", wire.LEASE)
    assert len(leases) == 2 and leases[0].lease != leases[1].lease


def test_credits_never_exceed_the_free_slots_and_a_take_frees_exactly_one() -> None:
    b = Bench(lease_ahead=6, buffer_size=2)
    b.hello(b"p1")
    leases = b.take(b"p1", wire.LEASE)
    for lease in leases:
        b.send(b"p1", wire.Ready(lease.lease))
    credits = b.take(b"p1", wire.CREDIT)
    assert len(credits) == 2  # the queue holds 2
    by_id = {m.lease: m for m in leases}
    for c in credits:
        b.deliver(b"p1", by_id[c.lease])
    assert len(b.queue) == 2 and b.take(b"p1", wire.CREDIT) == []
    b.queue.get(0)
    b.scheduler.on_free(b.now)
    b._collect()
    assert len(b.take(b"p1", wire.CREDIT)) == 1


def test_a_later_epochs_batches_leave_a_slot_for_the_earliest_epochs_last_ones() -> None:
    b = Bench(max_epochs=2, lease_ahead=3, buffer_size=3)  # 12 clips: 3 batches an epoch
    b.hello(b"slow")  # takes epoch 0's batches
    b.hello(b"fast")  # takes epoch 1's, and is ready first
    for lease in b.take(b"fast", wire.LEASE):
        b.held[b"fast"][lease.lease] = lease
        b.send(b"fast", wire.Ready(lease.lease))
    assert b.work(b"fast") == 2 and len(b.queue) == 2  # the third slot stays free for epoch 0
    assert b.take(b"fast", wire.CREDIT) == []
    epoch0 = []
    while len(epoch0) < 3:  # a loop taking epoch 0 alone: its batches still find room
        b.work(b"slow")
        got = b.queue.get(0, up_to_epoch=0)
        assert got is not None, "epoch 0's batch found no slot"
        epoch0.append(got[0])
        b.scheduler.on_free(b.now)
        b._collect()
    assert {item.epoch for item in epoch0} == {0} and sorted(i for item in epoch0 for i in item.ids) == sorted(IDS)
    epoch1 = b.drain_queue()
    while b.work(b"fast") + b.work(b"slow"):
        epoch1 += b.drain_queue()
    assert sorted(epoch1) == sorted(IDS)  # then epoch 1, every clip once


@pytest.mark.parametrize("shards", [0, 3], ids=["files", "shards"])
def test_every_sample_exactly_once_with_two_producers_and_one_leaving_mid_epoch(shards: int) -> None:
    b = Bench(max_epochs=2, shards=shards)
    assert (b.scheduler.planner.shards is not None) == bool(shards)
    b.hello(b"p1")
    b.hello(b"p2")
    trained = []
    b.work(b"p1")
    b.work(b"p2")
    b.work(b"p1")
    trained += b.drain_queue()
    b.send(b"p2", wire.Bye())  # leaves holding leases: they go back to the plan
    for _ in range(40):
        b.work(b"p1")
        trained += b.drain_queue()
    counts = collections.Counter(trained)
    assert set(counts) == IDS and set(counts.values()) == {2}  # two epochs, each sample once per epoch


def test_a_silent_producer_is_presumed_dead_after_the_heartbeat_timeout_and_its_work_moves() -> None:
    b = Bench()
    b.hello(b"silent")
    held = {i for m in b.take(b"silent", wire.LEASE) for i in m.ids}
    b.hello(b"alive")
    b.tick(0.5)
    b.send(b"alive", wire.Heartbeat())
    b.tick(0.6)  # 1.1 s since "silent" spoke: past heartbeat_timeout_s=1.0
    assert [p["status"] for p in b.scheduler.snapshot()["producers"]] == ["dead", "alive"]
    trained = []
    for _ in range(20):
        b.work(b"alive")
        trained += b.drain_queue()
    assert held <= set(trained) and sorted(trained) == sorted(IDS)  # its work moved, nothing twice


def test_heartbeats_go_out_every_interval_and_a_ping_is_answered() -> None:
    b = Bench()
    b.hello(b"p1")
    b.tick(0.1)
    assert b.take(b"p1", wire.HEARTBEAT) == []
    b.tick(0.15)  # 0.25 s: past heartbeat_interval_s=0.2
    assert len(b.take(b"p1", wire.HEARTBEAT)) == 1
    b.send(b"p1", wire.Heartbeat(ping=7.5))
    pong, = b.take(b"p1", wire.HEARTBEAT)
    assert pong.pong == 7.5


def test_a_missed_clip_is_replanned_onto_a_producer_that_has_it() -> None:
    b = Bench(lease_ahead=1)
    lease = b.credited(b"lacking")
    missing = lease.ids[0]
    b.deliver(b"lacking", lease, missed=[missing])
    assert missing not in b.drain_queue()
    b.hello(b"full")
    replanned = [m for m in b.take(b"full", wire.LEASE) if missing in m.ids]
    assert replanned and all(missing not in m.ids for m in b.take(b"lacking", wire.LEASE))
    assert replanned[0].ids == (missing,) and replanned[0].rows == 1  # a batch of its own: only real rows
    assert b.scheduler.snapshot()["missed_samples"] == 1


def _rejecting(b: Bench, lease: wire.Lease, rows: int, mask: bool = False) -> None:
    """``p1`` delivers ``lease`` without its first clip (rejected) in a batch of ``rows`` rows."""
    ids = lease.ids[1:]
    tokens, frames = lease.shape
    arrays = make_batch(rows, tokens, frames, 8, valid=len(ids))
    if mask:
        arrays["row_mask"] = (np.arange(rows) < len(ids)).astype(np.float32)
    b.send(b"p1", wire.Batch(lease.lease, lease.epoch, lease.index, ids,
                             rejected=(wire.Entry(lease.ids[0], "unreadable"),)), arrays)


def test_a_batch_with_a_rejected_clip_carries_only_its_real_rows() -> None:
    """B is the clips delivered: a batch padded to the lease's rows is refused (re-planned);
    the one of only real rows is queued, as it came."""
    b = Bench(lease_ahead=1)
    lease = b.credited(b"p1")
    assert lease.rows == len(lease.ids) == 4
    _rejecting(b, lease, rows=4)  # an empty row
    again, = b.take(b"p1", wire.LEASE)
    assert b.scheduler.snapshot()["rejected_messages"] == {"bad_batch": 1} and len(b.queue) == 0
    b.send(b"p1", wire.Ready(again.lease))
    b.take(b"p1", wire.CREDIT)
    _rejecting(b, again, rows=3)
    queued = b.queue.get(0)[0]
    assert queued.ids == list(again.ids[1:]) and queued.arrays["mel_lengths"].shape == (3,)
    assert (queued.arrays["mel_lengths"] > 0).all() and queued.frames_computed == 3 * again.shape[1]


def test_with_fixed_rows_a_batch_keeps_the_leases_rows_and_marks_the_empty_ones() -> None:
    b = Bench(lease_ahead=1, fixed_rows=True)
    assert "row_mask" in b.scheduler.schema.names
    lease = b.credited(b"p1")
    welcome, = b.take(b"p1", wire.WELCOME)  # what the producer collates by
    assert welcome.fixed_rows is True and welcome.fields == "row_mask"
    _rejecting(b, lease, rows=3, mask=True)  # too few rows
    again, = b.take(b"p1", wire.LEASE)
    b.send(b"p1", wire.Ready(again.lease))
    b.take(b"p1", wire.CREDIT)
    _rejecting(b, again, rows=4)  # no row_mask
    assert b.scheduler.snapshot()["rejected_messages"] == {"bad_batch": 2} and len(b.queue) == 0
    third, = b.take(b"p1", wire.LEASE)
    b.send(b"p1", wire.Ready(third.lease))
    b.take(b"p1", wire.CREDIT)
    _rejecting(b, third, rows=4, mask=True)
    queued = b.queue.get(0)[0]
    assert queued.arrays["row_mask"].tolist() == [1.0, 1.0, 1.0, 0.0] and queued.arrays["mel_lengths"][3] == 0


def test_a_clip_every_live_producer_lacks_is_rejected_once_nothing_else_is_left() -> None:
    b = Bench(max_epochs=1)
    gone = sorted(IDS)[0]
    b.hello(b"p1")
    trained = []
    for _ in range(40):
        b.work(b"p1", missing={gone})
        trained += b.drain_queue()
    assert set(trained) == IDS - {gone} and len(trained) == len(IDS) - 1
    assert [r.id for r in b.rejected] == [gone]
    assert b.rejected[0].reason == "audio file missing on every producer host (test): no file"  # and the miss's why
    assert b.scheduler.rejected_in_epoch(0) == 1


def test_a_batch_that_does_not_match_its_lease_is_dropped_and_replanned() -> None:
    b = Bench(lease_ahead=1)
    lease = b.credited(b"p1")
    tokens, frames = lease.shape
    wrong = make_batch(lease.rows, tokens, frames + 16, 8, valid=len(lease.ids))
    b.send(b"p1", wire.Batch(lease.lease, lease.epoch, lease.index, lease.ids), wrong)
    again, = b.take(b"p1", wire.LEASE)
    assert again.ids == lease.ids and again.lease != lease.lease
    assert b.scheduler.snapshot()["rejected_messages"] == {"bad_batch": 1} and len(b.queue) == 0


def test_late_uncredited_and_foreign_batches_are_counted_and_dropped() -> None:
    b = Bench(lease_ahead=1)
    b.hello(b"p1")
    b.hello(b"p2")
    lease, = b.take(b"p1", wire.LEASE)
    b.deliver(b"p1", lease)  # no credit yet
    b.send(b"p1", wire.Ready(lease.lease))
    b.take(b"p1", wire.CREDIT)
    b.deliver(b"p2", lease)  # someone else's lease
    b.deliver(b"p1", lease)
    b.deliver(b"p1", lease)  # a late duplicate
    assert b.scheduler.snapshot()["rejected_messages"] == {"uncredited": 1, "wrong_producer": 1,
                                                           "unknown_lease": 1}
    assert len(b.queue) == 1


def test_garbage_and_strangers_are_counted_and_a_stranger_is_asked_to_rejoin_once_a_second() -> None:
    b = Bench()
    rng = np.random.default_rng(0)
    for _ in range(200):
        b.scheduler.on_message(b"x", [rng.bytes(int(rng.integers(0, 64))) for _ in range(int(rng.integers(0, 3)))],
                               b.now)
    b.send(b"stranger", wire.Heartbeat())
    b.send(b"stranger", wire.Heartbeat())
    assert len(b.take(b"stranger", wire.REFUSE)) == 1
    b.tick(1.0)
    b.send(b"stranger", wire.Heartbeat())
    refuse, = b.take(b"stranger", wire.REFUSE)
    assert refuse.rejoin is True
    assert sum(b.scheduler.snapshot()["rejected_messages"].values()) == 203


def test_a_closed_connection_means_dead_unless_a_new_one_takes_its_descriptor() -> None:
    b = Bench()
    b.hello(b"p1", fd=7)
    b.hello(b"p2", fd=8)
    b.scheduler.on_connection_closed(7, b.now)
    b.scheduler.on_connection_accepted(7)  # the close was of an older connection: p1 is on the new one
    b.scheduler.on_connection_closed(8, b.now)
    b.tick(DISCONNECT_GRACE_S + 0.01)
    status = {p["id"]: p["status"] for p in b.scheduler.snapshot()["producers"]}
    assert status == {"p1": "alive", "p2": "dead"}
    assert b.scheduler.snapshot()["rejected_messages"]["connection_dropped"] == 2


def test_stop_says_stop_to_every_producer_and_names_those_on_a_connection() -> None:
    b = Bench()
    b.hello(b"p1", fd=3)
    b.hello(b"p2")
    b.hello(b"p3", fd=4)
    b.scheduler.on_connection_closed(4, b.now)  # held against p3 for the grace: no BYE can come on it
    assert b.scheduler.stop() == [b"p1"]
    b._collect()
    assert all(len(b.take(p, wire.STOP)) == 1 for p in (b"p1", b"p2", b"p3"))
    assert {p["status"] for p in b.scheduler.snapshot()["producers"]} == {"stopped"}


def test_a_producer_with_another_dataset_is_refused_with_the_reason_and_given_nothing() -> None:
    b = Bench(dataset=fake_reference())
    b.hello(b"stranger", dataset=copy_described(fake_sha256("another dataset")))
    refuse, = b.take(b"stranger", wire.REFUSE)
    assert refuse.reason == (f"dataset on test does not match the trainer's: metadata.csv differs (SHA-256 "
                             f"{fake_sha256('another dataset')[:16]} there, {fake_sha256('trainer')[:16]} on the "
                             "trainer); point --data at a copy of the trainer's dataset")
    assert b.inbox[b"stranger"] == []  # no WELCOME, no lease
    snap = b.scheduler.snapshot()
    assert snap["refused_producers"] == [{"producer": "stranger", "host": "test", "reason": refuse.reason}]
    assert snap["producers"] == []


def test_a_copy_of_the_trainers_metadata_joins_and_a_clip_it_misses_is_trained_by_another_once() -> None:
    b = Bench(dataset=fake_reference(), max_epochs=2)
    b.hello(b"remote", dataset=copy_described())
    b.hello(b"local", dataset=deferred("metadata.csv"))
    assert b.take(b"remote", wire.WELCOME) and b.take(b"local", wire.WELCOME)
    gone = sorted(IDS)[0]  # absent on the remote host, or of another size there: missed when read
    trained: list[str] = []
    for _ in range(50):
        b.work(b"remote", missing={gone})
        b.work(b"local")
        trained += b.drain_queue()
    assert collections.Counter(trained) == collections.Counter(sorted(IDS) * 2)  # each clip once an epoch
    producers = {p["id"]: p for p in b.scheduler.snapshot()["producers"]}
    assert producers["remote"]["lacks"] == 1 and producers["remote"]["misses"] == 1  # not leased it again
    assert producers["local"]["lacks"] == 0 and b.rejected == []


def test_a_hello_of_the_previous_protocol_version_is_refused_in_that_version() -> None:
    """What a producer of version 3 sends; it reads the REFUSE, whose layout is every version's."""
    b = Bench()
    old = wire.PROTOCOL_VERSION - 1
    b.send_frames(b"old", [msgpack.packb({"v": old, "k": "hello", "a": [], "producer": "p0", "host": "h3", "pid": 9,
                                          "dataset": {}}, use_bin_type=True)])
    (frames,) = b.frames[b"old"]
    header = msgpack.unpackb(frames[0], raw=False)
    reason = (f"the producer speaks protocol version {old} and the trainer {wire.PROTOCOL_VERSION}: run the "
              "trainer's stoker version on host h3")
    assert header == {"v": old, "k": "refuse", "a": [], "reason": reason} and len(frames) == 1
    assert b.inbox[b"old"] == []  # no WELCOME, no lease
    snap = b.scheduler.snapshot()
    assert snap["refused_producers"] == [{"producer": "p0", "host": "h3", "reason": reason}]
    assert snap["producers"] == [] and snap["rejected_messages"] == {"bad_version": 1}
    b.hello(b"p1")  # a producer of this version joins as ever
    assert len(b.take(b"p1", wire.WELCOME)) == 1


def test_a_producer_lacking_a_config_key_the_trainer_sends_is_refused_naming_it() -> None:
    b = Bench()
    b.hello(b"old", config=lacking("transforms", "mel_norm"))
    refuse, = b.take(b"old", wire.REFUSE)
    assert refuse.reason == ("the producer's config schema differs from the trainer's (it lacks the config keys "
                             "transforms.mel_norm): run the trainer's stoker version on host test")
    assert b.inbox[b"old"] == []
    snap = b.scheduler.snapshot()
    assert snap["refused_producers"] == [{"producer": "old", "host": "test", "reason": refuse.reason}]
    assert snap["producers"] == [] and snap["rejected_messages"] == {}
    b.hello(b"other", config=wire.ConfigSchema(wire.CONFIG_VERSION + 1, wire.ConfigSchema.local().sections))
    refuse, = b.take(b"other", wire.REFUSE)
    assert f"config version {wire.CONFIG_VERSION + 1} here and {wire.CONFIG_VERSION} on the trainer" in refuse.reason


def test_the_welcome_carries_the_trainers_config_sections_as_they_are() -> None:
    b = Bench()
    b.hello(b"p1")
    welcome, = b.take(b"p1", wire.WELCOME)
    cfg = b.cfg
    assert welcome.config == wire.ProducerConfig(cfg.features, cfg.transforms, cfg.faults)
    assert (welcome.heartbeat_interval_s, welcome.ref_frames) == (cfg.pipeline.heartbeat_interval_s,
                                                                  cfg.batching.ref_frames)


def test_a_repeated_hello_of_one_session_is_welcomed_again_and_changes_nothing() -> None:
    b = Bench()
    b.hello(b"p", session="s1")
    b.take(b"p", wire.WELCOME)
    assert len(b.take(b"p", wire.LEASE)) == 2
    b.hello(b"p", session="s1")  # a retry that crossed the WELCOME
    assert len(b.take(b"p", wire.WELCOME)) == 1 and b.inbox[b"p"] == []  # no new lease, nothing re-planned
    snap = b.scheduler.snapshot()
    assert snap["reissued_leases"] == 0 and snap["producers"][0]["connections"] == 1


def test_a_workers_share_reaches_the_trainer_in_plan_order_through_a_credit_window() -> None:
    """Trainer workers take the same planned batch at each step: credits go to the earliest
    planned batches only, so the one the trainer waits for always finds room; an empty
    share is a batch too."""
    b = Bench(max_epochs=1, count=17, workers=2, worker=1, lease_ahead=4, buffer_size=2)
    plan = b.scheduler.planner.plan(0)
    assert any(not batch.ids for batch in plan)  # 17 clips, 8 a global batch: one lone clip's share
    b.hello(b"p1")
    b.hello(b"p2")
    taken = []
    for _ in range(60):
        b.work(b"p2")  # the later producer first: deliveries arrive out of plan order
        b.work(b"p1")
        ahead = [(0, batch.index) for batch in plan[len(taken):len(taken) + 2]]
        assert set(b.queue.positions()) <= set(ahead)  # never beyond the window of the next 2
        got = b.queue.get(0, ahead[0]) if ahead else None
        if got is not None:
            taken.append(got[0])
            b.scheduler.on_free(b.now)
            b._collect()
    assert [(t.index, t.ids) for t in taken] == [(batch.index, list(batch.ids)) for batch in plan]


def test_a_clip_a_workers_producer_lacks_is_rejected_not_replanned_into_an_extra_step() -> None:
    b = Bench(max_epochs=1, lease_ahead=1, workers=2, worker=0)
    lease = b.credited(b"lacking")
    missing = lease.ids[0]
    b.deliver(b"lacking", lease, missed=[missing])
    assert b.drain_queue() == [i for i in lease.ids if i != missing]
    assert [r.id for r in b.rejected] == [missing] and "missing on host test" in b.rejected[0].reason
    # what is left to do is the rest of the plan, each planned batch once: no extra batch for the clip
    left = [(m.epoch, m.index) for m in b.take(b"lacking", wire.LEASE)]
    left += [(batch.epoch, batch.index) for batch in b.scheduler.replan.pending]
    rest = [(0, batch.index) for batch in b.scheduler.planner.plan(0) if batch.index != lease.index]
    assert sorted(left) == sorted(rest)


def test_a_workers_earliest_batches_lost_with_a_producer_take_a_later_lease_slot() -> None:
    """In plan order, the producer that is left holds only later batches, which cannot be
    credited before the earliest: one of its leases is revoked so that it takes them."""
    b = Bench(max_epochs=1, count=48, workers=2, worker=0, lease_ahead=3, buffer_size=2)
    plan = b.scheduler.planner.plan(0)
    b.hello(b"early")
    early = b.take(b"early", wire.LEASE)
    b.hello(b"late")
    for lease in b.take(b"late", wire.LEASE):
        b.held[b"late"][lease.lease] = lease
        b.send(b"late", wire.Ready(lease.lease))
    assert [m.index for m in early] == [batch.index for batch in plan[:3]]
    assert b.take(b"late", wire.CREDIT) == []  # nothing of the window is its
    b.send(b"early", wire.Bye(tuple(m.lease for m in early)))
    revoked = b.take(b"late", wire.REVOKE)
    late = {lease_id: m.index for lease_id, m in b.held[b"late"].items()}
    assert sorted(late[r.lease] for r in revoked) == [batch.index for batch in plan[4:]]  # its latest two
    for r in revoked:
        b.held[b"late"].pop(r.lease)
    taken = []
    for _ in range(40):
        b.work(b"late")
        want = (0, plan[len(taken)].index) if len(taken) < len(plan) else None
        got = b.queue.get(0, want) if want else None
        if got is not None:
            taken.append(got[0].index)
            b.scheduler.on_free(b.now)
            b._collect()
        for r in b.take(b"late", wire.REVOKE):
            b.held[b"late"].pop(r.lease, None)
    assert taken == [batch.index for batch in plan]


# Held-out clips: five fit the training buckets (L 8, T 32), V005 is longer, V006 has more tokens.
HELD = [Sample(f"V{i:03d}", "text", 4 + i, 18 + 3 * i, 0.5) for i in range(5)] + [
    Sample("V005", "text", 6, 40, 0.5), Sample("V006", "text", 12, 20, 0.5)]


def test_validation_batches_take_the_smallest_training_shape_that_holds_each_clip() -> None:
    planner = EpochPlanner(samples(12), make_config().batching)
    batches = validation_batches(HELD, planner)
    assert sorted(i for b in batches for i in b.ids) == [s.id for s in HELD]
    by_id = {s.id: s for s in HELD}
    for b in batches:
        fits = [s for s in planner.shapes if all(by_id[i].num_frames <= s[2] and by_id[i].num_tokens <= s[1]
                                                 for i in b.ids)]
        if fits:  # the smallest training shape that holds every clip of the batch, its rows the clips'
            smallest = min(fits, key=lambda s: (s[2], s[1]))
            assert b.shape == smallest[1:] and b.rows == len(b.ids) <= smallest[0]
        else:  # clips no training bucket holds: buckets of their own, each clip within its shape
            assert set(b.ids) <= {"V005", "V006"} and b.shape not in [s[1:] for s in planner.shapes]
            assert all(by_id[i].num_frames <= b.shape[1] and by_id[i].num_tokens <= b.shape[0] for i in b.ids)
    assert [b.index for b in batches] == list(range(len(batches))) and {b.epoch for b in batches} == {0}
    assert validation_batches(list(reversed(HELD)), planner) == batches  # the same plan at every pass


def test_a_validation_pass_gives_every_held_out_clip_once_beside_a_full_training_queue_and_a_dying_producer():
    b = Bench(held=HELD, max_epochs=2, buffer_size=2, lease_ahead=2)
    b.hello(b"p1")
    b.hello(b"p2")
    while b.work(b"p1") + b.work(b"p2"):  # the training queue fills; the trainer, validating, takes none
        pass
    training = {lease.id: lease.batch for lease in b.scheduler.leases}
    queued = b.queue.positions()
    assert len(queued) == 2 and len(training) == 4  # both producers' slots hold ready batches, no credit
    for number in (1, 2):
        b.scheduler.start_validation(number, b.now)
        b._collect()
        got: list = []
        if number == 1:  # p2 delivers all but one of its validation batches and dies holding that one, credited
            leases = b.take(b"p2", wire.LEASE)
            assert leases and all(m.epoch == -1 for m in leases)  # slots beside its training ones
            for lease in leases:
                b.send(b"p2", wire.Ready(lease.lease))
            assert len(b.take(b"p2", wire.CREDIT)) == len(leases)  # credits of the validation queue, not the full one
            for lease in leases[:-1]:
                b.deliver(b"p2", lease)
            got += b.take_items(b.val_queue)
            b.send(b"p2", wire.Bye())
        while b.scheduler.validation_finished < number:
            assert b.work(b"p1"), "the pass stalled"
            got += b.take_items(b.val_queue)
        assert {item.epoch for item in got} == {-number}
        assert sorted(i for item in got for i in item.ids) == sorted(s.id for s in HELD)  # each once per pass
        assert b.queue.positions() == queued  # no validation batch in the training queue, none taken from it
        p1 = [b.scheduler.leases[i] for i in b.scheduler.peers.live[b"p1"].leases]
        assert all(training[lease.id] == lease.batch for lease in p1 if lease.batch.epoch >= 0)  # untouched
        assert not [m for m in b.take(b"p1", wire.REVOKE) if m.lease in training]
    trained = b.drain_queue()
    while b.work(b"p1"):
        trained += b.drain_queue()
    assert sorted(trained) == sorted([*IDS, *IDS])  # training: every clip once per epoch, no held-out one
    assert not b.rejected and b.scheduler.figures.reissued > 0


def test_a_validation_pass_left_early_stops_leasing_and_the_next_one_is_whole() -> None:
    b = Bench(held=HELD, max_epochs=0)
    b.hello(b"p1")
    b.scheduler.start_validation(1, b.now)
    b._collect()
    b.work(b"p1")  # two validation batches made and queued, more leased
    b.scheduler.cancel_validation(1, b.now)
    b._collect()
    assert b.take(b"p1", wire.REVOKE) and b.scheduler.validation_finished == 1
    assert all(lease.state == "credited" for lease in b.scheduler.leases)
    got = b.take_items(b.val_queue)  # the trainer skips what is left of pass 1
    b.scheduler.start_validation(2, b.now)
    b._collect()
    while b.scheduler.validation_finished < 2:
        assert b.work(b"p1"), "the pass stalled"
        got += b.take_items(b.val_queue)
    assert {item.epoch for item in got} == {-1, -2}
    assert sorted(i for item in got if item.epoch == -2 for i in item.ids) == sorted(s.id for s in HELD)


def test_a_held_out_clip_every_producer_lacks_leaves_the_pass_which_still_ends() -> None:
    b = Bench(held=HELD, max_epochs=0)
    b.hello(b"p1")
    b.scheduler.start_validation(1, b.now)
    b._collect()
    got = []
    while b.scheduler.validation_finished < 1:
        assert b.work(b"p1", missing={"V002"}), "the pass stalled"
        got += b.take_items(b.val_queue)
    assert sorted(i for item in got for i in item.ids) == sorted(s.id for s in HELD if s.id != "V002")
    assert [r.id for r in b.rejected] == ["V002"] and b.scheduler.rejected_in_epoch(0) == 0


def _poison_run(workers: int = 1) -> tuple[Bench, tuple[str, ...], int]:
    """Producers that each die sending one planned batch (a frame the socket drops: its
    connection closes), MAX_LEASE_FAILURES times in a row; the poisoned batch's clips and the
    connections it cost."""
    b = Bench(count=12, lease_ahead=1, workers=workers)
    poison, fd = None, 10
    for attempt in range(MAX_LEASE_FAILURES):
        who = f"p{attempt}".encode()
        b.hello(who, fd=fd)
        lease, = b.take(who, wire.LEASE)
        poison = poison or tuple(lease.ids)
        assert tuple(lease.ids) == poison  # re-planned to the front: the next producer takes it
        b.send(who, wire.Ready(lease.lease))
        assert len(b.take(who, wire.CREDIT)) == 1
        b.scheduler.on_connection_closed(fd, b.now)  # the socket refused its BATCH
        b.tick(DISCONNECT_GRACE_S + 0.01)
        fd += 1
    return b, poison, fd


def test_a_batch_that_kills_its_lease_again_and_again_is_rejected_and_the_run_goes_on() -> None:
    b, poison, fd = _poison_run()
    assert sorted(r.id for r in b.rejected) == sorted(poison)
    assert all(f"failed {MAX_LEASE_FAILURES} times" in r.reason and "max_message_mb" in r.reason
               for r in b.rejected)
    assert b.scheduler.rejected_in_epoch(0) == len(poison)
    # A healthy producer trains every other clip once; the poisoned batch is never leased again.
    b.hello(b"healthy", fd=fd)
    trained: list[str] = []
    for _ in range(20):
        b.work(b"healthy")
        trained += b.drain_queue()
        b.tick(0.1)
    assert sorted(trained) == sorted(IDS - set(poison))
    assert not set(trained) & set(poison)


def test_a_failing_batch_of_a_workers_plan_is_still_a_step_of_empty_rows() -> None:
    b, poison, fd = _poison_run(workers=2)
    assert sorted(r.id for r in b.rejected) == sorted(poison)
    b.hello(b"healthy", fd=fd)
    items = []
    for _ in range(20):
        b.work(b"healthy")
        items += b.take_items(b.queue)
        b.tick(0.1)
    plan = b.scheduler.planner.plan(0)
    assert [(i.epoch, i.index) for i in items] == [(0, p.index) for p in plan]  # every step, in plan order
    assert [i.ids for i in items if not i.ids] == [[]]  # the rejected batch: a step of empty rows


def test_failures_of_different_kinds_reject_nothing() -> None:
    b = Bench(count=4, lease_ahead=1, lease_timeout_s=5.0, heartbeat_timeout_s=100.0)
    b.hello(b"p1", fd=3)
    for _ in range(MAX_LEASE_FAILURES - 1):  # not prepared in time, again and again, one short of the limit
        b.take(b"p1", wire.LEASE)
        b.tick(5.01)
    lease, = b.take(b"p1", wire.LEASE)
    b.send(b"p1", wire.Ready(lease.lease))
    b.take(b"p1", wire.CREDIT)
    b.scheduler.on_connection_closed(3, b.now)  # then another way: its connection closed while sending it
    b.tick(DISCONNECT_GRACE_S + 0.01)
    b.hello(b"p2", fd=4)
    b.work(b"p2")
    assert b.rejected == [] and sorted(b.drain_queue()) == sorted(s.id for s in samples(4))


def test_leases_to_a_remote_copy_carry_each_files_size_on_the_trainer_and_a_local_producers_none(tmp_path) -> None:
    make_dataset(tmp_path, count=6)
    index = build_index(DataConfig(path=str(tmp_path), index_cache="off"), FeaturesConfig())
    cfg = make_config(lease_ahead=1)
    planner = EpochPlanner(index.samples, cfg.batching)
    scheduler = Scheduler(cfg, planner, BatchQueue(3), max_epochs=1, dataset=Reference.of(index),
                          tokens=TokenTable(index.samples, index.vocabulary))
    for who, dataset in ((b"remote", describe_copy(tmp_path)), (b"local", deferred("metadata.csv"))):
        scheduler.on_message(who, hello_of(who.decode(), dataset=dataset).encode(), 0.0, -1)
    leases = {who: wire.read(msg.encode())[0] for who, msg, _ in scheduler.take_outbox() if msg.KIND == wire.LEASE}
    remote, local = leases[b"remote"], leases[b"local"]
    assert remote.sizes == {i: (tmp_path / name).stat().st_size for i, name in remote.files.items()}
    assert set(remote.sizes) == set(remote.ids) and local.sizes is None and local.files
