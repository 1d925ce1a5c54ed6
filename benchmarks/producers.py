"""Producers benchmark: remote producers over TCP, scaling and failover.

Everything runs as real processes on this host, the producers as ``run.py produce``
connecting over loopback TCP to a trainer started with ``--producers 0`` (remote
producers only), exactly as producers on other hosts would. Numpy log-mels (no
TensorFlow) on the embedded demo set, batch 16.

scaling   trainer ``--model synthetic:1`` (a 1 ms step: the trainer is not the limit),
          with N = 1, 2, 4 producers (one ``run.py produce --producers N``). Figure:
          samples/s in the steady state, from the trainer's metrics.jsonl: from the
          step at which SKIP_FRAC of the run is done to the last step,
          ``sum(samples) / (t_last - t_first)``. Efficiency = aggregate / (N x the
          N = 1 figure). Target: >= 0.9 until the trainer is the limit. The producers'
          CPU seconds are sampled too: on a 2-core host the CPU is the limit first,
          and samples per producer CPU-second shows whether the pipeline or the CPU
          caps it.

standin   the same as scaling, with stand-in producers (STANDIN_HOLD_MS per batch
          without using the CPU, then a batch of the leased shape; the real protocol:
          HELLO with the dataset, leases, READY, credits, heartbeats) instead of
          ``run.py produce``: how the trainer's side (coordinator, sockets, queue)
          scales with N when the producers' CPU is not the limit. Each is a process;
          runs have N x the steps, so each lasts about as long. One stand-in's rate
          includes its per-batch round trip (READY, CREDIT), which N of them overlap,
          so the efficiency can come out a little above 1.

failover  trainer ``--model synthetic:250`` (demand 4 batches/s), 3 producers (each its
          own ``run.py produce``), default heartbeats (1 s interval, 5 s timeout),
          ``--epochs`` with ``--record-samples``. After KILL_AT_FRAC of the steps, one
          producer is hit, in two runs: "kill" = SIGKILL (its launcher is suspended
          first, so that it cannot restart it; the kernel closes the connection, which
          the coordinator sees at once) and "freeze" = SIGSTOP (the connection stays
          open and silent: only the heartbeat timeout finds it, as for a network
          partition). Figures: the time from its last message (and from the hit) to the
          last of its batches being leased to a survivor (summary.json ``failovers``;
          target <= heartbeat timeout + 1 s); data_wait_frac after warm-up over the
          whole run and over the steps after the hit (target <= 0.05, with the
          survivors' capacity above the demand, shown); and whether every sample was
          trained exactly once per epoch.

Run alone: ``python -m stoker.benchmarks.producers [--quick] [--json FILE]``: prints the tables
and returns the section as a dict (``run()`` returns the same dict).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue as queue_mod
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import psutil
import zmq

from .common import STOKER, BenchError, machine_info, ratio, spawn_context, stop_children, table
from ..shared import wire
from ..shared.batch import SCHEMA, batch_dims, collate
from ..shared.config import FeaturesConfig
from ..shared.dataset.agreement import describe_copy
from ..shared.dataset.corpus.registry import read_metadata
from ..shared.dataset.files import DEMO_DATA_DIR
from ..shared.metrics import wait_share
from ..shared.mel import pad_values

BATCH_SIZE = 16
SCALING_STEP_MS = 1.0
FAILOVER_STEP_MS = 250.0
FAILOVER_PRODUCERS = 3
# Default heartbeats (configs/default.yaml), which the failover target is stated for.
HEARTBEAT_TIMEOUT_S = 5.0
TARGET_EFFICIENCY = 0.9
TARGET_REISSUE_SLACK_S = 1.0
TARGET_WAIT_FRAC = 0.05
# The steady state starts when this share of the steps is done (start-up and joins before).
SKIP_FRAC = 0.2
# The failover kill comes when this share of the steps is done.
KILL_AT_FRAC = 0.3
# Start-up of a run.py process, and the run itself beyond its ideal length.
START_S = 60.0
RUN_SLACK_S = 120.0
# How often the producers' CPU times are sampled (their last sample before they exit counts).
CPU_SAMPLE_S = 0.25
# After the run, the launchers get this long to stop on their own (the trainer's STOP).
STOP_S = 15.0
# A stand-in producer "prepares" a batch in this long without using the CPU.
STANDIN_HOLD_MS = 100.0
# Stand-in producers say they are alive this often (the default heartbeat interval).
STANDIN_BEAT_S = 1.0
NUMPY = ["--set", "features.backend=numpy"]


@dataclass
class ProducersPlan:
    counts: tuple[int, ...] = (1, 2, 4)
    scaling_steps: int = 120
    failover_epochs: int = 30  # 4 batches per epoch of the demo set: 120 steps, 30 s at 4 steps/s
    sections: tuple[str, ...] = ("scaling", "standin", "failover")

    @classmethod
    def quick(cls) -> "ProducersPlan":
        return cls(counts=(1, 2, 4), scaling_steps=60, failover_epochs=15)


# ---------------------------------------------------------------- processes
class Proc:
    """A ``run.py`` child with its output lines collected by a thread; waits have deadlines."""

    def __init__(self, args: Sequence[str], log_path: Path) -> None:
        self.argv = [*STOKER, *args]
        self.lines: list[str] = []
        self._queue: queue_mod.Queue[str | None] = queue_mod.Queue()
        self._log = open(log_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float) -> str:
        regex = re.compile(pattern)
        for line in self.lines:
            if regex.search(line):
                return line
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(f"no line matching {pattern!r} within {timeout:.0f} s from {' '.join(self.argv)}")
            try:
                line = self._queue.get(timeout=remaining)
            except queue_mod.Empty:
                continue
            if line is None:
                raise BenchError(f"{' '.join(self.argv)} ended (status {self.proc.wait()}) before {pattern!r}")
            self.lines.append(line)
            if regex.search(line):
                return line

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(5)
        return code

    def stop(self) -> None:
        """Whatever is still running: the launcher's own shutdown (SIGTERM), then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._reader.join(5)
        self._log.close()


