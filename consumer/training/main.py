"""The consumer process: the feed (consumer/feed/feed.py) and stoker's trainer on it.

Started by the launcher as ``python -m stoker.consumer.training.main --run-dir DIR`` with
``CUDA_VISIBLE_DEVICES`` already naming the model GPU (or none). It reads the resolved
``DIR/config.yaml``; the feed indexes the dataset, binds the ROUTER socket and this
process tells the launcher the endpoint on its status pipe (``{"event": "ready",
"endpoint": ...}``), then builds the model and trains on the feed's batches.

Per step (consumer/feed/feed.py says how wait, depth and step time are measured): the
trainer's step on the staged batch, the step's loss handle to the feed, and at the end
of each logging interval the losses fetched at once and checked for NaN or inf.

Stop: the feed ends (the step budget, the planned epochs complete) or SIGTERM/SIGINT
arrives (checked between steps and while waiting). Then the feed closes: STOP to every
producer, the run files flushed, summary.json written.
Checkpoints (consumer/feed/checkpoint.py): every ``trainer.checkpoint_every_steps``, at the
end and after a stop signal, model, optimizer, step and input position go to
``DIR/ckpt/``; with ``--resume`` the run goes on from the latest one.
Exit status: 0 finished, 130 interrupted, 1 failed, 2 a user error (bad dataset,
endpoint in use, unknown model).
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from . import melimage
from ..feed.feed import FeedCore, PreparedRun, Resolved, TransformFailed
from .trainer import ModelError, ModelTrainer, Trainer, make_trainer, uses_tensorflow
from .tb import TensorBoard
from ...shared import config as config_mod
from ...shared.batch import FRAMES
from ...shared.errors import UserError
from ...shared.gpumon import GpuSampler
from ...shared.runfiles import CONFIG, RESUME_CONFIG, RunFileError
from ...shared.tfsetup import configure_replicas
from ...shared.proc import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USER, StatusWriter, die_with_parent,
                         exit_without_teardown, flush_sockets, install_stop_handlers, setup_logging)

log = logging.getLogger("consumer")

# At exit, give the STOP messages this long to reach the producers.
FLUSH_S = 1.0
# What TensorFlow raises from a collective op when a peer worker is gone (tf.errors' names,
# matched by name so this module does not import TensorFlow).
PEER_GONE_ERRORS = ("UnavailableError", "DeadlineExceededError", "CancelledError", "AbortedError")


class WorkerGone(Exception):
    """Another trainer worker of a multi-host job is gone; the message is one line."""


class NonFiniteLoss(Exception):
    """Too many steps in a row had a NaN or inf loss; the message is one line for the user."""


class Run:
    """One training run in this process: the feed (consumer/feed/feed.py) and stoker's trainer on it."""

    def __init__(self, cfg: config_mod.Config, run_dir: Path, stop: threading.Event,
                 status: StatusWriter, parent_pid: int | None, gpu_memory_mb: int | None,
                 resume: bool = False, fresh_plan: bool = False) -> None:
        self.cfg, self.run_dir, self.stop = cfg, run_dir, stop
        self.status = status
        self.parent_pid = parent_pid
        self.gpu_memory_mb = gpu_memory_mb
        self.resume, self.fresh_plan = resume, fresh_plan

    def execute(self) -> int:
        prepared = PreparedRun(self.cfg, self.run_dir, resume=self.resume, fresh_plan=self.fresh_plan,
                               hold_out=uses_tensorflow(self.cfg.trainer.model))
        feed = FeedCore(prepared, self.stop, parent_pid=self.parent_pid)
        # Producers start now, while this process imports TensorFlow and builds the model.
        self.status.send("ready", endpoint=feed.endpoint, batches_per_epoch=feed.planner.batches_per_epoch)
        loop = TrainLoop(feed)
        try:
            loop.run(self.gpu_memory_mb)
            loop.save_checkpoint()  # at the end, and after Ctrl-C or SIGTERM (not after a failure)
            if feed.coordinator.failure is not None:
                raise feed.coordinator.failure
            if feed.interrupted:
                feed.exit_reason, feed.code = "interrupted", EXIT_INTERRUPTED
            failed = feed.all_failed_one_transform() or feed.nothing_trained()
            if failed:
                raise TransformFailed(failed)
        except RunFileError as exc:  # a full disk, a quota, permissions: reported once the run is closed
            feed.note_file_error(exc)
        except (ModelError, TransformFailed) as exc:  # the model or a transform: the user's to fix
            feed.exit_reason, feed.code = f"failed: {exc}"[:500], EXIT_USER
            log.log(logging.DEBUG if self.status.connected else logging.ERROR, "%s", exc)
            self.status.error(exc, "consumer", user_error=True)
        except NonFiniteLoss as exc:
            feed.exit_reason, feed.code = f"failed: {exc}"[:500], EXIT_FAILED
            loop.save_checkpoint()  # non-finite steps were skipped: the model holds its last good state
            log.error("%s", exc)
            self.status.error(exc, "consumer")
        except BaseException as exc:
            gone = self._peer_gone(feed, exc)
            if gone is not None:
                feed.exit_reason, feed.code = f"failed: {gone}", EXIT_FAILED
                log.error("%s", gone)
                self.status.error(gone, "consumer")
            else:
                feed.exit_reason, feed.code = f"failed: {type(exc).__name__}: {exc}"[:500], EXIT_FAILED
                log.exception("training failed")
                self.status.error(exc, "consumer")
        finally:
            feed.file_step(loop.close)
            feed.close(loop.model_summary(), loop.resolve)
        failure = feed.files.failure()  # one line: the file, its error, and summary.json if it is not written
        if failure is not None:
            log.log(logging.DEBUG if self.status.connected else logging.ERROR, "%s", failure)
            self.status.error(failure, "consumer", user_error=True)
        return feed.code

    @staticmethod
    def _peer_gone(feed: FeedCore, exc: BaseException) -> "WorkerGone | None":
        """Another trainer worker died or hung up, so the step's all-reduce failed: one line
        saying how the job goes on (None for any other failure)."""
        if feed.planner.workers == 1 or type(exc).__name__ not in PEER_GONE_ERRORS:
            return None
        return WorkerGone(f"a trainer worker of the job stopped answering ({type(exc).__name__} in the step's "
                          f"all-reduce); the job cannot go on: start every worker with --resume "
                          f"{feed.run_dir.parent}")


