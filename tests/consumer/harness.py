"""A real Coordinator on a ROUTER socket, and scripted producers on DEALER sockets."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import zmq

from stoker.consumer.buffer import BatchQueue
from stoker.consumer.coordinator.coordinator import Coordinator
from stoker.consumer.plan import EpochPlanner
from stoker.shared import wire
from stoker.shared.config import Config, PipelineConfig
from stoker.shared.dataset.types import Sample
from tests.factories import make_batch

RECV_TIMEOUT_MS = 5000
# The socket tests' scripted producers send no heartbeats: a heartbeat timeout no such test
# reaches keeps a slow host from presuming one dead mid-test. Liveness itself is tested on the
# scheduler's virtual clock (test_scheduler.py, test_peers.py).
QUIET_TIMEOUT_S = 3600.0


def samples(n: int = 12) -> list[Sample]:
    return [Sample(f"S{i:03d}", "text", 5 + i % 4, 20 + i, 0.5) for i in range(n)]


def hello_of(name: str, host: str = "test", **fields: Any) -> wire.Hello:
    """A scripted producer's HELLO: this install's config schema unless given, no dataset unless given."""
    fields.setdefault("config", wire.ConfigSchema.local())
    return wire.Hello(producer=name, host=host, pid=1, **fields)


def lacking(section: str, key: str) -> wire.ConfigSchema:
    """This install's config schema without ``section.key``: a producer of a stoker version before it."""
    local = wire.ConfigSchema.local()
    return wire.ConfigSchema(local.version, {**local.sections,
                                             section: tuple(k for k in local.sections[section] if k != key)})


def make_config(**pipeline) -> Config:
    cfg = Config()
    base = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0, lease_ahead=2, buffer_size=3)
    base.update(pipeline)
    return dataclasses.replace(
        cfg, pipeline=dataclasses.replace(PipelineConfig(), **base),
        batching=dataclasses.replace(cfg.batching, batch_size=4, num_buckets=2),
        features=dataclasses.replace(cfg.features, n_mels=8))


def socket_config(**pipeline) -> Config:
    """make_config for a test on real sockets: nobody is presumed dead for being silent."""
    return make_config(**{"heartbeat_timeout_s": QUIET_TIMEOUT_S, **pipeline})


class Harness:
    def __init__(self, cfg: Config, n: int = 12, max_epochs: int | None = None, **coordinator_kwargs) -> None:
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.stop = threading.Event()
        self.queue = BatchQueue(cfg.pipeline.buffer_size)
        self.planner = EpochPlanner(samples(n), cfg.batching)
        self.rejected: list = []
        self.coord = Coordinator(cfg, self.planner, self.queue, self.stop, max_epochs=max_epochs, context=self.ctx,
                                 on_rejected=self.rejected.extend, **coordinator_kwargs)
        self.queue.on_free = self.coord.notify_free
        self.endpoint = self.coord.bind("tcp://127.0.0.1:*")
        self.coord.start()
        self.peers: list[zmq.Socket] = []

    def socket(self, **options) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.rcvtimeo = RECV_TIMEOUT_MS
        sock.sndtimeo = RECV_TIMEOUT_MS  # a socket with no peer to queue on (its handshake failed) must not hang
        for key, value in options.items():
            setattr(sock, key, value)
        sock.connect(self.endpoint)
        self.peers.append(sock)
        return sock

    def producer(self, name: str = "fake", sock: zmq.Socket | None = None, **hello) -> zmq.Socket:
        sock = sock or self.socket()
        sock.send_multipart(hello_of(name, **hello).encode())
        return sock

    def recv(self, sock: zmq.Socket, kind: str, skip: tuple[str, ...] = (wire.HEARTBEAT,)) -> Any:
        """Next message of ``kind`` (shared/wire.py's class of it), skipping heartbeats (and the
        kinds in ``skip``)."""
        while True:
            msg, _ = wire.read(sock.recv_multipart())
            if msg.KIND == kind:
                return msg
            assert msg.KIND in skip, f"expected {kind}, got {msg.KIND}"

    def credit(self, sock: zmq.Socket, lease: wire.Lease,
               skip: tuple[str, ...] = (wire.HEARTBEAT,)) -> wire.Credit:
        """Say the lease's batch is READY and wait for its CREDIT."""
        sock.send_multipart(wire.Ready(lease.lease).encode())
        return self.recv(sock, wire.CREDIT, skip=skip)

    def batch_frames(self, lease: wire.Lease) -> list:
        max_tokens, max_frames = lease.shape
        ids = lease.ids
        rows = lease.rows if self.planner.fixed_rows else len(ids)  # as a producer collates
        arrays = make_batch(rows, max_tokens, max_frames, self.cfg.features.n_mels, valid=len(ids))
        return wire.Batch(lease.lease, lease.epoch, lease.index, ids, prep_ms=1.0).encode(arrays)

    def close(self) -> None:
        for sock in self.peers:  # first, so the coordinator need not wait for their BYEs
            sock.close()
        self.stop.set()
        self.coord.join(5)
        self.coord.close_notifier()
        self.queue.close()
        self.ctx.term()
