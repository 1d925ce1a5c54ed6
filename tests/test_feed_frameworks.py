"""The PyTorch and JAX loops of docs/FEED.md train for real on the demo data, with no
TensorFlow anywhere: docs/examples/torch_loop.py and jax_loop.py, each killed with SIGKILL
right after a checkpoint and run again, resume from their own checkpoint (torch.save read
with torch.load(weights_only=True); an .npz read without pickle) and train every clip but
the held-out ones once per epoch, as counted inside their training step (tests/trained.py).
Their loss goes down, every batch value is the framework's own type, and neither the loop's
process nor any producer process imported TensorFlow (its modules; its libraries mapped into
the producers, /proc/PID/maps)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.gpus import jax_with_cuda
from tests.procs import read_json, read_jsonl
from tests.trained import check_trained, clips_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROJECT = Path(__file__).resolve().parents[1]
DEMO_IDS = {line.split("|")[0] for line in (PROJECT / "data" / "demo" / "metadata.csv").read_text().splitlines()}
EPOCHS = 2
KILL_AT = 3  # mid-epoch 0: the demo's 60 training clips are 4 batches of 16 an epoch


def run_user(framework: str, report: Path, argv: list[str], kill_at: int = 0) -> subprocess.CompletedProcess:
    """``python -m tests.framework_user`` (the example with its steps noted); its producers gone after it."""
    env = {**os.environ, "KILL_AT_STEP": str(kill_at)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.framework_user", framework, str(report), *argv],
                            cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    producers = [p for p in psutil.process_iter(["cmdline"])
                 if f"--parent-pid {proc.pid}" in " ".join(p.info["cmdline"] or [])]
    _, alive = psutil.wait_procs(producers, timeout=10)
    assert not alive, f"producers outlived their feed: {[p.pid for p in alive]}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def check_no_tensorflow(report: dict) -> None:
    assert report["modules"] == [], f"the loop's process imported {report['modules'][:5]}"
    assert report["producers"], "no producer process was found to check"
    for pid, libraries in report["producers"].items():
        assert libraries == [], f"producer {pid} loaded {len(libraries)} TensorFlow libraries: {libraries[:3]}"


@pytest.mark.parametrize("framework, checkpoint", [("torch", "ckpt.pt"), ("jax", "ckpt.npz")])
def test_example_loop_killed_after_a_checkpoint_resumes_and_trains_every_clip_once_without_tensorflow(
        tmp_path: Path, framework: str, checkpoint: str) -> None:
    pytest.importorskip(framework)
    run_dir = tmp_path / "run"
    argv = ["--epochs", str(EPOCHS), "--run-dir", str(run_dir), "--checkpoint", str(tmp_path / checkpoint),
            "--checkpoint-every", str(KILL_AT)]
    killed = run_user(framework, tmp_path / "killed.json", argv, kill_at=KILL_AT)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run_user(framework, tmp_path / "resumed.json", argv)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"the feed goes on from step {KILL_AT}" in resumed.stdout, resumed.stdout

    first, second = (json.loads((tmp_path / name).read_text()) for name in ("killed.json", "resumed.json"))
    assert [s["step"] for s in first["steps"]] == list(range(1, KILL_AT + 1))  # what the checkpoint holds
    held_out = set(read_json(run_dir / "validation.json")["ids"])
    assert len(held_out) == 4
    check_trained(first["steps"] + second["steps"], clips_of(run_dir), EPOCHS, DEMO_IDS - held_out)
    for report in (first, second):
        assert report["foreign"] == [] and report["types"], report["types"]
        check_no_tensorflow(report)
        if framework == "torch":  # on the CPU: the slots' memory wrapped in the loop's thread, no stager
            assert report["devices"] == ["cpu"] and "stager" not in report["threads"], report["threads"]
    assert "validation loss" in resumed.stdout  # each epoch's end: a pass over the held-out clips
    check_learned(run_dir)


def check_learned(run_dir: Path) -> None:
    """The run's metrics: each step once (across a kill), the loss down by a fifth at least."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, EPOCHS * 4 + 1))
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"], [r["loss"] for r in rows]


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_the_loop_on_a_gpu_trains_every_clip_once_staged_between_steps(tmp_path: Path, framework: str) -> None:
    """On a GPU host the example's batches are on cuda:0, staged in the loop's thread between
    steps (no stager thread; PyTorch's copies read the slots page-locked for CUDA, JAX's puts
    are waited for before each slot's release), each row the clip its id says and every clip
    once per epoch, as counted inside the step."""
    pytest.importorskip(framework)
    if framework == "jax" and not jax_with_cuda():
        pytest.skip("JAX with CUDA (jax[cuda13] or jax[cuda12]) is not installed on this GPU host")
    run_dir = tmp_path / "run"
    done = run_user(framework, tmp_path / "report.json", ["--epochs", str(EPOCHS), "--run-dir", str(run_dir)])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert "could not be page-locked" not in done.stdout + done.stderr
    assert report["devices"] == ["cuda:0"] and "stager" not in report["threads"], (report["devices"], report["threads"])
    held_out = set(read_json(run_dir / "validation.json")["ids"])
    check_trained(report["steps"], clips_of(run_dir), EPOCHS, DEMO_IDS - held_out)
    check_no_tensorflow(report)
    check_learned(run_dir)
    summary = read_json(run_dir / "summary.json")
    assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == EPOCHS