class TrainLoop:
    """stoker's trainer on the feed: per batch, step, then record; until the feed ends.

    The step never waits for the device: its loss stays a tensor until the end of the
    logging interval (``trainer.log_every_steps``), when the interval's losses are
    fetched at once (FeedCore.flush), the non-finite count checked and TensorBoard
    written. Validation runs every ``trainer.val_every_steps``; checkpoints every
    ``trainer.checkpoint_every_steps``.
    """

    def __init__(self, feed: FeedCore) -> None:
        self.feed = feed
        self.cfg = feed.cfg
        self.tb: TensorBoard | None = None
        self.trainer: Trainer | None = None
        self.val_losses: list[tuple[int, float]] = []
        self.skipped_steps = 0

    def save_checkpoint(self) -> None:
        """Checkpoint model, optimizer, step and input position now; the step logs are
        flushed first, so they hold every step the checkpoint counts."""
        if self.trainer is not None:
            self._flush(check=False)  # the rows whose loss is still on the device, first
        self.feed.flush_logs()
        self.feed.checkpoints.save(self.feed.step)

    def close(self) -> None:
        if self.trainer is not None:
            self._flush(check=False)
        if self.tb is not None:
            self.tb.close()

    def model_summary(self) -> dict[str, Any]:
        """summary.json fields of the trainer: parameters, precision, traces, validation."""
        if not isinstance(self.trainer, ModelTrainer):
            return {}
        return {"trainer": self.trainer.stats(), "skipped_steps": self.skipped_steps,
                "val_loss_first": self.val_losses[0][1] if self.val_losses else None,
                "val_loss_last": self.val_losses[-1][1] if self.val_losses else None,
                "val_losses": [{"step": s, "loss": v} for s, v in self.val_losses]}

    def _make_trainer(self, gpu_memory_mb: int | None) -> Trainer:
        cfg, feed = self.cfg, self.feed
        devices = ["/CPU:0"]
        if uses_tensorflow(cfg.trainer.model):
            _, devices = configure_replicas(gpu_memory_mb, cfg.devices.replicas or 1)
        budget = feed.expected_steps if feed.expected_steps else None
        trainer = make_trainer(cfg, devices, feed.planner.shapes, budget, feed.vocabulary.size,
                               multi_worker=feed.planner.workers > 1)
        feed.checkpoints.attach(trainer)  # restores the model and optimizer of a resumed run
        # The one staging path, as a stoker.Feed's: the batches held and those to come, staged
        # in the queue; validation batches stay on the host (split and staged in _validate).
        feed.use_staging(trainer.staging(), validation=False)
        if isinstance(trainer, ModelTrainer):
            resumed = feed.checkpoints.resumed
            self.tb = TensorBoard(feed.run_dir, resumed.step if resumed is not None else None)
            if feed.val_batches:
                log.info("validation: %d held-out clips in %d batches, made by the producers every %d steps",
                         len(feed.val_samples), len(feed.val_batches), cfg.trainer.val_every_steps)
            trainer.prepare(feed.planner.shapes)
        where = ", ".join(devices) if trainer.uses_tensorflow else "host (no TensorFlow)"
        log.info("trainer %s on %s", trainer.name, where)
        return trainer

    def resolve(self, handles: Sequence[Any]) -> Resolved:
        """The losses of an interval's steps, fetched by the trainer at once, with each step's
        loss terms where the trainer has a model (the feed's flush calls it)."""
        trainer = self.trainer
        assert trainer is not None  # the handles are its steps'
        losses = trainer.resolve(handles)
        return Resolved(losses, trainer.resolved_terms if isinstance(trainer, ModelTrainer) else None)

    def run(self, gpu_memory_mb: int | None) -> None:
        feed, cfg = self.feed, self.cfg
        trainer = self.trainer = self._make_trainer(gpu_memory_mb)
        for item in feed.batches():
            feed.step_done(trainer.step(feed.take(item)))
            if trainer.received:  # what the step received, as the trainer noted it (--record-samples)
                feed.record_trained(item.epoch, trainer.received.pop())
            if feed.checkpoints.due(feed.step):
                self.save_checkpoint()  # every trainer.checkpoint_every_steps
            if feed.flush_due():
                self._flush()
            if (isinstance(trainer, ModelTrainer) and feed.step % cfg.trainer.val_every_steps == 0
                    and not feed.finished()):
                self._validate(trainer)
        self._flush()
        if isinstance(trainer, ModelTrainer) and feed.step and not feed.interrupted:
            self._validate(trainer)

    def _flush(self, check: bool = True) -> None:
        """End of a logging interval: the feed fetches its losses (the one device sync) and
        writes its rows; then TensorBoard, and (``check``) a stop if the loss has been
        non-finite too long."""
        trainer = self.trainer
        assert trainer is not None
        rows = self.feed.flush(self.resolve, check=check)
        if not rows:
            return
        health = trainer.health()
        if health.bad_total > self.skipped_steps:
            log.warning("skipped %d step(s) with a NaN or inf loss (%d in all, %d in a row)",
                        health.bad_total - self.skipped_steps, health.bad_total, health.bad_in_row)
        self.skipped_steps = health.bad_total
        if self.tb is not None:
            self._tensorboard(rows, trainer)
        limit = self.cfg.trainer.max_bad_steps
        if check and health.bad_in_row >= limit:
            raise NonFiniteLoss(
                f"the loss was NaN or inf for {health.bad_in_row} steps in a row (trainer.max_bad_steps={limit}); "
                f"those steps were skipped, so the model holds its last good state; training stopped "
                f"(try a lower trainer.learning_rate, or check the data)")

    def _tensorboard(self, recent: list[dict[str, Any]], trainer: Trainer) -> None:
        assert self.tb is not None
        finite = [r["loss"] for r in recent if r["loss"] is not None]
        loss = sum(finite) / len(finite) if finite else None
        train = {"skipped_steps": float(self.skipped_steps)}
        for name in {k for r in recent for k in r.get("terms") or {}}:  # each term's mean over the interval
            values = [r["terms"][name] for r in recent if (r.get("terms") or {}).get(name) is not None]
            if values:
                train[f"loss/{name}"] = sum(values) / len(values)
        if isinstance(trainer, ModelTrainer):
            train["learning_rate"] = trainer.learning_rate()
        self.tb.write(self.feed.step, self.feed.telemetry.window(time.monotonic()), loss,
                      self.feed.coordinator.alive(), train)

    def _validate(self, trainer: ModelTrainer) -> None:
        """The loss on the held-out clips, made by the producers in a validation pass of the
        feed (consumer/feed/validation.py), and the first clip's mel image, into the log and tb/."""
        feed = self.feed
        if not feed.val_batches or self.tb is None:
            return
        step = feed.step
        if self.val_losses and self.val_losses[-1][0] == step:
            return
        items = sorted(feed.validation_pass(), key=lambda item: item.index)  # the plan's order: a fixed first clip
        if feed.stop.is_set():
            return  # the pass was cut short: no loss over part of the clips
        # Evaluated on the first device in the rows one replica trains (a planned batch has them all).
        parts = [part for item in items for part in _split_rows(item.arrays, feed.planner.replicas)
                 if part[FRAMES].any()]
        loss = trainer.evaluate([trainer.stage_one(p) for p in parts])
        if loss is None:
            return
        self.val_losses.append((step, loss))
        log.info("step %d  validation loss %.4f", step, loss)
        first = parts[0]
        frames = int(first[FRAMES][0])
        predicted = trainer.predict({k: v[:1] for k, v in first.items()})["mel"][0]
        image = melimage.comparison(predicted[:frames], first["mel"][0, :frames])
        self.tb.validation(step, loss, image, trainer.evaluated_terms)


def _split_rows(arrays: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """A batch of ``parts`` x B rows as ``parts`` batches of B rows."""
    rows = len(arrays[FRAMES]) // parts
    return [{k: v[i * rows:(i + 1) * rows] for k, v in arrays.items()} for i in range(parts)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.consumer.training.main")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--gpu-memory-mb", type=int, default=None)
    parser.add_argument("--status-fd", type=int, default=None)
    parser.add_argument("--nvml-gpus", default="", help="ROLE=INDEX,... GPUs whose utilisation to record")
    parser.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    parser.add_argument("--fresh-plan", action="store_true", help="with --resume: its model and step count, on a new "
                        "epoch plan of the dataset as it is now")
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
            code = Run(cfg, args.run_dir, stop, status, args.parent_pid, args.gpu_memory_mb, args.resume,
                       args.fresh_plan).execute()
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
    exit_without_teardown(main())
