"""stoker as a package: the built wheel, installed into a fresh virtual environment, runs from
another directory with its own default config and demo data (``stoker --steps 20``,
``stoker produce --help``), under its one import name.

The environment sees the site-packages of the interpreter running the tests for the
dependencies (TensorFlow and the rest are not downloaded again), whether that is the
system's or a virtual environment's, and the wheel is installed without them; the stoker
it runs is the wheel's, which the test checks.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

PROJECT = Path(__file__).resolve().parents[1]


def run(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def see_dependencies(python: Path) -> None:
    """Let the environment of ``python`` import what this interpreter imports, after its own
    packages: each site directory of this interpreter (the system's, or a virtual environment's,
    whose base interpreter's `--system-site-packages` would not hold them) added by a .pth file,
    through site.addsitedir so that its own .pth files count too."""
    ours = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=python.parent)
    assert purelib.returncode == 0, purelib.stderr
    lines = [f"import site; site.addsitedir({path!r})" for path in ours if Path(path).is_dir()]
    (Path(purelib.stdout.strip()) / "stoker_test_dependencies.pth").write_text("\n".join(lines) + "\n")


def test_the_wheel_installs_and_runs_from_anywhere(tmp_path: Path) -> None:
    # Built from a copy of the tracked files: a build in the checkout would leave build/ there.
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=PROJECT, capture_output=True, check=True).stdout
    source = tmp_path / "source"
    for name in filter(None, tracked.decode().split("\0")):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(PROJECT / name, source / name, follow_symlinks=False)  # stoker/shared -> ../shared stays a link
    wheels = tmp_path / "wheels"
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(source)],
                cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel, = wheels.glob("stoker-*.whl")
    venv = tmp_path / "venv"
    made = run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)  # this pip installs into it
    assert made.returncode == 0, made.stderr
    python, stoker = venv / "bin" / "python", venv / "bin" / "stoker"
    see_dependencies(python)
    installed = run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                    cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = run([str(python), "-c", "import stoker, stoker.shared.config as c; print(stoker.__file__); "
                 "print(c.DEFAULT_CONFIG); import importlib.util as u; print(u.find_spec('shared'))"], cwd=elsewhere)
    package_file, config, shared = where.stdout.split("\n")[:3]
    assert package_file.startswith(str(venv)) and config.startswith(str(venv)), where.stdout
    assert shared == "None"  # no generic top-level name in site-packages
    helped = run([str(stoker), "produce", "--help"], cwd=elsewhere)
    assert helped.returncode == 0 and "--connect" in helped.stdout, helped.stderr
    # The pipeline from the package, on its demo data; the model does not matter here.
    trained = run([str(stoker), "--steps", "20", "--run-dir", "run", "--model-start-delay", "0",
                   "--model", "synthetic:1"], cwd=elsewhere)
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = json.loads((elsewhere / "run" / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["exit_reason"] == "completed"
    assert summary["clips"] == 64  # the demo data, from the package
    assert not (elsewhere / "configs").exists() and str(PROJECT) not in (elsewhere / "run" / "config.yaml").read_text()
