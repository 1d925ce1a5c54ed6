"""stoker.Feed against the loaders a user picks instead, on the same work (``python -m
stoker.benchmarks.peers``, and the ``peers`` section of ``python run.py bench``).

The PyTorch step of benchmarks/gpu.py (on the CPU: the small model at width ``CPU_DIM`` plus
tiny torch ops, one torch thread, interpreter-bound as a step that launches kernels is), the
same generated clips and the consumer's planned batches, epoch after epoch. Every way but
replay makes each planned batch by the producers' own code (``producer.batches.BatchMaker.make``
on the lease the coordinator sends, the feed's resolved features: read, the batch's log-mels
by ``MelComputer``, the lease's tokens, collation into the bucket's shape), with W workers:

    replay           one batch per bucket shape made once, replayed: the step alone.
    feed             ``stoker.Feed(framework="torch")`` with W producer processes.
    feed-cache       the same with ``data.feature_cache`` on, the cache empty at the start: the
                     first epoch computes and stores each clip's log-mel, later epochs read
                     it (what only stoker offers: the figure a user with a cache gets; its mels
                     are the cache's 16-bit ones, so it is not in the equality check).
    dataloader       ``torch.utils.data.DataLoader``, W spawned workers, ``batch_size=None``.
    spdl-threads     SPDL's ``PipelineBuilder``: the maker piped with ``concurrency=W`` on the
                     pipeline's thread pool (``num_threads=W``), in the plan's order.
    spdl-processes   the same stage on a ``ProcessPoolExecutor`` of W spawned processes (each
                     with its own maker, made by the pool's initializer).
    nodes-threads    ``torchdata.nodes``: ``ParallelMapper(method="thread", num_workers=W)``,
                     a ``Prefetcher`` of 2, a ``Loader``.
    nodes-processes  the same with ``method="process"`` (spawned).
    grain            Grain: ``MapDataset.source(plan).map(maker).to_iter_dataset(one read
                     thread).mp_prefetch(W workers)``: W processes, one batch computed at a time
                     in each, as a DataLoader worker computes.

A way whose package is not installed is skipped, with one line saying so. Before any way is
timed, a check child takes one epoch from a feed (one producer) and from every way that makes
batches (W = 1) and requires each way's arrays to equal the feed's, batch by batch (the same
ids), exactly, and every clip taken once. Every timed run counts each clip once per epoch
inside its loop too (the lease each step took; the feed's samples.jsonl), and fails otherwise.

Each (way, W) runs in its own process, all of them interleaved and repeated (the order
rotated each repetition; this host's CPU speed drifts): median, min and max of each figure.
Figures of a run: samples/s after the warm-up steps; the median step per bucket shape against
replay's (each shape's first step left out); the wait share (time in ``next()``); the time to
the first batch (from before the index is built: the feed's own, for the feed ways, which count
against the bench's plan after their loop); the CPU seconds of the whole process tree
(``getrusage`` of the waited-for children: workers, producers and the coordinator included);
the peak PSS of the tree (psutil, sampled every ``MEMORY_SAMPLE_S``: shared pages split among
the processes that map them, so torch's libraries are not counted once per worker).

The cores' limit: the host's cores over (the data CPU per batch, the BatchMaker's in the check,
plus the step's CPU per batch, replay's) in batches/s, times the samples per batch; and the
step's own limit (one interpreter runs the steps: 1 / the step's CPU); "of limit" is against
the smaller. Targets
(reported, not enforced), at every W: the feed's median samples/s >= 1.1 x the best peer's with
the spreads not overlapping; the feed at >= 0.9 of the cores' limit; its first batch within 1 s
of the fastest peer's.

    python -m stoker.benchmarks.peers [--quick] [--workers 1 --workers 2] [--repetitions N]
        [--clips N] [--epochs E] [--way NAME ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import importlib.util
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import psutil

from . import gpu
from .common import (CHILD_TIMEOUT_S, QUIET_ENV, BenchError, machine_info, ratio, report, spread, table, targets_table,
                     write_json)
from .corpus import leases_of, make_clips
from ..launcher import PRODUCER_ENV
from ..shared.proc import steady_heap
from ..shared.runfiles import SAMPLES

RESULT_PREFIX = "PEERS-BENCH-RESULT "
FEED_WAYS = ("feed", "feed-cache")
# The ways that make the batches by the producers' code in a pipeline of another package (or torch's).
PEER_WAYS = ("dataloader", "spdl-threads", "spdl-processes", "nodes-threads", "nodes-processes", "grain")
WAYS = ("replay", *FEED_WAYS, *PEER_WAYS)
# The package each peer needs (its import name), beyond torch.
PACKAGES = {"spdl-threads": "spdl", "spdl-processes": "spdl", "nodes-threads": "torchdata",
            "nodes-processes": "torchdata", "grain": "grain"}
# Batches a peer holds ready beyond those in the making (the DataLoader's default prefetch per worker).
PREFETCH = 2
MEMORY_SAMPLE_S = 0.25
TARGET_LEAD = 1.1
TARGET_OF_LIMIT = 0.9
TARGET_FIRST_BATCH_S = 1.0


@dataclass
class PeersPlan:
    clips: int = 256
    batch_size: int = 16
    epochs: int = 6
    workers: tuple[int, ...] = (1, 2)
    repetitions: int = 3
    ways: tuple[str, ...] = WAYS
    size: str = "small"
    warmup_steps: int = 4
    cpu_hold_ops: int = -1  # -1: gpu.CPU_HOLD_OPS of the size

    @classmethod
    def quick(cls) -> "PeersPlan":
        return cls(clips=96, epochs=3, repetitions=1)

    @classmethod
    def suite(cls) -> "PeersPlan":
        """The bench's full run: shorter runs, two repetitions (~5 minutes on two cores)."""
        return cls(clips=128, epochs=4, repetitions=2)


