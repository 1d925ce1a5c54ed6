"""Which GPU each process gets, decided before any TensorFlow is imported.

The launcher lists the GPUs (``nvidia-smi``, or NVML when ``nvidia-ml-py`` is installed),
decides a :class:`DevicePlan` (the mode, the model replicas, the memory split) and gives each
child an environment whose ``CUDA_VISIBLE_DEVICES`` names exactly its GPU, or none
(:func:`child_env`), so the child's TensorFlow sees only its own device, as ``/GPU:0``. Memory
limits are applied inside the child by ``shared/tfsetup.configure_tensorflow``, the only place
TensorFlow is imported for device setup. The modes:

- ``cpu``: no GPU found, or none requested while some device key was given: all on the CPU;
- ``dual-gpu``: producers on ``devices.data_gpu`` (``--data-gpu``), the trainer on
  ``devices.model_gpu`` (``--model-gpu``), different indexes;
- ``single-gpu``: one GPU shared (only one exists, or both keys name the same index): memory is
  split between the trainer and the producers, and stated;
- ``mixed``: one role on a GPU, the other on the CPU (only one key given).

With neither key, stoker picks GPU 0 for the trainer and GPU 1 (or 0, shared) for the producers
when GPUs exist, the CPU otherwise; with only one, the other role runs on the CPU.

Model replicas (``tf.distribute.MirroredStrategy`` in the trainer): ``devices.model_gpu: 1,2,3``
(``--model-gpu 1,2,3``) or ``all`` puts one replica on each GPU named, and the trainer's
``CUDA_VISIBLE_DEVICES`` names them all; ``devices.replicas: N`` (``--replicas N``) alone picks
the first N GPUs, and on a host without GPUs splits the CPU into N logical devices
(shared/tfsetup.py). A memory limit applies to each model GPU alike, since every replica holds
the same model.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from .shared.config import DevicesConfig
from .shared.errors import UserError

log = logging.getLogger(__name__)

# nvidia-smi answers in well under a second; a hung driver must not hang the launcher.
NVIDIA_SMI_TIMEOUT_S = 10.0

# In single-GPU mode producers only run STFTs and matmuls on a few batches: this share
# of the card (split among producers) is ample, and the trainer keeps the rest.
SINGLE_GPU_DATA_SHARE = 0.15
# Headroom left for the CUDA context and cuDNN workspaces of every process on a shared card.
SINGLE_GPU_RESERVE_SHARE = 0.05
# A producer never needs more than this by default, even on a card of its own.
DEFAULT_PRODUCER_MEMORY_MB = 2048


class DeviceError(UserError):
    """A GPU request that cannot be met (no such index, no GPU at all)."""


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_mb: int


@dataclass(frozen=True)
class DevicePlan:
    mode: str  # cpu | single-gpu | dual-gpu | mixed
    data_gpu: int | None
    model_gpu: int | None  # the first model GPU
    data_memory_mb: int | None  # per producer process; None: no limit (CPU or unset)
    model_memory_mb: int | None  # per model GPU
    model_gpus: tuple[int, ...] = ()  # every model GPU, one replica on each (() on the CPU)
    replicas: int = 1  # model replicas: len(model_gpus), or logical CPU devices

    def describe(self, producers: int) -> str:
        replicas = f", {self.replicas} model replicas" if self.replicas > 1 else ""
        if self.mode == "cpu":
            where = f" ({self.replicas} logical devices)" if self.replicas > 1 else ""
            return f"CPU mode: no GPU in use; producers and trainer{where} run on the CPU"
        if self.mode == "single-gpu":
            return (f"single-GPU mode: GPU {self.data_gpu} shared; trainer limited to "
                    f"{self.model_memory_mb} MB, each of {producers} producer(s) to {self.data_memory_mb} MB{replicas}")
        data = "CPU" if self.data_gpu is None else f"GPU {self.data_gpu}"
        model = "CPU" if not self.model_gpus else "GPU " + ",".join(map(str, self.model_gpus))
        return f"{self.mode} mode: producers on {data}, trainer on {model}{replicas}"


def list_gpus() -> list[GpuInfo]:
    """GPUs the driver reports; [] where there is no driver, tool or device."""
    exe = shutil.which("nvidia-smi")
    if exe:
        try:
            out = subprocess.run(
                [exe, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("nvidia-smi failed (%s); assuming no GPU", exc)
            return []
        if out.returncode != 0:
            log.info("nvidia-smi found no usable GPU: %s", out.stderr.strip()[:200])
            return []
        gpus = []
        for line in out.stdout.strip().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3 and parts[0].isdigit():
                mem = int(float(parts[2])) if parts[2].replace(".", "", 1).isdigit() else 0
                gpus.append(GpuInfo(int(parts[0]), parts[1], mem))
        return gpus
    try:
        import pynvml  # nvidia-ml-py, optional
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
        try:
            return [GpuInfo(i, str(pynvml.nvmlDeviceGetName(h)), int(pynvml.nvmlDeviceGetMemoryInfo(h).total >> 20))
                    for i in range(pynvml.nvmlDeviceGetCount())
                    for h in [pynvml.nvmlDeviceGetHandleByIndex(i)]]
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        log.info("NVML found no usable GPU: %s", exc)
        return []


def _check(index: int, key: str, gpus: list[GpuInfo]) -> GpuInfo:
    for gpu in gpus:
        if gpu.index == index:
            return gpu
    if not gpus:
        raise DeviceError(f"{key}: GPU {index} requested, but no GPU is visible on this host "
                          f"(leave {key} unset to run on the CPU)")
    found = ", ".join(f"{g.index} ({g.name})" for g in gpus)
    raise DeviceError(f"{key}: GPU {index}: no such GPU; this host has {len(gpus)}: {found}")


def model_gpu_indexes(value: int | str | None, gpus: list[GpuInfo]) -> tuple[int, ...]:
    """The GPUs ``--model-gpu`` names: one index, a list ``1,2,3`` or ``all``; () for none.
    DeviceError (one line) for a malformed list, an index named twice or one that does not exist."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (_check(value, "devices.model_gpu", gpus).index,)
    text = value.strip()
    if text == "all":
        if not gpus:
            raise DeviceError("devices.model_gpu: all, but no GPU is visible on this host (leave devices.model_gpu unset "
                              "to run on the CPU)")
        return tuple(g.index for g in gpus)
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise DeviceError(f"devices.model_gpu: {value}: expected a GPU index, a list such as 1,2,3, or all")
    indexes = [int(p) for p in parts]
    twice = sorted({i for i in indexes if indexes.count(i) > 1})
    if twice:
        raise DeviceError(f"devices.model_gpu: {value}: GPU {twice[0]} is named twice (one model replica per GPU)")
    return tuple(_check(i, "devices.model_gpu", gpus).index for i in indexes)


