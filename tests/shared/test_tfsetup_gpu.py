"""A GPU planned for a process that TensorFlow cannot use (the gpu extra not installed, no
driver) is one line for the user, not a silent run on the CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parents[2]
# It ends with os._exit: TensorFlow's interpreter teardown (~1 s) has nothing to show here.
SCRIPT = ("import os, sys; sys.path.insert(0, sys.argv[1])\n"
          "from stoker.shared.tfsetup import GpuUnavailable, configure_tensorflow\n"
          "try:\n"
          "    print(configure_tensorflow(None)[1])\n"
          "except GpuUnavailable as exc:\n"
          "    print('refused:', exc)\n"
          "sys.stdout.flush()\n"
          "os._exit(0)\n")


def configured(visible: str) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT)], capture_output=True, text=True, timeout=80,
                          env={"CUDA_VISIBLE_DEVICES": visible, "TF_CPP_MIN_LOG_LEVEL": "3", "PATH": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_planned_gpu_tensorflow_cannot_see_is_refused_in_one_line() -> None:
    import shutil

    if shutil.which("nvidia-smi"):
        pytest.skip("this host has an NVIDIA driver: GPU 0 may well be usable here")
    said = configured("0")
    assert said.startswith("refused: this process was given GPU 0") and "pip install 'stoker[gpu]'" in said
    assert "\n" not in said


def test_no_gpu_planned_is_the_cpu() -> None:
    assert configured("") == "/CPU:0"
