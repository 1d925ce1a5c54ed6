"""The coordinator against a scripted producer on a real DEALER socket."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from stoker.shared import wire
from tests.consumer.harness import make_config
from tests.factories import make_batch

pytestmark = pytest.mark.timeout(60)

def test_hello_welcome_and_leases(harness):
    h = harness(cfg=make_config())
    sock = h.producer()
    welcome = h.recv(sock, wire.WELCOME)
    assert welcome["features"]["n_mels"] == 8
    leases = [h.recv(sock, wire.LEASE) for _ in range(2)]  # lease_ahead
    assert len({m["lease"] for m in leases}) == 2
    for m in leases:
        assert 1 <= len(m["ids"]) <= 4 and len(m["shape"]) == 2


def test_credits_never_exceed_free_slots_and_batches_reach_queue(harness):
    cfg = make_config(lease_ahead=6, buffer_size=2)
    h = harness(cfg=cfg)
    sock = h.producer()
    h.recv(sock, wire.WELCOME)
    leases = [h.recv(sock, wire.LEASE) for _ in range(6)]
    for m in leases:
        sock.send_multipart(wire.encode(wire.READY, {"lease": m["lease"]}))
    credits = [h.recv(sock, wire.CREDIT) for _ in range(2)]
    # The queue holds 2: no third credit may come while both are outstanding.
    assert sock.poll(500) == 0 or wire.decode(sock.recv_multipart()).kind == wire.HEARTBEAT
    by_id = {m["lease"]: m for m in leases}
    for c in credits:
        sock.send_multipart(h.batch_frames(by_id[c["lease"]]), copy=False)
    first = None
    deadline = time.monotonic() + 5
    while first is None and time.monotonic() < deadline:
        first = h.queue.get(0.5)
    assert first is not None
    item, depth = first
    assert item.producer == "fake" and item.arrays["mel"].shape[2] == 8
    # Taking one frees a slot: exactly one more credit follows.
    third = h.recv(sock, wire.CREDIT, skip=(wire.HEARTBEAT, wire.LEASE))
    assert third["lease"] not in {c["lease"] for c in credits}
    assert len(h.queue) <= 2


def test_late_duplicate_and_uncredited_batches_are_dropped(harness):
    h = harness(cfg=make_config())
    sock = h.producer()
    h.recv(sock, wire.WELCOME)
    lease = h.recv(sock, wire.LEASE)
    frames = h.batch_frames(lease)
    sock.send_multipart(frames)  # no credit yet: dropped
    h.credit(sock, lease, skip=(wire.HEARTBEAT, wire.LEASE))
    sock.send_multipart(h.batch_frames(lease))
    sock.send_multipart(h.batch_frames(lease))  # duplicate of a delivered lease
    got = h.queue.get(5)
    assert got is not None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and h.coord.snapshot()["rejected_messages"].get("unknown_lease", 0) < 1:
        h.queue.wait_for_depth(99, 0.05)
    dropped = h.coord.snapshot()["rejected_messages"]
    assert dropped.get("uncredited") == 1
    assert dropped.get("unknown_lease") == 1
    assert len(h.queue) == 0


def test_batch_not_matching_its_lease_is_dropped_and_replanned(harness):
    h = harness(cfg=make_config(lease_ahead=1))
    sock = h.producer()
    h.recv(sock, wire.WELCOME)
    lease = h.recv(sock, wire.LEASE)
    h.credit(sock, lease)
    max_tokens, max_frames = lease["shape"]
    wrong = make_batch(4, max_tokens, max_frames + 16, 8, valid=len(lease["ids"]))
    sock.send_multipart(wire.encode(wire.BATCH, {"lease": lease["lease"], "ids": lease["ids"], "rejected": []},
                                    wrong))
    again = h.recv(sock, wire.LEASE)
    assert again["ids"] == lease["ids"] and again["lease"] != lease["lease"]
    assert h.coord.snapshot()["rejected_messages"]["bad_batch"] == 1


def test_garbage_messages_are_counted_never_fatal(harness):
    h = harness(cfg=make_config())
    attacker = h.ctx.socket(zmq.DEALER)
    attacker.linger = 0
    attacker.connect(h.endpoint)
    h.peers.append(attacker)
    rng = np.random.default_rng(0)
    for i in range(300):
        attacker.send_multipart([rng.bytes(int(rng.integers(0, 64))) for _ in range(int(rng.integers(1, 4)))])
    attacker.send_multipart(wire.encode(wire.BATCH, {"lease": 1, "ids": [], "rejected": []}))  # not a peer
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


def test_silent_producer_loses_its_leases_to_another(harness):
    h = harness(cfg=make_config(lease_ahead=2))
    silent = h.producer("silent")
    h.recv(silent, wire.WELCOME)
    silent_leases = [h.recv(silent, wire.LEASE) for _ in range(2)]
    taken = {m["lease"] for m in silent_leases}
    silent_ids = [m["ids"] for m in silent_leases]
    survivor = h.producer("survivor")
    h.recv(survivor, wire.WELCOME)
    first = [h.recv(survivor, wire.LEASE) for _ in range(2)]
    # Keep the survivor alive with heartbeats; the silent one says nothing past the timeout.
    def status_of(name: str) -> str:
        return {p["id"]: p for p in h.coord.snapshot()["producers"]}[name]["status"]

    deadline = time.monotonic() + 5
    while status_of("silent") != "dead" and time.monotonic() < deadline:
        survivor.send_multipart(wire.encode(wire.HEARTBEAT, {"ready": 0, "working": 2}))
        if survivor.poll(100):
            msg = wire.decode(survivor.recv_multipart())
            assert msg.kind == wire.HEARTBEAT  # no new work while its two leases are held
    # Delivering one lease frees a slot: the next lease is a re-planned batch of the dead one.
    lease = first[0]
    h.credit(survivor, lease)
    survivor.send_multipart(h.batch_frames(lease))
    replanned = h.recv(survivor, wire.LEASE)
    assert replanned["lease"] not in taken
    assert replanned["ids"] in silent_ids
    stats = {p["id"]: p for p in h.coord.snapshot()["producers"]}
    assert stats["silent"]["status"] == "dead"
    assert h.coord.snapshot()["reissued_leases"] == 2
    assert {m["lease"] for m in first}.isdisjoint(taken)


def test_bye_returns_leases_at_once(harness):
    h = harness(cfg=make_config(lease_ahead=2))
    leaving = h.producer("leaving")
    h.recv(leaving, wire.WELCOME)
    ids = [tuple(h.recv(leaving, wire.LEASE)["ids"]) for _ in range(2)]
    leaving.send_multipart(wire.encode(wire.BYE, {"leases": []}))
    other = h.producer("other")
    h.recv(other, wire.WELCOME)
    got = [tuple(h.recv(other, wire.LEASE)["ids"]) for _ in range(2)]
    assert got == ids  # the returned batches come first, in plan order
    stats = {p["id"]: p for p in h.coord.snapshot()["producers"]}
    assert stats["leaving"]["status"] == "left"


def test_batch_with_non_string_ids_is_dropped_not_fatal(harness):
    h = harness(cfg=make_config(lease_ahead=1))
    sock = h.producer()
    h.recv(sock, wire.WELCOME)
    lease = h.recv(sock, wire.LEASE)
    h.credit(sock, lease)
    max_tokens, max_frames = lease["shape"]
    arrays = make_batch(4, max_tokens, max_frames, 8, valid=len(lease["ids"]))
    sock.send_multipart(wire.encode(wire.BATCH, {"lease": lease["lease"], "ids": [[1]] * len(lease["ids"]),
                                                 "rejected": [{"id": [2]}]}, arrays))
    again = h.recv(sock, wire.LEASE)
    assert again["ids"] == lease["ids"]
    assert h.coord.failure is None
    assert h.coord.snapshot()["rejected_messages"]["bad_batch"] == 1
