"""live.json, the watch view, and the Prometheus endpoint."""

from __future__ import annotations

import io
import json
import threading
import urllib.request

import pytest

from stoker.consumer.feed.telemetry import Telemetry
from stoker.watch import format_live, watch
from tests.procs import free_port

pytestmark = pytest.mark.timeout(30)


def row(step: int, wait_ms: float = 10.0, step_ms: float = 90.0, depth: int = 2) -> dict:
    return {"step": step, "epoch": 0, "t": step * 0.1, "queue_depth": depth, "wait_ms": wait_ms,
            "step_ms": step_ms, "loss": 1.5, "samples": 16, "producer": "p0"}


def producers() -> list[dict]:
    return [{"id": "p0", "status": "alive", "batches": 3}, {"id": "p1", "status": "dead", "batches": 1}]


def test_live_json_window_figures(tmp_path):
    telemetry = Telemetry(tmp_path, capacity=3, total_steps=100, producers=producers)
    for i in range(1, 6):
        telemetry.on_step(row(i))
    live = json.loads((tmp_path / "live.json").read_text())
    assert live["step"] == 1  # written on the first step, then at most once per interval
    assert live["producers_alive"] == 1 and live["capacity"] == 3
    telemetry._last_write = 0.0
    telemetry.tick()
    live = json.loads((tmp_path / "live.json").read_text())
    assert live["step"] == 5
    w = live["window"]
    assert w["steps"] == 5 and w["wait_frac"] == pytest.approx(0.1) and w["queue_depth_mean"] == 2
    assert w["samples_per_s"] == pytest.approx(5 * 16 / 0.5)
    assert "step 5/100" in format_live(live) and "wait 10.0%" in format_live(live)


def test_prometheus_endpoint_serves_the_figures(tmp_path):
    port = free_port()
    telemetry = Telemetry(tmp_path, capacity=3, total_steps=None, producers=producers, metrics_port=port)
    for i in range(1, 4):
        telemetry.on_step(row(i, depth=1))
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "stoker_steps_total 3.0" in body
    assert "stoker_queue_depth 1.0" in body
    assert "stoker_queue_capacity 3.0" in body
    assert "stoker_producers_alive 1.0" in body


def test_watch_ends_with_the_summary(tmp_path):
    telemetry = Telemetry(tmp_path, capacity=3, total_steps=10, producers=producers)
    telemetry.on_step(row(1))
    lines: list[str] = []
    stop = threading.Event()
    assert watch(tmp_path, stream=io.StringIO(), stop=stop, emit=lines.append, max_refreshes=1) is None
    assert lines and "step 1/10" in lines[0]
    (tmp_path / "summary.json").write_text(json.dumps({"verdict": "balanced", "exit_reason": "completed"}))
    assert watch(tmp_path, stream=io.StringIO(), stop=stop)["verdict"] == "balanced"
