"""The trainer side of the pipeline, without a model: where every training step gets its batch.

:class:`FeedCore` lives in the process that trains. It indexes the dataset, plans the
epochs, binds the coordinator's socket and holds the bounded queue; it hands out batches
one step at a time, measures each step's wait and queue depth, records which planned
batches were trained (the input position), writes the step logs and, at the end,
summary.json. Two users drive it, so there is one path from producers to a training step:

- stoker's own trainer (consumer/training/main.py: ``TrainLoop``), in the consumer process the
  launcher started, with the launcher's producers;
- ``stoker.Feed`` (stoker/feed.py), in the user's own process and training loop, which
  starts and supervises its producers itself.

A run goes through two objects, each made whole by its constructor: :class:`PreparedRun`
indexes the dataset, saves its vocabulary, plans the epochs and finds the checkpoints (the
model is built from it: nothing is bound yet), and :class:`FeedCore` opens it: resumes the
input position, binds and starts the coordinator, makes the queues and step logs. Per step
the user of the core calls::

    core = FeedCore(PreparedRun(cfg, run_dir), stop)   # index and plan, then open
    for item in core.batches():          # warm-up first; ends when the budget is reached or on stop
        handle = train_step(item.arrays)  # the user's step; a loss handle (float, tensor, None)
        core.step_done(handle)           # its step ends here (else at the next request)
        if core.flush_due():
            core.flush(resolve)           # the interval's losses fetched at once, rows written
    core.close(figures, resolve)         # the loop's own figures go into summary.json

Handed out is not trained. A batch counts (in the input position that a checkpoint or
``state_dict`` saves, in the step count and in the step logs) only once its step is
*confirmed*: by :meth:`FeedCore.step_done`, or by the next request when batches are
taken one at a time (``batches(confirm_on_request=True)``). Where batches are taken
ahead of training (tf.data's prefetch under Keras ``fit``), only ``step_done`` confirms,
oldest first; what was handed out and never confirmed is trained again after a resume,
never skipped.

Step row (metrics.jsonl), written when the step is confirmed: ``wait_ms`` is the time
from the later of the batch's request and the end of the step before until the batch
was handed out (0 when it was taken ahead; work between steps is no wait),
``queue_depth`` the batches held when it was asked for, ``step_ms`` the time from the
later of its hand-out and the step before's end until the step was confirmed. The first request waits until the
queue is full or ``pipeline.model_start_delay_s`` has passed (warm-up, ``warmup_s``).

One file of some 700 lines: handing out, recording and closing are the life of one open
run whose state (plan, position, queue, step logs) they all share.

Stop: the step budget is reached, the planned epochs are complete (every sample of each
trained, or rejected while the run went on), or ``stop`` is set (checked between steps
and while waiting). :meth:`close` then stops the coordinator (STOP to every producer),
closes the queue and the step logs and writes summary.json.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from . import validation
from .buffer import BatchQueue, QueuedBatch
from .checkpoint import RunCheckpoints, trim_step_log
from .handoff import CoordinatorProcess
from .handout import Confirmed, HandOutLedger
from .plan import EpochPlanner, InputPosition, PlannedBatch, PositionError, check_message_size, validation_batches
from .progress import LiveLine
from .telemetry import Telemetry
from .validation import VALIDATION_QUEUE_CAPACITY
from ...shared import config as config_mod
from ...shared.cluster import Cluster, from_env, worker_dir_name
from ...shared.dataset import DatasetIndex, Sample, build_index, feature_cache_dir, mel_stats_file
from ...shared.errors import UserError
from ...shared.layouts import Rejection
from ...shared.melstats import MelStats, load, stats_key
from ...shared.metrics import JsonlWriter, read_jsonl, summarize
from ...shared.proc import EXIT_OK, EXIT_USER, parent_alive
from ...shared.runfiles import (CONFIG, MEL_STATS, METRICS, REJECTED, RESUME_CONFIG, SAMPLES, SUMMARY, TRAINED,
                                    VALIDATION_SAMPLES, VOCAB, RunFileError, write_json)
from ...shared.vocab import Vocabulary, load_vocabulary, save_vocabulary

log = logging.getLogger("consumer")

# While waiting for a batch, wake this often to check the stop flag and the parent.
WAIT_SLICE_S = 0.25
# Say so when no batch has come for this long (no producer connected, all stalled).
NO_DATA_WARN_S = 10.0
# A user transform (or producer model) that failed every one of this many clips (or of all clips,
# when fewer) and let none through is broken, not unlucky: the run ends with one line instead of waiting.
ALL_FAILED_CLIPS = 32
# A rejection's reason as counted for the one line of a run that trained nothing.
REASON_CHARS = 300
# The start of a rejection reason naming the user transform (or declared field) that failed it.
TRANSFORM_FAILURE = re.compile(r"(?:transform|producer model) (field \S+|[\w.]+:\w+)")
# The format of a feed's state_dict(); a newer one is refused, not guessed at.
FEED_STATE_FORMAT = 1


class MelStatsMissing(UserError):
    """transforms.mel_norm=dataset without the dataset's statistics; one line for the user."""


