"""The comparison sections (alternatives, preprocessing, scaling) in tiny configurations.

Structure only: every figure is there, every ratio is the quotient of the two measured
numbers stored with it. No timing assertions. One real run of stoker and one of the
in-process tf.data variant (the only TensorFlow import here, in a child process).
"""

from __future__ import annotations

import json
import math

import pytest

from stoker.benchmarks import alternatives, data, producers, suite
from stoker.benchmarks.common import ratio
from tests.benchmarks.checks import assert_ratio

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def fake_result(steps_per_s: float, wait: float, first: float) -> dict:
    return {"steps": 10, "steps_per_s": steps_per_s, "wait_frac": wait, "time_to_first_batch_s": first,
            "cpu_s": 10.0 * first, "peak_rss_mb": 100.0 * first}


def test_summarize_ratios_and_targets():
    plan = alternatives.AlternativesPlan(steps=10, repetitions=2)
    samples = {"stoker": [fake_result(9.9, 0.001, 5.0), fake_result(9.8, 0.003, 6.0)],
               "tf.data": [fake_result(9.0, 0.05, 4.0), fake_result(9.2, 0.04, 4.5)],
               "tf.data service": [fake_result(9.5, 0.02, 20.0), fake_result(9.6, 0.03, 22.0)],
               "mp.Queue": [fake_result(9.1, 0.06, 9.0), fake_result(9.3, 0.07, 9.5)]}
    section = alternatives.summarize(plan, samples)
    json.dumps(section)
    assert set(section["variants"]) == set(samples)
    for kind, vs in section["vs_stoker"].items():
        for name in ("throughput", "time_to_first_batch", "cpu", "memory"):
            assert_ratio(vs[name])
        assert vs["throughput"]["numerator"] == section["variants"]["stoker"]["steps_per_s"]["median"]
        assert vs["throughput"]["denominator"] == section["variants"][kind]["steps_per_s"]["median"]
    targets = {t["what"]: t["met"] for t in section["targets"]}
    assert targets == {"stoker wait share <= tf.data's": True, "stoker time to first batch < tf.data's": False,
                       "stoker wait share <= tf.data service's": True,
                       "stoker time to first batch < tf.data service's": True}
    items = [t for t in suite.targets({"alternatives": section}) if t["section"] == "alternatives"]
    assert len(items) == 4
    for t in items:
        if t["numerator"] is not None:
            assert math.isclose(t["value"], t["numerator"] / t["denominator"])
    assert "tf.data service" in alternatives.render(section)
    # without the TF-op stoker row the tf.data variants are compared with stoker's default, and say so
    assert [(k, v["against"], v["same_work"]) for k, v in section["vs_stoker"].items()] == [
        ("tf.data", "stoker", False), ("tf.data service", "stoker", False), ("mp.Queue", "stoker", True)]
    assert "stoker (other work)" in alternatives.render(section)
    # with it, each alternative against the stoker row of the same per-batch work
    samples["stoker (tf ops)"] = [fake_result(9.7, 0.002, 7.0), fake_result(9.7, 0.004, 8.0)]
    fair = alternatives.summarize(plan, samples)
    assert {k: v["against"] for k, v in fair["vs_stoker"].items()} == {
        "tf.data": "stoker (tf ops)", "tf.data service": "stoker (tf ops)", "mp.Queue": "stoker",
        "stoker (tf ops)": "stoker"}
    assert all(v["same_work"] for v in fair["vs_stoker"].values())
    tf_data = fair["vs_stoker"]["tf.data"]
    assert tf_data["throughput"]["numerator"] == fair["variants"]["stoker (tf ops)"]["steps_per_s"]["median"]
    assert tf_data["time_to_first_batch"]["denominator"] == 7.5
    assert [t["what"] for t in fair["targets"]] == [
        "stoker (tf ops) wait share <= tf.data's", "stoker (tf ops) time to first batch < tf.data's",
        "stoker (tf ops) wait share <= tf.data service's", "stoker (tf ops) time to first batch < tf.data service's"]