def descendants(pid: int) -> list[Any]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


class CpuSampler:
    """The last CPU times (user + system) seen of each producer process, sampled in a thread."""

    def __init__(self, launchers: list[Proc]) -> None:
        self.launchers = launchers
        self.seconds: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(CPU_SAMPLE_S):
            for launcher in self.launchers:
                for child in descendants(launcher.proc.pid):
                    try:
                        times = child.cpu_times()
                    except psutil.Error:
                        continue
                    self.seconds[child.pid] = times.user + times.system

    def total(self) -> float:
        self._stop.set()
        self._thread.join(5)
        return sum(self.seconds.values())


def trainer_args(run_dir: Path, step_ms: float, *extra: str) -> list[str]:
    return ["--model", f"synthetic:{step_ms:g}", "--batch-size", str(BATCH_SIZE), "--producers", "0",
            "--model-start-delay", "0", "--run-dir", str(run_dir), "--set", "trainer.log_every_steps=5",
            *NUMPY, *extra]


def endpoint_of(trainer: Proc) -> str:
    line = trainer.wait_for(r"consumer listening on tcp://", START_S)
    found = re.search(r"(tcp://\S+)", line)
    assert found is not None
    return found.group(1)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def steady_rate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples/s from the step at SKIP_FRAC of the run to the last one."""
    rows = sorted(rows, key=lambda r: r["step"])
    if len(rows) < 5:
        raise BenchError(f"only {len(rows)} steps")
    first = rows[max(1, int(len(rows) * SKIP_FRAC))]
    window = [r for r in rows if r["step"] > first["step"]]
    seconds = window[-1]["t"] - first["t"]
    samples = sum(r["samples"] for r in window)
    if seconds <= 0 or samples <= 0:
        raise BenchError("no measurable steady phase")
    return {"samples_per_s": samples / seconds, "samples": samples, "seconds": seconds,
            "from_step": first["step"], "to_step": window[-1]["step"]}


def wait_frac(rows: list[dict[str, Any]]) -> float:
    return wait_share(rows) or 0.0


# ---------------------------------------------------------------- scaling
def scaling_run(count: int, steps: int, work: Path) -> dict[str, Any]:
    run_dir = work / f"scaling-{count}"
    trainer = Proc(trainer_args(run_dir, SCALING_STEP_MS, "--steps", str(steps)), work / f"scaling-{count}.log")
    launchers: list[Proc] = []
    try:
        endpoint = endpoint_of(trainer)
        launchers.append(Proc(["produce", "--connect", endpoint, "--producers", str(count)],
                              work / f"scaling-{count}-produce.log"))
        sampler = CpuSampler(launchers)
        code = trainer.wait(timeout=START_S + RUN_SLACK_S + steps)
        cpu_s = sampler.total()
        if code != 0:
            raise BenchError(f"trainer exited with status {code}; see {work}")
        launchers[0].wait(timeout=STOP_S)
    finally:
        for proc in [trainer, *launchers]:
            proc.stop()
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    rate = steady_rate(rows)
    prep = [p["prep_ms_mean"] for p in summary["producers"] if p.get("prep_ms_mean")]
    total_samples = sum(r["samples"] for r in rows)
    return {
        "producers": count,
        "steady": rate,
        "samples_per_s": rate["samples_per_s"],
        "prep_ms_mean": sum(prep) / len(prep) if prep else None,
        "producer_cpu_s": cpu_s,
        "samples_per_producer_cpu_s": total_samples / cpu_s if cpu_s > 0 else None,
        "data_wait_frac": summary.get("data_wait_frac"),
        "command": "python run.py " + " ".join(trainer_args(Path("RUN"), SCALING_STEP_MS, "--steps", str(steps)))
                   + f"  +  python run.py produce --connect ENDPOINT --producers {count}",
    }


def scaling(plan: ProducersPlan, work: Path, log: Any) -> dict[str, Any]:
    rows = []
    for count in plan.counts:
        row = scaling_run(count, plan.scaling_steps, work)
        rows.append(row)
        log(f"producers scaling N={count}: {row['samples_per_s']:.1f} samples/s, prep {row['prep_ms_mean']:.1f} ms, "
            f"producer CPU {row['producer_cpu_s']:.1f} s")
    base = next(r for r in rows if r["producers"] == 1)["samples_per_s"] if 1 in plan.counts else rows[0][
        "samples_per_s"] / rows[0]["producers"]
    cores = os.cpu_count() or 1
    for row in rows:
        ideal = row["producers"] * base
        row["efficiency"] = ratio(row["samples_per_s"], ideal, note="aggregate / (N x one producer's)")
        # Each producer keeps about one core busy; with the trainer's process beside them,
        # more producers than cores cannot run at full speed on this host.
        row["cpu_bound"] = row["producers"] >= cores
        row["target_met"] = row["efficiency"]["value"] >= TARGET_EFFICIENCY
    return {"one_producer_samples_per_s": base, "cores": cores, "rows": rows,
            "target": f"aggregate >= {TARGET_EFFICIENCY} x N x one producer's, until the trainer (or the CPU) "
                      "is the limit"}


# ---------------------------------------------------------------- stand-in producers
def _standin_batch(lease: Any, cache: dict[tuple[int, int, int], dict[str, Any]], n_mels: int,
                   hold_ms: float) -> list[Any]:
    """The BATCH frames of a lease: the same small example in every row (one array set per shape)."""
    max_tokens, max_frames = lease.shape
    key = (max_tokens, max_frames, len(lease.ids))
    if key not in cache:
        example = {"tokens": np.ones(min(5, max_tokens), np.int32),
                   "mel": np.zeros((min(10, max_frames), n_mels), np.float32)}
        cache[key] = collate([example] * len(lease.ids), batch_dims(lease.rows, lease.shape, n_mels),
                             pad_values(SCHEMA, FeaturesConfig(), "off"))
    return wire.Batch(lease.lease, lease.epoch, lease.index, lease.ids, prep_ms=hold_ms).encode(cache[key])


def standin_producer(endpoint: str, name: str, hold_ms: float, dataset: dict[str, Any]) -> None:
    """A producer that holds HOLD_MS per batch instead of computing it (child process)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 1000
    sock.connect(endpoint)
    sock.send_multipart(wire.Hello(producer=name, host="bench", pid=os.getpid(), config=wire.ConfigSchema.local(),
                                   launcher=os.getppid(), session=uuid.uuid4().hex, dataset=dataset).encode())
    todo: collections.deque[wire.Lease] = collections.deque()
    ready: dict[int, list[Any]] = {}
    cache: dict[tuple[int, int, int], dict[str, Any]] = {}
    welcome: wire.Welcome | None = None
    current: wire.Lease | None = None
    done_at = last_beat = 0.0
    try:
        while True:
            now = time.monotonic()
            if current is None and todo:
                current, done_at = todo.popleft(), now + hold_ms / 1000
            if current is not None and welcome is not None and now >= done_at:
                ready[current.lease] = _standin_batch(current, cache, welcome.config.features.n_mels, hold_ms)
                sock.send_multipart(wire.Ready(current.lease).encode())
                current = None
                continue
            if now - last_beat >= STANDIN_BEAT_S and welcome is not None:
                sock.send_multipart(wire.Heartbeat(ready=len(ready), working=len(todo), ping=now).encode())
                last_beat = now
            wait_ms = 100 if current is None else max(0, int((done_at - now) * 1000))
            if not sock.poll(min(100, wait_ms)):
                continue
            msg, _ = wire.read(sock.recv_multipart())
            if isinstance(msg, wire.Welcome):
                welcome = msg
            elif isinstance(msg, wire.Lease):
                todo.append(msg)
            elif isinstance(msg, wire.Credit) and msg.lease in ready:
                sock.send_multipart(ready.pop(msg.lease), copy=False)
            elif isinstance(msg, wire.Revoke):
                ready.pop(msg.lease, None)
            elif isinstance(msg, wire.Stop):
                sock.send_multipart(wire.Bye().encode())
                return
            elif isinstance(msg, wire.Refuse):
                raise RuntimeError(f"refused: {msg.reason}")
    finally:
        sock.close()
        ctx.term()


