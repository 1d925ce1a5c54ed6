"""shared/tfsetup.py: native writes to stderr are hidden while TensorFlow loads, and only then."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    from stoker.shared.tfsetup import native_stderr_quiet
    os.write(2, b"before\\n")
    with native_stderr_quiet({enabled}):
        os.write(2, b"native inside\\n")
        print("python inside", file=sys.stderr)
    os.write(2, b"after\\n")
    try:
        with native_stderr_quiet({enabled}):
            raise ValueError("from inside")
    except ValueError as exc:
        print("caught", exc, file=sys.stderr)
    os.write(2, b"end\\n")
""")


def _stderr(enabled: bool) -> str:
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(root=root, enabled=enabled)], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_quiet_hides_native_and_python_writes_inside_only() -> None:
    assert _stderr(True).splitlines() == ["before", "after", "caught from inside", "end"]


def test_off_hides_nothing() -> None:
    assert _stderr(False).splitlines() == ["before", "native inside", "python inside", "after", "caught from inside",
                                           "end"]
