"""Producer models in JAX (producer/models.py picks this module by the model's type): a model
function returns ``(apply_fn, params)``, called ``apply_fn(params, **inputs)``, jitted (one
compilation per bucket shape), on the producer's data device (its pinned GPU within its
memory share, or the CPU on one thread). docs/design/features.md, "Producer models".
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import sys
from typing import Any, Mapping

import numpy as np

from .features import gpu_visible
from .models_common import ModelSetupError, ProducerModel, one_line

log = logging.getLogger("producer")

FRAMEWORK = "jax"
# Without the card's size (no NVML) a memory share cannot be given: JAX then allocates as it
# goes instead of taking most of the card at its start.
NO_PREALLOCATION = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def owns(made: Any) -> bool:
    """Whether a model function returned a JAX model: a pair (apply_fn, params)."""
    return isinstance(made, tuple) and len(made) == 2 and callable(made[0]) and not isinstance(made[0], type)


def adopt(made: tuple[Any, Any]) -> tuple[Any, tuple[str, ...], Any]:
    """(apply_fn, its input names: its parameters after the first, params)."""
    apply_fn, params = made
    signature = inspect.signature(apply_fn)
    names = [name for name, p in signature.parameters.items()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return apply_fn, tuple(names[1:]), params


def digest(params: Any) -> str:
    """The SHA-256 of a JAX model's parameters (hex): the pytree's leaves, by path, with their
    dtypes and shapes; "" without any."""
    import jax  # a JAX model is configured

    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    if not leaves:
        return ""
    h = hashlib.sha256()
    for path, leaf in leaves:
        value = np.asarray(leaf)
        h.update(str((jax.tree_util.keystr(path), value.dtype.name, value.shape)).encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def environment(memory_mb: int | None) -> dict[str, str]:
    """What JAX must find in the environment when it starts (it reads these then, once): on the
    pinned GPU, its memory share (``memory_mb`` of the card, through NVML: CUDA_DEVICE_ORDER is
    PCI_BUS_ID, so CUDA's index is NVML's); on the CPU, the CPU platform on one thread."""
    if not gpu_visible():
        flags = os.environ.get("XLA_FLAGS", "")
        one_thread = "" if "xla_cpu_multi_thread_eigen" in flags else " --xla_cpu_multi_thread_eigen=false"
        return {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS") or "cpu", "XLA_FLAGS": (flags + one_thread).strip()}
    total_mb = _card_mb(os.environ["CUDA_VISIBLE_DEVICES"].split(",")[0].strip()) if memory_mb else None
    if not memory_mb or not total_mb:
        return dict(NO_PREALLOCATION)
    return {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{min(1.0, memory_mb / total_mb):.4f}"}


def _card_mb(visible: str) -> int | None:
    """The memory of the card CUDA_VISIBLE_DEVICES names first (an index or a UUID), or None."""
    try:
        import pynvml as nvml  # optional: the gpu extra installs it
    except ImportError:
        log.info("producer models: JAX's memory share not set: nvidia-ml-py is not installed")
        return None
    try:
        nvml.nvmlInit()
        handle = (nvml.nvmlDeviceGetHandleByIndex(int(visible)) if visible.isdigit()
                  else nvml.nvmlDeviceGetHandleByUUID(visible))
        return int(nvml.nvmlDeviceGetMemoryInfo(handle).total >> 20)
    except nvml.NVMLError as exc:
        log.info("producer models: JAX's memory share not set: NVML cannot read GPU %s (%s)", visible, exc)
        return None


def prepare_environment(memory_mb: int | None) -> None:
    """:func:`environment` set, before a model's module imports JAX (it is no other framework's)."""
    if "jax" in sys.modules:
        log.debug("producer models: JAX was imported before its device was configured")
        return
    os.environ.update(environment(memory_mb))


class Backend:
    """JAX models on the producer's data device, each jitted (compiled once per input shape)."""

    def __init__(self) -> None:
        import jax  # a JAX model is configured

        self.jax = jax
        self.device = jax.devices()[0]
        if gpu_visible() and self.device.platform != "gpu":
            raise ModelSetupError(f"this producer was given GPU {os.environ['CUDA_VISIBLE_DEVICES']} "
                                  f"(CUDA_VISIBLE_DEVICES), but JAX sees no GPU (its backend is "
                                  f"{self.device.platform}): install JAX with CUDA (jax[cuda13] or jax[cuda12], "
                                  "as your CUDA)")

    def prepare(self, m: ProducerModel) -> None:
        m.params = self.jax.device_put(m.params, self.device)
        m.traced, m.jit = self.jax.jit(m.fn), True

    def call(self, m: ProducerModel, inputs: Mapping[str, np.ndarray]) -> Any:
        """The model's outputs on the batch's ``inputs``, on the host (or what it returned); a
        model jax.jit cannot trace runs op by op from then on, once warned."""
        jax = self.jax
        args = {n: jax.device_put(inputs[n], self.device) for n in m.inputs}
        try:
            out = (m.traced if m.jit else m.fn)(m.params, **args)
        except jax.errors.JAXTypeError as exc:  # a value-dependent Python branch, a host conversion
            if not m.jit:
                raise
            log.warning("producer model %s: jax.jit cannot trace it (%s); running it without jit", m.spec,
                        one_line(exc))
            m.jit = False
            out = m.fn(m.params, **args)
        if not isinstance(out, Mapping):
            return out
        return {k: np.asarray(v) for k, v in out.items()}
