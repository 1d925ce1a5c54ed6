"""A host's epoch plans in files that every process of the host maps.

The trainer process, its coordinator process and every trainer worker (torchrun rank) of a host
plan the same global epochs. The first of them to want an epoch's plan makes it under the
directory's lock and writes its arrays to a file (the index cache's format: checksummed sections,
shared/dataset/cache.py), keyed by the plan's key and the epoch; the others, and later runs of
the same plan, map that file instead of planning again, so the plan's pages are the page cache's,
held once for the host. Files of epochs well behind the one written are removed (a process that
mapped one keeps it). docs/design/scheduling.md, "A host's plans", tells the long story.
"""

from __future__ import annotations

import fcntl
import logging
import time
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from ..shared.dataset.cache import open_index, write_index
from ..shared.runfiles import replacing

log = logging.getLogger(__name__)

# The directory beside the index cache file that holds the plan files.
PLANS_DIR = "plans"
SUFFIX = ".plan"
LOCK = ".lock"
# What a plan file's header says it is (with its name).
KIND = "stoker-plan"
# The name of a buckets file: their key, then this.
BUCKETS = "-buckets"
# A plan file of the same key this many epochs behind the one written is removed.
EPOCHS_KEPT_BEHIND = 2
# A plan file of another key not touched for this long is removed (a run of other settings, gone).
OTHER_KEYS_KEPT_S = 7 * 24 * 3600.0


Arrays = Mapping[str, np.ndarray]


class PlanFiles:
    """The plan files of one directory (module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._warned = False

    def path(self, name: str) -> Path:
        return self.directory / f"{name}{SUFFIX}"

    def epoch(self, key: str, epoch: int, make: Callable[[], Arrays]) -> Arrays:
        """The arrays of ``epoch``'s plan of key ``key`` (:meth:`get`); this key's files of epochs
        well behind it removed when it is written."""
        return self.get(f"{key}-{epoch}", make, lambda: self._prune(key, epoch))

    def get(self, name: str, make: Callable[[], Arrays], written: Callable[[], None] | None = None) -> Arrays:
        """The arrays of file ``name``: mapped from it, else made by ``make`` under the directory's
        lock (another process making them meanwhile is waited for), written (then ``written``
        called) and mapped. Where the directory cannot be written, made here (logged once)."""
        path = self.path(name)
        found = self._open(path, name)
        if found is not None:
            return found
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(self.directory / LOCK, "a+b") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                found = self._open(path, name)  # made by another process while this one waited
                if found is None:
                    made = {key: np.ascontiguousarray(a) for key, a in make().items()}
                    header = {"kind": KIND, "name": name, "dtypes": {key: a.dtype.str for key, a in made.items()}}
                    with replacing(path) as tmp:
                        with open(tmp, "wb") as f:
                            write_index(f, header, made)
                    if written is not None:
                        written()
                    found = self._open(path, name)
                    if found is None:
                        return made
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("cannot keep the epoch plans in %s (%s); each process plans its own", self.directory,
                            exc.strerror or exc)
            return make()
        return found

    def _open(self, path: Path, name: str) -> Arrays | None:
        """The arrays of the plan file at ``path``, mapped; None when there is none or it is not
        this plan's (a damaged one is logged, then made again)."""
        try:
            cached = open_index(path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("epoch plan file %s is unusable (%s); planning the epoch again", path, exc)
            return None
        header = cached.header
        if (header.get("kind"), header.get("name")) != (KIND, name):
            return None
        dtypes = header["dtypes"]
        return {name: np.frombuffer(view, np.dtype(dtypes[name])) for name, view in cached.sections.items()}

    def _prune(self, key: str, epoch: int) -> None:
        """Remove this key's files of epochs EPOCHS_KEPT_BEHIND behind ``epoch``, and other keys'
        files not touched for OTHER_KEYS_KEPT_S."""
        now = time.time()
        for path in self.directory.glob(f"*{SUFFIX}"):
            name, _, number = path.stem.rpartition("-")
            try:
                stale = (int(number) < epoch - EPOCHS_KEPT_BEHIND if name == key and number.isdigit()
                         else now - path.stat().st_mtime > OTHER_KEYS_KEPT_S)
                if stale:
                    path.unlink()
            except (ValueError, OSError):
                continue

