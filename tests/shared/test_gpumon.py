"""The NVML sampler against a fake NVML module."""

from __future__ import annotations

import json
import threading
import types

import pytest

from stoker.shared.gpumon import GpuSampler

pytestmark = pytest.mark.timeout(30)


class FakeNvml(types.ModuleType):
    class NVMLError(Exception):
        pass

    def __init__(self, utils: dict[int, list[int]], fail_init: bool = False) -> None:
        super().__init__("pynvml")
        self.utils = utils
        self.fail_init = fail_init
        self.calls: dict[int, int] = {i: 0 for i in utils}
        self.enough = threading.Event()
        self.shutdown = False

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index not in self.utils:
            raise self.NVMLError("Invalid Argument")
        return index

    def nvmlDeviceGetUtilizationRates(self, handle: int):
        series = self.utils[handle]
        value = series[min(self.calls[handle], len(series) - 1)]
        self.calls[handle] += 1
        if all(c >= 5 for c in self.calls.values()):
            self.enough.set()
        return types.SimpleNamespace(gpu=value, memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int):
        return types.SimpleNamespace(used=(1000 + handle) << 20, total=80000 << 20, free=0)


def test_samples_both_gpus_into_gpu_jsonl(tmp_path):
    nvml = FakeNvml({0: [10, 20, 30, 40, 50, 60], 1: [90, 80, 70, 60, 50, 40]})
    sampler = GpuSampler({"data": 0, "model": 1}, tmp_path, nvml=nvml, interval_s=0.001)
    assert sampler.start()
    assert nvml.enough.wait(10)
    sampler.stop()
    rows = [json.loads(line) for line in (tmp_path / "gpu.jsonl").read_text().splitlines()]
    data = [r for r in rows if r["role"] == "data"]
    model = [r for r in rows if r["role"] == "model"]
    assert [r["util"] for r in data[:5]] == [10, 20, 30, 40, 50]
    assert [r["util"] for r in model[:5]] == [90, 80, 70, 60, 50]
    assert {r["gpu"] for r in data} == {0} and model[0]["mem_used_mb"] == 1001 and model[0]["mem_total_mb"] == 80000
    assert nvml.shutdown


def test_without_nvml_one_line_and_nothing_else(tmp_path, caplog):
    caplog.set_level("INFO")
    sampler = GpuSampler({"model": 0}, tmp_path, nvml=FakeNvml({0: [1]}, fail_init=True))
    assert not sampler.start()
    assert not (tmp_path / "gpu.jsonl").exists()
    lines = [r for r in caplog.records if "GPU utilisation not recorded" in r.getMessage()]
    assert len(lines) == 1 and "Driver Not Loaded" in lines[0].getMessage()
    sampler.stop()


def test_no_gpus_in_use_starts_nothing(tmp_path):
    assert not GpuSampler({}, tmp_path, nvml=FakeNvml({})).start()


def test_diagnose_reports_recorded_utilisation(tmp_path):
    from stoker.diagnose import gpu_report

    rows = [{"t": i / 10, "role": "model", "gpu": 1, "util": u, "mem_used_mb": 100, "mem_total_mb": 1000}
            for i, u in enumerate([0, 100, 0, 100])]
    (tmp_path / "gpu.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    report = gpu_report(tmp_path)
    assert report["model"]["util_mean"] == 50.0 and report["model"]["gpu"] == 1
