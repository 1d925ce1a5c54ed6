"""The coordinator's router against scripted producers on real DEALER sockets: what only a
socket shows (frames in, messages out, garbage on the wire). The scheduling itself is tested
without sockets in test_scheduler.py."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from stoker.shared import wire
from tests.consumer.harness import socket_config
from tests.factories import make_batch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

def test_hello_welcome_and_leases(harness):
    h = harness(cfg=socket_config())
    sock = h.producer()
    welcome = h.recv(sock, wire.WELCOME)
    assert welcome.config.features.n_mels == 8
    leases = [h.recv(sock, wire.LEASE) for _ in range(2)]  # lease_ahead
    assert len({m.lease for m in leases}) == 2
    for m in leases:
        assert 1 <= len(m.ids) <= 4 and len(m.shape) == 2


def test_garbage_messages_are_counted_never_fatal(harness):
    h = harness(cfg=socket_config())
    attacker = h.ctx.socket(zmq.DEALER)
    attacker.linger = 0
    attacker.connect(h.endpoint)
    h.peers.append(attacker)
    rng = np.random.default_rng(0)
    for i in range(300):
        attacker.send_multipart([rng.bytes(int(rng.integers(0, 64))) for _ in range(int(rng.integers(1, 4)))])
    attacker.send_multipart(wire.Batch(1, 0, 0, ()).encode())  # not a peer
    sock = h.producer("honest")
    h.recv(sock, wire.WELCOME)
    h.recv(sock, wire.LEASE)
    # ROUTER queues fairly between peers: the attacker's backlog may still be in flight.
    deadline = time.monotonic() + 10
    while sum(h.coord.snapshot()["rejected_messages"].values()) < 301 and time.monotonic() < deadline:
        h.queue.wait_for_depth(99, 0.05)
    dropped = h.coord.snapshot()["rejected_messages"]
    assert sum(dropped.values()) == 301
    assert dropped["unknown_peer"] == 1
    assert h.coord.failure is None


def test_bye_returns_leases_at_once(harness):
    h = harness(cfg=socket_config(lease_ahead=2))
    leaving = h.producer("leaving")
    h.recv(leaving, wire.WELCOME)
    ids = [tuple(h.recv(leaving, wire.LEASE).ids) for _ in range(2)]
    leaving.send_multipart(wire.Bye().encode())
    other = h.producer("other")
    h.recv(other, wire.WELCOME)
    got = [tuple(h.recv(other, wire.LEASE).ids) for _ in range(2)]
    assert got == ids  # the returned batches come first, in plan order
    stats = {p["id"]: p for p in h.coord.snapshot()["producers"]}
    assert stats["leaving"]["status"] == "left"


def test_batch_with_non_string_ids_is_dropped_not_fatal(harness):
    h = harness(cfg=socket_config(lease_ahead=1))
    sock = h.producer()
    h.recv(sock, wire.WELCOME)
    lease = h.recv(sock, wire.LEASE)
    h.credit(sock, lease)
    max_tokens, max_frames = lease.shape
    arrays = make_batch(4, max_tokens, max_frames, 8, valid=len(lease.ids))
    sock.send_multipart(wire.encode(wire.BATCH, {"lease": lease.lease, "ids": [[1]] * len(lease.ids),
                                                 "rejected": [{"id": [2]}]}, arrays))
    again = h.recv(sock, wire.LEASE)
    assert again.ids == lease.ids
    assert h.coord.failure is None
    assert h.coord.snapshot()["rejected_messages"]["bad_batch"] == 1
