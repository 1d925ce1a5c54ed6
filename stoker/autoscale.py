"""``--producers auto``: add local producers while the trainer starves, remove idle ones.

The launcher reads the consumer's ``live.json`` once per DECISION_INTERVAL_S and asks
:class:`AutoScaler` for a decision, logged with its evidence. The rules and their hysteresis:
docs/design/starvation.md.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .shared.metrics import HOST_BUSY_FRAC, PRODUCER_MARGIN
from .shared.runfiles import LIVE

log = logging.getLogger("launcher.autoscale")

# Decisions are taken on windows this long: several steps, and longer than live.json's
# one-second refresh.
DECISION_INTERVAL_S = 3.0
ADD_WAIT_FRAC = 0.05  # as the verdict's bound: more than this is starving
ADD_STREAK = 2
REMOVE_WAIT_FRAC = 0.01
REMOVE_BLOCKED_FRAC = 0.5
REMOVE_STREAK = 3
# A window with fewer steps says too little to act on.
MIN_WINDOW_STEPS = 4


@dataclass
class Evidence:
    wait_frac: float
    queue_depth_mean: float
    blocked_frac: float | None  # producers' time holding a ready batch / (that + preparing)
    steps: int
    cpu_busy_frac: float
    producers_delivering: int
    prep_ms_mean: float | None = None  # producers' time to prepare a batch, in the window
    step_ms_mean: float | None = None  # the trainer's step time, in the window

    def describe(self) -> str:
        blocked = "n/a" if self.blocked_frac is None else f"{100 * self.blocked_frac:.0f}%"
        return (f"wait {100 * self.wait_frac:.1f}%, queue mean {self.queue_depth_mean:.2f}, producers blocked on "
                f"credits {blocked}, CPU busy {100 * self.cpu_busy_frac:.0f}%, {self.steps} steps")


class AutoScaler:
    def __init__(self, max_producers: int, capacity: int) -> None:
        self.max_producers = max_producers
        self.capacity = capacity
        self.starved_at = 0  # highest count seen starving
        self._add_streak = 0
        self._remove_streak = 0
        self._last_stay = ""
        self.decisions: list[dict[str, Any]] = []

    def decide(self, count: int, ev: Evidence) -> int:
        """+1, -1 or 0 for a window's evidence."""
        if ev.steps < MIN_WINDOW_STEPS or ev.producers_delivering < count:
            return 0
        starving = ev.wait_frac > ADD_WAIT_FRAC
        idle = (ev.wait_frac < REMOVE_WAIT_FRAC and ev.queue_depth_mean >= self.capacity - 1
                and ev.blocked_frac is not None and ev.blocked_frac > REMOVE_BLOCKED_FRAC)
        self._add_streak = self._add_streak + 1 if starving else 0
        self._remove_streak = self._remove_streak + 1 if idle else 0
        if starving:
            self.starved_at = max(self.starved_at, count)
        change = 0
        if self._add_streak >= ADD_STREAK:
            if count >= self.max_producers:
                reason = f"starving but at the maximum of {self.max_producers} producers"
            elif ev.cpu_busy_frac > HOST_BUSY_FRAC:
                reason = "starving but the host has no free core"
            else:
                # Jump to what the evidence says is needed (the diagnosis' demand / rate
                # formula), at least one more; later windows correct an over- or undershoot.
                change, reason = 1, "the trainer starves"
                if ev.prep_ms_mean and ev.step_ms_mean:
                    needed = math.ceil(PRODUCER_MARGIN * ev.prep_ms_mean / ev.step_ms_mean)
                    change = max(1, min(needed, self.max_producers) - count)
                    reason += f" (about {needed} needed: {ev.prep_ms_mean:.0f} ms per batch, step {ev.step_ms_mean:.0f} ms)"
        elif self._remove_streak >= REMOVE_STREAK and count > 1 and count - 1 > self.starved_at:
            change, reason = -1, "producers mostly wait for credits"
        else:
            return 0
        self._add_streak = self._remove_streak = 0
        if change:
            log.info("auto producers: %d -> %d: %s (%s)", count, count + change, reason, ev.describe())
        elif reason != self._last_stay:
            log.info("auto producers: stay at %d: %s (%s)", count, reason, ev.describe())
        self._last_stay = "" if change else reason
        if change or not self.decisions or self.decisions[-1]["reason"] != reason:
            self.decisions.append({"count": count, "change": change, "reason": reason, "evidence": ev.describe()})
        return change


class LiveWindow:
    """Evidence over the time between two readings of live.json."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LIVE
        self._last: dict[str, tuple[int, float, float]] = {}

    def read(self, cpu_busy_frac: float) -> Evidence | None:
        try:
            live = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        w = live.get("window") or {}
        if w.get("wait_frac") is None:
            return None
        prep_total = credit_total = 0.0
        delivering = delivered = 0
        current = {}
        for p in live.get("producers", []):
            if p.get("status") != "alive":
                continue
            batches = int(p.get("batches") or 0)
            prep = float(p.get("prep_ms_mean") or 0.0) * batches
            credit = float(p.get("credit_wait_ms_mean") or 0.0) * batches
            current[p["id"]] = (batches, prep, credit)
            before = self._last.get(p["id"], (0, 0.0, 0.0))
            if batches > before[0]:
                delivering += 1
                delivered += batches - before[0]
                prep_total += prep - before[1]
                credit_total += credit - before[2]
        self._last = current
        blocked = credit_total / (credit_total + prep_total) if credit_total + prep_total > 0 else None
        return Evidence(float(w["wait_frac"]), float(w.get("queue_depth_mean") or 0.0), blocked,
                        int(w.get("steps") or 0), cpu_busy_frac, delivering,
                        prep_total / delivered if delivered else None, w.get("step_ms_mean"))


def default_max_producers() -> int:
    return max(1, (os.cpu_count() or 1))
