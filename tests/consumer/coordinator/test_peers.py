"""A producer's liveness as the scheduler keeps it (consumer/coordinator/peers.py), on a virtual
clock: the decisions that depend on time, at the exact instants they must happen. The
end-to-end tests with real processes (tests/test_remote.py) assert what happened and in
which order; how soon is asserted here, where time is the number each event carries."""

from __future__ import annotations

import collections

import pytest

from stoker.consumer.coordinator.peers import DISCONNECT_GRACE_S
from stoker.shared import wire
from tests.consumer.coordinator.scheduler_bench import IDS, Bench

# Far above DISCONNECT_GRACE_S: a closed connection, not the silence, must be what ends a producer.
HEARTBEAT_TIMEOUT_S = 10.0


def test_a_producer_joining_mid_epoch_is_leased_work_with_its_welcome() -> None:
    """Its first leases answer its HELLO at the same instant: it waits for no tick and no epoch end."""
    b = Bench(max_epochs=2, lease_ahead=2)
    b.hello(b"first")
    b.tick(0.1)
    b.work(b"first")
    trained = b.drain_queue()
    assert 0 < len(trained) < len(IDS)  # mid-epoch
    b.tick(0.1)
    b.hello(b"joining")
    assert [m.producer_name for m in b.take(b"joining", wire.WELCOME)] == ["joining"]
    assert len(b.take(b"joining", wire.LEASE)) == 2  # lease_ahead, with no time passed
    stats = {p["id"]: p for p in b.scheduler.snapshot()["producers"]}
    assert stats["joining"]["first_lease_ms"] == 0.0


def test_a_closed_connection_moves_the_work_after_the_grace_long_before_the_heartbeat_timeout() -> None:
    b = Bench(lease_ahead=2, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    b.hello(b"victim", fd=7)
    held = {i for m in b.take(b"victim", wire.LEASE) for i in m.ids}
    b.hello(b"survivor", fd=8)
    b.tick(0.2)
    b.scheduler.on_connection_closed(7, b.now)  # its process died: the kernel closed the connection
    b.tick(DISCONNECT_GRACE_S - 0.01)
    assert {p["id"]: p["status"] for p in b.scheduler.snapshot()["producers"]} == {"victim": "alive",
                                                                                  "survivor": "alive"}
    b.tick(0.02)  # the grace is over: dead, 0.71 s after it last spoke, not after the 10 s of silence
    failover, = b.scheduler.snapshot()["failovers"]
    assert (failover["producer"], failover["status"], failover["leases"]) == ("victim", "dead", 2)
    assert failover["silent_s"] == pytest.approx(0.2 + DISCONNECT_GRACE_S + 0.01)
    trained = []
    for _ in range(20):
        b.work(b"survivor")
        trained += b.drain_queue()
    assert collections.Counter(trained) == collections.Counter(IDS)  # its work moved, nothing twice
    assert held <= set(trained)
    assert b.scheduler.snapshot()["failovers"][0]["reissued"] == 2  # both its batches leased to the survivor
