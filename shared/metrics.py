"""Per-step metrics, the run summary and the starvation verdict.

:func:`summarize` turns metrics.jsonl's rows (a contract: README.md) and the producers'
statistics into summary.json's figures, as a pure function of them, so the launcher and
``diagnose`` can recompute a summary. The fields, the figures and the verdict's rules:
docs/design/starvation.md.
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

import psutil

from .runfiles import file_error

# Waiting more than 5% of the time for data means the GPU visibly starves.
WAIT_BOUND_FRAC = 0.05
# A queue whose mean depth is within this many batches of capacity is "full".
FULL_QUEUE_SLACK = 1.0
# Producers needed are rounded up after this safety factor for jitter and stalls.
PRODUCER_MARGIN = 1.2
# metrics.jsonl is flushed at least this often, so a crash loses at most this much.
FLUSH_INTERVAL_S = 1.0
# A host whose cores were busy this share of their time or more has none to spare for another
# producer (stoker/autoscale.py adds none beyond it either).
HOST_BUSY_FRAC = 0.9
# The verdict's other value of summary.json's "limit": the host's CPU, not the producer count.
HOST_CPU_LIMIT = "host-cpu"
# psutil.cpu_times fields that Linux counts inside "user" and "nice" already.
_GUEST_TIMES = ("guest", "guest_nice")


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
    """Producers needed for the trainer's demand, with margin (docs/design/starvation.md)."""
    rates = [p for p in prep_ms_means if p]
    if not step_ms_mean or not rates:
        return max(current, 1) + (1 if kind == "producer-bound" else 0)
    needed = max(1, math.ceil(PRODUCER_MARGIN * (sum(rates) / len(rates)) / step_ms_mean))
    if kind == "producer-bound":
        return max(needed, current + 1)
    if kind == "consumer-bound":
        return max(1, min(needed, current)) if current else needed
    return needed


class HostCpu:
    """The host's CPU over a run's steady window (from the end of warm-up to the summary): the
    share of its cores' time that was busy (psutil.cpu_times: every process on the host, the
    trainer, the producers and anything else) and this process's own CPU seconds (the trainer's)."""

    def __init__(self) -> None:
        self._start: tuple[float, Any, os.times_result] | None = None

    def start(self) -> None:
        self._start = (time.monotonic(), psutil.cpu_times(), os.times())

    def figures(self, producers: Sequence[dict[str, Any]], host: str) -> dict[str, Any] | None:
        """summary.json's ``host_cpu`` (None before :meth:`start`): ``cores``, ``window_s``,
        ``busy_frac``, ``trainer_cpu_s`` and, of the producers that delivered from ``host`` (this
        one), their count and the seconds they spent preparing batches (their prep_ms)."""
        if self._start is None:
            return None
        began, host_before, own_before = self._start
        host_now, own_now = psutil.cpu_times(), os.times()
        spent = {name: getattr(host_now, name) - getattr(host_before, name) for name in host_now._fields
                 if name not in _GUEST_TIMES}
        total = sum(spent.values())
        idle = spent.get("idle", 0.0) + spent.get("iowait", 0.0)
        local = [p for p in producers if p.get("host") == host and p.get("batches")]
        return {"cores": os.cpu_count(), "window_s": round(time.monotonic() - began, 3),
                "busy_frac": round(1 - idle / total, 4) if total > 0 else None,
                "trainer_cpu_s": round(own_now.user + own_now.system - own_before.user - own_before.system, 3),
                "local_producers": len(local),
                "local_prep_s": round(sum(p["batches"] * (p.get("prep_ms_mean") or 0.0) for p in local) / 1000, 3)}


def host_cpu_limited(kind: str, host_cpu: dict[str, Any] | None) -> bool:
    """Whether the host's CPU, not the producer count, limited a producer- or consumer-bound run:
    its cores were busy (HOST_BUSY_FRAC of their time or more, over the steady window) while
    producers ran on it beside the trainer, so more producers there would only share the same
    cores, and the trainer's own step competes with them for them."""
    if kind == "balanced" or not host_cpu:
        return False
    busy = host_cpu.get("busy_frac")
    return busy is not None and busy >= HOST_BUSY_FRAC and bool(host_cpu.get("local_producers"))


def wait_share(rows: Sequence[dict[str, Any]]) -> float | None:
    """The share of the trainer's time these step rows spent waiting for a batch:
    wait / (wait + step); None when they took no time."""
    wait = sum(r["wait_ms"] for r in rows)
    busy = wait + sum(r["step_ms"] for r in rows)
    return wait / busy if busy > 0 else None


def summarize(rows: Sequence[dict[str, Any]], *, capacity: int, batches_per_epoch: int,
              producers: list[dict[str, Any]], rejected: int, exit_reason: str,
              wall_s: float, warmup_s: float = 0.0, batch_size: int = 0,
              host_cpu: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """summary.json from metrics rows (its fields are a contract: README.md, "What a run writes").
    ``host_cpu``: HostCpu.figures of the run; where it says the host's CPU was the limit
    (host_cpu_limited), ``limit`` is "host-cpu" and no more producers are recommended."""
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
    host_limited = host_cpu_limited(kind, host_cpu)
    recommended = recommend_producers(kind, _mean(step_ms), [p.get("prep_ms_mean") for p in producers], alive)
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
        "limit": HOST_CPU_LIMIT if host_limited else kind,
        "host_cpu": host_cpu,
        "recommended_producers": min(recommended, max(alive, 1)) if host_limited else recommended,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "capacity": capacity,
        "batch_size": batch_size,
        "exit_reason": exit_reason,
    }
    if extra:
        summary.update(extra)
    return summary

