"""The diagnosis is right: what ``diagnose`` says about runs whose figures the test controls.

A scenario is the files a run writes (metrics.jsonl; summary.json as the run's own
summarize writes it; config.yaml), written here with the figures of a run with too few
producers, of a slow trainer and of a producer that stalls every second: the verdict, the
cure and the period follow from those figures alone, on any host. Whether a real run shows
those figures and whether the cure works on one are performance questions, measured by
benchmarks/starvation.py (its scenarios A to C); one real run here checks the command.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stoker.diagnose import analyse, autocorrelation, find_period, render, sparkline, starvation_episodes
from stoker.shared.metrics import summarize
from tests.factories import make_dataset
from tests.procs import read_json, run_cli

pytestmark = pytest.mark.timeout(240)

FAST = ["--set", "features.backend=numpy", "--batch-size", "4", "--model-start-delay", "0.5",
        "--log-level", "WARNING"]
CAPACITY = 3
CONFIG = "data:\n  path: corpus\ntrainer:\n  model: synthetic:50\nbatching:\n  batch_size: 4\n"
CURE = "python run.py --data corpus --model synthetic:50 --batch-size 4"
WARMUP_WAIT_MS = 500.0  # the first step's wait: start-up, left out of data_wait_frac


def rows_of(steps: list[tuple[float, float, int]]) -> list[dict[str, Any]]:
    """metrics.jsonl rows of (wait_ms, step_ms, queue_depth) steps, one after the other."""
    rows, t = [], 0.0
    for i, (wait_ms, step_ms, depth) in enumerate(steps):
        t += (wait_ms + step_ms) / 1000
        rows.append({"step": i + 1, "epoch": 0, "t": round(t, 6), "queue_depth": depth, "wait_ms": wait_ms,
                     "step_ms": step_ms, "loss": None, "samples": 4})
    return rows


def producer(index: int, batches: int, prep_ms: float, credit_wait_ms: float) -> dict[str, Any]:
    return {"id": f"p{index}@h", "host": "h", "batches": batches, "samples": 4 * batches, "rejected": 0,
            "status": "stopped", "prep_ms_mean": prep_ms, "credit_wait_ms_mean": credit_wait_ms}


def write_run(run_dir: Path, rows: list[dict[str, Any]], producers: list[dict[str, Any]],
              host_cpu: dict[str, Any] | None = None) -> dict[str, Any]:
    """A run's files with these figures; its summary.json, as the run computes it."""
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize(rows, capacity=CAPACITY, batches_per_epoch=16, producers=producers, rejected=0,
                        exit_reason="steps", wall_s=rows[-1]["t"], batch_size=4, host_cpu=host_cpu)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "config.yaml").write_text(CONFIG)
    return summary


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("diag") / "data"
    make_dataset(root, count=24)
    return root


