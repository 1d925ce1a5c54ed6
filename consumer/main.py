"""The consumer process: dataset index, coordinator, bounded queue, trainer loop, run files.

Started by the launcher as ``python -m consumer.main --run-dir DIR`` with
``CUDA_VISIBLE_DEVICES`` already naming the model GPU (or none). It reads the resolved
``DIR/config.yaml``, indexes the dataset, binds the ROUTER socket and tells the launcher
the endpoint on its status pipe (``{"event": "ready", "endpoint": ...}``), then trains.

Training loop, per step: ask the queue for the next batch (the time until it comes is
``wait_ms``; the batches held when asking are ``queue_depth``), run the step
(``step_ms``), record the row. The first step waits until the queue is full or
``model_start_delay_s`` has passed (warm-up, reported as ``warmup_s``).

Stop: the step budget is reached, the planned epochs are complete (every sample of
each trained, or rejected while the run went on), or SIGTERM/SIGINT arrives (checked
between steps and while waiting). Then: the coordinator sends STOP to every producer
and closes, the run files are flushed and summary.json is written.
Checkpoints (consumer/checkpoint.py): every ``trainer.checkpoint_every_steps``, at the
end and after a stop signal, model, optimizer, step and input position go to
``DIR/ckpt/``; with ``--resume`` the run goes on from the latest one.
Exit status: 0 finished, 130 interrupted, 1 failed, 2 a user error (bad dataset,
endpoint in use, unknown model).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import math
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from consumer import melimage, validation
from consumer.buffer import BatchQueue
from consumer.checkpoint import RESUME_CONFIG, RunCheckpoints
from consumer.coordinator import Coordinator
from consumer.models import ModelError, Trainer, make_trainer, uses_tensorflow
from consumer.plan import EpochPlanner, InputPosition, ReferenceTable, TokenTable
from consumer.progress import LiveLine
from consumer.tb import TensorBoard
from consumer.telemetry import Telemetry
from shared import config as config_mod
from shared.batch import FRAMES
from shared.dataset import DatasetIndex, Sample, build_index, feature_cache_dir, mel_stats_file
from shared.errors import UserError
from shared.layouts import Rejection
from shared.gpumon import GpuSampler
from shared.keys import load_server_keys
from shared.melstats import MelStats, load, stats_key
from shared.metrics import JsonlWriter, read_jsonl, summarize
from shared.runfiles import CONFIG, MEL_STATS, METRICS, REJECTED, SAMPLES, SUMMARY, VOCAB, write_json
from shared.text import Vocabulary, load_vocabulary, save_vocabulary
from shared.proc import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USER, StatusWriter, die_with_parent,
                         flush_sockets, install_stop_handlers, parent_alive, setup_logging)

log = logging.getLogger("consumer")

# While waiting for a batch, wake this often to check the stop flag and the parent.
WAIT_SLICE_S = 0.25
# Say so when no batch has come for this long (no producer connected, all stalled).
NO_DATA_WARN_S = 10.0
# A user transform that failed every one of this many clips (or of all clips, when fewer) and
# let none through is broken, not unlucky: the run ends with one line instead of waiting.
ALL_FAILED_CLIPS = 32
# The start of a rejection reason naming the user transform (or declared field) that failed it.
TRANSFORM_FAILURE = re.compile(r"transform (field \S+|[\w.]+:\w+)")
# After training, give the coordinator this long to send STOP and close.
COORDINATOR_JOIN_S = 3.0
# At exit, give the STOP messages this long to reach the producers.
FLUSH_S = 1.0


class MelStatsMissing(UserError):
    """transforms.mel_norm=dataset without the dataset's statistics; one line for the user."""


class TransformFailed(UserError):
    """Every clip failed the same user transform; the message is one line for the user."""


class NonFiniteLoss(Exception):
    """Too many steps in a row had a NaN or inf loss; the message is one line for the user."""


