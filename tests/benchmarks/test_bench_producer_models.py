"""The producer_models section (benchmarks/producer_models.py) without its runs: the four ways
are run with the commands they name, in both layouts of the cores, for the Keras encoder in
stoker's runs and the PyTorch one on stoker.Feed(framework="torch"), and the ratios and
targets come from their summaries."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from stoker.benchmarks import producer_models, suite
from tests.benchmarks.checks import assert_ratio

RATES = {("shared", "none"): 400.0, ("shared", "in-step"): 200.0, ("shared", "producers"): 300.0,
         ("shared", "cache"): 390.0, ("pinned", "none"): 250.0, ("pinned", "in-step"): 100.0,
         ("pinned", "producers"): 200.0, ("pinned", "cache"): 240.0}


def fake_runs(monkeypatch, calls: list[tuple[list[str], str, Any]]) -> None:
    """Stands in for stoker's runs: each run's rate from RATES, the second round 10 faster
    (so that a median of two is their mean)."""
    def fake(args: list[str], run_dir: Path, cores: Any = None) -> dict[str, Any]:
        calls.append((args, run_dir.name, cores))
        if run_dir.name.endswith("precompute"):
            return {}
        name, rounds = run_dir.name[len("run-"):].rsplit("-", 1)
        layout, way = name.split("-", 1)
        assert (cores is not None) == (layout == "pinned")
        summary = {"samples_per_s": RATES[layout, way] + (10.0 if rounds == "1" else 0.0), "data_wait_frac": 0.01,
                   "step_ms_mean": 30.0, "producers": [{"model_runs": 0 if way == "cache" else 4, "model_hits": 64}]}
        return summary if cores is None else {**summary, "pinned": {"trainer_core": sorted(cores.trainer)}}

    monkeypatch.setattr(producer_models, "_stoker", fake)


def test_both_layouts_give_the_ratios_and_targets_of_their_summaries(monkeypatch) -> None:
    calls: list[tuple[list[str], str, Any]] = []
    fake_runs(monkeypatch, calls)
    result = producer_models.run(producer_models.ProducerModelsPlan(steps=20, repetitions=2, frameworks=("tensorflow",)),
                                 usable_cores={0, 1})
    trainers = [args[args.index("--model") + 1].rsplit(":", 1)[1] for args, _, _ in calls[1:]]
    first_round = ["plain", "in_step", "on_codes", "on_codes"] * 2
    assert trainers == first_round + first_round[::-1]  # alternated
    assert [name.split("-")[1] for _, name, _ in calls[1:9]] == ["shared"] * 4 + ["pinned"] * 4
    pinned = {cores for _, name, cores in calls if "pinned" in name}
    assert pinned == {producer_models.Cores(trainer=frozenset({0}), producers=frozenset({1}))}
    precompute = calls[0][0]
    assert precompute[0] == "precompute" and calls[0][2] is None
    assert producer_models.ENCODER in precompute and "data.feature_cache=" in " ".join(precompute)
    for layout in ("shared", "pinned"):
        by_way = {way: run["command"] for way, run in result["layouts"][layout]["runs"].items()}
        assert producer_models.ENCODER not in by_way["none"] and "feature_cache" in by_way["none"]
        assert by_way["in step"].endswith("log_every_steps=20") and ":in_step" in by_way["in step"]
        assert producer_models.ENCODER in by_way["producers"] and "feature_cache" not in by_way["producers"]
    shared, pinned_layout = result["layouts"]["shared"], result["layouts"]["pinned"]
    assert math.isclose(shared["producers_vs_in_step"]["value"], 305 / 205)
    assert math.isclose(shared["cache_vs_none"]["value"], 395 / 405)
    assert math.isclose(pinned_layout["producers_vs_in_step"]["value"], 205 / 105)
    assert math.isclose(pinned_layout["cache_vs_none"]["value"], 245 / 255)
    assert shared["pinned"] is None and pinned_layout["pinned"] == {"trainer_core": [0]}
    for layout in (shared, pinned_layout):
        assert_ratio(layout["producers_vs_in_step"])
        assert_ratio(layout["cache_vs_none"])
    listed = suite.targets({"producer_models": result})
    assert [(t["what"].split(":")[0], t["met"]) for t in listed] == [
        ("shared cores", True), ("shared cores", True), ("pinned cores", True), ("pinned cores", True)]
    assert [t["numerator"] for t in listed] == [305.0, 395.0, 205.0, 245.0]
    assert [t["section"] for t in listed] == ["producer_models"] * 4
    text = producer_models.render(result)
    assert "(b) producers / (a) in step: 1.49" in text and "(b) producers / (a) in step: 1.95" in text
    assert "(c) cache / none: 0.98" in text and "(c) cache / none: 0.96" in text
    assert "one core per device" in text and "No GPU was measured" in text


def test_a_host_with_one_core_skips_the_pinned_layout_and_says_why(monkeypatch) -> None:
    calls: list[tuple[list[str], str, Any]] = []
    fake_runs(monkeypatch, calls)
    said: list[str] = []
    result = producer_models.run(producer_models.ProducerModelsPlan(steps=20, repetitions=1,
                                                                    frameworks=("tensorflow",)),
                                 said.append, usable_cores={3})
    assert all(cores is None for _, _, cores in calls) and len(calls) == 1 + 4
    assert result["layouts"]["pinned"] == {"skipped": "the pinned layout needs 2 cores, this host lets this "
                                                      "process use 1"}
    assert any("pinned layout skipped: the pinned layout needs 2 cores" in line for line in said)
    assert [t["what"].split(":")[0] for t in result["targets"]] == ["shared cores", "shared cores"]
    assert "one core per device (trainer on one core, producers on another): skipped (the pinned layout needs 2 " \
           "cores" in producer_models.render(result)


def test_the_cores_are_split_one_for_the_trainer_and_one_for_the_producers() -> None:
    assert producer_models.split_cores({5, 2, 9}) == producer_models.Cores(trainer=frozenset({2}),
                                                                            producers=frozenset({5}))
    assert producer_models.split_cores(set()) == "the pinned layout needs 2 cores, this host lets this process use 0"


TORCH_RATES = {("shared", "none"): 300.0, ("shared", "in-step"): 150.0, ("shared", "producers"): 180.0,
               ("shared", "cache"): 290.0, ("pinned", "none"): 200.0, ("pinned", "in-step"): 90.0,
               ("pinned", "producers"): 150.0, ("pinned", "cache"): 196.0}


def test_the_pytorch_encoder_is_measured_the_four_ways_on_the_feed_with_its_own_cache(monkeypatch) -> None:
    calls: list[tuple[list[str], str, Any]] = []
    fake_runs(monkeypatch, calls)
    runs: list[tuple[str, str, Any]] = []

    def fake_torch(way: str, steps: int, run_dir: Path, cache: Path, cores: Any) -> dict[str, Any]:
        runs.append((way, run_dir.name, cores))
        layout = run_dir.name.split("-")[1]
        assert (cores is not None) == (layout == "pinned") and steps == 20 and cache.name == "torch-cache"
        return {"samples_per_s": TORCH_RATES[layout, way.replace(" ", "-")], "data_wait_frac": 0.02,
                "step_ms_mean": 40.0, "producers": [{"model_runs": 3 if way == "producers" else 0, "model_hits": 0}]}

    monkeypatch.setattr(producer_models, "_torch_run", fake_torch)
    result = producer_models.run(producer_models.ProducerModelsPlan(steps=20, repetitions=1, frameworks=("torch",)),
                                 usable_cores={0, 1})
    (precompute, name, _), = calls  # stoker's runs: only the precompute that fills the PyTorch encoder's cache
    assert name == "torch-precompute" and producer_models.TORCH_ENCODER in precompute
    assert "data.feature_cache=" in " ".join(precompute) and precompute[0] == "precompute"
    assert [(way, name.split("-")[1]) for way, name, _ in runs] == [
        (way, layout) for layout in ("shared", "pinned") for way in ("none", "in step", "producers", "cache")]
    assert "layouts" not in result  # no Keras runs asked for
    torch_result = result["torch"]
    assert torch_result["device"] == "cpu" and "--data-gpu" not in precompute  # this host has no GPU
    assert math.isclose(torch_result["layouts"]["shared"]["producers_vs_in_step"]["value"], 180 / 150)
    assert math.isclose(torch_result["layouts"]["pinned"]["producers_vs_in_step"]["value"], 150 / 90)
    assert math.isclose(torch_result["layouts"]["pinned"]["cache_vs_none"]["value"], 196 / 200)
    listed = suite.targets({"producer_models": result})
    assert [(t["what"].split(":")[0], t["met"]) for t in listed] == [
        ("PyTorch encoder, shared cores", False), ("PyTorch encoder, shared cores", True),
        ("PyTorch encoder, pinned cores", True), ("PyTorch encoder, pinned cores", True)]
    text = producer_models.render(result)
    assert "PyTorch encoder and step" in text and "no TensorFlow) on cpu:" in text
    assert "(b) producers / (a) in step: 1.67" in text and "No GPU was measured" in text
    on_gpu = producer_models.render({**result, "torch": {**torch_result, "device": "NVIDIA H200"}})
    assert "no TensorFlow) on NVIDIA H200:" in on_gpu and "No GPU was measured" not in on_gpu


def test_the_pytorch_trainer_takes_its_codes_the_way_it_is_run() -> None:
    """(a) encodes each batch in the step, (b) and (c) read the batch's codes, none trains on
    zeros: the losses differ accordingly on one batch."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    mel = torch.randn(2, 24, producer_models.N_MELS)
    batch = {"mel": mel, "mel_lengths": torch.tensor([24, 17], dtype=torch.int32),
             "tokens": torch.randint(1, 9, (2, 6), dtype=torch.int32)}
    codes = producer_models.torch_encoder()(mel=mel, mel_lengths=batch["mel_lengths"])["codes"]
    assert codes.shape == (2, 6) and codes.dtype == torch.int32
    losses = {}
    for way, given in (("in step", {}), ("producers", {"codes": codes}), ("none", {})):
        torch.manual_seed(1)
        model, encoder = producer_models._torch_trainer(10, way)
        assert (encoder is not None) == (way == "in step")
        losses[way] = float(model({**batch, **given}).detach())
    assert losses["in step"] == pytest.approx(losses["producers"], rel=1e-6)
    assert losses["none"] != pytest.approx(losses["producers"], rel=1e-3)
