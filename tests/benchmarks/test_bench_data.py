"""Smoke test of benchmarks/data.py in a tiny configuration: structure, and what each timed
build did (one repetition on a busy host says nothing about which is faster), not timings."""

from __future__ import annotations

import math

import psutil
import pytest

from stoker.benchmarks import data

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_tiny_data_benchmark_reports_every_figure_and_target(tmp_path, monkeypatch):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    builds: dict[tuple[str, str], list[dict]] = {}  # what each index build it timed did, by dataset and front-end
    timed = data._timed_index

    def recorded(root, cache_dir, workers, frontend="characters"):
        seconds, stats = timed(root, cache_dir, workers, frontend)
        builds.setdefault((root.name, frontend), []).append(stats)
        return seconds, stats

    monkeypatch.setattr(data, "_timed_index", recorded)
    plan = data.DataPlan(index_sizes=[data.LJSPEECH_ITEMS // 40, data.LJSPEECH_ITEMS // 20], index_repetitions=1,
                         clips=6, repetitions=1, variants=["stoker", "librosa", "stoker-warm", "stoker-shards",
                                                               "stoker-parquet"],
                         default_threads=False)
    report = data.run(plan, workdir=tmp_path, log=lambda line: None)
    rows = report["index"]["rows"]
    assert [r["items"] for r in rows] == plan.index_sizes
    for r in rows:  # each timing is of the build it names: cold read every header, warm none (the cache's)
        assert r["cold_s"]["median"] > 0 and r["warm_s"]["median"] > 0
        cold, warm = builds[(f"index-{r['items']}", "characters")]
        assert (cold["cache"], cold["headers_read"]) == ("miss", r["items"]), cold
        assert (warm["cache"], warm["headers_read"]) == ("hit", 0), warm
    variants = report["producer"]["threads"]["1"]
    assert set(variants) == {"stoker", "librosa", "stoker-warm", "stoker-shards", "stoker-parquet"}
    assert variants["stoker"]["backend"] == "numpy"  # auto on a machine without a GPU for this process
    assert variants["stoker-warm"]["cache"]["hits"] == plan.clips
    targets = {(t["section"], t["what"]) for t in report["targets"]}
    assert len(targets) == 10 and ("producer", "producer clips/s from tar shards >= 0.9 x from loose files") in targets
    assert ("producer", "producer clips/s from Parquet >= 0.9 x from loose files") in targets
    phonemes = report["index"]["phonemes"]
    assert phonemes["sentences"] == plan.index_sizes[0] and phonemes["sentences_per_s_per_core"] > 0
    assert phonemes["cold_s"]["median"] > 0 and phonemes["warm_s"]["median"] > 0
    phoneme_builds = builds[(f"index-{plan.index_sizes[0]}", "phonemes")]  # each repetition: 1 core, all, warm
    assert len(phoneme_builds) == 3 * plan.phoneme_repetitions
    for one_core, cold, warm in zip(*[iter(phoneme_builds)] * 3):
        assert [b["cache"] for b in (one_core, cold, warm)] == ["miss", "miss", "hit"] and one_core["workers"] == 1
        assert one_core["texts_tokenized"] == cold["texts_tokenized"] == plan.index_sizes[0]  # cold: every text
        assert warm["texts_tokenized"] == 0  # warm: the cache's units
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
