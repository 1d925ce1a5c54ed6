"""The alternatives: what a user would pick instead of stoker, on the same work.

Four ways to feed the same trainer the same batches, each started from nothing and
measured from outside:

    stoker        ``python run.py --model synthetic:MS --producers P --model-start-delay 0``
                  (launcher, consumer, P producer processes), with its default
                  ``features.backend=auto``: on this CPU the numpy/scipy implementation of
                  the same log-mel definition (equal to the TF ops within 1e-4, tested),
                  so its producers never import TensorFlow.
    stoker (tf ops)  the same with ``--set features.backend=tf``: the producers run the
                  very TF ops the tf.data variants run (each producer imports TensorFlow).
    tf.data       one process: ``from_tensor_slices(plan).map(batch_fn,
                  num_parallel_calls=AUTOTUNE).prefetch(AUTOTUNE)`` with
                  ``options.autotune.cpu_budget = P``: what a single-process user does.
    tf.data service  a dispatcher and P workers, each its own process on localhost (free
                  ports picked here), the trainer reading
                  ``dataset.apply(distribute("distributed_epoch", ...))``; the map runs in
                  the workers with ``num_parallel_calls=1`` (one core each, as a producer).
    mp.Queue      the trainer process starts P ``multiprocessing`` (spawn) workers that put
                  pickled batch dicts into a ``multiprocessing.Queue(maxsize=3)``; each batch made
                  by the producers' own code (``producer.batches.BatchMaker.make`` on the lease the
                  coordinator sends, ``features.backend=auto`` resolved as a producer resolves it,
                  the launcher's producer environment): exactly the ``stoker`` row's work.

Same data: the embedded demo set (64 clips, 22,050 Hz 16-bit WAV). Same batches: the
consumer's epoch plan (``consumer/plan.py``, batch 16, bucketed shapes), epoch after
epoch, each batch padded to its bucket shape [B, L] / [B, T, F]. Same preprocessing:
read the WAV, the log-mel of ``producer/features.py``: in the tf.data variants computed by its
TensorFlow ops (the ``tf.function`` of :class:`producer.features.MelComputer`, which
``stoker (tf ops)``'s producers run with ``features.backend=tf``), in mp.Queue by the producers'
BatchMaker as in ``stoker``; token ids from the index's vocabulary (``consumer.coordinator.lease_tables.TokenTable``, as the leases carry
them; for the tf.data variants put into the plan's tensors, since a Python tokenizer
cannot run in a tf.data service worker), padding with the same values. stoker's own default computes the same
definition without TensorFlow (the target "tf.data service ... needs the TF-op version
of the preprocessing"); both stoker rows are reported. The demo set needs no resampling (a
dataset at another rate would need a resampling op in the TF-op version). Same trainer
step: a sleep of MS milliseconds per batch (stoker's ``synthetic:MS``), standing in for
GPU time, so the trainer wait share compares the input side alone. Same CPU budget: P
preprocessing processes (or P parallel calls) and one trainer process, on this host.

Figures of one run (each variant is run ``repetitions`` times, interleaved; median,
min, max):

- steps/s after warm-up: ``(N - 1) / (t_N - t_1)`` over the ends of steps 1..N;
- trainer wait share: waits of steps 2..N / (those waits + step times of steps 2..N),
  the definition of ``data_wait_frac`` in summary.json;
- time to first batch: from just before the first process is started (the "start
  command") to the moment the trainer has its first batch in hand, on the wall clock.
  For stoker, the first batch is the start of step 1 (metrics.jsonl ``t`` minus its
  ``step_ms``), mapped to the wall clock by ``live.json`` (``wall_time - t``, whose clock
  starts a little after the consumer's: so stoker's figure errs on the late side);
- CPU used: user + system seconds of every process involved (``getrusage`` of the
  waited-for children: the launcher waits for its consumer and producers, the trainer
  for its workers);
- peak memory: the sum over processes of each one's peak RSS, sampled every
  MEMORY_SAMPLE_S with psutil.

Ratios are stoker / alternative for throughput (higher is better for stoker) and
alternative / stoker for time to first batch, CPU and memory (higher: stoker uses less),
each stored with the two medians it came from, against the stoker row that does the same
per-batch work (SAME_WORK): ``stoker (tf ops)`` for the tf.data variants (the same TF ops,
TensorFlow imported in the workers), ``stoker`` for mp.Queue (the producers' BatchMaker). A
run without that row compares with ``stoker`` and says so (``same_work`` false). Targets: the
same-work stoker row's wait share <= that of tf.data and of tf.data service; its time to first
batch lower than both.

Run alone: ``python -m stoker.benchmarks.alternatives [--quick] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import psutil

from .common import DEMO_DATA, QUIET_ENV, STOKER, BenchError, ratio, spread, table, targets_table
from .corpus import leases_of
from ..consumer.coordinator.lease_tables import TokenTable
from ..consumer.plan import EpochPlanner
from ..launcher import PRODUCER_ENV
from ..producer.batches import BatchMaker
from ..producer.features import MelComputer, pad_value, resolve_backend
from ..shared.config import BatchingConfig, DataConfig, FeaturesConfig
from ..consumer.index.index import build_index
from ..shared.metrics import wait_share

KINDS = ("stoker", "stoker (tf ops)", "tf.data", "tf.data service", "mp.Queue")
# The stoker variants and their features.backend.
STOKER_BACKENDS = {"stoker": "auto", "stoker (tf ops)": "tf"}
# The variants a target compares stoker with.
TARGET_KINDS = ("tf.data", "tf.data service")
# Each alternative's stoker row of the same per-batch work: the TF-op mels for the tf.data
# variants (a tf.data service worker runs TF ops only), the producers' BatchMaker for mp.Queue.
SAME_WORK = {"stoker (tf ops)": "stoker", "tf.data": "stoker (tf ops)", "tf.data service": "stoker (tf ops)",
             "mp.Queue": "stoker"}
BATCH_SIZE = 16
# Queue capacity of the mp.Queue variant: stoker's default buffer size.
QUEUE_CAPACITY = 3
# Peak RSS is sampled this often (a process's peak between samples can be missed).
MEMORY_SAMPLE_S = 0.1
# Beyond its steps, one run may take this long (interpreters, TensorFlow imports, tracing).
RUN_OVERHEAD_S = 150.0
# A child that does not stop within this long after SIGTERM is killed.
TERM_GRACE_S = 10.0
# The trainer process prints its figures on one line starting with this.
RESULT_PREFIX = "ALTERNATIVES-RESULT "


@dataclass
class AlternativesPlan:
    step_ms: float = 100.0
    steps: int = 120
    workers: int = 2  # P: producers, parallel calls, service workers, queue workers
    repetitions: int = 3
    kinds: tuple[str, ...] = KINDS
    data: str = str(DEMO_DATA)

    @classmethod
    def quick(cls) -> "AlternativesPlan":
        # Every row, the TF-op stoker one too (the tf.data variants' same work), once, short.
        return cls(steps=30, repetitions=1)


# ---------------------------------------------------------------- the shared work
def plan_batches(data_dir: Path, steps: int) -> list[dict[str, Any]]:
    """The consumer's planned batches, epoch after epoch, until ``steps`` batches; each with
    its lease as the coordinator sends it (benchmarks/corpus.leases_of)."""
    index = build_index(DataConfig(path=str(data_dir), index_cache="off"), FeaturesConfig())
    planner = EpochPlanner(index.samples, BatchingConfig(batch_size=BATCH_SIZE))
    files = {s.id: s.audio for s in index.samples}
    assert index.vocabulary is not None
    tokens = TokenTable(index.samples, index.vocabulary)
    out: list[dict[str, Any]] = []
    epoch = 0
    while len(out) < steps:
        planned = planner.plan(epoch)
        for b, lease in zip(planned, leases_of(planned, tokens)):
            out.append({"ids": list(b.ids), "shape": list(b.shape),
                        "paths": [str(data_dir / files[i]) for i in b.ids],
                        "tokens": [list(row) for row in lease.tokens], "lease": lease})
        epoch += 1
    return out[:steps]


def plan_tensors(batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The plan as fixed-shape arrays for ``from_tensor_slices``: one row per batch."""
    tokens = [[np.asarray(t, np.int32) for t in b["tokens"]] for b in batches]
    max_len = max([len(t) for row in tokens for t in row] + [b["shape"][0] for b in batches])  # bucket L
    n = len(batches)
    out = {"paths": np.full((n, BATCH_SIZE), "", dtype=object),
           "tokens": np.zeros((n, BATCH_SIZE, max_len), dtype=np.int32),
           "token_lengths": np.zeros((n, BATCH_SIZE), dtype=np.int32),
           "shape": np.array([b["shape"] for b in batches], dtype=np.int32)}
    for i, (b, row) in enumerate(zip(batches, tokens)):
        for j, (path, tok) in enumerate(zip(b["paths"], row)):
            out["paths"][i, j] = path
            out["tokens"][i, j, :len(tok)] = tok
            out["token_lengths"][i, j] = len(tok)
    out["paths"] = out["paths"].astype(bytes)
    return out


