"""End to end: stoker's trainer with 2 model replicas (MirroredStrategy over 2 logical CPU
devices, as ``--replicas 2`` makes them on a host without GPUs): every clip once per
epoch, the loss falls, nothing retraces, and ``--resume`` of a replicated run goes on
from its checkpoint's input position."""

from __future__ import annotations

import pytest

from stoker.shared import config as config_mod
from tests.factories import make_dataset
from tests.procs import read_json, read_jsonl, run_cli
from tests.test_run import NUMPY_FEATURES
from tests.trained import check_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# A small user model (the mechanics, not the preset); two buckets of 4 rows per replica: few
# shapes to trace, and an epoch of a few steps.
REPLICATED = ["--model", "tests.consumer.training.user_models:good", "--replicas", "2", "--batch-size", "4",
              "--producers", "2", "--record-samples", "--model-start-delay", "0", "--log-level", "WARNING",
              "--set", "batching.num_buckets=2",
              "--set", "trainer.learning_rate=1e-2", "--set", "trainer.warmup_steps=0", *NUMPY_FEATURES]


def test_two_replicas_train_each_clip_once_per_epoch_and_resume_from_the_checkpoint(tmp_path):
    data, run_dir = tmp_path / "data", tmp_path / "run"
    made = make_dataset(data, count=24)
    first = run_cli("--data", str(data), "--run-dir", str(run_dir), *REPLICATED, "--epochs", "2", timeout=200)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = read_json(run_dir / "summary.json")
    rows = read_jsonl(run_dir / "samples.jsonl")
    held = set(read_json(run_dir / "validation.json")["ids"])
    assert len(held) == summary["val_clips"] and held < set(made)
    trained = set(made) - held
    check_run(run_dir, 2, trained)
    assert summary["replicas"] == 2 and summary["trainer"]["replicas"] == 2
    assert summary["trainer"]["traces"] == summary["trainer"]["bucket_shapes"] == 2
    assert summary["trainer"]["retraces"] == 0
    assert summary["loss_last"] < summary["loss_first"]
    assert all(len(r["ids"]) <= 8 for r in rows)  # a step: 2 replica batches of 4 rows
    # Replicas split each batch in equal parts: its rows are fixed, the empty ones marked by row_mask.
    saved = config_mod.load(run_dir / "config.yaml")
    assert saved.batching.fixed_rows and "row_mask" in config_mod.batch_schema(saved).names
    steps = summary["steps"]

    again = run_cli("--resume", str(run_dir), "--epochs", "3", timeout=200)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = read_json(run_dir / "summary.json")
    rows = read_jsonl(run_dir / "samples.jsonl")
    assert resumed["resumed_from_step"] == steps and resumed["replicas"] == 2
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert {r["epoch"] for r in rows[steps:]} == {2}  # the third epoch only, from the checkpoint on
    check_run(run_dir, 3, trained)
