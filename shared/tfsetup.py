"""TensorFlow's device setup inside a process that the launcher pinned to its GPU(s).

The launcher (stoker/devices.py) decides which GPU each process gets and names it in the
child's ``CUDA_VISIBLE_DEVICES`` before the child starts; here, in the child, TensorFlow
is imported for the first time and the memory limit applied. It is the only place that
imports TensorFlow for device setup.

TensorFlow's native start-up lines (absl's "All log messages before absl::InitializeLog()",
oneDNN's and cudart's notices) are written by C++ straight to file descriptor 2, past
Python's logging and ``TF_CPP_MIN_LOG_LEVEL``; they are kept out of the user's terminal
while TensorFlow loads (:func:`native_stderr_quiet`), unless the log level is DEBUG.

TensorFlow is an extra (``pip install 'stoker[tf]'``): a stoker.Feed for PyTorch, JAX or
numpy runs without it. What needs it says so in one line (:func:`require_tensorflow`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
from typing import Any, Callable, Iterator

from .errors import UserError

# The extra that installs TensorFlow with stoker (pyproject.toml); `gpu` is TensorFlow with CUDA.
TF_EXTRA = "pip install 'stoker[tf]'"


class GpuUnavailable(UserError):
    """A GPU was planned for this process and TensorFlow cannot use it; one line for the user."""


class TensorFlowMissing(UserError):
    """Something that runs on TensorFlow was asked for where TensorFlow is not installed."""


def tensorflow_installed() -> bool:
    """Whether TensorFlow can be imported here, found without importing it (seconds of CPU)."""
    return importlib.util.find_spec("tensorflow") is not None


def require_tensorflow(what: str) -> None:
    """TensorFlowMissing (one line naming ``what`` and the extra) unless TensorFlow is installed."""
    if not tensorflow_installed():
        raise TensorFlowMissing(f"{what} needs TensorFlow: {TF_EXTRA}")


@contextlib.contextmanager
def native_stderr_quiet(enabled: bool = True) -> Iterator[None]:
    """File descriptor 2 goes to /dev/null inside the block (native code's writes included);
    Python's exceptions still propagate and are reported after it."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def configure_tensorflow(memory_mb: int | None):  # -> (the tensorflow module, device name)
    """Import TensorFlow in a pinned child and apply its memory limit; return (tf, device)."""
    tf, devices = configure_replicas(memory_mb, 1)
    return tf, devices[0]


def configure_replicas(memory_mb: int | None, replicas: int):  # -> (the tensorflow module, device names)
    """Import TensorFlow in a pinned child and return (tf, one device name per model replica):
    the GPUs ``CUDA_VISIBLE_DEVICES`` names, each with the memory limit ``memory_mb`` (or
    growing memory), or on a host without them the CPU, split into ``replicas`` logical
    devices when there are several. GpuUnavailable (one line) when TensorFlow sees fewer
    GPUs than were planned."""
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        raise RuntimeError("CUDA_VISIBLE_DEVICES must be set before TensorFlow is imported")
    require_tensorflow("this process (stoker's trainer, or a producer with features.backend tf or transforms.models)")
    with native_stderr_quiet(logging.getLogger().getEffectiveLevel() > logging.DEBUG):
        import tensorflow as tf

    given = os.environ["CUDA_VISIBLE_DEVICES"].strip()
    planned = [g for g in given.split(",") if g.strip()] if given != "-1" else []  # "" and -1 hide every GPU
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        if planned:
            raise GpuUnavailable(f"this process was given GPU {given} (CUDA_VISIBLE_DEVICES), but TensorFlow sees no "
                                 f"GPU: its CUDA libraries are missing (install stoker with the gpu extra: pip install "
                                 f"'stoker[gpu]') or the NVIDIA driver is not loaded")
        return tf, _cpu_devices(tf, replicas)
    if len(gpus) < replicas:
        raise GpuUnavailable(f"{replicas} model replicas were planned on GPUs {given} (CUDA_VISIBLE_DEVICES), but "
                             f"TensorFlow sees {len(gpus)} of them")
    for gpu in gpus[:replicas]:
        if memory_mb:
            tf.config.set_logical_device_configuration(
                gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=int(memory_mb))])
        else:
            tf.config.experimental.set_memory_growth(gpu, True)
    return tf, [f"/GPU:{i}" for i in range(replicas)]


def _cpu_devices(tf: Any, replicas: int) -> list[str]:
    """The CPU as ``replicas`` logical devices (one: the CPU itself)."""
    return split_cpu(replicas, tf) if replicas > 1 else ["/CPU:0"]


def split_cpu(replicas: int, tf: Any = None) -> list[str]:
    """Split the CPU into ``replicas`` logical devices and return their names. Splitting needs
    TensorFlow not to have set up its devices yet; where it has, the devices it already has
    are used, and too few is an error."""
    if tf is None:
        with native_stderr_quiet(logging.getLogger().getEffectiveLevel() > logging.DEBUG):
            import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have < replicas:
            raise RuntimeError(f"TensorFlow set up {have} CPU device(s) before the CPU could be split into "
                               f"{replicas} replicas") from None
    return [f"/CPU:{i}" for i in range(replicas)]


def replica_stager(tf: Any, strategy: Any, devices: list[str]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A global batch's host arrays -> per-replica values of ``strategy``: rows split into
    len(devices) equal parts along the batch axis (B), part i copied onto devices[i] in the
    queue's stager thread, while the step on the previous batch runs."""
    n = len(devices)

    def stage(arrays: dict[str, Any]) -> dict[str, Any]:
        parts: list[dict[str, Any]] = [{} for _ in devices]
        for name, array in arrays.items():
            if len(array) % n:
                raise ValueError(f"batch field {name!r} has {len(array)} rows, not a multiple of {n} replicas")
            step = len(array) // n
            for i, device in enumerate(devices):
                with tf.device(device):
                    parts[i][name] = tf.identity(tf.convert_to_tensor(array[i * step:(i + 1) * step]))
        # A worker of several holds replicas w x n .. w x n + n - 1 of the whole job: its own are ids mod n.
        return {name: strategy.experimental_distribute_values_from_function(
                    lambda ctx, name=name: parts[ctx.replica_id_in_sync_group % n][name]) for name in arrays}

    return stage


def device_stager(tf: Any, device: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A batch's host arrays -> tensors on ``device``, for the queue's stager thread: the copy
    happens there (``identity`` forces it now), while the step on the previous batch runs."""

    def stage(arrays: dict[str, Any]) -> dict[str, Any]:
        with tf.device(device):
            return {k: tf.identity(tf.convert_to_tensor(v)) for k, v in arrays.items()}

    return stage