def standin_run(count: int, steps: int, work: Path) -> dict[str, Any]:
    run_dir = work / f"standin-{count}"
    trainer = Proc(trainer_args(run_dir, SCALING_STEP_MS, "--steps", str(steps)), work / f"standin-{count}.log")
    procs: list[Any] = []
    try:
        endpoint = endpoint_of(trainer)
        ctx = spawn_context()
        dataset = describe_copy(DEMO_DATA_DIR)
        procs = [ctx.Process(target=standin_producer, args=(endpoint, f"standin{i}", STANDIN_HOLD_MS, dataset),
                             name=f"standin{i}", daemon=True) for i in range(count)]
        for proc in procs:
            proc.start()
        code = trainer.wait(timeout=START_S + RUN_SLACK_S + steps)
        if code != 0:
            raise BenchError(f"trainer exited with status {code}; see {work}")
    finally:
        stop_children(procs, STOP_S)
        trainer.stop()
    rate = steady_rate(read_jsonl(run_dir / "metrics.jsonl"))
    return {"producers": count, "steady": rate, "samples_per_s": rate["samples_per_s"]}


def standin(plan: ProducersPlan, work: Path, log: Any) -> dict[str, Any]:
    rows = []
    for count in plan.counts:
        # N times the steps, so that every run lasts as long: the stand-ins finish batches
        # in bursts every hold period, and a short window would cut those unevenly.
        row = standin_run(count, plan.scaling_steps * count, work)
        rows.append(row)
        log(f"producers stand-in N={count}: {row['samples_per_s']:.1f} samples/s")
    base = rows[0]["samples_per_s"] / rows[0]["producers"]
    for row in rows:
        row["efficiency"] = ratio(row["samples_per_s"], row["producers"] * base,
                                  note="aggregate / (N x one stand-in producer's)")
        row["target_met"] = row["efficiency"]["value"] >= TARGET_EFFICIENCY
    return {"hold_ms": STANDIN_HOLD_MS, "one_producer_samples_per_s": base, "rows": rows}


