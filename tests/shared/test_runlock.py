"""shared/runlock.py: one owner per run directory. The judgement of a lock is a pure function
(owner_gone); the lock itself is tested against a holder in another process."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from stoker.shared.runfiles import RUN_LOCK
from stoker.shared.runlock import (LOCK_STALE_S, LOCK_WRITE_S, LockOwner, RunLock, RunLocked, owner_gone, pid_namespace,
                                   process_start)
from tests.procs import holding_run_lock

HOST = "here"
OWNER = LockOwner(HOST, 4242, 1000.0, "t0")


def test_owner_on_this_host_is_honoured_while_its_pid_runs_as_the_same_process() -> None:
    assert owner_gone(OWNER, 1e6, HOST, started=lambda pid: 1000.3) is None  # alive: however old its heartbeat
    assert owner_gone(OWNER, 0.0, HOST, started=lambda pid: None) == "pid 4242 is not running"
    assert owner_gone(OWNER, 0.0, HOST, started=lambda pid: 5000.0) == "pid 4242 is another process now"


def test_owner_on_another_host_is_honoured_until_its_heartbeat_is_stale() -> None:
    never = lambda pid: pytest.fail("a pid of another host is never looked up")  # noqa: E731
    assert owner_gone(OWNER, LOCK_STALE_S - 1, "elsewhere", started=never) is None
    assert "not refreshed for" in owner_gone(OWNER, LOCK_STALE_S + 1, "elsewhere", started=never)
    # A container with the host's name but pids of its own: its pids mean nothing here either.
    assert owner_gone(OWNER, LOCK_STALE_S - 1, HOST, "pid:[4026532999]", started=never) is None
    # A file naming no owner may be between its create and its write (no hard links): honoured as long as that takes.
    assert owner_gone(None, 1.0, HOST, started=never) is None
    assert "names no owner" in owner_gone(None, LOCK_WRITE_S + 1, HOST, started=never)


@pytest.mark.timeout(60)
def test_a_second_owner_is_refused_naming_the_first_and_takes_it_once_released(tmp_path) -> None:
    run_dir = tmp_path / "run"
    with holding_run_lock(run_dir) as child:
        with pytest.raises(RunLocked) as refused:
            RunLock.acquire(run_dir)
        line = str(refused.value)
        assert f"host {socket.gethostname()}, pid {child.pid}" in line and "\n" not in line
    assert not (run_dir / RUN_LOCK).exists()  # released: removed
    with RunLock.acquire(run_dir) as lock:
        assert RunLock.acquire(run_dir) is lock  # taken again in this process: the same lock
        lock.release()
        assert json.loads((run_dir / RUN_LOCK).read_text())["pid"] == os.getpid()
    assert not (run_dir / RUN_LOCK).exists()


def _write_lock(run_dir, owner: LockOwner, age_s: float = 0.0) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_LOCK).write_text(owner.to_json())
    then = time.time() - age_s
    os.utime(run_dir / RUN_LOCK, (then, then))


@pytest.mark.timeout(60)
def test_a_lock_of_a_dead_or_reused_pid_is_taken_over_with_a_log_line(tmp_path, caplog) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(dead.pid).create_time()
    dead.wait(timeout=30)
    host = socket.gethostname()
    cases = {"dead": LockOwner(host, dead.pid, started, "a", pid_namespace()),
             "reused": LockOwner(host, os.getpid(), process_start(os.getpid()) - 3600, "b", pid_namespace())}
    for name, owner in cases.items():
        run_dir = tmp_path / name
        _write_lock(run_dir, owner)
        with caplog.at_level(logging.WARNING, logger="stoker.runlock"):
            lock = RunLock.acquire(run_dir)
        assert lock.owner.pid == os.getpid() and LockOwner.parse((run_dir / RUN_LOCK).read_bytes()) == lock.owner
        assert f"took over the lock of host {host}, pid {owner.pid}" in caplog.text
        lock.release()
        assert sorted(p.name for p in run_dir.iterdir()) == []  # nothing left aside


@pytest.mark.parametrize("links", [True, False], ids=["hard-links", "no-hard-links"])
def test_a_lock_file_is_whole_from_its_first_moment_and_an_empty_one_is_taken_over(tmp_path, monkeypatch,
                                                                                    links) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / RUN_LOCK).write_bytes(b"")  # a writer that died between create and write
    then = time.time() - LOCK_WRITE_S - 1
    os.utime(run_dir / RUN_LOCK, (then, then))
    seen: list[bytes] = []
    real_link = os.link

    def link(src, dst):  # what another process reading the lock would see the moment it appears
        if not links:
            raise OSError(errno.EPERM, "Operation not permitted")
        real_link(src, dst)
        seen.append((run_dir / RUN_LOCK).read_bytes())

    monkeypatch.setattr(os, "link", link)
    with RunLock.acquire(run_dir) as lock:
        assert LockOwner.parse((run_dir / RUN_LOCK).read_bytes()) == lock.owner
        assert [LockOwner.parse(raw) for raw in seen] == ([lock.owner] if links else [])
        assert sorted(p.name for p in run_dir.iterdir()) == [RUN_LOCK]  # no record or stale file left beside it
    assert sorted(run_dir.iterdir()) == []


def test_another_hosts_lock_is_honoured_until_stale(tmp_path) -> None:
    run_dir = tmp_path / "run"
    _write_lock(run_dir, LockOwner("node-b", 7, 1000.0, "c"), age_s=10.0)
    with pytest.raises(RunLocked, match="in use by host node-b, pid 7"):
        RunLock.acquire(run_dir)
    os.utime(run_dir / RUN_LOCK, (0, time.time() - LOCK_STALE_S - 5))
    RunLock.acquire(run_dir).release()


def test_the_heartbeat_refreshes_the_lock_and_notices_it_taken(tmp_path, caplog) -> None:
    with RunLock.acquire(tmp_path / "run") as lock:
        os.utime(lock.path, (0, 1000.0))
        refreshed = time.time()
        assert lock.refresh() and lock.path.stat().st_mtime >= refreshed - 1  # now (to the clock's tick), not 1970
        _write_lock(lock.path.parent, LockOwner("node-b", 7, 1000.0, "d"))  # taken over by another host
        with caplog.at_level(logging.ERROR, logger="stoker.runlock"):
            assert not lock.refresh()
        assert "taken over by another process (host node-b, pid 7" in caplog.text
    assert (lock.path.parent / RUN_LOCK).exists()  # release leaves another holder's lock alone
