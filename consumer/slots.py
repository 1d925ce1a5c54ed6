"""Batches in shared memory, between the coordinator process and the trainer process.

One file, mapped by both (on /dev/shm, or where there is no room there in the system's
temporary directory), holds ``count`` slots of ``size`` bytes, each sized for the plan's
largest batch. The coordinator process copies a received batch's arrays into a free slot
(:meth:`SlotFile.write`) and sends the trainer process a small descriptor (the slot and each
array's name, dtype, shape and offset); the trainer process reads the batch as read-only
numpy views of the slot (:meth:`SlotFile.views`). Who owns which slot, and when a slot is
free again: consumer/coordinator/coordproc.py and docs/design/processes.md, "The coordinator process".
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from .message_size import message_bytes
from ..shared.config import Config

# Each array of a slot starts at a multiple of this (a cache line; what SIMD loads like).
ALIGN = 64


class SlotTooSmall(ValueError):
    """A batch larger than a slot (the plan's largest batch sizes them: a batch off the plan)."""


def aligned(nbytes: int) -> int:
    return nbytes + -nbytes % ALIGN


def slot_bytes(cfg: Config, shapes: Iterable[tuple[int, int, int]]) -> int:
    """The bytes a slot needs for the largest of the batches of ``shapes`` (B, L, T)."""
    return max((sum(aligned(n) for n in message_bytes(cfg, rows, (tokens, frames)).values())
                for rows, tokens, frames in shapes), default=ALIGN) or ALIGN


class SlotFile:
    """``count`` slots of ``size`` bytes in the file ``path``, mapped (``create``: made, of that size)."""

    def __init__(self, path: Path, count: int, size: int, create: bool = False) -> None:
        self.path, self.count, self.size = path, count, size
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:  # the memory itself, now: a full /dev/shm is an OSError here, not a SIGBUS at a write
                try:
                    os.posix_fallocate(fd, 0, count * size)
                except OSError:
                    path.unlink()
                    raise
            self._map = mmap.mmap(fd, count * size)
        finally:
            os.close(fd)

    def write(self, slot: int, arrays: Mapping[str, np.ndarray]) -> list[list[Any]]:
        """Copy ``arrays`` into ``slot``; their layout there: [name, dtype, shape, offset] each."""
        layout: list[list[Any]] = []
        at = slot * self.size
        end = at + self.size
        for name, array in arrays.items():
            if at + array.nbytes > end:
                raise SlotTooSmall(f"a batch of {sum(a.nbytes for a in arrays.values())} bytes, slots of {self.size}")
            np.copyto(np.ndarray(array.shape, array.dtype, buffer=self._map, offset=at), array, casting="no")
            layout.append([name, array.dtype.str, list(array.shape), at])
            at += aligned(array.nbytes)
        return layout

    def memory(self) -> tuple[int, int]:
        """The mapping's address in this process and its length (to page-lock it for a device's copies)."""
        whole = np.frombuffer(self._map, np.uint8)
        return whole.ctypes.data, whole.nbytes

    def views(self, layout: list[list[Any]]) -> dict[str, np.ndarray]:
        """The arrays of a slot as :meth:`write` laid them out: read-only views, nothing copied."""
        out = {}
        for name, dtype, shape, offset in layout:
            view = np.ndarray(tuple(shape), np.dtype(dtype), buffer=self._map, offset=offset)
            view.flags.writeable = False
            out[name] = view
        return out


__all__ = ["ALIGN", "SlotFile", "SlotTooSmall", "slot_bytes"]
