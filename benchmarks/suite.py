"""The benchmark suite behind ``python run.py bench [--quick] [--out FILE]``.

Runs the sections below, prints plain tables and writes ``bench.json``:

    transport      stoker's wire protocol with credits vs raw PUSH/PULL, tcp and ipc,
                   64 KiB / 1 MiB / 8 MiB batches (benchmarks/transport.py)
    preprocessing  clips/s of one producer process on the demo data vs librosa and the
                   numpy reference; CPU per clip and peak RSS (benchmarks/data.py)
    pipeline       real runs with synthetic:MS trainers at several MS vs the ideal
                   1000/MS steps/s; data_wait_frac of each (benchmarks/pipeline.py)
    alternatives   stoker vs tf.data in-process, tf.data service, multiprocessing.Queue on
                   the same data, preprocessing and trainer step (benchmarks/alternatives.py)
    scaling        remote producers N = 1, 2, 4 (benchmarks/producers.py); index build and
                   time to first batch at 13,100 and 100,000 items (benchmarks/data.py)
    batching       frame-budget batches vs fixed rows: padding and shapes of the plans, and
                   (full run only) the tiny model's samples/s at the same memory
                   (benchmarks/batching.py)
    trainer        (full run only) the trainer's input side (dequeue + staging) vs the same
                   model fed from tensors in memory, and traces after warm-up over 1,000
                   steps (benchmarks/trainer.py, the trainer's targets)
    feed           (full run only) the tiny model's steps/s through stoker.Feed in a user's
                   loop and through as_dataset() + fit vs stoker's own trainer; fit on the
                   feed vs fit on a tf.data pipeline: wait share, first batch (benchmarks/feed.py)
    replicas       (full run only) 2 model replicas vs 1, same batch per replica: samples/s
                   and wait share of the tiny model and of a synthetic trainer
                   (benchmarks/replicas.py)
    producer_models  (full run only) one neural encoder (mel -> codes) inside the training step,
                   in the producers (transforms.models), and from the feature cache, vs no
                   encoder: samples/s and wait share, with the processes sharing the cores
                   and one core per device (benchmarks/producer_models.py)
    gpu            (full run only) a PyTorch text-to-mel model fed by stoker.Feed(framework="torch"),
                   by a DataLoader doing the producers' work (checked equal before timing; the
                   per-clip reference mel as an extra way) and from batches held on the device:
                   samples/s, step per shape, wait share; on a host without CUDA a CPU step that
                   holds the interpreter
                   (benchmarks/gpu.py)
    peers          (full run only) the same step fed by stoker.Feed (and with its feature cache), the
                   DataLoader, SPDL (threads, processes), torchdata.nodes (threads, processes) and
                   Grain, all doing the producers' work (checked equal), and replay, at W = 1, 2,
                   interleaved and repeated: samples/s, step per shape, wait share, first batch,
                   CPU and PSS of the process tree, the cores' limit (benchmarks/peers.py)
    scale          manifests of 1 M and 10 M clips with durations (--quick: 20,000 and
                   100,000): index build cold and warm, launch to first batch, samples/s
                   and peak RSS of a synthetic:5 run, per-clip growth (benchmarks/scale.py)

The older sections (memory: the consumer's RSS over thousands of batches; starvation:
diagnosis on injected faults; data: the full data benchmark; producers: scaling,
stand-ins, failover) are not in the default plan, to keep the full run under 20
minutes on two cores; each runs alone (``python -m stoker.benchmarks.NAME``) or by naming it in
``SuitePlan.sections``.

Every figure is the median of repetitions with min and max; every ratio is stored with
the two numbers measured in this run that it came from. Targets are reported, not
enforced: exit status 0 when every section produced its numbers, 1 when one failed.
"""

from __future__ import annotations

import datetime as _dt
import json
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from . import (alternatives, batching, data, feed, gpu, memory, peers, pipeline, producer_models, producers,
                               replicas, scale, starvation, trainer, transforms, transport)
from .common import machine_info, table

SECTIONS = ("transport", "preprocessing", "pipeline", "alternatives", "scaling", "batching", "transforms", "trainer",
            "feed", "replicas", "producer_models", "gpu", "peers", "scale")
# The trainer section (TensorFlow in this process, ~4 minutes) would take --quick past 3 minutes.
QUICK_SECTIONS = ("transport", "preprocessing", "pipeline", "alternatives", "scaling", "batching", "transforms",
                  "scale")
