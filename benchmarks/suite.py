"""The benchmark suite behind ``python run.py bench [--quick] [--out FILE]``.

Runs three sections, prints plain tables and writes ``bench.json``:

    transport  stoker's wire protocol with credits vs raw PUSH/PULL (benchmarks/transport.py)
    pipeline   the real run with a 100 ms synthetic trainer vs the ideal 10 steps/s
               (benchmarks/pipeline.py)
    memory     the consumer's RSS over thousands of batches (benchmarks/memory.py)
    starvation verdicts, cures, periods and --producers auto on controlled scenarios
               (benchmarks/starvation.py; full suite only)

Targets (each judged on figures stored with the two numbers they come from):
    protocol >= 0.8 x raw at 8 MiB (both transports);
    steps/s after warm-up >= 0.97 x 10 and data_wait_frac after warm-up <= 0.02
    (synthetic:100, batch 16, the chosen producers and backend);
    no memory growth (criterion in benchmarks/memory.py).

Exit status: 0 when every section produced its numbers (targets met or not: they are
reported, not enforced), 1 when a section failed to run.
"""

from __future__ import annotations

import datetime as _dt
import json
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import data, memory, pipeline, producers, starvation, transport
from benchmarks.common import machine_info, table

SECTIONS = ("transport", "pipeline", "memory", "starvation", "data", "producers")
# The starvation scenarios, the data and the producers sections are many real runs
# (minutes each): only in the full suite. Each also runs alone: python -m benchmarks.NAME.
QUICK_SECTIONS = ("transport", "pipeline", "memory")


@dataclass
class SuitePlan:
    transport: transport.TransportPlan = field(default_factory=transport.TransportPlan)
    transport_sizes: dict[str, int] = field(default_factory=lambda: dict(transport.SIZES))
    pipeline: pipeline.PipelinePlan = field(default_factory=pipeline.PipelinePlan)
    memory: memory.MemoryPlan = field(default_factory=memory.MemoryPlan)
    sections: tuple[str, ...] = SECTIONS

    @classmethod
    def for_mode(cls, quick: bool) -> "SuitePlan":
        if not quick:
            return cls()
        return cls(transport=transport.TransportPlan.quick(), pipeline=pipeline.PipelinePlan.quick(),
                   memory=memory.MemoryPlan.quick(), sections=QUICK_SECTIONS)


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def targets(sections: dict[str, Any]) -> list[dict[str, Any]]:
    """Every judged target, flat: what, the figure, its numbers, met."""
    out = []
    for row in sections.get("transport") or []:
        if row["target"]["applies"]:
            r = row["ratio"]
            out.append({"section": "transport", "what": f"{row['transport']} {row['size']}: {row['target']['what']}",
                        "value": r["value"], "numerator": r["numerator"], "denominator": r["denominator"],
                        "limit": row["target"]["min_ratio"], "met": row["target"]["met"]})
    for cfg in (sections.get("pipeline") or {}).get("configs", []):
        if not cfg.get("targets"):
            continue
        t = cfg["targets"]
        r = cfg["steps_ratio"]
        out.append({"section": "pipeline", "what": t["steps_per_s"]["what"], "value": r["value"],
                    "numerator": r["numerator"], "denominator": r["denominator"],
                    "limit": t["steps_per_s"]["min_ratio"], "met": t["steps_per_s"]["met"]})
        w = cfg["data_wait_frac"]["median"]
        out.append({"section": "pipeline", "what": t["data_wait_frac"]["what"], "value": w,
                    "numerator": None, "denominator": None, "limit": t["data_wait_frac"]["max"],
                    "met": t["data_wait_frac"]["met"]})
        if cfg["capacity"]:
            c = cfg["capacity"]["ratio"]
            out.append({"section": "pipeline", "what": t["capacity_above_demand"]["what"], "value": c["value"],
                        "numerator": c["numerator"], "denominator": c["denominator"], "limit": 1.0,
                        "met": t["capacity_above_demand"]["met"]})
    for name, scenario in (sections.get("starvation") or {}).items():
        out.append({"section": "starvation", "what": f"{name}: {scenario['target']}", "value": float(scenario["met"]),
                    "numerator": None, "denominator": None, "limit": 1.0, "met": scenario["met"]})
    for t in (sections.get("data") or {}).get("targets", []):
        r = t.get("ratio") or {}
        out.append({"section": "data", "what": t["what"], "value": t["value"], "numerator": r.get("numerator"),
                    "denominator": r.get("denominator"), "limit": t["limit"], "met": t["met"]})
    mem = sections.get("memory")
    if mem:
        c = mem["criterion"]
        out.append({"section": "memory", "what": c["what"], "value": c["growth_mb"], "numerator": None,
                    "denominator": None, "limit": c["limit_mb"], "met": c["met"]})
    return out


