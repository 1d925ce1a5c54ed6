"""What a feed hands out, per framework (``trainer.framework``): how a batch's host arrays
reach the model device, and what the user's loop gets when it takes the batch.

A :class:`Staging` has two halves. ``stage`` starts a batch's way to the device: in the queue's
stager thread as soon as the batch arrives, while the loop's step on the previous batch runs,
or (``on_request``) in the thread that asks for a batch, between steps, for each batch that
arrived meanwhile (consumer/buffer.py). ``take`` runs in the loop's thread when the
loop takes the batch. ``settle`` runs before a batch's host memory may be written again.

- ``numpy``: the host arrays as they arrived (read-only views of their shared-memory slot,
  valid until the batch's step is confirmed: docs/design/processes.md, "The coordinator process"); no staging.
- ``torch``: on a CUDA device, each array copied with ``non_blocking=True`` on a side stream, and
  an event recorded on that stream after the copies. Where the slots' memory could be
  page-locked for CUDA (``use_memory``: registered with the driver), the copies read the slot
  itself, so staging only queues them and runs on request, between steps: no thread of the
  feed's takes the interpreter while the step launches its kernels; ``settle`` waits for the
  copies' event before the slot is released (the host is ahead of the device). Elsewhere each
  array is first copied to pinned memory (``pin_memory``) in the stager thread. ``take`` makes
  the loop's current stream wait for that event (the host does not wait there) and marks each tensor
  as used on that stream (``record_stream``), so the caching allocator does not give its
  memory to another tensor while work of the loop on it is still queued. On the CPU,
  ``torch.from_numpy`` in ``take``: no copy, so the tensors share the batch's shared-memory
  slot and are for reading (valid until the batch's step is confirmed; torch's CPU ops are
  done when the step returns), and no staging, so no stager thread takes the interpreter
  while the step runs.
- ``jax``: ``jax.device_put`` onto a device, or a ``jax.sharding.Sharding`` given to the feed.
  On an accelerator the put returns before its transfers are done, so staging runs on request, between
  steps, as torch's does, and ``settle`` waits for them (``block_until_ready``) before the slot
  is released. In host memory (the CPU, or a sharding of a host memory kind) JAX would share the
  arrays' memory (a shared-memory slot, consumer/slots.py) and its asynchronous
  dispatch could read it after the step is confirmed: the stager thread copies them first.
- ``tensorflow``: shared/tfsetup.py's stagers, wrapped (:class:`FunctionStaging`): a
  ``stoker.Feed``'s (stoker/feed_staging.py) and stoker's own trainer's
  (consumer/training/trainer.py), which both hand their staging to the feed (FeedCore.use_staging).

A batch whose staging failed reaches ``take`` as host arrays (the queue trains it from host
memory); every staging but numpy's puts it on the device there.
"""

from __future__ import annotations

import logging
import mmap
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from ..buffer import Staging

log = logging.getLogger(__name__)

# torch warns once per process that a tensor made from a read-only array must not be written:
# the CPU path's tensors share the batch's shared-memory slot on purpose (docs/FEED.md).
READ_ONLY_WARNING = "The given NumPy array is not writable"
# cudaHostRegisterPortable: the memory counts as pinned for every CUDA context (as torch's own
# torch/cuda/_pin_memory_utils.py registers shared memory).
HOST_REGISTER_PORTABLE = 1
# JAX's memory kinds in host memory: a put there may share the host array's memory.
HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


