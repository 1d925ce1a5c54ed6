"""benchmarks/trainer.py in a tiny configuration: structure and where each figure comes from,
no timings judged."""

from __future__ import annotations

import pytest

from stoker.benchmarks import suite, trainer

pytestmark = pytest.mark.slow  # TensorFlow or processes: not a unit test


@pytest.mark.timeout(120)
def test_trainer_benchmark_structure() -> None:
    plan = trainer.TrainerPlan(model="tests.consumer.training.user_models:good", batch_size=4, steps=4, warmup_steps=1,
                               repetitions=2, log_every=2, retrace_steps=10, retrace_batch_size=2)
    result = trainer.run(plan)
    o, r = result["overhead"], result["retraces"]
    assert o["memory_step_ms"]["n"] == o["queue_step_ms"]["n"] == 2
    ratio = o["overhead"]
    assert ratio["numerator"] == pytest.approx(o["queue_step_ms"]["median"] / 1e3)
    assert ratio["denominator"] == pytest.approx(o["memory_step_ms"]["median"] / 1e3)
    assert ratio["value"] == pytest.approx(ratio["numerator"] / ratio["denominator"] - 1)
    assert len(ratio["per_repetition"]) == 2 and o["target"] == trainer.TARGET_OVERHEAD
    assert o["met"] == (ratio["value"] <= trainer.TARGET_OVERHEAD)
    assert r["steps"] == 10 and r["traces_at_warmup"] == r["bucket_shapes"] >= 1
    assert r["traces_after_warmup"] == 0 and r["met"]
    text = trainer.render(result)
    assert "dequeue + staging" in text and "traces after warm-up over 10 steps" in text
    items = [t for t in suite.targets({"trainer": result}) if t["section"] == "trainer"]
    assert [t["met"] for t in items] == [o["met"], True]
