"""benchmarks/staging.py at its smallest: each way staged where it says (none, a stager thread,
the asking thread), every figure a median of its own rounds; no timings judged."""

from __future__ import annotations

import pytest

from stoker.benchmarks import staging


@pytest.mark.timeout(120)
def test_staging_benchmark_structure() -> None:
    pytest.importorskip("torch")
    result = staging.run(rounds=2, steps=staging.WARMUP_STEPS + 4, ops=20, calls=1)
    assert list(result["ways"]) == list(staging.WAYS)
    staged_in = {way: {name for r in rows for name in r["staged_in"]} for way, rows in result["rounds"].items()}
    assert staged_in == {"none": set(), "thread": {"stager"}, "request": {"MainThread"}}
    for way, figures in result["ways"].items():
        steps = [r["step_ms"] for r in result["rounds"][way]]
        assert figures["step_ms"]["n"] == 2 and figures["step_ms"]["median"] == pytest.approx(sum(steps) / 2)
        assert all(v > 0 for v in steps) and figures["between_ms"]["min"] >= 0
    for way in ("thread", "request"):
        vs = result["step_vs_none"][way]
        assert vs["numerator"] == result["ways"][way]["step_ms"]["median"]
        assert vs["denominator"] == result["ways"]["none"]["step_ms"]["median"]
    text = staging.render(result)
    assert "2 rounds of 9 steps, a step of 20 torch ops, 1 calls per array" in text and "request" in text