# ---------------------------------------------------------------- failover
FAILOVER_MODES = ("kill", "freeze")


def failover_run(plan: ProducersPlan, work: Path, mode: str) -> dict[str, Any]:
    """One run with 3 producers; one is SIGKILLed ("kill": its connection closes) or SIGSTOPped
    ("freeze": silent, found by the heartbeat timeout) a third of the way through."""
    run_dir = work / f"failover-{mode}"
    steps = plan.failover_epochs * 4  # 64 demo clips in batches of 16
    kill_step = int(steps * KILL_AT_FRAC) // 5 * 5
    args = trainer_args(run_dir, FAILOVER_STEP_MS, "--epochs", str(plan.failover_epochs), "--record-samples")
    trainer = Proc(args, work / f"failover-{mode}.log")
    launchers: list[Proc] = []
    frozen: list[Any] = []
    try:
        endpoint = endpoint_of(trainer)
        launchers = [Proc(["produce", "--connect", endpoint, "--producers", "1"],
                          work / f"failover-{mode}-produce-{i}.log") for i in range(FAILOVER_PRODUCERS)]
        for launcher in launchers:
            launcher.wait_for(r"first batch delivered", START_S)
        trainer.wait_for(rf" step {kill_step}/", START_S + steps)
        hit_unix, frozen = _hit(launchers[0], mode)
        code = trainer.wait(timeout=START_S + RUN_SLACK_S + steps * FAILOVER_STEP_MS / 1000)
        if code != 0:
            raise BenchError(f"trainer exited with status {code}; see {work}")
    finally:
        for child in frozen:
            try:
                child.kill()
            except psutil.Error:
                pass
        for proc in [trainer, *launchers]:
            proc.stop()
    return _failover_figures(plan, run_dir, mode, kill_step, hit_unix)


