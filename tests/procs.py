"""Running ``python run.py`` from tests: output lines, waits with deadlines, no orphans."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import psutil

ROOT = Path(__file__).resolve().parent.parent


class RunProcess:
    """``python run.py ARGS`` with its stderr+stdout lines collected by a reader thread."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, prefix: list[str] | None = None) -> None:
        # prefix: a command that execs the rest, e.g. ``ip netns exec NS`` (same pid, so no orphans)
        self.argv = [*(prefix or []), sys.executable, str(ROOT / "run.py"), *args]
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     cwd=ROOT, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.descendants: dict[int, psutil.Process] = {}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for_line(self, pattern: str, timeout: float, count: int = 1) -> str:
        """Block until ``count`` lines match ``pattern``; return the last; fail with the output so far if not."""
        regex = re.compile(pattern)
        seen = 0
        for line in self.lines:
            if regex.search(line):
                seen += 1
                if seen == count:
                    return line
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n" + self.output())
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"process ended before a line matched {pattern!r}:\n" + self.output())
            self.lines.append(line)
            if regex.search(line):
                seen += 1
                if seen == count:
                    return line

    def remember_children(self) -> dict[int, psutil.Process]:
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.descendants[child.pid] = child
        except psutil.NoSuchProcess:
            pass
        return self.descendants

    def _drain(self) -> None:
        """Move the lines read so far into ``lines``, without waiting."""
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                return
            if line is not None:
                self.lines.append(line)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        self._drain()
        return code

    def output(self) -> str:
        self._drain()
        return "\n".join(self.lines[-80:])

    def alive_descendants(self) -> list[psutil.Process]:
        return [p for p in self.descendants.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    def kill(self) -> None:
        """Clean-up for a failed test: kill the launcher and every child it started."""
        self.remember_children()
        for p in [*self.descendants.values()]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def __enter__(self) -> "RunProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


# free_port picks below the kernel's ephemeral range (where a connection's own end gets its
# port), from this port up: a port a test binds again later (a resumed job's endpoint) is then
# not taken meanwhile by some connection of another test running beside it.
PORT_FLOOR = 10_000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
EPHEMERAL_LOW_DEFAULT = 32_768  # Linux's default, where the range cannot be read
FREE_PORT_TRIES = 100


def free_port() -> int:
    """A TCP port free on the loopback interface now, below the ephemeral range (PORT_FLOOR)."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = EPHEMERAL_LOW_DEFAULT
    pick = random.SystemRandom()
    for _ in range(FREE_PORT_TRIES if low > PORT_FLOOR else 0):
        port = pick.randrange(PORT_FLOOR, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no such range here, or every try taken: the OS picks
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python run.py ARGS`` from the project root; ``env``: variables added to this one's."""
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, stdin=subprocess.DEVNULL,
                          env={**os.environ, **env} if env else None)


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# A process that holds a run directory's lock (shared/runlock.py) until its stdin closes.
_LOCK_HOLDER = ("import sys; from stoker.shared.runlock import RunLock\n"
                "lock = RunLock.acquire(sys.argv[1]); print('held', flush=True); sys.stdin.read(); lock.release()")


@contextlib.contextmanager
def holding_run_lock(run_dir: Path, timeout: float = 30) -> Iterator[subprocess.Popen]:
    """Another process owns ``run_dir`` (its lock taken) for the duration; it releases it on exit."""
    child = subprocess.Popen([sys.executable, "-c", _LOCK_HOLDER, str(run_dir)], cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        yield child
        child.communicate("", timeout=timeout)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=timeout)