class Run:
    def __init__(self, cfg: config_mod.Config, run_dir: Path, stop: threading.Event,
                 status: StatusWriter, parent_pid: int | None, gpu_memory_mb: int | None,
                 resume: bool = False) -> None:
        self.cfg = cfg
        self.resume = resume
        self.run_dir = run_dir
        self.stop = stop
        self.status = status
        self.parent_pid = parent_pid
        self.gpu_memory_mb = gpu_memory_mb
        self.rejected_count = 0
        self.started = time.monotonic()
        self._producer_rejected: set[str] = set()
        self._rejected_before: set[tuple[str, str]] = set()  # rows a resumed run's rejected.jsonl holds
        self._producer_reasons: collections.Counter[str] = collections.Counter()  # "transform X" or ""

    def _record_rejections(self, rejections: list[Rejection]) -> None:
        """Write each rejected clip once: a clip a producer cannot read fails again every epoch."""
        for r in rejections:
            if (r.id, r.reason) in self._rejected_before:
                continue
            if r.producer != "index":
                if r.id in self._producer_rejected:
                    continue
                self._producer_rejected.add(r.id)
                failed = TRANSFORM_FAILURE.match(r.reason)  # which transform (or declared field) failed
                self._producer_reasons[failed.group(0) if failed else ""] += 1
            self.rejected.write(r.to_json())
            self.rejected_count += 1

    def _index(self) -> tuple[DatasetIndex, Vocabulary, str]:
        """The dataset's index, its vocabulary (saved in the run) and the feature cache directory."""
        cfg = self.cfg
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
        if feature_cache != cfg.data.feature_cache:
            self.cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, feature_cache=feature_cache))
        if feature_cache:
            log.info("feature cache %s", feature_cache)
        return index, vocab, feature_cache

    def execute(self) -> int:
        index, vocab, feature_cache = self._index()
        cfg = self.cfg
        metadata_sha256 = index.scan.metadata_sha256
        # Held-out clips only when the trainer has a loss to validate (not synthetic:MS).
        train_samples, val_samples, eval_rejected = (validation.hold_out(index, cfg, self.run_dir)
                                                     if uses_tensorflow(cfg.trainer.model) else (index.samples, [], []))
        planner = EpochPlanner(train_samples, cfg.batching)
        log.info("dataset %s: %d clips usable, %d rejected; %d batches per epoch in %d shapes (B, L, T) %s%s",
                 index.root, len(index.samples), len(index.rejected), planner.batches_per_epoch,
                 len(planner.shapes), planner.shapes,
                 f" (frame budget {cfg.batching.max_frames})" if cfg.batching.max_frames else "")
        log.info("dataset fingerprint %s (metadata %s, audio index %s; %d audio files missing here)",
                 index.scan.fingerprint, index.scan.metadata_fp, index.scan.audio_fp, len(index.scan.missing))
        checkpoints = RunCheckpoints(self.run_dir, cfg, planner, index.scan.fingerprint, vocab)
        if self.resume:
            self._resume(checkpoints)  # CheckpointError before anything in the run directory changes
        mel_key = stats_key(cfg.features, cfg.transforms, index.scan.fingerprint)
        mel_norm = self._mel_norm(index, mel_key)
        self.rejected = JsonlWriter(self.run_dir / REJECTED)
        self._record_rejections(index.rejected + eval_rejected)
        keys = load_server_keys(Path(cfg.pipeline.keys)) if cfg.pipeline.keys else None
        queue = BatchQueue(cfg.pipeline.buffer_size)
        coordinator = Coordinator(cfg, planner, queue, self.stop, max_epochs=cfg.trainer.epochs,
                                  on_rejected=self._record_rejections, metadata_sha256=metadata_sha256,
                                  dataset=index.scan, keys=keys, resume=checkpoints.skip_plan(),
                                  tokens=TokenTable(train_samples, vocab),
                                  references=(ReferenceTable(train_samples, cfg.batching.seed)
                                              if "ref_mel" in config_mod.batch_schema(cfg).names else None),
                                  mel_norm=mel_norm)
        queue.on_free = coordinator.notify_free
        endpoint = coordinator.bind(cfg.pipeline.bind)
        coordinator.start()
        log.info("consumer listening on %s", endpoint)
        # Producers start now, while this process imports TensorFlow and builds the model.
        self.status.send("ready", endpoint=endpoint, batches_per_epoch=planner.batches_per_epoch)
        loop = TrainLoop(cfg, self.run_dir, queue, coordinator, planner, self.stop, self.parent_pid, self.started,
                         checkpoints, val_samples=val_samples, data_root=index.root, vocabulary=vocab,
                         mel_norm=load(mel_norm, cfg.features.n_mels) if mel_norm else None)
        at_least = min(ALL_FAILED_CLIPS, planner.samples_per_epoch)
        loop.check_failure = lambda: self._all_failed_one_transform(loop.step, at_least)
        try:
            loop.run(self.gpu_memory_mb)
            loop.save_checkpoint()  # at the end, and after Ctrl-C or SIGTERM (not after a failure)
            if coordinator.failure is not None:
                raise coordinator.failure
            if loop.interrupted:
                loop.exit_reason, loop.code = "interrupted", EXIT_INTERRUPTED
            failed = self._all_failed_one_transform(loop.step)
            if failed:
                raise TransformFailed(failed)
        except (ModelError, TransformFailed) as exc:  # the model or a transform: the user's to fix
            loop.exit_reason, loop.code = f"failed: {exc}"[:500], EXIT_USER
            log.log(logging.DEBUG if self.status.connected else logging.ERROR, "%s", exc)
            self.status.error(exc, "consumer", user_error=True)
        except NonFiniteLoss as exc:
            loop.exit_reason, loop.code = f"failed: {exc}"[:500], EXIT_FAILED
            loop.save_checkpoint()  # non-finite steps were skipped: the model holds its last good state
            log.error("%s", exc)
            self.status.error(exc, "consumer")
        except BaseException as exc:
            loop.exit_reason, loop.code = f"failed: {type(exc).__name__}: {exc}"[:500], EXIT_FAILED
            log.exception("training failed")
            self.status.error(exc, "consumer")
        finally:
            self.stop.set()
            coordinator.join(COORDINATOR_JOIN_S)
            coordinator.close_notifier()
            queue.close()
            loop.close()
            self.rejected.close()
            write_json(self.run_dir / SUMMARY, self._summary(loop, coordinator, queue, planner, index, vocab,
                                                             len(val_samples), feature_cache, checkpoints))
            if loop.epochs_completed and not mel_norm and coordinator.mel_stats.frames:
                self._keep_mel_stats(coordinator.mel_stats, mel_key, index)
            log.info("run over (%s): %d steps, summary in %s", loop.exit_reason, loop.step,
                     self.run_dir / SUMMARY)
        return loop.code

    def _summary(self, loop: "TrainLoop", coordinator: Coordinator, queue: BatchQueue, planner: EpochPlanner,
                 index: DatasetIndex, vocab: Vocabulary, val_clips: int, feature_cache: str,
                 checkpoints: RunCheckpoints) -> dict[str, Any]:
        """summary.json: the run's figures from metrics.jsonl and the coordinator, with the dataset,
        text, trainer and checkpoint figures beside them."""
        cfg = self.cfg
        snap = coordinator.snapshot()
        return summarize(
            read_jsonl(self.run_dir / METRICS), capacity=cfg.pipeline.buffer_size,
            batches_per_epoch=planner.batches_per_epoch, producers=snap["producers"],
            rejected=self.rejected_count, exit_reason=loop.exit_reason,
            wall_s=time.monotonic() - self.started, warmup_s=loop.warmup_s, batch_size=cfg.batching.batch_size,
            extra={"epochs_completed": loop.epochs_completed, "model": cfg.trainer.model,
                   "rejected_messages": snap["rejected_messages"], "reissued_leases": snap["reissued_leases"],
                   "queue_high_water": queue.high_water, "stage_errors": queue.stage_errors,
                   "host_cores": os.cpu_count(), "clips": len(index.samples), "val_clips": val_clips,
                   "text": {"frontend": vocab.frontend, "vocab_size": vocab.size, "vocabulary": vocab.fingerprint,
                            "languages": list(vocab.languages), "speakers": len(vocab.speakers), "lost": index.lost},
                   "index": index.stats.to_json(), **loop.model_summary(),
                   "feature_cache": feature_cache_totals(feature_cache, snap["producers"]),
                   "missed_samples": snap["missed_samples"], "refused_producers": snap["refused_producers"],
                   "failovers": snap["failovers"], "dataset_fingerprint": index.scan.fingerprint,
                   "checkpoint": checkpoints.summary(),
                   "resumed_from_step": checkpoints.resumed.step if checkpoints.resumed is not None else None})

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

    def _keep_mel_stats(self, stats: MelStats, key: str, index: Any) -> None:
        """After a whole epoch: the mel statistics measured, in the run and beside the dataset's
        index cache, where transforms.mel_norm=dataset finds them."""
        data = stats.to_json(key)
        write_json(self.run_dir / MEL_STATS, data)
        path = mel_stats_file(index.root, self.cfg.data, key)
        if path is None:
            return
        try:
            write_json(path, data)
        except OSError as exc:
            log.warning("mel statistics not kept beside the dataset (%s: %s); they are in %s", path,
                        exc.strerror or exc, self.run_dir / MEL_STATS)
            return
        log.info("mel statistics over %d frames kept in %s", stats.frames, path)

    def _all_failed_one_transform(self, steps: int, at_least: int = 1) -> str:
        """The one line when no clip trained and every clip a producer rejected (at least
        ``at_least``) failed the same user transform ("" otherwise)."""
        if steps or len(self._producer_reasons) != 1:
            return ""
        (family, count), = self._producer_reasons.items()
        if not family or count < at_least:
            return ""
        return (f"every clip failed {family} ({count} rejected, reasons in rejected.jsonl): fix the transform or "
                f"take it out of transforms.user")

    def _resume(self, checkpoints: RunCheckpoints) -> None:
        """Continue from the latest checkpoint: check it, cut the step logs back to it, adopt
        the config the launcher resolved for the resumed run, keep rejected.jsonl's rows."""
        resumed = checkpoints.resume()
        self.started -= resumed.last_t  # "t" in metrics.jsonl goes on from the last row kept
        pending = self.run_dir / RESUME_CONFIG
        if pending.exists():
            pending.replace(self.run_dir / CONFIG)
        # The summary of the session before is rewritten at the end; until then it would be stale.
        (self.run_dir / SUMMARY).unlink(missing_ok=True)
        self._rejected_before = {(str(r.get("id")), str(r.get("reason"))) for r in
                                 read_jsonl(self.run_dir / REJECTED)}
        self._producer_rejected = {i for i, _ in self._rejected_before}
        self.rejected_count = len(self._rejected_before)