# --quick's scale section: two small manifests, to see the figures and the growth, not the targets.
QUICK_SCALE_SIZES = (20_000, 100_000)
QUICK_LOOSE_SIZES = (20_000,)  # and one LJSpeech layout of loose files
QUICK_PARQUET_SIZES = (100_000,)  # and one set of Parquet files
# Time to first batch at scale: a run of a few steps of this synthetic trainer.
SCALING_FIRST_BATCH_STEP_MS = 10.0


@dataclass
class ScalingPlan:
    producers: producers.ProducersPlan = field(default_factory=lambda: producers.ProducersPlan(sections=("scaling",)))
    index: data.DataPlan = field(default_factory=lambda: data.DataPlan(index_repetitions=2))

    @classmethod
    def quick(cls) -> "ScalingPlan":
        return cls(producers.ProducersPlan(scaling_steps=30, sections=("scaling",)),
                   data.DataPlan(index_sizes=[data.LJSPEECH_ITEMS, 30_000], index_repetitions=1))


def run_scaling(plan: ScalingPlan, log: Any) -> dict[str, Any]:
    """Producers N = 1, 2, 4 and the index (with time to first batch) at two dataset sizes."""
    work = Path(tempfile.mkdtemp(prefix="stoker-bench-scaling-"))
    try:
        def first_batch(root: Path) -> dict[str, Any]:
            # python run.py --data ROOT (index cache cold: built by this run) until the first batch
            run = alternatives.AlternativesPlan(step_ms=SCALING_FIRST_BATCH_STEP_MS, steps=3, workers=1,
                                                data=str(root))
            r = alternatives.run_stoker(run, work / f"first-batch-{root.name}", backend="numpy")
            log(f"scaling: {root.name}: first batch {r['time_to_first_batch_s']:.2f} s after the command")
            return r

        return {"producers": producers.scaling(plan.producers, work, log),
                "index": data.run_index(plan.index, work, log, with_dataset=first_batch)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class SuitePlan:
    transport: transport.TransportPlan = field(default_factory=transport.TransportPlan)
    transport_sizes: dict[str, int] = field(default_factory=lambda: dict(transport.SIZES))
    pipeline: pipeline.PipelinePlan = field(default_factory=pipeline.PipelinePlan)
    memory: memory.MemoryPlan = field(default_factory=memory.MemoryPlan)
    preprocessing_repetitions: int = 5
    alternatives: alternatives.AlternativesPlan = field(default_factory=alternatives.AlternativesPlan)
    scaling: ScalingPlan = field(default_factory=ScalingPlan)
    trainer: trainer.TrainerPlan = field(default_factory=trainer.TrainerPlan)
    batching: batching.BatchingPlan = field(default_factory=batching.BatchingPlan)
    transforms: transforms.TransformsPlan = field(default_factory=transforms.TransformsPlan)
    feed: feed.FeedPlan = field(default_factory=feed.FeedPlan)
    replicas: replicas.ReplicasPlan = field(default_factory=replicas.ReplicasPlan)
    producer_models: producer_models.ProducerModelsPlan = field(default_factory=producer_models.ProducerModelsPlan)
    gpu: gpu.GpuPlan = field(default_factory=gpu.GpuPlan.quick)
    peers: peers.PeersPlan = field(default_factory=peers.PeersPlan.suite)
    scale: scale.ScalePlan = field(default_factory=scale.ScalePlan)
    sections: tuple[str, ...] = SECTIONS

    @classmethod
    def for_mode(cls, quick: bool) -> "SuitePlan":
        if not quick:
            return cls()
        return cls(transport=transport.TransportPlan.quick(), pipeline=pipeline.PipelinePlan.quick(),
                   memory=memory.MemoryPlan.quick(), preprocessing_repetitions=1,
                   alternatives=alternatives.AlternativesPlan.quick(), scaling=ScalingPlan.quick(),
                   trainer=trainer.TrainerPlan.quick(), batching=batching.BatchingPlan.quick(),
                   transforms=transforms.TransformsPlan.quick(),
                   scale=scale.ScalePlan(sizes=QUICK_SCALE_SIZES, loose_sizes=QUICK_LOOSE_SIZES,
                                         parquet_sizes=QUICK_PARQUET_SIZES, mix_sizes=(), steps=100),
                   sections=QUICK_SECTIONS)


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _target(section: str, what: str, value: float, limit: float, met: bool,
            ratio: dict[str, Any] | None = None) -> dict[str, Any]:
    r = ratio or {}
    return {"section": section, "what": what, "value": value, "numerator": r.get("numerator"),
            "denominator": r.get("denominator"), "limit": limit, "met": met}


def _listed(sections: dict[str, Any], names: Sequence[str]) -> list[dict[str, Any]]:
    """The targets of sections that list their own (what, value, limit, met, ratio)."""
    out = []
    for name in names:
        section = sections.get(name) or {}
        items = (section.get("index") or {}).get("targets", {}).values() if name == "scaling" \
            else section.get("targets", [])
        out += [_target(name, t["what"], t["value"], t["limit"], t["met"], t.get("ratio")) for t in items]
    return out


def _pipeline_targets(pipeline_section: dict[str, Any] | None) -> list[dict[str, Any]]:
    out = []
    for cfg in (pipeline_section or {}).get("configs", []):
        if not cfg.get("targets"):
            continue
        t = cfg["targets"]
        out.append(_target("pipeline", t["steps_per_s"]["what"], cfg["steps_ratio"]["value"],
                           t["steps_per_s"]["min_ratio"], t["steps_per_s"]["met"], cfg["steps_ratio"]))
        out.append(_target("pipeline", t["data_wait_frac"]["what"], cfg["data_wait_frac"]["median"],
                           t["data_wait_frac"]["max"], t["data_wait_frac"]["met"]))
        if cfg["capacity"]:
            c = cfg["capacity"]["ratio"]
            out.append(_target("pipeline", t["capacity_above_demand"]["what"], c["value"], 1.0,
                               t["capacity_above_demand"]["met"], c))
    return out


def targets(sections: dict[str, Any]) -> list[dict[str, Any]]:
    """Every judged target, flat: what, the figure, its numbers, met."""
    out = [_target("transport", f"{row['transport']} {row['size']}: {row['target']['what']}", row["ratio"]["value"],
                   row["target"]["min_ratio"], row["target"]["met"], row["ratio"])
           for row in sections.get("transport") or [] if row["target"]["applies"]]
    out += _pipeline_targets(sections.get("pipeline"))
    out += [_target("starvation", f"{name}: {scenario['target']}", float(scenario["met"]), 1.0, scenario["met"])
            for name, scenario in (sections.get("starvation") or {}).items()]
    out += _listed(sections, ("data", "alternatives", "scaling"))
    tr = sections.get("trainer")
    if tr:
        o, r = tr["overhead"], tr["retraces"]
        out.append(_target("trainer", "input side (dequeue + staging) overhead vs in-memory tensors",
                           o["overhead"]["value"], o["target"], o["met"], o["overhead"]))
        out.append(_target("trainer", f"traces after warm-up over {r['steps']} steps",
                           float(r["traces_after_warmup"]), 0.0, r["met"]))
    out += _listed(sections, ("batching", "transforms", "feed", "replicas", "producer_models", "gpu", "peers",
                              "scale"))
    mem = sections.get("memory")
    if mem:
        c = mem["criterion"]
        out.append(_target("memory", c["what"], c["growth_mb"], c["limit_mb"], c["met"]))
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
        "preprocessing": lambda: data.run_preprocessing(plan.preprocessing_repetitions, log=log),
        "alternatives": lambda: alternatives.run(plan.alternatives, log=log),
        "scaling": lambda: run_scaling(plan.scaling, log),
        "pipeline": lambda: pipeline.run(plan.pipeline, log=log),
        "trainer": lambda: trainer.run(plan.trainer),
        "batching": lambda: batching.run(plan.batching, log),
        "transforms": lambda: transforms.run(plan.transforms, log),
        "feed": lambda: feed.run(plan.feed, log),
        "replicas": lambda: replicas.run(plan.replicas, log),
        "producer_models": lambda: producer_models.run(plan.producer_models, log),
        "gpu": lambda: gpu.run(plan.gpu, log),
        "peers": lambda: peers.run(plan.peers, log),
        "scale": lambda: scale.run(plan.scale, log),
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


# The report's sections in the order printed: each one's heading (from its figures) and its tables.
SECTION_VIEWS: tuple[tuple[str, Callable[[dict[str, Any]], str], Callable[[dict[str, Any]], str]], ...] = (
    ("transport", lambda s: "1. transport: protocol (DEALER/ROUTER + wire + credits, capacity 3) vs raw PUSH/PULL; "
                            "median [min,max] of repetitions", transport.render),
    ("preprocessing", lambda s: f"2. preprocessing: one producer process, one thread, the demo data ({s['clips']} "
                                f"clips in {s['batches']} batches of 16): read + resample + log-mel + tokens + "
                                "padding + message; ratio = stoker clips/s / this variant's",
     data.render_preprocessing),
    ("pipeline", lambda s: "3. pipeline: python run.py --model synthetic:MS --batch-size 16 (ideal 1000/MS steps/s); "
                           "after warm-up = from the end of step 1", pipeline.render),
    ("alternatives", lambda s: "4. alternatives: same demo data, same batches, same log-mel (stoker: its default numpy "
                               "backend; stoker (tf ops) and the tf.data variants: TF ops), trainer step = sleep "
                               f"{s['config']['step_ms']:g} ms, P = {s['config']['workers']} (producers / parallel "
                               f"calls / service workers / queue workers), {s['config']['steps']} steps; median "
                               f"[min,max] of {s['config']['repetitions']}", alternatives.render),
    ("scaling", lambda s: "5. scaling",
     lambda s: producers.render({"scaling": s["producers"]}) + "\n\n" + data.render_index(s["index"])),
    ("batching", lambda s: "batching: frame-budget batches vs fixed rows on 13,100 LJSpeech-like clip lengths (same "
                           "peak memory)", batching.render),
    ("transforms", lambda s: "transforms: one producer (numpy backend) over the demo epoch, plain vs trim + loudness "
                             "+ mel normalisation; ms per clip", transforms.render),
    ("feed", lambda s: "feed: the tiny model on the CPU, demo data, batch 16, 2 producers: stoker's trainer, the feed "
                       "in a user's loop, fit on the feed and on tf.data", feed.render),
    ("replicas", lambda s: "replicas: 2 model replicas (2 logical CPU devices) vs 1, demo data, the same batch per "
                           "replica", replicas.render),
    ("producer_models", lambda s: "producer_models: one encoder (mel -> codes, about a training step's cost) in the "
                                  "training step, in the producers, from the cache, vs none; demo data, batch 16, 2 "
                                  "producers; shared cores and one core per device", producer_models.render),
    ("gpu", lambda s: "gpu: a PyTorch text-to-mel model fed by stoker.Feed, a DataLoader (as many workers) doing the "
                      "producers' work, the same with the per-clip reference mel (an extra way), and from batches "
                      "held on the device; the same batches", gpu.render),
    ("peers", lambda s: "peers: the PyTorch step fed by stoker.Feed and by the loaders a user picks instead, the "
                        "producers' work in each (checked equal); median [min,max] of "
                        f"{s['config']['repetitions']} interleaved repetitions", peers.render),
    ("scale", lambda s: "scale: manifests with durations (audio: a few files reused), index cold and warm, a "
                        "synthetic:5 run warm; peak RSS by process", scale.render),
    ("trainer", lambda s: "trainer: the tiny model on the CPU, batch 16, demo bucket shapes; overhead = queue / "
                          "memory time per step - 1 (median of repetitions)", trainer.render),
    ("memory", lambda s: "memory: consumer process RSS (coordinator + queue capacity 3, trainer as fast as possible)",
     memory.render),
    ("starvation", lambda s: "starvation: is the diagnosis right? real runs with injected producer faults",
     starvation.table),
    ("data", lambda s: "data: index build and cache, producer vs librosa, feature cache", data.render),
    ("producers", lambda s: "producers: scaling with N producers, failover of a killed one", producers.render),
)


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    parts = [f"stoker bench ({'quick' if report['quick'] else 'full'}): {m.get('cores')} cores, "
             f"python {m.get('python')}, {m.get('platform')}; {report['duration_s']} s"]
    sections = report["sections"]
    for name, heading, view in SECTION_VIEWS:
        if sections.get(name):
            parts += ["", heading(sections[name]), view(sections[name])]
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

    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.suite")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="bench.json")
    args = parser.parse_args()
    sys.exit(main(args.quick, Path(args.out)))
