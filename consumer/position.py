"""The input position: how far training got through the epoch plans.

The sampler state a checkpoint saves (:meth:`InputPosition.state_dict`) and a resume loads:
per epoch, which planned batches were trained, recorded by sample against the epoch's plan
(consumer/plan.py), so a batch that travelled in parts or was re-planned still counts
once. Saved as bit arrays over the plan (a bit per planned batch, and the places in the
planned order of the clips trained from batches not done), raw bytes that msgpack keeps as
they are: some 0.4 MB an open epoch at 10^8 clips. docs/design/checkpoints.md, "Input position", and
docs/design/index.md, "Index cache", tell the long story.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from .plan import EpochPlan, EpochPlanner, PlannedBatch
from ..shared.errors import UserError

log = logging.getLogger(__name__)


class PositionError(UserError):
    """A saved input position does not fit this run's epoch plan (one line)."""


# The form of :meth:`InputPosition.state_dict`: bit arrays over the epochs' plans. A state
# without ``form`` is the one before (done batch indices and trained clips by id, plain JSON),
# still read; a newer form is refused.
STATE_FORM = 2


# How an epoch's trained places are saved: as numbers (little-endian, 4 bytes while they fit), or
# as a bit per clip of the plan where that is smaller (more than one clip in 32 or 64 trained from
# batches not done), so an open epoch never takes more than a bit per clip and a bit per batch.
PLACES_AS_BITS = "bits"


def place_form(clips: int, places: int) -> str:
    """The form of ``places`` trained places of a plan of ``clips``: a numpy type, or PLACES_AS_BITS."""
    kind = "<u4" if clips < 1 << 32 else "<u8"
    return PLACES_AS_BITS if places * np.dtype(kind).itemsize * 8 > clips else kind