def tf_batch_fn(cfg: Any) -> Callable[..., dict[str, Any]]:
    """The batch function in TensorFlow ops: read, log-mel (producer/features.py's tf.function), pad."""
    import tensorflow as tf

    mel_fn = MelComputer(dataclasses.replace(cfg, backend="tf"))._tf_function()
    half, hop, n_mels, pad = cfg.n_fft // 2, cfg.hop_length, cfg.n_mels, pad_value(cfg)

    def one(path: Any, frames_max: Any) -> tuple[Any, Any]:
        def real() -> tuple[Any, Any]:
            audio = tf.audio.decode_wav(tf.io.read_file(path), desired_channels=1).audio[:, 0]
            frames = 1 + tf.shape(audio)[0] // hop  # producer/features.py num_frames
            mel = mel_fn(tf.pad(audio, [[half, half]], mode="REFLECT"))[:frames]  # centre padding, reflect
            return tf.pad(mel, [[0, frames_max - frames], [0, 0]], constant_values=pad), frames

        def empty() -> tuple[Any, Any]:  # a row past the batch's examples
            return tf.fill([frames_max, n_mels], tf.constant(pad, tf.float32)), tf.constant(0, tf.int32)

        return tf.cond(tf.strings.length(path) > 0, real, empty)

    def batch(paths: Any, tokens: Any, token_lengths: Any, shape: Any) -> dict[str, Any]:
        mels, lengths = tf.map_fn(lambda p: one(p, shape[1]), paths, fn_output_signature=(
            tf.TensorSpec([None, n_mels], tf.float32), tf.TensorSpec([], tf.int32)))
        return {"tokens": tokens[:, :shape[0]], "token_lengths": token_lengths, "mel": mels, "mel_lengths": lengths}

    return batch


