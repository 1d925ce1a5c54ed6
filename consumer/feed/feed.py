"""The trainer side of the pipeline, without a model: where every training step gets its batch.

:class:`FeedCore` lives in the process that trains: it opens a :class:`PreparedRun` (the dataset
indexed, the epochs planned), starts the coordinator in a process of its own, hands out one
batch per step, counts a batch only once its step is confirmed (the input position), and
writes the step logs and summary.json. stoker's trainer (consumer/training/main.py) and
``stoker.Feed`` drive it, so there is one path from producers to a step::

    core = FeedCore(PreparedRun(cfg, run_dir), stop)   # index and plan, then open
    core.use_staging(staging)            # how batches reach the device (consumer/feed/frameworks.py)
    for item in core.batches():          # warm-up first; ends when the budget is reached or on stop
        handle = train_step(core.take(item))  # the user's step; a loss handle (float, tensor, None)
        core.step_done(handle)           # its step ends here (else at the next request)
        if core.flush_due():
            core.flush(resolve)           # the interval's losses fetched at once, rows written
    core.close(figures, resolve)         # the loop's own figures go into summary.json

docs/design/feed.md and docs/design/processes.md, "The coordinator process", tell the rest: what
confirms a step, what a step row measures, how long a handed-out batch's memory stays valid.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

from ..buffer import BatchQueue, QueuedBatch
from .checkpoint import trim_step_log
from .frameworks import Staging
from .handoff import CoordinatorProcess
from .handout import Confirmed, HandOutLedger
from ..position import InputPosition
from .prepared import PreparedRun
from .passes import ValidationPasses
from .progress import LiveLine
from .rejections import RejectionLog
from .runstate import (FeedStateError, FileFailures, MelStatsMissing, dataset_mel_norm, feature_cache_totals,
                       feed_state, keep_mel_stats, position_of, run_summary)
from .steplog import Resolved, StepLog, live_text, progress_line, resolve_floats
from .telemetry import Telemetry
from .validation import VALIDATION_QUEUE_CAPACITY
from ...shared.errors import UserError
from ...shared.dataset.layouts import Rejection
from ...shared.melstats import stats_key
from ...shared.metrics import HostCpu
from ...shared.proc import EXIT_OK, EXIT_USER, parent_alive, steady_heap
from ...shared.runfiles import (CONFIG, METRICS, RESUME_CONFIG, SAMPLES, SUMMARY, TRAINED, RunFileError,
                                write_json)

log = logging.getLogger("consumer")

# While waiting for a batch, wake this often to check the stop flag and the parent.
WAIT_SLICE_S = 0.25
# Say so when no batch has come for this long (no producer connected, all stalled).
NO_DATA_WARN_S = 10.0
# A user transform (or producer model) that failed every one of this many clips (or of all clips,
# when fewer) and let none through is broken, not unlucky: the run ends with one line instead of waiting.
ALL_FAILED_CLIPS = 32


class TransformFailed(UserError):
    """Nothing could train: every clip failed the same user transform or producer model, or every clip was rejected
    (a lease failing again and again); the message is one line for the user."""


class FeedCore:
    """An open run (module docstring), until :meth:`close`. ``state``: a feed's state_dict() to continue
    from. UserError (one line) for what the user must fix: the keys, the endpoint, a checkpoint or
    state that does not fit."""

    def __init__(self, prepared: PreparedRun, stop: threading.Event, *, parent_pid: int | None = None,
                 state: dict[str, Any] | None = None) -> None:
        self.prepared = prepared
        cfg, planner, index = prepared.cfg, prepared.planner, prepared.index
        # What the open run uses of the prepared one, by the names its users know.
        self.cfg, self.run_dir, self.planner, self.index = cfg, prepared.run_dir, planner, index
        self.vocabulary, self.checkpoints = prepared.vocabulary, prepared.checkpoints
        self.val_samples, self.val_batches = prepared.val_samples, prepared.val_batches
        self.stop = stop
        self.parent_pid = parent_pid
        self.started = time.monotonic()  # "t" in metrics.jsonl counts from here: the run's socket opens now
        self.rejections = RejectionLog(self.run_dir)
        self.step = 0
        self.epochs = cfg.trainer.epochs
        self.warmup_s = 0.0
        self.host_cpu = HostCpu()
        self.interrupted = False
        self.exit_reason, self.code = "completed", EXIT_OK
        self.files = FileFailures()  # the run's files it could not write (a full disk): the first ends the run
        self.ledger, self.warmed = HandOutLedger(), False  # handed out, held back, confirmed; warm-up done
        # Batches are handed out in one thread (tf.data's, under fit) and confirmed in another.
        self._lock = threading.Lock()
        if prepared.resume or state is not None:
            self._resume(state)
        self.position: InputPosition = self.checkpoints.position  # what was trained (confirmed)
        self.handed = self.position.copy()  # what was handed out: the trained part and what is taken ahead
        # With workers: the plan's order, step by step (a generator: it reads the position as it goes).
        self._positions = self.handed.planned_from_here(planner, self.epochs)
        self.handed_steps = self.step
        self.epochs_completed = len(self.position.complete)
        self.mel_key = stats_key(cfg.features, cfg.transforms, index.dataset_fingerprint)
        self.mel_norm = dataset_mel_norm(cfg, index.root, self.mel_key, self.run_dir)
        self.rejections.open()
        self._record_rejections(index.rejected + prepared.eval_rejected)
        self.rejections.flush()  # in rejected.jsonl before the feed's start returns, not at a later flush
        self.logs = StepLog(self.run_dir, cfg.trainer.record_samples)
        # With --epochs the run ends when those epochs are complete; re-planned misses can add
        # a batch or two, so the step count is only the plan's expectation (for progress lines).
        self.total_steps = None if self.epochs else cfg.trainer.steps
        self.expected_steps = self.epochs * planner.batches_per_epoch if self.epochs else cfg.trainer.steps
        self.queue = BatchQueue(cfg.pipeline.buffer_size)
        self.val_queue = BatchQueue(VALIDATION_QUEUE_CAPACITY)
        self.telemetry = Telemetry(self.run_dir, self.queue.capacity, self.expected_steps,
                                   lambda: self.coordinator.snapshot()["producers"], cfg.run.metrics_port)
        self.live = LiveLine()
        resumed = self.checkpoints.resumed is not None or state is not None
        # The coordinator, in a process of its own, bound once this returns (consumer/feed/handoff.py).
        self.coordinator = CoordinatorProcess(prepared, self.queue, self.val_queue, self.stop,
                                              self._record_rejections, self.position.copy() if resumed else None,
                                              self.mel_norm)
        self.queue.pump = self.val_queue.pump = self.coordinator.receive  # received by the thread that asks
        self.staging = Staging()  # host arrays, until use_staging
        self.passes = ValidationPasses(self.val_batches, self.val_queue, self.coordinator, self.stop,
                                       self.logs.validation, self._waiting, WAIT_SLICE_S)
        self.endpoint = self.coordinator.endpoint
        if cfg.trainer.steady_heap and not steady_heap():
            log.debug("trainer.steady_heap: malloc left as it is (the C library is not glibc, or mallopt refused)")
        self.opened = True  # until close()
        log.info("consumer listening on %s", self.endpoint)

    def use_staging(self, staging: Staging, validation: bool = True) -> None:
        """Stage the batches held and those that arrive from now on with ``staging``
        (consumer/feed/frameworks.py: a ``stoker.Feed``'s, or stoker's own trainer's), which
        is told where they arrive and settles each before its slot is written again;
        ``validation=False`` leaves the validation batches as host arrays (stoker's trainer
        splits and stages them itself)."""
        staging.use_memory(*self.coordinator.slots.memory())
        self.staging = staging
        for queue in (self.queue, self.val_queue) if validation else (self.queue,):
            queue.use_staging(staging)

    def take(self, item: QueuedBatch) -> Any:
        """The batch of ``item`` for the loop, in the loop's thread (Staging.take)."""
        return self.staging.take(item.arrays)

    def state_dict(self) -> dict[str, Any]:
        """The input position with what it belongs to (JSON): which planned batches of which
        epochs were trained, the step count, and the plan's and dataset's identity. The step
        logs are written up to this step first, so that a resume from it finds every row it
        counts (the interval's losses are fetched now)."""
        if self.opened:
            self.flush(check=False)
            self.flush_logs()
        with self._lock:
            return feed_state(self.step, self.position, self.checkpoints.identity)

    def _resume(self, state: Any) -> None:
        """Continue from the run directory's latest checkpoint (``prepared.resume``: checked, and the
        config the launcher resolved for the resumed run adopted) or from a feed's state_dict()
        ``state`` (FeedStateError when it does not fit); step logs cut back, rejected.jsonl kept."""
        if self.prepared.resume:
            resumed = self.checkpoints.resume(self.prepared.fresh_plan)  # CheckpointError before anything changes
            self.step = resumed.step
            self.started -= resumed.last_t  # "t" in metrics.jsonl goes on from the last row kept
            pending = self.run_dir / RESUME_CONFIG
            if pending.exists():
                pending.replace(self.run_dir / CONFIG)
        else:
            self.checkpoints.position, self.step = position_of(state, self.checkpoints.identity, self.planner)
            for name in (METRICS, SAMPLES, TRAINED):
                last = trim_step_log(self.run_dir / name, self.step)
                if name == METRICS and last is not None:
                    self.started -= float(last.get("t", 0.0))
            log.info("resuming the feed at step %d: epochs complete below %d, %d open epochs", self.step,
                     self.checkpoints.position.first_open(), len(self.checkpoints.position.trained_counts()))
        # The summary of the session before is rewritten at the end; until then it would be stale.
        (self.run_dir / SUMMARY).unlink(missing_ok=True)
        self.rejections.keep_before()

    # ------------------------------------------------------------ rejections
    def _record_rejections(self, rejections: list[Rejection]) -> None:
        """Write each rejected clip once (the coordinator's callback)."""
        self.rejections.record(rejections)

    def all_failed_one_transform(self, at_least: int = 1) -> str:
        """RejectionLog.all_failed_one_transform of this run: "" once a step trained."""
        return self.rejections.all_failed_one_transform(self.step, at_least)

    def nothing_trained(self) -> str:
        """RejectionLog.nothing_trained of this run: "" once a step trained, or before the epochs end."""
        return self.rejections.nothing_trained(self.step, self.epochs_completed)

    # ------------------------------------------------------------ steps
    def finished(self) -> bool:
        """Whether the budget is trained: ``total_steps`` steps confirmed, or the planned epochs complete."""
        if self.total_steps is not None:
            return self.step >= self.total_steps
        return self.epochs_completed >= (self.epochs or 0)

    def handed_all(self, epoch: int | None = None) -> bool:
        """Whether nothing is left to hand out: of the budget, or (``epoch``) of that epoch."""
        if self.ledger.returned(epoch):
            return False
        if self.total_steps is not None and self.handed_steps >= self.total_steps:
            return True
        if epoch is not None:
            return epoch in self.handed.complete or (self.epochs is not None and epoch >= self.epochs)
        return self.total_steps is None and len(self.handed.complete) >= (self.epochs or 0)

    def _update_epochs(self, trained: bool = True, handed: bool = True) -> None:
        """Mark epochs whose every sample was trained (handed out) or rejected; a step moves one of the two."""
        rejected = self.coordinator.rejected_epochs()
        if trained:
            self.epochs_completed = self.position.update_complete(self.epochs, self.coordinator.rejected_in_epoch,
                                                                  rejected)
        if handed:
            self.handed.update_complete(self.epochs, self.coordinator.rejected_in_epoch, rejected)

    def batches(self, confirm_on_request: bool = True, epoch: int | None = None) -> Iterator[QueuedBatch]:
        """Warm-up, then one batch per step until the budget, the plan's end or a stop
        (``interrupted`` tells which).

        ``confirm_on_request``: asking for the next batch confirms the last one handed out
        (its step ended there): true for a loop that takes each batch when it needs it; false
        where batches may be taken ahead of training (tf.data's prefetch), whose steps are
        confirmed by :meth:`step_done` alone. ``epoch``: hand out that epoch's batches only
        and end when all of them are handed out (batches of a later epoch that arrive first
        are held back, at most a queue's capacity of them)."""
        if self.handed_all(epoch):
            if epoch is None:
                log.info("nothing left to train at step %d (pass --steps or --epochs to go on)", self.step)
            return
        self._warm_up()
        while not self.handed_all(epoch):
            asked = time.monotonic()
            if confirm_on_request:
                self.confirm(asked)
            got = self._next_batch(asked, epoch)
            if got is None:
                if not self.handed_all(epoch):
                    self.interrupted = True
                return
            item, depth = got
            with self._lock:
                if self.ledger.hand(item, depth, asked, time.monotonic()):  # not a batch handed out again
                    self.handed_steps += 1
                    self._record(self.handed, item)
                    self._update_epochs(trained=False)
            yield item
            if self.stop.is_set() and not self.handed_all(epoch):
                if confirm_on_request:
                    self.confirm(time.monotonic())
                self.interrupted = True
                return
        if confirm_on_request:
            self.confirm(time.monotonic())

    def _record(self, position: InputPosition, item: QueuedBatch) -> None:
        """``item`` counts in ``position`` (handed out, or trained)."""
        position.record(item.epoch, item.ids, item.index if self.planner.workers > 1 else None, item.clips,
                        item.index if item.whole else None)

    def step_done(self, handle: Any = None) -> bool:
        """The step of the oldest batch handed out and not yet confirmed ended now; ``handle``:
        its loss (resolved at the next flush). False when no batch waited for it."""
        return self.confirm(time.monotonic(), handle)

    def hand_out_again(self) -> int:
        """The batches handed out and not confirmed go out again first (HandOutLedger.hand_out_again);
        the number of batches."""
        with self._lock:
            again = self.ledger.hand_out_again()
        if again:
            log.info("%d batch(es) taken ahead and never trained are handed out again", again)
        return again

    def training_epoch(self) -> int | None:
        """The epoch of the oldest batch handed out and not confirmed, else of the last confirmed one."""
        with self._lock:
            return self.ledger.training_epoch()

    @property
    def unconfirmed(self) -> int:
        """Batches handed out whose step has not been confirmed (taken ahead, or being trained)."""
        return len(self.ledger.unconfirmed)

    def confirm(self, ended: float, handle: Any = None) -> bool:
        """The oldest unconfirmed batch was trained, its step ending at ``ended``: it counts in the
        input position, the step logs and the step count (its figures: HandOutLedger.confirm).
        False when none was unconfirmed."""
        with self._lock:
            done = self.ledger.confirm(ended)
            if done is None:
                return False
            self.staging.settle(done.item.arrays)
            self.coordinator.release(done.item)  # its memory may be written again: the step is done
            self._record_step(done, ended, handle)
        return True

    def _record_step(self, done: Confirmed, ended: float, handle: Any) -> None:
        item = done.item
        self.step += 1
        row = {"step": self.step, "epoch": item.epoch, "t": round(ended - self.started, 4),
               "queue_depth": done.depth, "wait_ms": round(done.wait_s * 1e3, 3),
               "step_ms": round(done.step_s * 1e3, 3), "loss": None, "samples": len(item.ids),
               "producer": item.producer, "frames": item.frames, "frames_computed": item.frames_computed}
        self.logs.add(row, handle, item.ids)
        self._record(self.position, item)
        self._update_epochs(handed=False)
        self.telemetry.on_step(row)
        if self.live.due():
            self.live.update(self._live_text())

    def record_trained(self, epoch: int, rows: list[dict[str, Any]]) -> None:
        """What the step just confirmed received, as its trainer noted it (trained.jsonl; a
        stoker.Feed's loop trains on its own and writes none)."""
        self.logs.note_trained(self.step, epoch, rows)

    def flush_due(self) -> bool:
        """Whether the logging interval (trainer.log_every_steps) ends at this step."""
        return self.step % self.cfg.trainer.log_every_steps == 0 or self.finished()

    def flush(self, resolve: Callable[[Sequence[Any]], Resolved] = resolve_floats,
              check: bool = True) -> list[dict[str, Any]]:
        """End of a logging interval: fetch its losses at once (the one device sync), write its
        rows, log progress; the rows written. ``resolve``: what makes losses of the interval's
        loss handles (the trainer's; by default each a number). ``check=False``: a failing run
        keeps its rows without losses when they cannot be fetched."""
        rows = self.logs.flush(resolve, check)
        if rows:
            finite = [r["loss"] for r in rows if r["loss"] is not None]
            self._progress(sum(finite) / len(finite) if finite else None, rows)
        return rows

    def flush_if_due(self) -> None:
        """:meth:`flush` when the logging interval ends at this step."""
        if self.flush_due():
            self.flush()

    def flush_logs(self) -> None:
        """Every row so far on disk (before a checkpoint counts them)."""
        self.logs.flush_files()

    def _next_batch(self, asked: float, epoch: int | None = None) -> tuple[QueuedBatch, int] | None:
        """The next batch and the depth seen on asking (``epoch``: of that epoch or an earlier
        one; the queue holds later ones meanwhile); None when stopped while waiting, or when
        nothing is left to hand out meanwhile (the last samples were rejected)."""
        last_warn = asked
        want = next(self._positions, None) if self.planner.workers > 1 else None  # what every worker trains now
        while not self.stop.is_set():
            with self._lock:
                held = self.ledger.take_held(epoch)
            if held is not None:
                return held
            # A later epoch's batches wait in the queue; the coordinator keeps a slot free for this one's.
            got = self.queue.get(WAIT_SLICE_S, want, up_to_epoch=epoch)
            if got is not None:
                self.coordinator.taken(got[0])
                return got
            if self.epochs or epoch is not None:
                with self._lock:
                    self._update_epochs()
                if self.handed_all(epoch):
                    return None
            last_warn = self._waiting(asked, last_warn, "no batch for")
        if self.coordinator.failure is not None:  # it stopped the run: its one line, to the loop
            raise self.coordinator.failure
        return None

    def _waiting(self, since: float, last_warn: float, what: str) -> float:
        """One slice of waiting for a batch: live figures, the parent's liveness, a data
        failure that no waiting cures, and a warning every NO_DATA_WARN_S; returns when the
        last warning was given."""
        failure = self.all_failed_one_transform(min(ALL_FAILED_CLIPS, self.planner.samples_per_epoch))
        if failure:
            raise TransformFailed(failure)
        now = time.monotonic()
        self.telemetry.tick(now)
        if not parent_alive(self.parent_pid):
            log.error("launcher is gone; stopping")
            self.stop.set()
        elif now - last_warn >= NO_DATA_WARN_S:
            log.warning("%s %.0f s (%d producers alive)", what, now - since, self.coordinator.alive())
            return now
        return last_warn

    def _warm_up(self) -> None:
        """The first batch, then a full queue or model_start_delay_s more, so that producers
        still starting (importing TensorFlow, tracing) can fill the queue."""
        if self.warmed:
            return
        self.warmed = True
        warm_start = last_warn = time.monotonic()
        while not self.stop.is_set() and self.queue.wait_for_depth(1, WAIT_SLICE_S, self.stop) < 1:
            last_warn = self._waiting(warm_start, last_warn, "no batch yet after")
        self.queue.wait_for_depth(self.queue.capacity, self.cfg.pipeline.model_start_delay_s, self.stop)
        self.warmup_s = time.monotonic() - warm_start
        self.ledger.start(time.monotonic())
        self.host_cpu.start()  # summary.json's host_cpu: over the steady window

    # ------------------------------------------------------------ validation
    def validation_pass(self) -> Iterator[QueuedBatch]:
        """One validation pass (consumer/feed/passes.py): every held-out clip once, in batches the
        producers made as they make training batches, from a queue of their own. The step, the
        input position and metrics.jsonl stay as they are. Leaving it before its end leaves
        the rest of the pass unmade."""
        return self.passes.run(self.step)

    # ------------------------------------------------------------ progress
    def _live_text(self) -> str:
        return live_text(self.step, self.expected_steps, self.logs.last_loss, self.telemetry.window(time.monotonic()),
                         self.queue.capacity)

    def _progress(self, loss: float | None, recent: list[dict[str, Any]]) -> None:
        log.info("%s", progress_line(self.step, self.expected_steps, loss, recent, self.queue.capacity,
                                     self.coordinator.alive()))

    # ------------------------------------------------------------ closing
    def note_file_error(self, exc: RunFileError) -> None:
        """One of the run's files could not be written: the first such error ends the run
        (exit_reason, EXIT_USER; ``files.failure()`` is its one line); later ones only go to the log."""
        if self.files.note(exc):
            self.exit_reason, self.code = f"failed: {exc}"[:500], EXIT_USER

    def file_step(self, step: Callable[[], Any]) -> None:
        """Run ``step``, a write of the run's files; its RunFileError is noted, not raised, so
        that closing goes on (every file closed, summary.json tried)."""
        try:
            step()
        except RunFileError as exc:
            self.note_file_error(exc)

    def close(self, figures: Mapping[str, Any] | None = None,
              resolve: Callable[[Sequence[Any]], Resolved] = resolve_floats) -> None:
        """Stop the coordinator (STOP to every producer), close the queue and the step logs,
        write summary.json and, after a whole epoch, the mel statistics. Idempotent.
        ``figures``: the training loop's own for summary.json (its trainer, or who trained);
        ``resolve``: what makes losses of the last interval's loss handles (as :meth:`flush`).
        A file of the run it cannot write ends the run (:meth:`note_file_error`; the caller
        reports ``files.failure()``), and closing goes on."""
        if not self.opened:
            return
        self.opened = False
        if self.ledger.unconfirmed:
            log.info("%d batch(es) handed out were not confirmed as trained: the input position does not count "
                     "them, a resume trains them", len(self.ledger.unconfirmed))
        self.file_step(lambda: self.flush(resolve, check=False))
        self.stop.set()
        self.coordinator.close()
        self.queue.close()
        self.val_queue.close()
        self.staging.close()
        self.live.close()
        for writer in (*self.logs.writers(), self.rejections.writer):
            if writer is not None:
                self.file_step(writer.close)
        try:
            write_json(self.run_dir / SUMMARY, run_summary(self, figures or {}))
        except RunFileError as exc:
            self.files.summary = exc
            self.note_file_error(exc)
        if self.epochs_completed and not self.mel_norm and self.coordinator.mel_stats.frames:
            self.file_step(lambda: keep_mel_stats(self.coordinator.mel_stats, self.cfg, self.index.root, self.mel_key,
                                                  self.run_dir))
        log.info("run over (%s): %d steps, summary %s", self.exit_reason, self.step,
                 f"in {self.run_dir / SUMMARY}" if self.files.summary is None else "not written")


__all__ = ["FeedCore", "FeedStateError", "MelStatsMissing", "PreparedRun", "Resolved", "TransformFailed",
           "feature_cache_totals", "resolve_floats"]
