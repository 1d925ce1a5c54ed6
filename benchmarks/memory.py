"""Memory benchmark: the consumer's memory stays bounded over thousands of batches.

In this process: the real ``consumer.coordinator.coordinator.Coordinator`` (ROUTER socket bound to
tcp loopback, epoch plan over the demo data's index, leases, credits) and the real
``consumer.buffer.BatchQueue`` (capacity 3), built as consumer/training/main.py builds them, and
a trainer thread that takes batches as fast as it can (no step time). In a spawned
child: a fake producer that speaks the protocol (HELLO; for each LEASE, a batch of the
lease's shape collated with ``shared.batch.collate`` from random data, then READY;
on CREDIT, the BATCH). Only this process's RSS is sampled (psutil), before the producer
starts (``baseline``) and every ``sample_every`` batches.

Reported: RSS at the first sample (batch 250 in the full run) and at the end, the
least-squares slope over the second half of the samples in MB per 1000 batches, the
peak, and the bound ``baseline + capacity x largest batch bytes`` (plus, for
information, the same with one more batch: the one in the trainer's hands, whose slot
is already free).

Criterion ("no memory growth"), stated up front: the growth the fitted line predicts
over the second half (slope x batches in the second half) must be below 5% of the RSS
at the first sample plus one largest batch. The one-batch allowance is the allocator's
granularity: up to capacity + 1 batches are alive at any instant and malloc may keep or
return a freed batch-sized block, so RSS steps by about one batch up or down now and
then (seen here: +/- 1.9 MB steps); one such step in the middle of the second half
must not read as a leak. A leak is growth without end: it fails the criterion once it
exceeds ``detection_limit_bytes_per_batch`` (reported; about 2 KB per batch in the full
run), which is the honest sensitivity of this run: smaller per-batch leaks would need
more batches to see. The peak vs the bound is reported beside it, not judged: RSS also
holds allocator and ZeroMQ buffers that are not batches.

Run alone: ``python -m stoker.benchmarks.memory [--quick]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
import time
import traceback
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil
import zmq

from .common import (run_alone, BenchError, close_queue, collect, least_squares_slope, ratio, spawn_context,
                               stop_children, table)
from ..consumer.buffer import BatchQueue
from ..consumer.coordinator.coordinator import Coordinator
from ..consumer.plan import EpochPlanner
from ..shared import wire
from ..shared.batch import SCHEMA, batch_dims, collate
from ..shared.config import Config, FeaturesConfig
from ..consumer.index.index import build_index
from ..shared.mel import pad_values

MB = 1 << 20
GROWTH_LIMIT_FRAC = 0.05
HEARTBEAT_S = 1.0
SILENCE_S = 15.0  # the fake producer gives up after this long without a message


@dataclass
class MemoryPlan:
    batches: int = 5000
    sample_every: int = 250
    capacity: int = 3
    timeout_s: float = 300.0

    @classmethod
    def quick(cls) -> "MemoryPlan":
        # 1,000 batches sampled every 250 would leave 2 points for the second-half fit
        return cls(batches=1000, sample_every=50, timeout_s=120.0)


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


# ---------------------------------------------------------------- the fake producer (child)
def _fake_batch(lease: Any, rows: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray]],
                rng: np.random.Generator, n_mels: int, pads: dict[str, Any]) -> list[Any]:
    """The BATCH frames of a lease: a random example per id (fixed per id) that fits the bucket."""
    max_tokens, max_frames = lease.shape
    tokens, mels = [], []
    for sample_id in lease.ids:
        key = (sample_id, max_tokens, max_frames)
        if key not in rows:
            h = zlib.crc32(sample_id.encode())
            n_tok = max(1, max_tokens - h % 8)
            n_frames = max(1, max_frames - h % 16)
            rows[key] = (rng.integers(1, 60, n_tok, dtype=np.int32),
                         rng.standard_normal((n_frames, n_mels), dtype=np.float32))
        tokens.append(rows[key][0])
        mels.append(rows[key][1])
    arrays = collate([{"tokens": t, "mel": m} for t, m in zip(tokens, mels)],
                     batch_dims(lease.rows, (max_tokens, max_frames), n_mels), pads)
    return wire.Batch(lease.lease, lease.epoch, lease.index, lease.ids, prep_ms=0.1).encode(arrays)


def fake_producer(endpoint: str, seed: int, res_q: Any) -> None:
    """Speak the producer side of the protocol with random batches until STOP."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sent = 0
    try:
        rng = np.random.default_rng(seed)
        sock.identity = f"fake-{os.getpid()}".encode()
        sock.connect(endpoint)
        sock.send_multipart(wire.Hello(producer="fake", host="localhost", pid=os.getpid(),
                                       config=wire.ConfigSchema.local()).encode())
        n_mels, pads = 80, pad_values(SCHEMA, FeaturesConfig(), "off")
        rows: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray]] = {}
        ready: dict[int, list[Any]] = {}
        last_heard = last_beat = time.monotonic()
        while True:
            now = time.monotonic()
            if now - last_beat >= HEARTBEAT_S:
                sock.send_multipart(wire.Heartbeat(ready=len(ready), working=0).encode())
                last_beat = now
            if not sock.poll(100):
                if time.monotonic() - last_heard > SILENCE_S:
                    raise TimeoutError(f"consumer silent for {SILENCE_S} s")
                continue
            last_heard = time.monotonic()
            msg, _ = wire.read(sock.recv_multipart())
            if isinstance(msg, wire.Welcome):
                n_mels = msg.config.features.n_mels
                pads = pad_values(SCHEMA, msg.config.features, "off")
            elif isinstance(msg, wire.Lease):
                ready[msg.lease] = _fake_batch(msg, rows, rng, n_mels, pads)
                sock.send_multipart(wire.Ready(msg.lease).encode())
            elif isinstance(msg, wire.Credit):
                frames = ready.pop(msg.lease, None)
                if frames is not None:
                    sock.send_multipart(frames, copy=False)
                    sent += 1
            elif isinstance(msg, wire.Stop):
                break
        res_q.put({"role": "producer", "ok": True, "sent": sent})
    except BaseException:
        res_q.put({"role": "producer", "ok": False, "error": traceback.format_exc()[-2000:], "sent": sent})
    finally:
        sock.close()
        ctx.term()