def missing(ways: Sequence[str]) -> dict[str, str]:
    """The ways whose package is not installed here, each with its one line."""
    return {way: f"{way} skipped: the package {PACKAGES[way]!r} is not installed (pip install '.[test]')"
            for way in ways if way in PACKAGES and importlib.util.find_spec(PACKAGES[way]) is None}


# ---------------------------------------------------------------- the peers' pipelines (child)
class Maker:
    """Planned batch ``i`` -> ``(i, its arrays)``, by the producers' BatchMaker
    (gpu.PlannedDataset): one dataset copy per thread (a BatchMaker keeps buffers), and per
    process (pickled without its maker)."""

    def __init__(self, dataset: gpu.PlannedDataset) -> None:
        self.dataset = dataset
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["dataset"])  # type: ignore[misc]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> tuple[int, dict[str, np.ndarray]]:
        return self(i)

    def __call__(self, i: int) -> tuple[int, dict[str, np.ndarray]]:
        mine = getattr(self._local, "dataset", None)
        if mine is None:
            mine = self._local.dataset = copy.copy(self.dataset)
        return i, mine.arrays(i)


_POOL_MAKER: Maker | None = None


def _pool_init(maker: Maker) -> None:
    global _POOL_MAKER
    _POOL_MAKER = maker


def _pool_make(i: int) -> tuple[int, dict[str, np.ndarray]]:
    """One batch in a process of SPDL's pool (the maker its initializer left there)."""
    assert _POOL_MAKER is not None
    return _POOL_MAKER(i)


