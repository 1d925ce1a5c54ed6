"""Transport benchmark: stoker's wire protocol vs raw pyzmq, same payload, same machine.

Baseline (``raw``): PUSH -> PULL, one numpy frame per message holding exactly the
payload bytes of a batch, ``send(copy=False)`` / ``recv(copy=False)``.

Candidate (``protocol``): DEALER (producer side) -> ROUTER (consumer side) with
``shared.wire``'s typed messages (encode, decode and parse) and the credit round trip. The payload is shaped like a
real batch (tokens int32 [B, L], token_lengths int32 [B], mel float32 [B, T, F],
mel_lengths int32 [B]) with B = 16, F = 80 and L, T picked so the four arrays total
about 8 MiB, 1 MiB or 64 KiB. The receiver grants a CREDIT only for a free slot of a
capacity-3 ``consumer.buffer.BatchQueue`` (``capacity - len(queue) - credits in
flight``), and drains each arriving BATCH at once: decode (all header checks and
size checks, then the BATCH's typed fields), ``put``, ``get``. The sender sends a BATCH only against a CREDIT. So at
most 3 batches are in flight, as in a run. (The LEASE/READY messages of a real run
happen ahead of time and are left out: the sender always has its batch prepared.)

Decomposition (full run only, informational), three steps from raw to protocol:

- ``credit``: raw single frames over DEALER/ROUTER with the same capacity-3 credit
  window (one-byte credits), no wire encoding and no queue. credit/raw is the cost of
  flow control.
- ``frames``: the protocol's own messages, a BATCH of header + one frame per array
  (encoded once, before the clock starts) answered to each CREDIT message of the
  protocol, but no per-batch encode, no decode and no queue. frames/credit is the cost of
  the frame layout the wire rules fix (5 frames a batch instead of 1), and frames/raw the
  ceiling of any implementation of this wire format on the host: the protocol adds
  Python work to it, never removes any.
- protocol/frames is then the cost of the Python work per batch: encode, decode with all
  its checks, the queue.

Sender and receiver are separate spawned processes (no shared GIL). Both throughputs
are measured by the receiver, from the arrival of the last warm-up message to the
arrival of the last one. Repetitions are interleaved (raw and protocol alternate which
goes first, alternating), so drift on a noisy machine hits all. Reported per transport (tcp
loopback, ipc) and size: GB/s (1e9 bytes/s of payload) and batches/s as median
[min, max] over the repetitions, and the ratio protocol/raw of the medians. Also the
CPU time per batch of each whole process (``time.process_time``: main thread, ZeroMQ io
thread, pyzmq's gc thread), to tell "more CPU per byte" from "idle bubbles".

Run alone: ``python -m stoker.benchmarks.transport [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import zmq

from .common import (run_alone, BenchError, close_queue, collect, ratio, spawn_context, spread,
                               stop_children, table)
from ..consumer.buffer import BatchQueue, QueuedBatch
from ..shared import wire

BATCH_SIZE = 16
N_MELS = 80
CAPACITY = 3
# Text is ~1 token per 6 mel frames in LJSpeech-like data; the tokens are a small share anyway.
FRAMES_PER_TOKEN = 6

SIZES = {"8MiB": 8 << 20, "1MiB": 1 << 20, "64KiB": 64 << 10}
TRANSPORTS = ("tcp", "ipc")
# raw: the baseline; protocol: the candidate; credit and frames: the steps between them (see
# the module docstring), which split the protocol's cost into flow control (credit / raw),
# frame layout (frames / credit) and Python work per batch (protocol / frames).
KINDS = ("raw", "credit", "frames", "protocol")
STEPS = ("credit", "frames")
# Minimum protocol/raw throughput ratio by batch size: big batches must move at
# nearly wire speed; small ones pay a per-message cost (header, credit round trip, queue).
TARGET_RATIOS = {"8MiB": 0.8, "64KiB": 0.5}
TARGET_SIZE = "8MiB"
TARGET_RATIO = TARGET_RATIOS[TARGET_SIZE]
# No recv waits longer than this; a silent peer fails the measurement.
RECV_TIMEOUT_MS = 10_000


@dataclass
class TransportPlan:
    repetitions: int = 3
    # timed messages per measurement, by size: ~1.2 GB (about half a second) for the big
    # sizes, so scheduling noise of a few ms does not decide the figure
    messages: dict[str, int] = field(default_factory=lambda: {"8MiB": 150, "1MiB": 1000, "64KiB": 3000})
    warmup: int = 5
    transports: tuple[str, ...] = TRANSPORTS
    kinds: tuple[str, ...] = KINDS
    timeout_s: float = 120.0
    # the credit window (queue capacity); a run's default is 3 (``--buffer-size``), and the
    # targets are judged only there
    capacity: int = CAPACITY

    @classmethod
    def quick(cls) -> "TransportPlan":
        # without the informational decomposition, to fit the quick suite's 3 minutes
        return cls(repetitions=2, messages={"8MiB": 60, "1MiB": 300, "64KiB": 1000}, kinds=("raw", "protocol"))


# ---------------------------------------------------------------- payloads
def batch_shape(target_bytes: int, batch_size: int = BATCH_SIZE, n_mels: int = N_MELS) -> tuple[int, int]:
    """(L, T) whose batch arrays total about ``target_bytes``."""
    per_frame = batch_size * 4 * (n_mels + 1.0 / FRAMES_PER_TOKEN)
    frames = max(1, int(round((target_bytes - 2 * batch_size * 4) / per_frame)))
    tokens = max(1, frames // FRAMES_PER_TOKEN)
    return tokens, frames


def make_batch(tokens: int, frames: int, batch_size: int = BATCH_SIZE, n_mels: int = N_MELS,
               seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "tokens": rng.integers(1, 60, size=(batch_size, tokens), dtype=np.int32),
        "token_lengths": np.full(batch_size, tokens, dtype=np.int32),
        "mel": rng.standard_normal((batch_size, frames, n_mels), dtype=np.float32),
        "mel_lengths": np.full(batch_size, frames, dtype=np.int32),
    }


def payload_bytes(arrays: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays.values())


def _endpoint(transport: str, tmpdir: str) -> str:
    if transport == "tcp":
        return "tcp://127.0.0.1:*"
    if transport == "ipc":
        return f"ipc://{tmpdir}/{uuid.uuid4().hex[:12]}.sock"
    raise ValueError(f"unknown transport {transport!r}")


def _fail(res_q: Any, role: str) -> None:
    res_q.put({"role": role, "ok": False, "error": traceback.format_exc()[-2000:]})


def _recv_ready(sock: Any, what: str) -> None:
    if not sock.poll(RECV_TIMEOUT_MS):
        raise TimeoutError(f"nothing received for {RECV_TIMEOUT_MS} ms ({what})")


# ---------------------------------------------------------------- raw PUSH/PULL children
def raw_receiver(spec: str, nbytes: int, warmup: int, count: int, ep_q: Any, res_q: Any, done: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.linger = 0
    try:
        sock.bind(spec)
        ep_q.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        t0 = c0 = 0.0
        for i in range(warmup + count):
            _recv_ready(sock, f"raw message {i}")
            frame = sock.recv(copy=False)
            if len(frame.buffer) != nbytes:
                raise ValueError(f"got {len(frame.buffer)} bytes, expected {nbytes}")
            del frame
            if i == warmup - 1:
                t0 = time.perf_counter()
                c0 = time.process_time()
        seconds = time.perf_counter() - t0
        cpu_s = time.process_time() - c0
        res_q.put({"role": "receiver", "ok": True, "seconds": seconds, "messages": count, "bytes": count * nbytes,
                   "cpu_s": cpu_s})
    except BaseException:
        _fail(res_q, "receiver")
    finally:
        done.set()
        sock.close()
        ctx.term()


def raw_sender(nbytes: int, total: int, ep_q: Any, res_q: Any, done: Any, timeout_s: float) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    try:
        endpoint = ep_q.get(timeout=timeout_s)
        payload = np.random.default_rng(1).integers(0, 255, size=nbytes, dtype=np.uint8)
        sock.connect(endpoint)
        c0 = time.process_time()
        for i in range(total):
            if not sock.poll(RECV_TIMEOUT_MS, zmq.POLLOUT):
                raise TimeoutError(f"cannot send raw message {i}")
            sock.send(payload, copy=False)
        # linger is 0: keep the socket open until the receiver has everything
        if not done.wait(timeout_s):
            raise TimeoutError("receiver did not finish")
        res_q.put({"role": "sender", "ok": True, "sent": total, "cpu_s": time.process_time() - c0})
    except BaseException:
        _fail(res_q, "sender")
    finally:
        sock.close()
        ctx.term()


# ---------------------------------------------------------------- protocol DEALER/ROUTER children
def _await_hello(sock: Any) -> bytes:
    """The sender's HELLO; its identity."""
    _recv_ready(sock, "hello")
    frames = sock.recv_multipart(copy=False)
    hello, _ = wire.read(frames[1:])
    if not isinstance(hello, wire.Hello):
        raise ValueError(f"expected hello, got {hello.KIND}")
    return frames[0].bytes


