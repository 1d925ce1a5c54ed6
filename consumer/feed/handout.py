"""Which batches went out to the training loop, and which of them it trained.

A batch handed out is not yet trained: tf.data's ``map`` and ``prefetch`` (under Keras
``fit``) take batches ahead of the step that trains them. :class:`HandOutLedger` keeps the
batches handed out in order and counts one as trained only when its step is *confirmed*,
oldest first (a loop trains its batches in the order it took them). What was handed out
and never confirmed is trained again after a resume, never skipped.

Batches that an iterator took ahead and dropped untrained (:meth:`HandOutLedger.hand_out_again`)
are held here to go out again first, without being counted twice.

Pure bookkeeping: no socket, no thread, no clock of its own (times are passed in); the
feed core (consumer/feed/feed.py) calls it under its lock.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from ..buffer import QueuedBatch


@dataclass
class HandedOut:
    """A batch handed out whose step is not confirmed yet."""

    item: QueuedBatch
    depth: int  # batches held when it was asked for
    asked: float  # when it was asked for (time.monotonic())
    handed: float  # when it was handed out


@dataclass(frozen=True)
class Confirmed:
    """A batch whose step was confirmed, with the step's figures for metrics.jsonl."""

    item: QueuedBatch
    depth: int
    wait_s: float  # from the later of its request and the step before's end until it was handed out
    step_s: float  # from the later of the step before's end and its hand-out until the step was confirmed


class HandOutLedger:
    def __init__(self) -> None:
        self.unconfirmed: collections.deque[HandedOut] = collections.deque()
        self.held: collections.deque[tuple[QueuedBatch, int]] = collections.deque()  # to go out again first
        self._again: set[int] = set()  # id() of held batches that went out before and were never trained
        self.step_end: float | None = None  # when the last confirmed step ended
        self.last_epoch: int | None = None  # the epoch of the last confirmed batch

    def start(self, now: float) -> None:
        """Training starts (after the warm-up): the first step's wait counts from ``now``."""
        self.step_end = now

    # ------------------------------------------------------------ handing out
    def take_held(self, epoch: int | None) -> tuple[QueuedBatch, int] | None:
        """The oldest batch to go out again that may go out now (``epoch``: of that epoch or an
        earlier one)."""
        for held in self.held:
            if epoch is None or held[0].epoch <= epoch:
                self.held.remove(held)
                return held
        return None

    def hand(self, item: QueuedBatch, depth: int, asked: float, now: float) -> bool:
        """``item``, asked for at ``asked``, goes out to the loop ``now``; False when it went out
        before (returned by :meth:`hand_out_again`), so that it is not counted twice."""
        first = id(item) not in self._again
        self._again.discard(id(item))
        self.unconfirmed.append(HandedOut(item, depth, asked, now))
        return first

    def returned(self, epoch: int | None) -> bool:
        """Whether batches returned by :meth:`hand_out_again` wait to go out (of ``epoch`` or before)."""
        return any(id(item) in self._again and (epoch is None or item.epoch <= epoch) for item, _ in self.held)

    def hand_out_again(self) -> int:
        """The batches handed out and not confirmed go out again first, as they are (already
        staged): for an iterator that took them ahead and was dropped before training them.
        The number of batches."""
        again = list(self.unconfirmed)
        self.unconfirmed.clear()
        for out in reversed(again):
            self.held.appendleft((out.item, out.depth))
            self._again.add(id(out.item))
        return len(again)

    # ------------------------------------------------------------ confirming
    def confirm(self, ended: float) -> Confirmed | None:
        """The oldest unconfirmed batch was trained, its step ending at ``ended``; None when no
        batch was unconfirmed. Its wait is what the loop spent waiting for it: from the later
        of its request and the step before's end (work between steps, a validation, a
        checkpoint, is not waiting for data; a batch taken ahead waited 0)."""
        if not self.unconfirmed:
            return None
        out = self.unconfirmed.popleft()
        before = self.step_end if self.step_end is not None else out.asked
        begun = max(before, out.handed)
        self.step_end = ended
        self.last_epoch = out.item.epoch
        return Confirmed(out.item, out.depth, wait_s=max(0.0, out.handed - max(out.asked, before)),
                         step_s=max(0.0, ended - begun))

    def training_epoch(self) -> int | None:
        """The epoch of the oldest batch not confirmed, else of the last confirmed one."""
        return self.unconfirmed[0].item.epoch if self.unconfirmed else self.last_epoch


__all__ = ["Confirmed", "HandOutLedger", "HandedOut"]
