"""The GPU sampler (shared/gpumon.py) on a real GPU: with the real NVML it records what a CUDA
workload does to device 0 (tests/shared/test_gpumon.py tests it against a fake NVML)."""

from __future__ import annotations

import json
import time

import pytest

from stoker.shared.gpumon import GpuSampler
from tests.gpus import CudaWorkload, nvml_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(300)]

INTERVAL_S = 0.05
# Samples taken while the workload runs: each waits INTERVAL_S after the previous, so they span
# at least 3 s, many times NVML's utilisation period (1/6 s to 1 s, by card).
SAMPLES = 60
SAMPLES_WITHIN_S = 60.0


def test_sampler_sees_a_busy_gpu_and_the_memory_its_workload_holds(tmp_path):
    """What a user reads in gpu.jsonl is NVML's: device 0 busy, its memory holding the workload."""
    total_mb = nvml_gpus()[0].memory_total_mb
    with CudaWorkload(0, tmp_path / "workload.log") as work:
        held = work.running()
        sampler = GpuSampler({"data": 0}, tmp_path, interval_s=INTERVAL_S)  # no nvml given: the real pynvml
        assert sampler.start()
        try:
            deadline = time.monotonic() + SAMPLES_WITHIN_S
            while sampler.samples < SAMPLES and time.monotonic() < deadline:
                time.sleep(INTERVAL_S)  # a poll of the count, bounded by the deadline
        finally:
            sampler.stop()
        assert work.proc.poll() is None, "the workload ended while it was being sampled"
        assert work.stop() == 0, work.log.read_text()[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "gpu.jsonl").read_text().splitlines()]
    assert len(rows) >= SAMPLES, f"{len(rows)} samples in {SAMPLES_WITHIN_S:.0f} s"
    assert {(r["role"], r["gpu"], r["mem_total_mb"]) for r in rows} == {("data", 0, total_mb)}
    assert max(r["util"] for r in rows) > 0, [r["util"] for r in rows]
    assert all(0 <= r["util"] <= 100 for r in rows)
    assert held >= 1 << 30  # the ballast, at least
    assert max(r["mem_used_mb"] for r in rows) >= held >> 20, (held, [r["mem_used_mb"] for r in rows])
