"""Live figures of a running trainer: ``live.json`` and Prometheus metrics.

``live.json`` in the run directory is rewritten (atomically) every LIVE_INTERVAL_S with
the last LIVE_WINDOW_S of steps: queue depth, wait share, samples/s, producers alive
and each producer's figures. ``python run.py watch RUN_DIR`` shows it, and the launcher's
``--producers auto`` controller decides from it.

With ``run.metrics_port`` set (``--metrics-port N``), the same figures are served for
Prometheus (prometheus-client) on that port.
"""

from __future__ import annotations

import collections
import logging
import time
from pathlib import Path
from typing import Any, Callable

from ...shared.runfiles import LIVE, write_json

log = logging.getLogger(__name__)

# live.json is rewritten this often: often enough for a person watching, and for the
# auto-scaler whose decisions span several seconds.
LIVE_INTERVAL_S = 1.0
# Figures in live.json cover this many seconds of steps.
LIVE_WINDOW_S = 5.0


class Telemetry:
    def __init__(self, run_dir: Path, capacity: int, total_steps: int | None,
                 producers: Callable[[], list[dict[str, Any]]], metrics_port: int = 0) -> None:
        self.path = run_dir / LIVE
        self.capacity = capacity
        self.total_steps = total_steps
        self.producers = producers
        self._rows: collections.deque[tuple[float, dict[str, Any]]] = collections.deque()
        self._last_write = 0.0
        self._last_row: dict[str, Any] | None = None
        self.started = time.monotonic()
        self._prom: dict[str, Any] | None = None
        if metrics_port:
            self._prom = _start_prometheus(metrics_port, capacity)

    def window(self, now: float) -> dict[str, Any]:
        while self._rows and now - self._rows[0][0] > LIVE_WINDOW_S:
            self._rows.popleft()
        rows = [r for _, r in self._rows]
        wait = sum(r["wait_ms"] for r in rows)
        busy = wait + sum(r["step_ms"] for r in rows)
        return {
            "steps": len(rows),
            "wait_frac": round(wait / busy, 4) if busy else None,
            "samples_per_s": round(sum(r["samples"] for r in rows) / (busy / 1000), 2) if busy else None,
            "steps_per_s": round(len(rows) / (busy / 1000), 3) if busy else None,
            "queue_depth_mean": round(sum(r["queue_depth"] for r in rows) / len(rows), 3) if rows else None,
            "step_ms_mean": round(sum(r["step_ms"] for r in rows) / len(rows), 3) if rows else None,
        }

    def on_step(self, row: dict[str, Any]) -> None:
        now = time.monotonic()
        self._rows.append((now, row))
        if self._prom is not None:
            p = self._prom
            p["steps"].inc()
            p["samples"].inc(row["samples"])
            p["wait"].inc(row["wait_ms"] / 1000)
            p["step_time"].observe(row["step_ms"] / 1000)
            p["depth"].set(row["queue_depth"])
            if row.get("loss") is not None:
                p["loss"].set(row["loss"])
        self.tick(now, row)

    def tick(self, now: float | None = None, row: dict[str, Any] | None = None) -> None:
        """Rewrite live.json if it is due (called at each step and while waiting)."""
        now = time.monotonic() if now is None else now
        if row is not None:
            self._last_row = row
        row = self._last_row
        if now - self._last_write < LIVE_INTERVAL_S:
            return
        self._last_write = now
        producers = self.producers()
        window = self.window(now)
        alive = sum(1 for p in producers if p.get("status") == "alive")
        live = {"t": round(now - self.started, 3), "wall_time": time.time(), "capacity": self.capacity,
                "total_steps": self.total_steps, "step": row["step"] if row else None,
                "queue_depth": row["queue_depth"] if row else None, "window_s": LIVE_WINDOW_S,
                "window": window, "producers_alive": alive, "producers": producers}
        if self._prom is not None:
            self._prom["alive"].set(alive)
            if window["wait_frac"] is not None:
                self._prom["wait_frac"].set(window["wait_frac"])
                self._prom["rate"].set(window["samples_per_s"])
        write_json(self.path, live, indent=None)


def _start_prometheus(port: int, capacity: int) -> dict[str, Any] | None:
    try:
        import prometheus_client as prom  # only with --metrics-port; its absence is one warning
    except ImportError:
        log.warning("--metrics-port %d: prometheus-client is not installed; no metrics served", port)
        return None
    registry = prom.CollectorRegistry()
    metrics = {
        "steps": prom.Counter("stoker_steps", "Training steps taken", registry=registry),
        "samples": prom.Counter("stoker_samples", "Samples trained on", registry=registry),
        "wait": prom.Counter("stoker_data_wait_seconds", "Time the trainer waited for a batch", registry=registry),
        "step_time": prom.Histogram("stoker_step_seconds", "Time of one training step", registry=registry,
                                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)),
        "depth": prom.Gauge("stoker_queue_depth", "Batches ready when the trainer last asked", registry=registry),
        "capacity": prom.Gauge("stoker_queue_capacity", "Capacity of the batch queue", registry=registry),
        "wait_frac": prom.Gauge("stoker_data_wait_fraction", f"Share of time waiting, last {LIVE_WINDOW_S:g} s",
                                registry=registry),
        "rate": prom.Gauge("stoker_samples_per_second", f"Throughput over the last {LIVE_WINDOW_S:g} s",
                           registry=registry),
        "alive": prom.Gauge("stoker_producers_alive", "Producers connected and alive", registry=registry),
        "loss": prom.Gauge("stoker_loss", "Training loss of the last step", registry=registry),
    }
    metrics["capacity"].set(capacity)
    try:
        prom.start_http_server(port, registry=registry)
    except OSError as exc:
        log.warning("--metrics-port %d: cannot serve metrics (%s)", port, exc.strerror)
        return None
    log.info("Prometheus metrics on port %d", port)
    return metrics