class TransformFailed(UserError):
    """Nothing could train: every clip failed the same user transform or producer model, or every clip was rejected
    (a lease failing again and again); the message is one line for the user."""


class FeedStateError(UserError):
    """A feed state (``resume=``) that does not belong to this dataset and plan; one line."""


@dataclasses.dataclass
class Resolved:
    """What a resolver makes of an interval's loss handles: a loss per step, and optionally
    each step's named terms."""

    losses: list[float | None]
    terms: Sequence[dict[str, float] | None] | None = None


def resolve_floats(handles: Sequence[Any]) -> Resolved:
    """The default resolver: each handle a number (a float, a NumPy or TensorFlow scalar),
    or a dict with ``loss`` and named terms, or None."""
    losses: list[float | None] = []
    terms: list[dict[str, float] | None] = []
    for handle in handles:
        named: dict[str, float] | None = None
        if isinstance(handle, dict):
            named = {str(k): float(v) for k, v in handle.items() if k != "loss" and v is not None}
            handle = handle.get("loss")
        losses.append(None if handle is None else float(handle))
        terms.append(named or None)
    return Resolved(losses, terms)


class PreparedRun:
    """A run directory's dataset indexed and its epochs planned: what exists before any socket
    opens, from which the model can be built (its vocabulary size is known). Its constructor
    makes it whole; UserError (one line) for a dataset to fix. :class:`FeedCore` opens it.

    ``resume``: continue from the run directory's checkpoint (stoker's trainer), keeping its
    vocabulary; ``fresh_plan``: with ``resume``, its model and step count on a new epoch plan;
    ``hold_out``: keep validation clips out of the plan (a trainer with a loss to validate)."""

    def __init__(self, cfg: config_mod.Config, run_dir: Path, *, resume: bool = False, hold_out: bool = False,
                 fresh_plan: bool = False) -> None:
        self.run_dir = run_dir
        self.resume = resume
        self.fresh_plan = fresh_plan
        # Trainer workers of a multi-host job (TF_CONFIG): this one trains its share of every step's batch.
        cluster: Cluster | None = from_env(os.environ)
        # Replicas and workers split every batch into equal parts: its rows are fixed (row_mask on).
        cfg = config_mod.with_fixed_rows(cfg, cluster.size if cluster is not None else 1)
        index, self.vocabulary, feature_cache = self._index(cfg)
        self.index, self.feature_cache = index, feature_cache
        if feature_cache != cfg.data.feature_cache:
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, feature_cache=feature_cache))
        self.cfg = cfg
        self.val_samples: list[Sample] = []
        if hold_out:
            train, self.val_samples, self.eval_rejected = validation.hold_out(index, cfg, run_dir, resume)
        else:
            train, self.eval_rejected = index.samples, []
        self.train_samples = train
        workers, worker = (cluster.size, cluster.index) if cluster is not None else (1, 0)
        self.planner = planner = EpochPlanner(train, cfg.batching, cfg.devices.replicas or 1, workers, worker)
        # the held-out clips' batches (consumer/pipeline/plan.validation_batches)
        self.val_batches: list[PlannedBatch] = validation_batches(self.val_samples, planner)
        check_message_size(cfg, [*planner.shapes, *((b.rows, *b.shape) for b in self.val_batches)])
        log.info("dataset %s: %d clips usable, %d rejected; %d batches per epoch in %d shapes (B, L, T) %s%s",
                 index.root, len(index.samples), len(index.rejected), planner.batches_per_epoch,
                 len(planner.shapes), planner.shapes,
                 f" (frame budget {cfg.batching.max_frames})" if cfg.batching.max_frames else "")
        agreed = index.agreement
        log.info("dataset fingerprint %s (metadata %s, audio index %s; %d audio files missing here)",
                 index.dataset_fingerprint, agreed["metadata"], agreed["audio"], agreed["missing"])
        peers = [run_dir.parent / worker_dir_name(i) for i in range(workers) if i != worker]  # none alone
        self.checkpoints = RunCheckpoints(run_dir, cfg, planner, index.dataset_fingerprint, self.vocabulary, peers)

    def _index(self, cfg: config_mod.Config) -> tuple[DatasetIndex, Vocabulary, str]:
        """The dataset's index, its vocabulary (saved in the run) and the feature cache directory."""
        # A resumed run keeps its vocabulary: texts it cannot encode are rejected, not re-numbered.
        fixed = load_vocabulary(self.run_dir / VOCAB) if self.resume else None
        index = build_index(cfg.data, cfg.features, cfg.text, fixed)
        vocab = index.vocabulary
        assert vocab is not None
        save_vocabulary(vocab, self.run_dir / VOCAB)
        log.info("text front-end %s: %d token ids, languages %s, %d speaker(s); vocabulary %s in %s",
                 vocab.frontend, vocab.size, ", ".join(vocab.languages), len(vocab.speakers), vocab.fingerprint,
                 self.run_dir / VOCAB)
        feature_cache = feature_cache_dir(cfg.data.feature_cache, index.root)
        if feature_cache:
            log.info("feature cache %s", feature_cache)
        return index, vocab, feature_cache


