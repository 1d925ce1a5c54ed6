"""benchmarks/gpu.py at its smallest on the CPU: the report's structure, where each ratio comes
from, and that the feed, the DataLoader and the replay trained the same samples; no timings judged."""

from __future__ import annotations

import pytest

from stoker.benchmarks import gpu, suite
from stoker.benchmarks.common import BenchError
from tests.benchmarks.checks import assert_ratio

pytestmark = pytest.mark.slow  # processes: not a unit test


@pytest.mark.timeout(300)
def test_gpu_benchmark_structure() -> None:
    plan = gpu.GpuPlan(clips=16, batch_size=8, epochs=2, producers=(1,), sizes=("small",), warmup_steps=1,
                       cpu_hold_ops=20, device="cpu")
    result = gpu.run(plan)
    assert result["device"] == "cpu" and list(result["sizes"]) == ["small"]
    size = result["sizes"]["small"]
    assert size["model"]["dim"] == gpu.CPU_DIM and size["hold_ops"] == 20
    replay, one = size["replay"], size["producers"]["1"]
    feed, loader = one["feed"], one["dataloader"]
    # the same epochs of the same plan, three ways: the same steps and samples (16 clips, 2 epochs)
    assert replay["samples"] == feed["samples"] == loader["samples"] == 32
    assert replay["steps"] == feed["steps"] == loader["steps"] == 4
    for way in (replay, feed, loader):
        assert way["samples_per_s"] > 0 and 0 <= way["wait_share"] < 1 and way["gpu_util"] is None
    assert feed["first_batch_s"] > 0 and loader["first_batch_s"] > 0 and replay["first_batch_s"] is None
    # every shape the replay timed is compared, each ratio with the two medians it came from
    compared = one["compare"]
    assert set(compared["shapes"]) == set(replay["step_ms"]) and compared["shapes"]
    for shape, row in compared["shapes"].items():
        if row["feed_vs_replay"] is not None:
            assert_ratio(row["feed_vs_replay"])
            assert row["feed_vs_replay"]["numerator"] == feed["step_ms"][shape]["median"]
            assert row["feed_vs_replay"]["denominator"] == replay["step_ms"][shape]["median"]
    assert_ratio(compared["feed_vs_dataloader"])
    assert compared["feed_vs_dataloader"]["numerator"] == feed["samples_per_s"]
    assert compared["feed_vs_dataloader"]["denominator"] == loader["samples_per_s"]
    whats = [t["what"] for t in result["targets"]]
    assert whats == ["small P=1: feed step / replay step, worst shape", "small P=1: feed / DataLoader samples/s",
                     "small P=1: feed wait share"]
    assert [t["met"] for t in result["targets"]] == [t["value"] <= t["limit"] if n != 1 else t["value"] >= t["limit"]
                                                     for n, t in enumerate(result["targets"])]
    text = gpu.render(result)
    assert "feed/replay" in text and "dataloader" in text
    assert [t["what"] for t in suite.targets({"gpu": result})] == whats


def test_producer_sweep_doubles_up_to_the_cores() -> None:
    assert gpu.producer_sweep(1) == (1,)
    assert gpu.producer_sweep(2) == (1, 2)
    assert gpu.producer_sweep(16) == (1, 2, 4, 8, 16)
    assert gpu.producer_sweep(6) == (1, 2, 4, 6)


def test_targets_without_a_shape_timed_both_ways_is_one_line() -> None:
    one = {"compare": {"shapes": {"16x80x448": {"feed_vs_replay": None}}}, "feed": {"wait_share": 0.0}}
    with pytest.raises(BenchError, match="small P=2: no bucket shape was timed by both"):
        gpu.targets({"small": {"producers": {"2": one}}})
