"""benchmarks/feedstep.py at its smallest: the report's structure, each figure from its
children's own measurements; no timings judged."""

from __future__ import annotations

import pytest

from stoker.benchmarks import feedstep
from stoker.shared.proc import PACKAGE_PARENT

pytestmark = pytest.mark.slow  # processes: not a unit test


@pytest.mark.timeout(300)
def test_feedstep_benchmark_structure() -> None:
    result = feedstep.run(("numpy",), (8,), repeats=1, steps=8, clips=16, hold_ms=1.0, budget=10,
                          trees=[PACKAGE_PARENT], log=lambda text: None)
    (key,) = result["feed"]
    assert key == f"{PACKAGE_PARENT}|numpy|8"
    (figures,) = result["feed"][key]
    assert figures["steps"] == 8 - feedstep.WARMUP_STEPS
    assert 0 < figures["feed_us_median"] and 0 < figures["feed_us_mean"] and figures["other_threads_us"] >= 0
    assert list(result["position"]) == [f"{PACKAGE_PARENT}|8"] and result["position"][f"{PACKAGE_PARENT}|8"][0] > 0
    text = feedstep.render(result)
    assert "the first 8 steps of a run of 10 epochs" in text and "µs per batch" in text
