"""One owner per run directory: the lock file ``RUN_DIR/run.lock`` (shared/runfiles.py RUN_LOCK).

A run, a resume, Slurm's trainer task and ``stoker.Feed`` hold it while they write the
directory; a second owner is refused (:class:`RunLocked`) and a dead owner's lock taken over.
Who takes it and when: docs/design/checkpoints.md, "One owner per run directory".

How a lock is taken: the owner's record is written whole to a file of its own, then
hard-linked to the lock's name: ``link`` is atomic and fails when the name exists, on local
filesystems and NFS alike, so a lock file is never seen empty or half written. Where the
filesystem has no hard links, the file is created exclusively (``O_CREAT | O_EXCL``, atomic
on local filesystems and NFS v3 and later) and then written; an unreadable lock is honoured
for 5 s (``LOCK_WRITE_S``), the time such a write may take. Not ``fcntl``/``flock`` locks: on the
network filesystems run directories live on (NFS, Lustre, GPFS) they depend on a lock daemon
or a mount option, fail with ENOLCK/ENOSYS where those are missing, and an ``fcntl`` lock is
released when any descriptor of the file in the process closes; a created file also leaves
a record anyone can read to see who holds the lock. What it cannot do by itself is vanish
with a dead owner, hence:

- same host (its name and PID namespace: a container with the host's name but pids of its
  own counts as another host): the lock is honoured while its pid runs as the same process
  (its start time, from psutil, equal to the one written); a pid gone or reused by another
  process means the owner died (kill -9, a crash, a node reboot), and the next run takes the
  lock over with a log line;
- another host (pids mean nothing there): the owner refreshes the file's mtime every 10 s
  (``LOCK_HEARTBEAT_S``); a lock not refreshed for 120 s (``LOCK_STALE_S``) is stale and taken
  over.

Taking over moves the stale file aside with an atomic rename, checks that what moved is the
file judged stale (not a fresh lock another process made meanwhile, which is put back), and
creates a new one exclusively: of two processes taking over at once, one wins.

Limits (what the filesystem allows): the heartbeat compares this host's clock with an mtime
set by the file server (or the owner's host), so clocks apart by more than ``LOCK_STALE_S``,
or an owner frozen longer than that (SIGSTOP, a suspended job), let another host take the
lock over; two hosts with one hostname are taken for one (use distinct hostnames); a
filesystem without exclusive create (NFS v2) gives no guarantee. The owner notices a lock
taken from it at its next heartbeat and says so in the log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import errno
import json
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import psutil

from .errors import UserError
from .runfiles import RUN_LOCK, file_error

log = logging.getLogger("stoker.runlock")

# The owner refreshes its lock file's mtime this often (a thread of the owning process).
LOCK_HEARTBEAT_S = 10.0
# A lock of another host not refreshed for this long is stale (12 missed heartbeats: room for
# a loaded host, NFS attribute caching and some clock skew between hosts).
LOCK_STALE_S = 120.0
# psutil's process start times are exact to the clock tick; a reused pid starts later than this.
START_TOLERANCE_S = 1.0
# Attempts at taking a lock over before giving up (another process taking it over at once).
TAKE_OVER_ATTEMPTS = 3
# A lock file that is not an owner's record (empty, cut short, not JSON) is left alone this
# long after its mtime: a writer without hard links may be between its create and its write
# of ~150 bytes (milliseconds; seconds on a loaded NFS server). Older, it is no writer's.
LOCK_WRITE_S = 5.0


class RunLocked(UserError):
    """The run directory belongs to another live process (one line naming it)."""


@dataclasses.dataclass(frozen=True)
class LockOwner:
    """Who holds a run directory's lock."""

    host: str
    pid: int
    started_unix: float  # the process's start time (psutil create_time)
    token: str  # random: this holder, and no other, wrote the file
    pids: str = ""  # the PID namespace its pid belongs to ("" where the system has none)

    def describe(self) -> str:
        started = _dt.datetime.fromtimestamp(self.started_unix).isoformat(timespec="seconds")
        return f"host {self.host}, pid {self.pid} (started {started})"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self)) + "\n"

    @classmethod
    def parse(cls, raw: bytes) -> "LockOwner | None":
        """The owner a lock file names; None when it is not one (empty or cut short: damaged, or being
        written where the filesystem has no hard links)."""
        try:
            data = json.loads(raw.decode("utf-8"))
            return cls(str(data["host"]), int(data["pid"]), float(data["started_unix"]), str(data["token"]),
                       str(data.get("pids", "")))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def pid_namespace() -> str:
    """This process's PID namespace (``pid:[inode]``; "" where there is none to read)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_start(pid: int) -> float | None:
    """When process ``pid`` of this host started (unix time); None when no such process runs."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


def owner_gone(owner: LockOwner | None, age_s: float, host: str, pids: str = "",
               started: Callable[[int], float | None] = process_start) -> str | None:
    """Why the holder of a lock is gone, so that its lock may be taken over; None while it is
    honoured. ``owner``: what the file names (None: unreadable); ``age_s``: since its mtime;
    ``host``, ``pids``: this host's name and PID namespace; ``started``: a pid's start time
    here (None: not running)."""
    if owner is not None and owner.host == host and owner.pids == pids:
        now_started = started(owner.pid)
        if now_started is None:
            return f"pid {owner.pid} is not running"
        if abs(now_started - owner.started_unix) > START_TOLERANCE_S:
            return f"pid {owner.pid} is another process now"
        return None
    if owner is None and age_s > LOCK_WRITE_S:
        return f"the file names no owner {age_s:.0f} s after it was written"
    if age_s > LOCK_STALE_S:
        return f"not refreshed for {age_s:.0f} s (stale after {LOCK_STALE_S:.0f} s)"
    return None