def peer_batches(way: str, maker: Maker, workers: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(i, arrays)`` of every planned batch, in the plan's order, made by ``way``'s pipeline."""
    n = len(maker)
    spawn = multiprocessing.get_context("spawn")
    if way == "dataloader":
        import torch

        yield from torch.utils.data.DataLoader(maker, batch_size=None, shuffle=False, num_workers=workers,
                                               prefetch_factor=PREFETCH, multiprocessing_context=spawn)
    elif way in ("spdl-threads", "spdl-processes"):
        from spdl.pipeline import PipelineBuilder  # an optional peer: imported by its way alone

        pool = (ProcessPoolExecutor(workers, mp_context=spawn, initializer=_pool_init, initargs=(maker,))
                if way == "spdl-processes" else None)
        op = _pool_make if pool else maker
        pipeline = (PipelineBuilder().add_source(range(n))
                    .pipe(op, concurrency=workers, executor=pool, output_order="input")
                    .add_sink(PREFETCH).build(num_threads=workers))
        try:
            with pipeline.auto_stop():
                yield from pipeline
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
    elif way in ("nodes-threads", "nodes-processes"):
        import torchdata.nodes as tn  # an optional peer: imported by its way alone

        node = tn.ParallelMapper(tn.IterableWrapper(range(n)), maker, num_workers=workers, in_order=True,
                                 method="process" if way == "nodes-processes" else "thread",
                                 multiprocessing_context="spawn")
        yield from tn.Loader(tn.Prefetcher(node, prefetch_factor=PREFETCH))
    elif way == "grain":
        import grain  # an optional peer: imported by its way alone
        from absl import flags  # Grain's dependency

        if not flags.FLAGS.is_parsed():  # Grain reads its absl flags; a program without absl.app parses none
            flags.FLAGS.mark_as_parsed()
        ds = grain.MapDataset.source(range(n)).map(maker).to_iter_dataset(
            grain.ReadOptions(num_threads=1, prefetch_buffer_size=PREFETCH))
        yield from ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=PREFETCH))
    else:
        raise ValueError(f"unknown way {way!r}")


def as_torch(torch: Any, made: Iterator[tuple[int, dict[str, Any]]], taken: list[int]) -> Iterator[dict[str, Any]]:
    """The loop's batches as torch tensors (numpy's without a copy); each one's plan index into ``taken``."""
    for i, arrays in made:
        taken.append(int(i))
        yield {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(v) for k, v in arrays.items()}


def counted_once(leases: Sequence[Any], taken: Sequence[Sequence[str]], clips: set[str]) -> dict[str, Any]:
    """Every clip taken once per epoch: the ids of the batches the loop took (``taken``, one
    tuple per step) against the plan's epochs; BenchError naming the first clip that is not."""
    epochs = sorted({lease.epoch for lease in leases})
    counts = collections.Counter(i for ids in taken for i in ids)
    for clip in sorted(clips):
        if counts[clip] != len(epochs):
            raise BenchError(f"clip {clip} was taken {counts[clip]} times in {len(epochs)} epochs")
    if set(counts) != clips:
        raise BenchError(f"the loop took clips the plan does not have: {sorted(set(counts) - clips)[:3]}")
    return {"clips": len(clips), "epochs": len(epochs), "steps": len(taken)}


def feed_ids(run_dir: Path) -> list[tuple[str, ...]]:
    """The ids of each step's batch, from the feed's samples.jsonl, in step order."""
    rows = [json.loads(line) for line in (run_dir / SAMPLES).read_text(encoding="utf-8").splitlines() if line]
    return [tuple(row["ids"]) for row in sorted(rows, key=lambda row: row["step"])]


class StepCpu:
    """The step, with the CPU seconds of the loop's thread in each call (``cpu_s``)."""

    def __init__(self, step: gpu.Step) -> None:
        self.step = step
        self.model = step.model
        self.cpu_s: list[float] = []

    def __call__(self, batch: dict[str, Any]) -> Any:
        began = time.thread_time()
        loss = self.step(batch)
        self.cpu_s.append(time.thread_time() - began)
        return loss


