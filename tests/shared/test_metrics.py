"""Tests for shared/metrics.py: the summary figures, the verdict and the jsonl files."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest

from stoker.shared import metrics
from stoker.shared.metrics import JsonlWriter, read_jsonl, recommend_producers, summarize, verdict
from stoker.shared.runfiles import write_json

pytestmark = pytest.mark.timeout(60)

CAPACITY = 3
# summary.json fields that are a contract (README.md, "What a run writes").
SUMMARY_CONTRACT = {
    "steps", "epochs_completed", "samples", "wall_s", "steps_per_s", "samples_per_s", "data_wait_frac",
    "queue_depth_mean", "starved_steps", "rejected", "producers", "verdict", "recommended_producers",
    "loss_first", "loss_last", "exit_reason",
}
METRICS_ROW_CONTRACT = ("step", "epoch", "t", "queue_depth", "wait_ms", "step_ms", "loss")


def _rows(waits, steps, depths, losses=None, samples=4):
    rows = []
    t = 0.0
    for i, (w, s, d) in enumerate(zip(waits, steps, depths)):
        t += (w + s) / 1000
        rows.append({"step": i + 1, "epoch": 0, "t": t, "queue_depth": d, "wait_ms": w, "step_ms": s,
                     "loss": None if losses is None else losses[i], "samples": samples})
    return rows


def _producer(pid: int, prep_ms: float | None, batches: int = 10) -> dict:
    return {"id": pid, "host": "h", "batches": batches, "samples": batches * 4, "rejected": 0,
            "status": "running", "prep_ms_mean": prep_ms}


def _summary(rows, producers=(), **kw):
    args = dict(capacity=CAPACITY, batches_per_epoch=4, producers=list(producers), rejected=0,
                exit_reason="steps", wall_s=12.3456)
    args.update(kw)
    return summarize(rows, **args)


def test_contract_fields_present() -> None:
    rows = _rows([1.0] * 5, [10.0] * 5, [2] * 5, losses=[5.0, 4.0, 3.0, 2.5, 2.0])
    summary = _summary(rows, [_producer(0, 20.0)])
    assert SUMMARY_CONTRACT <= set(summary)
    json.dumps(summary)  # all plain data
    assert all(key in rows[0] for key in METRICS_ROW_CONTRACT)


def test_figures_from_synthetic_rows() -> None:
    waits = [0.0, 5.0, 0.0, 20.0, 1.0, 0.0, 0.0, 3.0]
    steps = [10.0, 12.0, 9.0, 11.0, 10.0, 10.0, 14.0, 10.0]
    depths = [3, 0, 2, 0, 1, 3, 2, 0]
    rows = _rows(waits, steps, depths, losses=[None, 4.0, 3.5, None, 3.0, 2.9, 2.8, None])
    producers = [_producer(0, 25.0), _producer(1, 35.0)]
    summary = _summary(rows, producers, rejected=3, exit_reason="interrupted", batches_per_epoch=3, batch_size=4)
    # The first step's wait is warm-up (module docstring): reported apart, not in data_wait_frac.
    expected_frac = sum(waits[1:]) / (sum(waits[1:]) + sum(steps))
    assert summary["data_wait_frac"] == pytest.approx(expected_frac, abs=1e-5)
    assert summary["data_wait_frac_incl_warmup"] == pytest.approx(sum(waits) / (sum(waits) + sum(steps)), abs=1e-5)
    assert summary["first_batch_wait_ms"] == waits[0]
    assert summary["steps"] == 8
    assert summary["epochs_completed"] == 2
    assert summary["samples"] == 32
    assert summary["starved_steps"] == 3
    assert summary["queue_depth_mean"] == pytest.approx(sum(depths) / 8, abs=1e-4)
    # Rates are over the time after warm-up too: from the start of the first step on.
    steady_s = (sum(waits[1:]) + sum(steps)) / 1000
    assert summary["steps_per_s"] == pytest.approx(8 / steady_s, rel=1e-3)
    assert summary["samples_per_s"] == pytest.approx(32 / steady_s, rel=1e-3)
    assert summary["steps_per_s_incl_warmup"] == pytest.approx(8000 / (sum(waits) + sum(steps)), rel=1e-3)
    assert summary["loss_first"] == 4.0 and summary["loss_last"] == 2.8
    assert summary["rejected"] == 3 and summary["exit_reason"] == "interrupted"
    assert summary["wall_s"] == 12.346
    assert summary["producers"] == producers
    assert summary["capacity"] == CAPACITY


def test_no_rows() -> None:
    summary = _summary([])
    assert summary["steps"] == 0 and summary["starved_steps"] == 0
    assert summary["data_wait_frac"] is None and summary["queue_depth_mean"] is None
    assert summary["verdict"] == "balanced"
    assert summary["steps_per_s"] == 0.0 and summary["loss_first"] is None
    assert summary["recommended_producers"] >= 1


def test_unknown_batches_per_epoch() -> None:
    assert _summary(_rows([0.0] * 5, [1.0] * 5, [1] * 5), batches_per_epoch=0)["epochs_completed"] == 0


# --------------------------------------------------------------------------- verdicts

def test_producer_bound_when_waiting_more_than_5_percent() -> None:
    rows = _rows([10.0] * 20, [90.0] * 20, [0] * 20)  # 10% waiting
    summary = _summary(rows, [_producer(0, 200.0), _producer(1, 200.0)])
    assert summary["verdict"] == "producer-bound"
    assert summary["recommended_producers"] >= 3


def test_waiting_exactly_5_percent_is_not_producer_bound() -> None:
    # First row: a long warm-up wait that does not count; then 5 ms of 100 waited.
    rows = _rows([999.0, 5.0], [0.0, 95.0], [1, 1])
    assert _summary(rows)["data_wait_frac"] == 0.05
    assert _summary(rows)["verdict"] == "balanced"
    rows = _rows([999.0, 5.1], [0.0, 94.9], [1, 1])
    assert _summary(rows)["verdict"] == "producer-bound"


def test_warm_up_wait_alone_is_not_starvation() -> None:
    rows = _rows([5000.0] + [0.0] * 9, [50.0] * 10, [0] + [1] * 9)
    summary = _summary(rows)
    assert summary["data_wait_frac"] == 0.0
    assert summary["data_wait_frac_incl_warmup"] == pytest.approx(5000 / 5500, abs=1e-5)
    assert summary["verdict"] == "balanced"
    assert summary["starved_steps"] == 1


def test_consumer_bound_when_queue_full_and_no_wait() -> None:
    rows = _rows([0.0] * 20, [100.0] * 20, [3, 3, 2, 3] * 5)  # mean 2.75 >= capacity - 1
    summary = _summary(rows, [_producer(i, 30.0) for i in range(4)])
    assert summary["verdict"] == "consumer-bound"
    assert summary["recommended_producers"] <= 4


def test_full_queue_but_waiting_is_producer_bound() -> None:
    rows = _rows([20.0] * 10, [80.0] * 10, [3] * 10)
    assert _summary(rows)["verdict"] == "producer-bound"


def test_balanced_otherwise() -> None:
    rows = _rows([1.0] * 10, [99.0] * 10, [1] * 10)  # 1% wait, queue half empty
    assert _summary(rows)["verdict"] == "balanced"


@pytest.mark.parametrize(("frac", "depth", "expected"), [
    (None, 2.0, "balanced"), (0.2, None, "balanced"), (0.051, 3.0, "producer-bound"),
    (0.0, 2.0, "consumer-bound"), (0.0, 1.99, "balanced"), (0.05, 0.0, "balanced"),
])
def test_verdict_table(frac, depth, expected: str) -> None:
    assert verdict(frac, depth, CAPACITY) == expected


# --------------------------------------------------------------------------- recommended_producers

@pytest.mark.parametrize(("prep", "step"), [(100.0, 50.0), (30.0, 100.0), (250.0, 30.0), (99.0, 99.0)])
def test_recommendation_formula_when_balanced(prep: float, step: float) -> None:
    assert recommend_producers("balanced", step, [prep, prep], 2) == math.ceil(1.2 * prep / step)


def test_recommendation_uses_mean_prep_time() -> None:
    assert recommend_producers("balanced", 10.0, [20.0, 40.0, None], 2) == math.ceil(1.2 * 30.0 / 10.0)


@pytest.mark.parametrize("current", [1, 2, 5, 10])
def test_producer_bound_recommends_more(current: int) -> None:
    got = recommend_producers("producer-bound", 100.0, [50.0], current)  # formula alone says 1
    assert got >= current + 1
    assert recommend_producers("producer-bound", 10.0, [100.0], current) >= max(12, current + 1)


@pytest.mark.parametrize("current", [1, 2, 5, 10])
def test_consumer_bound_never_recommends_more(current: int) -> None:
    assert 1 <= recommend_producers("consumer-bound", 10.0, [1000.0], current) <= current
    assert recommend_producers("consumer-bound", 100.0, [30.0], current) == 1


def test_recommendation_without_timings() -> None:
    assert recommend_producers("balanced", None, [20.0], 3) == 3
    assert recommend_producers("producer-bound", 10.0, [None], 3) == 4
    assert recommend_producers("balanced", 10.0, [], 0) == 1


def test_summary_recommendation_uses_active_producers() -> None:
    rows = _rows([0.0] * 10, [40.0] * 10, [1] * 10)
    producers = [_producer(0, 100.0), _producer(1, 100.0), _producer(2, None, batches=0)]
    summary = _summary(rows, producers)
    assert summary["verdict"] == "balanced"
    assert summary["recommended_producers"] == math.ceil(1.2 * 100.0 / 40.0)


# --------------------------------------------------------------------------- files

def test_read_jsonl_ignores_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = _rows([1.0, 2.0], [10.0, 11.0], [1, 2])
    text = "".join(json.dumps(r) + "\n" for r in rows) + json.dumps(rows[0])[:17]
    path.write_text(text, encoding="utf-8")
    assert read_jsonl(path) == rows


def test_read_jsonl_missing_file(tmp_path: Path) -> None:
    assert read_jsonl(tmp_path / "absent.jsonl") == []


def test_jsonl_writer_round_trip_from_threads(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    writer = JsonlWriter(path)
    threads = [threading.Thread(target=lambda k=k: [writer.write({"t": k, "i": i}) for i in range(200)])
               for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    writer.close()
    writer.close()  # idempotent
    got = read_jsonl(path)
    assert len(got) == 800
    assert sorted((r["t"], r["i"]) for r in got) == [(k, i) for k in range(4) for i in range(200)]
    assert len(path.read_text(encoding="utf-8").splitlines()) == 800  # no interleaved lines


def test_write_json_is_complete_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    write_json(path, {"steps": 3, "verdict": "balanced"})
    write_json(path, {"steps": 4, "verdict": "balanced"})
    assert json.loads(path.read_text(encoding="utf-8")) == {"steps": 4, "verdict": "balanced"}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_constants_match_the_documentation() -> None:
    assert metrics.WAIT_BOUND_FRAC == 0.05
    assert metrics.PRODUCER_MARGIN == 1.2


def test_frames_useful_frac_is_valid_over_computed_frames() -> None:
    rows = _rows([1.0] * 3, [10.0] * 3, [2] * 3)
    for row, (frames, computed) in zip(rows, [(90, 100), (50, 100), (160, 200)]):
        row.update(frames=frames, frames_computed=computed)
    assert _summary(rows)["frames_useful_frac"] == round(300 / 400, 4)
    assert _summary(_rows([1.0], [10.0], [2]))["frames_useful_frac"] is None  # rows that do not say


def test_diagnose_names_padding_waste() -> None:
    from stoker.diagnose import padding_report

    rows = [{"frames": 80, "frames_computed": 100}, {"frames": 70, "frames_computed": 100}]
    assert padding_report(rows) == {"frames_useful_frac": 0.75, "waste": True}
    assert padding_report([{"frames": 97, "frames_computed": 100}]) == {"frames_useful_frac": 0.97, "waste": False}
    assert padding_report([{"step": 1}]) is None


def test_wait_share_is_wait_over_wait_plus_step_and_none_without_time() -> None:
    from stoker.shared.metrics import wait_share

    rows = [{"wait_ms": 10.0, "step_ms": 90.0}, {"wait_ms": 30.0, "step_ms": 70.0}]
    assert wait_share(rows) == pytest.approx(40.0 / 200.0)
    assert wait_share([]) is None and wait_share([{"wait_ms": 0.0, "step_ms": 0.0}]) is None


def _host(busy: float | None, local: int = 2, cores: int = 2) -> dict:
    """summary.json's host_cpu of a run over 10 s (HostCpu.figures)."""
    return {"cores": cores, "window_s": 10.0, "busy_frac": busy, "trainer_cpu_s": 9.0, "local_producers": local,
            "local_prep_s": 10.5}


