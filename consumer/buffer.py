"""The bounded batch queue between the coordinator process (consumer/feed/handoff.py) and the trainer.

Capacity counts every batch the consumer holds that the trainer has not taken: those
received and waiting, and those already staged onto the model device. The coordinator
grants a credit only for a free slot (``capacity - len(queue) - credits in flight``),
so :meth:`BatchQueue.put` finding the queue full is a protocol violation, never
back-pressure. With the default capacity of 3 the queue is the triple buffer: one
batch arriving, one staged on the model device, one being trained on.

Receiving: with a ``pump`` (the coordinator process's ``receive``), the thread that asks for a
batch receives what was sent, first whatever arrived during the step, then, while none is
there, waiting in ZeroMQ (without the interpreter); without one, it waits for a ``put`` of
another thread.

Staging: given a :class:`Staging` (consumer/feed/frameworks.py has each framework's) with a ``stage`` (a ``stoker.Feed``'s or stoker's
own trainer's, through FeedCore.use_staging), a stager thread converts each batch's host
arrays to device tensors as soon as it arrives, while the trainer runs its step on the previous
one. The trainer takes batches in arrival order and waits for the head batch's staging if it is
not finished yet. Staged ``on_request`` (a stage that only queues asynchronous copies), the
queue's asking thread stages each batch that arrived before it looks for one, between steps,
and no thread wakes during a step.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)

# The stager re-checks its stop flag at least this often while idle.
STAGER_POLL_S = 0.5


class Staging:
    """Batches as host arrays: no staging, and the loop takes what arrived."""

    stage: Callable[[dict[str, Any]], Any] | None = None
    device = "host"
    on_request = False  # stage in the thread that asks for a batch, between steps (else a stager thread)

    def use_memory(self, address: int, nbytes: int) -> None:
        """Batches will arrive in these bytes of this process's memory (the slots' mapping)."""

    def take(self, staged: Any) -> dict[str, Any]:
        """The batch for the loop, in the loop's thread."""
        return staged

    def settle(self, staged: Any) -> None:
        """Return once nothing of ``staged`` still reads its host memory (before it is written again)."""

    def close(self) -> None:
        """Let go of what :meth:`use_memory` took; after the last step, with no batch in flight."""


class QueueFull(RuntimeError):
    """A batch arrived without a free slot: a credit accounting error."""


@dataclass
class QueuedBatch:
    lease: int
    epoch: int
    index: int
    ids: list[str]
    arrays: Any  # dict of numpy arrays, replaced by staged tensors
    producer: str
    frames: int = 0  # valid mel frames of its rows
    frames_computed: int = 0  # frames the step computes: B x T, padding included
    staged: bool = False
    clips: list[int] | None = None  # the ids' rows in the planner's table (None: a validation batch, or unknown)
    whole: bool = False  # its clips are every clip of planned batch ``index``, each once (EpochPlanner.is_whole)
    slot: int = -1  # its shared-memory slot (consumer/feed/handoff.py); -1: none, or released