def requested_replicas(cfg: DevicesConfig) -> int:
    """The model replicas a config asks for, before the GPUs are checked: ``replicas``, else
    one per GPU of a ``model_gpu`` list (``all``: every GPU here), else 1."""
    if cfg.replicas:
        return cfg.replicas
    if isinstance(cfg.model_gpu, str):
        text = cfg.model_gpu.strip()
        return max(1, len(list_gpus()) if text == "all" else len([p for p in text.split(",") if p.strip()]))
    return 1


def _choose(cfg: DevicesConfig, gpus: list[GpuInfo]) -> tuple[int | None, tuple[int, ...]]:
    """(data GPU, model GPUs) as requested, or chosen when neither flag is given: the first
    GPUs for the model (``--replicas`` of them, else one) and the next one for the
    producers (the first, shared, when there is none left)."""
    data_idx = cfg.data_gpu
    if data_idx is not None:
        _check(data_idx, "devices.data_gpu", gpus)  # the first key is the first named in an error
    model = model_gpu_indexes(cfg.model_gpu, gpus)
    if data_idx is not None or model or not gpus:
        return data_idx, model
    wanted = cfg.replicas or 1
    if wanted > len(gpus):
        found = ", ".join(f"{g.index} ({g.name})" for g in gpus)
        raise DeviceError(f"devices.replicas: {wanted}, but this host has {len(gpus)} GPU(s): {found} (one replica per "
                          f"GPU)")
    model = tuple(g.index for g in gpus[:wanted])
    return (gpus[wanted].index if len(gpus) > wanted else gpus[0].index), model