@dataclass
class _EpochProgress:
    plan: EpochPlan  # the epoch's plan (the planner's, shared): where a trained clip lies, its batch (batch_of)
    sizes: list[int]  # samples of each planned batch (shared too)
    done: np.ndarray  # a bool per planned batch: trained whole
    partial: dict[int, set[int]] = field(default_factory=dict)  # planned index -> rows trained so far
    count: int = 0  # samples trained: kept as they are recorded (asked at every step)
    batches_done: int = 0  # of ``done``, kept the same way

    @classmethod
    def of(cls, planner: EpochPlanner, epoch: int) -> "_EpochProgress":
        sizes = planner.batch_sizes(epoch)  # first: where they are made, the plan is made and kept
        return cls(planner.plan(epoch), sizes, np.zeros(len(sizes), bool))

    def add(self, row: int) -> bool:
        index = self.plan.batch_of_row(row)
        if index < 0 or self.done[index]:
            return False
        got = self.partial.setdefault(index, set())
        if row in got:
            return False
        got.add(row)
        self.count += 1
        if len(got) == self.sizes[index]:
            self.done[index] = True
            self.batches_done += 1
            del self.partial[index]
        return True

    def mark_done(self, index: int) -> None:
        """Planned batch ``index`` trained whole."""
        if not self.done[index]:
            self.done[index] = True
            self.batches_done += 1
            self.count += self.sizes[index] - len(self.partial.pop(index, ()))

    def trained(self) -> int:
        return self.count

    def copy(self) -> "_EpochProgress":
        return _EpochProgress(self.plan, self.sizes, self.done.copy(),
                              {i: set(r) for i, r in self.partial.items()}, self.count, self.batches_done)

    def places(self) -> np.ndarray:
        """The places in the planned order (``plan.clips``) of the clips trained from batches not done, ascending."""
        plan = self.plan
        found = [plan.starts[index] + np.flatnonzero(np.isin(plan.clips[plan.starts[index]:plan.starts[index + 1]],
                                                             np.fromiter(rows, np.int64, len(rows))))
                 for index, rows in self.partial.items()]
        return np.sort(np.concatenate(found)) if found else np.zeros(0, np.int64)

    def state(self, epoch: int) -> dict[str, Any]:
        """This epoch's part of the saved position: raw bytes, no object per clip."""
        places, clips = self.places(), len(self.plan.clips)
        form = place_form(clips, len(places))
        if form == PLACES_AS_BITS:
            bits = np.zeros(clips, bool)
            bits[places] = True
            raw = np.packbits(bits).tobytes()
        else:
            raw = places.astype(form).tobytes()
        return {"epoch": epoch, "batches": len(self.done), "clips": clips, "done": np.packbits(self.done).tobytes(),
                "places_as": form, "places": raw}

    def restore(self, entry: Any) -> None:
        """Take the saved ``entry`` (of :meth:`state`); ValueError naming what does not fit the plan."""
        epoch, plan, batches = int(entry["epoch"]), self.plan, len(self.done)
        if (int(entry["batches"]), int(entry["clips"])) != (batches, len(plan.clips)):
            raise ValueError(f"epoch {epoch} was saved with {entry['batches']} planned batches of "
                             f"{entry['clips']} clips, its plan has {batches} of {len(plan.clips)}")
        self.done = _bits(entry["done"], batches, f"epoch {epoch}'s done batches")
        self.batches_done = int(np.count_nonzero(self.done))
        self.count = int(plan.sizes()[self.done].sum())
        form, raw = entry["places_as"], bytes(entry["places"])
        if form == PLACES_AS_BITS:
            places = np.flatnonzero(_bits(raw, len(plan.clips), f"epoch {epoch}'s trained places"))
        elif form in ("<u4", "<u8"):
            kind = np.dtype(form)
            if len(raw) % kind.itemsize:
                raise ValueError(f"epoch {epoch}: {len(raw)} bytes of places are not {kind.itemsize}-byte numbers")
            places = np.frombuffer(raw, kind).astype(np.int64)
        else:
            raise ValueError(f"epoch {epoch}: places saved as {form!r}")
        if len(places) and (places[-1] >= len(plan.clips) or (np.diff(places) <= 0).any()):
            raise ValueError(f"epoch {epoch}: trained places not ascending within its {len(plan.clips)} clips")
        rows = plan.clips[places]
        index = plan.batch_of(rows)
        if (index < 0).any() or self.done[np.maximum(index, 0)].any():
            raise ValueError(f"epoch {epoch}: a trained place is in another worker's share or a done batch")
        firsts = np.flatnonzero(np.diff(index, prepend=-1))  # places ascend: a batch's are together
        for first, stop in zip(firsts, [*firsts[1:], len(index)]):
            batch = int(index[first])
            got = set(rows[first:stop].tolist())
            if len(got) == self.sizes[batch]:
                self.mark_done(batch)
            else:
                self.partial[batch] = got
                self.count += len(got)

    def untrained(self) -> np.ndarray:
        """The table rows of this worker's share still to train, in planned order."""
        place, batch = self.plan.share()
        left = ~self.done[batch]
        rows = self.plan.clips[place[left]]
        if self.partial:
            trained = np.fromiter((r for got in self.partial.values() for r in got), np.int64)
            rows = rows[~np.isin(rows, trained)]
        return rows


