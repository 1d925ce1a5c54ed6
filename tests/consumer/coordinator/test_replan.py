"""The scheduler's re-planning (consumer/coordinator/replan.py), driven through the scheduler on a
virtual clock: work lost with a producer, clips missed or missing everywhere, and batches whose
lease keeps failing, each sample still trained exactly once."""

from __future__ import annotations

import collections

import pytest

from stoker.consumer.coordinator.peers import DISCONNECT_GRACE_S
from stoker.consumer.coordinator.replan import MAX_LEASE_FAILURES
from stoker.shared import wire
from tests.consumer.harness import samples
from tests.consumer.coordinator.scheduler_bench import IDS, Bench


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
