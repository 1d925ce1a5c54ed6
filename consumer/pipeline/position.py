"""The input position: how far training got through the epoch plans.

The sampler state a checkpoint saves (:meth:`InputPosition.state_dict`) and a resume loads:
per epoch, which planned batches were trained, recorded by sample id against the epoch's plan
(consumer/pipeline/plan.py), so a batch that travelled in parts or was re-planned still counts
once. docs/DESIGN.md ("Checkpoints and resume", "Index cache") tells the long story.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from .plan import EpochPlanner, PlannedBatch
from ...shared.errors import UserError

log = logging.getLogger(__name__)


class PositionError(UserError):
    """A saved input position does not fit this run's epoch plan (one line)."""


@dataclass
class _EpochProgress:
    home: np.ndarray  # table row -> index of its planned batch in this epoch's plan, -1: none (the planner's, shared)
    sizes: list[int]  # samples of each planned batch (shared too)
    done: set[int] = field(default_factory=set)
    partial: dict[int, set[int]] = field(default_factory=dict)  # planned index -> rows trained so far
    count: int = 0  # samples trained: kept as they are recorded (asked at every step)

    def add(self, row: int) -> bool:
        index = int(self.home[row]) if 0 <= row < len(self.home) else -1
        if index < 0 or index in self.done:
            return False
        got = self.partial.setdefault(index, set())
        if row in got:
            return False
        got.add(row)
        self.count += 1
        if len(got) == self.sizes[index]:
            self.done.add(index)
            del self.partial[index]
        return True

    def mark_done(self, index: int) -> None:
        """Planned batch ``index`` trained whole."""
        if index not in self.done:
            self.done.add(index)
            self.count += self.sizes[index] - len(self.partial.pop(index, ()))

    def trained(self) -> int:
        return self.count


