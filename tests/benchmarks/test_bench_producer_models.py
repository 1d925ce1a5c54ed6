"""The producer_models section (benchmarks/producer_models.py) without its runs: the four ways
are run with the commands they name, and the ratios and targets come from their summaries."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from stoker.benchmarks import producer_models, suite


def test_the_four_ways_give_the_ratios_and_targets_of_their_summaries(monkeypatch) -> None:
    calls: list[list[str]] = []
    rates = {"none": 400.0, "in-step": 200.0, "producers": 300.0, "cache": 390.0}

    def fake(args: list[str], run_dir: Path) -> dict[str, Any]:
        calls.append(args)
        if run_dir.name == "precompute":
            return {}
        way, rounds = run_dir.name[len("run-"):].rsplit("-", 1)[0], int(run_dir.name.rsplit("-", 1)[1])
        rate = rates.get(way, 0.0) + (10.0 if rounds == 1 else 0.0)  # the second round 10 faster: medians of two
        return {"samples_per_s": rate, "data_wait_frac": 0.01, "step_ms_mean": 30.0,
                "producers": [{"model_runs": 0 if way == "cache" else 4, "model_hits": 64}]}

    monkeypatch.setattr(producer_models, "_stoker", fake)
    result = producer_models.run(producer_models.ProducerModelsPlan(steps=20, repetitions=2))
    assert [c[c.index("--model") + 1].rsplit(":", 1)[1] for c in calls[1:]] == [
        "plain", "in_step", "on_codes", "on_codes", "on_codes", "on_codes", "in_step", "plain"]  # alternated
    assert calls[0][0] == "precompute" and f"transforms.models={producer_models.ENCODER}" not in calls[0]
    assert producer_models.ENCODER in calls[0] and "data.feature_cache=" in " ".join(calls[0])
    by_way = {way: run["command"] for way, run in result["runs"].items()}
    assert producer_models.ENCODER not in by_way["none"] and "feature_cache" in by_way["none"]
    assert by_way["in step"].endswith("log_every_steps=20") and ":in_step" in by_way["in step"]
    assert producer_models.ENCODER in by_way["producers"] and "feature_cache" not in by_way["producers"]
    assert math.isclose(result["producers_vs_in_step"]["value"], 305 / 205)
    assert math.isclose(result["cache_vs_none"]["value"], 395 / 405)
    assert [t["met"] for t in result["targets"]] == [True, True]
    listed = suite.targets({"producer_models": result})
    assert [t["section"] for t in listed] == ["producer_models"] * 2 and listed[0]["numerator"] == 305.0
    assert "(b) producers / (a) in step: 1.49" in producer_models.render(result)
