"""What a feed hands out, per framework (``trainer.framework``): how a batch's host arrays
reach the model device, and what the user's loop gets when it takes the batch.

A :class:`Staging` has two halves. ``stage`` runs in the queue's stager thread
(consumer/pipeline/buffer.py) as soon as a batch arrives, while the loop's step on the
previous batch runs; ``take`` runs in the loop's thread when the loop takes the batch.

- ``numpy``: the host arrays as they arrived (read-only views of their shared-memory slot,
  valid until the batch's step is confirmed: docs/DESIGN.md, "The coordinator process"); no staging.
- ``torch``: on a CUDA device, each array copied from pinned host memory with
  ``non_blocking=True`` on a side stream of the stager thread, and an event recorded on
  that stream after the copies. ``take`` makes the loop's current stream wait for that
  event (the host never waits) and marks each tensor as used on that stream
  (``record_stream``), so the caching allocator does not give its memory to another tensor
  while work of the loop on it is still queued. On the CPU, ``torch.from_numpy`` in ``take``:
  no copy, so the tensors share the batch's shared-memory slot and are for reading (valid
  until the batch's step is confirmed; torch's CPU ops are done when the step returns), and
  no staging, so no stager thread takes the interpreter while the step runs.
- ``jax``: ``jax.device_put`` onto a device, or a ``jax.sharding.Sharding`` given to the feed;
  the stager waits for the copy (``block_until_ready``), and on the CPU copies the host arrays
  first: JAX would share their memory (a shared-memory slot, consumer/pipeline/slots.py) and
  its asynchronous dispatch could read it after the step is confirmed.
- ``tensorflow``: shared/tfsetup.py's stagers, wrapped (:class:`FunctionStaging`).

A batch whose staging failed reaches ``take`` as host arrays (the queue trains it from host
memory); torch and jax put it on the device there.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

# torch warns once per process that a tensor made from a read-only array must not be written:
# the CPU path's tensors share the batch's shared-memory slot on purpose (docs/FEED.md).
READ_ONLY_WARNING = "The given NumPy array is not writable"


class Staging:
    """Batches as host arrays: no staging, and the loop takes what arrived."""

    stage: Callable[[dict[str, Any]], Any] | None = None
    device = "host"

    def take(self, staged: Any) -> dict[str, Any]:
        """The batch for the loop, in the loop's thread."""
        return staged


class FunctionStaging(Staging):
    """A stager function (TensorFlow's) whose result the loop takes as it is."""

    def __init__(self, stage: Callable[[dict[str, Any]], Any], device: str) -> None:
        self.stage = stage
        self.device = device


@dataclass
class CopiedBatch:
    """A batch whose copies to a CUDA device were queued on the stager's stream."""

    tensors: dict[str, Any]
    copied: Any  # torch.cuda.Event recorded on the stager's stream after the copies


class TorchStaging(Staging):
    """Batches as torch tensors on ``device`` ("cuda:N" or "cpu")."""

    def __init__(self, torch: Any, device: str) -> None:
        self.torch = torch
        self.device = device
        self._device = torch.device(device)
        self._stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        # On the CPU nothing is copied: the loop's thread wraps the arrays when it takes them,
        # and no stager thread wakes (and takes the interpreter) while the step runs.
        self.stage = self._copy if self._stream is not None else None
        # Only the warning this module's own calls raise (warnings match the caller's module).
        warnings.filterwarnings("ignore", message=READ_ONLY_WARNING, category=UserWarning, module=__name__)

    def _copy(self, arrays: Mapping[str, np.ndarray]) -> CopiedBatch:
        torch, stream = self.torch, self._stream
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            tensors = {name: torch.from_numpy(array).pin_memory().to(self._device, non_blocking=True)
                       for name, array in arrays.items()}
            copied = torch.cuda.Event()
            copied.record(stream)
        return CopiedBatch(tensors, copied)

    def take(self, staged: Any) -> dict[str, Any]:
        if not isinstance(staged, CopiedBatch):  # the CPU's host arrays, or those whose staging failed
            if self._stream is None:
                return {name: self.torch.from_numpy(value) for name, value in staged.items()}
            return {name: self.torch.as_tensor(value, device=self._device) for name, value in staged.items()}
        current = self.torch.cuda.current_stream(self._device)
        current.wait_event(staged.copied)
        for tensor in staged.tensors.values():
            tensor.record_stream(current)
        return staged.tensors


class JaxStaging(Staging):
    """Batches as jax arrays, put onto ``target``: a device or a ``jax.sharding.Sharding``."""

    def __init__(self, jax: Any, target: Any) -> None:
        self.jax = jax
        self.target = target
        self.device = str(target)
        self.stage = self._put
        devices = target.device_set if hasattr(target, "device_set") else {target}
        # On the CPU, device_put shares an aligned numpy buffer (a shared-memory slot), and a step
        # dispatched asynchronously may read it after the step is confirmed and the slot written
        # again: the arrays are copied first.
        self._host = all(d.platform == "cpu" for d in devices)

    def _put(self, arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
        put = {name: self.jax.device_put(np.array(array) if self._host else array, self.target)
               for name, array in arrays.items()}
        for value in put.values():  # the host memory read before it may be written again (the stager waits)
            value.block_until_ready()
        return put

    def take(self, staged: Any) -> dict[str, Any]:
        if all(isinstance(value, self.jax.Array) for value in staged.values()):
            return staged
        return self._put(staged)  # host arrays whose staging failed
