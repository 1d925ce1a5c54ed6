"""Tests for consumer/buffer.py: the bounded queue, its staging (a thread, or on request), and
capacity under load."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from stoker.consumer.buffer import STAGER_POLL_S, BatchQueue, QueuedBatch, QueueFull
from stoker.consumer.feed.frameworks import FunctionStaging, Staging

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0  # generous bound for anything that should happen promptly
SHORT_S = 0.05  # a wait that is expected to time out
STRESS_ITEMS = 3000


def _item(n: int, arrays=None) -> QueuedBatch:
    return QueuedBatch(lease=n, epoch=0, index=n, ids=[f"id{n}"],
                       arrays={"x": np.full(2, n)} if arrays is None else arrays, producer="p0")


def staged_by(stage, on_request: bool = False) -> Staging:
    """A Staging of ``stage``, in the queue's stager thread or (``on_request``) in the asking one."""
    staging = FunctionStaging(stage, "test")
    staging.on_request = on_request
    return staging


@pytest.fixture
def queues():
    """Queues made by a test are closed at the end, so no stager thread outlives it."""
    made: list[BatchQueue] = []

    def make(*args, **kwargs) -> BatchQueue:
        q = BatchQueue(*args, **kwargs)
        made.append(q)
        return q

    yield make
    for q in made:
        q.close()


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BatchQueue(0)


def test_put_beyond_capacity_raises(queues) -> None:
    q = queues(3)
    for n in range(3):
        q.put(_item(n))
    assert len(q) == 3
    with pytest.raises(QueueFull):
        q.put(_item(99))
    assert len(q) == 3
    assert q.high_water == 3
    got = q.get(WAIT_S)
    assert got is not None and got[0].lease == 0
    q.put(_item(3))  # a freed slot takes one more
    with pytest.raises(QueueFull):
        q.put(_item(100))


def test_fifo_and_depth_seen_at_ask(queues) -> None:
    q = queues(4)
    for n in range(4):
        q.put(_item(n))
    out = []
    while len(q):
        item, depth = q.get(WAIT_S)
        out.append((item.lease, depth))
        assert item.staged
    assert out == [(0, 4), (1, 3), (2, 2), (3, 1)]


def test_get_times_out_with_none(queues) -> None:
    q = queues(2)
    start = time.monotonic()
    assert q.get(SHORT_S) is None  # the wait itself is what is tested: it lasts its timeout
    assert time.monotonic() - start >= SHORT_S * 0.9
    assert q.get(0) is None


def test_get_with_zero_timeout_returns_a_ready_item(queues) -> None:
    q = queues(2)
    q.put(_item(1))
    got = q.get(0)
    assert got is not None and got[0].lease == 1 and got[1] == 1


def test_on_free_called_once_per_get(queues) -> None:
    calls = []
    q = queues(3, on_free=lambda: calls.append(len(q)))
    for n in range(3):
        q.put(_item(n))
    assert calls == []
    q.get(WAIT_S)
    assert calls == [2]  # called after the slot is free
    q.get(WAIT_S)
    q.get(WAIT_S)
    assert calls == [2, 1, 0]
    assert q.get(0) is None
    assert len(calls) == 3  # a timed-out get frees nothing


class Pump:
    """A pump that puts ``arrivals[k]`` (items, or nothing) into its queue at its k-th call,
    noting the seconds each call was allowed to wait."""

    def __init__(self, queue: BatchQueue, arrivals: list[list[int]]) -> None:
        self.queue, self.arrivals, self.waits = queue, arrivals, []
        queue.pump = self

    def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        for lease in self.arrivals.pop(0) if self.arrivals else []:
            self.queue.put(_item(lease))


def test_a_pumped_get_takes_what_arrived_during_the_step_then_receives_until_one_comes(queues) -> None:
    q = queues(3)
    pump = Pump(q, [[0, 1], [], [], [], [], [2]])
    item, depth = q.get(WAIT_S)
    assert item.lease == 0 and depth == 2  # the depth seen once what arrived during the step is in
    assert pump.waits == [0.0]  # nothing waited for: a batch was there
    assert q.get(WAIT_S)[0].lease == 1 and pump.waits == [0.0, 0.0]
    item, depth = q.get(WAIT_S)  # none there: it receives, waiting, until one comes
    assert item.lease == 2 and depth == 0
    assert pump.waits[2] == 0.0 and len(pump.waits) == 6 and all(0 < w <= WAIT_S for w in pump.waits[3:])
    assert q.get(SHORT_S) is None  # nothing comes: None at the deadline, every wait within it
    assert all(0 <= w <= SHORT_S for w in pump.waits[6:]) and len(pump.waits) > 7


