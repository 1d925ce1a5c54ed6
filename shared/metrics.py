"""Per-step metrics, the run summary and the starvation verdict.

:func:`summarize` turns metrics.jsonl's rows (a contract: README.md) and the producers'
statistics into summary.json's figures, as a pure function of them, so the launcher and
``diagnose`` can recompute a summary. The fields, the figures and the verdict's rules:
docs/DESIGN.md, Seeing starvation.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from .runfiles import file_error

# Waiting more than 5% of the time for data means the GPU visibly starves.
WAIT_BOUND_FRAC = 0.05
# A queue whose mean depth is within this many batches of capacity is "full".
FULL_QUEUE_SLACK = 1.0
# Producers needed are rounded up after this safety factor for jitter and stalls.
PRODUCER_MARGIN = 1.2
# metrics.jsonl is flushed at least this often, so a crash loses at most this much.
FLUSH_INTERVAL_S = 1.0


class JsonlWriter:
    """Append JSON lines, thread-safe, flushed every FLUSH_INTERVAL_S and on close. A full
    disk, a quota or permissions: RunFileError naming the file (shared/runfiles.py); the
    rows not flushed then are lost, and a checkpoint counts only rows flushed before it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with self._errors():
            self._file = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            error = file_error(exc, self.path)
            if error is None:
                raise
            raise error from None

    def write(self, obj: dict[str, Any]) -> None:
        with self._lock, self._errors():
            self._file.write(json.dumps(obj, separators=(",", ":")) + "\n")
            now = time.monotonic()
            if now - self._last_flush >= FLUSH_INTERVAL_S:
                self._file.flush()
                self._last_flush = now

    def flush(self) -> None:
        """Everything written so far onto the disk (before a checkpoint that counts these rows)."""
        with self._lock, self._errors():
            if not self._file.closed:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._last_flush = time.monotonic()

    def close(self) -> None:
        """Flush and close (closed even when the flush fails)."""
        with self._lock, self._errors():
            if not self._file.closed:
                self._file.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a jsonl file; a torn last line (crash mid-write) is ignored."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return rows


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _spread(values: Sequence[int]) -> dict[str, float] | None:
    """min, median and max of ``values`` (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    return {"min": ordered[0], "median": float(statistics.median(ordered)), "max": ordered[-1]}


def verdict(data_wait_frac: float | None, queue_depth_mean: float | None, capacity: int) -> str:
    if data_wait_frac is None or queue_depth_mean is None:
        return "balanced"
    if data_wait_frac > WAIT_BOUND_FRAC:
        return "producer-bound"
    if queue_depth_mean >= capacity - FULL_QUEUE_SLACK:
        return "consumer-bound"
    return "balanced"


def recommend_producers(kind: str, step_ms_mean: float | None, prep_ms_means: Iterable[float | None],
                        current: int) -> int:
    """Producers needed for the trainer's demand, with margin (docs/DESIGN.md, Seeing starvation)."""
    rates = [p for p in prep_ms_means if p]
    if not step_ms_mean or not rates:
        return max(current, 1) + (1 if kind == "producer-bound" else 0)
    needed = max(1, math.ceil(PRODUCER_MARGIN * (sum(rates) / len(rates)) / step_ms_mean))
    if kind == "producer-bound":
        return max(needed, current + 1)
    if kind == "consumer-bound":
        return max(1, min(needed, current)) if current else needed
    return needed


def wait_share(rows: Sequence[dict[str, Any]]) -> float | None:
    """The share of the trainer's time these step rows spent waiting for a batch:
    wait / (wait + step); None when they took no time."""
    wait = sum(r["wait_ms"] for r in rows)
    busy = wait + sum(r["step_ms"] for r in rows)
    return wait / busy if busy > 0 else None


def summarize(rows: Sequence[dict[str, Any]], *, capacity: int, batches_per_epoch: int,
              producers: list[dict[str, Any]], rejected: int, exit_reason: str,
              wall_s: float, warmup_s: float = 0.0, batch_size: int = 0,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """summary.json from metrics rows (its fields are a contract: README.md, "What a run writes")."""
    steps = len(rows)
    wait = [r["wait_ms"] for r in rows]
    step_ms = [r["step_ms"] for r in rows]
    depth = [r["queue_depth"] for r in rows]
    samples = sum(int(r.get("samples", 0)) for r in rows)
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    computed = sum(int(r.get("frames_computed", 0)) for r in rows)
    train_ms = sum(wait) + sum(step_ms)
    # Warm-up lasts until the first batch is in hand: the first step's wait is start-up
    # (processes importing TensorFlow, first batches), reported as first_batch_wait_ms.
    steady_ms = sum(wait[1:]) + sum(step_ms)
    data_wait_frac = sum(wait[1:]) / steady_ms if steady_ms > 0 else None
    depth_mean = _mean(depth)
    kind = verdict(data_wait_frac, depth_mean, capacity)
    alive = sum(1 for p in producers if p.get("batches"))
    # Rates over the same time as data_wait_frac: from the start of the first step on.
    steady_s = steady_ms / 1000
    summary: dict[str, Any] = {
        "steps": steps,
        "epochs_completed": (steps // batches_per_epoch) if batches_per_epoch else 0,
        "samples": samples,
        "wall_s": round(wall_s, 3),
        "warmup_s": round(warmup_s, 3),
        "steps_per_s": round(steps / steady_s, 4) if steady_s > 0 else 0.0,
        "samples_per_s": round(samples / steady_s, 3) if steady_s > 0 else 0.0,
        "steps_per_s_incl_warmup": round(steps / (train_ms / 1000), 4) if train_ms > 0 else 0.0,
        "data_wait_frac": round(data_wait_frac, 5) if data_wait_frac is not None else None,
        "data_wait_frac_incl_warmup": round(sum(wait) / train_ms, 5) if train_ms > 0 else None,
        "first_batch_wait_ms": wait[0] if wait else None,
        "queue_depth_mean": round(depth_mean, 4) if depth_mean is not None else None,
        "starved_steps": sum(1 for d in depth if d == 0),
        "step_ms_mean": round(_mean(step_ms), 3) if step_ms else None,
        "wait_ms_mean": round(_mean(wait), 3) if wait else None,
        "rejected": rejected,
        # valid frames over the frames the steps computed (padding excluded from the numerator)
        "frames_useful_frac": round(sum(int(r.get("frames", 0)) for r in rows) / computed, 4) if computed else None,
        # the frames each step computed (rows x T): the spread a frame budget keeps narrow
        "frames_per_batch": _spread([int(r["frames_computed"]) for r in rows if r.get("frames_computed")]),
        "producers": producers,
        "verdict": kind,
        "recommended_producers": recommend_producers(
            kind, _mean(step_ms), [p.get("prep_ms_mean") for p in producers], alive),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "capacity": capacity,
        "batch_size": batch_size,
        "exit_reason": exit_reason,
    }
    if extra:
        summary.update(extra)
    return summary

