"""How a ``stoker.Feed``'s batches reach the user's loop, per framework (trainer.framework):
the framework checked before anything starts, then a :class:`Staging` onto the model device
(consumer/feed/frameworks.py) as devices.model_gpu, a ``tf.distribute`` strategy or a
JAX sharding say. docs/FEED.md, Other frameworks, is the user's side.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

from .consumer.feed.frameworks import FunctionStaging, JaxStaging, Staging, TorchStaging
from .shared.cluster import TORCHRUN, from_env
from .shared.config import FRAMEWORKS, TENSORFLOW, DevicesConfig
from .shared.errors import UserError
from .shared.tfsetup import TF_EXTRA, device_stager, replica_stager

log = logging.getLogger("stoker.feed")

# What each framework needs installed: its module, its name, and how to install it.
FRAMEWORK_MODULES = {
    TENSORFLOW: ("tensorflow", "TensorFlow", f"{TF_EXTRA}, or choose framework='torch', 'jax' or 'numpy'"),
    "torch": ("torch", "PyTorch", "pip install torch (the build for your CUDA: pytorch.org)"),
    "jax": ("jax", "JAX", "pip install 'jax[cpu]' (or 'jax[cuda13]', 'jax[cuda12]')"),
}


class FeedError(UserError):
    """A feed used wrongly (an unknown option, a feed used after it closed, a state that
    does not fit); the message is one line for the user."""


def check_framework(framework: str, strategy: Any, sharding: Any) -> str:
    """``framework`` if it is installed and the options fit it; else one FeedError line."""
    assert framework in FRAMEWORKS  # the config checked it
    if strategy is not None and framework != TENSORFLOW:
        raise FeedError(f"stoker.Feed: strategy= is a tf.distribute strategy, for framework='tensorflow'; "
                        f"this feed's framework is {framework!r}")
    if sharding is not None and framework != "jax":
        raise FeedError(f"stoker.Feed: sharding= is a jax.sharding.Sharding, for framework='jax'; this feed's "
                        f"framework is {framework!r}")
    module, name, install = FRAMEWORK_MODULES.get(framework, (None, "", ""))
    if module is not None and importlib.util.find_spec(module) is None:
        raise FeedError(f"stoker.Feed(framework={framework!r}) needs {name}: {install}")
    if sharding is not None:
        import jax  # the user's sharding is JAX's: JAX is loaded already

        if not isinstance(sharding, jax.sharding.Sharding):
            raise FeedError(f"stoker.Feed: sharding= takes a jax.sharding.Sharding, got {type(sharding).__name__}")
    return framework


def make_staging(framework: str, devices: DevicesConfig, strategy: Any = None, sharding: Any = None) -> Staging:
    """How batches reach the loop for ``framework``: staged onto the model device (in the
    queue's stager thread, or between steps: consumer/feed/frameworks.py), or host arrays (numpy)."""
    if framework == TENSORFLOW:
        return tf_staging(devices, strategy)
    if framework == "torch":
        return torch_staging(devices)
    if framework == "jax":
        return jax_staging(devices, sharding)
    log.info("batches handed out as numpy arrays (host memory)")
    return Staging()


def one_model_gpu(devices: DevicesConfig, several: str) -> int | None:
    """``devices.model_gpu`` as one index (None: not given); FeedError for several, saying ``several``."""
    wanted = devices.model_gpu
    if isinstance(wanted, str):
        raise FeedError(f"devices.model_gpu {wanted!r}: {several}")
    return wanted


def tf_staging(devices: DevicesConfig, strategy: Any) -> Staging:
    """Host arrays -> tensors on the model device, in the queue's stager thread: the
    GPU ``devices.model_gpu`` names among this process's GPUs (default its first, with
    ``devices.model_gpu_memory_mb`` as its limit), else the CPU; with a strategy, each
    replica's part onto that replica's device."""
    import tensorflow as tf

    if strategy is not None:
        replicas = list(strategy.extended.worker_devices)
        log.info("batches split over %d replicas and staged onto %s", len(replicas), ", ".join(replicas))
        return FunctionStaging(replica_stager(tf, strategy, replicas), ", ".join(replicas))

    wanted = one_model_gpu(devices, "without strategy= the feed stages each batch onto one GPU; for a replica on "
                                 "each of several, give strategy=tf.distribute.MirroredStrategy(...)")
    limit_mb = devices.model_gpu_memory_mb
    physical = tf.config.list_physical_devices("GPU")
    if wanted is not None and wanted >= len(physical):
        raise FeedError(f"devices.model_gpu {wanted}: TensorFlow in this process sees {len(physical)} GPU(s) "
                        f"(numbered from 0 among CUDA_VISIBLE_DEVICES)")
    if limit_mb and physical:
        try:
            tf.config.set_logical_device_configuration(
                physical[wanted or 0], [tf.config.LogicalDeviceConfiguration(memory_limit=int(limit_mb))])
        except RuntimeError:
            raise FeedError("devices.model_gpu_memory_mb: TensorFlow in this process has set up its GPUs already (a "
                            "tensor or model was made before the feed started); start the feed first, or leave the "
                            "limit to tf.config.set_logical_device_configuration in your code") from None
    elif limit_mb:
        log.warning("devices.model_gpu_memory_mb=%d: this process has no GPU; nothing to limit", limit_mb)
    gpus = tf.config.list_logical_devices("GPU")
    device = gpus[wanted or 0].name if gpus else "/CPU:0"
    log.info("batches staged onto %s", device)
    return FunctionStaging(device_stager(tf, device), device)


def torch_staging(devices: DevicesConfig) -> Staging:
    """Batches as torch tensors on ``cuda:N`` when CUDA is available (N: ``devices.model_gpu``;
    by default 0, or under torchrun LOCAL_RANK modulo the GPUs seen, so the ranks of a host
    take a GPU each, or share them when they outnumber the GPUs), with
    ``devices.model_gpu_memory_mb`` as the process's share of that GPU; else on the CPU."""
    import torch  # the user's framework: loaded with the feed of a torch loop only

    wanted = one_model_gpu(devices, "the feed stages each batch onto one GPU, cuda:N; several GPUs are a process "
                                 "each (torch.distributed), each with its model_gpu")
    limit_mb = devices.model_gpu_memory_mb
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if wanted is not None and wanted >= count:
            raise FeedError(f"devices.model_gpu {wanted}: PyTorch in this process sees {count} GPU(s) (numbered "
                            f"from 0 among CUDA_VISIBLE_DEVICES)")
        index = wanted if wanted is not None else torchrun_gpu(count)
        if limit_mb:
            total_mb = torch.cuda.get_device_properties(index).total_memory / 2**20
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit_mb / total_mb), index)
        device = f"cuda:{index}"
    elif wanted is not None:
        raise FeedError(f"devices.model_gpu {wanted}: PyTorch in this process sees no GPU "
                        f"(torch.cuda.is_available() is False: a CPU build of torch, or no driver)")
    else:
        if limit_mb:
            log.warning("devices.model_gpu_memory_mb=%d: this process has no GPU; nothing to limit", limit_mb)
        device = "cpu"
    log.info("batches staged onto %s as torch tensors", device)
    return TorchStaging(torch, device)


