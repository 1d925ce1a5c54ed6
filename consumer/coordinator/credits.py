"""The scheduler's credits: flow control against the queues' free slots.

A ready lease gets a CREDIT only while queued batches + credits in flight < capacity, so a
queue never overflows and its depth is exact; credits go to the producer holding the fewest
first, then in plan order. A later epoch's batches leave one slot for the earliest epoch's;
with trainer workers only the planned batches of the credit window get them; a validation
pass has a queue and credits of its own. docs/design/feed.md, "Credits and the triple buffer".
"""

from __future__ import annotations

from typing import Callable

from ..buffer import BatchQueue
from .leases import Lease, Leases, is_validation
from .replan import Replanner
from ...shared import wire


class Credits:
    """Credits in flight, for the training queue and the validation queue (module docstring).
    ``ordered``: trainer workers' plan order (only the window gets credits); ``send(identity,
    message)`` queues a CREDIT."""

    def __init__(self, queue: BatchQueue, validation_queue: BatchQueue | None, leases: Leases,
                 replan: Replanner, ordered: bool, send: Callable[[bytes, wire.Body], None]) -> None:
        self.queue = queue
        self.validation_queue = validation_queue
        self.leases = leases
        self.replan = replan
        self.ordered = ordered
        self.send = send
        self.out = 0  # training credits in flight: granted, their batch not yet delivered
        self.validation_out = 0

    def returned(self, lease: Lease) -> None:
        """A credited lease's credit is back: its batch was delivered, or it was released."""
        if is_validation(lease.batch):
            self.validation_out -= 1
        else:
            self.out -= 1

    def grant(self, now: float) -> None:
        """Credits for free slots: to the producer holding the fewest, then in plan order.

        Spreading them means a producer that freezes while holding credits blocks at most
        its share of the queue until it is presumed dead, not the whole queue.
        """
        self._grant_validation(now)
        free = self.queue.capacity - len(self.queue) - self.out
        if free <= 0:
            return
        ready = [lease for lease in self.leases if lease.state == "ready" and not is_validation(lease.batch)]
        if self.ordered:
            window = self.window()
            ready = [lease for lease in ready if (lease.batch.epoch, lease.batch.index) in window]
            self.out += self._credit(ready, free, now)
            return
        first = self._first_uncredited_epoch()
        earliest = [lease for lease in ready if first is None or lease.batch.epoch <= first]
        given = self._credit(earliest, free, now)
        # Later epochs' batches leave one slot free while the earliest epoch still has batches to
        # send: a loop that takes an epoch at a time (the feed's epochs) waits for those, and
        # they must find room in the queue.
        later = [lease for lease in ready if first is not None and lease.batch.epoch > first]
        given += self._credit(later, free - given - 1, now)
        self.out += given

    def _first_uncredited_epoch(self) -> int | None:
        """The earliest epoch with a planned batch not yet credited (pending, or leased and not
        credited); None when every planned batch so far has its credit."""
        epochs = [lease.batch.epoch for lease in self.leases
                  if lease.state != "credited" and not is_validation(lease.batch)]
        pending = self.replan.earliest_pending_epoch()
        if pending is not None:
            epochs.append(pending)
        return min(epochs, default=None)

    def _grant_validation(self, now: float) -> None:
        """Credits for the validation queue's free slots, apart from the training queue's."""
        if self.validation_queue is None:
            return
        free = self.validation_queue.capacity - len(self.validation_queue) - self.validation_out
        ready = [lease for lease in self.leases if lease.state == "ready" and is_validation(lease.batch)]
        self.validation_out += self._credit(ready, free, now)

    def _credit(self, ready: list[Lease], free: int, now: float) -> int:
        """CREDIT for up to ``free`` of the ``ready`` leases, to the producer holding the fewest
        credits first, then in plan order; how many were sent."""
        if not ready or free <= 0:
            return 0
        held = self.leases.credits_held()
        count = min(free, len(ready))
        for _ in range(count):
            lease = min(ready, key=lambda x: (held[x.identity], x.batch.epoch, x.batch.index))
            ready.remove(lease)
            held[lease.identity] += 1
            lease.state = "credited"
            lease.credited_t = now
            self.send(lease.identity, wire.Credit(lease.id))
        return count

    def window(self) -> set[tuple[int, int]]:
        """The ``capacity`` earliest planned batches not trained yet: queued, leased or pending."""
        capacity = self.queue.capacity
        positions = set(self.queue.positions())
        positions.update((lease.batch.epoch, lease.batch.index) for lease in self.leases
                         if not is_validation(lease.batch))
        positions.update((b.epoch, b.index) for b in self.replan.pending.head(capacity))
        return set(sorted(positions)[:capacity])
