"""Process plumbing shared by the launcher and its children.

Status channel: each child gets the write end of a pipe (``--status-fd``) and writes
one JSON object per line: ``{"event": "ready", ...}``, ``{"event": "error", "type",
"message", "where", "user_error"}``. Exceptions thus cross the process boundary as
data (as PyTorch's ExceptionWrapper) and the launcher reports them in one line.

Dead parent: children are started in their own session (so a terminal's Ctrl-C reaches
only the launcher, which runs the shutdown protocol), ask the kernel for SIGTERM when
the launcher dies (PR_SET_PDEATHSIG), and also compare ``os.getppid()`` with the pid
they were given, for platforms without prctl.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import signal
import site
import sys
import sysconfig
import threading
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any, Mapping

import zmq

log = logging.getLogger(__name__)

# The directory that holds the stoker package (a checkout's root, or site-packages), and the
# package's own file: a child must import this stoker, not another the interpreter can find.
# Through the package's own module: an editable install maps stoker.shared to a folder beside stoker/.
STOKER_INIT = Path(sys.modules[__name__.partition(".")[0]].__file__ or "__init__.py").resolve()
PACKAGE_PARENT = STOKER_INIT.parent.parent

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# glibc's malloc.h: mallopt's parameters, and the ceiling of its dynamic mmap threshold on 64 bits.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
GLIBC_MMAP_THRESHOLD_MAX_BYTES = 32 << 20

# Exit statuses of run.py and its children: finished, trainer failed, user error, interrupted.
EXIT_OK, EXIT_FAILED, EXIT_USER, EXIT_INTERRUPTED = 0, 1, 2, 130

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(role)s %(name)s: %(message)s"


class _RoleFilter(logging.Filter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = self.role
        return True


def setup_logging(role: str, level: str = "INFO") -> None:
    """Plain, levelled log lines on stderr, tagged with the process role."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RoleFilter(role))
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # TensorFlow's absl logger reports routine internals at INFO (checkpoint sharding times).
    logging.getLogger("absl").setLevel(max(logging.WARNING, root.level))