class RunLock:
    """The lock of one run directory, held by this process (the module's docstring). Taken again in
    the process that holds it (the Slurm trainer task, then its launch), it is the same lock,
    released when the last taker releases it."""

    _held: dict[Path, "RunLock"] = {}
    _held_lock = threading.Lock()

    def __init__(self, path: Path, owner: LockOwner) -> None:
        self.path = path
        self.owner = owner
        self._takers = 1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="run-lock", daemon=True)

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike[str]) -> "RunLock":
        """Take ``run_dir``'s lock (making the directory if needed): RunLocked (one line) while
        another live process holds it; RunFileError (one line) when the file cannot be written."""
        path = Path(run_dir).expanduser().resolve() / RUN_LOCK
        with cls._held_lock:
            held = cls._held.get(path)
            if held is not None:
                held._takers += 1
                return held
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise file_error(exc, path.parent) or exc from None
            me = LockOwner(socket.gethostname(), os.getpid(), process_start(os.getpid()) or time.time(),
                           secrets.token_hex(8), pid_namespace())
            for _ in range(TAKE_OVER_ATTEMPTS):
                if _create(path, me):
                    lock = cls(path, me)
                    cls._held[path] = lock
                    lock._thread.start()
                    return lock
                _take_over_if_gone(path, me)
            raise RunLocked(f"run directory {path.parent}: its lock {path.name} changed hands {TAKE_OVER_ATTEMPTS} "
                            "times while this run tried to take it; another run is starting there")

    def release(self) -> None:
        """Give the lock up (the file is removed, if it is still this holder's)."""
        with self._held_lock:
            self._takers -= 1
            if self._takers > 0:
                return
            self._held.pop(self.path, None)
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if self._mine():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _mine(self) -> bool:
        try:
            return LockOwner.parse(self.path.read_bytes()) == self.owner
        except OSError:
            return False

    def refresh(self) -> bool:
        """One heartbeat: the file's mtime set to now (what other hosts judge it by); False, and
        said in the log, when the lock is no longer this holder's."""
        if not self._mine():
            log.error("the lock %s of this run was taken over by another process (%s): this run is no longer the "
                      "only one writing its run directory", self.path, _describe_file(self.path))
            return False
        try:
            os.utime(self.path)
        except OSError as exc:
            log.warning("cannot refresh the run directory's lock %s: %s", self.path, exc.strerror)
        return True

    def _beat(self) -> None:
        while not self._stop.wait(LOCK_HEARTBEAT_S) and self.refresh():
            pass


def _create(path: Path, me: LockOwner) -> bool:
    """Make the lock file holding ``me``, atomically and whole (the module's docstring): False when
    it exists."""
    record = path.with_name(f"{path.name}.{me.token}.new")
    try:
        _write_new(record, me)
        try:
            os.link(record, path)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in NO_HARD_LINKS:
                raise
            return _create_then_write(path, me)
        return True
    except OSError as exc:
        raise file_error(exc, path) or exc from None
    finally:
        with contextlib.suppress(OSError):
            record.unlink()


# What link() raises on a filesystem without hard links (FAT, some FUSE and SMB mounts).
NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})


def _write_new(path: Path, me: LockOwner) -> None:
    """``me`` into a file that must not exist yet, on disk before this returns."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(me.to_json())
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise


def _create_then_write(path: Path, me: LockOwner) -> bool:
    """The lock without hard links: created exclusively, then written (LOCK_WRITE_S covers
    the moment between): False when it exists."""
    try:
        _write_new(path, me)
    except FileExistsError:
        return False
    return True


def _describe_file(path: Path) -> str:
    try:
        owner = LockOwner.parse(path.read_bytes())
    except OSError:
        return "its lock is gone"
    return owner.describe() if owner is not None else "an unreadable lock"


def _take_over_if_gone(path: Path, me: LockOwner) -> None:
    """The lock at ``path`` exists: RunLocked while its owner is alive; else move it aside (the
    caller then creates its own). Returns also when the lock vanished meanwhile."""
    try:
        raw = path.read_bytes()
        age_s = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return  # released meanwhile: try again
    owner = LockOwner.parse(raw)
    why = owner_gone(owner, age_s, me.host, me.pids)
    if why is None:
        who = owner.describe() if owner is not None else "a run starting now (its lock is being written)"
        raise RunLocked(f"run directory {path.parent} is in use by {who}: wait for that run to end or stop it "
                        f"(a lock whose owner has died is taken over; {path.name} names the owner)")
    aside = path.with_name(f"{path.name}.{me.token}.stale")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another process took it over first: try again
    if aside.read_bytes() != raw:  # a fresh lock made in between: give it back
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        aside.unlink()
        return
    aside.unlink()
    log.warning("run directory %s: took over the lock of %s: %s", path.parent,
                owner.describe() if owner is not None else "an unreadable lock", why)
