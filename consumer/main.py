"""The consumer process: dataset index, coordinator, bounded queue, trainer loop, run files.

Started by the launcher as ``python -m consumer.main --run-dir DIR`` with
``CUDA_VISIBLE_DEVICES`` already naming the model GPU (or none). It reads the resolved
``DIR/config.yaml``, indexes the dataset, binds the ROUTER socket and tells the launcher
the endpoint on its status pipe (``{"event": "ready", "endpoint": ...}``), then trains.

Training loop, per step: ask the queue for the next batch (the time until it comes is
``wait_ms``; the batches held when asking are ``queue_depth``), run the step
(``step_ms``), record the row. The first step waits until the queue is full or
``model_start_delay_s`` has passed (warm-up, reported as ``warmup_s``).

Stop: the step budget is reached, the planned epochs are trained, or SIGTERM/SIGINT
arrives (checked between steps and while waiting). Then: the coordinator sends STOP to
every producer and closes, the run files are flushed and summary.json is written.
Exit status: 0 finished, 130 interrupted, 1 failed, 2 a user error (bad dataset,
endpoint in use, unknown model).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

from consumer.buffer import BatchQueue
from consumer.coordinator import BindError, Coordinator
from consumer.models import ModelError, make_trainer, uses_tensorflow
from consumer.plan import EpochPlanner
from shared import config as config_mod
from shared.dataset import DatasetError, Rejection, build_index
from shared.metrics import JsonlWriter, summarize, write_json
from shared.proc import StatusWriter, die_with_parent, install_stop_handlers, parent_alive, setup_logging

log = logging.getLogger("consumer")

# While waiting for a batch, wake this often to check the stop flag and the parent.
WAIT_SLICE_S = 0.25
# Say so when no batch has come for this long (no producer connected, all stalled).
NO_DATA_WARN_S = 10.0
# After training, give the coordinator this long to send STOP and close.
COORDINATOR_JOIN_S = 3.0

EXIT_OK, EXIT_FAILED, EXIT_USER, EXIT_INTERRUPTED = 0, 1, 2, 130


class Run:
    def __init__(self, cfg: config_mod.Config, run_dir: Path, stop: threading.Event,
                 status: StatusWriter, parent_pid: int | None, gpu_memory_mb: int | None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.stop = stop
        self.status = status
        self.parent_pid = parent_pid
        self.gpu_memory_mb = gpu_memory_mb
        self.rejected_count = 0
        self.rows_written = 0
        self.started = time.monotonic()

    def _record_rejections(self, rejections: list[Rejection]) -> None:
        for r in rejections:
            self.rejected.write(r.to_json())
        self.rejected_count += len(rejections)

    def _progress(self, step: int, total: int | None, loss: float | None, recent: list[dict[str, Any]],
                  alive: int) -> None:
        wait = sum(r["wait_ms"] for r in recent)
        busy = wait + sum(r["step_ms"] for r in recent)
        samples = sum(r["samples"] for r in recent)
        depth = sum(r["queue_depth"] for r in recent) / len(recent)
        loss_text = f"loss {loss:.4f}  " if loss is not None else ""
        log.info("step %d%s  %s%.1f samples/s  queue %.1f/%d  wait %.1f%%  producers %d",
                 step, f"/{total}" if total else "", loss_text,
                 samples / (busy / 1000) if busy else 0.0, depth, self.cfg.pipeline.buffer_size,
                 100 * wait / busy if busy else 0.0, alive)

    def execute(self) -> int:
        cfg = self.cfg
        self.rejected = JsonlWriter(self.run_dir / "rejected.jsonl")
        metrics = JsonlWriter(self.run_dir / "metrics.jsonl")
        samples_log = JsonlWriter(self.run_dir / "samples.jsonl") if cfg.trainer.record_samples else None
        index = build_index(cfg.data, cfg.features)
        self._record_rejections(index.rejected)
        planner = EpochPlanner(index.samples, cfg.batching)
        log.info("dataset %s: %d clips usable, %d rejected; %d batches of %d per epoch in %d shapes %s",
                 index.root, len(index.samples), len(index.rejected), planner.batches_per_epoch,
                 cfg.batching.batch_size, len(planner.shapes), planner.shapes)
        device = "/CPU:0"
        if uses_tensorflow(cfg.trainer.model):
            from shared.devices import configure_tensorflow

            _, device = configure_tensorflow(self.gpu_memory_mb)
        trainer = make_trainer(cfg, device)
        log.info("trainer %s on %s", trainer.name, device if trainer.uses_tensorflow else "host (no TensorFlow)")

        coordinator: Coordinator | None = None
        queue = BatchQueue(cfg.pipeline.buffer_size, stage=trainer.stage if trainer.uses_tensorflow else None)
        max_epochs = cfg.trainer.epochs
        total_steps = max_epochs * planner.batches_per_epoch if max_epochs else cfg.trainer.steps
        coordinator = Coordinator(cfg, planner, queue, self.stop, max_epochs=max_epochs,
                                  on_rejected=self._record_rejections)
        queue._on_free = coordinator.notify_free
        endpoint = coordinator.bind(cfg.pipeline.bind)
        coordinator.start()
        log.info("consumer listening on %s", endpoint)
        self.status.send("ready", endpoint=endpoint, batches_per_epoch=planner.batches_per_epoch)

        exit_reason, code = "completed", EXIT_OK
        epoch_done: dict[int, int] = {}
        epochs_completed = 0
        recent: list[dict[str, Any]] = []
        warmup_s = 0.0
        t0 = time.monotonic()
        step = 0
        try:
            warm_start = time.monotonic()
            queue.wait_for_depth(queue.capacity, cfg.pipeline.model_start_delay_s, self.stop)
            warmup_s = time.monotonic() - warm_start
            t0 = time.monotonic()
            while total_steps is None or step < total_steps:
                if self.stop.is_set():
                    break
                asked = time.monotonic()
                got = None
                last_warn = asked
                while got is None and not self.stop.is_set():
                    got = queue.get(WAIT_SLICE_S)
                    now = time.monotonic()
                    if got is None:
                        if not parent_alive(self.parent_pid):
                            log.error("launcher is gone; stopping")
                            self.stop.set()
                        elif now - last_warn >= NO_DATA_WARN_S:
                            log.warning("no batch for %.0f s (%d producers alive)", now - asked, coordinator.alive())
                            last_warn = now
                if got is None:
                    break
                item, depth = got
                begun = time.monotonic()
                loss = trainer.step(item.arrays)
                ended = time.monotonic()
                step += 1
                row = {"step": step, "epoch": item.epoch, "t": round(ended - t0, 4), "queue_depth": depth,
                       "wait_ms": round((begun - asked) * 1e3, 3), "step_ms": round((ended - begun) * 1e3, 3),
                       "loss": loss, "samples": len(item.ids), "producer": item.producer}
                metrics.write(row)
                if samples_log is not None:
                    samples_log.write({"step": step, "epoch": item.epoch, "ids": item.ids})
                epoch_done[item.epoch] = epoch_done.get(item.epoch, 0) + 1
                if epoch_done[item.epoch] == planner.batches_per_epoch:
                    epochs_completed += 1
                recent.append(row)
                if step % cfg.trainer.log_every_steps == 0 or step == total_steps:
                    self._progress(step, total_steps, loss, recent, coordinator.alive())
                    recent = []
            if coordinator.failure is not None:
                raise coordinator.failure
            if self.stop.is_set() and (total_steps is None or step < total_steps):
                exit_reason, code = "interrupted", EXIT_INTERRUPTED
        except BaseException as exc:
            exit_reason, code = f"failed: {type(exc).__name__}: {exc}"[:500], EXIT_FAILED
            log.exception("training failed")
            self.status.error(exc, "consumer")
        finally:
            self.stop.set()
            coordinator.join(COORDINATOR_JOIN_S)
            coordinator.close_notifier()
            queue.close()
            metrics.close()
            if samples_log is not None:
                samples_log.close()
            self.rejected.close()
            from shared.metrics import read_jsonl

            rows = read_jsonl(self.run_dir / "metrics.jsonl")
            snap = coordinator.snapshot()
            summary = summarize(
                rows, capacity=cfg.pipeline.buffer_size, batches_per_epoch=planner.batches_per_epoch,
                producers=snap["producers"], rejected=self.rejected_count, exit_reason=exit_reason,
                wall_s=time.monotonic() - self.started, warmup_s=warmup_s, batch_size=cfg.batching.batch_size,
                extra={"epochs_completed": epochs_completed, "model": trainer.name,
                       "rejected_messages": snap["rejected_messages"],
                       "reissued_leases": snap["reissued_leases"], "queue_high_water": queue.high_water})
            write_json(self.run_dir / "summary.json", summary)
            log.info("run over (%s): %d steps, summary in %s", exit_reason, step, self.run_dir / "summary.json")
        return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m consumer.main")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--gpu-memory-mb", type=int, default=None)
    parser.add_argument("--status-fd", type=int, default=None)
    args = parser.parse_args(argv)
    status = StatusWriter(args.status_fd)
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        cfg = config_mod.load(args.run_dir / "config.yaml")
    except config_mod.ConfigError as exc:
        status.error(exc, "consumer", user_error=True)
        return EXIT_USER
    setup_logging("consumer", cfg.run.log_level)
    try:
        die_with_parent(args.parent_pid)
        return Run(cfg, args.run_dir, stop, status, args.parent_pid, args.gpu_memory_mb).execute()
    except (DatasetError, ModelError, BindError) as exc:
        status.error(exc, "consumer", user_error=True)
        log.error("%s", exc)
        return EXIT_USER


if __name__ == "__main__":
    sys.exit(main())