def _bits(raw: Any, count: int, what: str) -> np.ndarray:
    """``count`` bools from their packed bytes; ValueError unless there are just enough, the rest zero."""
    packed = np.frombuffer(bytes(raw), np.uint8)
    if len(packed) != -(-count // 8):
        raise ValueError(f"{what}: {len(packed)} bytes for {count} bits")
    bits = np.unpackbits(packed)
    if bits[count:].any():
        raise ValueError(f"{what}: bits set beyond the {count}")
    return bits[:count].astype(bool)


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

    Its state: per open epoch a bool per planned batch (done) and, for the batches partly
    trained, their rows trained so far; complete epochs as ``complete_below`` (all epochs
    before it) and ``complete`` (later ones, when leasing ahead finished one first). Saved
    (:meth:`state_dict`) as bit arrays over each open epoch's plan, with the plan's key.
    """

    def __init__(self, planner: EpochPlanner) -> None:
        self.planner = planner
        self.complete: set[int] = set()  # epochs whose every sample was trained or rejected
        self._epochs: dict[int, _EpochProgress] = {}

    def _progress(self, epoch: int) -> _EpochProgress:
        progress = self._epochs.get(epoch)
        if progress is None:
            progress = self._epochs[epoch] = _EpochProgress.of(self.planner, epoch)
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
        elif whole is not None and 0 <= whole < len(progress.sizes) and not progress.done[whole] \
                and whole not in progress.partial:
            progress.mark_done(whole)
        else:
            rows = clips if clips is not None and len(clips) == len(ids) else self.planner.table.find_rows(list(ids))
            strays = [i for i, row in zip(ids, rows) if not progress.add(row)]
            if strays:
                log.warning("epoch %d: %d trained samples are not in its plan or were trained before: %s", epoch,
                            len(strays), strays[:5])
        for done in [e for e in self._epochs if e in self.complete]:  # their progress is needed no more
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
        return set(np.flatnonzero(progress.done).tolist()) if progress is not None else set()

    def untrained(self, epoch: int) -> np.ndarray:
        """The table rows of ``epoch`` still to train (this worker's share), in planned order, as
        one array: what :meth:`remaining` leaves, without a batch object each."""
        if epoch in self.complete:
            return np.zeros(0, np.int64)
        progress = self._epochs.get(epoch)
        if progress is None:
            plan = self.planner.plan(epoch)
            return plan.clips[plan.share()[0]]
        return progress.untrained()

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
        return epoch in self.complete or (progress is not None and bool(progress.done[index]))

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
        """The position as msgpack keeps it (raw bytes: not JSON): the plan's key and seed it was
        saved over, the epochs complete, and per open epoch its bit arrays (module docstring)."""
        below = self.first_open()
        return {"form": STATE_FORM, "plan": self.planner.key, "seed": self.planner.cfg.seed,
                "complete_below": below, "complete": sorted(e for e in self.complete if e > below),
                "open": [p.state(e) for e, p in sorted(self._epochs.items()) if e not in self.complete]}

    @classmethod
    def from_state_dict(cls, data: Any, planner: EpochPlanner) -> "InputPosition":
        """Rebuild a position (:meth:`state_dict`'s, or the form before it); PositionError when it
        does not fit the plan."""
        position = cls(planner)
        try:
            if "form" not in data:
                return position._restore_ids(data)
            if data["form"] != STATE_FORM:
                raise PositionError(f"the input position has form {data['form']!r}; this stoker reads form "
                                    f"{STATE_FORM} (and the one before)")
            if (data["plan"], data["seed"]) != (planner.key, planner.cfg.seed):
                raise PositionError(f"the input position was saved over another epoch plan (seed {data['seed']}, "
                                    f"plan key {str(data['plan'])[:16]}; this run's: seed {planner.cfg.seed}, "
                                    f"plan key {planner.key[:16]})")
            position._complete_from(data)
            for entry in data["open"]:
                epoch = int(entry["epoch"])
                if epoch in position._epochs or epoch in position.complete or epoch < 0:
                    raise ValueError(f"epoch {epoch} is open twice, or complete too")
                position._progress(epoch).restore(entry)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise PositionError(f"the input position does not fit this run's epoch plan ({exc})") from None
        return position

    def _complete_from(self, data: Any) -> None:
        self.complete = set(range(int(data["complete_below"]))) | {int(e) for e in data["complete"]}

    def _restore_ids(self, data: Any) -> "InputPosition":
        """The form before :data:`STATE_FORM` (JSON: per open epoch the indices of its done
        batches and the ids trained from the others), as checkpoints and feed states written
        before it hold it."""
        self._complete_from(data)
        for key, entry in data["open"].items():
            epoch = int(key)
            progress = self._progress(epoch)
            for index in entry["done"]:
                index = int(index)
                if not 0 <= index < len(progress.sizes):
                    raise ValueError(f"epoch {epoch} has no planned batch {index}")
                progress.mark_done(index)
            ids = [str(i) for i in entry["ids"]]
            for sample_id, row in zip(ids, self.planner.table.find_rows(ids) if ids else []):
                if progress.plan.batch_of_row(row) < 0:
                    raise ValueError(f"sample {sample_id!r} is not in the plan of epoch {epoch}")
                progress.add(row)
        return self

    def copy(self) -> "InputPosition":
        """An independent copy (for the coordinator, which plans in its own thread)."""
        other = InputPosition(self.planner)
        other.complete = set(self.complete)
        other._epochs = {e: p.copy() for e, p in self._epochs.items()}
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
                if progress is not None and progress.batches_done == len(progress.sizes):
                    self.complete.add(epoch)
            elif self.trained(epoch) + rejected_in_epoch(epoch) >= self.planner.samples_in(epoch):
                self.complete.add(epoch)
        return len(self.complete)

