"""shared/proc.py: a process's exit without the interpreter's teardown keeps what sys.exit does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
