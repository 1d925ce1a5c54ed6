"""stoker/devices.py and the launcher's pinning on a real GPU host: discovery lists the GPUs NVML
sees, and a child the launcher starts pinned to a GPU sees that card and no other, one pinned
to none sees no GPU (tests/stoker/test_devices.py tests them against a fake nvidia-smi)."""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from stoker.devices import DevicePlan, list_gpus
from stoker.launcher import Child, Supervisor
from tests.gpus import CHILD_START_S, cuda_library, nvml_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(300)]


def test_nvidia_smi_lists_the_gpus_nvml_sees() -> None:
    """The launcher plans on nvidia-smi's list when it is there: the same cards as NVML's, by index."""
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is not on PATH here: discovery asks NVML (the next test)")
    gpus = list_gpus()
    assert [(g.index, g.name) for g in gpus] == [(g.index, g.name) for g in nvml_gpus()]
    assert all(g.memory_mb > 0 for g in gpus)  # the single-GPU plan splits this memory


def test_without_nvidia_smi_discovery_asks_nvml(monkeypatch) -> None:
    """Without nvidia-smi on PATH, discovery reads NVML itself: the same count, names and memory."""
    monkeypatch.setenv("PATH", "")
    assert shutil.which("nvidia-smi") is None
    assert [(g.index, g.name, g.memory_mb) for g in list_gpus()] == \
        [(g.index, g.name, g.memory_total_mb) for g in nvml_gpus()]


def launched_child_sees(gpu: int | None) -> dict[str, Any]:
    """What a child started by the launcher's Supervisor, pinned to ``gpu``, reports of CUDA."""
    sup = Supervisor(DevicePlan("cpu", None, None, None, None))
    child = sup.spawn(Child("producer", "probe", ["tests.stoker.cuda_probe", "--library", cuda_library()], gpu))
    try:
        sup.wait([child], CHILD_START_S)
        sup.poll_status(0)  # what it wrote just before it exited
        assert child.proc.poll() == 0, f"the probe did not finish (status {child.proc.poll()})"
    finally:
        sup.cleanup()
    reports = [e for e in child.events if e.get("event") == "devices"]
    assert len(reports) == 1, child.events
    return reports[0]


def test_a_child_pinned_to_a_gpu_sees_exactly_that_card() -> None:
    """The last GPU (on a host of several, not CUDA's default device 0) is the child's only one."""
    chosen = nvml_gpus()[-1]
    seen = launched_child_sees(chosen.index)
    assert seen["visible"] == str(chosen.index)
    assert len(seen["devices"]) == 1, seen
    device = seen["devices"][0]
    if device["pci"] is not None:
        assert tuple(device["pci"]) == chosen.pci, (device, chosen)
    else:  # a PyTorch without the PCI ids: the card's UUID names it as well
        assert device["uuid"] is not None, device
        assert device["uuid"].lower().removeprefix("gpu-") == chosen.uuid.lower().removeprefix("gpu-"), \
            (device, chosen)


def test_a_child_pinned_to_no_gpu_sees_none() -> None:
    """The CPU roles of a plan (a producer with no --data-gpu) get no GPU at all."""
    seen = launched_child_sees(None)
    assert seen["visible"] == ""
    assert seen["devices"] == []
