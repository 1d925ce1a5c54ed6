"""Pipeline benchmark: does the real pipeline keep a 100 ms trainer step fed?

Runs the real thing as a subprocess:

    python run.py --model synthetic:100 --batch-size 16 --steps S --producers P
                  --set features.backend=B --run-dir TMP --model-start-delay 2

``synthetic:100`` holds each step for 100 ms without using the CPU, so the ideal rate is
1000 / 100 = 10 steps/s and anything below it is the input pipeline's doing (plus the
loop's own overhead). From the run's ``summary.json`` and ``metrics.jsonl``:

- steps/s after warm-up: warm-up ends when the first batch is in hand (the product's own
  definition, as in summary.json's ``data_wait_frac``), so the rate is measured from the
  end of step 1 to the end of the last step, ``(N - 1) / (t_N - t_1)``, on the ``t``
  column. Ratio: that / the ideal 10 steps/s. Target: >= 0.97.
- data_wait_frac after warm-up: waits of steps 2..N over (waits of steps 2..N + step
  times of steps 2..N). Target: <= 0.02. summary.json's own figure is kept beside it.
- producer capacity: one producer's rate is 1000 / prep_ms_mean (its measured time to
  prepare one batch, under the run's real CPU contention); capacity = P x 1000 /
  prep_ms_mean (prep_ms_mean averaged over producers, weighted by batches), compared
  with the demand 1000 / 100 = 10 batches/s. Capacity must be above demand for the
  targets to be fair; the chosen configuration (P, backend) is checked by this number.

Several trainer steps (``RunSpec.step_ms``; the figures above are for 100 ms, and
scale as 1000 / MS). Full: the judged configuration ``tf`` backend, P = 2, MS = 100,
S = 200, 2 repetitions; informational runs at MS = 200 (tf) and MS = 50 (tf and numpy).
Quick: numpy backend (no TensorFlow import), P = 2, S = 60 at MS = 100 (judged) and 50.

Run alone: ``python -m stoker.benchmarks.pipeline [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .common import run_alone, STOKER, BenchError, ratio, spread, table
from ..shared.metrics import wait_share

STEP_MS = 100.0
IDEAL_STEPS_PER_S = 1000.0 / STEP_MS
DEMAND_BATCHES_PER_S = 1000.0 / STEP_MS
BATCH_SIZE = 16
TARGET_STEPS_RATIO = 0.97
TARGET_WAIT_FRAC = 0.02
# Beyond the steps themselves: interpreter and TensorFlow start-up, warm-up, shutdown.
RUN_OVERHEAD_S = 120.0
# After SIGTERM to the launcher, give the shutdown protocol this long before SIGKILL.
TERM_GRACE_S = 15.0


@dataclass
class RunSpec:
    backend: str
    producers: int
    steps: int
    repetitions: int
    targets: bool  # whether this configuration is the one the targets are judged on
    step_ms: float = STEP_MS  # the synthetic trainer's step

    @property
    def label(self) -> str:
        return f"{self.backend} P={self.producers} S={self.steps} MS={self.step_ms:g}"


@dataclass
class PipelinePlan:
    # Several trainer steps: 100 ms is judged; 200 ms is easier, 50 ms asks
    # 20 batches/s of two producers on two cores (informational: capacity shown).
    runs: list[RunSpec] = field(default_factory=lambda: [
        RunSpec("tf", 2, 200, 2, targets=True),
        RunSpec("tf", 2, 100, 1, targets=False, step_ms=200.0),
        RunSpec("tf", 2, 200, 1, targets=False, step_ms=50.0),
        RunSpec("numpy", 2, 200, 1, targets=False, step_ms=50.0),
    ])

    @classmethod
    def quick(cls) -> "PipelinePlan":
        return cls([RunSpec("numpy", 2, 60, 1, targets=True), RunSpec("numpy", 2, 60, 1, targets=False, step_ms=50.0)])


# ---------------------------------------------------------------- analysis (pure)
def analyze(summary: dict[str, Any], rows: Sequence[dict[str, Any]], producers: int,
            step_ms: float = STEP_MS) -> dict[str, Any]:
    """Figures of one run from its summary.json and metrics.jsonl rows."""
    rows = sorted(rows, key=lambda r: r["step"])
    if len(rows) < 3:
        raise BenchError(f"run has {len(rows)} metric rows; need at least 3")
    first, last = rows[0], rows[-1]
    steady = rows[1:]
    steps = last["step"] - first["step"]
    seconds = last["t"] - first["t"]
    if steps <= 0 or seconds <= 0:
        raise BenchError(f"no measurable steady phase ({steps} steps in {seconds} s)")
    steps_per_s = steps / seconds
    ideal = 1000.0 / step_ms
    wait_ms = sum(r["wait_ms"] for r in steady)
    busy_ms = wait_ms + sum(r["step_ms"] for r in steady)
    wait_frac = wait_ms / busy_ms if busy_ms > 0 else 0.0
    # a late window too, for the reader: the last 90% of steps
    late = rows[max(1, len(rows) // 10):]
    stats = [p for p in summary.get("producers", []) if p.get("batches") and p.get("prep_ms_mean")]
    batches = sum(p["batches"] for p in stats)
    prep_ms = sum(p["prep_ms_mean"] * p["batches"] for p in stats) / batches if batches else None
    demand = 1000.0 / step_ms
    capacity = None
    if prep_ms:
        per_producer = 1000.0 / prep_ms
        capacity = {
            "prep_ms_mean": prep_ms,
            "per_producer_batches_per_s": per_producer,
            "producers": producers,
            "capacity_batches_per_s": producers * per_producer,
            "demand_batches_per_s": demand,
            "ratio": ratio(producers * per_producer, demand, note="P x 1000/prep_ms_mean over 1000/step_ms"),
            "above_demand": producers * per_producer > demand,
            "per_producer_prep_ms": {p["id"]: p["prep_ms_mean"] for p in stats},
        }
    depth = [r["queue_depth"] for r in steady]
    return {
        "steps": len(rows),
        "steady_steps": steps,
        "steady_seconds": seconds,
        "steps_per_s": steps_per_s,
        "ideal_steps_per_s": ideal,
        "steps_ratio": ratio(steps_per_s, ideal, note="steps/s after warm-up / ideal 1000/step_ms (ideal is "
                                                      "not measured: the trainer's configured step)"),
        "data_wait_frac": wait_frac,
        "data_wait": {"wait_ms": wait_ms, "busy_ms": busy_ms},
        "data_wait_frac_late90": wait_share(late) or 0.0,
        "starved_steps_after_warmup": sum(1 for d in depth if d == 0),
        "queue_depth_mean_after_warmup": sum(depth) / len(depth),
        "step_ms_mean": sum(r["step_ms"] for r in steady) / len(steady),
        "first_batch_wait_ms": first["wait_ms"],
        "summary": {k: summary.get(k) for k in ("steps", "steps_per_s", "data_wait_frac", "data_wait_frac_incl_warmup",
                                                "queue_depth_mean", "starved_steps", "verdict",
                                                "recommended_producers", "warmup_s", "wall_s", "exit_reason",
                                                "rejected", "reissued_leases", "rejected_messages")},
        "capacity": capacity,
    }


def read_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    rows = []
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return summary, rows


# ---------------------------------------------------------------- running
def command(spec: RunSpec, run_dir: Path) -> list[str]:
    return [*STOKER, "--model", f"synthetic:{spec.step_ms:g}",
            "--batch-size", str(BATCH_SIZE), "--steps", str(spec.steps), "--producers", str(spec.producers),
            "--set", f"features.backend={spec.backend}", "--run-dir", str(run_dir), "--model-start-delay", "2",
            "--log-level", "WARNING"]


def run_once(spec: RunSpec, keep: Path | None = None) -> dict[str, Any]:
    """One real run; its analysis, with the command and wall time."""
    tmp = Path(tempfile.mkdtemp(prefix="stoker-bench-run-"))
    run_dir = tmp / "run"
    cmd = command(spec, run_dir)
    timeout_s = spec.steps * spec.step_ms / 1000.0 * 3 + RUN_OVERHEAD_S
    log_path = tmp / "output.log"
    started = time.monotonic()
    try:
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)  # the launcher's own shutdown protocol
                try:
                    proc.wait(timeout=TERM_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
                raise BenchError(f"run timed out after {timeout_s:.0f} s: {' '.join(cmd)}\n{_tail(log_path)}") \
                    from None
        wall = time.monotonic() - started
        if code != 0 or not (run_dir / "summary.json").exists():
            raise BenchError(f"run exited with status {code}: {' '.join(cmd)}\n{_tail(log_path)}")
        summary, rows = read_run(run_dir)
        result = analyze(summary, rows, spec.producers, spec.step_ms)
        result["command"] = " ".join(cmd)
        result["wall_s_total"] = wall
        if keep is not None:
            shutil.copytree(run_dir, keep, dirs_exist_ok=True)
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def aggregate(spec: RunSpec, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over repetitions of one configuration, with targets if it is the judged one."""
    sps = spread([r["steps_per_s"] for r in runs])
    wait = spread([r["data_wait_frac"] for r in runs])
    ideal = demand = 1000.0 / spec.step_ms
    steps_ratio = ratio(sps["median"], ideal,
                        note=f"median steps/s after warm-up / ideal {ideal:g} steps/s (1000 / {spec.step_ms:g} ms)")
    caps = [r["capacity"] for r in runs if r["capacity"]]
    capacity = None
    if caps:
        prep = spread([c["prep_ms_mean"] for c in caps])
        cap = spread([c["capacity_batches_per_s"] for c in caps])
        capacity = {
            "prep_ms_mean": prep,
            "capacity_batches_per_s": cap,
            "demand_batches_per_s": demand,
            "ratio": ratio(cap["median"], demand, note=f"P x 1000/prep_ms_mean over {demand:g} batches/s"),
            "above_demand": cap["median"] > demand,
        }
    out: dict[str, Any] = {
        "config": {"backend": spec.backend, "producers": spec.producers, "steps": spec.steps,
                   "repetitions": spec.repetitions, "model": f"synthetic:{spec.step_ms:g}", "batch_size": BATCH_SIZE,
                   "step_ms": spec.step_ms, "ideal_steps_per_s": ideal},
        "judged": spec.targets,
        "steps_per_s": sps,
        "steps_ratio": steps_ratio,
        "data_wait_frac": wait,
        "summary_data_wait_frac": spread([r["summary"]["data_wait_frac"] or 0.0 for r in runs]),
        "summary_steps_per_s": spread([r["summary"]["steps_per_s"] or 0.0 for r in runs]),
        "capacity": capacity,
        "runs": runs,
    }
    if spec.targets:
        out["targets"] = {
            "steps_per_s": {"what": f"synthetic:{spec.step_ms:g}: steps/s after warm-up >= {TARGET_STEPS_RATIO} x "
                                    f"{ideal:g}",
                            "min_ratio": TARGET_STEPS_RATIO, "met": steps_ratio["value"] >= TARGET_STEPS_RATIO},
            "data_wait_frac": {"what": f"synthetic:{spec.step_ms:g}: data_wait_frac after warm-up <= {TARGET_WAIT_FRAC}",
                               "max": TARGET_WAIT_FRAC, "met": wait["median"] <= TARGET_WAIT_FRAC},
            "capacity_above_demand": {"what": f"synthetic:{spec.step_ms:g}: P x 1000/prep_ms_mean > {demand:g} "
                                              "batches/s (precondition)",
                                      "met": bool(capacity and capacity["above_demand"])},
        }
    return out