class StatusWriter:
    """Write JSON events to the launcher; a missing fd makes every call a no-op."""

    def __init__(self, fd: int | None) -> None:
        self._file = os.fdopen(fd, "w", buffering=1) if fd is not None and fd >= 0 else None
        self._lock = threading.Lock()

    def send(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        with self._lock:
            try:
                self._file.write(json.dumps({"event": event, **fields}) + "\n")
            except (BrokenPipeError, OSError):
                self._file = None  # the launcher is gone; the parent-death watch will stop us

    @property
    def connected(self) -> bool:
        return self._file is not None

    def error(self, exc: BaseException, where: str, user_error: bool = False) -> None:
        self.send("error", type=type(exc).__name__, message=str(exc), where=where, user_error=user_error)


def die_with_parent(parent_pid: int | None) -> None:
    """Ask Linux to SIGTERM this process when its parent dies; check it has not already."""
    if parent_pid is None:
        return
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            log.debug("prctl unavailable; relying on getppid checks")
    if os.getppid() != parent_pid:
        raise SystemExit(f"parent {parent_pid} already gone")


def parent_alive(parent_pid: int | None) -> bool:
    return parent_pid is None or os.getppid() == parent_pid


def glibc() -> bool:
    """This process's C library is glibc."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError):  # a platform without the name
        return False


def steady_heap() -> bool:
    """Have glibc's malloc keep the freed top of its heap instead of handing it back to the
    kernel at each free: a training step frees and re-allocates the same large tensors every
    step, and each hand-back is faulted in again on the next (docs/design/processes.md,
    "The trainer's heap"). The values are glibc's own dynamic ceiling and its rule for the trim threshold,
    fixed from the start instead of reached only after a large free. False where the C
    library is not glibc."""
    if not glibc():
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD_MAX_BYTES)
                and libc.mallopt(M_TRIM_THRESHOLD, 2 * GLIBC_MMAP_THRESHOLD_MAX_BYTES))


def flush_sockets(timeout_s: float) -> None:
    """Let the last messages (STOP, BYE) leave before the process exits.

    Closing a socket with a linger queues its messages for the ZeroMQ I/O thread; only
    terminating the context waits for them. It blocks while any socket is still open,
    so it runs in a helper thread and is given up after ``timeout_s``.
    """
    ctx = zmq.Context.instance()
    done = threading.Thread(target=ctx.term, name="zmq-term", daemon=True)
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        log.debug("sockets still open after %.1f s; exiting without flushing them", timeout_s)


def exit_without_teardown(code: int) -> None:
    """Exit with ``code`` as ``sys.exit`` would, less the interpreter's teardown of every module:
    with TensorFlow loaded that teardown takes over a second and has nothing left to do (the
    run's files are closed and its sockets flushed by then). The exit handlers still run and
    the standard streams are flushed; while a thread the interpreter would wait for is alive,
    this is the ordinary exit."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def install_stop_handlers(event: threading.Event) -> None:
    """SIGTERM and SIGINT set ``event``; the process then stops at its next check."""

    def handler(signum: int, _frame: Any) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        event.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def with_stoker_path(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with :data:`PACKAGE_PARENT` on PYTHONPATH only where a child would not import this
    stoker without it, so that a user's own module named ``shared``, ``producer`` or ``tests``
    is not shadowed by a checkout's folders of those names.

    A child (``python -m stoker....``) looks for ``stoker`` in its current directory, then in
    PYTHONPATH's entries, then in site-packages and through the finders installed there (an
    editable install's). Where that ends at this stoker (a wheel, an editable install of this
    checkout, an entry holding it), ``env`` is returned as it is. Otherwise (this checkout run as
    ``python run.py`` while the editable install names another git worktree of it, or no
    stoker is installed) the directory goes after the user's entries, or just before the first
    that holds another stoker: every entry ahead of it then holds none, so the child's stoker is
    this one and the user's modules in those entries still come first. The current directory is
    not looked at: it comes first whatever PYTHONPATH says, so where it holds this stoker the
    added entry changes nothing, and where it holds another nothing on PYTHONPATH could win.
    A directory that a .pth file adds is not looked at either: a stoker found only there gets
    the entry, which is correct, merely not needed."""
    out = dict(env)
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    at = len(entries)
    for index, entry in enumerate(entries):
        found = _stoker_in([str(Path(entry).resolve())])
        if found == STOKER_INIT:
            return out
        if found is not None:
            at = index
            break
    else:
        if _installed_stoker() == STOKER_INIT:
            return out
    out["PYTHONPATH"] = os.pathsep.join([*entries[:at], str(PACKAGE_PARENT), *entries[at:]])
    return out


def caller_path() -> list[str]:
    """This process's import path as a child started by it needs it on PYTHONPATH to import the
    same user modules: the directories on ``sys.path``, in its order (the script's directory or
    the current one first; ``""`` is the current directory), absolute, without those a child's
    interpreter puts there itself (the standard library, site-packages and the directories their
    .pth files add), which PYTHONPATH would move ahead of the standard library."""
    own = _interpreter_paths()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    out: list[str] = []
    for entry in sys.path:
        path = Path(entry or os.getcwd()).resolve()
        if not path.is_dir() or path in own or path.is_relative_to(stdlib):
            continue
        if str(path) not in out:
            out.append(str(path))
    return out


def _interpreter_paths() -> set[Path]:
    """The directories a child's interpreter puts on its path by itself: site-packages (the user's
    too) and the directories listed in their .pth files."""
    sites = [Path(p) for p in (*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE
                                                          else []))]
    own = {p.resolve() for p in sites}
    for folder in sites:
        for pth in sorted(folder.glob("*.pth")) if folder.is_dir() else ():
            try:
                lines = pth.read_text(encoding="utf-8", errors="replace").splitlines()
            except OSError:
                continue  # site skips a .pth file it cannot read too
            own.update((folder / line.strip()).resolve() for line in lines
                       if line.strip() and not line.startswith(("#", "import ", "import\t")))
    return own


def _stoker_in(directories: list[str]) -> Path | None:
    """The file of the ``stoker`` package (or module) found first in ``directories``, or None."""
    origin = getattr(PathFinder.find_spec("stoker", directories), "origin", None)
    return Path(origin).resolve() if origin else None


def _installed_stoker() -> Path | None:
    """The file of the ``stoker`` a child finds past PYTHONPATH: in site-packages, or through a
    finder that site-packages' .pth files installed (this process ran them too)."""
    sites = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    for finder in sys.meta_path:
        if finder is PathFinder:
            found = _stoker_in(sites)
        else:
            spec = finder.find_spec("stoker", None) if hasattr(finder, "find_spec") else None
            found = Path(spec.origin).resolve() if getattr(spec, "origin", None) else None
        if found is not None:
            return found
    return None