class _Credits:
    """The coordinator's credit rule, alone: a CREDIT per free queue slot, up to ``total`` leases."""

    def __init__(self, sock: Any, identity: bytes, queue: Any, total: int) -> None:
        self.sock, self.identity, self.queue, self.total = sock, identity, queue, total
        self.out = 0
        self.next_lease = 1
        self.outstanding: set[int] = set()

    def grant(self) -> None:
        free = self.queue.capacity - len(self.queue) - self.out
        while free > 0 and self.next_lease <= self.total:
            lease = self.next_lease
            self.sock.send_multipart([self.identity, *wire.Credit(lease).encode()])
            self.outstanding.add(lease)
            self.next_lease += 1
            self.out += 1
            free -= 1


def protocol_receiver(spec: str, nbytes: int, warmup: int, count: int, ep_q: Any, res_q: Any, done: Any,
                      capacity: int = CAPACITY) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    try:
        sock.bind(spec)
        ep_q.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        identity = _await_hello(sock)
        queue = BatchQueue(capacity)
        total = warmup + count
        credits = _Credits(sock, identity, queue, total)
        outstanding = credits.outstanding
        grant = credits.grant
        grant()
        received = 0
        t0 = c0 = 0.0
        max_bytes = 256 << 20
        while received < total:
            _recv_ready(sock, f"batch {received}")
            frames = sock.recv_multipart(copy=False)
            msg, arrays = wire.read(frames[1:], max_bytes=max_bytes)
            if not isinstance(msg, wire.Batch):
                continue
            lease = msg.lease
            if lease not in outstanding:
                raise ValueError(f"batch for lease {lease} without a credit")
            if sum(a.nbytes for a in arrays.values()) != nbytes:
                raise ValueError("wrong payload size")
            outstanding.discard(lease)
            queue.put(QueuedBatch(lease=lease, epoch=0, index=received, ids=list(msg.ids),
                                  arrays=arrays, producer="bench"))
            credits.out -= 1
            got = queue.get(timeout=0)
            if got is None:
                raise RuntimeError("queue returned nothing")
            del got, msg, arrays, frames
            received += 1
            if received == warmup:
                t0 = time.perf_counter()
                c0 = time.process_time()
            grant()
        seconds = time.perf_counter() - t0
        cpu_s = time.process_time() - c0
        sock.send_multipart([identity, *wire.Stop("bench over").encode()])
        res_q.put({"role": "receiver", "ok": True, "seconds": seconds, "messages": count, "bytes": count * nbytes,
                   "cpu_s": cpu_s,
                   "queue_high_water": queue.high_water})
        done.wait(5.0)  # let the sender read STOP before the socket goes
    except BaseException:
        _fail(res_q, "receiver")
    finally:
        done.set()
        sock.close()
        ctx.term()


