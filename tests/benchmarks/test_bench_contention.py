"""benchmarks/contention.py's neighbour: the pipeline's load beside another process's step, steady
before the step starts and gone when it ends; no timings judged."""

from __future__ import annotations

import json

import pytest

from stoker.benchmarks import contention, feedstep
from stoker.benchmarks.common import BenchError
from stoker.benchmarks.corpus import make_clips

pytestmark = pytest.mark.slow  # processes: not a unit test


def _spec(tmp_path, **changes) -> dict:
    return {"kind": "feed", "neighbour": True, "framework": "numpy", "data": str(tmp_path / "clips"),
            "batch_size": 4, "budget": contention.NEIGHBOUR_EPOCHS, "hold_ms": 1.0, "steps": 0,
            "work": str(tmp_path / "neighbour"), **changes}


@pytest.mark.timeout(240)
def test_a_neighbour_feed_is_steady_when_entered_and_stops_when_left(tmp_path) -> None:
    make_clips(tmp_path / "clips", 12)
    with contention.neighbour_feed(_spec(tmp_path), tmp_path / "neighbour.log") as proc:
        assert proc.poll() is None  # it trains on, past its warm-up steps, until told to stop
    assert proc.returncode == 0
    # its run ended on the stop, after its warm-up steps, not at the end of its budget (3 steps an epoch)
    summary = json.loads((tmp_path / "neighbour" / "run" / "summary.json").read_text())
    assert feedstep.WARMUP_STEPS <= summary["steps"] < 3 * contention.NEIGHBOUR_EPOCHS


@pytest.mark.timeout(240)
def test_a_neighbour_that_fails_before_its_steady_load_says_so(tmp_path) -> None:
    with pytest.raises(BenchError, match="ended .*before its steady load"):
        with contention.neighbour_feed(_spec(tmp_path, data=str(tmp_path / "missing")), tmp_path / "n.log"):
            pass
    assert feedstep.STEADY_LINE not in (tmp_path / "n.log").read_text()
