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

from ...shared.runfiles import GPU, TB_DIR, replacing

log = logging.getLogger(__name__)



def trim_events(directory: Path, max_step: int) -> int:
    """Drop the events of steps after ``max_step`` from every event file in ``directory``.

    A resumed run trains again from its checkpoint's step; the events its crashed
    predecessor wrote past that step would otherwise sit in TensorBoard beside the new
    ones, as a second curve over the same steps. (TensorBoard's own orphan purge needs a
    SessionLog START event, which ``tf.summary`` writers never write, and the fast
    loader ignores it.) Each file is rewritten only if it loses events: a temporary file,
    then a rename. A torn last record (the crash came mid-write) goes too. Returns the
    number of events dropped.
    """
    import tensorflow as tf

    dropped = 0
    for path in sorted(directory.glob("events.out.tfevents.*")):
        kept: list[bytes] = []
        later = 0
        torn = False
        try:
            for record in tf.data.TFRecordDataset(str(path)).as_numpy_iterator():
                if tf.compat.v1.Event.FromString(record).step <= max_step:
                    kept.append(record)
                else:
                    later += 1
        except tf.errors.DataLossError:  # a truncated or corrupt tail: keep what came before it
            torn = True
        dropped += later
        if not later and not torn:
            continue
        with replacing(path) as tmp, tf.io.TFRecordWriter(str(tmp)) as writer:
            for record in kept:
                writer.write(record)
        log.info("%s: kept %d events up to step %d, dropped %d%s", path.name, len(kept), max_step, later,
                 " (a torn last record dropped)" if torn else "")
    return dropped


class TensorBoard:
    def __init__(self, run_dir: Path, resumed_step: int | None = None) -> None:
        """``resumed_step``: the checkpoint's step of a resumed run; later events are dropped."""
        import tensorflow as tf

        self.tf = tf
        if resumed_step is not None and (run_dir / TB_DIR).is_dir():
            trim_events(run_dir / TB_DIR, resumed_step)
        self.writer = tf.summary.create_file_writer(str(run_dir / TB_DIR))
        self.gpu_path = run_dir / GPU
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

    def validation(self, step: int, loss: float | None, image: Any = None,
                   terms: dict[str, float] | None = None) -> None:
        """The validation loss and its terms (``val/loss/NAME``), and an ``[H, W, 3]`` uint8
        image (target above prediction)."""
        tf = self.tf
        with self.writer.as_default(step=step):
            if loss is not None:
                tf.summary.scalar("val/loss", loss)
            for name, value in (terms or {}).items():
                tf.summary.scalar(f"val/loss/{name}", value)
            if image is not None:
                tf.summary.image("val/mel_target_vs_predicted", image[None], max_outputs=1)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