def tf_dataset(batches: Sequence[dict[str, Any]], cfg: Any, parallel: Any) -> Any:
    import tensorflow as tf

    t = plan_tensors(batches)
    fn = tf_batch_fn(cfg)
    ds = tf.data.Dataset.from_tensor_slices((t["paths"], t["tokens"], t["token_lengths"], t["shape"]))
    return ds.map(fn, num_parallel_calls=parallel, deterministic=False)


# ---------------------------------------------------------------- the trainer (child process)
def train_loop(next_batch: Callable[[], Any], steps: int, step_ms: float) -> dict[str, Any]:
    """Take ``steps`` batches, holding each for ``step_ms``; the figures of the run."""
    rows = []
    first_unix = None
    for step in range(1, steps + 1):
        asked = time.perf_counter()
        batch = next_batch()
        begun = time.perf_counter()
        if first_unix is None:
            first_unix = time.time()
        if batch is None:
            raise BenchError(f"no batch for step {step}")
        time.sleep(step_ms / 1000.0)  # the step: no CPU, as synthetic:MS
        ended = time.perf_counter()
        rows.append({"step": step, "t": ended, "wait_ms": (begun - asked) * 1e3, "step_ms": (ended - begun) * 1e3})
    return {"first_batch_unix": first_unix, "rows": rows}


def _queue_worker(root: str, batches: list[dict[str, Any]], out: Any) -> None:
    """One mp.Queue worker: every batch given to it made by the producers' BatchMaker (the
    features a producer resolves), pickled into the queue."""
    maker = BatchMaker(Path(root), {}, resolve_backend(FeaturesConfig()), None, "mp.Queue")
    for b in batches:
        out.put(maker.make(b["lease"]).arrays)


