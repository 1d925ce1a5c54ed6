"""Tests for stoker/devices.py: GPU discovery, the device plan and child environments."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from stoker import devices
from stoker.shared.config import DevicesConfig
from stoker.devices import DeviceError, DevicePlan, GpuInfo, child_env, list_gpus, plan_devices

pytestmark = pytest.mark.timeout(60)

H100 = 81559
TWO = [GpuInfo(0, "NVIDIA A100", 40960), GpuInfo(1, "NVIDIA H100", H100)]
ONE = [GpuInfo(0, "NVIDIA T4", 15360)]


def _cfg(**kw) -> DevicesConfig:
    return DevicesConfig(**kw)


# --------------------------------------------------------------------------- plan_devices

def test_no_gpu_means_cpu_mode() -> None:
    plan = plan_devices(_cfg(), [], producers=2)
    assert plan == DevicePlan("cpu", None, None, None, None)
    assert "CPU" in plan.describe(2)


def test_requested_index_missing_names_key_and_lists_gpus() -> None:
    with pytest.raises(DeviceError) as info:
        plan_devices(_cfg(data_gpu=5, model_gpu=1), TWO, producers=2)
    text = str(info.value)
    assert text.startswith("devices.data_gpu: GPU 5: no such GPU")
    assert "0 (NVIDIA A100)" in text and "1 (NVIDIA H100)" in text
    with pytest.raises(DeviceError, match="^devices.model_gpu: GPU 2: no such GPU"):
        plan_devices(_cfg(model_gpu=2), TWO, producers=2)


@pytest.mark.parametrize("flag", ["data_gpu", "model_gpu"])
def test_flag_without_any_gpu_says_none_visible(flag: str) -> None:
    with pytest.raises(DeviceError) as info:
        plan_devices(_cfg(**{flag: 0}), [], producers=2)
    text = str(info.value)
    assert text.startswith(f"devices.{flag}: GPU 0 requested, but no GPU is visible on this host")


def test_two_gpus_distinct_flags_is_dual_gpu() -> None:
    plan = plan_devices(_cfg(data_gpu=1, model_gpu=0), TWO, producers=4)
    assert plan.mode == "dual-gpu"
    assert (plan.data_gpu, plan.model_gpu) == (1, 0)
    # Per-producer limit: a share of the data GPU, at most the default producer cap.
    assert plan.data_memory_mb == min(devices.DEFAULT_PRODUCER_MEMORY_MB, int(H100 * 0.9 / 4))
    assert 0 < plan.data_memory_mb * 4 <= H100
    assert plan.model_memory_mb is None  # the trainer's card is its own
    assert plan.describe(4) == "dual-gpu mode: producers on GPU 1, trainer on GPU 0"


def test_dual_gpu_respects_explicit_memory() -> None:
    plan = plan_devices(_cfg(data_gpu=0, model_gpu=1, data_gpu_memory_mb=700, model_gpu_memory_mb=30000),
                        TWO, producers=3)
    assert (plan.data_memory_mb, plan.model_memory_mb) == (700, 30000)


def test_dual_gpu_small_card_many_producers() -> None:
    gpus = [GpuInfo(0, "big", 24000), GpuInfo(1, "small", 4000)]
    plan = plan_devices(_cfg(data_gpu=1, model_gpu=0), gpus, producers=8)
    assert plan.data_memory_mb * 8 <= 4000


@pytest.mark.parametrize("producers", [0, 1, 2, 4, 16])
@pytest.mark.parametrize("gpus", [TWO, ONE], ids=["h100", "t4"])
def test_same_index_twice_is_single_gpu_with_split_memory(producers: int, gpus) -> None:
    index = gpus[-1].index
    total = gpus[-1].memory_mb
    plan = plan_devices(_cfg(data_gpu=index, model_gpu=index), gpus, producers=producers)
    assert plan.mode == "single-gpu"
    assert plan.data_gpu == plan.model_gpu == index
    n = max(producers, 1)
    assert plan.model_memory_mb > 0 and plan.data_memory_mb > 0
    assert plan.model_memory_mb + n * plan.data_memory_mb <= total
    line = plan.describe(producers)
    assert "\n" not in line
    assert line.startswith("single-GPU mode")
    assert f"GPU {index} shared" in line
    assert f"{plan.model_memory_mb} MB" in line and f"{plan.data_memory_mb} MB" in line


def test_single_gpu_explicit_memory_that_does_not_fit() -> None:
    with pytest.raises(DeviceError, match="does not fit"):
        plan_devices(_cfg(data_gpu=0, model_gpu=0, data_gpu_memory_mb=4000, model_gpu_memory_mb=10000),
                     ONE, producers=2)
    plan = plan_devices(_cfg(data_gpu=0, model_gpu=0, data_gpu_memory_mb=1000, model_gpu_memory_mb=10000),
                        ONE, producers=2)
    assert (plan.data_memory_mb, plan.model_memory_mb) == (1000, 10000)


def test_single_gpu_too_small_for_the_producers() -> None:
    with pytest.raises(DeviceError, match="no memory for the trainer"):
        plan_devices(_cfg(data_gpu=0, model_gpu=0), [GpuInfo(0, "tiny", 1000)], producers=8)


def test_one_gpu_and_no_flags_is_single_gpu() -> None:
    plan = plan_devices(_cfg(), ONE, producers=2)
    assert plan.mode == "single-gpu"
    assert plan.data_gpu == plan.model_gpu == 0
    assert plan.model_memory_mb + 2 * plan.data_memory_mb <= ONE[0].memory_mb


def test_two_gpus_and_no_flags_is_dual_gpu() -> None:
    plan = plan_devices(_cfg(), TWO, producers=2)
    assert plan.mode == "dual-gpu"
    assert (plan.model_gpu, plan.data_gpu) == (0, 1)


def test_only_model_gpu_puts_producers_on_cpu() -> None:
    plan = plan_devices(_cfg(model_gpu=1), TWO, producers=2)
    assert plan.model_gpu == 1
    assert plan.data_gpu is None and plan.data_memory_mb is None
    assert plan.mode != "single-gpu" and plan.mode != "dual-gpu"
    assert "producers on CPU" in plan.describe(2) and "trainer on GPU 1" in plan.describe(2)


def test_only_data_gpu_puts_trainer_on_cpu() -> None:
    plan = plan_devices(_cfg(data_gpu=0), TWO, producers=2)
    assert plan.data_gpu == 0 and plan.model_gpu is None and plan.model_memory_mb is None
    assert "trainer on CPU" in plan.describe(2)


# --------------------------------------------------------------------------- child_env

def test_child_env_pins_and_does_not_mutate_base() -> None:
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1"}
    snapshot = dict(base)
    cpu = child_env(base, None)
    gpu = child_env(base, 1)
    assert base == snapshot
    assert cpu["CUDA_VISIBLE_DEVICES"] == ""
    assert gpu["CUDA_VISIBLE_DEVICES"] == "1"
    assert child_env(base, 0)["CUDA_VISIBLE_DEVICES"] == "0"
    for env in (cpu, gpu):
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert env["PATH"] == "/bin"
        assert int(env["TF_CPP_MIN_LOG_LEVEL"]) >= 2  # TensorFlow's C++ chatter hidden by default
    assert cpu is not base


@pytest.mark.parametrize("gpu", [None, 0])
def test_child_env_keeps_user_log_level(gpu) -> None:
    env = child_env({"TF_CPP_MIN_LOG_LEVEL": "0"}, gpu)
    assert env["TF_CPP_MIN_LOG_LEVEL"] == "0"


def test_child_env_accepts_os_environ_without_changing_it(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    before = dict(os.environ)
    env = child_env(os.environ, None)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert dict(os.environ) == before
    assert isinstance(env, dict) and env is not os.environ


# --------------------------------------------------------------------------- list_gpus

def _fake_smi(tmp_path: Path, monkeypatch, body: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + body, encoding="utf-8")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")


def test_list_gpus_without_nvidia_smi(monkeypatch) -> None:
    monkeypatch.setattr(devices.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML fallback either
    assert list_gpus() == []


def test_list_gpus_with_empty_path(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert list_gpus() == []


@pytest.mark.skipif(sys.platform == "win32", reason="shell script")
def test_list_gpus_parses_nvidia_smi_csv(monkeypatch, tmp_path: Path) -> None:
    args_file = tmp_path / "args.txt"
    _fake_smi(tmp_path, monkeypatch,
              f'echo "$@" > "{args_file}"\n'
              'echo "0, NVIDIA H100 80GB HBM3, 81559"\n'
              'echo "1, NVIDIA A10G, 22731.5"\n'
              'echo "2, Some GPU, [N/A]"\n'
              'echo "garbage line"\n'
              'echo ""\n')
    assert list_gpus() == [GpuInfo(0, "NVIDIA H100 80GB HBM3", 81559), GpuInfo(1, "NVIDIA A10G", 22731),
                           GpuInfo(2, "Some GPU", 0)]
    args = args_file.read_text(encoding="utf-8")
    assert "--query-gpu=index,name,memory.total" in args
    assert "--format=csv,noheader,nounits" in args


@pytest.mark.skipif(sys.platform == "win32", reason="shell script")
def test_list_gpus_when_nvidia_smi_fails(monkeypatch, tmp_path: Path) -> None:
    _fake_smi(tmp_path, monkeypatch, 'echo "NVIDIA-SMI has failed" >&2\nexit 9\n')
    assert list_gpus() == []


@pytest.mark.skipif(sys.platform == "win32", reason="shell script")
def test_list_gpus_when_nvidia_smi_hangs(monkeypatch, tmp_path: Path) -> None:
    _fake_smi(tmp_path, monkeypatch, "exec sleep 30\n")
    monkeypatch.setattr(devices, "NVIDIA_SMI_TIMEOUT_S", 0.2)
    assert list_gpus() == []


# --------------------------------------------------------------------------- model replicas

FOUR = [GpuInfo(i, "NVIDIA H100", H100) for i in range(4)]


def test_a_model_gpu_list_or_all_is_a_replica_on_each() -> None:
    plan = plan_devices(_cfg(data_gpu=0, model_gpu="1,2,3"), FOUR, producers=4)
    assert (plan.mode, plan.model_gpus, plan.replicas, plan.model_gpu) == ("dual-gpu", (1, 2, 3), 3, 1)
    assert "trainer on GPU 1,2,3, 3 model replicas" in plan.describe(4)
    everything = plan_devices(_cfg(model_gpu="all"), FOUR, producers=2)
    assert everything.model_gpus == (0, 1, 2, 3) and everything.replicas == 4
    assert child_env({}, plan.model_gpus)["CUDA_VISIBLE_DEVICES"] == "1,2,3"


def test_replicas_alone_take_the_first_gpus_and_on_the_cpu_split_it() -> None:
    plan = plan_devices(_cfg(replicas=2), FOUR, producers=2)
    assert (plan.model_gpus, plan.data_gpu, plan.replicas) == ((0, 1), 2, 2)
    cpu = plan_devices(_cfg(replicas=3), [], producers=2)
    assert (cpu.mode, cpu.model_gpus, cpu.replicas) == ("cpu", (), 3)
    assert "3 logical devices" in cpu.describe(2)
    assert child_env({}, cpu.model_gpus)["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.parametrize(("given", "gpus", "says"), [
    (dict(model_gpu="1,1"), FOUR, "devices.model_gpu: 1,1: GPU 1 is named twice"),
    (dict(model_gpu="1,7"), FOUR, "devices.model_gpu: GPU 7: no such GPU; this host has 4"),
    (dict(model_gpu="1;2"), FOUR, "devices.model_gpu: 1;2: expected a GPU index, a list such as 1,2,3, or all"),
    (dict(model_gpu="all"), [], "devices.model_gpu: all, but no GPU is visible on this host"),
    (dict(model_gpu="0,1", replicas=3), FOUR, "devices.replicas: 3 with devices.model_gpu 0,1: on GPUs there is one replica "
                                              "per model GPU (2)"),
    (dict(replicas=5), FOUR, "devices.replicas: 5, but this host has 4 GPU(s)"),
])
def test_a_bad_replica_request_is_one_line(given, gpus, says) -> None:
    with pytest.raises(DeviceError) as info:
        plan_devices(_cfg(**given), gpus, producers=2)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_the_default_producers_are_per_replica_and_a_given_count_is_kept() -> None:
    from stoker.service import resolve

    def producers(**overrides) -> int:
        return resolve(None, overrides).pipeline.producers

    one = producers()
    assert producers(**{"devices.replicas": 3}) == 3 * one and producers(**{"devices.model_gpu": "1,2"}) == 2 * one
    assert producers(**{"devices.replicas": 3, "pipeline.producers": 1}) == 1
    assert devices.requested_replicas(_cfg(model_gpu=1)) == 1
