"""shared/proc.py: a process's exit without the interpreter's teardown keeps what sys.exit does; a
steady heap is not handed back to the kernel and faulted in again at every step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.shared.proc import glibc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]  # starts interpreters

ROOT = Path(__file__).resolve().parents[2]
EXITING = """
import atexit, sys, threading
sys.path.insert(0, sys.argv[1])
from stoker.shared.proc import exit_without_teardown

atexit.register(lambda: print("exit handler ran"))
print("written before the exit", end=" ")
sys.stderr.write("and to stderr")
if sys.argv[2] == "thread":  # alive until the interpreter's shutdown, which must wait for it
    threading.Thread(target=lambda: (threading.main_thread().join(), print("thread done", end=" "))).start()
exit_without_teardown(3)
print("never")
"""


@pytest.mark.parametrize("case", ["plain", "thread"])
def test_exit_without_teardown_keeps_the_status_the_streams_and_the_exit_handlers(case: str) -> None:
    done = subprocess.run([sys.executable, "-c", EXITING, str(ROOT), case], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 3
    expected = "written before the exit " + ("thread done " if case == "thread" else "") + "exit handler ran\n"
    assert done.stdout == expected and done.stderr == "and to stderr"


HEAP = """
import resource, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from stoker.shared.proc import steady_heap

if sys.argv[2] == "steady":
    assert steady_heap()

def step():  # as a training step's activations: allocated, then freed at the heap's top
    arrays = [np.ones(1 << 18, np.float32) for _ in range(24)]
    del arrays

step(), step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
STEP_PAGES = 24 * (1 << 20) // os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not glibc(), reason="steady_heap tunes glibc's malloc; this C library is another")
def test_a_steady_heap_is_not_faulted_in_again_at_every_step() -> None:
    faults = {}
    for case in ("glibc's own", "steady"):
        done = subprocess.run([sys.executable, "-c", HEAP, str(ROOT), case], capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 0, done.stderr
        faults[case] = int(done.stdout)
    # glibc's own thresholds hand the freed top back and fault it in again: most of every step's pages
    assert faults["glibc's own"] > 5 * STEP_PAGES // 2
    assert faults["steady"] < STEP_PAGES // 10


def test_caller_path_is_the_users_directories_in_order_without_the_interpreters_own(tmp_path, monkeypatch) -> None:
    import site
    import sysconfig

    from stoker.shared.proc import caller_path

    first, later = tmp_path / "script", tmp_path / "appended"
    first.mkdir()
    later.mkdir()
    monkeypatch.chdir(tmp_path)
    stdlib = sysconfig.get_paths()["stdlib"]
    monkeypatch.setattr(sys, "path", [str(first), "", stdlib, *site.getsitepackages(), str(tmp_path / "gone"),
                                      str(tmp_path / "file.zip"), str(later), str(first)])
    assert caller_path() == [str(first.resolve()), str(tmp_path.resolve()), str(later.resolve())]