def plan_devices(cfg: DevicesConfig, gpus: list[GpuInfo], producers: int) -> DevicePlan:
    """Decide each role's GPU(s), memory limit and the model replicas; DeviceError (one line)
    on a bad request."""
    data_idx, model_gpus = _choose(cfg, gpus)
    if model_gpus:
        if cfg.replicas is not None and cfg.replicas != len(model_gpus):
            raise DeviceError(f"devices.replicas: {cfg.replicas} with devices.model_gpu "
                              f"{','.join(map(str, model_gpus))}: on GPUs there is one replica per model GPU "
                              f"({len(model_gpus)}); name {cfg.replicas} GPUs or leave devices.replicas unset")
        replicas = len(model_gpus)
    else:
        replicas = cfg.replicas or 1
    if data_idx is None and not model_gpus:
        return DevicePlan("cpu", None, None, None, None, (), replicas)
    model_idx = model_gpus[0] if model_gpus else None
    if data_idx is not None and data_idx in model_gpus:
        shared = _check(data_idx, "devices.data_gpu", gpus)
        total = shared.memory_mb
        n = max(producers, 1)
        data_mb = cfg.data_gpu_memory_mb or max(256, min(DEFAULT_PRODUCER_MEMORY_MB,
                                                          int(total * SINGLE_GPU_DATA_SHARE / n)))
        model_mb = cfg.model_gpu_memory_mb or int(total * (1 - SINGLE_GPU_RESERVE_SHARE)) - n * data_mb
        if total and model_mb + n * data_mb > total:
            raise DeviceError(f"GPU {shared.index} has {total} MB: trainer {model_mb} MB + "
                              f"{n} x {data_mb} MB for producers does not fit")
        if model_mb <= 0:
            raise DeviceError(f"GPU {shared.index} ({total} MB) leaves no memory for the trainer "
                              f"after {n} x {data_mb} MB for producers")
        return DevicePlan("single-gpu", data_idx, model_idx, data_mb, model_mb, model_gpus, replicas)
    data_mb = None
    if data_idx is not None:
        data_gpu = _check(data_idx, "devices.data_gpu", gpus)
        data_mb = cfg.data_gpu_memory_mb or min(DEFAULT_PRODUCER_MEMORY_MB,
                                                int(data_gpu.memory_mb * 0.9 / max(producers, 1)))
    mode = "dual-gpu" if data_idx is not None and model_gpus else "mixed"
    return DevicePlan(mode, data_idx, model_idx, data_mb, cfg.model_gpu_memory_mb if model_gpus else None,
                      model_gpus, replicas)


def child_env(base: Mapping[str, str], gpu: int | tuple[int, ...] | None,
              import_path: Sequence[str] = ()) -> dict[str, str]:
    """The environment of a child pinned to ``gpu`` (several: a trainer with a replica on
    each; None or (): no GPU visible at all); ``import_path``: directories its PYTHONPATH starts
    with (a stoker.Feed's caller's: shared/proc.caller_path)."""
    env = dict(base)
    gpus = gpu if isinstance(gpu, tuple) else () if gpu is None else (gpu,)
    # An empty value hides every GPU from CUDA, so TensorFlow places everything on the CPU.
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    # Device indexes follow nvidia-smi's order, not CUDA's "fastest first" default.
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    # TensorFlow's C++ INFO/WARNING chatter (cuInit failures on CPU hosts, oneDNN notices)
    # would drown the run's own log; the user can still set it lower.
    # On a CPU-only child, CUDA's "no device" error is expected, so errors are hidden too.
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2" if gpus else "3")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # A user's model module (--model module:function) is found as from the user's shell: on
    # PYTHONPATH or in the current directory, both passed as absolute paths (a child's own
    # path handling must not depend on where it runs).
    paths = [str(Path(p).resolve()) for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*import_path, *paths, os.getcwd()]))
    return env
