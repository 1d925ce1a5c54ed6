"""End to end: docs/examples/ddp_trainer.py as two torchrun ranks (gloo, CPU), each with its own
stoker.Feed, served by one pool of producers for the host (or each by its own). One rank kills itself with SIGKILL right after a checkpoint; torchrun
restarts the job, every rank restores the DCP checkpoint with its own feed state, and the
job goes on: every clip but the held-out ones trained exactly once per epoch across the ranks,
as counted inside the model's step (tests/trained.py), every rank the same number of steps in
each epoch, and at each step both ranks' batches of one bucket shape. On the CPU (gloo) in the
suite; on a GPU host (tests/gpu.sh) the same job with both ranks sharing its first GPU."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.factories import make_dataset
from tests.gpus import nvml_gpus
from tests.procs import read_json, read_jsonl
from tests.trained import check_trained, clips_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

pytest.importorskip("torch")

PROJECT = Path(__file__).resolve().parents[1]
RANKS = 2
EPOCHS = 2
KILL_RANK = 1  # not rank 0: the one that writes the checkpoint's metadata and names it lives on
KILL_AT = 4  # a checkpoint inside epoch 1: 22 training clips in global batches of 8 are 3 steps an epoch
PRODUCERS = 2
JOB_TIMEOUT_S = 240


def torchrun(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run`` (torchrun) on this host, allowed one restart of the job
    (with a rendezvous store of each attempt's own: TORCH_DISABLE_SHARE_RDZV_TCP_STORE, see
    docs/design/training.md, "torchrun ranks"); torchrun and every process under it killed if it outlives its deadline
    (its ranks run in sessions of their own)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
               "--max-restarts", "1", "--monitor-interval", "0.1", "-m", *argv]
    path = os.pathsep.join(filter(None, [str(PROJECT), os.environ.get("PYTHONPATH")]))  # a GPU host's site too
    env = {**os.environ, "PYTHONPATH": path, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env}
    proc = subprocess.Popen(command, cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            for child in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                with contextlib.suppress(psutil.NoSuchProcess):  # ended meanwhile
                    child.kill()
            proc.communicate()
    return subprocess.CompletedProcess(command, proc.returncode, out, "")


def check_no_producer_left(pids: list[int]) -> None:
    producers = [p for p in psutil.process_iter(["cmdline"])
                 if any(f"--parent-pid {pid}" in " ".join(p.info["cmdline"] or []) for pid in pids)]
    _, alive = psutil.wait_procs(producers, timeout=10)
    assert not alive, f"producers outlived their rank: {[p.pid for p in alive]}"


def run_job(tmp_path: Path, devices: dict[str, str], producers_per: str = "host") -> dict[tuple[int, int], dict]:
    """The job (``devices``: the CUDA variables its ranks see; ``producers_per``: one pool for the
    host or each rank's own), a rank killed after a checkpoint and the job restarted, checked as
    the module says; each (rank, attempt)'s report (tests/ddp_user.py)."""
    data, job, reports = tmp_path / "data", tmp_path / "job", tmp_path / "reports"
    reports.mkdir()
    made = make_dataset(data, count=24)
    argv = ["tests.ddp_user", str(reports), "--data", str(data), "--epochs", str(EPOCHS), "--batch-size", "4",
            "--producers", str(PRODUCERS), "--producers-per", producers_per, "--run-dir", str(job), "--checkpoint", str(tmp_path / "ckpt"),
            "--checkpoint-every", "2"]
    result = torchrun(argv, {"KILL_RANK": str(KILL_RANK), "KILL_AT_STEP": str(KILL_AT), **devices})
    assert result.returncode == 0, result.stdout[-4000:]
    assert f"rank {KILL_RANK}: killing myself after the checkpoint of step {KILL_AT}" in result.stdout
    for rank in range(RANKS):  # torchrun restarted the job: every rank went on from the checkpoint
        assert f"rank {rank}: restored step-{KILL_AT:08d}: the feed goes on from step {KILL_AT}" in result.stdout

    report = {(r, a): json.loads((reports / f"rank-{r}-attempt-{a}.json").read_text())
              for r in range(RANKS) for a in range(2)}
    check_no_producer_left([r["pid"] for r in report.values()])
    steps = {r: report[r, 0]["steps"] + report[r, 1]["steps"] for r in range(RANKS)}
    assert all(len(report[r, 0]["steps"]) == KILL_AT for r in range(RANKS))  # what the checkpoint holds

    held_out = set(read_json(job / "worker-0" / "validation.json")["ids"])
    assert held_out == set(read_json(job / "worker-1" / "validation.json")["ids"]) and len(held_out) == 2
    check_trained(steps[0] + steps[1], clips_of(job / "worker-0"), EPOCHS, set(made) - held_out)
    per_epoch = {r: collections.Counter(s["epoch"] for s in steps[r]) for r in range(RANKS)}
    assert per_epoch[0] == per_epoch[1] == {e: report[0, 1]["batches_per_epoch"] for e in range(EPOCHS)}
    shapes = [report[r, 0]["shapes"] + report[r, 1]["shapes"] for r in range(RANKS)]
    assert [(t[1], m[1]) for t, m in shapes[0]] == [(t[1], m[1]) for t, m in shapes[1]]  # L and T, step by step
    assert [t[0] for t, _ in shapes[0]] == [t[0] for t, _ in shapes[1]]  # rows: each rank's equal share

    joined = [{p["pid"] for p in read_json(job / f"worker-{r}" / "summary.json")["producers"]} for r in range(RANKS)]
    if producers_per == "host":  # the restarted attempt's pool of local rank 0 served both ranks
        assert joined[0] == joined[1] and len(joined[0]) == PRODUCERS, joined
    else:
        assert not joined[0] & joined[1] and len(joined[0]) == len(joined[1]) == PRODUCERS, joined
    for rank in range(RANKS):
        summary = read_json(job / f"worker-{rank}" / "summary.json")
        assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == EPOCHS
        rows = read_jsonl(job / f"worker-{rank}" / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(1, EPOCHS * 3 + 1))  # each step once, across the kill
    return report


@pytest.mark.parametrize("producers_per", ["host", "rank"])
def test_two_torchrun_ranks_killed_after_a_checkpoint_restart_and_train_every_clip_once(tmp_path: Path,
                                                                                       producers_per: str) -> None:
    """The ranks of the host share one pool of producers (the example's default), or each has its own."""
    report = run_job(tmp_path, {"CUDA_VISIBLE_DEVICES": ""}, producers_per)  # the CPU, wherever the suite runs
    assert {r["backend"] for r in report.values()} == {"gloo"}
    assert {d for r in report.values() for d in r["devices"]} == {"cpu"}


@pytest.mark.gpu
def test_two_torchrun_ranks_sharing_one_gpu_killed_restart_and_train_every_clip_once(tmp_path: Path) -> None:
    """A one-GPU host: both ranks' batches staged onto the one card, the process group gloo (nccl
    refuses two ranks on one device)."""
    report = run_job(tmp_path, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(nvml_gpus()[0].index)})
    assert {r["backend"] for r in report.values()} == {"gloo"}
    assert {d for r in report.values() for d in r["devices"]} == {"cuda:0"}