def protocol_sender(shape: tuple[int, int], ep_q: Any, res_q: Any, done: Any, timeout_s: float,
                    capacity: int = CAPACITY) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.copy_threshold = wire.COPY_THRESHOLD_BYTES  # as producer/link.py sets it
    try:
        endpoint = ep_q.get(timeout=timeout_s)
        arrays = make_batch(*shape)
        ids = tuple(f"BENCH-{i:04d}" for i in range(BATCH_SIZE))

        def prepare(lease: int) -> list[Any]:
            return wire.Batch(lease, 0, lease - 1, ids, prep_ms=0.0).encode(arrays)

        # As a producer, keep the next `capacity` batches encoded ahead of their credits
        # (producer/worker.py encodes in its compute thread, before READY); the encoding
        # still costs this process its CPU, only off the credit -> send path.
        ready = {lease: prepare(lease) for lease in range(1, capacity + 1)}
        sock.connect(endpoint)
        c0 = time.process_time()
        sock.send_multipart(wire.Hello(producer="bench", host="localhost", pid=os.getpid(),
                                       config=wire.ConfigSchema.local()).encode())
        sent = 0
        while True:
            _recv_ready(sock, "credit")
            msg, _ = wire.read(sock.recv_multipart())
            if isinstance(msg, wire.Credit):
                lease = msg.lease
                frames = ready.pop(lease, None) or prepare(lease)
                sock.send_multipart(frames, copy=False)
                sent += 1
                ready[lease + capacity] = prepare(lease + capacity)
            elif isinstance(msg, wire.Stop):
                break
        res_q.put({"role": "sender", "ok": True, "sent": sent, "cpu_s": time.process_time() - c0})
    except BaseException:
        _fail(res_q, "sender")
    finally:
        done.set()
        sock.close()
        ctx.term()


