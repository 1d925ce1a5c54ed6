"""A user's transform for tests/test_gpu_run.py (``transforms.user = tests.gated_user:hold``): every
clip waits until the test opens a gate (creates the file GATE_ENV names), so the run's producers
and trainer are all alive, and the run not over, while the test looks at them."""

from __future__ import annotations

import os
import time
from pathlib import Path

GATE_ENV = "STOKER_TEST_GATE"
GATE_TIMEOUT_S = 120.0
POLL_S = 0.05


def hold(audio, **_):
    """The clip unchanged (None), once the gate is open; an error (the clip rejected) if it never opens."""
    gate = Path(os.environ[GATE_ENV])
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not gate.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test did not open {gate} within {GATE_TIMEOUT_S:.0f} s")
        time.sleep(POLL_S)
    return None
