"""How a ``stoker.Feed`` hands out its batches and counts its steps: to a loop that iterates it
(each request confirms the batch before) or to tf.data (taken ahead, confirmed by step_done or
the Keras callback), never both; and its validation passes. docs/FEED.md, Three ways in, is
the user's side.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

from .consumer.feed.feed import FeedCore
from .feed_run import FeedRun
from .feed_staging import FeedError


class HandOut:
    """The batches of ``run`` (stoker/feed_run.py), which starts on the first one asked for."""

    def __init__(self, run: FeedRun) -> None:
        self.run = run
        self.batches: Iterator[Any] | None = None  # plain iteration's, from the first batch on
        self.taken_by: str | None = None  # "iteration" or "as_dataset()"
        self.ended = False  # plain iteration took every batch

    def _running(self) -> FeedCore:
        """The open run, where a batch was taken already (so start() made it)."""
        assert self.run.core is not None
        return self.run.core

    def next(self) -> dict[str, Any]:
        """The next batch of plain iteration; StopIteration at the end of the plan, and after."""
        if self.run.closed:
            raise FeedError("this feed is closed; no batch is left")
        if self.ended:
            raise StopIteration
        self.take_by("iteration")
        if self.batches is None:
            self.batches = self.run.start().batches(confirm_on_request=False)
        try:
            return self.next_of(self.batches)
        except StopIteration:
            self.ended = True
            raise

    def epochs(self) -> Iterator[tuple[int, Iterator[dict[str, Any]]]]:
        """Each epoch of the plan left, with its batches (Feed.epochs)."""
        self.take_by("iteration")
        core = self.run.start()
        while not self.run.closed and not core.handed_all():
            epoch = core.handed.first_open()
            yield epoch, self._epoch_batches(epoch)

    def _epoch_batches(self, epoch: int) -> Iterator[dict[str, Any]]:
        batches = self._running().batches(confirm_on_request=False, epoch=epoch)
        while True:
            try:
                yield self.next_of(batches)
            except StopIteration:
                return

    def next_of(self, batches: Iterator[Any]) -> dict[str, Any]:
        """The next batch of ``batches`` for a loop that asks when it needs one: the step of the
        batch before ended when the loop asked (unless step_done said so earlier)."""
        core = self._running()
        if core.unconfirmed:  # else step_done() confirmed it
            core.confirm(time.monotonic())
        core.flush_if_due()
        try:
            item = next(batches)
        except StopIteration:
            core.flush()
            raise
        return core.take(item)

    def take_by(self, way: str) -> None:
        """Batches go either to a loop that iterates the feed or to tf.data (``as_dataset``), which
        takes them ahead of training: which batch a step trained is known only in one of them."""
        if self.taken_by not in (None, way):
            raise FeedError(f"this feed's batches are taken by {self.taken_by} already; a feed is either iterated "
                            f"(for batch in feed, feed.epochs()) or read through as_dataset(), not both")
        self.taken_by = way

    def step_done(self, loss: Any = None, **terms: Any) -> None:
        """The oldest batch handed out and not yet confirmed was trained (Feed.step_done)."""
        core = self.run.core
        if self.taken_by is None or core is None:
            raise FeedError("step_done() before the first batch")
        confirmed = core.step_done({"loss": loss, **terms} if terms else loss)
        if self.taken_by == "iteration":
            return  # a second call for one batch changes nothing
        if not confirmed:
            raise FeedError("step_done() without a batch to confirm: every batch handed out through as_dataset() "
                            "is confirmed already (call it once per training step, and not beside feed.callback())")
        core.flush_if_due()

    def return_prefetched(self) -> int:
        """Batches taken ahead through ``as_dataset()`` and never confirmed, handed out again first."""
        if self.run.core is None or self.taken_by != "as_dataset()":
            return 0
        return self.run.core.hand_out_again()

    def confirm_steps(self, steps: int) -> None:
        """``steps`` steps of ``fit`` ended (the Keras callback's)."""
        core = self.run.core
        if core is None:
            return
        for _ in range(steps):
            if not core.step_done():
                break  # the last execution of an epoch ran short of its steps_per_execution
        core.flush_if_due()

    def epoch(self) -> int | None:
        """The plan epoch of the batch being trained (Feed.epoch)."""
        core = self.run.core
        if core is None:
            return None
        return core.training_epoch()

    def dataset_epoch(self) -> Iterator[dict[str, Any]]:
        """One iteration of ``as_dataset()``: the next epoch not yet handed out in full, taken ahead."""
        self.take_by("as_dataset()")
        core = self.run.start()
        if core.handed_all():
            return
        for item in core.batches(confirm_on_request=False, epoch=core.handed.first_open()):
            yield item.arrays

    def validation(self) -> Iterator[dict[str, Any]]:
        """One validation pass (Feed.validation)."""
        if self.run.closed:
            raise FeedError("this feed is closed; validate before leaving the `with` block")
        core = self.run.start()

        def batches() -> Iterator[dict[str, Any]]:
            for item in core.validation_pass():
                yield core.take(item)

        return batches()