# ---------------------------------------------------------------- the steps between (decomposition)
def credit_receiver(spec: str, nbytes: int, warmup: int, count: int, ep_q: Any, res_q: Any, done: Any,
                    capacity: int = CAPACITY, protocol_frames: bool = False) -> None:
    """ROUTER granting credits for a capacity-``capacity`` window; no decode, no queue.

    ``credit`` kind: one-byte credits, one payload frame per batch. ``frames`` kind
    (``protocol_frames``): the protocol's CREDIT and STOP messages, and batches of the
    protocol's frames, checked by their total size only.
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    try:
        sock.bind(spec)
        ep_q.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        _recv_ready(sock, "hello")
        identity = sock.recv_multipart()[0]
        total = warmup + count
        granted = received = 0
        credits_out = 0
        first_array = 2 if protocol_frames else 1  # after the identity (and the header)
        t0 = c0 = 0.0
        while received < total:
            while credits_out < capacity and granted < total:
                granted += 1
                credit = wire.Credit(granted).encode() if protocol_frames else [b"C"]
                sock.send_multipart([identity, *credit])
                credits_out += 1
            _recv_ready(sock, f"{'frames' if protocol_frames else 'credit'} message {received}")
            frames = sock.recv_multipart(copy=False)
            got = sum(len(f.buffer) for f in frames[first_array:])
            if got != nbytes:
                raise ValueError(f"got {got} bytes, expected {nbytes}")
            del frames
            credits_out -= 1
            received += 1
            if received == warmup:
                t0 = time.perf_counter()
                c0 = time.process_time()
        seconds = time.perf_counter() - t0
        cpu_s = time.process_time() - c0
        sock.send_multipart([identity, *(wire.Stop("bench over").encode() if protocol_frames else [b"S"])])
        res_q.put({"role": "receiver", "ok": True, "seconds": seconds, "messages": count, "bytes": count * nbytes,
                   "cpu_s": cpu_s})
        done.wait(5.0)
    except BaseException:
        _fail(res_q, "receiver")
    finally:
        done.set()
        sock.close()
        ctx.term()


def credit_sender(shape: tuple[int, int], ep_q: Any, res_q: Any, done: Any, timeout_s: float,
                  protocol_frames: bool = False) -> None:
    """DEALER answering each credit with one batch, prepared once before the clock starts.

    ``credit`` kind: the batch's bytes as one frame. ``frames`` kind
    (``protocol_frames``): the protocol's BATCH frames, and each CREDIT decoded as the
    producer decodes it.
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if protocol_frames:  # as the protocol's sender; raw frames keep pyzmq's default, as raw does
        sock.copy_threshold = wire.COPY_THRESHOLD_BYTES
    try:
        endpoint = ep_q.get(timeout=timeout_s)
        if protocol_frames:
            batch = wire.Batch(1, 0, 0, tuple(f"BENCH-{i:04d}" for i in range(BATCH_SIZE)),
                               prep_ms=0.0).encode(make_batch(*shape))
        else:
            batch = [np.random.default_rng(1).integers(0, 255, size=_shape_bytes(shape), dtype=np.uint8)]
        sock.connect(endpoint)
        c0 = time.process_time()
        sock.send(b"H")
        sent = 0
        while True:
            _recv_ready(sock, "credit")
            if protocol_frames:
                if isinstance(wire.read(sock.recv_multipart())[0], wire.Stop):
                    break
            elif sock.recv() == b"S":
                break
            sock.send_multipart(batch, copy=False)
            sent += 1
        res_q.put({"role": "sender", "ok": True, "sent": sent, "cpu_s": time.process_time() - c0})
    except BaseException:
        _fail(res_q, "sender")
    finally:
        done.set()
        sock.close()
        ctx.term()


