"""Producer models in PyTorch (producer/models.py picks this module by the model's type): an
eager ``nn.Module``, a TorchScript module or a ``torch.export`` ExportedProgram, run eagerly
on the producer's data device (its pinned GPU within its memory share, or the CPU on one
thread). docs/design/features.md, "Producer models".
"""

from __future__ import annotations

import hashlib
import inspect
import os
import sys
from typing import Any, Mapping

import numpy as np

from .features import gpu_visible
from .models_common import ModelSetupError, ProducerModel

FRAMEWORK = "torch"


def _exported(made: Any) -> bool:
    export = sys.modules.get("torch.export")  # imported wherever an ExportedProgram was made or loaded
    return export is not None and isinstance(made, export.ExportedProgram)


def owns(made: Any) -> bool:
    """Whether a model function returned a PyTorch model (PyTorch is imported by then if so)."""
    torch = sys.modules.get("torch")
    return torch is not None and (isinstance(made, torch.nn.Module) or _exported(made))


def adopt(made: Any) -> tuple[Any, tuple[str, ...]]:
    """(the module to call, its input names: its ``forward``'s parameters) of a PyTorch model."""
    if _exported(made):
        module = made.module()  # the program as a module, called with the same keyword arguments
        return module, _parameters(module.forward)
    schema = getattr(getattr(made, "forward", None), "schema", None)
    if schema is not None:  # TorchScript: the compiled method's arguments, self first
        return made, tuple(a.name for a in schema.arguments[1:])
    return made, _parameters(made.forward)


def _parameters(forward: Any) -> tuple[str, ...]:
    signature = inspect.signature(forward)
    return tuple(name for name, p in signature.parameters.items()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def digest(made: Any) -> str:
    """The SHA-256 of a PyTorch model's weights (hex): its state_dict's tensors (an exported
    program's and its lifted constants), by name, with their dtypes and shapes; "" without any."""
    import torch  # imported already: the model is PyTorch's

    if _exported(made):
        tensors = {**made.state_dict, **{f"constant:{k}": v for k, v in made.constants.items()
                                         if isinstance(v, torch.Tensor)}}
    else:
        tensors = made.state_dict()
    if not tensors:
        return ""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(str((name, str(t.dtype), tuple(t.shape))).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def device_for(torch: Any, memory_mb: int | None) -> Any:
    """The producer's data device for PyTorch: ``cuda:0`` when the launcher pinned it a GPU
    (CUDA_VISIBLE_DEVICES names one), its allocator held to ``memory_mb`` of that card; else
    the CPU, on one thread (producers are one per core). ModelSetupError (one line) for a GPU
    PyTorch cannot use."""
    if not gpu_visible():
        torch.set_num_threads(1)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ModelSetupError(f"this producer was given GPU {os.environ['CUDA_VISIBLE_DEVICES']} "
                              f"(CUDA_VISIBLE_DEVICES), but PyTorch sees no GPU: a CPU-only PyTorch build, or the "
                              f"NVIDIA driver is not loaded")
    device = torch.device("cuda", 0)
    if memory_mb:
        total_mb = torch.cuda.get_device_properties(device).total_memory / 2 ** 20
        torch.cuda.set_per_process_memory_fraction(min(1.0, memory_mb / total_mb), device)
    return device


class Backend:
    """PyTorch models on the producer's data device, eagerly (no shape is compiled)."""

    def __init__(self, memory_mb: int | None) -> None:
        import torch  # a PyTorch model is configured

        self.torch = torch
        self.device = device_for(torch, memory_mb)

    def prepare(self, m: ProducerModel) -> None:
        """The model onto the device, in inference mode (an exported program moved whole)."""
        if _exported(m.made):
            if self.device.type != "cpu":
                from torch.export.passes import move_to_device_pass  # PyTorch's, as above

                m.fn = move_to_device_pass(m.made, self.device).module()
        else:
            m.fn = m.fn.to(self.device).eval()

    def call(self, m: ProducerModel, inputs: Mapping[str, np.ndarray]) -> Any:
        """The model's outputs on the batch's ``inputs``, on the host (or what it returned)."""
        torch = self.torch
        with torch.inference_mode():
            tensors = {n: torch.from_numpy(np.ascontiguousarray(inputs[n])).to(self.device) for n in m.inputs}
            out = m.fn(**tensors)
            if not isinstance(out, Mapping):
                return out
            return {k: self._host(v) for k, v in out.items()}

    def _host(self, value: Any) -> Any:
        if not isinstance(value, self.torch.Tensor):
            return value
        value = value.detach().to("cpu")
        return (value.float() if value.dtype == self.torch.bfloat16 else value).numpy()
