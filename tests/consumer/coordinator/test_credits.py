"""The scheduler's credits (consumer/coordinator/credits.py), driven through the scheduler on a
virtual clock: never more than the free slots, one slot kept for the earliest epoch, and a
worker's credit window in plan order."""

from __future__ import annotations

from stoker.shared import wire
from tests.consumer.coordinator.scheduler_bench import IDS, Bench


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