def feature_cache_totals(directory: str, producers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """summary.json's ``feature_cache``: what the producers' caches did, summed (None: off)."""
    if not directory:
        return None
    totals: dict[str, Any] = {"dir": directory}
    for key in ("hits", "computed", "stale", "corrupt"):
        totals[key] = sum(int(p.get(f"cache_{key}", 0) or 0) for p in producers)
    return totals


class TrainLoop:
    """Warm-up, then: wait for a batch, step, record; until the budget or a stop.

    The step never waits for the device: its loss stays a tensor until the end of the
    logging interval (``trainer.log_every_steps``), when the interval's losses are
    fetched at once, its metrics.jsonl rows written, the progress line logged and the
    non-finite count checked. Validation runs every ``trainer.val_every_steps``.
    """

    def __init__(self, cfg: config_mod.Config, run_dir: Path, queue: BatchQueue, coordinator: Coordinator,
                 planner: EpochPlanner, stop: threading.Event, parent_pid: int | None, started: float,
                 checkpoints: RunCheckpoints | None = None, val_samples: list[Sample] | None = None,
                 data_root: Path | None = None, vocabulary: Vocabulary | None = None,
                 mel_norm: tuple[Any, Any] | None = None) -> None:
        self.cfg = cfg
        self.vocabulary = vocabulary  # None only for stand-in trainers in tests
        self.mel_norm = mel_norm  # (mean, std) of transforms.mel_norm, for the validation batches
        self.queue = queue
        self.coordinator = coordinator
        self.planner = planner
        self.stop = stop
        self.parent_pid = parent_pid
        self.started = started  # "t" in metrics.jsonl counts from the consumer's start
        self.run_dir = run_dir
        self.val_samples = val_samples or []
        self.data_root = data_root
        self.tb: TensorBoard | None = None
        self.trainer: Trainer | None = None
        self.metrics = JsonlWriter(run_dir / METRICS)
        self.samples_log = JsonlWriter(run_dir / SAMPLES) if cfg.trainer.record_samples else None
        self.epochs = cfg.trainer.epochs
        # With --epochs the run ends when those epochs are complete; re-planned misses can add
        # a batch or two, so the step count is only the plan's expectation (for progress lines).
        self.total_steps = None if self.epochs else cfg.trainer.steps
        self.expected_steps = self.epochs * planner.batches_per_epoch if self.epochs else cfg.trainer.steps
        self.step = 0
        self.epochs_completed = 0
        self.warmup_s = 0.0
        self.interrupted = False
        self.exit_reason, self.code = "completed", EXIT_OK
        self._epoch_done: dict[int, int] = {}
        self.telemetry = Telemetry(run_dir, queue.capacity, self.expected_steps,
                                   lambda: coordinator.snapshot()["producers"], cfg.run.metrics_port)
        self.live = LiveLine()
        # Why the data can never come (set by the run; "" while it may): checked while waiting.
        self.check_failure: Callable[[], str] = lambda: ""
        self._pending: list[tuple[dict[str, Any], Any]] = []  # rows whose loss is still on the device
        self._last_loss: float | None = None
        self._val_batches: list[Any] = []
        self._val_arrays: list[dict[str, Any]] = []
        self.val_losses: list[tuple[int, float]] = []
        self.skipped_steps = 0
        self.checkpoints = checkpoints
        # Which planned batches were trained: the checkpoints' own position (a resumed run goes
        # on from its checkpoint's step and epochs), or a fresh one when nothing is checkpointed.
        self.position = checkpoints.position if checkpoints is not None else InputPosition(planner)
        if checkpoints is not None and checkpoints.resumed is not None:
            self.step = checkpoints.resumed.step
        self.epochs_completed = len(self.position.complete)

    def _update_epochs(self) -> None:
        """Mark epochs whose every sample was trained or rejected while the run went on."""
        self.epochs_completed = self.position.update_complete(self.epochs, self.coordinator.rejected_in_epoch)

    def finished(self) -> bool:
        if self.total_steps is not None:
            return self.step >= self.total_steps
        return self.epochs_completed >= (self.epochs or 0)

    def save_checkpoint(self) -> None:
        """Checkpoint model, optimizer, step and input position now; the step logs are
        flushed first, so they hold every step the checkpoint counts."""
        if self.checkpoints is None:
            return
        if self.trainer is not None:
            self._flush(self.trainer)  # the rows whose loss is still on the device, first
        self.metrics.flush()
        if self.samples_log is not None:
            self.samples_log.flush()
        self.checkpoints.save(self.step)

    def close(self) -> None:
        self.live.close()
        if self.tb is not None:
            self.tb.close()
        self.metrics.close()
        if self.samples_log is not None:
            self.samples_log.close()

    def model_summary(self) -> dict[str, Any]:
        """summary.json fields of the trainer: parameters, precision, traces, validation."""
        if self.trainer is None or not self.trainer.uses_tensorflow:
            return {}
        return {"trainer": self.trainer.stats(), "skipped_steps": self.skipped_steps,
                "val_loss_first": self.val_losses[0][1] if self.val_losses else None,
                "val_loss_last": self.val_losses[-1][1] if self.val_losses else None,
                "val_losses": [{"step": s, "loss": v} for s, v in self.val_losses]}

    def _next_batch(self) -> tuple[Any, int] | None:
        """The next batch and the depth seen on asking; None when stopped while waiting, or
        when the last epoch completed meanwhile (its last samples were rejected)."""
        asked = last_warn = time.monotonic()
        while not self.stop.is_set():
            got = self.queue.get(WAIT_SLICE_S)
            if got is not None:
                return got
            if self.epochs:
                self._update_epochs()
                if self.finished():
                    return None
            last_warn = self._waiting(asked, last_warn, "no batch for")
        return None

    def _waiting(self, since: float, last_warn: float, what: str) -> float:
        """One slice of waiting for a batch: live figures, the launcher's liveness, a data
        failure that no waiting cures, and a warning every NO_DATA_WARN_S; returns when the
        last warning was given."""
        failure = self.check_failure()
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

    def _make_trainer(self, gpu_memory_mb: int | None) -> Trainer:
        cfg = self.cfg
        device = "/CPU:0"
        if uses_tensorflow(cfg.trainer.model):
            from shared.tfsetup import configure_tensorflow

            _, device = configure_tensorflow(gpu_memory_mb)
        budget = self.expected_steps if self.expected_steps else None
        trainer = make_trainer(cfg, device, self.planner.shapes, budget,
                               self.vocabulary.size if self.vocabulary is not None else 0)
        if self.checkpoints is not None:
            self.checkpoints.attach(trainer)  # restores the model and optimizer of a resumed run
        if trainer.uses_tensorflow:
            self.queue.enable_staging(trainer.stage)
            resumed = self.checkpoints.resumed if self.checkpoints is not None else None
            self.tb = TensorBoard(self.run_dir, resumed.step if resumed is not None else None)
            if self.val_samples and self.data_root is not None:
                assert self.vocabulary is not None
                self._val_arrays = validation.make_batches(self.val_samples, self.data_root, cfg, self.vocabulary,
                                                           self.mel_norm)
                self._val_batches = [trainer.stage(b) for b in self._val_arrays]
                log.info("validation: %s, every %d steps", validation.describe(self._val_arrays),
                         cfg.trainer.val_every_steps)
            trainer.prepare(self.planner.shapes)  # type: ignore[attr-defined]
        log.info("trainer %s on %s", trainer.name, device if trainer.uses_tensorflow else "host (no TensorFlow)")
        return trainer

    def run(self, gpu_memory_mb: int | None) -> None:
        trainer = self.trainer = self._make_trainer(gpu_memory_mb)
        if self.finished():
            log.info("nothing left to train at step %d (pass --steps or --epochs to go on)", self.step)
            return
        try:
            self._warm_up()
            self._train(trainer)
        except BaseException:
            self._flush(trainer, check=False)
            raise
        self._flush(trainer)
        if trainer.uses_tensorflow and self.step and not self.interrupted:
            self._validate(trainer)

    def _warm_up(self) -> None:
        """The first batch, then a full queue or model_start_delay_s more, so that producers
        still starting (importing TensorFlow, tracing) can fill the queue."""
        warm_start = last_warn = time.monotonic()
        while not self.stop.is_set() and self.queue.wait_for_depth(1, WAIT_SLICE_S, self.stop) < 1:
            last_warn = self._waiting(warm_start, last_warn, "no batch yet after")
        self.queue.wait_for_depth(self.queue.capacity, self.cfg.pipeline.model_start_delay_s, self.stop)
        self.warmup_s = time.monotonic() - warm_start

    def _train(self, trainer: Trainer) -> None:
        cfg = self.cfg
        t0 = self.started
        while not self.finished():
            asked = time.monotonic()
            got = self._next_batch()
            if got is None:
                if not self.finished():
                    self.interrupted = True
                return
            item, depth = got
            begun = time.monotonic()
            handle = trainer.step(item.arrays)
            ended = time.monotonic()
            self.step += 1
            row = {"step": self.step, "epoch": item.epoch, "t": round(ended - t0, 4), "queue_depth": depth,
                   "wait_ms": round((begun - asked) * 1e3, 3), "step_ms": round((ended - begun) * 1e3, 3),
                   "loss": None, "samples": len(item.ids), "producer": item.producer, "frames": item.frames,
                   "frames_computed": item.frames_computed}
            self._pending.append((row, handle))
            self.telemetry.on_step(row)
            if self.samples_log is not None:
                self.samples_log.write({"step": self.step, "epoch": item.epoch, "ids": item.ids})
            self.position.record(item.epoch, item.ids)
            self._update_epochs()
            if self.live.due():
                self.live.update(self._live_text())
            if self.checkpoints is not None and self.checkpoints.due(self.step):
                self.save_checkpoint()  # every trainer.checkpoint_every_steps
            if self.step % cfg.trainer.log_every_steps == 0 or self.finished():
                self._flush(trainer)
            if trainer.uses_tensorflow and self.step % cfg.trainer.val_every_steps == 0 and not self.finished():
                self._validate(trainer)
            if self.stop.is_set() and not self.finished():
                self.interrupted = True
                return

    def _flush(self, trainer: Trainer, check: bool = True) -> None:
        """End of a logging interval: fetch its losses (the one device sync), write its rows,
        log progress, and (``check``) stop if the loss has been non-finite too long."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            losses = trainer.resolve([handle for _, handle in pending])
        except Exception as exc:  # already failing (check=False): keep the rows, without losses
            if check:
                raise
            log.warning("losses of the last %d steps unavailable: %s", len(pending), exc)
            losses = [None] * len(pending)
        terms = getattr(trainer, "resolved_terms", None) or [None] * len(pending)
        rows = []
        for (row, _), loss, named in zip(pending, losses, terms):
            row["loss"] = loss if loss is None or math.isfinite(loss) else None
            if named:  # each term of the loss (a mean), as the trainer computed it: metrics.jsonl "terms"
                row["terms"] = {k: round(v, 6) if math.isfinite(v) else None for k, v in named.items()}
            self.metrics.write(row)
            rows.append(row)
        finite = [loss for loss in losses if loss is not None and math.isfinite(loss)]
        mean_loss = sum(finite) / len(finite) if finite else None
        if mean_loss is not None:
            self._last_loss = finite[-1]
        health = trainer.health()
        if health.bad_total > self.skipped_steps:
            log.warning("skipped %d step(s) with a NaN or inf loss (%d in all, %d in a row)",
                        health.bad_total - self.skipped_steps, health.bad_total, health.bad_in_row)
        self.skipped_steps = health.bad_total
        self._progress(mean_loss, rows, trainer)
        limit = self.cfg.trainer.max_bad_steps
        if check and health.bad_in_row >= limit:
            raise NonFiniteLoss(
                f"the loss was NaN or inf for {health.bad_in_row} steps in a row (trainer.max_bad_steps={limit}); "
                f"those steps were skipped, so the model holds its last good state; training stopped "
                f"(try a lower trainer.learning_rate, or check the data)")

    def _live_text(self) -> str:
        window = self.telemetry.window(time.monotonic())
        total = f"/{self.expected_steps}" if self.expected_steps else ""
        loss = f"  loss {self._last_loss:.4f}" if self._last_loss is not None else ""
        wait = window["wait_frac"]
        return (f"step {self.step}{total}{loss}  {window['samples_per_s'] or 0:.1f} samples/s  "
                f"queue {window['queue_depth_mean'] or 0:.1f}/{self.queue.capacity}  "
                f"wait {100 * (wait or 0):.1f}%")

    def _progress(self, loss: float | None, recent: list[dict[str, Any]], trainer: Trainer) -> None:
        wait = sum(r["wait_ms"] for r in recent)
        busy = wait + sum(r["step_ms"] for r in recent)
        samples = sum(r["samples"] for r in recent)
        depth = sum(r["queue_depth"] for r in recent) / len(recent)
        loss_text = f"loss {loss:.4f}  " if loss is not None else ""
        alive = self.coordinator.alive()
        log.info("step %d%s  %s%.1f samples/s  queue %.1f/%d  wait %.1f%%  producers %d",
                 self.step, f"/{self.expected_steps}" if self.expected_steps else "", loss_text,
                 samples / (busy / 1000) if busy else 0.0, depth, self.cfg.pipeline.buffer_size,
                 100 * wait / busy if busy else 0.0, alive)
        if self.tb is not None:
            train = {"skipped_steps": float(self.skipped_steps)}
            for name in {k for r in recent for k in r.get("terms") or {}}:  # each term's mean over the interval
                values = [r["terms"][name] for r in recent if (r.get("terms") or {}).get(name) is not None]
                if values:
                    train[f"loss/{name}"] = sum(values) / len(values)
            learning_rate = getattr(trainer, "learning_rate", None)
            if learning_rate is not None:
                train["learning_rate"] = learning_rate()
            self.tb.write(self.step, self.telemetry.window(time.monotonic()), loss, alive, train)

    def _validate(self, trainer: Trainer) -> None:
        """The loss on the held-out clips, and the first clip's mel image, into the log and tb/."""
        if not self._val_batches or self.tb is None:
            return
        if self.val_losses and self.val_losses[-1][0] == self.step:
            return
        loss = trainer.evaluate(self._val_batches)  # type: ignore[attr-defined]
        if loss is None:
            return
        self.val_losses.append((self.step, loss))
        log.info("step %d  validation loss %.4f", self.step, loss)
        first = self._val_arrays[0]
        frames = int(first[FRAMES][0])
        predicted = trainer.predict({k: v[:1] for k, v in first.items()})["mel"][0]  # type: ignore[attr-defined]
        image = melimage.comparison(predicted[:frames], first["mel"][0, :frames])
        self.tb.validation(self.step, loss, image, getattr(trainer, "evaluated_terms", None))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m consumer.main")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--gpu-memory-mb", type=int, default=None)
    parser.add_argument("--status-fd", type=int, default=None)
    parser.add_argument("--nvml-gpus", default="", help="ROLE=INDEX,... GPUs whose utilisation to record")
    parser.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    args = parser.parse_args(argv)
    status = StatusWriter(args.status_fd)
    stop = threading.Event()
    install_stop_handlers(stop)
    config_path = args.run_dir / CONFIG
    if args.resume and (args.run_dir / RESUME_CONFIG).exists():
        config_path = args.run_dir / RESUME_CONFIG  # becomes config.yaml once the checkpoint is checked
    try:
        cfg = config_mod.load(config_path)
    except config_mod.ConfigError as exc:
        status.error(exc, "consumer", user_error=True)
        return EXIT_USER
    setup_logging("consumer", cfg.run.log_level)
    try:
        die_with_parent(args.parent_pid)
        gpus = {role: int(index) for role, _, index in
                (item.partition("=") for item in args.nvml_gpus.split(",") if item)}
        sampler = GpuSampler(gpus, args.run_dir)
        sampler.start()
        try:
            code = Run(cfg, args.run_dir, stop, status, args.parent_pid, args.gpu_memory_mb, args.resume).execute()
        finally:
            sampler.stop()
        flush_sockets(FLUSH_S)
        return code
    except UserError as exc:  # the dataset, the model, the endpoint, the keys, a checkpoint: the user's to fix
        # The launcher prints a user error as its one line; log it only when run alone.
        log.log(logging.DEBUG if status.connected else logging.ERROR, "%s", exc)
        status.error(exc, "consumer", user_error=True)
        return EXIT_USER


if __name__ == "__main__":
    sys.exit(main())