def test_a_pumped_get_waits_for_a_staging_without_receiving(queues) -> None:
    """The head has arrived and is being staged: the stager wakes the get, not a message."""
    release = threading.Event()

    def stage(arrays):
        assert release.wait(WAIT_S)
        return {"staged": arrays["x"] * 10}

    q = queues(3, staging=staged_by(stage))
    pump = Pump(q, [[4]])
    result = {}
    t = threading.Thread(target=lambda: result.update(got=q.get(WAIT_S)))
    t.start()
    while not pump.waits:  # the get has asked (a poll of a fact, bounded by the test's timeout)
        time.sleep(0.001)
    release.set()
    t.join(WAIT_S)
    assert not t.is_alive() and result["got"][0].lease == 4
    np.testing.assert_array_equal(result["got"][0].arrays["staged"], [40, 40])
    assert pump.waits == [0.0]


class OnRequest:
    """A stage that notes the thread it ran in and each batch it staged."""

    def __init__(self, fail: int | None = None) -> None:
        self.staged: list[tuple[int, int]] = []  # (the batch's value, the staging thread)
        self.fail = fail

    def __call__(self, arrays):
        value = int(arrays["x"][0])
        if value == self.fail:
            raise RuntimeError("no room on the device")
        self.staged.append((value, threading.get_ident()))
        return {"staged": arrays["x"] * 10}


def test_batches_staged_on_request_are_staged_by_the_asking_thread_between_steps_each_once(queues) -> None:
    """No thread of the queue's own: each request stages what arrived since the last one,
    oldest first, before it hands out the head (so later batches' copies overlap the next step)."""
    stage = OnRequest()
    q = queues(3)
    q.use_staging(staged_by(stage, on_request=True))
    pump = Pump(q, [[0, 1], [], [], [2], [], [3]])
    assert not [t for t in threading.enumerate() if t.name == "stager"]
    item, depth = q.get(WAIT_S)
    assert item.lease == 0 and depth == 2
    np.testing.assert_array_equal(item.arrays["staged"], [0, 0])
    assert stage.staged == [(0, threading.get_ident()), (1, threading.get_ident())]  # both, in this thread
    item, _ = q.get(WAIT_S)  # staged by the request before: not again
    assert item.lease == 1 and [v for v, _ in stage.staged] == [0, 1]
    item, _ = q.get(WAIT_S)  # none held: received while waiting, then staged
    assert item.lease == 2 and item.staged and [v for v, _ in stage.staged] == [0, 1, 2]
    assert q.get(WAIT_S)[0].lease == 3 and len(pump.waits) >= 6
    assert {thread for _, thread in stage.staged} == {threading.get_ident()}


def test_a_batch_put_by_another_thread_is_staged_by_the_asking_one(queues) -> None:
    stage = OnRequest()
    q = queues(3)
    q.use_staging(staged_by(stage, on_request=True))
    taken = {}
    asker = threading.Thread(target=lambda: taken.update(got=q.get(WAIT_S), thread=threading.get_ident()))
    asker.start()
    q.put(_item(5))  # no pump: another thread's put (a receiving thread, or the in-process coordinator)
    asker.join(WAIT_S)
    assert not asker.is_alive() and taken["got"][0].lease == 5
    np.testing.assert_array_equal(taken["got"][0].arrays["staged"], [50, 50])
    assert stage.staged == [(5, taken["thread"])]


def test_a_batch_whose_staging_on_request_failed_is_handed_out_from_host_memory(queues) -> None:
    q = queues(3)
    q.use_staging(staged_by(OnRequest(fail=1), on_request=True))
    for n in range(3):
        q.put(_item(n))
    got = [q.get(WAIT_S)[0] for _ in range(3)]
    assert [item.lease for item in got] == [0, 1, 2] and q.stage_errors == 1
    assert "staged" in got[0].arrays and "x" in got[1].arrays and "staged" in got[2].arrays