def _hit(victim: "Proc", mode: str) -> tuple[float, list[Any]]:
    """SIGKILL the victim's producers and launcher ("kill"), or SIGSTOP its producers ("freeze");
    when, and the processes frozen (to be killed at the end)."""
    parent = psutil.Process(victim.proc.pid)
    children = parent.children()
    hit_unix = time.time()
    if mode != "kill":
        for child in children:
            child.suspend()
        return hit_unix, children
    parent.suspend()  # it must not restart the producer we kill
    for child in children:
        child.kill()
    parent.kill()
    victim.wait(timeout=STOP_S)
    return hit_unix, []


def _exactly_once(run_dir: Path, epochs: int) -> bool:
    """Every demo clip trained once in each epoch (samples.jsonl)."""
    per_epoch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for row in read_jsonl(run_dir / "samples.jsonl"):
        per_epoch[row["epoch"]].update(row["ids"])
    expected = {e.id for e in read_metadata(DEMO_DATA_DIR)[0]}
    return (sorted(per_epoch) == list(range(epochs))
            and all(set(c) == expected and max(c.values()) == 1 for c in per_epoch.values()))


def _failover_figures(plan: "ProducersPlan", run_dir: Path, mode: str, kill_step: int,
                      hit_unix: float) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    rows = sorted(read_jsonl(run_dir / "metrics.jsonl"), key=lambda r: r["step"])
    dead = [f for f in summary.get("failovers", []) if f["status"] == "dead"]
    if len(dead) != 1 or not dead[0].get("reissued_unix"):
        raise BenchError(f"expected one dead producer whose leases were re-issued, got {summary.get('failovers')}")
    event = dead[0]
    exactly_once = _exactly_once(run_dir, plan.failover_epochs)
    survivors = [p for p in summary["producers"] if p["status"] != "dead" and p.get("prep_ms_mean")]
    capacity = sum(1000.0 / p["prep_ms_mean"] for p in survivors)
    demand = 1000.0 / FAILOVER_STEP_MS
    reissue_s = event["reissue_after_last_heard_s"]
    limit = HEARTBEAT_TIMEOUT_S + TARGET_REISSUE_SLACK_S
    return {
        "mode": mode,
        "steps": len(rows),
        "hit_at_step": kill_step,
        "reissue_after_last_heard_s": reissue_s,
        "reissue_after_hit_s": event["reissued_unix"] - hit_unix,
        "declared_dead_after_hit_s": event["declared_unix"] - hit_unix,
        "leases_reissued": event["reissued"],
        "data_wait_frac": summary["data_wait_frac"],
        "data_wait_frac_after_hit": wait_frac([r for r in rows if r["step"] > kill_step]),
        "max_wait_ms_after_warmup": max(r["wait_ms"] for r in rows[1:]),
        "survivor_capacity_batches_per_s": capacity,
        "demand_batches_per_s": demand,
        "exactly_once": exactly_once,
        "reissue_limit_s": limit,
        "targets": {
            "reissue": {"what": f"leases re-issued <= heartbeat timeout {HEARTBEAT_TIMEOUT_S:g} s + "
                                f"{TARGET_REISSUE_SLACK_S:g} s after the producer's last message",
                        "met": reissue_s <= limit},
            "wait": {"what": f"data_wait_frac <= {TARGET_WAIT_FRAC} with one producer gone (survivors' capacity "
                             f"{capacity:.1f} vs demand {demand:.1f} batches/s)",
                     "met": summary["data_wait_frac"] <= TARGET_WAIT_FRAC and capacity > demand},
        },
        "command": "python run.py " + " ".join(trainer_args(Path("RUN"), FAILOVER_STEP_MS, "--epochs",
                                                            str(plan.failover_epochs), "--record-samples"))
                   + f"  +  {FAILOVER_PRODUCERS} x python run.py produce --connect ENDPOINT --producers 1; "
                   + ("SIGKILL" if mode == "kill" else "SIGSTOP") + " one producer",
    }