# ---------------------------------------------------------------- one measurement
def measure(kind: str, transport: str, size: int, count: int, warmup: int, tmpdir: str,
            timeout_s: float, capacity: int = CAPACITY) -> dict[str, Any]:
    """One measurement in two fresh processes; returns seconds, messages, bytes."""
    if warmup < 1:
        raise ValueError("warmup must be >= 1 (the clock starts at the last warm-up message)")
    ctx = spawn_context()
    ep_q, res_q, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    spec = _endpoint(transport, tmpdir)
    shape = batch_shape(size)
    nbytes = _shape_bytes(shape)
    if kind == "raw":
        receiver = ctx.Process(target=raw_receiver, args=(spec, nbytes, warmup, count, ep_q, res_q, done),
                               name=f"raw-receiver-{transport}", daemon=True)
        sender = ctx.Process(target=raw_sender, args=(nbytes, warmup + count, ep_q, res_q, done, timeout_s),
                             name=f"raw-sender-{transport}", daemon=True)
    elif kind in STEPS:
        frames = kind == "frames"
        receiver = ctx.Process(target=credit_receiver,
                               args=(spec, nbytes, warmup, count, ep_q, res_q, done, capacity, frames),
                               name=f"{kind}-receiver-{transport}", daemon=True)
        sender = ctx.Process(target=credit_sender, args=(shape, ep_q, res_q, done, timeout_s, frames),
                             name=f"{kind}-sender-{transport}", daemon=True)
    elif kind == "protocol":
        receiver = ctx.Process(target=protocol_receiver,
                               args=(spec, nbytes, warmup, count, ep_q, res_q, done, capacity),
                               name=f"protocol-receiver-{transport}", daemon=True)
        sender = ctx.Process(target=protocol_sender, args=(shape, ep_q, res_q, done, timeout_s, capacity),
                             name=f"protocol-sender-{transport}", daemon=True)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    procs = [receiver, sender]
    try:
        for p in procs:
            p.start()
        results = collect(res_q, ["receiver", "sender"], procs, timeout_s)
    finally:
        stop_children(procs)
        for q in (ep_q, res_q):
            close_queue(q)
    rec = results["receiver"]
    if rec["seconds"] <= 0:
        raise BenchError(f"{kind}/{transport}: non-positive duration {rec['seconds']}")
    snd = results["sender"]
    return {"seconds": rec["seconds"], "messages": rec["messages"], "bytes": rec["bytes"],
            "gbps": rec["bytes"] / rec["seconds"] / 1e9, "batches_per_s": rec["messages"] / rec["seconds"],
            # CPU of each whole process (main thread, ZeroMQ io thread, pyzmq's gc thread) per message
            "receiver_cpu_us": rec["cpu_s"] / rec["messages"] * 1e6,
            "sender_cpu_us": snd["cpu_s"] / max(1, snd["sent"]) * 1e6}


