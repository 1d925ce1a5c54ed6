"""A GPU host's real devices, for the tests marked ``gpu``: NVML's view of them from the test
process (by NVML index, which ignores CUDA_VISIBLE_DEVICES, as stoker's sampler does) and a
CUDA workload in a child pinned the launcher's way. CUDA work runs with PyTorch, else CuPy;
nothing here imports TensorFlow (the GPU host has none)."""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

from stoker.devices import child_env

# The CUDA libraries a child may use, in the order they are tried.
CUDA_LIBRARIES = ("torch", "cupy")
# The workload's ballast: memory it holds on the device besides its matrices, so that NVML's
# "used" is seen to cover an allocation of a known size.
BALLAST_BYTES = 1 << 30
# The workload's square matrices: each product is a few milliseconds of one GPU's kernels.
MATRIX_SIZE = 4096
# Importing PyTorch and creating a CUDA context take seconds; a cold host's first one longer.
CHILD_START_S = 120.0
CHILD_STOP_S = 30.0


def jax_with_cuda() -> bool:
    """JAX and a CUDA plugin of it (jax_cuda13_plugin, jax_cuda12_plugin: whichever CUDA the host has)."""
    return importlib.util.find_spec("jax") is not None and any(
        m.name.startswith("jax_cuda") and m.name.endswith("_plugin") for m in pkgutil.iter_modules())


@dataclass(frozen=True)
class NvmlGpu:
    index: int
    name: str
    pci: tuple[int, int, int]  # (domain, bus, device): where CUDA places the same card
    uuid: str
    memory_total_mb: int


def nvml_text(value: str | bytes) -> str:
    """An NVML string: nvidia-ml-py 11.515 and later give str, older versions bytes."""
    return value.decode() if isinstance(value, bytes) else value


def nvml_gpus() -> list[NvmlGpu]:
    """Every GPU NVML sees, by index."""
    import pynvml

    pynvml.nvmlInit()
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pci = pynvml.nvmlDeviceGetPciInfo(handle)
            gpus.append(NvmlGpu(index, nvml_text(pynvml.nvmlDeviceGetName(handle)),
                                (int(pci.domain), int(pci.bus), int(pci.device)),
                                nvml_text(pynvml.nvmlDeviceGetUUID(handle)),
                                int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) >> 20))
        return gpus
    finally:
        pynvml.nvmlShutdown()


def cuda_library() -> str:
    """The library a CUDA child uses (PyTorch, else CuPy); the test is skipped where neither is."""
    for name in CUDA_LIBRARIES:
        if importlib.util.find_spec(name) is not None:
            return name
    pytest.skip("neither PyTorch nor CuPy is installed: no CUDA work can run in a child")


# Matrix products on CUDA device 0 until stdin closes; the first line says it is running and
# how many bytes it holds on the device (after the ballast and the matrices are allocated).
WORKLOAD = """\
import sys, threading
library, ballast_bytes, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
stopped = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stopped.set()), daemon=True).start()
if library == "torch":
    import torch
    ballast = torch.ones(ballast_bytes // 4, dtype=torch.float32, device="cuda")
    a = torch.rand(n, n, dtype=torch.float32, device="cuda")
    b = torch.rand(n, n, dtype=torch.float32, device="cuda")
    sync, held = torch.cuda.synchronize, torch.cuda.memory_allocated
else:
    import cupy
    ballast = cupy.ones(ballast_bytes // 4, dtype=cupy.float32)
    a = cupy.random.rand(n, n, dtype=cupy.float32)
    b = cupy.random.rand(n, n, dtype=cupy.float32)
    sync, held = cupy.cuda.Device().synchronize, cupy.get_default_memory_pool().used_bytes
c = a @ b
sync()
print("running", held(), flush=True)
while not stopped.is_set():
    for _ in range(16):
        c = a @ b
    sync()
"""


class CudaWorkload:
    """A child pinned to ``gpu`` (:func:`stoker.devices.child_env`, as the launcher pins its
    children) running matrix products on it until :meth:`stop`; its stderr goes to ``log``."""

    def __init__(self, gpu: int, log: Path) -> None:
        self.log = log
        self._stderr: IO[str] = open(log, "w", encoding="utf-8")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKLOAD, cuda_library(), str(BALLAST_BYTES), str(MATRIX_SIZE)],
            env=child_env(os.environ, gpu), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, text=True)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put("")  # end of output: the child is gone

    def running(self) -> int:
        """Wait until the products run; the bytes the child holds on the device."""
        try:
            line = self._lines.get(timeout=CHILD_START_S)
        except queue.Empty:
            raise AssertionError(f"the CUDA workload did not start within {CHILD_START_S:.0f} s") from None
        if not line.startswith("running "):
            self.proc.wait(timeout=CHILD_STOP_S)
            raise AssertionError(f"the CUDA workload stopped (status {self.proc.returncode}):\n"
                                 + self.log.read_text(encoding="utf-8")[-3000:])
        return int(line.split()[1])

    def stop(self) -> int:
        """Close its stdin (it stops after its current products), wait for it; its exit status."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.close()
            return self.proc.wait(timeout=CHILD_STOP_S)
        except (subprocess.TimeoutExpired, BrokenPipeError):
            self.proc.kill()
            return self.proc.wait(timeout=CHILD_STOP_S)
        finally:
            self._stderr.close()

    def __enter__(self) -> "CudaWorkload":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc.poll() is None:
            self.stop()
        self._stderr.close()