# ---------------------------------------------------------------- the consumer side (this process)
def _trainer(queue: Any, coordinator: Any, plan: "MemoryPlan", stop: threading.Event, state: dict[str, Any],
             samples: list[tuple[int, int, float]]) -> None:
    """The trainer thread: takes every batch at once, sampling the process's RSS."""
    t0 = time.monotonic()
    try:
        while state["taken"] < plan.batches and not stop.is_set():
            got = queue.get(0.25)
            if got is None:
                if time.monotonic() - t0 > plan.timeout_s:
                    raise TimeoutError(f"only {state['taken']} batches in {plan.timeout_s:.0f} s")
                continue
            item, _depth = got
            state["bytes"] += sum(a.nbytes for a in item.arrays.values())
            del item, got
            state["taken"] += 1
            if state["taken"] % plan.sample_every == 0:
                samples.append((state["taken"], rss_bytes(), time.monotonic() - t0))
    except BaseException as exc:
        state["error"] = exc
    finally:
        coordinator.close_notifier()  # the notifier socket belongs to this thread


def _watch(thread: threading.Thread, child: Any, coordinator: Any, plan: "MemoryPlan", stop: threading.Event,
           state: dict[str, Any]) -> None:
    """Until the trainer thread is done: stop early when the coordinator or the producer failed."""
    deadline = time.monotonic() + plan.timeout_s + 10
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(0.5)
        if coordinator.failure is not None:
            stop.set()
        if not child.is_alive() and state["taken"] < plan.batches:
            stop.set()
    if thread.is_alive():
        stop.set()
        thread.join(5.0)
        raise BenchError(f"memory benchmark timed out after {state['taken']} batches")


