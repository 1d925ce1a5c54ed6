"""The diagnosis is right: controlled scenarios built from real runs, not mocked numbers.

Producers are made slow with injected faults (a delay or a periodic stall that uses no
CPU), so the scenarios hold on a 2-core machine whatever else it runs.
"""

from __future__ import annotations

import json

import pytest

from stoker.diagnose import analyse, autocorrelation, find_period, render, sparkline, starvation_episodes
from tests.factories import make_dataset
from tests.procs import read_json, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FAST = ["--set", "features.backend=numpy", "--batch-size", "4", "--model-start-delay", "0.5",
        "--log-level", "WARNING"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("diag") / "data"
    make_dataset(root, count=24)
    return root


def run(data, run_dir, *args: str) -> dict:
    result = run_cli("--data", str(data), "--run-dir", str(run_dir), *FAST, *args, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_json(run_dir / "summary.json")


def test_too_few_producers_is_producer_bound_and_the_cure_works(data, tmp_path):
    # The trainer wants 20 batches/s; a producer makes ~6/s, mostly the injected delay.
    slow = ["--model", "synthetic:50", "--set", "faults.producer_delay_ms=150"]
    first = run(data, tmp_path / "one", *slow, "--steps", "30", "--producers", "1")
    assert first["verdict"] == "producer-bound"
    assert first["data_wait_frac"] > 0.3
    report = analyse(tmp_path / "one")
    assert report["verdict"] == "producer-bound"
    recommended = report["recommended_producers"]
    assert recommended == first["recommended_producers"] >= 2
    assert f"--producers {recommended}" in report["cure"]
    cured = run(data, tmp_path / "cured", *slow, "--steps", "100", "--producers", str(recommended))
    assert cured["data_wait_frac"] <= 0.05, (recommended, cured["data_wait_frac"])


def test_slow_trainer_is_consumer_bound_and_asks_for_no_more(data, tmp_path):
    summary = run(data, tmp_path / "slow", "--model", "synthetic:75", "--steps", "40", "--producers", "2")
    assert summary["verdict"] == "consumer-bound"
    assert summary["recommended_producers"] <= 2
    report = analyse(tmp_path / "slow")
    assert all(p["blocked_frac"] > 0.5 for p in report["producers"])
    assert "trainer is the limit" in report["cure"]


def test_periodic_stall_period_is_found_within_ten_percent(data, tmp_path):
    period_s = 1.0  # ten periods in the run's 250 steps of 40 ms and its waits
    # A stall of 0.4 s outlasts the 3 queued batches (120 ms) by far more than a step's jitter on
    # a loaded host: each period's wait stands out.
    run(data, tmp_path / "stall", "--model", "synthetic:40", "--steps", "250", "--producers", "1",
        "--set", f"faults.producer_stall_every_s={period_s}", "--set", "faults.producer_stall_s=0.4")
    report = analyse(tmp_path / "stall")
    assert report["period"] is not None, render(report)
    assert abs(report["period"]["period_s"] - period_s) / period_s <= 0.10, report["period"]
    assert report["starvation"]["episodes"] >= 4


def test_diagnose_command_text_and_json(data, tmp_path):
    run(data, tmp_path / "r", "--model", "synthetic:5", "--steps", "20", "--producers", "1")
    text = run_cli("diagnose", str(tmp_path / "r"))
    assert text.returncode == 0
    for heading in ("step time", "data wait", "queue depth", "starvation", "periodicity", "producers",
                    "rejected", "padding", "verdict", "advice"):
        assert heading in text.stdout
    as_json = json.loads(run_cli("diagnose", str(tmp_path / "r"), "--json").stdout)
    assert as_json["steps"] == 20 and as_json["verdict"] in ("producer-bound", "consumer-bound", "balanced")
    missing = run_cli("diagnose", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and missing.stderr.startswith("stoker: error:")


def test_find_period_on_a_known_signal():
    # 20 ms steps; every 1.25 s the trainer waits 300 ms; steps in between vary in length.
    rows, t = [], 0.0
    next_stall = 1.25
    for i in range(600):
        step_ms = 20.0 + 10.0 * (i % 3)
        wait_ms = 300.0 if t >= next_stall else 1.0
        if wait_ms > 1.0:
            next_stall += 1.25
        t += (step_ms + wait_ms) / 1000
        rows.append({"t": t, "wait_ms": wait_ms, "step_ms": step_ms})
    found = find_period(rows)
    assert found["period_s"] == pytest.approx(1.25, rel=0.05)
    flat = [{"t": 0.03 * (i + 1), "wait_ms": 1.0, "step_ms": 29.0} for i in range(600)]
    assert find_period(flat) is None


def test_autocorrelation_is_one_at_zero_and_sparkline_and_episodes():
    acf = autocorrelation([0, 1, 0, 1, 0, 1, 0, 1])
    assert acf[0] == pytest.approx(1.0) and acf[2] > 0.7 and acf[1] < -0.8
    assert sparkline([0, 0, 3, 3], top=3, width=4) == "  ██"
    episodes = starvation_episodes([0, 0, 1, 0, 2], [5, 6, 0, 7, 0])
    assert [(e["start_step"], e["steps"], e["wait_ms"]) for e in episodes] == [(1, 2, 11.0), (4, 1, 7.0)]


def test_with_replicas_the_demand_is_replica_batches_and_the_cure_keeps_them(tmp_path):
    """A step of 2 replicas takes 2 replica batches, which a producer makes as one planned batch."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": i + 1, "epoch": 0, "t": 0.15 * (i + 1), "queue_depth": 0, "wait_ms": 50.0, "step_ms": 100.0,
             "loss": None} for i in range(40)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    producers = [{"id": f"p{i}@h", "host": "h", "batches": 20, "samples": 300, "rejected": 0, "status": "stopped",
                  "prep_ms_mean": 400.0, "credit_wait_ms_mean": 0.0} for i in range(2)]
    (run_dir / "summary.json").write_text(json.dumps({"replicas": 2, "producers": producers, "capacity": 3,
                                                      "exit_reason": "completed"}))
    (run_dir / "config.yaml").write_text("devices:\n  replicas: 2\n  model_gpu: null\ntrainer:\n  model: tiny\n")
    report = analyse(run_dir)
    assert report["verdict"] == "producer-bound" and report["replicas"] == 2
    assert report["evidence"]["trainer_demand_batches_per_s"] == pytest.approx(20.0)  # 2 x 10 steps/s
    assert report["evidence"]["producer_rate_batches_per_s"] == pytest.approx(5.0)  # 2 per 400 ms
    assert report["recommended_producers"] == 5  # ceil(1.2 x 20 / 5)
    assert report["cure"].endswith("--replicas 2 --producers 5")
    text = render(report)
    assert "replicas      2" in text and "(2 replicas x steps/s)" in text