def render_targets(items: list[dict[str, Any]]) -> str:
    rows = []
    for t in items:
        numbers = "" if t["numerator"] is None else f"{t['numerator']:.4g} / {t['denominator']:.4g}"
        rows.append([t["section"], t["what"], f"{t['value']:.4f}", numbers, f"{t['limit']:g}",
                     "met" if t["met"] else "NOT met"])
    return table(["section", "target", "value", "from", "limit", "result"], rows)


def run_suite(plan: SuitePlan, out_path: Path, quick: bool, log: Any = _log) -> dict[str, Any]:
    """Run the plan's sections; write and return the report."""
    started = time.monotonic()
    report: dict[str, Any] = {
        "machine": machine_info(),
        "quick": quick,
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "sections": {},
        "errors": {},
    }
    runners = {
        "transport": lambda: transport.run(plan.transport, plan.transport_sizes, log=log),
        "pipeline": lambda: pipeline.run(plan.pipeline, log=log),
        "memory": lambda: memory.run(plan.memory, log=log),
        "starvation": lambda: starvation.main(quick=quick),
        "data": lambda: data.run(data.DataPlan.quick() if quick else data.DataPlan(), log=log),
        "producers": lambda: producers.run(producers.ProducersPlan.quick() if quick else producers.ProducersPlan(),
                                           log=log),
    }
    durations = {}
    for name in plan.sections:
        t0 = time.monotonic()
        log(f"--- {name} ---")
        try:
            report["sections"][name] = runners[name]()
        except Exception as exc:  # one failed section must not hide the others' numbers
            report["sections"][name] = None
            report["errors"][name] = f"{type(exc).__name__}: {exc}"[:4000]
            log(f"{name} failed: {exc}\n{traceback.format_exc()}")
        durations[name] = round(time.monotonic() - t0, 1)
    report["durations_s"] = durations
    report["duration_s"] = round(time.monotonic() - started, 1)
    report["targets"] = targets(report["sections"])
    out_path = Path(out_path)
    if out_path.parent and not out_path.parent.exists():
        out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out_path)
    return report


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    parts = [f"stoker bench ({'quick' if report['quick'] else 'full'}): {m.get('cores')} cores, "
             f"python {m.get('python')}, {m.get('platform')}; {report['duration_s']} s"]
    sections = report["sections"]
    if sections.get("transport"):
        parts += ["", "transport: protocol (DEALER/ROUTER + wire + credits, capacity 3) vs raw PUSH/PULL; credit = raw "
                      "frames with the same credit window (informational); median [min,max] of repetitions",
                  transport.render(sections["transport"])]
    if sections.get("pipeline"):
        parts += ["", "pipeline: python run.py --model synthetic:100 --batch-size 16 (ideal 10 steps/s, demand "
                      "10 batches/s); after warm-up = from the end of step 1", pipeline.render(sections["pipeline"])]
    if sections.get("memory"):
        parts += ["", "memory: consumer process RSS (coordinator + queue capacity 3, trainer as fast as possible)",
                  memory.render(sections["memory"])]
    if sections.get("starvation"):
        parts += ["", "starvation: is the diagnosis right? real runs with injected producer faults",
                  starvation.table(sections["starvation"])]
    if sections.get("data"):
        parts += ["", "data: index build and cache, producer vs librosa, feature cache", data.render(sections["data"])]
    if sections.get("producers"):
        parts += ["", "producers: scaling with N producers, failover of a killed one",
                  producers.render(sections["producers"])]
    if report["targets"]:
        parts += ["", "targets", render_targets(report["targets"])]
    for name, error in report["errors"].items():
        parts += ["", f"{name}: FAILED: {error.splitlines()[0] if error else ''}"]
    return "\n".join(parts)


def main(quick: bool, out_path: Path) -> int:
    plan = SuitePlan.for_mode(quick)
    report = run_suite(plan, Path(out_path), quick)
    print(render(report))
    print(f"\nwrote {out_path}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="bench.json")
    args = parser.parse_args()
    sys.exit(main(args.quick, Path(args.out)))
