"""Checks the benchmark tests share."""

from __future__ import annotations

import math


def assert_ratio(r: dict) -> None:
    assert r["numerator"] > 0 and r["denominator"] > 0
    assert math.isclose(r["value"], r["numerator"] / r["denominator"], rel_tol=1e-12)
