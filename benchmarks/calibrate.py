"""The GPU benchmark's model sized to a step time on the device at hand (benchmarks/gpu.py).

A step's time on a GPU depends on the GPU: a launch-bound step grows with the model's depth (the
kernels launched), a compute-bound one with its width, and by how much differs from an H100 to an
H200. So each size names the step it aims at and the one dimension that moves it, and
:func:`search` finds that dimension on the device before the three ways run: doubling or halving
until the aim lies between two measured values, then bisecting. A step's time is taken to grow
with the dimension; noise only makes the pick one of the nearer values measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

# Measurements per size at most (each a model built and a few steps timed on the device).
MAX_TRIES = 8


@dataclass(frozen=True)
class Aim:
    """What a model size aims at on a GPU: ``step_ms``, reached by changing ModelSize's ``field``
    within ``[lo, hi]`` in multiples of ``grain``."""

    step_ms: float
    field: str
    lo: int
    hi: int
    grain: int = 1

    def clamp(self, value: float) -> int:
        return int(min(self.hi, max(self.lo, round(value / self.grain) * self.grain)))


def search(measure: Callable[[int], float], start: int, aim: Aim,
           tries: int = MAX_TRIES) -> tuple[int, list[tuple[int, float]]]:
    """The value of ``aim.field`` whose measured step (``measure(value)``, ms) is nearest
    ``aim.step_ms`` as a ratio, and every (value, ms) measured on the way, in order."""
    trail: list[tuple[int, float]] = []
    below: int | None = None  # the largest value measured under the aim
    above: int | None = None  # the smallest value measured at or over it
    value = aim.clamp(start)
    while True:
        ms = measure(value)
        trail.append((value, ms))
        if ms < aim.step_ms:
            below = value
        else:
            above = value
        if len(trail) >= tries:
            break
        if above is None:
            value = aim.clamp(below * 2)  # type: ignore[operator]  # below is set: the first value was under
        elif below is None:
            value = aim.clamp(above / 2)
        else:
            value = aim.clamp((below + above) / 2)
        if value in (below, above):  # at an end of the range, or nothing left between the two
            break
    best = min(trail, key=lambda pair: abs(math.log(pair[1] / aim.step_ms)))
    return best[0], trail


__all__ = ["Aim", "MAX_TRIES", "search"]
