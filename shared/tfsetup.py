"""TensorFlow's device setup inside a process that the launcher pinned to its GPU.

The launcher (stoker/devices.py) decides which GPU each process gets and names it in the
child's ``CUDA_VISIBLE_DEVICES`` before the child starts; here, in the child, TensorFlow
is imported for the first time and the memory limit applied. It is the only place that
imports TensorFlow for device setup.
"""

from __future__ import annotations

import os


def configure_tensorflow(memory_mb: int | None):  # -> the tensorflow module
    """Import TensorFlow in a pinned child and apply its memory limit; return (tf, device)."""
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        raise RuntimeError("CUDA_VISIBLE_DEVICES must be set before TensorFlow is imported")
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return tf, "/CPU:0"
    gpu = gpus[0]  # CUDA_VISIBLE_DEVICES leaves exactly one
    if memory_mb:
        tf.config.set_logical_device_configuration(
            gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=int(memory_mb))])
    else:
        tf.config.experimental.set_memory_growth(gpu, True)
    return tf, "/GPU:0"