def _shape_bytes(shape: tuple[int, int], batch_size: int = BATCH_SIZE, n_mels: int = N_MELS) -> int:
    tokens, frames = shape
    return 4 * batch_size * (tokens + 1 + frames * n_mels + 1)


# ---------------------------------------------------------------- the section
def run(plan: TransportPlan | None = None, sizes: dict[str, int] | None = None,
        log: Any = None) -> list[dict[str, Any]]:
    """All measurements of the plan; one row per (transport, size)."""
    plan = plan or TransportPlan()
    sizes = sizes or SIZES
    log = log or (lambda text: None)
    samples: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    tmpdir = tempfile.mkdtemp(prefix="stoker-bench-")
    try:
        for rep in range(plan.repetitions):
            for transport in plan.transports:
                for size_name, size in sizes.items():
                    kinds = plan.kinds if rep % 2 == 0 else tuple(reversed(plan.kinds))
                    for kind in kinds:
                        m = measure(kind, transport, size, plan.messages[size_name], plan.warmup, tmpdir,
                                    plan.timeout_s, plan.capacity)
                        samples.setdefault((transport, size_name, kind), []).append(m)
                        log(f"transport rep {rep + 1}/{plan.repetitions} {transport} {size_name} {kind}: "
                            f"{m['gbps']:.3f} GB/s, {m['batches_per_s']:.0f} batches/s")
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return [_row(plan, samples, transport, size_name, size) for transport in plan.transports
            for size_name, size in sizes.items()]


def _block(ms: list[dict[str, Any]]) -> dict[str, Any]:
    return {"gbps": spread([m["gbps"] for m in ms]), "batches_per_s": spread([m["batches_per_s"] for m in ms]),
            "receiver_cpu_us_per_batch": spread([m["receiver_cpu_us"] for m in ms]),
            "sender_cpu_us_per_batch": spread([m["sender_cpu_us"] for m in ms])}


def _row(plan: TransportPlan, samples: dict[tuple[str, str, str], list[dict[str, Any]]], transport: str,
         size_name: str, size: int) -> dict[str, Any]:
    """One (transport, size): raw and protocol figures, their ratio and target, and the steps between."""
    raw = samples[(transport, size_name, "raw")]
    proto = samples[(transport, size_name, "protocol")]
    raw_gbps = spread([m["gbps"] for m in raw])
    proto_gbps = spread([m["gbps"] for m in proto])
    paired = spread([p["gbps"] / r["gbps"] for p, r in zip(proto, raw)])
    shape = batch_shape(size)
    value = ratio(proto_gbps["median"], raw_gbps["median"], paired=paired,
                  note="median protocol GB/s / median raw GB/s; paired = per-repetition ratios")
    applies = size_name in TARGET_RATIOS and plan.capacity == CAPACITY
    min_ratio = TARGET_RATIOS.get(size_name, TARGET_RATIO)
    decomposition = None
    if all((transport, size_name, step) in samples for step in STEPS):
        decomposition = _decomposition(samples[(transport, size_name, "credit")],
                                       samples[(transport, size_name, "frames")], raw_gbps["median"],
                                       proto_gbps["median"])
    return {
        "transport": transport,
        "size": size_name,
        "payload_bytes": _shape_bytes(shape),
        "batch_shape": {"B": BATCH_SIZE, "L": shape[0], "T": shape[1], "F": N_MELS},
        "messages": plan.messages[size_name],
        "repetitions": plan.repetitions,
        "capacity": plan.capacity,
        "raw": _block(raw),
        "protocol": _block(proto),
        "ratio": value,
        "decomposition": decomposition,
        "target": {"what": f"protocol >= {min_ratio} x raw at {size_name}", "min_ratio": min_ratio,
                   "applies": applies, "met": (value["value"] >= min_ratio) if applies else None},
    }