def child_main(spec: dict[str, Any]) -> dict[str, Any]:
    """One way with W workers (or the check): its raw figures."""
    import torch

    torch.set_num_threads(1)  # the step is one interpreter's work; the workers have the other cores
    steady_heap()  # every way's step on the feed's malloc settings (gpu.child_main)
    work = Path(spec["work"])
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    kind, workers = spec["kind"], spec["workers"]
    size = gpu.ModelSize(**spec["size"])
    clock = gpu.StepClock(torch, False)
    if kind in FEED_WAYS:  # the feed builds its index and plan itself; the bench's plan, to count, after the loop
        sets = {"trainer.record_samples": True}
        if kind == "feed-cache":
            sets["data.feature_cache"] = str(work / "features")
        feed = gpu.open_feed(spec, spec["epochs"], workers, work / "run", **sets).prepare()
        step = StepCpu(gpu.Step(torch, feed.vocabulary.size, feed.n_mels, size, "cpu", spec["hold_ops"]))
        with feed:
            out = gpu.timed_loop(torch, iter(feed), step, clock, "cpu", on_step=lambda loss: feed.step_done(loss=loss))
        _, _, planned, tokens = gpu.planned_batches(spec["data"], spec["batch_size"], spec["epochs"])
        leases = leases_of(planned, tokens)
        counted = counted_once(leases, feed_ids(work / "run"), {i for lease in leases for i in lease.ids})
        return child_result(out, step, clock, counted, started, kind)
    cfg, index, planned, tokens = gpu.planned_batches(spec["data"], spec["batch_size"], spec["epochs"])
    leases = leases_of(planned, tokens)
    dataset = gpu.PlannedDataset(spec["data"], cfg.features, leases)
    clips = {lease_id for lease in leases for lease_id in lease.ids}
    if kind == "check":
        return check(torch, spec, dataset, clips)
    step = StepCpu(gpu.Step(torch, index.vocabulary.size, cfg.features.n_mels, size, "cpu", spec["hold_ops"]))
    if kind == "replay":
        out = gpu.replay_loop(torch, dataset, step, clock, "cpu")
        counted = None
    else:
        taken: list[int] = []
        out = gpu.timed_loop(torch, as_torch(torch, peer_batches(kind, Maker(dataset), workers), taken), step,
                             clock, "cpu")
        counted = counted_once(leases, [leases[i].ids for i in taken], clips)
    return child_result(out, step, clock, counted, started, kind)


def child_result(out: dict[str, Any], step: "StepCpu", clock: Any, counted: dict[str, Any] | None, started: float,
                 kind: str) -> dict[str, Any]:
    """A timed child's raw figures: its loop's, the step's CPU, the first batch from ``started``."""
    first = out.pop("first_batch")
    return {**out, "step_s": clock.seconds(), "gpu_util": None, "counted": counted,
            "step_cpu_ms": statistics.median(step.cpu_s) * 1e3,
            "parameters": sum(p.numel() for p in step.model.parameters()),
            "first_batch_s": None if first is None or kind == "replay" else first - started}


def check(torch: Any, spec: dict[str, Any], dataset: gpu.PlannedDataset, clips: set[str]) -> dict[str, Any]:
    """One epoch from a feed (one producer) against one epoch of every way in ``spec["ways"]``
    (W = 1): arrays equal batch by batch, each clip taken once (BenchError otherwise); and the
    BatchMaker's CPU per batch, made here (the data CPU of the cores' limit)."""
    run_dir = Path(spec["work"]) / "run"
    got = []
    with gpu.open_feed(spec, 1, 1, run_dir, **{"trainer.record_samples": True}) as feed:
        for batch in feed:
            got.append({name: tensor.numpy().copy() for name, tensor in batch.items()})  # before its slot is reused
            feed.step_done()
    ids = feed_ids(run_dir)
    if len(ids) != len(got):
        raise BenchError(f"the feed handed out {len(got)} batches, its samples.jsonl names {len(ids)}")
    counted_once(dataset.leases, ids, clips)
    ways = {}
    for way in spec["ways"]:
        taken: list[int] = []
        items: list[Any] = [None] * len(dataset)
        for i, arrays in peer_batches(way, Maker(dataset), 1):
            taken.append(int(i))
            items[int(i)] = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in arrays.items()}
        ways[way] = {**gpu.check_same_work(list(zip(ids, got)), dataset.leases, items, None),
                     **counted_once(dataset.leases, [dataset.leases[i].ids for i in taken], clips)}
    cpu_ms = []
    for i in [*range(len(dataset))] * 2:  # the first pass warms the maker up; the second's are kept
        began = time.process_time()
        dataset.arrays(i)
        cpu_ms.append((time.process_time() - began) * 1e3)
    cpu_ms = cpu_ms[len(dataset):]
    return {"batches": len(got), "ways": ways, "data_cpu_ms_per_batch": spread(cpu_ms)}