def test_analyze_uses_the_steps_after_the_first():
    rows = [{"step": 1, "t": 1.0, "wait_ms": 900.0, "step_ms": 100.0},
            {"step": 2, "t": 1.2, "wait_ms": 100.0, "step_ms": 100.0},
            {"step": 3, "t": 1.3, "wait_ms": 0.0, "step_ms": 100.0}]
    r = alternatives.analyze(rows, first_batch_unix=105.0, started_unix=100.0)
    assert r["steps_per_s"] == pytest.approx(2 / 0.3)
    assert r["wait_frac"] == pytest.approx(100 / 300)
    assert r["time_to_first_batch_s"] == pytest.approx(5.0)


def test_plan_tensors_pad_to_the_bucket_shapes():
    batches = alternatives.plan_batches(alternatives.DEMO_DATA, 6)
    assert len(batches) == 6
    # each batch's lease, as the coordinator sends it: the same clips and tokens
    assert all(list(b["lease"].ids) == b["ids"] and [list(t) for t in b["lease"].tokens] == b["tokens"]
               for b in batches)
    t = alternatives.plan_tensors(batches)
    assert t["paths"].shape == t["token_lengths"].shape == (6, alternatives.BATCH_SIZE)
    assert t["tokens"].shape[2] >= max(b["shape"][0] for b in batches)
    assert (t["token_lengths"] <= t["shape"][:, :1]).all()


def test_real_stoker_and_tf_data_runs(tmp_path):
    # one tiny run each: the measuring code paths (rusage, RSS sampling, live.json, child result)
    plan = alternatives.AlternativesPlan(step_ms=10.0, steps=4, workers=1, repetitions=1,
                                         kinds=("stoker", "tf.data"))
    s = alternatives.run_stoker(plan, tmp_path / "s", backend="numpy")
    t = alternatives.run_alternative("tf.data", plan, tmp_path)
    for r in (s, t):
        assert r["steps"] == 4 and r["steps_per_s"] > 0 and r["time_to_first_batch_s"] > 0
        assert r["cpu_s"] > 0 and r["peak_rss_mb"] > 0 and 0 <= r["wait_frac"] <= 1
    section = alternatives.summarize(plan, {"stoker": [s], "tf.data": [t]})
    for name in ("throughput", "time_to_first_batch", "cpu", "memory"):
        assert_ratio(section["vs_stoker"]["tf.data"][name])


def test_preprocessing_tiny():
    section = data.run_preprocessing(1, variants=("stoker", "numpy-reference"), log=lambda text: None)
    assert set(section["variants"]) == {"stoker", "numpy-reference"}
    for v in section["variants"].values():
        assert v["clips_per_s"]["median"] > 0 and v["cpu_ms_per_clip"]["median"] > 0 and v["peak_rss_mb"] > 0
    r = section["ratios"]["numpy-reference"]
    assert_ratio(r)
    assert r["numerator"] == section["variants"]["stoker"]["clips_per_s"]["median"]
    assert "numpy-reference" in data.render_preprocessing(section)


def test_scaling_section_with_a_tiny_index(monkeypatch):
    def fake_scaling(plan, work, log):
        rows = [{"producers": n, "samples_per_s": 100.0 * n, "efficiency": ratio(100.0 * n, 100.0 * n),
                 "prep_ms_mean": 50.0, "producer_cpu_s": 1.0, "samples_per_producer_cpu_s": 10.0,
                 "target_met": True, "cpu_bound": False} for n in plan.counts]
        return {"one_producer_samples_per_s": 100.0, "cores": 2, "rows": rows, "target": "t"}

    monkeypatch.setattr(producers, "scaling", fake_scaling)
    plan = suite.ScalingPlan(producers.ProducersPlan(counts=(1, 2), sections=("scaling",)),
                             data.DataPlan(index_sizes=[60, 120], index_repetitions=1))
    section = suite.run_scaling(plan, log=lambda text: None)
    rows = section["index"]["rows"]
    assert [r["items"] for r in rows] == [60, 120]
    for r in rows:
        assert r["with_dataset"]["time_to_first_batch_s"] > 0
    items = [t for t in suite.targets({"scaling": section}) if t["section"] == "scaling"]
    assert items and all(isinstance(t["met"], bool) for t in items)
    report = {"machine": {}, "quick": True, "duration_s": 1.0, "sections": {"scaling": section}, "targets": [],
              "errors": {}}
    assert "first batch" in suite.render(report)