def _decomposition(credit: list[dict[str, Any]], frames: list[dict[str, Any]], raw_gbps: float,
                   proto_gbps: float) -> dict[str, Any]:
    """Where raw and protocol differ: flow control, the frame layout, the per-batch Python work."""
    credit_gbps = spread([m["gbps"] for m in credit])["median"]
    frames_gbps = spread([m["gbps"] for m in frames])["median"]
    return {
        "credit": _block(credit),
        "frames": _block(frames),
        "flow_control_ratio": ratio(credit_gbps, raw_gbps, note="raw frames with the credit window / raw PUSH-PULL"),
        "frame_layout_ratio": ratio(frames_gbps, credit_gbps,
                                    note="the protocol's frames and credits, no per-batch Python work "
                                         "/ raw frames with the credit window"),
        "ceiling_ratio": ratio(frames_gbps, raw_gbps,
                               note="the protocol's frames and credits, no per-batch Python work "
                                    "/ raw PUSH-PULL: the most this wire format reaches here"),
        "python_work_ratio": ratio(proto_gbps, frames_gbps,
                                   note="protocol / its frames and credits without the Python work"),
    }


def render(rows: list[dict[str, Any]]) -> str:
    headers = ["transport", "size", "raw GB/s med [min,max]", "proto GB/s med [min,max]",
               "raw batch/s", "proto batch/s", "ratio", "paired [min,max]", "target"]
    out = []
    for r in rows:
        rg, pg = r["raw"]["gbps"], r["protocol"]["gbps"]
        pr = r["ratio"]["paired"]
        target = ("met" if r["target"]["met"] else "NOT met") + f" (>= {r['target']['min_ratio']})" \
            if r["target"]["applies"] else "-"
        out.append([r["transport"], r["size"],
                    f"{rg['median']:.3f} [{rg['min']:.3f},{rg['max']:.3f}]",
                    f"{pg['median']:.3f} [{pg['min']:.3f},{pg['max']:.3f}]",
                    f"{r['raw']['batches_per_s']['median']:.0f}", f"{r['protocol']['batches_per_s']['median']:.0f}",
                    f"{r['ratio']['value']:.3f}", f"[{pr['min']:.3f},{pr['max']:.3f}]", target])
    text = table(headers, out)
    steps = [r for r in rows if r.get("decomposition")]
    if steps:
        text += ("\n\nFrom raw to protocol, median GB/s: credit = raw frames with the credit window; frames = the "
                 "protocol's frames and credits without per-batch Python work (ceiling = frames / raw)\n")
        text += table(["transport", "size", "credit GB/s", "frames GB/s", "credit/raw", "frames/credit",
                       "ceiling", "proto/frames"],
                      [[r["transport"], r["size"], f"{d['credit']['gbps']['median']:.3f}",
                        f"{d['frames']['gbps']['median']:.3f}", f"{d['flow_control_ratio']['value']:.3f}",
                        f"{d['frame_layout_ratio']['value']:.3f}", f"{d['ceiling_ratio']['value']:.3f}",
                        f"{d['python_work_ratio']['value']:.3f}"]
                       for r in steps for d in [r["decomposition"]]])
    def blocks(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {"raw": r["raw"], **(r.get("decomposition") or {}), "protocol": r["protocol"]}

    kinds = [k for k in KINDS if any(k in blocks(r) for r in rows)]  # the quick run has no steps
    cpu_rows = []
    for r in rows:
        cells = [r["transport"], r["size"]]
        for kind in kinds:
            b = blocks(r).get(kind)
            cells += ["-", "-"] if b is None else [f"{b['sender_cpu_us_per_batch']['median']:.0f}",
                                                  f"{b['receiver_cpu_us_per_batch']['median']:.0f}"]
        cpu_rows.append(cells)
    cpu = table(["transport", "size", *(f"{k} {side}" for k in kinds for side in ("send", "recv"))], cpu_rows)
    return (text + "\n\nCPU microseconds per batch, whole process (main + ZeroMQ io + pyzmq gc threads), "
            "median\n" + cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.transport")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--capacity", type=int, default=CAPACITY,
                        help=f"credit window = queue capacity (default {CAPACITY}, a run's default; "
                             "the targets are judged only there)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.capacity < 1:
        parser.error("--capacity must be at least 1")
    plan = replace(TransportPlan.quick() if args.quick else TransportPlan(), capacity=args.capacity)
    return run_alone("transport", lambda log: run(plan, log=log), render, args.json)


if __name__ == "__main__":
    sys.exit(main())
