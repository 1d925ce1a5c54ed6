"""The coordinator: the consumer's ROUTER socket, the epoch plan, leases and credits.

It runs in its own thread and is the only user of the ROUTER socket.

Leases (work): the epoch plan (consumer/plan.py) is handed out batch by batch. Each
producer holds up to ``lease_ahead`` leases. A lease is identified by a fresh integer;
re-issuing a planned batch creates a new lease id, so a late delivery of the old one is
recognised and dropped. A producer that says BYE, reports a fatal ERROR or is silent
for ``heartbeat_timeout_s`` loses its leases: their planned batches go back to the front
of the pending list. That keeps "every valid sample exactly once per epoch" while any
producer is alive.

Credits (flow): a producer tells READY when a leased batch is prepared. The coordinator
sends a CREDIT for a ready lease only while
``queued batches + credits in flight < capacity``, lowest (epoch, index) first, so the
queue can never overflow and its depth is exact. A credit not used within the heartbeat
timeout is revoked and its batch re-planned.

Anything malformed or unexpected is dropped and counted by reason
(``rejected_messages`` in summary.json); nothing a peer sends can stop the coordinator.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import zmq

from consumer.buffer import BatchQueue, QueuedBatch, QueueFull
from consumer.plan import EpochPlanner, PlannedBatch
from shared import wire
from shared.config import Config
from shared.dataset import Rejection

log = logging.getLogger("consumer.coordinator")

# The loop wakes at least this often for heartbeats and expiry even when nothing arrives.
POLL_INTERVAL_MS = 100
# On stop, give the STOP messages this long to leave before the socket closes.
STOP_LINGER_MS = 500
# Expected dtype and rank of each batch array (see producer/collate.py).
BATCH_SPEC = {"tokens": ("int32", 2), "token_lengths": ("int32", 1),
              "mel": ("float32", 3), "mel_lengths": ("int32", 1)}


class BindError(Exception):
    """The ROUTER socket cannot bind (address in use, bad endpoint)."""


@dataclass
class Lease:
    id: int
    batch: PlannedBatch
    identity: bytes
    state: str = "working"  # working -> ready -> credited -> (delivered: removed)
    issued_t: float = field(default_factory=time.monotonic)
    ready_t: float = 0.0
    credited_t: float = 0.0


@dataclass
class Peer:
    identity: bytes
    name: str
    host: str
    pid: int
    index: int
    last_seen: float
    leases: set[int] = field(default_factory=set)


@dataclass
class ProducerStats:
    id: str
    host: str
    batches: int = 0
    samples: int = 0
    rejected: int = 0
    status: str = "alive"
    connections: int = 0
    prep_ms_total: float = 0.0
    credit_wait_ms_total: float = 0.0
    last_error: str = ""
    # Feature cache, summed over this producer's batches (see producer/feature_cache.py).
    cache_hits: int = 0
    cache_computed: int = 0  # log-mels computed from audio (no valid entry) and stored
    cache_stale: int = 0
    cache_corrupt: int = 0

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["prep_ms_mean"] = round(self.prep_ms_total / self.batches, 3) if self.batches else None
        out["credit_wait_ms_mean"] = round(self.credit_wait_ms_total / self.batches, 3) if self.batches else None
        del out["prep_ms_total"], out["credit_wait_ms_total"]
        return out


class Coordinator:
    def __init__(self, cfg: Config, planner: EpochPlanner, queue: BatchQueue, stop: threading.Event,
                 max_epochs: int | None = None, on_rejected: Callable[[list[Rejection]], None] | None = None,
                 context: zmq.Context | None = None, metadata_sha256: str = "") -> None:
        self.cfg = cfg
        self.metadata_sha256 = metadata_sha256
        self.planner = planner
        self.queue = queue
        self.stop = stop
        self.max_epochs = max_epochs
        self.on_rejected = on_rejected or (lambda rejections: None)
        self.ctx = context or zmq.Context.instance()
        self.endpoint = ""
        self._router: zmq.Socket | None = None
        self._wake_addr = f"inproc://consumer-wake-{uuid.uuid4().hex}"
        self._wake_local = threading.local()
        self._pending: collections.deque[PlannedBatch] = collections.deque()
        self._next_epoch = 0
        self._next_lease = 1
        self._leases: dict[int, Lease] = {}
        self._peers: dict[bytes, Peer] = {}
        self._credits_out = 0
        self._lock = threading.Lock()  # guards the stats below, read by other threads
        self.producers: dict[str, ProducerStats] = {}
        self.dropped: collections.Counter[str] = collections.Counter()
        self.reissued = 0
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self._max_bytes = cfg.pipeline.max_message_mb << 20

    # ------------------------------------------------------------ lifecycle
    def bind(self, endpoint: str) -> str:
        """Bind the ROUTER socket (in the caller's thread, so errors surface there)."""
        router = self.ctx.socket(zmq.ROUTER)
        router.linger = 0
        router.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
        try:
            router.bind(endpoint)
        except zmq.ZMQError as exc:
            router.close()
            raise BindError(f"cannot bind {endpoint}: {exc.strerror}") from None
        self._router = router
        self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._wake = self.ctx.socket(zmq.PULL)
        self._wake.linger = 0
        self._wake.bind(self._wake_addr)
        return self.endpoint

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run_guarded, name="coordinator", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def notify_free(self) -> None:
        """Called from the trainer thread when it takes a batch: a slot is free."""
        sock = getattr(self._wake_local, "sock", None)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.linger = 0
            sock.connect(self._wake_addr)
            self._wake_local.sock = sock
        try:
            sock.send(b"", flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a wake-up is already pending; one is enough

    def close_notifier(self) -> None:
        sock = getattr(self._wake_local, "sock", None)
        if sock is not None:
            sock.close()
            self._wake_local.sock = None

    # ------------------------------------------------------------ stats for the trainer
    def alive(self) -> int:
        with self._lock:
            return sum(1 for p in self.producers.values() if p.status == "alive")

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "producers": [p.to_json() for p in self.producers.values()],
                "rejected_messages": dict(self.dropped),
                "reissued_leases": self.reissued,
            }

    # ------------------------------------------------------------ sending
    def _send(self, identity: bytes, kind: str, fields: dict[str, Any] | None = None) -> None:
        assert self._router is not None
        try:
            self._router.send_multipart([identity, *wire.encode(kind, fields)], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("could not send %s to %s: its queue is full", kind, identity)
        except zmq.ZMQError as exc:
            log.warning("could not send %s to %s: %s", kind, identity, exc)

    # ------------------------------------------------------------ plan and leases
    def _next_planned(self) -> PlannedBatch | None:
        if not self._pending and (self.max_epochs is None or self._next_epoch < self.max_epochs):
            self._pending.extend(self.planner.plan(self._next_epoch))
            self._next_epoch += 1
        return self._pending.popleft() if self._pending else None

    def _assign(self, peer: Peer) -> None:
        while len(peer.leases) < self.cfg.pipeline.lease_ahead:
            batch = self._next_planned()
            if batch is None:
                return
            lease = Lease(self._next_lease, batch, peer.identity)
            self._next_lease += 1
            self._leases[lease.id] = lease
            peer.leases.add(lease.id)
            self._send(peer.identity, wire.LEASE, {
                "lease": lease.id, "epoch": batch.epoch, "index": batch.index,
                "ids": list(batch.ids), "shape": list(batch.shape)})

    def _assign_all(self) -> None:
        for peer in sorted(self._peers.values(), key=lambda p: len(p.leases)):
            self._assign(peer)

    def _release(self, lease_ids: list[int]) -> None:
        """Put leased batches back at the front of the plan, in plan order."""
        batches = []
        for lease_id in lease_ids:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                continue
            if lease.state == "credited":
                self._credits_out -= 1
            peer = self._peers.get(lease.identity)
            if peer is not None:
                peer.leases.discard(lease_id)
            batches.append(lease.batch)
        for batch in sorted(batches, key=lambda b: (b.epoch, b.index), reverse=True):
            self._pending.appendleft(batch)
        if batches:
            with self._lock:
                self.reissued += len(batches)

    def _drop_peer(self, peer: Peer, status: str) -> None:
        self._peers.pop(peer.identity, None)
        self._release(sorted(peer.leases))
        with self._lock:
            stats = self.producers.get(peer.name)
            if stats is not None:
                stats.status = status
        self._assign_all()
        self._grant()

    def _grant(self) -> None:
        free = self.queue.capacity - len(self.queue) - self._credits_out
        if free <= 0:
            return
        ready = sorted((lease for lease in self._leases.values() if lease.state == "ready"),
                       key=lambda lease: (lease.batch.epoch, lease.batch.index))
        now = time.monotonic()
        for lease in ready[:free]:
            lease.state = "credited"
            lease.credited_t = now
            self._credits_out += 1
            self._send(lease.identity, wire.CREDIT, {"lease": lease.id})

    # ------------------------------------------------------------ receiving
    def _count(self, reason: str, detail: str = "") -> None:
        with self._lock:
            self.dropped[reason] += 1
            first = self.dropped[reason] == 1
        # The first of each reason is worth a warning; repeats (a flood) only at debug level.
        log.log(logging.WARNING if first else logging.DEBUG, "dropped a message (%s) %s; further ones are "
                "counted in summary.json", reason, detail)

    def _check_batch(self, msg: wire.Message, lease: Lease) -> str | None:
        """Why this BATCH does not match its lease, or None if it does."""
        try:
            wire.require(msg, ids=list, rejected=list)
        except wire.ProtocolError as exc:
            return exc.reason
        if set(BATCH_SPEC) != set(msg.arrays):
            return "bad_batch"
        size = self.cfg.batching.batch_size
        max_tokens, max_frames = lease.batch.shape
        expected_shapes = {"tokens": (size, max_tokens), "token_lengths": (size,),
                           "mel": (size, max_frames, self.cfg.features.n_mels), "mel_lengths": (size,)}
        for name, (dtype, _rank) in BATCH_SPEC.items():
            array = msg.arrays[name]
            if array.dtype.name != dtype or array.shape != expected_shapes[name]:
                return "bad_batch"
        planned = set(lease.batch.ids)
        delivered = msg["ids"]
        rejected_ids = [r.get("id") if isinstance(r, dict) else None for r in msg["rejected"]]
        if not all(isinstance(x, str) for x in [*delivered, *rejected_ids]):
            return "bad_batch"
        if (len(delivered) + len(rejected_ids) != len(planned)
                or set(delivered) | set(rejected_ids) != planned):
            return "bad_batch"
        lengths = msg.arrays["mel_lengths"]
        if np.any(lengths[:len(delivered)] <= 0) or np.any(lengths[len(delivered):] != 0):
            return "bad_batch"
        return None

    def _on_batch(self, peer: Peer, msg: wire.Message, now: float) -> None:
        lease_id = msg.get("lease")
        valid_id = isinstance(lease_id, int) and not isinstance(lease_id, bool)
        lease = self._leases.get(lease_id) if valid_id else None
        if lease is None:
            self._count("unknown_lease", str(lease_id))
            return
        if lease.identity != peer.identity:
            self._count("wrong_producer", str(lease_id))
            return
        if lease.state != "credited":
            self._count("uncredited", str(lease_id))
            return
        problem = self._check_batch(msg, lease)
        if problem is not None:
            self._count(problem, str(lease_id))
            log.warning("batch of lease %d from %s does not match its plan (%s); re-planning it",
                        lease_id, peer.name, problem)
            self._release([lease_id])
            self._assign_all()
            self._grant()
            return
        item = QueuedBatch(lease=lease_id, epoch=lease.batch.epoch, index=lease.batch.index,
                           ids=list(msg["ids"]), arrays=msg.arrays, producer=peer.name)
        try:
            self.queue.put(item)
        except QueueFull:
            # Cannot happen while credits are counted right; if it does, re-plan rather than lose it.
            log.error("queue full on delivery of lease %d; re-planning it", lease_id)
            self._count("queue_full")
            self._release([lease_id])
            return
        self._credits_out -= 1
        del self._leases[lease_id]
        peer.leases.discard(lease_id)
        rejections = [Rejection(str(r.get("id")), str(r.get("reason", "rejected by producer"))[:300], peer.name)
                      for r in msg["rejected"]]
        prep_ms = msg.get("prep_ms")
        cache = msg.get("cache")
        cache = cache if isinstance(cache, dict) else {}

        def count(key: str) -> int:
            value = cache.get(key, 0)
            return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0

        with self._lock:
            stats = self.producers[peer.name]
            stats.batches += 1
            stats.samples += len(item.ids)
            stats.rejected += len(rejections)
            if isinstance(prep_ms, (int, float)):
                stats.prep_ms_total += float(prep_ms)
            # Time the prepared batch waited for its credit: high when the trainer is the limit.
            stats.credit_wait_ms_total += max(0.0, lease.credited_t - lease.ready_t) * 1e3
            stats.cache_hits += count("hits")
            stats.cache_computed += count("computed")
            stats.cache_stale += count("stale")
            stats.cache_corrupt += count("corrupt")
        if rejections:
            for r in rejections:
                log.warning("producer %s rejected %s: %s", peer.name, r.id, r.reason)
            self.on_rejected(rejections)
        self._assign(peer)

    def _on_hello(self, identity: bytes, msg: wire.Message, now: float) -> None:
        wire.require(msg, producer=str, host=str, pid=int)
        old = self._peers.get(identity)
        if old is not None:  # reconnected with the same identity: it dropped its work
            self._drop_peer(old, "alive")
        name = msg["producer"][:200]
        peer = Peer(identity, name, msg["host"][:200], msg["pid"], len(self._peers), now)
        self._peers[identity] = peer
        with self._lock:
            stats = self.producers.setdefault(name, ProducerStats(id=name, host=peer.host))
            stats.status = "alive"
            stats.host = peer.host
            stats.connections += 1
        log.info("producer %s joined from %s (pid %d)", name, peer.host, peer.pid)
        self._send(identity, wire.WELCOME, {
            "producer_index": peer.index,
            "features": dataclasses.asdict(self.cfg.features),
            "batch_size": self.cfg.batching.batch_size,
            "metadata_file": self.cfg.data.metadata_file,
            "metadata_sha256": self.metadata_sha256,
            "feature_cache": self.cfg.data.feature_cache,
            "heartbeat_interval_s": self.cfg.pipeline.heartbeat_interval_s,
            "heartbeat_timeout_s": self.cfg.pipeline.heartbeat_timeout_s,
            "faults": dataclasses.asdict(self.cfg.faults),
        })
        self._assign(peer)

    def _on_message(self, frames: list[Any], now: float) -> None:
        if len(frames) < 2:
            self._count("frame_count")
            return
        identity = bytes(frames[0].bytes if hasattr(frames[0], "bytes") else frames[0])
        try:
            msg = wire.decode(frames[1:], max_bytes=self._max_bytes)
        except wire.ProtocolError as exc:
            self._count(exc.reason, exc.detail)
            return
        try:
            if msg.kind == wire.HELLO:
                self._on_hello(identity, msg, now)
                return
            peer = self._peers.get(identity)
            if peer is None:
                self._count("unknown_peer", msg.kind)
                return
            peer.last_seen = now
            if msg.kind == wire.BATCH:
                self._on_batch(peer, msg, now)
            elif msg.kind == wire.READY:
                wire.require(msg, lease=int)
                lease = self._leases.get(msg["lease"])
                if lease is None or lease.identity != identity or lease.state != "working":
                    self._count("unknown_lease", "ready")
                    return
                lease.state = "ready"
                lease.ready_t = now
                self._grant()
            elif msg.kind == wire.HEARTBEAT:
                pass
            elif msg.kind == wire.ERROR:
                text = f"{msg.get('type')}: {msg.get('message')} (in {msg.get('where')})"[:1000]
                log.error("producer %s reported %s", peer.name, text)
                with self._lock:
                    self.producers[peer.name].last_error = text
                if msg.get("fatal"):
                    self._drop_peer(peer, "crashed")
            elif msg.kind == wire.BYE:
                log.info("producer %s left, returning %d leases", peer.name, len(peer.leases))
                self._drop_peer(peer, "left")
            else:
                self._count("unexpected_kind", msg.kind)
        except wire.ProtocolError as exc:
            self._count(exc.reason, exc.detail)

    def _housekeeping(self, now: float) -> None:
        timeout = self.cfg.pipeline.heartbeat_timeout_s
        for peer in list(self._peers.values()):
            if now - peer.last_seen > timeout:
                log.warning("producer %s silent for %.1f s: presumed dead, re-planning its %d leases",
                            peer.name, now - peer.last_seen, len(peer.leases))
                self._drop_peer(peer, "dead")
        stale = [lease.id for lease in self._leases.values()
                 if lease.state == "credited" and now - lease.credited_t > timeout]
        if stale:
            log.warning("%d credited batches not delivered within %.1f s; re-planning them", len(stale), timeout)
            self._release(stale)
            self._assign_all()
        self._grant()

    def _run_guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # the trainer sees it via .failure and stops with the error
            self.failure = exc
            log.exception("coordinator failed")
            self.stop.set()

    def _run(self) -> None:
        router = self._router
        assert router is not None
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        interval = self.cfg.pipeline.heartbeat_interval_s
        last_beat = last_housekeeping = time.monotonic()
        try:
            while not self.stop.is_set():
                events = dict(poller.poll(POLL_INTERVAL_MS))
                now = time.monotonic()
                if self._wake in events:
                    while True:
                        try:
                            self._wake.recv(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                    self._grant()
                if router in events:
                    for _ in range(64):  # bounded burst, then heartbeats get their turn
                        try:
                            frames = router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_message(frames, now)
                if now - last_beat >= interval:
                    for identity in list(self._peers):
                        self._send(identity, wire.HEARTBEAT, {})
                    last_beat = now
                if now - last_housekeeping >= POLL_INTERVAL_MS / 1000:
                    self._housekeeping(now)
                    last_housekeeping = now
        finally:
            for identity in list(self._peers):
                self._send(identity, wire.STOP, {"reason": "run over"})
            router.close(linger=STOP_LINGER_MS)
            self._wake.close()
            with self._lock:
                for stats in self.producers.values():
                    if stats.status == "alive":
                        stats.status = "stopped"