def run(plan: PipelinePlan | None = None, log: Any = None) -> dict[str, Any]:
    plan = plan or PipelinePlan()
    log = log or (lambda text: None)
    configs = []
    for spec in plan.runs:
        runs = []
        for rep in range(spec.repetitions):
            r = run_once(spec)
            runs.append(r)
            cap = r["capacity"]["capacity_batches_per_s"] if r["capacity"] else float("nan")
            log(f"pipeline {spec.label} rep {rep + 1}/{spec.repetitions}: {r['steps_per_s']:.3f} steps/s, "
                f"wait {r['data_wait_frac']:.4f}, capacity {cap:.1f} batches/s")
        configs.append(aggregate(spec, runs))
    return {"ideal_steps_per_s": IDEAL_STEPS_PER_S, "demand_batches_per_s": DEMAND_BATCHES_PER_S,
            "configs": configs}


def render(section: dict[str, Any]) -> str:
    headers = ["config", "judged", "steps/s med [min,max]", "ratio vs ideal", "wait frac med [min,max]",
               "summary wait", "prep ms", "capacity b/s", "cap/demand", "targets"]
    out = []
    for c in section["configs"]:
        s, w = c["steps_per_s"], c["data_wait_frac"]
        cap = c["capacity"]
        targets = "-"
        if c.get("targets"):
            t = c["targets"]
            targets = (f"steps {'met' if t['steps_per_s']['met'] else 'NOT met'}, "
                       f"wait {'met' if t['data_wait_frac']['met'] else 'NOT met'}, "
                       f"capacity {'ok' if t['capacity_above_demand']['met'] else 'BELOW demand'}")
        cfg = c["config"]
        out.append([f"synthetic:{cfg.get('step_ms', STEP_MS):g} {cfg['backend']} P={cfg['producers']} S={cfg['steps']} "
                    f"x{cfg['repetitions']}",
                    "yes" if c["judged"] else "no (info)",
                    f"{s['median']:.3f} [{s['min']:.3f},{s['max']:.3f}]",
                    f"{c['steps_ratio']['value']:.4f}",
                    f"{w['median']:.4f} [{w['min']:.4f},{w['max']:.4f}]",
                    f"{c['summary_data_wait_frac']['median']:.4f}",
                    f"{cap['prep_ms_mean']['median']:.1f}" if cap else "-",
                    f"{cap['capacity_batches_per_s']['median']:.1f}" if cap else "-",
                    f"{cap['ratio']['value']:.2f}" if cap else "-",
                    targets])
    return table(headers, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.pipeline")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="also write the section to this file")
    args = parser.parse_args(argv)
    plan = PipelinePlan.quick() if args.quick else PipelinePlan()
    return run_alone("pipeline", lambda log: run(plan, log=log), render, args.json)


if __name__ == "__main__":
    sys.exit(main())
