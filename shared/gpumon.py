"""GPU utilisation sampling through NVML (nvidia-ml-py), into ``gpu.jsonl``.

The consumer starts a :class:`GpuSampler` for the data and model GPUs (by their NVML
index, which ignores CUDA_VISIBLE_DEVICES). It reads utilisation and memory about
every SAMPLE_INTERVAL_S and appends ``{"t", "role", "gpu", "util", "mem_used_mb",
"mem_total_mb"}`` rows. Without NVML (package missing, no driver, no device), one log
line says so and nothing else changes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from .runfiles import GPU, file_error

log = logging.getLogger(__name__)

# ~10 Hz: fast enough to see a GPU oscillating between steps of ~100 ms, and NVML
# queries cost a few microseconds each.
SAMPLE_INTERVAL_S = 0.1
# Rows are flushed to disk this often, not at every sample.
FLUSH_EVERY = 20


def load_nvml() -> ModuleType | None:
    try:
        import pynvml  # optional: the gpu extra installs it
    except ImportError:
        log.info("GPU utilisation not recorded: nvidia-ml-py is not installed")
        return None
    return pynvml


class GpuSampler:
    def __init__(self, gpus: dict[str, int], run_dir: Path, nvml: ModuleType | None = None,
                 interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.gpus = gpus
        self.path = run_dir / GPU
        self.nvml = nvml
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples = 0

    def start(self) -> bool:
        """Start sampling; False (with one log line) where NVML cannot be used."""
        if not self.gpus:
            return False
        nvml = self.nvml or load_nvml()
        if nvml is None:
            return False
        try:
            nvml.nvmlInit()
            handles = {role: (index, nvml.nvmlDeviceGetHandleByIndex(index)) for role, index in self.gpus.items()}
        except Exception as exc:  # NVMLError and its many subclasses; the driver's word is enough
            log.info("GPU utilisation not recorded: NVML unavailable (%s)", exc)
            return False
        self.nvml = nvml
        self._thread = threading.Thread(target=self._run, args=(handles,), name="gpu-sampler", daemon=True)
        self._thread.start()
        log.info("sampling GPU utilisation of %s every %.0f ms into %s",
                 ", ".join(f"{r} GPU {i}" for r, i in self.gpus.items()), self.interval_s * 1000, self.path.name)
        return True

    def _sample(self, handles: dict[str, tuple[int, Any]], t: float) -> list[dict[str, Any]]:
        rows = []
        for role, (index, handle) in handles.items():
            util = self.nvml.nvmlDeviceGetUtilizationRates(handle)
            mem = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            rows.append({"t": round(t, 3), "role": role, "gpu": index, "util": int(util.gpu),
                         "mem_used_mb": int(mem.used) >> 20, "mem_total_mb": int(mem.total) >> 20})
        return rows

    def _run(self, handles: dict[str, tuple[int, Any]]) -> None:
        try:
            self._write(handles)
        except OSError as exc:  # a full disk: the samples stop; the run's own files say the rest
            log.warning("GPU sampling stopped: %s", file_error(exc, self.path) or exc)

    def _write(self, handles: dict[str, tuple[int, Any]]) -> None:
        started = time.monotonic()
        with open(self.path, "a", encoding="utf-8") as f:
            try:
                while not self._stop.is_set():
                    try:
                        rows = self._sample(handles, time.monotonic() - started)
                    except Exception as exc:  # a GPU fallen off the bus: stop sampling, keep training
                        log.warning("GPU sampling stopped: %s", exc)
                        return
                    for row in rows:
                        f.write(json.dumps(row) + "\n")
                    self.samples += 1
                    if self.samples % FLUSH_EVERY == 0:
                        f.flush()
                    self._stop.wait(self.interval_s)
            finally:
                try:
                    self.nvml.nvmlShutdown()
                except Exception as exc:  # shutting down a broken NVML is not worth failing over
                    log.debug("nvmlShutdown: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