def run(data, run_dir, *args: str) -> dict:
    result = run_cli("--data", str(data), "--run-dir", str(run_dir), *FAST, *args, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_json(run_dir / "summary.json")


def test_too_few_producers_is_producer_bound_and_the_cure_asks_for_no_more(tmp_path):
    # The trainer wants 20 batches/s (50 ms steps); its one producer makes 6 (165 ms a batch):
    # each step waits 115 ms for the next batch, on an empty queue.
    rows = rows_of([(WARMUP_WAIT_MS, 50.0, 0)] + [(115.0, 50.0, 0)] * 29)
    summary = write_run(tmp_path / "one", rows, [producer(0, 30, prep_ms=165.0, credit_wait_ms=0.0)])
    report = analyse(tmp_path / "one")
    assert report["verdict"] == summary["verdict"] == "producer-bound"
    assert report["data_wait_frac"] == pytest.approx(29 * 115 / (29 * 115 + 30 * 50))  # the steps after the first
    assert report["evidence"]["trainer_demand_batches_per_s"] == pytest.approx(20.0)
    assert report["evidence"]["producer_rate_batches_per_s"] == pytest.approx(1000 / 165, abs=1e-3)
    assert report["recommended_producers"] == summary["recommended_producers"] == 4  # ceil(1.2 x 165 / 50)
    assert report["cure"] == f"{CURE} --producers 4"
    # The cured run: 4 producers make 24 batches/s for the trainer's 20; it never waits, their
    # batches wait for room in the queue, and diagnose asks for nothing more.
    cured_rows = rows_of([(WARMUP_WAIT_MS, 50.0, 0)] + [(0.0, 50.0, 3 - i % 2) for i in range(99)])
    cured = write_run(tmp_path / "cured", cured_rows, [producer(i, 25, prep_ms=165.0, credit_wait_ms=35.0)
                                                       for i in range(4)])
    report = analyse(tmp_path / "cured")
    assert report["verdict"] == cured["verdict"] == "consumer-bound" and report["data_wait_frac"] == 0.0
    assert report["recommended_producers"] == cured["recommended_producers"] == 4
    assert report["cure"] == "no change needed for the input pipeline: the trainer is the limit"


def test_slow_trainer_is_consumer_bound_and_asks_for_no_more(tmp_path):
    # A trainer of 75 ms steps and two producers of 40 ms a batch: the queue stays full and
    # each prepared batch waits 110 ms for room (2 x 75 - 40).
    rows = rows_of([(WARMUP_WAIT_MS, 75.0, 0)] + [(0.0, 75.0, 3)] * 39)
    summary = write_run(tmp_path / "slow", rows, [producer(i, 20, prep_ms=40.0, credit_wait_ms=110.0)
                                                  for i in range(2)])
    report = analyse(tmp_path / "slow")
    assert report["verdict"] == summary["verdict"] == "consumer-bound"
    assert [p["blocked_frac"] for p in report["producers"]] == [round(110 / 150, 4)] * 2
    assert report["recommended_producers"] == summary["recommended_producers"] == 1  # ceil(1.2 x 40 / 75)
    assert report["cure"] == f"the trainer is the limit and fewer producers suffice: {CURE} --producers 1"


def test_periodic_stall_period_is_found_within_ten_percent(tmp_path):
    # Steps of 39 to 41 ms; a producer stalls 0.4 s every second: the 3 queued batches carry
    # the trainer through 3 steps (120 ms), then it waits 280 ms on an empty queue. One period
    # is 18 steps: 15 + 3 of 40 ms on average and the wait, 1.0 s in all.
    period = [(0.0, 3)] * 15 + [(0.0, 2), (0.0, 1), (280.0, 0)]
    steps = [(wait_ms, 40.0 + i % 3 - 1, depth) for i, (wait_ms, depth) in enumerate(period * 14)]
    write_run(tmp_path / "stall", rows_of([(WARMUP_WAIT_MS, 40.0, 3)] + steps), [producer(0, 253, 30.0, 10.0)])
    report = analyse(tmp_path / "stall")
    assert report["period"] is not None, render(report)
    assert report["period"]["period_s"] == pytest.approx(1.0, rel=0.10), report["period"]
    assert report["period"]["period_steps"] == pytest.approx(18, rel=0.10), report["period"]
    assert report["starvation"]["episodes"] == 14 and report["starvation"]["longest_steps"] == 1
    assert report["verdict"] == "producer-bound"  # 280 ms of each second: above the 5% it allows


@pytest.mark.slow
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


def host_cpu(busy_frac: float, window_s: float, trainer_cpu_s: float, producers: int, prep_s: float) -> dict[str, Any]:
    """summary.json's host_cpu as the run records it (shared/metrics.HostCpu) on a 2-core host."""
    return {"cores": 2, "window_s": window_s, "busy_frac": busy_frac, "trainer_cpu_s": trainer_cpu_s,
            "local_producers": producers, "local_prep_s": prep_s}


def test_a_consumer_bound_run_on_a_host_with_every_core_busy_says_the_host_cpu_is_the_limit(tmp_path):
    # Two producers and a CPU-heavy trainer on 2 cores: the queue stays full (the trainer's step is
    # slowed by the producers beside it), so the producer count's verdict is consumer-bound; the
    # host's cores were 98 % busy over the 4 s, the trainer using 1.1 of them, the producers 0.8.
    rows = rows_of([(WARMUP_WAIT_MS, 100.0, 0)] + [(0.0, 100.0, 3)] * 39)
    cpu = host_cpu(0.98, 4.0, 4.4, 2, 3.2)
    summary = write_run(tmp_path / "busy", rows, [producer(i, 20, prep_ms=80.0, credit_wait_ms=120.0)
                                                  for i in range(2)], cpu)
    report = analyse(tmp_path / "busy")
    assert report["verdict"] == summary["verdict"] == "consumer-bound"
    assert report["limit"] == summary["limit"] == "host-cpu" and report["host_cpu"] == cpu
    assert report["recommended_producers"] == summary["recommended_producers"] == 1  # never more than the 2
    assert "python run.py produce --connect tcp://THIS_HOST:PORT --data corpus" in report["cure"]
    assert "--producers 0 here" in report["cure"] and "data GPU (--data-gpu N)" in report["cure"]
    text = render(report)
    assert "host cpu      2 cores 98.0% busy over 4.0 s: the trainer process used 1.10 cores; 2 producers here " \
           "prepared batches 0.80 s a second" in text
    assert "limit         the host's CPU, not the producer count: consumer-bound with every core busy" in text
    assert "advice        no more producers here (1); move the producers' work off this host's cores" in text
    # the same figures from a feed in the user's loop: the feed's option, not the command line
    feed_run = tmp_path / "feed"
    write_run(feed_run, rows, [producer(i, 20, prep_ms=80.0, credit_wait_ms=120.0) for i in range(2)], cpu)
    written = json.loads((feed_run / "summary.json").read_text())
    (feed_run / "summary.json").write_text(json.dumps({**written, "trained_by": "stoker.Feed"}))
    assert "stoker.Feed(..., producers=0)" in analyse(feed_run)["cure"]


def test_a_producer_bound_run_on_a_busy_host_asks_for_no_more_producers_there(tmp_path):
    # One producer of 165 ms a batch for a 50 ms step (the first test's run), on a host with every
    # core busy: three more producers on those cores would not make batches faster.
    rows = rows_of([(WARMUP_WAIT_MS, 50.0, 0)] + [(115.0, 50.0, 0)] * 29)
    summary = write_run(tmp_path / "busy", rows, [producer(0, 30, prep_ms=165.0, credit_wait_ms=0.0)],
                        host_cpu(0.95, 5.0, 3.0, 1, 4.95))
    report = analyse(tmp_path / "busy")
    assert report["verdict"] == "producer-bound" and report["limit"] == summary["limit"] == "host-cpu"
    assert report["recommended_producers"] == summary["recommended_producers"] == 1
    assert "--producers 4" not in report["cure"] and "another host" in report["cure"]


def test_genuine_limits_on_a_host_with_cores_to_spare_keep_their_advice(tmp_path):
    # The slow trainer and the too few producers of the tests above, on a host 40 % and 60 % busy:
    # the producer count's verdicts and cures stand, and the host's line says it was not the limit.
    slow = rows_of([(WARMUP_WAIT_MS, 75.0, 0)] + [(0.0, 75.0, 3)] * 39)
    write_run(tmp_path / "slow", slow, [producer(i, 20, prep_ms=40.0, credit_wait_ms=110.0) for i in range(2)],
              host_cpu(0.4, 3.0, 0.9, 2, 1.6))
    report = analyse(tmp_path / "slow")
    assert report["verdict"] == report["limit"] == "consumer-bound" and report["recommended_producers"] == 1
    assert report["cure"] == f"the trainer is the limit and fewer producers suffice: {CURE} --producers 1"
    text = render(report)
    assert "host cpu      2 cores 40.0% busy" in text and "limit         the host's CPU" not in text
    few = rows_of([(WARMUP_WAIT_MS, 50.0, 0)] + [(115.0, 50.0, 0)] * 29)
    write_run(tmp_path / "few", few, [producer(0, 30, prep_ms=165.0, credit_wait_ms=0.0)],
              host_cpu(0.6, 5.0, 1.0, 1, 4.95))
    report = analyse(tmp_path / "few")
    assert report["verdict"] == report["limit"] == "producer-bound"
    assert report["recommended_producers"] == 4 and report["cure"] == f"{CURE} --producers 4"