@pytest.mark.parametrize("on_request", [False, True], ids=["thread", "request"])
def test_batches_held_before_staging_began_are_staged_before_they_are_taken_each_once(queues, on_request) -> None:
    """stoker's trainer is built while the queue fills: the batches held when its staging comes
    are staged too, so every step gets a staged batch and none is staged again."""
    stage = OnRequest()
    q = queues(3)
    for n in range(2):
        q.put(_item(n))
    q.use_staging(staged_by(stage, on_request=on_request))
    q.put(_item(2))
    got = [q.get(WAIT_S)[0] for _ in range(3)]
    assert [item.lease for item in got] == [0, 1, 2] and all(item.staged for item in got)
    for n, item in enumerate(got):
        np.testing.assert_array_equal(item.arrays["staged"], [10 * n, 10 * n])
    assert sorted(value for value, _ in stage.staged) == [0, 1, 2] and q.stage_errors == 0


def test_a_staging_without_a_stage_leaves_the_host_arrays_and_starts_no_thread(queues) -> None:
    q = queues(3)
    q.use_staging(Staging())
    item = _item(0)
    arrays = item.arrays
    q.put(item)
    got, _ = q.get(WAIT_S)
    assert got.arrays is arrays and q._stager is None
    q.use_staging(staged_by(OnRequest()))  # the host's staging is none: a real one may follow


def test_staging_is_enabled_once(queues) -> None:
    q = queues(3, staging=staged_by(OnRequest()))
    with pytest.raises(RuntimeError, match="already"):
        q.use_staging(staged_by(OnRequest(), on_request=True))


def test_a_pumped_wait_for_depth_receives_until_the_depth_or_the_stop(queues) -> None:
    q = queues(3)
    stop = threading.Event()
    pump = Pump(q, [[0], [], [1, 2]])
    assert q.wait_for_depth(3, WAIT_S, stop) == 3 and len(pump.waits) == 3
    assert all(0 < w <= STAGER_POLL_S for w in pump.waits)
    stop.set()
    assert q.wait_for_depth(4, WAIT_S, stop) == 3 and len(pump.waits) == 3  # stopped: no receiving


def test_get_blocks_until_an_item_arrives(queues) -> None:
    q = queues(2)
    result = {}
    asking = threading.Event()

    def consumer() -> None:
        asking.set()
        result["got"] = q.get(WAIT_S)

    t = threading.Thread(target=consumer)
    t.start()
    assert asking.wait(WAIT_S)
    q.put(_item(5))
    t.join(WAIT_S)
    assert not t.is_alive()
    item, depth = result["got"]
    assert item.lease == 5 and depth in (0, 1)  # asked before or after the put landed


def test_get_waits_for_the_head_to_be_staged(queues) -> None:
    started = threading.Event()
    release = threading.Event()
    staged_calls = []

    def stage(arrays):
        staged_calls.append(int(arrays["x"][0]))
        if arrays["x"][0] == 0:
            started.set()
            assert release.wait(WAIT_S)
        return {"staged": arrays["x"] * 10}

    q = queues(3, staging=staged_by(stage))
    q.put(_item(0))
    q.put(_item(1))
    assert started.wait(WAIT_S)
    assert q.get(0) is None  # head still staging: nothing to take yet
    assert len(q) == 2
    release.set()
    item, depth = q.get(WAIT_S)
    assert item.lease == 0 and item.staged and depth == 2
    np.testing.assert_array_equal(item.arrays["staged"], [0, 0])
    item, depth = q.get(WAIT_S)
    assert item.lease == 1 and depth == 1
    np.testing.assert_array_equal(item.arrays["staged"], [10, 10])
    assert staged_calls == [0, 1]  # staged in arrival order, once each
    assert q.stage_errors == 0


def test_stage_failure_falls_back_to_host_arrays(queues) -> None:
    def stage(arrays):
        if arrays["x"][0] % 2:
            raise RuntimeError("device full")
        return {"device": arrays["x"]}

    q = queues(4, staging=staged_by(stage))
    hosts = [_item(n) for n in range(4)]
    host_arrays = [h.arrays for h in hosts]
    for h in hosts:
        q.put(h)
    results = [q.get(WAIT_S) for _ in range(4)]
    assert [r[0].lease for r in results] == [0, 1, 2, 3]
    assert all(r[0].staged for r in results)
    assert "device" in results[0][0].arrays and "device" in results[2][0].arrays
    assert results[1][0].arrays is host_arrays[1]
    assert results[3][0].arrays is host_arrays[3]
    assert q.stage_errors == 2


