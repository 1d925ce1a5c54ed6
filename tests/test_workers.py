"""End to end: two trainer workers on this host (TF_CONFIG, MultiWorkerMirroredStrategy), each
with its own producers: every clip trained once per epoch across both, both workers in
step (the same loss, the same bucket shape at every step), and a kill -9 of one worker
followed by ``--resume`` of the job going on at the checkpoint's input position."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest

from tests.factories import make_dataset
from tests.procs import RunProcess, free_port, read_json, read_jsonl
from tests.test_resume import crash, endpoint_of, gated_producer
from tests.test_run import NUMPY_FEATURES
from tests.trained import check_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WORKERS = 2
# A small user model: the mechanics, not the preset; two buckets of 4 rows per worker.
JOB = ["--model", "tests.consumer.training.user_models:good", "--batch-size", "4", "--producers", "1",
       "--record-samples", "--model-start-delay", "0", "--set", "batching.num_buckets=2", "--set", "trainer.learning_rate=1e-2",
       "--set", "trainer.warmup_steps=0", *NUMPY_FEATURES]
CHECKPOINT_LINE = r"checkpoint at step (\d+) saved"
# In the kill test each worker's only producer prepares this many batches until the test lets
# it: the job cannot train past step 5 of its 3 epochs, so the kill after the checkpoint at
# step 4 lands mid-run, however fast the host.
GATE_BATCHES = 5


def tf_config(ports: list[int], index: int) -> str:
    return json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                       "task": {"type": "worker", "index": index}})


def start_job(*args: str) -> list[RunProcess]:
    ports = [free_port() for _ in range(WORKERS)]
    return [RunProcess(*args, "--bind", f"tcp://127.0.0.1:{free_port()}", env={"TF_CONFIG": tf_config(ports, i)})
            for i in range(WORKERS)]


def finish(workers: list[RunProcess]) -> None:
    for worker in workers:
        assert worker.wait(timeout=200) == 0, worker.output()


def check_once_per_epoch(job: Path, epochs: int, made: list[str]) -> set[str]:
    """Every clip the test made but the held-out ones trained once per epoch across the workers,
    as their steps noted it; the clips trained."""
    held = set(read_json(job / "worker-0" / "validation.json")["ids"])
    trained = set(made) - held
    check_run(job / "worker-0", epochs, trained, *(job / f"worker-{w}" for w in range(1, WORKERS)))
    return trained


def test_two_workers_in_step_and_a_kill_9_of_one_then_resume_of_the_job_goes_on_at_the_checkpoint(tmp_path,
                                                                                                  monkeypatch):
    """One job (two workers, their TensorFlow processes the dearest part of the test) checked for
    both: the kill and resume, and the finished job's workers in step."""
    data, job = tmp_path / "data", tmp_path / "job"
    made = make_dataset(data, count=24)
    args = ["--data", str(data), "--run-dir", str(job), *JOB, "--producers", "0", "--epochs", "3", "--set",
            "trainer.checkpoint_every_steps=2", "--log-level", "INFO"]
    workers = start_job(*args)
    try:
        with contextlib.ExitStack() as producers:
            for w, worker in enumerate(workers):
                producers.enter_context(gated_producer(endpoint_of(worker), GATE_BATCHES, monkeypatch, data,
                                                       name=f"gated-{w}"))
            workers[0].wait_for_line(CHECKPOINT_LINE, timeout=150, count=2)
            crash(workers[1])  # one worker dies; the job is gone (a scheduler ends the other, as here)
            crash(workers[0])
    finally:
        for worker in workers:
            worker.kill()
    steps = [max(int(re.search(r"(\d+)$", p.name).group(1)) for p in (job / f"worker-{w}" / "ckpt").glob("ckpt-*"))
             for w in range(WORKERS)]
    common = min(steps)  # a worker behind on its save leaves the other a checkpoint ahead: both go on from here
    assert common >= 2
    survivor = job / "worker-0" / "summary.json"  # it may have seen its peer go before it was killed
    assert not survivor.exists() or read_json(survivor)["exit_reason"].startswith("failed")

    again = start_job("--resume", str(job), "--producers", "1", "--log-level", "WARNING")
    try:
        finish(again)
    finally:
        for worker in again:
            worker.kill()
    trained = check_once_per_epoch(job, 3, made)
    summaries = [read_json(job / f"worker-{w}" / "summary.json") for w in range(WORKERS)]
    assert len(trained) == summaries[0]["clips"] - summaries[0]["val_clips"]
    assert [(s["workers"], s["worker"], s["replicas"]) for s in summaries] == [(2, 0, 2), (2, 1, 2)]
    metrics = [read_jsonl(job / f"worker-{w}" / "metrics.jsonl") for w in range(WORKERS)]
    assert len(metrics[0]) == len(metrics[1]) == summaries[0]["steps"]
    # In step, across the kill: each step's loss is the global batch's, the same on both; and so is
    # its bucket shape (each worker computes its rows x the bucket's T frames).
    assert [r["loss"] for r in metrics[0]] == [r["loss"] for r in metrics[1]]
    assert [r["frames_computed"] for r in metrics[0]] == [r["frames_computed"] for r in metrics[1]]
    assert summaries[0]["loss_last"] < summaries[0]["loss_first"]
    for w, summary in enumerate(summaries):
        rows = read_jsonl(job / f"worker-{w}" / "samples.jsonl")
        assert summary["resumed_from_step"] == common and summary["epochs_completed"] == 3
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
