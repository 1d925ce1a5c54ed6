"""Validation passes of an open run (consumer/feed/validation.py says what a pass is).

A pass asks the coordinator to lease every held-out batch, takes them from the validation
queue as the producers deliver them and ends when the coordinator says the pass is finished
and the queue is empty; left before its end, the rest of the pass is cancelled.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterator

from ..buffer import BatchQueue, QueuedBatch
from ..plan import PlannedBatch
from ...shared.metrics import JsonlWriter

log = logging.getLogger("consumer")


class ValidationPasses:
    """The held-out ``batches``' passes, from ``queue`` (their batches' own), leased through
    ``coordinator``; ``waiting(since, last_warn, what)`` is the feed core's slice of waiting."""

    def __init__(self, batches: list[PlannedBatch], queue: BatchQueue, coordinator: Any, stop: threading.Event,
                 samples: JsonlWriter | None, waiting: Callable[[float, float, str], float], slice_s: float) -> None:
        self.batches, self.queue, self.coordinator, self.stop = batches, queue, coordinator, stop
        self.samples, self.waiting, self.slice_s = samples, waiting, slice_s
        self.count = 0

    def run(self, step: int) -> Iterator[QueuedBatch]:
        """One pass at training step ``step``: every held-out clip once (validation_samples.jsonl
        names them with ``record_samples``)."""
        if not self.batches:
            log.info("validation pass: no clip is held out (trainer.val_clips 0 and no data.eval_file): it is empty")
            return
        self.count += 1
        number = self.count
        self.coordinator.start_validation(number)
        finished = False
        clips = 0
        asked = last_warn = time.monotonic()
        try:
            while not self.stop.is_set():
                # The coordinator queues a pass's last batch before it marks the pass finished.
                if self.coordinator.validation_finished() >= number and not len(self.queue):
                    finished = True
                    break
                got = self.queue.get(self.slice_s)
                if got is None:
                    last_warn = self.waiting(asked, last_warn, "no validation batch for")
                    continue
                item = got[0]
                self.coordinator.taken(item)
                if item.epoch != -number:
                    continue  # of a pass left before its end
                if self.samples is not None:
                    self.samples.write({"pass": number, "step": step, "ids": item.ids})
                clips += len(item.ids)
                yield item
                asked = time.monotonic()
        finally:
            if not finished:
                self.coordinator.cancel_validation(number)
        if finished:
            log.info("validation pass %d at step %d: %d held-out clips", number, step, clips)
        else:
            log.warning("validation pass %d at step %d cut short: the run is stopping", number, step)


__all__ = ["ValidationPasses"]
