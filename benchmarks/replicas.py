"""Model replicas: 2 replicas against 1 with the same per-replica batch
(``python -m stoker.benchmarks.replicas``).

Every run is ``python -m stoker`` on the demo data, on the CPU (2 replicas are 2 logical
CPU devices: ``--replicas 2``), batch BATCH_SIZE per replica, PRODUCERS producers per
replica, warm-up delay 0, ``steps`` steps; 1 and 2 replicas alternate within each
repetition. Two trainers:

    tiny          the tiny text-to-mel model (MirroredStrategy when replicated)
    synthetic:MS  a step that holds MS ms without the CPU whatever its rows: the trainer
                  of N GPUs, each as fast as one, so the figure is what the input
                  pipeline delivers when the trainer's demand doubles

Figures, after warm-up and the first SETTLING_STEPS steps (samples.jsonl gives each
step's clips, metrics.jsonl its wait and step time): samples/s = clips / (wait + step
time), and the data wait share = wait / (wait + step). Targets: samples/s with 2
replicas >= SPEEDUP_TARGET x with 1, and the 2-replica run's wait share <= WAIT_TARGET.

On a 2-core host the two logical CPU devices of the tiny model share the same two cores
that the one device already used (TensorFlow's intra-op threads), and the producers
need them too: the replicas cannot add compute there, so the tiny figure shows the cost
of the strategy, not a speed-up; the synthetic figure shows whether the pipeline keeps
up with twice the demand.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .common import (CHILD_TIMEOUT_S, DEMO_DATA, QUIET_ENV, SETTLING_STEPS, STOKER, BenchError, ratio,
                                      report, spread, table)
from ..shared.metrics import wait_share

log = logging.getLogger(__name__)

SPEEDUP_TARGET = 1.6
WAIT_TARGET = 0.02
BATCH_SIZE = 8
PRODUCERS = 2  # per replica: the default pipeline.producers
SYNTHETIC_MS = 65.0  # the tiny model's step at batch 8 on 2 cores, so both ask the pipeline alike
MODELS = ("tiny", f"synthetic:{SYNTHETIC_MS:g}")


@dataclass
class ReplicasPlan:
    steps: int = 60
    repetitions: int = 2
    data: str = str(DEMO_DATA)

    @classmethod
    def quick(cls) -> "ReplicasPlan":
        return cls(steps=30, repetitions=1)


def _run(model: str, replicas: int, plan: ReplicasPlan, run_dir: Path) -> dict[str, Any]:
    argv = [*STOKER, "--model", model, "--replicas", str(replicas), "--steps", str(plan.steps),
            "--batch-size", str(BATCH_SIZE), "--producers", str(PRODUCERS * replicas), "--model-start-delay", "0",
            "--record-samples", "--run-dir", str(run_dir), "--data", plan.data, "--log-level", "WARNING",
            "--set", "trainer.val_every_steps=1000000000", "--set", "trainer.checkpoint_every_steps=0"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                          env={**os.environ, **QUIET_ENV})
    if done.returncode != 0:
        raise BenchError(f"{model} with {replicas} replica(s) failed ({done.returncode}): {done.stderr[-2000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    clips = {r["step"]: len(r["ids"]) for r in
             (json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines() if line)}
    steady = metrics[SETTLING_STEPS:]
    busy_s = sum(r["wait_ms"] + r["step_ms"] for r in steady) / 1e3
    return {"samples_per_s": sum(clips[r["step"]] for r in steady) / busy_s, "steps_per_s": len(steady) / busy_s,
            "wait_frac": wait_share(steady)}


def run(plan: ReplicasPlan | None = None, log_fn: Any = None) -> dict[str, Any]:
    plan = plan or ReplicasPlan()
    say = log_fn or log.info
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {m: {1: [], 2: []} for m in MODELS}
    with tempfile.TemporaryDirectory(prefix="stoker-bench-replicas-") as tmp:
        for rep in range(plan.repetitions):
            for model in MODELS:
                for replicas in ((1, 2) if rep % 2 == 0 else (2, 1)):
                    started = time.monotonic()
                    run_dir = Path(tmp) / f"{model.replace(':', '-')}-{replicas}-{rep}"
                    runs[model][replicas].append(_run(model, replicas, plan, run_dir))
                    say(f"replicas: {model} x{replicas} repetition {rep + 1}: {runs[model][replicas][-1]} "
                        f"({time.monotonic() - started:.0f} s)")
    result: dict[str, Any] = {"plan": {"steps": plan.steps, "repetitions": plan.repetitions,
                                       "batch_size_per_replica": BATCH_SIZE, "producers_per_replica": PRODUCERS,
                                       "device": "CPU (2 replicas: 2 logical devices)"},
                              "runs": runs, "models": {}, "targets": []}
    for model in MODELS:
        med = {n: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for n, rows in runs[model].items()}
        speedup = ratio(med[2]["samples_per_s"], med[1]["samples_per_s"], target=SPEEDUP_TARGET)
        wait = med[2]["wait_frac"]
        result["models"][model] = {
            "samples_per_s": {n: spread([r["samples_per_s"] for r in rows]) for n, rows in runs[model].items()},
            "wait_frac": {n: med[n]["wait_frac"] for n in med}, "speedup": speedup}
        result["targets"] += [
            {"what": f"{model}: samples/s, 2 replicas / 1 (same batch per replica)", "value": speedup["value"],
             "ratio": speedup, "limit": SPEEDUP_TARGET, "met": speedup["value"] >= SPEEDUP_TARGET},
            {"what": f"{model}: data wait share with 2 replicas (at most)", "value": wait, "limit": WAIT_TARGET,
             "met": wait <= WAIT_TARGET}]
    return result


def render(result: dict[str, Any]) -> str:
    rows = []
    for model, m in result["models"].items():
        rows.append([model, m["samples_per_s"][1]["median"], m["samples_per_s"][2]["median"], m["speedup"]["value"],
                     m["wait_frac"][1], m["wait_frac"][2]])
    return "\n".join([
        f"replicas: samples/s after warm-up, batch {BATCH_SIZE} per replica (median of repetitions); "
        f"target 2 / 1 >= {SPEEDUP_TARGET}, wait share with 2 <= {WAIT_TARGET}",
        table(["trainer", "1 replica", "2 replicas", "2 / 1", "wait 1", "wait 2"], rows)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.replicas")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = run(ReplicasPlan.quick() if args.quick else ReplicasPlan())
    return report(render(result), result, args.out)


if __name__ == "__main__":
    sys.exit(main())