def failover(plan: ProducersPlan, work: Path, log: Any) -> dict[str, Any]:
    runs = []
    for mode in FAILOVER_MODES:
        r = failover_run(plan, work, mode)
        runs.append(r)
        log(f"producers failover ({mode}): re-issued {r['reissue_after_last_heard_s']:.2f} s after last heard, "
            f"{r['reissue_after_hit_s']:.2f} s after the {mode}; wait frac {r['data_wait_frac']:.4f}; "
            f"exactly once {r['exactly_once']}")
    return {"runs": runs}


# ---------------------------------------------------------------- entry points
def run(plan: ProducersPlan | None = None, log: Any = None, keep: Path | None = None) -> dict[str, Any]:
    """Run the plan's sections; return their figures (and keep the run files in ``keep``)."""
    plan = plan or ProducersPlan()
    log = log or (lambda text: None)
    work = Path(tempfile.mkdtemp(prefix="stoker-bench-producers-"))
    out: dict[str, Any] = {"machine": machine_info()}
    try:
        if "scaling" in plan.sections:
            out["scaling"] = scaling(plan, work, log)
        if "standin" in plan.sections:
            out["standin"] = standin(plan, work, log)
        if "failover" in plan.sections:
            out["failover"] = failover(plan, work, log)
    finally:
        if keep is not None:
            shutil.copytree(work, keep, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    return out


def render(section: dict[str, Any]) -> str:
    parts = []
    if section.get("scaling"):
        s = section["scaling"]
        rows = [[r["producers"], f"{r['samples_per_s']:.1f}", f"{r['efficiency']['value']:.3f}",
                 f"{r['prep_ms_mean']:.1f}" if r["prep_ms_mean"] else "-", f"{r['producer_cpu_s']:.1f}",
                 f"{r['samples_per_producer_cpu_s']:.1f}" if r["samples_per_producer_cpu_s"] else "-",
                 "met" if r["target_met"] else ("NOT met: CPU-bound" if r["cpu_bound"] else "NOT met")]
                for r in s["rows"]]
        parts += [f"scaling: N remote producers (run.py produce over loopback TCP), trainer synthetic:"
                  f"{SCALING_STEP_MS:g}, batch {BATCH_SIZE}, numpy log-mels, {s['cores']} cores; steady-state "
                  f"samples/s; target {TARGET_EFFICIENCY} x N x one producer's",
                  table(["N", "samples/s", "efficiency", "prep ms", "producer CPU s", "samples/CPU s", "target"],
                        rows)]
    if section.get("standin"):
        s = section["standin"]
        rows = [[r["producers"], f"{r['samples_per_s']:.1f}", f"{r['efficiency']['value']:.3f}",
                 "met" if r["target_met"] else "NOT met"] for r in s["rows"]]
        parts += ["", f"stand-in producers (each holds {s['hold_ms']:g} ms per batch without CPU; real protocol, "
                      f"trainer synthetic:{SCALING_STEP_MS:g}): what the trainer's side sustains",
                  table(["N", "samples/s", "efficiency", "target"], rows)]
    if section.get("failover"):
        runs = section["failover"]["runs"]
        rows = []
        for f in runs:
            t = f["targets"]
            rows.append([f["mode"], f"{f['declared_dead_after_hit_s']:.2f}", f"{f['reissue_after_hit_s']:.2f}",
                         f"{f['reissue_after_last_heard_s']:.2f} (<= {f['reissue_limit_s']:g}: "
                         f"{'met' if t['reissue']['met'] else 'NOT met'})",
                         f"{f['data_wait_frac']:.4f} (<= {TARGET_WAIT_FRAC}: {'met' if t['wait']['met'] else 'NOT met'})",
                         f"{f['data_wait_frac_after_hit']:.4f}", f"{f['max_wait_ms_after_warmup']:.0f}",
                         f"{f['survivor_capacity_batches_per_s']:.1f}/{f['demand_batches_per_s']:.1f}",
                         "yes" if f["exactly_once"] else "NO"])
        parts += ["", f"failover: {FAILOVER_PRODUCERS} remote producers, trainer synthetic:{FAILOVER_STEP_MS:g}, "
                      f"default heartbeats (timeout {HEARTBEAT_TIMEOUT_S:g} s); one producer SIGKILLed (kill) or "
                      f"SIGSTOPped (freeze) at step {runs[0]['hit_at_step']} of {runs[0]['steps']}; times in s",
                  table(["mode", "declared dead after", "re-issued after", "re-issued after last message",
                         "data_wait_frac", "wait after hit", "max wait ms", "capacity/demand", "exactly once"],
                        rows)]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.producers")
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--keep", help="keep the runs' files in this directory")
    parser.add_argument("--only", choices=("scaling", "standin", "failover"), help="run one section")
    args = parser.parse_args(argv)
    plan = ProducersPlan.quick() if args.quick else ProducersPlan()
    if args.only:
        plan.sections = (args.only,)
    section = run(plan, log=lambda text: print(text, file=sys.stderr, flush=True),
                  keep=Path(args.keep) if args.keep else None)
    print(render(section))
    if args.json:
        Path(args.json).write_text(json.dumps(section, indent=2) + "\n", encoding="utf-8")
    return section


if __name__ == "__main__":
    try:
        main()
    except BenchError as exc:
        print(f"producers benchmark failed: {exc}", file=sys.stderr)
        sys.exit(1)