# ---------------------------------------------------------------- the parent: runs and figures
class TreeMemory:
    """Peak PSS of a process and its descendants, summed per sample (in a thread)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(MEMORY_SAMPLE_S):
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            total = 0
            for p in procs:
                try:
                    total += p.memory_full_info().pss
                except psutil.Error:
                    continue
            self.peak = max(self.peak, total)

    def stop_mb(self) -> float:
        self._stop.set()
        self._thread.join(5)
        return self.peak / 1e6


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_child(spec: dict[str, Any], log_path: Path) -> dict[str, Any]:
    """One child (a way, or the check), measured from here: its result, CPU seconds of its
    process tree, peak PSS."""
    env = {**PRODUCER_ENV, **os.environ, **QUIET_ENV}  # every way's batches made in a producer's environment
    cpu0 = _children_cpu_s()
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "stoker.benchmarks.peers", "child", json.dumps(spec)],
                                stdout=subprocess.PIPE, stderr=log_file, env=env)
        memory = TreeMemory(proc.pid)
        try:
            stdout, _ = proc.communicate(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise BenchError(f"{spec['kind']} W={spec.get('workers')} timed out after {CHILD_TIMEOUT_S:.0f} s") \
                from None
        finally:
            peak_mb = memory.stop_mb()
    cpu_s = _children_cpu_s() - cpu0
    lines = [line for line in stdout.decode("utf-8", "replace").splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise BenchError(f"{spec['kind']} W={spec.get('workers')} exited with status {proc.returncode}:\n{tail}")
    return {**json.loads(lines[-1][len(RESULT_PREFIX):]), "tree_cpu_s": cpu_s, "peak_pss_mb": peak_mb}


def summarize(raw: dict[str, Any], warmup_steps: int) -> dict[str, Any]:
    """gpu.summarize_run's figures, with the tree's CPU and PSS and the loop's CPU per step."""
    s = gpu.summarize_run(raw, warmup_steps)
    return {key: s[key] for key in ("samples", "steps", "samples_per_s", "wait_share", "first_batch_s", "step_ms")} | {
        "cpu_s": raw["tree_cpu_s"], "peak_pss_mb": raw["peak_pss_mb"],
        "step_cpu_ms": raw["step_cpu_ms"], "counted": raw["counted"]}


def schedule(plan: PeersPlan, ways: Sequence[str], rep: int) -> list[tuple[str, int]]:
    """One repetition's runs: replay once, every other way at every W; rotated by ``rep``."""
    runs = [("replay", 0)] if "replay" in ways else []
    runs += [(way, w) for w in plan.workers for way in ways if way != "replay"]
    k = rep % len(runs) if runs else 0
    return runs[k:] + runs[:k]


FIGURES = ("samples_per_s", "wait_share", "first_batch_s", "cpu_s", "peak_pss_mb", "step_cpu_ms")