def _check(coordinator: Any, child: Any, res_q: Any, plan: "MemoryPlan", state: dict[str, Any]) -> None:
    """BenchError naming what failed: the coordinator, the trainer thread or the producer."""
    if coordinator.failure is not None:
        raise BenchError(f"coordinator failed: {coordinator.failure!r}")
    if state["error"] is not None:
        raise BenchError(f"trainer thread failed: {state['error']!r}")
    if state["taken"] < plan.batches:
        try:
            detail = res_q.get(timeout=2.0).get("error", "")
        except Exception:  # nothing posted: it died without a word
            detail = ""
        raise BenchError(f"fake producer exited (status {child.exitcode}) after {state['taken']} batches"
                         f"{': ' + detail if detail else ''}")


def run(plan: MemoryPlan | None = None, log: Any = None) -> dict[str, Any]:
    plan = plan or MemoryPlan()
    log = log or (lambda text: None)
    if plan.batches < 4 * plan.sample_every:
        raise ValueError("need at least 4 samples (batches >= 4 x sample_every) for a second-half slope")
    base = Config()
    cfg = dataclasses.replace(base, pipeline=dataclasses.replace(
        base.pipeline, buffer_size=plan.capacity, bind="tcp://127.0.0.1:*"))
    index = build_index(cfg.data, cfg.features)
    planner = EpochPlanner(index.samples, cfg.batching)
    shapes = planner.shapes
    batch_bytes = [4 * B * (L + 1 + T * cfg.features.n_mels + 1) for B, L, T in shapes]
    max_batch = max(batch_bytes)
    stop = threading.Event()
    queue = BatchQueue(cfg.pipeline.buffer_size)
    coordinator = Coordinator(cfg, planner, queue, stop, max_epochs=None)
    queue.on_free = coordinator.notify_free
    endpoint = coordinator.bind(cfg.pipeline.bind)

    samples: list[tuple[int, int, float]] = []  # (batches, rss, seconds)
    state: dict[str, Any] = {"taken": 0, "error": None, "bytes": 0}

    ctx = spawn_context()
    res_q = ctx.Queue()
    child = ctx.Process(target=fake_producer, args=(endpoint, 1, res_q), name="fake-producer", daemon=True)
    baseline = rss_bytes()
    thread = threading.Thread(target=_trainer, args=(queue, coordinator, plan, stop, state, samples),
                              name="bench-trainer", daemon=True)
    started = time.monotonic()
    try:
        coordinator.start()
        child.start()
        thread.start()
        _watch(thread, child, coordinator, plan, stop, state)
        elapsed = time.monotonic() - started
        stop.set()
        coordinator.join(5.0)  # its loop ends by sending STOP to the producer
        _check(coordinator, child, res_q, plan, state)
        sent = collect(res_q, ["producer"], [child], 15.0)["producer"]["sent"]
    finally:
        stop.set()
        coordinator.join(5.0)
        queue.close()
        stop_children([child])
        close_queue(res_q)
    snap = coordinator.snapshot()
    return analyze(samples, baseline=baseline, capacity=plan.capacity, max_batch_bytes=max_batch,
                   batch_bytes_by_shape={f"{B}x{L}x{T}": b for (B, L, T), b in zip(shapes, batch_bytes)},
                   extra={"batches": state["taken"], "sample_every": plan.sample_every, "seconds": elapsed,
                          "batches_per_s": state["taken"] / elapsed, "payload_gbps": state["bytes"] / elapsed / 1e9,
                          "producer_sent": sent, "queue_high_water": queue.high_water,
                          "rejected_messages": snap["rejected_messages"], "reissued_leases": snap["reissued_leases"]})


