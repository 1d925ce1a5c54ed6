"""benchmarks/gpu.py at its smallest on the CPU: the report's structure, where each ratio comes
from, that the DataLoader's batches are the feed's (checked before timing), and that the feed, the
DataLoaders and the replay trained the same samples; no timings judged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.benchmarks import gpu, suite
from stoker.benchmarks.calibrate import MAX_TRIES
from stoker.benchmarks.corpus import make_clips
from stoker.benchmarks.common import BenchError, write_json
from tests.benchmarks.checks import assert_ratio

pytestmark = pytest.mark.slow  # processes: not a unit test


@pytest.mark.timeout(300)
def test_gpu_benchmark_structure(tmp_path: Path) -> None:
    plan = gpu.GpuPlan(clips=16, batch_size=8, epochs=2, producers=(1,), sizes=("small",), warmup_steps=1,
                       cpu_hold_ops=20, device="cpu", calibrate=True)
    kept: list[dict] = []
    result = gpu.run(plan, partial=kept.append)
    assert result["device"] == "cpu" and list(result["sizes"]) == ["small"] and result["complete"]
    size = result["sizes"]["small"]
    assert size["model"]["dim"] == gpu.CPU_DIM and size["hold_ops"] == 20
    replay, one = size["replay"], size["producers"]["1"]
    feed, loader, reference = one["feed"], one["dataloader"], one["dataloader_reference"]
    # before timing: one epoch of the feed's batches (16 clips / 8) equal to the DataLoader's, array by array
    same = result["same_work"]
    assert same["batches"] == 2 and same["equal"] and 0 < same["reference_mel_max_abs_diff"] < 1e-3
    assert {name: v["n"] for name, v in same["cpu_ms_per_batch"].items()} == {"dataloader": 2,
                                                                               "dataloader-reference": 2}
    # calibrated first (the small size's depth), and the three ways trained the model it chose
    calibration = size["calibration"]
    aim = gpu.AIMS["small"]
    assert calibration["aim"]["field"] == aim.field == "decoder_layers" and calibration["size"] == size["model"]
    tried = [value for value, _ in calibration["trail"]]
    assert tried[0] == gpu.SIZES["small"].decoder_layers and size["model"][aim.field] in tried
    assert all(aim.lo <= value <= aim.hi for value in tried) and len(tried) <= MAX_TRIES
    make_clips(tmp_path, plan.clips)  # the same generated clips: the same vocabulary and plan
    cfg, index, planned, _ = gpu.planned_batches(str(tmp_path), plan.batch_size, 1)
    shapes = sorted({(b.rows, *b.shape) for b in planned})
    assert calibration["shape"] == "x".join(map(str, shapes[len(shapes) // 2]))  # the middle bucket shape
    model = gpu.build_model(torch, index.vocabulary.size, cfg.features.n_mels, gpu.ModelSize(**size["model"]))
    assert replay["parameters"] == feed["parameters"] == loader["parameters"] == reference["parameters"] == \
        sum(p.numel() for p in model.parameters())
    # the same epochs of the same plan, four ways: the same steps and samples (16 clips, 2 epochs)
    assert replay["samples"] == feed["samples"] == loader["samples"] == reference["samples"] == 32
    assert replay["steps"] == feed["steps"] == loader["steps"] == reference["steps"] == 4
    for way in (replay, feed, loader, reference):
        assert way["samples_per_s"] > 0 and 0 <= way["wait_share"] < 1 and way["gpu_util"] is None
    assert feed["first_batch_s"] > 0 and loader["first_batch_s"] > 0 and replay["first_batch_s"] is None
    # the feed's trainer process on the CPU: the loop's thread, no stager (torch on the CPU stages nothing)
    assert "MainThread" in feed["threads"] and "stager" not in feed["threads"] and replay["threads"] is None
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
    assert_ratio(compared["feed_vs_dataloader_reference"])
    assert compared["feed_vs_dataloader_reference"]["denominator"] == reference["samples_per_s"]
    whats = [t["what"] for t in result["targets"]]
    assert whats == ["small P=1: feed step / replay step, worst shape", "small P=1: feed / DataLoader samples/s",
                     "small P=1: feed wait share"]
    assert [t["met"] for t in result["targets"]] == [t["value"] <= t["limit"] if n != 1 else t["value"] >= t["limit"]
                                                     for n, t in enumerate(result["targets"])]
    text = gpu.render(result)
    assert "feed/replay" in text and "decoder_layers calibrated for a step of ~15 ms" in text
    assert "its arrays equal the feed's in 2 batches (checked before timing)" in text
    assert "CPU per batch, made in the check's process in turns" in text
    assert "dataloader-reference (extra way)" in text and "feed / dataloader-reference samples/s (the extra way" in text
    assert f"the feed's trainer process's threads (P=1): {', '.join(feed['threads'])}" in text
    assert [t["what"] for t in suite.targets({"gpu": result})] == whats
    # kept on the way (what a run stopped at its deadline leaves): the feed's figures before the
    # dataloader ran, then both, then the extra way's, each a snapshot the later ways did not change
    assert [k["complete"] for k in kept] == [False] * 4 and all("targets" not in k for k in kept)
    assert kept[0]["sizes"]["small"]["producers"] == {} and kept[0]["sizes"]["small"]["replay"] == replay
    after_feed = kept[1]["sizes"]["small"]["producers"]["1"]
    assert after_feed["feed"] == feed and after_feed["dataloader"] is None
    without_loader = {"dataloader_ms": None, "dataloader_vs_replay": None}
    assert after_feed["compare"]["shapes"] == {shape: {**row, **without_loader}
                                               for shape, row in compared["shapes"].items()}
    assert after_feed["compare"]["feed_vs_dataloader"] is None
    assert kept[2]["sizes"]["small"]["producers"]["1"]["dataloader"] == loader
    assert kept[2]["sizes"]["small"]["producers"]["1"]["dataloader_reference"] is None
    assert kept[3]["sizes"] == result["sizes"]


def test_write_json_replaces_the_file_whole(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    write_json(out, {"complete": False})
    write_json(out, {"complete": True, "sizes": {}})
    assert json.loads(out.read_text()) == {"complete": True, "sizes": {}}
    assert [p.name for p in tmp_path.iterdir()] == ["gpu.json"]


def test_producer_sweep_doubles_up_to_the_cores() -> None:
    assert gpu.producer_sweep(1) == (1,)
    assert gpu.producer_sweep(2) == (1, 2)
    assert gpu.producer_sweep(16) == (1, 2, 4, 8, 16)
    assert gpu.producer_sweep(6) == (1, 2, 4, 6)


def test_targets_without_a_shape_timed_both_ways_is_one_line() -> None:
    one = {"compare": {"shapes": {"16x80x448": {"feed_vs_replay": None}}}, "feed": {"wait_share": 0.0}}
    with pytest.raises(BenchError, match="small P=2: no bucket shape was timed by both"):
        gpu.targets({"small": {"producers": {"2": one}}})


def _lease(ids: tuple[str, ...]) -> gpu.wire.Lease:
    return gpu.wire.Lease(lease=1, epoch=0, index=0, ids=ids, shape=(3, 4), rows=len(ids), tokens=((1,),) * len(ids))


def _arrays(mel: float = 0.5) -> dict[str, np.ndarray]:
    return {"tokens": np.ones((2, 3), np.int32), "mel_lengths": np.array([4, 2], np.int32),
            "mel": np.full((2, 4, 2), mel, np.float32)}


def test_same_work_is_every_array_equal_batch_by_batch() -> None:
    leases = [_lease(("a", "b")), _lease(("c", "d"))]
    items = [_arrays(0.5), _arrays(0.25)]
    reference = [_arrays(0.5), _arrays(0.25 + 1e-6)]
    # the feed's batches in another order than the plan's, matched by their ids
    same = gpu.check_same_work([(("c", "d"), _arrays(0.25)), (("a", "b"), _arrays(0.5))], leases, items, reference)
    assert same["batches"] == 2 and same["equal"] and same["reference_mel_max_abs_diff"] == pytest.approx(1e-6, rel=0.1)
    assert gpu.check_same_work([(("a", "b"), _arrays(0.5))], leases, items, None)["reference_mel_max_abs_diff"] is None
    off = _arrays(0.5)
    off["mel"][0, 0, 0] = np.nextafter(np.float32(0.5), np.float32(1))  # one value, one float32 step off
    with pytest.raises(BenchError, match="batch 0: the DataLoader's mel .* is not the feed's"):
        gpu.check_same_work([(("a", "b"), off)], leases, items, None)
    with pytest.raises(BenchError, match="the DataLoader's arrays"):
        gpu.check_same_work([(("a", "b"), {**_arrays(), "extra": np.zeros(1)})], leases, items, None)
    with pytest.raises(BenchError, match="a batch the plan does not have"):
        gpu.check_same_work([(("a", "c"), _arrays())], leases, items, None)
    with pytest.raises(BenchError, match="no batch to check"):
        gpu.check_same_work([], leases, items, None)


def test_planned_dataset_sends_its_workers_no_batch_maker(tmp_path: Path) -> None:
    make_clips(tmp_path, 4)
    cfg, _, planned, tokens = gpu.planned_batches(str(tmp_path), 4, 1)
    dataset = gpu.PlannedDataset(str(tmp_path), cfg.features, gpu.leases_of(planned, tokens))
    made = dataset.arrays(0)  # made by the producers' BatchMaker, kept for the next item
    assert dataset._maker is not None and made["mel"].dtype == np.float32
    state = dataset.__getstate__()
    assert state["_maker"] is None and state["leases"] == dataset.leases