class InputPosition:
    """How far training got through the epoch plans: the sampler state that a checkpoint saves
    (:meth:`state_dict`) and a resume loads (:meth:`from_state_dict`).

    For every epoch, which of its planned batches were trained. It records the sample ids
    of each trained batch and maps them to the planned batch they belong to in the epoch's
    plan (a pure function of the index, the batching config and the epoch), so a planned
    batch is *done* when all its samples were trained, however they travelled: a producer
    lacking some clips delivers a planned batch in parts, and a missed clip re-planned by
    the coordinator rides in another batch of its bucket or in an extra batch of its own.
    An epoch is *complete* when every sample was trained or rejected
    (:meth:`update_complete`). Several epochs can be open at once, since the coordinator
    leases ahead across the epoch boundary.

    Its state: per open epoch the indices of the done planned batches and the ids trained
    from batches not yet done; complete epochs as ``complete_below`` (all epochs before it)
    and ``complete`` (later ones, when leasing ahead finished one first).
    """

    def __init__(self, planner: EpochPlanner) -> None:
        self.planner = planner
        self.complete: set[int] = set()  # epochs whose every sample was trained or rejected
        self._epochs: dict[int, _EpochProgress] = {}

    def _progress(self, epoch: int) -> _EpochProgress:
        progress = self._epochs.get(epoch)
        if progress is None:
            home, sizes = self.planner.homes(epoch)
            progress = self._epochs[epoch] = _EpochProgress(home, sizes)
        return progress

    def record(self, epoch: int, ids: Sequence[str], index: int | None = None,
               clips: Sequence[int] | None = None, whole: int | None = None) -> None:
        """The samples ``ids`` of ``epoch`` were trained (one batch, planned or re-planned);
        ``clips``: their table rows, where the caller has them (else looked up by id).
        ``index``: the planned batch they are, taken whole (trainer workers step through the
        plan in order, a step per planned batch): it is done, however many samples it had.
        ``whole``: the planned batch whose every clip ``clips`` are, each once, where the
        coordinator found so (EpochPlanner.is_whole): done at once, as counting each row
        would leave it, unless part of it was trained before (then row by row, so that the
        log names those rows)."""
        progress = self._progress(epoch)
        if index is not None and 0 <= index < len(progress.sizes):
            progress.mark_done(index)
        elif whole is not None and 0 <= whole < len(progress.sizes) and whole not in progress.done \
                and whole not in progress.partial:
            progress.mark_done(whole)
        else:
            rows = clips if clips is not None and len(clips) == len(ids) else self.planner.table.find_rows(list(ids))
            strays = [i for i, row in zip(ids, rows) if not progress.add(row)]
            if strays:
                log.warning("epoch %d: %d trained samples are not in its plan or were trained before: %s", epoch,
                            len(strays), strays[:5])
        for done in [e for e in self._epochs if e in self.complete]:  # their ids are needed no more
            del self._epochs[done]

    def first_open(self) -> int:
        epoch = 0
        while epoch in self.complete:
            epoch += 1
        return epoch

    def trained_counts(self) -> dict[int, int]:
        """Samples trained per open epoch (the trainer's completion count starts from these)."""
        return {e: p.trained() for e, p in self._epochs.items() if e not in self.complete}

    def done_batches(self, epoch: int) -> set[int]:
        progress = self._epochs.get(epoch)
        return set(progress.done) if progress is not None else set()

    def remaining(self, batches: Iterable[PlannedBatch]) -> list[PlannedBatch]:
        """The part of an epoch's plan still to train: done planned batches left out, partly
        trained ones cut to their untrained samples (same index, bucket and shape)."""
        return [left for left in map(self.left_of, batches) if left is not None]

    def planned_from_here(self, planner: EpochPlanner, epochs: int | None) -> Iterator[tuple[int, int]]:
        """(epoch, index) of the plan's batches in order from this position on, those done left out,
        up to epoch ``epochs`` (None: no end); read as it goes, so it follows this position."""
        epoch = self.first_open()
        while epochs is None or epoch < epochs:
            plan = planner.plan(epoch)
            for index in range(len(plan)):  # the plan's batches made one at a time
                if not self.is_done(epoch, index):
                    yield epoch, index
            epoch += 1

    def is_done(self, epoch: int, index: int) -> bool:
        """Whether planned batch ``index`` of ``epoch`` was trained whole."""
        progress = self._epochs.get(epoch)
        return epoch in self.complete or (progress is not None and index in progress.done)

    def left_of(self, batch: PlannedBatch) -> PlannedBatch | None:
        """What is still to train of a planned batch: itself, its untrained samples (same
        index, bucket and shape), or None when it was trained."""
        if self.is_done(batch.epoch, batch.index):
            return None
        progress = self._epochs.get(batch.epoch)
        trained = progress.partial.get(batch.index) if progress is not None else None
        if not trained or not batch.ids:  # an empty share of a global batch: its step is still to take
            return batch
        rows = self.planner.clips_of(batch)
        ids = tuple(i for i, row in zip(batch.ids, rows) if row not in trained)
        if not ids:
            return None
        return batch if len(ids) == len(batch.ids) else self.planner.with_ids(batch, ids)

    def state_dict(self) -> dict[str, Any]:
        below = self.first_open()
        return {
            "complete_below": below,
            "complete": sorted(e for e in self.complete if e > below),
            "open": {str(e): {"done": sorted(p.done),
                              "ids": sorted(self.planner.table.strings(
                                  "id", sorted(row for rows in p.partial.values() for row in rows)))}
                     for e, p in sorted(self._epochs.items()) if e not in self.complete},
        }

    @classmethod
    def from_state_dict(cls, data: Any, planner: EpochPlanner) -> "InputPosition":
        """Rebuild a position; PositionError when it does not fit the plan."""
        position = cls(planner)
        try:
            below = data["complete_below"]
            position.complete = set(range(int(below))) | {int(e) for e in data["complete"]}
            for key, entry in data["open"].items():
                epoch = int(key)
                progress = position._progress(epoch)
                for index in entry["done"]:
                    index = int(index)
                    if not 0 <= index < len(progress.sizes):
                        raise ValueError(f"epoch {epoch} has no planned batch {index}")
                    progress.mark_done(index)
                ids = [str(i) for i in entry["ids"]]
                for sample_id, row in zip(ids, planner.table.find_rows(ids) if ids else []):
                    if row < 0 or progress.home[row] < 0:
                        raise ValueError(f"sample {sample_id!r} is not in the plan of epoch {epoch}")
                    progress.add(row)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PositionError(f"the input position does not fit this run's epoch plan ({exc})") from None
        return position

    def copy(self) -> "InputPosition":
        """An independent copy (for the coordinator, which plans in its own thread)."""
        other = InputPosition(self.planner)
        other.complete = set(self.complete)
        other._epochs = {e: _EpochProgress(p.home, p.sizes, set(p.done), {i: set(r) for i, r in p.partial.items()},
                                           p.count) for e, p in self._epochs.items()}
        return other

    def trained(self, epoch: int) -> int:
        """Samples of ``epoch`` trained so far (all of them once it is complete)."""
        if epoch in self.complete:
            return self.planner.samples_in(epoch)
        progress = self._epochs.get(epoch)
        return progress.trained() if progress is not None else 0

    def update_complete(self, epochs: int | None, rejected_in_epoch: Callable[[int], int],
                        rejected_epochs: Iterable[int] | None = None) -> int:
        """Mark the epochs whose every sample was trained or rejected; the number complete.

        ``epochs``: the run's epoch budget (None: look at the epochs trained so far);
        ``rejected_in_epoch``: the samples of an epoch rejected while the run went on;
        ``rejected_epochs``: the epochs with rejections, where the caller knows them. An epoch
        with nothing trained is complete only by its rejections (a worker's, never: it steps
        through its planned batches), so the epochs looked at are those trained and those
        rejected from, not the whole budget at every step.
        """
        if epochs and self.planner.workers > 1:
            candidates = {e for e in self._epochs if 0 <= e < epochs}
        elif epochs and rejected_epochs is not None and self.planner.samples_per_epoch > 0:
            candidates = {e for e in (*self._epochs, *rejected_epochs) if 0 <= e < epochs}
        else:
            candidates = set(range(epochs)) if epochs else set(self._epochs)
        for epoch in sorted(candidates - self.complete):
            if self.planner.workers > 1:  # a worker steps through every planned batch, its share empty or not
                progress = self._epochs.get(epoch)
                if progress is not None and len(progress.done) == len(progress.sizes):
                    self.complete.add(epoch)
            elif self.trained(epoch) + rejected_in_epoch(epoch) >= self.planner.samples_in(epoch):
                self.complete.add(epoch)
        return len(self.complete)