class FeedCore:
    """An open run: a prepared run (:class:`PreparedRun`) with its coordinator bound and
    started, its queues, step logs and input position (see the module docstring). Its
    constructor opens it; :meth:`close` ends it. ``state``: a feed's state_dict() to continue
    from. UserError (one line) for what the user must fix: the keys, the endpoint, a
    checkpoint or state that does not fit."""

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
        # With workers: the plan's order, step by step (a generator: it reads the position at the first step).
        self._positions = self._plan_order()
        self.started = time.monotonic()  # "t" in metrics.jsonl counts from here: the run's socket opens now
        self.rejected_count = 0
        self._producer_rejected: set[str] = set()
        self._rejected_before: set[tuple[str, str]] = set()  # rows a resumed run's rejected.jsonl holds
        self._producer_reasons: collections.Counter[str] = collections.Counter()  # "transform X" or ""
        self._reasons: collections.Counter[str] = collections.Counter()  # why producers (or leases) rejected clips
        self.step = 0
        self.epochs = cfg.trainer.epochs
        self.warmup_s = 0.0
        self.interrupted = False
        self.exit_reason, self.code = "completed", EXIT_OK
        # The first of the run's files that could not be written (a full disk, ...): it ends the
        # run; and whether summary.json could not be written either (close).
        self.file_error: RunFileError | None = None
        self.summary_error: RunFileError | None = None
        self._pending: list[tuple[dict[str, Any], Any]] = []  # rows whose loss is not fetched yet
        self.ledger = HandOutLedger()  # handed out, held back, confirmed
        self.warmed = False
        # Batches are handed out in one thread (tf.data's, under fit) and confirmed in another.
        self._lock = threading.Lock()
        # One interval's rows written at a time: Keras may confirm steps (and flush) from threads of its own.
        self._flushing = threading.Lock()
        self.last_loss: float | None = None
        self.validation_passes = 0
        if prepared.resume:
            self._resume_checkpoint()  # CheckpointError before anything in the run directory changes
        elif state is not None:
            self._resume_state(state)
        self.position: InputPosition = self.checkpoints.position  # what was trained (confirmed)
        self.handed = self.position.copy()  # what was handed out: the trained part and what is taken ahead
        self.handed_steps = self.step
        self.epochs_completed = len(self.position.complete)
        self.mel_key = stats_key(cfg.features, cfg.transforms, index.dataset_fingerprint)
        self.mel_norm = self._mel_norm(index, self.mel_key)
        self.rejected = JsonlWriter(self.run_dir / REJECTED)
        self._record_rejections(index.rejected + prepared.eval_rejected)
        self.metrics = JsonlWriter(self.run_dir / METRICS)
        self.samples_log = JsonlWriter(self.run_dir / SAMPLES) if cfg.trainer.record_samples else None
        self.trained_log: JsonlWriter | None = None  # opened by the first step a trainer notes (record_trained)
        self.val_log = JsonlWriter(self.run_dir / VALIDATION_SAMPLES) if cfg.trainer.record_samples else None
        # With --epochs the run ends when those epochs are complete; re-planned misses can add
        # a batch or two, so the step count is only the plan's expectation (for progress lines).
        self.total_steps = None if self.epochs else cfg.trainer.steps
        self.expected_steps = self.epochs * planner.batches_per_epoch if self.epochs else cfg.trainer.steps
        self.queue = BatchQueue(cfg.pipeline.buffer_size)
        self.val_queue = BatchQueue(VALIDATION_QUEUE_CAPACITY)
        resumed = self.checkpoints.resumed is not None or state is not None
        # The coordinator, in a process of its own, bound once this returns (consumer/pipeline/handoff.py).
        self.coordinator = CoordinatorProcess(prepared, self.queue, self.val_queue, self.stop,
                                              self._record_rejections, self.position.copy() if resumed else None,
                                              self.mel_norm)
        self.telemetry = Telemetry(self.run_dir, self.queue.capacity, self.expected_steps,
                                   lambda: self.coordinator.snapshot()["producers"], cfg.run.metrics_port)
        self.live = LiveLine()
        self.endpoint = self.coordinator.endpoint
        self.opened = True  # until close()
        log.info("consumer listening on %s", self.endpoint)

    def _resume_checkpoint(self) -> None:
        """Continue from the run directory's latest checkpoint: check it, cut the step logs back
        to it, adopt the config the launcher resolved for the resumed run, keep rejected.jsonl."""
        resumed = self.checkpoints.resume(self.prepared.fresh_plan)
        self.step = resumed.step
        self.started -= resumed.last_t  # "t" in metrics.jsonl goes on from the last row kept
        pending = self.run_dir / RESUME_CONFIG
        if pending.exists():
            pending.replace(self.run_dir / CONFIG)
        self._keep_rejected()

    def _keep_rejected(self) -> None:
        # The summary of the session before is rewritten at the end; until then it would be stale.
        (self.run_dir / SUMMARY).unlink(missing_ok=True)
        self._rejected_before = {(str(r.get("id")), str(r.get("reason"))) for r in
                                 read_jsonl(self.run_dir / REJECTED)}
        self._producer_rejected = {i for i, _ in self._rejected_before}
        self.rejected_count = len(self._rejected_before)

    def state_dict(self) -> dict[str, Any]:
        """The input position with what it belongs to (JSON): which planned batches of which
        epochs were trained, the step count, and the plan's and dataset's identity. The step
        logs are written up to this step first, so that a resume from it finds every row it
        counts (the interval's losses are fetched now)."""
        if self.opened:
            self.flush(check=False)
            self.flush_logs()
        identity = self.checkpoints.identity
        with self._lock:
            return {"format": FEED_STATE_FORMAT, "step": self.step, "plan": identity["fingerprint"],
                    "dataset_fingerprint": identity["dataset_fingerprint"],
                    "batches_per_epoch": identity["batches_per_epoch"], "position": self.position.state_dict()}

    def _resume_state(self, state: Any) -> None:
        """Continue from a feed's state_dict(): FeedStateError when it is not one, or belongs to
        another dataset or plan. Step logs of this run directory are cut back to its step."""
        if not isinstance(state, dict) or "position" not in state or "plan" not in state:
            raise FeedStateError("resume= takes what feed.state_dict() returned (a dict with the input position); "
                                 f"got {type(state).__name__}")
        if state.get("format") != FEED_STATE_FORMAT:
            raise FeedStateError(f"resume= state has format {state.get('format')!r}; this stoker reads "
                                 f"format {FEED_STATE_FORMAT}")
        identity = self.checkpoints.identity
        if state.get("dataset_fingerprint") != identity["dataset_fingerprint"]:
            raise FeedStateError(f"resume= state belongs to another dataset (fingerprint "
                                 f"{state.get('dataset_fingerprint')}, this one {identity['dataset_fingerprint']})")
        if state.get("plan") != identity["fingerprint"]:
            raise FeedStateError("resume= state belongs to another epoch plan of this dataset (batch_size, "
                                 "max_frames, num_buckets, seed or the features differ from the run that saved it)")
        try:
            self.checkpoints.position = InputPosition.from_state_dict(state["position"], self.planner)
        except PositionError as exc:
            raise FeedStateError(f"resume= state: {exc}") from None
        self.step = int(state.get("step") or 0)
        for name in (METRICS, SAMPLES, TRAINED):
            last = trim_step_log(self.run_dir / name, self.step)
            if name == METRICS and last is not None:
                self.started -= float(last.get("t", 0.0))
        self._keep_rejected()
        log.info("resuming the feed at step %d: epochs complete below %d, %d open epochs", self.step,
                 self.checkpoints.position.first_open(), len(self.checkpoints.position.trained_counts()))

    def _mel_norm(self, index: Any, key: str) -> dict[str, Any] | None:
        """transforms.mel_norm: dataset: the dataset's mel statistics for these settings (kept in
        the run directory for synth and export); UserError (one line) when none were measured."""
        cfg = self.cfg
        if cfg.transforms.mel_norm != "dataset":
            return None
        path = mel_stats_file(index.root, cfg.data, key)
        try:
            data = json.loads(path.read_text(encoding="utf-8")) if path is not None else None
            load(data or {}, cfg.features.n_mels)
        except (OSError, ValueError) as exc:
            raise MelStatsMissing(f"transforms.mel_norm=dataset needs the dataset's mel statistics for these "
                                  f"features and transforms, and there are none ({path or 'data.index_cache is off'}: "
                                  f"{getattr(exc, 'strerror', None) or exc}): run `python run.py precompute` with "
                                  f"the same data, features and transforms first") from None
        write_json(self.run_dir / MEL_STATS, data)
        log.info("mel normalised with the dataset's statistics over %s frames (%s)", data.get("frames"), path)
        return data

    # ------------------------------------------------------------ rejections
    def _record_rejections(self, rejections: list[Rejection]) -> None:
        """Write each rejected clip once: a clip a producer cannot read fails again every epoch."""
        for r in rejections:
            if (r.id, r.reason) in self._rejected_before:
                continue
            if r.producer != "index":
                if r.id in self._producer_rejected:
                    continue
                self._producer_rejected.add(r.id)
                self._reasons[r.reason[:REASON_CHARS]] += 1
                failed = TRANSFORM_FAILURE.match(r.reason)  # which transform (or declared field) failed
                self._producer_reasons[failed.group(0) if failed else ""] += 1
            self.rejected.write(r.to_json())
            self.rejected_count += 1

    def all_failed_one_transform(self, at_least: int = 1) -> str:
        """The one line when no clip trained and every clip a producer rejected (at least
        ``at_least``) failed the same user transform ("" otherwise)."""
        if self.step or len(self._producer_reasons) != 1:
            return ""
        (family, count), = self._producer_reasons.items()
        if not family or count < at_least:
            return ""
        fix = ("the model or take it out of transforms.models" if family.startswith("producer model")
               else "the transform or take it out of transforms.user")
        return f"every clip failed {family} ({count} rejected, reasons in rejected.jsonl): fix {fix}"

    def nothing_trained(self) -> str:
        """The one line when the planned epochs ended with no step trained because every clip
        was rejected while the run went on ("" otherwise): the most common reason."""
        if self.step or not self.epochs_completed or not self._reasons:
            return ""
        reason, count = self._reasons.most_common(1)[0]
        return (f"nothing could train: every clip was rejected ({sum(self._reasons.values())}, reasons in "
                f"rejected.jsonl); {count} for: {reason}")

    def _check_transforms(self) -> str:
        return self.all_failed_one_transform(min(ALL_FAILED_CLIPS, self.planner.samples_per_epoch))

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

    def _update_epochs(self) -> None:
        """Mark epochs whose every sample was trained (handed out) or rejected while the run went on."""
        self.epochs_completed = self.position.update_complete(self.epochs, self.coordinator.rejected_in_epoch)
        self.handed.update_complete(self.epochs, self.coordinator.rejected_in_epoch)

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
                    self.handed.record(item.epoch, item.ids, item.index if self.planner.workers > 1 else None,
                                       item.clips)
                    self._update_epochs()
            yield item
            if self.stop.is_set() and not self.handed_all(epoch):
                if confirm_on_request:
                    self.confirm(time.monotonic())
                self.interrupted = True
                return
        if confirm_on_request:
            self.confirm(time.monotonic())

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
        if self.samples_log is not None:
            self.samples_log.write({"step": self.step, "epoch": item.epoch, "ids": item.ids})
        self.position.record(item.epoch, item.ids, item.index if self.planner.workers > 1 else None, item.clips)
        self._update_epochs()
        self._pending.append((row, handle))
        self.telemetry.on_step(row)
        if self.live.due():
            self.live.update(self._live_text())

    def record_trained(self, epoch: int, rows: list[dict[str, Any]]) -> None:
        """What the step just confirmed received, as its trainer noted it (trained.jsonl; a
        stoker.Feed's loop trains on its own and writes none)."""
        if self.trained_log is None:
            self.trained_log = JsonlWriter(self.run_dir / TRAINED)
        self.trained_log.write({"step": self.step, "epoch": epoch, "rows": rows})

    def flush_due(self) -> bool:
        """Whether the logging interval (trainer.log_every_steps) ends at this step."""
        return self.step % self.cfg.trainer.log_every_steps == 0 or self.finished()

    def flush(self, resolve: Callable[[Sequence[Any]], Resolved] = resolve_floats,
              check: bool = True) -> list[dict[str, Any]]:
        """End of a logging interval: fetch its losses at once (the one device sync), write its
        rows, log progress; the rows written. ``resolve``: what makes losses of the interval's
        loss handles (the trainer's; by default each a number). ``check=False``: a failing run
        keeps its rows without losses when they cannot be fetched."""
        with self._flushing:
            return self._flush(resolve, check)

    def flush_if_due(self) -> None:
        """:meth:`flush` when the logging interval ends at this step."""
        if self.flush_due():
            self.flush()

    def _flush(self, resolve: Callable[[Sequence[Any]], Resolved], check: bool) -> list[dict[str, Any]]:
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return []
        try:
            resolved = resolve([handle for _, handle in pending])
        except Exception as exc:  # already failing (check=False): keep the rows, without losses
            if check:
                raise
            log.warning("losses of the last %d steps unavailable: %s", len(pending), exc)
            resolved = Resolved([None] * len(pending))
        terms = resolved.terms or [None] * len(pending)
        rows = []
        for (row, _), loss, named in zip(pending, resolved.losses, terms):
            row["loss"] = loss if loss is None or math.isfinite(loss) else None
            if named:  # each term of the loss (a mean), as the step computed it: metrics.jsonl "terms"
                row["terms"] = {k: round(v, 6) if math.isfinite(v) else None for k, v in named.items()}
            self.metrics.write(row)
            rows.append(row)
        finite = [r["loss"] for r in rows if r["loss"] is not None]
        if finite:
            self.last_loss = finite[-1]
        self._progress(sum(finite) / len(finite) if finite else None, rows)
        return rows

    def flush_logs(self) -> None:
        """Every row so far on disk (before a checkpoint counts them)."""
        self.metrics.flush()
        for log_file in (self.samples_log, self.trained_log):
            if log_file is not None:
                log_file.flush()

    def _next_batch(self, asked: float, epoch: int | None = None) -> tuple[QueuedBatch, int] | None:
        """The next batch and the depth seen on asking (``epoch``: of that epoch or an earlier
        one; the queue holds later ones meanwhile); None when stopped while waiting, or when
        nothing is left to hand out meanwhile (the last samples were rejected)."""
        last_warn = asked
        want = self._next_position() if self.planner.workers > 1 else None
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

    def _next_position(self) -> tuple[int, int] | None:
        """The (epoch, index) every worker trains at this step: the plan's batches in order,
        from the input position on (None past the last planned epoch)."""
        return next(self._positions, None)

    def _plan_order(self) -> Iterator[tuple[int, int]]:
        epoch = self.handed.first_open()
        while self.epochs is None or epoch < self.epochs:
            plan = self.planner.plan(epoch)
            for index in range(len(plan)):  # the plan's batches made one at a time
                if not self.handed.is_done(epoch, index):
                    yield epoch, index
            epoch += 1

    def _waiting(self, since: float, last_warn: float, what: str) -> float:
        """One slice of waiting for a batch: live figures, the parent's liveness, a data
        failure that no waiting cures, and a warning every NO_DATA_WARN_S; returns when the
        last warning was given."""
        failure = self._check_transforms()
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

    # ------------------------------------------------------------ validation
    def validation_pass(self) -> Iterator[QueuedBatch]:
        """One validation pass (consumer/pipeline/validation.py): every held-out clip once, in batches the
        producers made as they make training batches, from a queue of their own. The step, the
        input position and metrics.jsonl stay as they are. Leaving it before its end leaves
        the rest of the pass unmade."""
        if not self.val_batches:
            log.info("validation pass: no clip is held out (trainer.val_clips 0 and no data.eval_file): it is empty")
            return
        self.validation_passes += 1
        number = self.validation_passes
        self.coordinator.start_validation(number)
        finished = False
        clips = 0
        asked = last_warn = time.monotonic()
        try:
            while not self.stop.is_set():
                # The coordinator queues a pass's last batch before it marks the pass finished.
                if self.coordinator.validation_finished() >= number and not len(self.val_queue):
                    finished = True
                    break
                got = self.val_queue.get(WAIT_SLICE_S)
                if got is None:
                    last_warn = self._waiting(asked, last_warn, "no validation batch for")
                    continue
                self.coordinator.taken(got[0])
                item = got[0]
                if item.epoch != -number:
                    continue  # of a pass left before its end
                if self.val_log is not None:
                    self.val_log.write({"pass": number, "step": self.step, "ids": item.ids})
                clips += len(item.ids)
                yield item
                asked = time.monotonic()
        finally:
            if not finished:
                self.coordinator.cancel_validation(number)
        if finished:
            log.info("validation pass %d at step %d: %d held-out clips", number, self.step, clips)
        else:
            log.warning("validation pass %d at step %d cut short: the run is stopping", number, self.step)

    # ------------------------------------------------------------ progress
    def _live_text(self) -> str:
        window = self.telemetry.window(time.monotonic())
        total = f"/{self.expected_steps}" if self.expected_steps else ""
        loss = f"  loss {self.last_loss:.4f}" if self.last_loss is not None else ""
        wait = window["wait_frac"]
        return (f"step {self.step}{total}{loss}  {window['samples_per_s'] or 0:.1f} samples/s  "
                f"queue {window['queue_depth_mean'] or 0:.1f}/{self.queue.capacity}  "
                f"wait {100 * (wait or 0):.1f}%")

    def _progress(self, loss: float | None, recent: list[dict[str, Any]]) -> None:
        wait = sum(r["wait_ms"] for r in recent)
        busy = wait + sum(r["step_ms"] for r in recent)
        samples = sum(r["samples"] for r in recent)
        depth = sum(r["queue_depth"] for r in recent) / len(recent)
        loss_text = f"loss {loss:.4f}  " if loss is not None else ""
        log.info("step %d%s  %s%.1f samples/s  queue %.1f/%d  wait %.1f%%  producers %d",
                 self.step, f"/{self.expected_steps}" if self.expected_steps else "", loss_text,
                 samples / (busy / 1000) if busy else 0.0, depth, self.cfg.pipeline.buffer_size,
                 100 * wait / busy if busy else 0.0, self.coordinator.alive())

    # ------------------------------------------------------------ closing
    def note_file_error(self, exc: RunFileError) -> None:
        """One of the run's files could not be written: the first such error ends the run
        (exit_reason, EXIT_USER); later ones (the same full disk) only go to the log."""
        if self.file_error is None:
            self.file_error = exc
            self.exit_reason, self.code = f"failed: {exc}"[:500], EXIT_USER
        else:
            log.warning("%s", exc)

    def file_step(self, step: Callable[[], Any]) -> None:
        """Run ``step``, a write of the run's files; its RunFileError is noted, not raised, so
        that closing goes on (every file closed, summary.json tried)."""
        try:
            step()
        except RunFileError as exc:
            self.note_file_error(exc)

    def file_failure(self) -> UserError | None:
        """The one line of a run ended by a file it could not write (None if none): the file
        and the error, and whether summary.json could not be written either."""
        if self.file_error is None:
            return None
        summary = self.summary_error
        return UserError(f"{self.file_error}" + (f"; summary.json not written either ({summary.strerror})"
                                                 if summary is not None else ""))

    def close(self, figures: Mapping[str, Any] | None = None,
              resolve: Callable[[Sequence[Any]], Resolved] = resolve_floats) -> None:
        """Stop the coordinator (STOP to every producer), close the queue and the step logs,
        write summary.json and, after a whole epoch, the mel statistics. Idempotent.
        ``figures``: the training loop's own for summary.json (its trainer, or who trained);
        ``resolve``: what makes losses of the last interval's loss handles (as :meth:`flush`).
        A file of the run it cannot write ends the run (:meth:`note_file_error`; the caller
        reports :meth:`file_failure`), and closing goes on."""
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
        self.live.close()
        for writer in (self.metrics, self.samples_log, self.trained_log, self.val_log, self.rejected):
            if writer is not None:
                self.file_step(writer.close)
        try:
            write_json(self.run_dir / SUMMARY, self._summary(figures or {}))
        except RunFileError as exc:
            self.summary_error = exc
            self.note_file_error(exc)
        if self.epochs_completed and not self.mel_norm and self.coordinator.mel_stats.frames:
            self.file_step(lambda: self._keep_mel_stats(self.coordinator.mel_stats))
        log.info("run over (%s): %d steps, summary %s", self.exit_reason, self.step,
                 f"in {self.run_dir / SUMMARY}" if self.summary_error is None else "not written")

    def _summary(self, figures: Mapping[str, Any]) -> dict[str, Any]:
        """summary.json: the run's figures from metrics.jsonl and the coordinator, with the dataset,
        text, checkpoint and the training loop's ``figures`` beside them."""
        cfg, index, vocab, queue = self.cfg, self.index, self.vocabulary, self.queue
        snap = self.coordinator.snapshot()
        resumed = self.checkpoints.resumed
        return summarize(
            read_jsonl(self.run_dir / METRICS), capacity=cfg.pipeline.buffer_size,
            batches_per_epoch=self.planner.batches_per_epoch, producers=snap["producers"],
            rejected=self.rejected_count, exit_reason=self.exit_reason,
            wall_s=time.monotonic() - self.started, warmup_s=self.warmup_s, batch_size=cfg.batching.batch_size,
            extra={"epochs_completed": self.epochs_completed, "model": cfg.trainer.model,
                   "rejected_messages": snap["rejected_messages"], "reissued_leases": snap["reissued_leases"],
                   "queue_high_water": queue.high_water, "stage_errors": queue.stage_errors,
                   "host_cores": os.cpu_count(), "clips": len(index.samples), "val_clips": len(self.val_samples),
                   "validation_passes": self.validation_passes,
                   "text": {"frontend": vocab.frontend, "vocab_size": vocab.size, "vocabulary": vocab.fingerprint,
                            "languages": list(vocab.languages), "speakers": len(vocab.speakers), "lost": index.lost},
                   "index": index.stats.to_json(),
                   "feature_cache": feature_cache_totals(self.prepared.feature_cache, snap["producers"]),
                   "missed_samples": snap["missed_samples"], "refused_producers": snap["refused_producers"],
                   "failovers": snap["failovers"], "dataset_fingerprint": index.dataset_fingerprint,
                   "checkpoint": self.checkpoints.summary(),
                   "resumed_from_step": resumed.step if resumed is not None else None,
                   "replicas": self.planner.replicas * self.planner.workers,
                   "workers": self.planner.workers, "worker": self.planner.worker,
                   **figures})

    def _keep_mel_stats(self, stats: MelStats) -> None:
        """After a whole epoch: the mel statistics measured, in the run and beside the dataset's
        index cache, where transforms.mel_norm=dataset finds them."""
        data = stats.to_json(self.mel_key)
        write_json(self.run_dir / MEL_STATS, data)
        path = mel_stats_file(self.index.root, self.cfg.data, self.mel_key)
        if path is None:
            return
        try:
            write_json(path, data)
        except OSError as exc:
            log.warning("mel statistics not kept beside the dataset (%s: %s); they are in %s", path,
                        exc.strerror or exc, self.run_dir / MEL_STATS)
            return
        log.info("mel statistics over %d frames kept in %s", stats.frames, path)


def feature_cache_totals(directory: str, producers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """summary.json's ``feature_cache``: what the producers' caches did, summed (None: off)."""
    if not directory:
        return None
    totals: dict[str, Any] = {"dir": directory}
    for key in ("hits", "computed", "stale", "corrupt"):
        totals[key] = sum(int(p.get(f"cache_{key}", 0) or 0) for p in producers)
    return totals


__all__ = ["FeedCore", "FeedStateError", "MelStatsMissing", "PreparedRun", "Resolved", "TransformFailed",
           "feature_cache_totals", "resolve_floats"]
