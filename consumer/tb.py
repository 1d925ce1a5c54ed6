"""TensorBoard event files under ``RUN_DIR/tb/`` (runs whose trainer uses TensorFlow).

Written with ``tf.summary`` at every progress interval (``trainer.log_every_steps``), so
the trainer never syncs for it more often than that: training loss (mean of the
interval), learning rate, non-finite steps skipped, data wait share, step time, queue
depth, samples/s, producers alive, and the GPU utilisation the NVML sampler recorded
since the last write. At each validation (``trainer.val_every_steps``): the validation
loss and an image of a held-out clip's target mel (top) and prediction (bottom). A synthetic trainer does not import TensorFlow, and
writes no TensorBoard files (its figures are all in metrics.jsonl and live.json).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TB_DIR = "tb"


class TensorBoard:
    def __init__(self, run_dir: Path) -> None:
        import tensorflow as tf

        self.tf = tf
        self.writer = tf.summary.create_file_writer(str(run_dir / TB_DIR))
        self.gpu_path = run_dir / "gpu.jsonl"
        self._gpu_offset = 0

    def _gpu_since_last(self) -> dict[str, list[int]]:
        """Utilisation rows appended to gpu.jsonl since the last call, by role."""
        try:
            with open(self.gpu_path, encoding="utf-8") as f:
                f.seek(self._gpu_offset)
                chunk = f.read()
        except FileNotFoundError:
            return {}
        complete, _, _ = chunk.rpartition("\n")
        self._gpu_offset += len(complete.encode()) + (1 if complete else 0)
        by_role: dict[str, list[int]] = {}
        for line in complete.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            by_role.setdefault(row.get("role", "?"), []).append(row.get("util", 0))
        return by_role

    def write(self, step: int, window: dict[str, Any], loss: float | None, alive: int,
              train: dict[str, float] | None = None) -> None:
        """One progress interval; ``train``: more train/ scalars (learning rate, skipped steps)."""
        tf = self.tf
        with self.writer.as_default(step=step):
            if loss is not None:
                tf.summary.scalar("train/loss", loss)
            for name, value in (train or {}).items():
                tf.summary.scalar(f"train/{name}", value)
            for key, tag in (("wait_frac", "pipeline/data_wait_frac"), ("step_ms_mean", "pipeline/step_ms"),
                             ("queue_depth_mean", "pipeline/queue_depth"), ("samples_per_s", "pipeline/samples_per_s")):
                if window.get(key) is not None:
                    tf.summary.scalar(tag, window[key])
            tf.summary.scalar("pipeline/producers_alive", alive)
            for role, utils in self._gpu_since_last().items():
                tf.summary.scalar(f"gpu/{role}_util", sum(utils) / len(utils))
        self.writer.flush()

    def validation(self, step: int, loss: float | None, image: Any = None) -> None:
        """The validation loss, and an ``[H, W, 3]`` uint8 image (target above prediction)."""
        tf = self.tf
        with self.writer.as_default(step=step):
            if loss is not None:
                tf.summary.scalar("val/loss", loss)
            if image is not None:
                tf.summary.image("val/mel_target_vs_predicted", image[None], max_outputs=1)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