def analyze(samples: list[tuple[int, int, float]], *, baseline: int, capacity: int, max_batch_bytes: int,
            batch_bytes_by_shape: dict[str, int] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The memory figures from RSS samples ``(batches taken, rss bytes, seconds)``."""
    if len(samples) < 4:
        raise BenchError(f"{len(samples)} RSS samples; need at least 4")
    first_n, first_rss, _ = samples[0]
    last_n, last_rss, _ = samples[-1]
    half = samples[len(samples) // 2:]
    xs = [n / 1000.0 for n, _, _ in half]
    ys = [rss / MB for _, rss, _ in half]
    slope = least_squares_slope(xs, ys)  # MB per 1000 batches
    span_batches = half[-1][0] - half[0][0]
    growth_mb = slope * span_batches / 1000.0
    limit_mb = (GROWTH_LIMIT_FRAC * first_rss + max_batch_bytes) / MB
    peak = max(rss for _, rss, _ in samples)
    bound = baseline + capacity * max_batch_bytes
    bound_plus_one = baseline + (capacity + 1) * max_batch_bytes
    out = {
        "baseline_rss_mb": baseline / MB,
        "first_sample": {"batches": first_n, "rss_mb": first_rss / MB},
        "end": {"batches": last_n, "rss_mb": last_rss / MB},
        "end_vs_first": ratio(last_rss / MB, first_rss / MB, note="RSS at the end / RSS at the first sample"),
        "slope_mb_per_1000_batches": slope,
        "second_half": {"from_batches": half[0][0], "to_batches": half[-1][0], "points": len(half),
                        "fitted_growth_mb": growth_mb},
        "peak_rss_mb": peak / MB,
        "bound": {"formula": "baseline + capacity x largest batch bytes", "capacity": capacity,
                  "largest_batch_bytes": max_batch_bytes, "bound_mb": bound / MB,
                  "bound_plus_trainer_batch_mb": bound_plus_one / MB,
                  "peak_minus_baseline_mb": (peak - baseline) / MB,
                  "peak_within_bound": peak <= bound, "peak_within_bound_plus_one": peak <= bound_plus_one,
                  "batch_bytes_by_shape": batch_bytes_by_shape or {}},
        "samples": [{"batches": n, "rss_mb": round(rss / MB, 3), "t_s": round(t, 3)} for n, rss, t in samples],
        "criterion": {
            "what": (f"fitted RSS growth over the second half (slope x {span_batches} batches) < "
                     f"{GROWTH_LIMIT_FRAC:.0%} of the RSS at batch {first_n} + one largest batch"),
            "growth_mb": growth_mb, "limit_mb": limit_mb,
            "detection_limit_bytes_per_batch": limit_mb * MB / span_batches if span_batches else None,
            "met": growth_mb < limit_mb,
        },
    }
    if extra:
        out.update(extra)
    return out


def render(section: dict[str, Any]) -> str:
    c, b = section["criterion"], section["bound"]
    rows = [
        ["batches", section.get("batches"), ""],
        ["throughput", f"{section.get('batches_per_s', 0):.0f} batches/s, {section.get('payload_gbps', 0):.2f} GB/s",
         "trainer takes batches as fast as it can"],
        ["baseline RSS (MB)", f"{section['baseline_rss_mb']:.1f}", "before the producer starts"],
        [f"RSS at batch {section['first_sample']['batches']} (MB)", f"{section['first_sample']['rss_mb']:.1f}", ""],
        [f"RSS at batch {section['end']['batches']} (MB)", f"{section['end']['rss_mb']:.1f}",
         f"end/first = {section['end_vs_first']['value']:.4f}"],
        ["slope, second half (MB/1000 batches)", f"{section['slope_mb_per_1000_batches']:.3f}",
         f"fitted growth {c['growth_mb']:.2f} MB vs limit {c['limit_mb']:.2f} MB"],
        ["peak RSS (MB)", f"{section['peak_rss_mb']:.1f}",
         f"bound {b['bound_mb']:.1f} (+1 batch: {b['bound_plus_trainer_batch_mb']:.1f}); "
         f"largest batch {b['largest_batch_bytes'] / MB:.2f} MB"],
        ["no growth (criterion)", "met" if c["met"] else "NOT met",
         f"detects leaks above ~{c['detection_limit_bytes_per_batch']:.0f} bytes/batch"],
    ]
    return table(["figure", "value", "note"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.memory")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batches", type=int)
    parser.add_argument("--json", help="also write the section to this file")
    args = parser.parse_args(argv)
    plan = MemoryPlan.quick() if args.quick else MemoryPlan()
    if args.batches:
        plan.batches = args.batches
    return run_alone("memory", lambda log: run(plan, log=log), render, args.json)


if __name__ == "__main__":
    sys.exit(main())
