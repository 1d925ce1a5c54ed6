"""The hand-out ledger: which batches went out, which were trained, and each step's figures."""

from __future__ import annotations

import pytest

from stoker.consumer.buffer import QueuedBatch
from stoker.consumer.feed.handout import HandOutLedger


def batch(epoch: int, index: int) -> QueuedBatch:
    return QueuedBatch(lease=epoch * 100 + index, epoch=epoch, index=index, ids=[f"e{epoch}b{index}"], arrays={},
                       producer="p0")


def test_batches_taken_ahead_are_confirmed_oldest_first_with_the_step_boundary_figures():
    ledger = HandOutLedger()
    ledger.start(10.0)
    first, second, third = batch(0, 0), batch(0, 1), batch(0, 2)
    for n, item in enumerate((first, second, third)):  # a prefetch takes three at once
        assert ledger.hand(item, depth=3 - n, asked=10.0, now=10.5 + n * 0.01)
    assert ledger.training_epoch() == 0 and len(ledger.unconfirmed) == 3
    done = ledger.confirm(11.0)  # the first step ends: it waited for its batch from 10.0 to 10.5
    assert done.item is first and done.depth == 3
    assert done.wait_s == pytest.approx(0.5) and done.step_s == pytest.approx(0.5)
    done = ledger.confirm(11.25)  # taken ahead: no wait, the step ran from the last one's end
    assert done.item is second and done.wait_s == 0.0 and done.step_s == pytest.approx(0.25)
    assert ledger.confirm(11.5).item is third
    assert ledger.confirm(12.0) is None  # nothing handed out is left to confirm


def test_work_between_steps_is_not_a_wait_for_data():
    ledger = HandOutLedger()
    ledger.start(0.0)
    ledger.hand(batch(0, 0), 3, asked=0.0, now=0.0)
    assert ledger.confirm(1.0).wait_s == 0.0
    # The loop validates and checkpoints for 2 s, then asks; its batch comes 0.25 s later.
    ledger.hand(batch(0, 1), 3, asked=3.0, now=3.25)
    done = ledger.confirm(4.25)
    assert done.wait_s == pytest.approx(0.25) and done.step_s == pytest.approx(1.0)


def test_batches_an_iterator_took_ahead_and_dropped_go_out_again_first_and_count_once():
    ledger = HandOutLedger()
    ledger.start(0.0)
    items = [batch(0, i) for i in range(4)]
    for item in items:
        assert ledger.hand(item, 0, 1.0, 1.0)
    assert ledger.confirm(2.0).item is items[0]  # one step trained; the prefetch had three more
    assert ledger.hand_out_again() == 3 and not ledger.unconfirmed
    assert ledger.returned(0) and not ledger.returned(-1)
    again = [ledger.take_held(0) for _ in range(3)]
    assert [b.index for b, _ in again] == [1, 2, 3]  # in the order they first went out
    assert [ledger.hand(b, d, 3.0, 3.0) for b, d in again] == [False, False, False]  # not counted twice
    assert not ledger.returned(None)
    assert [ledger.confirm(4.0).item.index for _ in range(3)] == [1, 2, 3]
