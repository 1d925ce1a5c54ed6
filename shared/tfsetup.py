"""TensorFlow's device setup inside a process that the launcher pinned to its GPU.

The launcher (stoker/devices.py) decides which GPU each process gets and names it in the
child's ``CUDA_VISIBLE_DEVICES`` before the child starts; here, in the child, TensorFlow
is imported for the first time and the memory limit applied. It is the only place that
imports TensorFlow for device setup.

TensorFlow's native start-up lines (absl's "All log messages before absl::InitializeLog()",
oneDNN's and cudart's notices) are written by C++ straight to file descriptor 2, past
Python's logging and ``TF_CPP_MIN_LOG_LEVEL``; they are kept out of the user's terminal
while TensorFlow loads (:func:`native_stderr_quiet`), unless the log level is DEBUG.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, Callable, Iterator

from .errors import UserError


class GpuUnavailable(UserError):
    """A GPU was planned for this process and TensorFlow cannot use it; one line for the user."""


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


def configure_tensorflow(memory_mb: int | None):  # -> the tensorflow module
    """Import TensorFlow in a pinned child and apply its memory limit; return (tf, device)."""
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        raise RuntimeError("CUDA_VISIBLE_DEVICES must be set before TensorFlow is imported")
    with native_stderr_quiet(logging.getLogger().getEffectiveLevel() > logging.DEBUG):
        import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        given = os.environ["CUDA_VISIBLE_DEVICES"].strip()
        if given and given != "-1":  # "" (stoker's) and -1 (CUDA's) hide every GPU: the CPU was planned
            raise GpuUnavailable(f"this process was given GPU {given} (CUDA_VISIBLE_DEVICES), but TensorFlow sees no "
                                 f"GPU: its CUDA libraries are missing (install stoker with the gpu extra: pip install "
                                 f"'stoker[gpu]') or the NVIDIA driver is not loaded")
        return tf, "/CPU:0"
    gpu = gpus[0]  # CUDA_VISIBLE_DEVICES leaves exactly one
    if memory_mb:
        tf.config.set_logical_device_configuration(
            gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=int(memory_mb))])
    else:
        tf.config.experimental.set_memory_growth(gpu, True)
    return tf, "/GPU:0"


def device_stager(tf: Any, device: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A batch's host arrays -> tensors on ``device``, for the queue's stager thread: the copy
    happens there (``identity`` forces it now), while the step on the previous batch runs."""

    def stage(arrays: dict[str, Any]) -> dict[str, Any]:
        with tf.device(device):
            return {k: tf.identity(tf.convert_to_tensor(v)) for k, v in arrays.items()}

    return stage
