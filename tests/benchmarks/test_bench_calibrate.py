"""benchmarks/calibrate.py: the search for the model dimension that gives a step its aimed time,
against step-time curves given as functions (a launch-bound one linear in depth, a compute-bound
one with a floor, quadratic in width), so that each pick and each measurement can be checked."""

from __future__ import annotations

import math

import pytest

from stoker.benchmarks.calibrate import MAX_TRIES, Aim, search

DEPTH = Aim(step_ms=15.0, field="decoder_layers", lo=1, hi=64)
WIDTH = Aim(step_ms=50.0, field="dim", lo=256, hi=3072, grain=64)


def launch_bound(depth: int) -> float:
    return 6.0 + 0.4 * depth  # 15 ms at 22.5 blocks


def compute_bound(dim: int) -> float:
    return max(18.0, 1.2e-5 * dim**2)  # launch-bound until ~1225, 50 ms at ~2041


def nearest(curve, aim: Aim) -> int:
    """Every allowed value's step, the one nearest the aim as a ratio (what the search should find)."""
    values = range(aim.lo, aim.hi + 1, aim.grain) if aim.lo % aim.grain == 0 else range(aim.lo, aim.hi + 1)
    return min(values, key=lambda v: abs(math.log(curve(v) / aim.step_ms)))


@pytest.mark.parametrize(("curve", "aim", "start"), [
    (launch_bound, DEPTH, 2), (launch_bound, DEPTH, 64), (launch_bound, DEPTH, 1),
    (compute_bound, WIDTH, 512), (compute_bound, WIDTH, 3072), (compute_bound, WIDTH, 256),
])
def test_finds_the_value_nearest_the_aim(curve, aim: Aim, start: int) -> None:
    measured: list[int] = []

    def measure(value: int) -> float:
        measured.append(value)
        return curve(value)

    value, trail = search(measure, start, aim)
    # bisection over this range finds the nearest whole value within MAX_TRIES, or one grain off it
    assert abs(value - nearest(curve, aim)) <= aim.grain
    assert abs(math.log(curve(value) / aim.step_ms)) < 0.05
    assert [v for v, _ in trail] == measured and [ms for _, ms in trail] == [curve(v) for v in measured]
    assert len(measured) <= MAX_TRIES and len(set(measured)) == len(measured)  # nothing measured twice
    assert all(aim.lo <= v <= aim.hi and v % aim.grain == 0 for v in measured)
    assert value in measured


def test_an_aim_out_of_reach_stops_at_the_end_of_the_range() -> None:
    value, trail = search(compute_bound, 512, Aim(step_ms=5_000.0, field="dim", lo=256, hi=3072, grain=64))
    assert value == 3072 and [v for v, _ in trail] == [512, 1024, 2048, 3072]
    value, trail = search(launch_bound, 8, Aim(step_ms=1.0, field="decoder_layers", lo=1, hi=64))
    assert value == 1 and [v for v, _ in trail] == [8, 4, 2, 1]


def test_it_measures_at_most_the_tries_given() -> None:
    value, trail = search(lambda depth: 10.0 + depth * 1e-3, 1, Aim(step_ms=15.0, field="d", lo=1, hi=10_000), tries=3)
    assert [v for v, _ in trail] == [1, 2, 4] and value == 4


def test_clamp_keeps_the_range_and_the_grain() -> None:
    assert [WIDTH.clamp(v) for v in (0, 100, 700, 740, 5000)] == [256, 256, 704, 768, 3072]
    assert [DEPTH.clamp(v) for v in (0, 1.4, 1.5, 2.5, 99)] == [1, 1, 2, 2, 64]
