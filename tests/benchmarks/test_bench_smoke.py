"""Smoke tests of the benchmark code paths in tiny configurations.

They check the structure of the results and that every ratio is the quotient of the two
positive measured numbers stored with it. No timing assertions: the machine is noisy.
"""

from __future__ import annotations

import json
import math

import pytest

from stoker.benchmarks import memory, pipeline, suite, transport
from stoker.benchmarks.common import least_squares_slope, ratio, spread
from tests.benchmarks.checks import assert_ratio

pytestmark = pytest.mark.timeout(120)

TINY_SIZES = {"16KiB": 16 << 10}


def assert_spread(s: dict) -> None:
    assert s["n"] == len(s["values"]) >= 1
    assert s["min"] <= s["median"] <= s["max"]


def tiny_transport_plan() -> transport.TransportPlan:
    return transport.TransportPlan(repetitions=2, messages={"16KiB": 20}, warmup=2, timeout_s=60)


# ---------------------------------------------------------------- helpers
def test_common_helpers():
    assert least_squares_slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    s = spread([3.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)
    assert_ratio(ratio(3.0, 4.0))
    with pytest.raises(Exception):
        ratio(0.0, 1.0)


def test_batch_shape_sizes_are_close_to_target():
    for size in transport.SIZES.values():
        shape = transport.batch_shape(size)
        nbytes = transport.payload_bytes(transport.make_batch(*shape))
        assert abs(nbytes - size) / size < 0.02


# ---------------------------------------------------------------- transport
@pytest.mark.slow  # processes or sockets
def test_transport_tiny():
    rows = transport.run(tiny_transport_plan(), sizes=TINY_SIZES)
    assert len(rows) == len(transport.TRANSPORTS) * len(TINY_SIZES)
    assert {(r["transport"], r["size"]) for r in rows} == {(t, s) for t in transport.TRANSPORTS for s in TINY_SIZES}
    for r in rows:
        for kind in ("raw", "protocol"):
            for figure in ("gbps", "batches_per_s", "sender_cpu_us_per_batch", "receiver_cpu_us_per_batch"):
                assert_spread(r[kind][figure])
                assert r[kind][figure]["n"] == 2
                assert r[kind][figure]["min"] > 0 if figure in ("gbps", "batches_per_s") else \
                    r[kind][figure]["min"] >= 0
        assert_ratio(r["ratio"])
        assert r["ratio"]["numerator"] == r["protocol"]["gbps"]["median"]
        assert r["ratio"]["denominator"] == r["raw"]["gbps"]["median"]
        assert_spread(r["ratio"]["paired"])
        assert r["target"]["applies"] is False and r["target"]["met"] is None
        d = r["decomposition"]
        for step in transport.STEPS:
            assert_spread(d[step]["gbps"])
            assert d[step]["gbps"]["n"] == 2
        credit, frames = d["credit"]["gbps"]["median"], d["frames"]["gbps"]["median"]
        for key in ("flow_control_ratio", "frame_layout_ratio", "ceiling_ratio", "python_work_ratio"):
            assert_ratio(d[key])
        assert (d["flow_control_ratio"]["numerator"], d["flow_control_ratio"]["denominator"]) == \
            (credit, r["raw"]["gbps"]["median"])
        assert (d["frame_layout_ratio"]["numerator"], d["frame_layout_ratio"]["denominator"]) == (frames, credit)
        assert (d["ceiling_ratio"]["numerator"], d["ceiling_ratio"]["denominator"]) == \
            (frames, r["raw"]["gbps"]["median"])
        assert (d["python_work_ratio"]["numerator"], d["python_work_ratio"]["denominator"]) == \
            (r["protocol"]["gbps"]["median"], frames)
        assert r["capacity"] == transport.CAPACITY
    text = transport.render(rows)
    assert "ratio" in text and "ceiling" in text and "frames send" in text


@pytest.mark.slow  # processes or sockets
def test_transport_other_window_is_not_judged():
    plan = transport.TransportPlan(repetitions=1, messages={"64KiB": 10}, warmup=2, timeout_s=60,
                                   transports=("tcp",), kinds=("raw", "protocol"), capacity=1)
    (row,) = transport.run(plan, sizes={"64KiB": 64 << 10})
    assert row["capacity"] == 1 and row["decomposition"] is None
    assert row["target"]["applies"] is False and row["target"]["met"] is None
    assert "frames send" not in transport.render([row])


# ---------------------------------------------------------------- pipeline (no subprocess)
def fake_run(steps: int = 50, wait_ms: float = 0.5, prep_ms: float = 80.0) -> tuple[dict, list[dict]]:
    rows, t = [], 3.0
    for step in range(1, steps + 1):
        wait = 3000.0 if step == 1 else wait_ms
        t += (wait + 100.0) / 1000.0
        rows.append({"step": step, "epoch": 0, "t": round(t, 4), "queue_depth": 0 if step == 1 else 3,
                     "wait_ms": wait, "step_ms": 100.0, "loss": None, "samples": 16, "producer": "p0"})
    summary = {"steps": steps, "steps_per_s": 9.0, "data_wait_frac": 0.005, "data_wait_frac_incl_warmup": 0.3,
               "queue_depth_mean": 2.9, "starved_steps": 1, "verdict": "consumer-bound", "exit_reason": "completed",
               "producers": [{"id": "p0", "batches": 30, "prep_ms_mean": prep_ms},
                             {"id": "p1", "batches": 25, "prep_ms_mean": prep_ms * 1.5}]}
    return summary, rows


def test_pipeline_analyze_constructed_run():
    summary, rows = fake_run()
    r = pipeline.analyze(summary, rows, producers=2)
    expected_sps = (50 - 1) / (rows[-1]["t"] - rows[0]["t"])
    assert r["steps_per_s"] == pytest.approx(expected_sps)
    assert_ratio(r["steps_ratio"])
    assert r["steps_ratio"]["numerator"] == r["steps_per_s"]
    assert r["steps_ratio"]["denominator"] == pipeline.IDEAL_STEPS_PER_S
    assert r["data_wait_frac"] == pytest.approx(0.5 / 100.5)
    assert r["starved_steps_after_warmup"] == 0
    prep = (80.0 * 30 + 120.0 * 25) / 55
    cap = r["capacity"]
    assert cap["prep_ms_mean"] == pytest.approx(prep)
    assert cap["capacity_batches_per_s"] == pytest.approx(2 * 1000 / prep)
    assert_ratio(cap["ratio"])
    assert cap["above_demand"] is True


def test_pipeline_aggregate_and_targets():
    spec = pipeline.RunSpec("tf", 2, 50, 2, targets=True)
    runs = [pipeline.analyze(*fake_run(wait_ms=w), producers=2) for w in (0.5, 5.0)]
    agg = pipeline.aggregate(spec, runs)
    assert_spread(agg["steps_per_s"])
    assert_ratio(agg["steps_ratio"])
    assert agg["steps_ratio"]["numerator"] == agg["steps_per_s"]["median"]
    assert_ratio(agg["capacity"]["ratio"])
    assert set(agg["targets"]) == {"steps_per_s", "data_wait_frac", "capacity_above_demand"}
    assert all(isinstance(t["met"], bool) for t in agg["targets"].values())
    info = pipeline.aggregate(pipeline.RunSpec("numpy", 2, 50, 1, targets=False), runs[:1])
    assert "targets" not in info
    assert "steps/s" in pipeline.render({"configs": [agg, info]})


def test_pipeline_analyze_rejects_empty_run():
    summary, rows = fake_run()
    with pytest.raises(Exception):
        pipeline.analyze(summary, rows[:2], producers=1)


# ---------------------------------------------------------------- memory
def test_memory_tiny():
    section = memory.run(memory.MemoryPlan(batches=50, sample_every=10, timeout_s=60))
    assert section["batches"] == 50
    assert [s["batches"] for s in section["samples"]] == [10, 20, 30, 40, 50]
    assert section["producer_sent"] >= 50
    assert section["queue_high_water"] <= 3
    assert section["rejected_messages"] == {}
    assert_ratio(section["end_vs_first"])
    assert section["end_vs_first"]["numerator"] == pytest.approx(section["end"]["rss_mb"])
    assert section["end_vs_first"]["denominator"] == pytest.approx(section["first_sample"]["rss_mb"])
    c = section["criterion"]
    assert isinstance(c["met"], bool) and c["limit_mb"] > 0
    assert section["bound"]["bound_mb"] > section["baseline_rss_mb"] > 0
    assert "RSS" in memory.render(section)


def test_memory_analyze_flags_growth():
    mb = memory.MB
    flat = [(n, 100 * mb, n / 100) for n in range(250, 5001, 250)]
    leaky = [(n, 100 * mb + n * 4096, n / 100) for n in range(250, 5001, 250)]
    ok = memory.analyze(flat, baseline=90 * mb, capacity=3, max_batch_bytes=2 * mb)
    bad = memory.analyze(leaky, baseline=90 * mb, capacity=3, max_batch_bytes=2 * mb)
    assert ok["criterion"]["met"] is True and ok["slope_mb_per_1000_batches"] == pytest.approx(0.0)
    assert bad["criterion"]["met"] is False
    assert bad["slope_mb_per_1000_batches"] == pytest.approx(4096 * 1000 / mb)
    # one allocator step of one batch in the middle of the second half is not a leak
    step = [(n, 100 * mb + (2 * mb if n >= 3750 else 0), n / 100) for n in range(250, 5001, 250)]
    assert memory.analyze(step, baseline=90 * mb, capacity=3, max_batch_bytes=2 * mb)["criterion"]["met"] is True


# ---------------------------------------------------------------- the suite and bench.json
@pytest.mark.slow  # processes or sockets
def test_suite_writes_bench_json(tmp_path, monkeypatch):
    def fake_run_once(spec, keep=None):
        summary, rows = fake_run(steps=spec.steps)
        return {**pipeline.analyze(summary, rows, spec.producers), "command": "fake", "wall_s_total": 1.0}

    monkeypatch.setattr(pipeline, "run_once", fake_run_once)
    plan = suite.SuitePlan(
        # one repetition: the suite's rows and targets (test_transport_tiny checks the repetitions' spread)
        transport=transport.TransportPlan(repetitions=1, messages={"8MiB": 3, "16KiB": 10}, warmup=1, timeout_s=60,
                                          transports=("tcp",), kinds=("raw", "protocol")),
        transport_sizes={"8MiB": 8 << 20, "16KiB": 16 << 10},
        pipeline=pipeline.PipelinePlan([pipeline.RunSpec("tf", 2, 30, 2, targets=True),
                                        pipeline.RunSpec("numpy", 2, 20, 1, targets=False)]),
        memory=memory.MemoryPlan(batches=40, sample_every=10, timeout_s=60),
        sections=("transport", "pipeline", "memory"),
    )
    out = tmp_path / "sub" / "bench.json"
    report = suite.run_suite(plan, out, quick=True, log=lambda text: None)
    data = json.loads(out.read_text())
    assert data["errors"] == {}
    assert set(data["machine"]) >= {"cores", "python", "platform"}
    assert data["quick"] is True
    assert set(data["sections"]) == {"transport", "pipeline", "memory"}
    assert isinstance(data["sections"]["transport"], list) and len(data["sections"]["transport"]) == 2
    assert isinstance(data["sections"]["pipeline"], dict) and isinstance(data["sections"]["memory"], dict)
    eight = [r for r in data["sections"]["transport"] if r["size"] == "8MiB"][0]
    assert eight["target"]["applies"] is True and isinstance(eight["target"]["met"], bool)
    sections_with_targets = {t["section"] for t in data["targets"]}
    assert sections_with_targets == {"transport", "pipeline", "memory"}
    for t in data["targets"]:
        assert isinstance(t["met"], bool)
        if t["numerator"] is not None:
            assert math.isclose(t["value"], t["numerator"] / t["denominator"], rel_tol=1e-12)
    text = suite.render(report)
    assert "targets" in text and "transport" in text


def test_suite_records_a_failing_section(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(pipeline, "run", broken)
    plan = suite.SuitePlan(sections=("pipeline",))
    report = suite.run_suite(plan, tmp_path / "bench.json", quick=True, log=lambda text: None)
    assert "boom" in report["errors"]["pipeline"]
    assert report["sections"]["pipeline"] is None
    assert "FAILED" in suite.render(report)


# ---------------------------------------------------------------- one very short real run
@pytest.mark.slow  # processes or sockets
def test_pipeline_short_real_run():
    # numpy backend and the synthetic trainer: no TensorFlow is imported anywhere
    result = pipeline.run_once(pipeline.RunSpec("numpy", 1, 10, 1, targets=False))
    assert result["steps"] == 10
    assert_ratio(result["steps_ratio"])
    assert result["summary"]["exit_reason"] == "completed"
    assert result["capacity"] is not None and result["capacity"]["producers"] == 1
    assert_ratio(result["capacity"]["ratio"])


def test_starvation_section_table_and_targets(tmp_path):
    from stoker.benchmarks import starvation

    starvation.make_dataset(tmp_path / "data", count=3)
    assert len((tmp_path / "data" / "metadata.csv").read_text().splitlines()) == 3
    rows = [{"wait_ms": w, "step_ms": 100.0} for w in (50.0, 50.0, 0.0, 0.0)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert starvation.second_half_wait(tmp_path) == 0.0
    result = {
        "A_producer_bound": {"verdict": "producer-bound", "data_wait_frac_before": 0.6, "recommended_producers": 4,
                             "data_wait_frac_after": 0.01, "target": "t", "met": True},
        "B_consumer_bound": {"verdict": "consumer-bound", "recommended_producers": 2, "target": "t", "met": True},
        "C_periodic_stall": {"injected_period_s": 2.0, "reported": {"period_s": 2.1}, "relative_error": 0.05,
                             "target": "t", "met": True},
        "D_auto_vs_fixed": {"fixed": {1: {"second_half": 0.5}, 2: {"second_half": 0.0}}, "best_fixed_producers": 2,
                            "auto_final_producers": 3, "auto_wait_second_half": 0.01, "auto_wait_whole_run": 0.2,
                            "target": "t", "met": False},
    }
    text = starvation.table(result)
    assert "recommended 4" in text and "NOT met" in text and "2.1 s" in text
    items = [t for t in suite.targets({"starvation": result}) if t["section"] == "starvation"]
    assert [t["met"] for t in items] == [True, True, True, False]