def torchrun_gpu(count: int) -> int:
    """The GPU of this process among ``count``: under torchrun its LOCAL_RANK's (modulo
    ``count``), else the first."""
    cluster = from_env(os.environ)
    if cluster is None or cluster.source != TORCHRUN or cluster.local_rank is None:
        return 0
    return cluster.local_rank % count


def jax_staging(devices: DevicesConfig, sharding: Any) -> Staging:
    """Batches as jax arrays put with ``sharding=``, else onto ``jax.devices()[model_gpu or 0]``."""
    import jax  # the user's framework: loaded with the feed of a JAX loop only

    if devices.model_gpu_memory_mb:
        log.warning("devices.model_gpu_memory_mb=%d: JAX takes its memory limit from "
                    "XLA_PYTHON_CLIENT_MEM_FRACTION, set before JAX starts; not applied", devices.model_gpu_memory_mb)
    if sharding is not None:
        log.info("batches put with %s as jax arrays", sharding)
        return JaxStaging(jax, sharding)
    wanted = one_model_gpu(devices, "without sharding= the feed puts each batch on one device; for several, give "
                                 "sharding=jax.sharding.NamedSharding(mesh, PartitionSpec('batch'))")
    found = jax.devices()
    if wanted is not None and wanted >= len(found):
        raise FeedError(f"devices.model_gpu {wanted}: JAX in this process has {len(found)} device(s): {found}")
    device = found[wanted or 0]
    log.info("batches staged onto %s as jax arrays", device)
    return JaxStaging(jax, device)