class BatchQueue:
    def __init__(self, capacity: int, staging: Staging | None = None,
                 on_free: Callable[[], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._stage: Callable[[Any], Any] | None = None
        self.on_free = on_free
        # What receives batches into the queue, in the asking thread: called with the seconds it
        # may wait for the first message (module docstring); None: another thread puts them.
        self.pump: Callable[[float], None] | None = None
        self._items: collections.deque[QueuedBatch] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self.high_water = 0
        self.stage_errors = 0  # batches trained from host memory because staging failed (summary.json)
        self._stager: threading.Thread | None = None
        self._on_request = False  # staged by the asking thread (module docstring)
        if staging is not None:
            self.use_staging(staging)

    def use_staging(self, staging: Staging) -> None:
        """Stage every batch held and every one that arrives from now on with ``staging.stage``
        (the trainer may be built after the queue has started filling), in a stager thread, or
        (``staging.on_request``) in the thread that asks for a batch; a staging without a stage
        leaves the host arrays as they are."""
        if staging.stage is None:
            return
        with self._cond:
            if self._stage is not None:
                raise RuntimeError("staging already enabled")
            self._stage = staging.stage
            self._on_request = staging.on_request
            for item in self._items:  # held as host arrays so far: staged before they are taken
                item.staged = False
            if not self._on_request:
                self._stager = threading.Thread(target=self._stage_loop, name="stager", daemon=True)
                self._stager.start()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def put(self, item: QueuedBatch) -> None:
        with self._cond:
            if len(self._items) >= self.capacity:
                raise QueueFull(f"queue at capacity {self.capacity}")
            if self._stage is None:
                item.staged = True
            self._items.append(item)
            self.high_water = max(self.high_water, len(self._items))
            self._cond.notify_all()

    def wait_for_depth(self, depth: int, timeout: float, stop: threading.Event | None = None) -> int:
        """Block until ``depth`` batches are held, ``timeout`` passes or ``stop`` is set."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                held = len(self._items)
                remaining = deadline - time.monotonic()
                if held >= depth or self._closed or (stop and stop.is_set()) or remaining <= 0:
                    return held
                if self.pump is None:
                    self._cond.wait(min(remaining, STAGER_POLL_S))
                    continue
            self.pump(min(remaining, STAGER_POLL_S))

    def positions(self) -> list[tuple[int, int]]:
        """(epoch, index) of the planned batches held."""
        with self._cond:
            return [(item.epoch, item.index) for item in self._items]

    def _find(self, want: tuple[int, int] | None, up_to_epoch: int | None) -> QueuedBatch | None:
        if want is not None:
            return next((item for item in self._items if (item.epoch, item.index) == want), None)
        if up_to_epoch is not None:
            return next((item for item in self._items if item.epoch <= up_to_epoch), None)
        return self._items[0] if self._items else None

    def get(self, timeout: float, want: tuple[int, int] | None = None,
            up_to_epoch: int | None = None) -> tuple[QueuedBatch, int] | None:
        """Take the oldest batch (``want``: the one of that (epoch, index); ``up_to_epoch``: the
        oldest of that epoch or an earlier one) once staged; return it with the depth seen on
        asking.

        Returns None if nothing arrived within ``timeout`` (the caller re-checks its stop
        flag and asks again; the wait still counts as data wait).
        """
        deadline = time.monotonic() + timeout
        if self.pump is not None:
            self.pump(0.0)  # what arrived while the loop trained
        with self._cond:
            depth = len(self._items)
        while True:
            if self._on_request:
                self._stage_arrived()
            with self._cond:
                item = self._find(want, up_to_epoch)
                if item is not None and item.staged:
                    self._items.remove(item)  # no notify: nothing waits for a free place (put never blocks)
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return None
                if item is not None and self._on_request:
                    continue  # put by another thread's pump just now: staged at the top of the loop
                if self.pump is None or item is not None:  # a put, or its staging, wakes this
                    self._cond.wait(remaining)
                    continue
            self.pump(remaining)
        if self.on_free is not None:
            self.on_free()
        return item, depth

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._stager is not None:
            self._stager.join(timeout=5.0)

    def _next_unstaged(self) -> QueuedBatch | None:
        for item in self._items:
            if not item.staged:
                return item
        return None

    def _stage_loop(self) -> None:
        while True:
            with self._cond:
                item = self._next_unstaged()
                while item is None and not self._closed:
                    self._cond.wait(STAGER_POLL_S)
                    item = self._next_unstaged()
                if self._closed:
                    return
            self._stage_one(item)

    def _stage_arrived(self) -> None:
        """Stage, in this (the asking) thread, every batch held and not staged yet, oldest first."""
        with self._cond:
            arrived = [item for item in self._items if not item.staged]
        for item in arrived:
            self._stage_one(item)

    def _stage_one(self, item: QueuedBatch) -> None:
        assert self._stage is not None
        try:
            staged = self._stage(item.arrays)
        except Exception:  # a staging failure must not end the run (or the thread): train from host memory
            log.exception("staging batch of lease %d failed; it will be used from host memory", item.lease)
            self.stage_errors += 1
            staged = item.arrays
        with self._cond:
            item.arrays = staged
            item.staged = True
            self._cond.notify_all()
