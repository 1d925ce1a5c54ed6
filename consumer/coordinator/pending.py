"""The scheduler's pending batches: what is still to lease, in order.

At the front, the batches already made: put back (a lease released or revoked), re-planned
(missed clips), split (the part of a batch a producer lacks) or made from the plan and not
leased yet. Behind them, the rest of the planned epochs (consumer/plan.EpochPlan),
made a batch at a time as they are reached, so that pending work costs the plan's arrays,
not a Python object per batch of an epoch of millions of clips. A resumed run's input
position (consumer/position.py) leaves out what its checkpoint trained as batches are made.

Every batch made from a plan precedes, in (epoch, index) order, the plan's batches not made
yet, so an order kept among the made ones (trainer workers' plan order) holds for the whole.
"""

from __future__ import annotations

import collections
import itertools
from typing import Callable, Iterable

from ..plan import EpochPlan, PlannedBatch
from ..position import InputPosition


class Pending:
    """The pending batches (module docstring): a deque-like front of made batches, then the
    plans' batches not made yet."""

    def __init__(self, batches: Iterable[PlannedBatch] = ()) -> None:
        self._made: collections.deque[PlannedBatch] = collections.deque(batches)
        # Plans still being made into batches: (the plan, its next index, the position that leaves out trained ones).
        self._plans: collections.deque[tuple[EpochPlan, int, InputPosition | None]] = collections.deque()

    def add_plan(self, plan: EpochPlan, position: InputPosition | None = None) -> None:
        """An epoch's plan at the back, less what ``position`` says was trained."""
        self._plans.append((plan, 0, position))

    def _make(self, count: int) -> None:
        """Batches made from the plans until ``count`` are made (fewer at the end)."""
        while len(self._made) < count and self._plans:
            plan, at, position = self._plans.popleft()
            while at < len(plan) and len(self._made) < count:
                if position is None:
                    self._made.append(plan[at])
                elif not position.is_done(plan.epoch, at):
                    left = position.left_of(plan[at])
                    if left is not None:
                        self._made.append(left)
                at += 1
            if at < len(plan):
                self._plans.appendleft((plan, at, position))

    def __bool__(self) -> bool:
        self._make(1)
        return bool(self._made)

    def popleft(self) -> PlannedBatch:
        self._make(1)
        return self._made.popleft()

    def appendleft(self, batch: PlannedBatch) -> None:
        self._made.appendleft(batch)

    def head(self, count: int) -> list[PlannedBatch]:
        """The first ``count`` pending batches (fewer at the end), made now."""
        self._make(count)
        return list(itertools.islice(self._made, count))

    def made(self) -> collections.deque[PlannedBatch]:
        """The batches made so far, at the front: changed in place by the scheduler."""
        return self._made

    def __getitem__(self, pos: int) -> PlannedBatch:
        self._make(pos + 1)
        return self._made[pos]

    def __setitem__(self, pos: int, batch: PlannedBatch) -> None:
        self._make(pos + 1)
        self._made[pos] = batch

    def __delitem__(self, pos: int) -> None:
        self._make(pos + 1)
        del self._made[pos]

    def replace_head(self, count: int, batches: Iterable[PlannedBatch]) -> None:
        """The first ``count`` batches (of :meth:`head`) replaced by ``batches``."""
        self._make(count)
        for _ in range(min(count, len(self._made))):
            self._made.popleft()
        self._made.extendleft(reversed(list(batches)))

    def sort_made(self, key: Callable[[PlannedBatch], tuple[int, int]]) -> None:
        """The made batches in ``key`` order (the plans' batches not made come after them all)."""
        self._made = collections.deque(sorted(self._made, key=key))

    def clear(self) -> None:
        self._made.clear()
        self._plans.clear()