class FunctionStaging(Staging):
    """A stager function (TensorFlow's) whose result the loop takes as it is; a batch whose
    staging failed is staged in the loop's thread when it is taken."""

    def __init__(self, stage: Callable[[dict[str, Any]], Any], device: str) -> None:
        self.stage = stage
        self.device = device

    def take(self, staged: Any) -> Any:
        if all(isinstance(value, np.ndarray) for value in staged.values()):
            return self.stage(staged)  # its staging failed: the step gets it on the device all the same
        return staged


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
        self._registered: int | None = None  # the address of the host memory page-locked by use_memory
        # On the CPU nothing is copied: the loop's thread wraps the arrays when it takes them,
        # and no stager thread wakes (and takes the interpreter) while the step runs.
        self.stage = self._copy if self._stream is not None else None
        # Only the warning this module's own calls raise (warnings match the caller's module).
        warnings.filterwarnings("ignore", message=READ_ONLY_WARNING, category=UserWarning, module=__name__)

    def use_memory(self, address: int, nbytes: int) -> None:
        """On CUDA, page-lock the memory batches arrive in, so that their copies read it directly
        and staging moves between steps; where the driver refuses, batches go through pinned copies."""
        if self._stream is None:
            return
        nbytes += -nbytes % mmap.PAGESIZE  # whole pages, as a mapping has them
        refused = self._cuda_call(lambda cudart: cudart.cudaHostRegister(address, nbytes, HOST_REGISTER_PORTABLE))
        if refused:
            log.warning("the batch slots could not be page-locked for CUDA (%s); each batch is copied to pinned "
                        "memory in a stager thread instead", refused)
            return
        self._registered = address
        self.on_request = True
        log.debug("batch slots page-locked for CUDA (%.1f MB): copies read them directly", nbytes / 2**20)

    def _cuda_call(self, call: Callable[[Any], Any]) -> str:
        """``call(cudart)`` on this device, in a thread of its own: "" if it returned cudaSuccess,
        else why not. A failed call's error stays the calling thread's last CUDA error, which
        torch's next kernel launch in that thread would raise as its own."""
        outcome: list[str] = []

        def run() -> None:
            try:
                with self.torch.cuda.device(self._device):
                    error = int(call(self.torch.cuda.cudart()))
                outcome.append(f"cudaError {error}" if error else "")
            except Exception as exc:  # no CUDA runtime to ask (its bindings absent): the caller says why
                outcome.append(f"{type(exc).__name__}: {exc}")

        thread = threading.Thread(target=run, name="cuda-host-memory")
        thread.start()
        thread.join()
        return outcome[0]

    def _copy(self, arrays: Mapping[str, np.ndarray]) -> CopiedBatch:
        torch, stream, direct = self.torch, self._stream, self._registered is not None
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            tensors = {}
            for name, array in arrays.items():
                source = torch.from_numpy(array)
                tensors[name] = (source if direct else source.pin_memory()).to(self._device, non_blocking=True)
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

    def settle(self, staged: Any) -> None:
        if self._registered is not None and isinstance(staged, CopiedBatch):
            staged.copied.synchronize()  # the copies read the slot: done before it is written again

    def close(self) -> None:
        if self._registered is None:
            return
        address, self._registered = self._registered, None
        assert self._stream is not None
        self._stream.synchronize()  # no copy reads the memory any more
        refused = self._cuda_call(lambda cudart: cudart.cudaHostUnregister(address))
        if refused:
            log.warning("the batch slots could not be unregistered from CUDA (%s)", refused)


class JaxStaging(Staging):
    """Batches as jax arrays, put onto ``target``: a device or a ``jax.sharding.Sharding``."""

    def __init__(self, jax: Any, target: Any) -> None:
        self.jax = jax
        self.target = target
        self.device = str(target)
        self.stage = self._put
        devices = target.device_set if hasattr(target, "device_set") else {target}
        # In host memory, device_put shares an aligned numpy buffer (a shared-memory slot), and a
        # step dispatched asynchronously may read it after the step is confirmed and the slot
        # written again: the arrays are copied first, in the stager thread. Elsewhere the put
        # returns before its transfers (which read the slot) are done: it runs between steps, settle waits.
        self._host = (all(d.platform == "cpu" for d in devices)
                      or getattr(target, "memory_kind", None) in HOST_MEMORY_KINDS)
        self.on_request = not self._host

    def _put(self, arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return {name: self.jax.device_put(np.array(array) if self._host else array, self.target)
                for name, array in arrays.items()}

    def take(self, staged: Any) -> dict[str, Any]:
        if all(isinstance(value, self.jax.Array) for value in staged.values()):
            return staged
        put = self._put(staged)  # host arrays whose staging failed
        self.settle(put)  # read before the step: the confirmation's settle sees only the host arrays
        return put

    def settle(self, staged: Any) -> None:
        for value in staged.values():
            if isinstance(value, self.jax.Array):
                value.block_until_ready()  # its transfer, which reads the slot, is done
