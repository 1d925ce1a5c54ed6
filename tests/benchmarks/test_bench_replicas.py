"""The replicas benchmark's runs in a tiny configuration: its figures come from the run files
of real runs (no timing assertions: the machine is noisy)."""

from __future__ import annotations

import pytest

from stoker.benchmarks import replicas

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_a_replicated_run_steps_over_twice_the_rows(tmp_path):
    plan = replicas.ReplicasPlan(steps=replicas.SETTLING_STEPS + 6)
    one = replicas._run("synthetic:5", 1, plan, tmp_path / "one")
    two = replicas._run("synthetic:5", 2, plan, tmp_path / "two")
    for figures in (one, two):
        assert figures["samples_per_s"] > 0 and 0 <= figures["wait_frac"] < 1
        # samples/s over steps/s: the clips of a step, at most the planned rows
        assert figures["samples_per_s"] / figures["steps_per_s"] <= replicas.BATCH_SIZE * (2 if figures is two else 1)
    assert two["samples_per_s"] / two["steps_per_s"] > replicas.BATCH_SIZE  # more than one replica batch a step
