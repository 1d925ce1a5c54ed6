"""Smoke test of benchmarks/data.py in a tiny configuration: structure, not timings."""

from __future__ import annotations

import math

import psutil
import pytest

from stoker.benchmarks import data

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_tiny_data_benchmark_reports_every_figure_and_target(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    plan = data.DataPlan(index_sizes=[data.LJSPEECH_ITEMS // 40, data.LJSPEECH_ITEMS // 20], index_repetitions=1,
                         clips=6, repetitions=1, variants=["stoker", "librosa", "stoker-warm", "stoker-shards",
                                                               "stoker-parquet"],
                         default_threads=False)
    report = data.run(plan, workdir=tmp_path, log=lambda line: None)
    rows = report["index"]["rows"]
    assert [r["items"] for r in rows] == plan.index_sizes
    for r in rows:
        assert r["cold_s"]["median"] > r["warm_s"]["median"] > 0
    variants = report["producer"]["threads"]["1"]
    assert set(variants) == {"stoker", "librosa", "stoker-warm", "stoker-shards", "stoker-parquet"}
    assert variants["stoker"]["backend"] == "numpy"  # auto on a machine without a GPU for this process
    assert variants["stoker-warm"]["cache"]["hits"] == plan.clips
    targets = {(t["section"], t["what"]) for t in report["targets"]}
    assert len(targets) == 10 and ("producer", "producer clips/s from tar shards >= 0.9 x from loose files") in targets
    assert ("producer", "producer clips/s from Parquet >= 0.9 x from loose files") in targets
    phonemes = report["index"]["phonemes"]
    assert phonemes["sentences"] == plan.index_sizes[0] and phonemes["sentences_per_s_per_core"] > 0
    assert phonemes["cold_s"]["median"] > phonemes["warm_s"]["median"] > 0
    for t in report["targets"]:
        if "ratio" in t:
            r = t["ratio"]
            assert math.isclose(r["value"], r["numerator"] / r["denominator"])
        assert isinstance(t["met"], bool)
    text = data.render(report)
    assert "targets" in text and "librosa" in text
    leftover = [p for p in psutil.Process().children(recursive=True)
                if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                and "resource_tracker" not in " ".join(p.cmdline())]
    assert not leftover, leftover
