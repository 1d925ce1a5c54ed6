"""Is the diagnosis right? Controlled scenarios built from real runs of ``run.py``.

Producers are slowed with injected faults that use no CPU (``faults.producer_delay_ms``,
``faults.producer_stall_*``), so the scenarios mean the same on a 2-core machine as on a
big one. Each scenario is a real run; its verdict and recommendation come from the run's
summary.json and ``diagnose``.

  A  too few producers for a fast trainer: producer-bound; rerunning with the
     recommended count must remove the starvation (data_wait_frac <= 0.05)
  B  a slow trainer: consumer-bound; the recommendation must not ask for more producers
  C  a producer that stalls every P seconds: the period reported within 10%
  D  --producers auto against fixed counts 1..N: the count it settles on within one of
     the best fixed count, its data_wait_frac (second half of the run, after it has
     settled) within 0.03 of the best fixed run's

    python -m stoker.benchmarks.starvation [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import soundfile

from .common import STOKER, BenchError
from stoker.diagnose import analyse
from ..shared.metrics import wait_share

RUN_TIMEOUT_S = 400
# A trainer wanting 10 batches/s and producers that need ~330 ms per batch, mostly the
# injected delay: one producer delivers a third of the demand, and the CPU each uses
# stays small, so the scenario holds on 2 cores.
FAST_MODEL = "synthetic:100"
SLOW_PRODUCER = ["--set", "faults.producer_delay_ms=300"]
COMMON = ["--set", "features.backend=numpy", "--batch-size", "4", "--model-start-delay", "0.5",
          "--log-level", "WARNING"]


def make_dataset(root: Path, count: int = 24, rate_hz: int = 22050) -> None:
    """Short synthetic clips: the CPU cost of a batch is small next to the injected delay."""
    (root / "wavs").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(count):
        t = np.arange(int((0.6 + 0.05 * i) * rate_hz)) / rate_hz
        audio = (0.2 * np.sin(2 * np.pi * (120 + 10 * i) * t) + 0.01 * rng.standard_normal(t.size))
        soundfile.write(str(root / "wavs" / f"B{i:04d}.wav"), audio.astype(np.float32), rate_hz, subtype="PCM_16")
        lines.append(f"B{i:04d}|clip number {i}|clip number {i}")
    (root / "metadata.csv").write_text("\n".join(lines) + "\n")


def run(data: Path, run_dir: Path, *args: str) -> dict[str, Any]:
    cmd = [*STOKER, "--data", str(data), "--run-dir", str(run_dir), *COMMON, *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                            stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise RuntimeError(f"run failed ({result.returncode}): {' '.join(cmd)}\n{result.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def second_half_wait(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    share = wait_share(rows[len(rows) // 2:])
    if share is None:
        raise BenchError(f"{run_dir}: the second half of the run took no time")
    return share


def scenario_a(data: Path, work: Path, steps: int) -> dict[str, Any]:
    first = run(data, work / "a1", "--model", FAST_MODEL, *SLOW_PRODUCER, "--steps", str(steps // 4),
                "--producers", "1")
    report = analyse(work / "a1")
    n = report["recommended_producers"]
    cured = run(data, work / "a2", "--model", FAST_MODEL, *SLOW_PRODUCER, "--steps", str(steps),
                "--producers", str(n))
    return {"verdict": first["verdict"], "data_wait_frac_before": first["data_wait_frac"],
            "recommended_producers": n, "data_wait_frac_after": cured["data_wait_frac"],
            "target": "producer-bound, then data_wait_frac <= 0.05 with the recommended count",
            "met": first["verdict"] == "producer-bound" and cured["data_wait_frac"] <= 0.05}


def scenario_b(data: Path, work: Path, steps: int) -> dict[str, Any]:
    s = run(data, work / "b", "--model", "synthetic:150", "--steps", str(steps // 3), "--producers", "2")
    return {"verdict": s["verdict"], "data_wait_frac": s["data_wait_frac"], "producers": 2,
            "recommended_producers": s["recommended_producers"],
            "target": "consumer-bound, recommendation <= current count",
            "met": s["verdict"] == "consumer-bound" and s["recommended_producers"] <= 2}


def scenario_c(data: Path, work: Path, steps: int, period_s: float = 2.0) -> dict[str, Any]:
    run(data, work / "c", "--model", "synthetic:40", "--steps", str(steps), "--producers", "1",
        "--set", f"faults.producer_stall_every_s={period_s}", "--set", "faults.producer_stall_s=0.5")
    found = analyse(work / "c")["period"]
    error = abs(found["period_s"] - period_s) / period_s if found else None
    return {"injected_period_s": period_s, "reported": found, "relative_error": error,
            "target": "period within 10%", "met": error is not None and error <= 0.10}


def scenario_d(data: Path, work: Path, steps: int, max_fixed: int) -> dict[str, Any]:
    fixed = {}
    for n in range(1, max_fixed + 1):
        s = run(data, work / f"d{n}", "--model", FAST_MODEL, *SLOW_PRODUCER, "--steps", str(steps),
                "--producers", str(n))
        fixed[n] = {"data_wait_frac": s["data_wait_frac"], "second_half": second_half_wait(work / f"d{n}"),
                    "steps_per_s": s["steps_per_s"]}
    best_wait = min(v["second_half"] for v in fixed.values())
    best_n = min(n for n, v in fixed.items() if v["second_half"] <= best_wait + 0.01)
    auto = run(data, work / "dauto", "--model", FAST_MODEL, *SLOW_PRODUCER, "--steps", str(4 * steps),
               "--producers", "auto", "--max-producers", str(max_fixed + 1))
    final = auto.get("autoscale", {}).get("final_producers")
    auto_wait = second_half_wait(work / "dauto")
    return {"fixed": fixed, "best_fixed_producers": best_n, "best_fixed_wait": best_wait,
            "auto_final_producers": final, "auto_wait_second_half": auto_wait,
            "auto_wait_whole_run": auto["data_wait_frac"],
            "auto_decisions": auto.get("autoscale", {}).get("decisions", []),
            "target": "auto count within 1 of best fixed; its wait within 0.03 of the best",
            "met": final is not None and abs(final - best_n) <= 1 and auto_wait <= best_wait + 0.03}


def main(quick: bool = False) -> dict[str, Any]:
    steps = 100 if quick else 200
    with tempfile.TemporaryDirectory(prefix="stoker-starvation-") as tmp:
        work = Path(tmp)
        make_dataset(work / "data")
        results = {
            "A_producer_bound": scenario_a(work / "data", work, steps),
            "B_consumer_bound": scenario_b(work / "data", work, steps),
            "C_periodic_stall": scenario_c(work / "data", work, 400 if quick else 800),
            "D_auto_vs_fixed": scenario_d(work / "data", work, steps, max_fixed=5),
        }
    return results


def table(results: dict[str, Any]) -> str:
    a, b, c, d = (results[k] for k in ("A_producer_bound", "B_consumer_bound", "C_periodic_stall",
                                       "D_auto_vs_fixed"))
    lines = [
        f"A producer-bound: verdict {a['verdict']}, wait {a['data_wait_frac_before']:.3f} with 1 producer; "
        f"recommended {a['recommended_producers']} -> wait {a['data_wait_frac_after']:.3f}  "
        f"[{'met' if a['met'] else 'NOT met'}: <= 0.05]",
        f"B consumer-bound: verdict {b['verdict']}, recommended {b['recommended_producers']} of 2  "
        f"[{'met' if b['met'] else 'NOT met'}]",
        f"C periodic stall: injected {c['injected_period_s']} s, reported "
        f"{c['reported']['period_s'] if c['reported'] else None} s, error "
        f"{c['relative_error'] if c['relative_error'] is None else round(100 * c['relative_error'], 1)}%  "
        f"[{'met' if c['met'] else 'NOT met'}: <= 10%]",
        "D fixed counts: " + ", ".join(f"{n}: wait {v['second_half']:.3f}" for n, v in d["fixed"].items())
        + f"; best {d['best_fixed_producers']}",
        f"  auto settled on {d['auto_final_producers']}, wait {d['auto_wait_second_half']:.3f} (second half), "
        f"{d['auto_wait_whole_run']:.3f} (whole run)  [{'met' if d['met'] else 'NOT met'}]",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    res = main(args.quick)
    print(table(res))
    if args.out:
        args.out.write_text(json.dumps(res, indent=2, default=float))