def run(plan: PeersPlan | None = None, log: Callable[[str], None] | None = None,
        partial: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The check, then every (way, W) of ``plan``, interleaved, ``repetitions`` times: the report."""
    plan = plan or PeersPlan()
    log = log or (lambda text: None)
    skipped = missing(plan.ways)
    for line in skipped.values():
        log(f"peers: {line}")
    ways = [w for w in plan.ways if w not in skipped]
    size = gpu.SIZES[plan.size]
    size = dataclasses.replace(size, dim=gpu.CPU_DIM, heads=min(size.heads, 4))
    hold = plan.cpu_hold_ops if plan.cpu_hold_ops >= 0 else gpu.CPU_HOLD_OPS[plan.size]
    head = {"config": {**dataclasses.asdict(plan), "workers": list(plan.workers), "ways": list(plan.ways)},
            "machine": machine_info(), "cores": len(os.sched_getaffinity(0)), "skipped": skipped,
            "step": f"{plan.size} model at width {gpu.CPU_DIM} + {hold} tiny torch ops (interpreter-bound), "
                    "wall clock, 1 torch thread"}
    work = Path(tempfile.mkdtemp(prefix="stoker-bench-peers-"))
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        data = work / "clips"
        make_clips(data, plan.clips)
        base = {"data": str(data), "batch_size": plan.batch_size, "size": dataclasses.asdict(size),
                "hold_ops": hold, "name": plan.size}
        head["same_work"] = run_child({**base, "kind": "check", "epochs": 1, "workers": 1,
                                       "ways": [w for w in ways if w in PEER_WAYS], "work": str(work / "check")},
                                      work / "check.log")
        log(f"peers check: {', '.join(head['same_work']['ways'])} equal to the feed's arrays in "
            f"{head['same_work']['batches']} batches, every clip once")
        for rep in range(plan.repetitions):
            for way, w in schedule(plan, ways, rep):
                name = f"{way}-{w}-{rep}"
                spec = {**base, "kind": way, "epochs": plan.epochs, "workers": w, "work": str(work / name)}
                s = summarize(run_child(spec, work / f"{name}.log"), plan.warmup_steps)
                shutil.rmtree(work / name, ignore_errors=True)  # a feed-cache run starts with an empty cache
                samples.setdefault(way, {}).setdefault(str(w), []).append(s)
                log(f"peers rep {rep + 1}/{plan.repetitions} {way} W={w}: {s['samples_per_s']:.1f} samples/s, "
                    f"wait {s['wait_share']:.3f}, first batch {s['first_batch_s'] or 0:.2f} s, "
                    f"CPU {s['cpu_s']:.1f} s, PSS {s['peak_pss_mb']:.0f} MB")
                if partial is not None:
                    partial({**head, "runs": copy.deepcopy(samples), "complete": False})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {**head, **figures(head, samples), "complete": True}


def figures(head: dict[str, Any], samples: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Spreads per (way, W); each way's step per shape against replay's; the cores' limit; the targets."""
    ways: dict[str, dict[str, Any]] = {}
    for way, by_w in samples.items():
        for w, runs in by_w.items():
            shapes = sorted({shape for r in runs for shape in r["step_ms"]})
            ways.setdefault(way, {})[w] = {f: spread([r[f] for r in runs if r[f] is not None])
                                           for f in FIGURES if any(r[f] is not None for r in runs)} | {
                "step_ms": {shape: statistics.median([r["step_ms"][shape]["median"] for r in runs
                                                      if shape in r["step_ms"]]) for shape in shapes},
                "samples": runs[0]["samples"], "runs": runs}
    replay = (ways.get("replay") or {}).get("0")
    if replay is not None:
        for way, by_w in ways.items():
            for v in by_w.values():
                v["step_vs_replay"] = {shape: ms / replay["step_ms"][shape] for shape, ms in v["step_ms"].items()
                                       if replay["step_ms"].get(shape)}
    out: dict[str, Any] = {"ways": ways, "limit": None, "targets": []}
    if replay is None:
        return out
    steps = replay["runs"][0]["steps"]
    data_ms = head["same_work"]["data_cpu_ms_per_batch"]["median"]
    step_ms = replay["step_cpu_ms"]["median"]
    per_batch = replay["samples"] / steps
    cores_limit = head["cores"] / ((data_ms + step_ms) / 1e3) * per_batch
    step_limit = 1e3 / step_ms * per_batch  # one interpreter runs the steps one after another
    limit = min(cores_limit, step_limit)
    out["limit"] = {"samples_per_s": limit, "cores_samples_per_s": cores_limit, "step_samples_per_s": step_limit,
                    "cores": head["cores"], "data_cpu_ms_per_batch": data_ms, "step_cpu_ms_per_batch": step_ms,
                    "samples_per_batch": per_batch}
    for way, by_w in ways.items():
        for v in by_w.values():
            v["of_limit"] = v["samples_per_s"]["median"] / limit
    out["targets"] = targets(ways, limit)
    return out


def targets(ways: dict[str, Any], limit: float) -> list[dict[str, Any]]:
    """At each W the feed ran: the lead over the best peer, the share of the cores' limit, the first batch."""
    out = []
    for w, feed in (ways.get("feed") or {}).items():
        peers = {way: ways[way][w] for way in PEER_WAYS if w in ways.get(way, {})}
        if not peers:
            continue
        best = max(peers, key=lambda way: peers[way]["samples_per_s"]["median"])
        f, p = feed["samples_per_s"], peers[best]["samples_per_s"]
        r = ratio(f["median"], p["median"], note=f"feed / {best} samples/s (medians)")
        out.append({"what": f"W={w}: feed / best peer ({best}) samples/s, spreads apart", "value": r["value"],
                    "ratio": r, "limit": TARGET_LEAD, "apart": f["min"] > p["max"],
                    "met": r["value"] >= TARGET_LEAD and f["min"] > p["max"]})
        out.append({"what": f"W={w}: feed samples/s / the cores' limit", "value": feed["of_limit"],
                    "limit": TARGET_OF_LIMIT, "met": feed["of_limit"] >= TARGET_OF_LIMIT})
        fastest = min(peers, key=lambda way: peers[way]["first_batch_s"]["median"])
        gap = feed["first_batch_s"]["median"] - peers[fastest]["first_batch_s"]["median"]
        out.append({"what": f"W={w}: feed first batch - fastest peer's ({fastest}), s", "value": gap,
                    "limit": TARGET_FIRST_BATCH_S, "met": gap <= TARGET_FIRST_BATCH_S})
    return out


def render(section: dict[str, Any]) -> str:
    def cell(v: dict[str, Any] | None, digits: int = 1) -> str:
        return "-" if v is None else f"{v['median']:.{digits}f} [{v['min']:.{digits}f},{v['max']:.{digits}f}]"

    parts = [f"step: {section['step']}; {section['cores']} cores"]
    parts += list(section["skipped"].values())
    same = section["same_work"]
    parts.append(f"before timing: {', '.join(same['ways']) or 'no peer'} equal to the feed's arrays in "
                 f"{same['batches']} batches, every clip once")
    lim = section.get("limit")
    if lim:
        parts.append(f"the cores' limit: {lim['cores']} cores / ({lim['data_cpu_ms_per_batch']:.1f} ms data CPU + "
                     f"{lim['step_cpu_ms_per_batch']:.1f} ms step CPU per batch) x {lim['samples_per_batch']:.1f} "
                     f"samples = {lim['cores_samples_per_s']:.1f} samples/s; the step's own (one interpreter) "
                     f"{lim['step_samples_per_s']:.1f}; of limit: of the smaller")
    rows = []
    for way, by_w in section["ways"].items():
        for w, v in sorted(by_w.items()):
            vs = v.get("step_vs_replay") or {}
            rows.append([way, w if w != "0" else "-", cell(v["samples_per_s"]),
                         "-" if "of_limit" not in v else f"{v['of_limit']:.2f}", cell(v["wait_share"], 3),
                         cell(v.get("first_batch_s"), 2), cell(v["cpu_s"]), cell(v["peak_pss_mb"], 0),
                         f"{statistics.median(vs.values()):.3f} / {max(vs.values()):.3f}" if vs else "-"])
    parts += ["", table(["way", "W", "samples/s", "of limit", "wait share", "first batch s", "CPU s (tree)",
                         "peak PSS MB", "step/replay median/worst shape"], rows)]
    if section.get("targets"):
        parts += ["", targets_table(section["targets"], value=".3f")]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["child"]:
        print(RESULT_PREFIX + json.dumps(child_main(json.loads(args[1]))), flush=True)
        return 0
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.peers", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer clips and epochs, one repetition")
    parser.add_argument("--workers", type=int, action="append", help="W (default 1 and 2)")
    parser.add_argument("--way", action="append", choices=WAYS, help="the ways (default: all)")
    parser.add_argument("--repetitions", type=int)
    parser.add_argument("--clips", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--warmup-steps", type=int)
    parser.add_argument("--out", help="also write the section to this JSON file (after each run, complete: false)")
    ns = parser.parse_args(args)
    plan = PeersPlan.quick() if ns.quick else PeersPlan()
    changes = {"workers": tuple(ns.workers) if ns.workers else None, "ways": tuple(ns.way) if ns.way else None,
               "repetitions": ns.repetitions, "clips": ns.clips, "epochs": ns.epochs,
               "warmup_steps": ns.warmup_steps}
    plan = dataclasses.replace(plan, **{k: v for k, v in changes.items() if v is not None})
    try:
        section = run(plan, log=lambda text: print(text, file=sys.stderr, flush=True),
                      partial=(lambda kept: write_json(Path(ns.out), kept)) if ns.out else None)
    except BenchError as exc:
        print(f"peers benchmark failed: {exc}", file=sys.stderr)
        return 1
    return report(render(section), section, ns.out)


if __name__ == "__main__":
    sys.exit(main())
