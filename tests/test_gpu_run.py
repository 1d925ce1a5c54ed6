"""End-to-end on a GPU host: ``python run.py`` with the producers on ``--data-gpu 0`` and the
trainer on ``--model-gpu 0`` (one card shared, as on a one-GPU host). The synthetic trainer and
numpy features import no TensorFlow (the GPU host has none); the run's processes are pinned to
the card, and the utilisation it records is the real NVML's."""

from __future__ import annotations

import json

import psutil
import pytest

from tests.gated_user import GATE_ENV
from tests.gpus import nvml_gpus
from tests.procs import RunProcess, read_json, read_jsonl, run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(400)]

DEMO_CLIPS = 64
PRODUCERS = 2
CONSUMER_MODULE = "stoker.consumer.training.main"
PRODUCER_MODULE = "stoker.producer.worker"


def test_producers_and_trainer_on_gpu_0_run_pinned_and_record_its_utilisation(tmp_path):
    card = nvml_gpus()[0]
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    # Every clip waits for the gate (tests/gated_user.py): the run cannot end before the test
    # has read each process's environment.
    with RunProcess("--model", "synthetic:5", "--epochs", "1", "--producers", str(PRODUCERS),
                    "--data-gpu", "0", "--model-gpu", "0", "--model-start-delay", "0.2", "--run-dir", str(run_dir),
                    "--set", "features.backend=numpy", "--set", "transforms.user=tests.gated_user:hold",
                    env={GATE_ENV: str(gate)}) as run:
        # The same index for both roles is allowed: one card, its memory split between them.
        run.wait_for_line(r"single-GPU mode: GPU 0 shared", timeout=120)
        run.wait_for_line(rf"started {PRODUCERS} local producer\(s\)", timeout=300)
        run.remember_children()  # for the clean-up of a failed test
        pinned: dict[str, list[str | None]] = {CONSUMER_MODULE: [], PRODUCER_MODULE: []}
        for child in psutil.Process(run.proc.pid).children():
            module = next((m for m in pinned if m in child.cmdline()), None)
            if module is not None:
                pinned[module].append(child.environ().get("CUDA_VISIBLE_DEVICES"))
        gate.touch()
        code = run.wait(timeout=240)
    assert code == 0, run.output()
    assert pinned == {CONSUMER_MODULE: ["0"], PRODUCER_MODULE: ["0"] * PRODUCERS}

    summary = read_json(run_dir / "summary.json")
    assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == 1
    assert summary["samples"] == DEMO_CLIPS and summary["rejected"] == 0

    # The consumer samples the card for both roles (shared/gpumon.py): NVML's own figures.
    rows = read_jsonl(run_dir / "gpu.jsonl")
    assert rows, "no GPU utilisation recorded"
    assert {r["role"] for r in rows} == {"data", "model"}
    assert {(r["gpu"], r["mem_total_mb"]) for r in rows} == {(0, card.memory_total_mb)}
    assert all(0 <= r["util"] <= 100 and 0 <= r["mem_used_mb"] <= r["mem_total_mb"] for r in rows)

    # What the user reads of them: diagnose's GPU report.
    done = run_cli("diagnose", str(run_dir), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)["gpu"]
    assert set(report) == {"data", "model"}
    assert all(role["gpu"] == 0 and role["samples"] >= 1 for role in report.values())