def test_close_stops_the_stager_and_wakes_get() -> None:
    q = BatchQueue(2, staging=staged_by(lambda a: a))
    stager = q._stager
    assert stager is not None and stager.is_alive()
    result = {}
    asking = threading.Event()

    def consumer() -> None:
        asking.set()
        result["got"] = q.get(WAIT_S * 3)

    t = threading.Thread(target=consumer)
    t.start()
    assert asking.wait(WAIT_S)
    q.close()
    t.join(WAIT_S)
    assert not t.is_alive()  # woken by the close: its get would have waited three times as long
    assert result["got"] is None
    assert not stager.is_alive()
    assert q.get(WAIT_S) is None  # closed and empty: returns at once


def test_wait_for_depth(queues) -> None:
    q = queues(3)
    stop = threading.Event()
    assert q.wait_for_depth(1, 0) == 0  # not there: returns at its deadline, here now
    q.put(_item(0))
    assert q.wait_for_depth(1, WAIT_S) == 1  # already there
    result = {}
    waiting = threading.Event()

    def waiter(depth: int) -> None:
        waiting.set()
        result["depth"] = q.wait_for_depth(depth, WAIT_S * 3, stop)

    t = threading.Thread(target=waiter, args=(3,))
    t.start()
    assert waiting.wait(WAIT_S)
    q.put(_item(1))
    q.put(_item(2))
    t.join(WAIT_S)
    assert not t.is_alive() and result["depth"] == 3
    # A set stop flag ends the wait for a depth never reached (the capacity is 3) before its deadline.
    stop.set()
    t = threading.Thread(target=waiter, args=(10,))
    t.start()
    t.join(WAIT_S)
    assert not t.is_alive() and result["depth"] == 3


@pytest.mark.parametrize("staging", [False, True], ids=["host", "staged"])
def test_producer_consumer_stress(queues, staging: bool) -> None:
    capacity = 3
    credits = threading.Semaphore(capacity)  # the coordinator's credit accounting
    over: list[int] = []
    errors: list[BaseException] = []

    def check() -> None:
        n = len(q)
        if n > capacity:
            over.append(n)

    q = queues(capacity, staging=staged_by(lambda a: {"x": a["x"] + 1}) if staging else None,
               on_free=credits.release)
    received: list[int] = []
    depths: list[int] = []

    def producer() -> None:
        try:
            for n in range(STRESS_ITEMS):
                if not credits.acquire(timeout=WAIT_S):
                    raise TimeoutError(f"no credit for item {n}")
                q.put(_item(n))
                check()
        except BaseException as exc:  # reported below
            errors.append(exc)

    def consumer() -> None:
        try:
            for _ in range(STRESS_ITEMS):
                got = q.get(WAIT_S)
                if got is None:
                    raise TimeoutError("get timed out")
                item, depth = got
                check()
                depths.append(depth)
                expected = item.lease + (1 if staging else 0)
                if int(item.arrays["x"][0]) != expected:
                    raise AssertionError(f"item {item.lease} has arrays of {item.arrays['x'][0]}")
                received.append(item.lease)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=producer), threading.Thread(target=consumer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=45)
    assert not any(t.is_alive() for t in threads), "stress threads did not finish"
    assert errors == []
    assert over == []
    assert received == list(range(STRESS_ITEMS))  # FIFO, nothing lost or repeated
    assert max(depths) <= capacity
    assert q.high_water <= capacity
    assert len(q) == 0


def test_a_take_up_to_an_epoch_leaves_later_epochs_batches_in_order(queues) -> None:
    q = queues(3)
    for lease, epoch in ((1, 1), (2, 0), (3, 1)):
        q.put(QueuedBatch(lease=lease, epoch=epoch, index=lease, ids=[f"id{lease}"], arrays={}, producer="p0"))
    got = q.get(0, up_to_epoch=0)
    assert got is not None and got[0].lease == 2 and got[1] == 3  # the depth seen: all three
    assert q.get(0, up_to_epoch=0) is None  # none of epoch 0 left: nothing, at once
    assert [q.get(0)[0].lease for _ in range(2)] == [1, 3]  # the rest in arrival order