def child_main(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The trainer of one non-stoker variant; returns its figures."""
    cfg = FeaturesConfig(backend="tf")
    batches = plan_batches(Path(spec["data"]), spec["steps"])
    workers = int(spec["workers"])
    if kind == "mp.Queue":
        for key, value in PRODUCER_ENV.items():  # the workers' environment, as the launcher gives producers theirs
            os.environ.setdefault(key, value)
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue(maxsize=QUEUE_CAPACITY)
        procs = [ctx.Process(target=_queue_worker, args=(spec["data"], batches[k::workers], q), daemon=True)
                 for k in range(workers)]
        for p in procs:
            p.start()
        try:
            return train_loop(lambda: q.get(timeout=RUN_OVERHEAD_S), len(batches), spec["step_ms"])
        finally:
            for p in procs:
                p.join(TERM_GRACE_S)
                if p.is_alive():
                    p.terminate()
                    p.join(TERM_GRACE_S)
    import tensorflow as tf

    if kind == "tf.data":
        ds = tf_dataset(batches, cfg, tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
        options = tf.data.Options()
        options.autotune.cpu_budget = workers
        ds = ds.with_options(options)
    elif kind == "tf.data service":
        ds = tf_dataset(batches, cfg, 1).apply(tf.data.experimental.service.distribute(
            processing_mode="distributed_epoch", service=spec["service"], job_name="bench"))
        ds = ds.prefetch(tf.data.AUTOTUNE)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    it = iter(ds)
    return train_loop(lambda: next(it), len(batches), spec["step_ms"])


def service_main(role: str, port: int, dispatcher_port: int) -> None:
    """A tf.data service dispatcher or worker on localhost; serves until terminated."""
    import tensorflow as tf

    service = tf.data.experimental.service
    if role == "dispatcher":
        server = service.DispatchServer(service.DispatcherConfig(port=port, protocol="grpc"))
    else:
        server = service.WorkerServer(service.WorkerConfig(
            dispatcher_address=f"localhost:{dispatcher_port}", worker_address=f"localhost:{port}", port=port,
            protocol="grpc"))
    server.join()


# ---------------------------------------------------------------- measuring from outside
class MemorySampler:
    """Peak RSS of every process in the trees of ``roots`` (sampled in a thread)."""

    def __init__(self) -> None:
        self.roots: list[int] = []
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            for pid in list(self.roots):
                try:
                    root = psutil.Process(pid)
                    procs = [root, *root.children(recursive=True)]
                except psutil.Error:
                    continue
                for p in procs:
                    try:
                        rss = p.memory_info().rss
                    except psutil.Error:
                        continue
                    self.peak[p.pid] = max(self.peak.get(p.pid, 0), rss)
            if self._stop.wait(MEMORY_SAMPLE_S):
                return

    def total_mb(self) -> float:
        self._stop.set()
        self._thread.join(5)
        return sum(self.peak.values()) / 1e6


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, **QUIET_ENV})


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=TERM_GRACE_S)


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _child_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def analyze(rows: Sequence[dict[str, Any]], first_batch_unix: float, started_unix: float) -> dict[str, Any]:
    """Figures of one run from its step rows (``t`` = end of the step, any clock, seconds)."""
    rows = sorted(rows, key=lambda r: r["step"])
    if len(rows) < 3:
        raise BenchError(f"only {len(rows)} steps")
    seconds = rows[-1]["t"] - rows[0]["t"]
    if seconds <= 0:
        raise BenchError("no measurable steady phase")
    return {"steps": len(rows), "steps_per_s": (len(rows) - 1) / seconds,
            "wait_frac": wait_share(rows[1:]) or 0.0,
            "time_to_first_batch_s": first_batch_unix - started_unix}


def _wait_run(proc: subprocess.Popen[bytes], plan: AlternativesPlan, timed_out: str, log_path: Path) -> int:
    """The exit status of a measured run, allowed 3 x its ideal time plus start-up; stopped after."""
    try:
        return proc.wait(timeout=plan.steps * plan.step_ms / 1000 * 3 + RUN_OVERHEAD_S)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{timed_out}\n{_tail(log_path)}") from None
    finally:
        _stop(proc)


def run_stoker(plan: AlternativesPlan, work: Path, backend: str = "auto") -> dict[str, Any]:
    """One stoker run measured from outside (see the module docstring)."""
    run_dir = work / "stoker-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = [*STOKER, "--data", plan.data, "--model", f"synthetic:{plan.step_ms:g}",
            "--batch-size", str(BATCH_SIZE), "--steps", str(plan.steps), "--producers", str(plan.workers),
            "--set", f"features.backend={backend}", "--model-start-delay", "0", "--run-dir", str(run_dir),
            "--log-level", "WARNING"]
    memory = MemorySampler()
    cpu0 = _child_cpu_s()
    started = time.time()
    work.mkdir(parents=True, exist_ok=True)
    proc = _start(argv, work / "stoker.log")
    memory.roots.append(proc.pid)
    try:
        code = _wait_run(proc, plan, f"stoker timed out: {' '.join(argv)}", work / "stoker.log")
    finally:
        peak_mb = memory.total_mb()
    cpu_s = _child_cpu_s() - cpu0
    if code != 0:
        raise BenchError(f"stoker exited with status {code}: {' '.join(argv)}\n{_tail(work / 'stoker.log')}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    live = json.loads((run_dir / "live.json").read_text())
    consumer_start_unix = live["wall_time"] - live["t"]  # the telemetry clock, a little after the consumer's
    first = min(rows, key=lambda r: r["step"])
    first_unix = consumer_start_unix + first["t"] - first["step_ms"] / 1000
    summary = json.loads((run_dir / "summary.json").read_text())
    out = {**analyze(rows, first_unix, started), "cpu_s": cpu_s, "peak_rss_mb": peak_mb,
           "summary_data_wait_frac": summary.get("data_wait_frac"), "command": " ".join(argv[1:])}
    return out


def run_alternative(kind: str, plan: AlternativesPlan, work: Path) -> dict[str, Any]:
    spec: dict[str, Any] = {"data": plan.data, "steps": plan.steps, "step_ms": plan.step_ms, "workers": plan.workers}
    memory = MemorySampler()
    servers: list[subprocess.Popen[bytes]] = []
    log_path = work / f"{kind.replace(' ', '-').replace('.', '')}.log"
    cpu0 = _child_cpu_s()
    started = time.time()
    try:
        if kind == "tf.data service":
            dispatcher_port = free_port()
            ports = [dispatcher_port] + [free_port() for _ in range(plan.workers)]
            spec["service"] = f"grpc://localhost:{dispatcher_port}"
            for n, port in enumerate(ports):
                role = "dispatcher" if n == 0 else "worker"
                servers.append(_start([sys.executable, "-m", "stoker.benchmarks.alternatives", "serve", role, str(port),
                                       str(dispatcher_port)], log_path))
                memory.roots.append(servers[-1].pid)
        trainer = _start([sys.executable, "-m", "stoker.benchmarks.alternatives", "child", kind, json.dumps(spec)], log_path)
        memory.roots.append(trainer.pid)
        code = _wait_run(trainer, plan, f"{kind} timed out", log_path)
    finally:
        for server in servers:
            _stop(server)
        peak_mb = memory.total_mb()
    cpu_s = _child_cpu_s() - cpu0
    lines = [line for line in _tail(log_path, 200_000).splitlines() if line.startswith(RESULT_PREFIX)]
    if code != 0 or not lines:
        raise BenchError(f"{kind} exited with status {code}\n{_tail(log_path)}")
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    log_path.unlink()
    return {**analyze(result["rows"], result["first_batch_unix"], started), "cpu_s": cpu_s, "peak_rss_mb": peak_mb}


FIGURES = ("steps_per_s", "wait_frac", "time_to_first_batch_s", "cpu_s", "peak_rss_mb")


def run(plan: AlternativesPlan | None = None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    plan = plan or AlternativesPlan()
    log = log or (lambda text: None)
    work = Path(tempfile.mkdtemp(prefix="stoker-bench-alternatives-"))
    samples: dict[str, list[dict[str, Any]]] = {k: [] for k in plan.kinds}
    try:
        for rep in range(plan.repetitions):
            order = list(plan.kinds[rep % len(plan.kinds):] + plan.kinds[:rep % len(plan.kinds)])
            for kind in order:
                r = (run_stoker(plan, work, STOKER_BACKENDS[kind]) if kind in STOKER_BACKENDS
                     else run_alternative(kind, plan, work))
                samples[kind].append(r)
                log(f"alternatives rep {rep + 1}/{plan.repetitions} {kind}: {r['steps_per_s']:.2f} steps/s, "
                    f"wait {r['wait_frac']:.4f}, first batch {r['time_to_first_batch_s']:.2f} s, "
                    f"CPU {r['cpu_s']:.1f} s, peak {r['peak_rss_mb']:.0f} MB")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return summarize(plan, samples)


def summarize(plan: AlternativesPlan, samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per variant, ratios against the stoker row of the same work (SAME_WORK), targets."""
    variants = {kind: {f: spread([r[f] for r in runs]) for f in FIGURES} | {"runs": runs}
                for kind, runs in samples.items()}
    out: dict[str, Any] = {"config": dataclasses.asdict(plan), "ideal_steps_per_s": 1000.0 / plan.step_ms,
                           "variants": variants, "vs_stoker": {}, "targets": []}
    if "stoker" not in variants:
        return out
    for kind, v in variants.items():
        if kind == "stoker":
            continue
        against = SAME_WORK[kind] if SAME_WORK[kind] in variants else "stoker"
        s = variants[against]
        med = {f: v[f]["median"] for f in FIGURES}
        out["vs_stoker"][kind] = {
            "against": against, "same_work": against == SAME_WORK[kind],
            "throughput": ratio(s["steps_per_s"]["median"], med["steps_per_s"], note="stoker / alternative steps/s"),
            "time_to_first_batch": ratio(med["time_to_first_batch_s"], s["time_to_first_batch_s"]["median"],
                                         note="alternative / stoker seconds"),
            "cpu": ratio(med["cpu_s"], s["cpu_s"]["median"], note="alternative / stoker CPU seconds"),
            "memory": ratio(med["peak_rss_mb"], s["peak_rss_mb"]["median"], note="alternative / stoker peak RSS"),
            "wait_frac": {"stoker": s["wait_frac"]["median"], "alternative": med["wait_frac"],
                          "difference": med["wait_frac"] - s["wait_frac"]["median"]},
        }
        if kind in TARGET_KINDS:
            out["targets"].append({"what": f"{against} wait share <= {kind}'s", "value": s["wait_frac"]["median"],
                                   "limit": med["wait_frac"], "met": s["wait_frac"]["median"] <= med["wait_frac"]})
            r = out["vs_stoker"][kind]["time_to_first_batch"]
            out["targets"].append({"what": f"{against} time to first batch < {kind}'s", "value": r["value"],
                                   "ratio": r, "limit": 1.0, "met": r["value"] > 1.0})
    return out


def render(section: dict[str, Any]) -> str:
    rows = []
    vs = section.get("vs_stoker", {})
    for kind, v in section["variants"].items():
        def cell(f: str, digits: int = 3) -> str:
            s = v[f]
            return f"{s['median']:.{digits}f} [{s['min']:.{digits}f},{s['max']:.{digits}f}]"

        r = vs.get(kind)
        rows.append([kind, r["against"] + ("" if r["same_work"] else " (other work)") if r else "-",
                     cell("steps_per_s", 2), cell("wait_frac", 4), cell("time_to_first_batch_s", 2),
                     cell("cpu_s", 1), cell("peak_rss_mb", 0),
                     f"{r['throughput']['value']:.3f}" if r else "-",
                     f"{r['time_to_first_batch']['value']:.2f}" if r else "-",
                     f"{r['cpu']['value']:.2f}" if r else "-", f"{r['memory']['value']:.2f}" if r else "-"])
    lines = [table(["variant", "against", "steps/s", "wait share", "first batch s", "CPU s", "peak RSS MB",
                    "stoker/alt steps", "alt/stoker first", "alt/stoker CPU", "alt/stoker RSS"], rows)]
    if section.get("targets"):
        lines += ["", targets_table(section["targets"], limit=".4f")]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["child"]:  # the trainer of one variant
        result = child_main(args[1], json.loads(args[2]))
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return 0
    if args[:1] == ["serve"]:  # a tf.data service dispatcher or worker
        service_main(args[1], int(args[2]), int(args[3]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.alternatives")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="also write the section to this file")
    ns = parser.parse_args(args)
    plan = AlternativesPlan.quick() if ns.quick else AlternativesPlan()
    section = run(plan, log=lambda text: print(text, file=sys.stderr, flush=True))
    print(render(section))
    if ns.json:
        Path(ns.json).write_text(json.dumps(section, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
