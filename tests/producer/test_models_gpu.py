"""PyTorch and JAX producer models on a real data GPU (tests/gpu.sh runs them on a GPU host):
a producer's child, pinned to one GPU the launcher's way, runs its model on that card within
its memory share (tests/producer/test_models_torch.py checks the same choices against a fake
GPU on any host)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stoker.devices import child_env
from tests.gpus import CHILD_START_S, jax_with_cuda, nvml_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(300)]

PROJECT = Path(__file__).resolve().parents[2]
MEMORY_MB = 2048


def run_child(framework: str) -> dict[str, Any]:
    """The models_gpu_child's report, pinned to the last GPU (not CUDA's default device 0)."""
    env = child_env(os.environ, nvml_gpus()[-1].index)
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "tests.producer.models_gpu_child", framework, str(MEMORY_MB)],
                          capture_output=True, text=True, env=env, cwd=PROJECT, timeout=CHILD_START_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_torch_model_runs_on_the_pinned_gpu_within_its_memory_share(tmp_path, monkeypatch) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("PyTorch is not installed on this GPU host")
    monkeypatch.setenv("NEURAL_FEATURES_WEIGHTS", str(tmp_path / "weights"))
    report = run_child("torch")
    assert report["visible"] == str(nvml_gpus()[-1].index) and report["framework"] == "torch"
    assert report["device"] == "cuda:0"
    assert report["fraction"] == pytest.approx(MEMORY_MB / report["total_mb"])
    assert report["error"] <= 1e-5


def test_a_jax_model_runs_on_the_pinned_gpu_within_its_memory_share() -> None:
    if not jax_with_cuda():
        pytest.skip("JAX with CUDA (jax[cuda13] or jax[cuda12]) is not installed on this GPU host")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("PyTorch is not installed on this GPU host (the test models' module imports it)")
    report = run_child("jax")
    assert report["device"] == "gpu" and report["framework"] == "jax"
    assert float(report["fraction"]) == pytest.approx(MEMORY_MB / nvml_gpus()[-1].memory_total_mb, abs=1e-4)
    assert len(report["score"]) == 3