@pytest.mark.parametrize("kind", ["consumer-bound", "producer-bound"])
def test_a_bound_run_on_a_host_with_every_core_busy_is_host_cpu_limited(kind: str) -> None:
    assert metrics.host_cpu_limited(kind, _host(0.97))
    assert metrics.host_cpu_limited(kind, _host(metrics.HOST_BUSY_FRAC))


@pytest.mark.parametrize("kind, host", [
    ("consumer-bound", _host(0.55)),  # cores to spare: the trainer itself is the limit
    ("producer-bound", _host(0.6)),  # cores to spare: more producers help
    ("consumer-bound", _host(0.97, local=0)),  # busy, but no producer of the run on it: not the run's cores
    ("balanced", _host(0.99)),  # nothing starves
    ("producer-bound", None),  # a summary that recorded no host figures
    ("producer-bound", _host(None)),
])
def test_a_host_with_cores_to_spare_or_without_producers_is_not_the_limit(kind: str, host) -> None:
    assert not metrics.host_cpu_limited(kind, host)


def test_summary_on_a_busy_host_says_host_cpu_and_asks_for_no_more_producers() -> None:
    # waiting 50 % of the time for one producer of 300 ms batches: the producer count's verdict asks for 4
    rows = _rows([500.0] + [100.0] * 19, [100.0] * 20, [0] * 20)
    starving = _summary(rows, producers=[_producer(1, 300.0, 20)], host_cpu=_host(0.55, local=1))
    assert starving["verdict"] == starving["limit"] == "producer-bound"
    assert starving["recommended_producers"] == 4 and starving["host_cpu"] == _host(0.55, local=1)
    busy = _summary(rows, producers=[_producer(1, 300.0, 20)], host_cpu=_host(0.98, local=1))
    assert busy["verdict"] == "producer-bound" and busy["limit"] == metrics.HOST_CPU_LIMIT == "host-cpu"
    assert busy["recommended_producers"] == 1  # the one it had: more on these cores cannot help
    # a run with no host figures (written by the launcher from metrics.jsonl alone) keeps the verdict
    assert _summary(rows, producers=[_producer(1, 300.0, 20)])["limit"] == "producer-bound"


def test_host_cpu_figures_are_of_the_window_and_this_hosts_delivering_producers() -> None:
    host_cpu = metrics.HostCpu()
    assert host_cpu.figures([], "h") is None  # not started: no window
    host_cpu.start()
    producers = [_producer(1, 300.0, 20), {**_producer(2, 100.0, 5), "host": "other"}, _producer(3, 50.0, 0)]
    figures = host_cpu.figures(producers, "h")
    assert figures["local_producers"] == 1 and figures["local_prep_s"] == pytest.approx(6.0)  # 20 x 300 ms
    assert figures["cores"] >= 1 and figures["window_s"] >= 0 and figures["trainer_cpu_s"] >= 0
    assert figures["busy_frac"] is None or 0 <= figures["busy_frac"] <= 1
