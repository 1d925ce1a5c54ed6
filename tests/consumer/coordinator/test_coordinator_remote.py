"""The coordinator with producers on other hosts: agreement, misses, liveness, restarts, CURVE.

Scripted producers on real DEALER sockets, as in test_coordinator.py; a small loop
(:class:`Sim`) plays any number of them and the trainer until an epoch is accounted for.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from stoker.producer.worker import Producer
from stoker.shared import wire
from stoker.shared.keys import load_client_keys, load_server_keys, make_keys
from tests.consumer.harness import Harness, hello_of, lacking, samples, socket_config
from tests.factories import copy_described, fake_reference, make_dataset

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

IDS = [s.id for s in samples(12)]
# Every wait in these tests ends by this deadline; a healthy run needs a fraction of it.
DEADLINE_S = 15.0


def snapshot_until(h: Harness, check, what: str) -> dict:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        snap = h.coord.snapshot()
        if check(snap):
            return snap
        h.queue.wait_for_depth(99, 0.05)
    raise AssertionError(f"timed out waiting for {what}: {h.coord.snapshot()}")


class Sim:
    """Scripted producers that prepare every lease at once, plus a trainer taking every batch.

    ``missing[name]`` are ids that producer does not have at run time: it reports them as
    missed. ``leases[name]`` records every LEASE each producer got.
    """

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.socks: dict[str, zmq.Socket] = {}
        self.missing: dict[str, set[str]] = {}
        self.leases: dict[str, list[wire.Lease]] = collections.defaultdict(list)
        self.held: dict[str, dict[int, wire.Lease]] = collections.defaultdict(dict)
        self.trained: list[tuple[int, str, list[str]]] = []  # (epoch, producer, ids)
        self.paused: set[str] = set()  # these record their leases but prepare nothing yet
        self.poller = zmq.Poller()

    def join(self, name: str, missing: set[str] = frozenset(), **hello) -> zmq.Socket:
        """A producer says HELLO and is welcomed before anything else happens: otherwise the
        coordinator may handle another producer's batch first (and, say, reject a clip that
        every producer it knows so far lacks)."""
        sock = self.h.producer(name, **hello)
        self.h.recv(sock, wire.WELCOME)
        self.socks[name] = sock
        self.missing[name] = set(missing)
        self.poller.register(sock, zmq.POLLIN)
        return sock

    def _serve(self, name: str, msg: wire.Body) -> None:
        sock = self.socks[name]
        if isinstance(msg, wire.Lease):
            self.leases[name].append(msg)
            self.held[name][msg.lease] = msg
            if name not in self.paused:
                sock.send_multipart(wire.Ready(msg.lease).encode())
        elif isinstance(msg, wire.Credit):
            lease = self.held[name].pop(msg.lease)
            have = tuple(i for i in lease.ids if i not in self.missing[name])
            missed = tuple(wire.Entry(i, f"audio file missing: {i}.wav on host {name}-host")
                           for i in lease.ids if i in self.missing[name])
            batch, arrays = wire.read(self.h.batch_frames(dataclasses.replace(lease, ids=have)))
            sock.send_multipart(dataclasses.replace(batch, missed=missed).encode(arrays))

    def resume(self, name: str) -> None:
        self.paused.discard(name)
        for lease_id in self.held[name]:
            self.socks[name].send_multipart(wire.Ready(lease_id).encode())

    def step(self, timeout_ms: int = 50) -> None:
        for sock, _ in self.poller.poll(timeout_ms):
            name = next(n for n, s in self.socks.items() if s is sock)
            while sock.poll(0):
                self._serve(name, wire.read(sock.recv_multipart())[0])
        got = self.h.queue.get(0.0)
        if got is not None:
            item, _ = got
            self.trained.append((item.epoch, item.producer, item.ids))

    def run_until(self, done, what: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out: {what}; trained {self.trained}, rejected {self.h.rejected}")
            self.step()

    def trained_ids(self, epoch: int = 0) -> collections.Counter:
        return collections.Counter(i for e, _, ids in self.trained if e == epoch for i in ids)

    def accounted(self, epoch: int = 0) -> int:
        return sum(self.trained_ids(epoch).values()) + self.h.coord.rejected_in_epoch(epoch)


# ---------------------------------------------------------------- agreement
def test_a_producer_without_a_dataset_description_is_refused(harness):
    h = harness(cfg=socket_config(), dataset=fake_reference())
    sock = h.producer("old")  # no dataset description
    assert "did not describe its dataset" in h.recv(sock, wire.REFUSE).reason


def _warnings(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING]


def test_a_producer_of_the_previous_protocol_version_is_refused_at_joining_with_one_line(harness, caplog):
    """A scripted DEALER saying HELLO as a version-3 producer does: it gets a REFUSE it can read."""
    h = harness(cfg=socket_config())
    sock = h.socket()
    old = wire.PROTOCOL_VERSION - 1
    with caplog.at_level(logging.WARNING):
        sock.send_multipart([msgpack.packb({"v": old, "k": "hello", "a": [], "producer": "p0@old", "host": "old",
                                            "pid": 1, "launcher": 1, "session": "s", "dataset": {}})])
        frames = sock.recv_multipart()
    header = msgpack.unpackb(frames[0], raw=False)
    assert (header["v"], header["k"], header["a"], len(frames)) == (old, "refuse", [], 1)
    assert f"protocol version {old} and the trainer {wire.PROTOCOL_VERSION}" in header["reason"]
    assert h.coord.snapshot()["refused_producers"] == [{"producer": "p0@old", "host": "old",
                                                        "reason": header["reason"]}]
    lines = [line for line in _warnings(caplog, "consumer.coordinator") if "refused" in line]
    assert lines == [f"refused producer p0@old from old: {header['reason']}"]


def test_a_producer_lacking_a_config_key_is_refused_at_joining_with_one_line_on_both_sides(harness, tmp_path, caplog):
    """A real producer whose config schema lacks a key the trainer sends (a stoker version before it)."""
    h = harness(cfg=socket_config())
    make_dataset(tmp_path / "data", count=2)
    stop = threading.Event()
    producer = Producer(h.endpoint, tmp_path / "data", "p-old", stop, context=h.ctx,
                        config_schema=lacking("features", "top_db"))
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", producer.run()), daemon=True)
    with caplog.at_level(logging.WARNING):
        thread.start()
        thread.join(20)
    stop.set()
    thread.join(5)
    assert result.get("code") == 2
    reason = h.coord.snapshot()["refused_producers"][0]["reason"]
    assert "it lacks the config keys features.top_db" in reason
    assert _warnings(caplog, "producer") == [f"the trainer at {h.endpoint} refused this producer: {reason}"]
    assert [line for line in _warnings(caplog, "consumer.coordinator") if "refused" in line] == [
        f"refused producer p-old from {producer.host}: {reason}"]


def test_clips_a_remote_copy_lacks_go_to_another_and_are_never_leased_to_it_again(harness):
    h = harness(cfg=socket_config(lease_ahead=2), max_epochs=2, dataset=fake_reference())
    sim = Sim(h)
    lacking = {IDS[0], IDS[5], IDS[7]}
    sim.join("full", dataset=copy_described())
    sim.join("partial", lacking, dataset=copy_described())  # its copy's metadata is the trainer's, not its audio
    sim.run_until(lambda: sim.accounted(0) == len(IDS) and sim.accounted(1) == len(IDS), "two epochs")
    assert sim.leases["partial"], "the partial copy got work too"
    assert all(sum(i in lease.ids for lease in sim.leases["partial"]) <= 1 for i in lacking)  # missed once at most
    assert sim.trained_ids(0) == sim.trained_ids(1) == collections.Counter(IDS)  # exactly once
    stats = {p["id"]: p for p in h.coord.snapshot()["producers"]}
    assert stats["partial"]["lacks"] == stats["partial"]["misses"] <= 3 and h.rejected == []


# ---------------------------------------------------------------- misses
def test_a_missed_clip_is_replanned_onto_another_producer_in_its_shape(harness):
    h = harness(cfg=socket_config(lease_ahead=4), max_epochs=1)
    sim = Sim(h)
    sim.paused.add("a")
    sim.join("a", missing={IDS[5]})
    sim.run_until(lambda: len(sim.leases["a"]) == h.planner.batches_per_epoch, "a holding the whole epoch")
    original = next(lease for lease in sim.leases["a"] if IDS[5] in lease.ids)
    sim.join("b")
    sim.resume("a")
    sim.run_until(lambda: sim.accounted() == len(IDS), "an epoch")
    assert [lease.ids for lease in sim.leases["b"]] == [(IDS[5],)]
    replanned = sim.leases["b"][0]
    assert (replanned.epoch, replanned.shape) == (original.epoch, original.shape)
    assert sim.trained_ids() == collections.Counter(IDS)
    stats = {p["id"]: p for p in h.coord.snapshot()["producers"]}
    assert stats["a"]["misses"] == 1 and h.coord.snapshot()["missed_samples"] == 1
    assert h.rejected == []


def test_a_clip_no_live_producer_has_is_rejected_with_the_hosts(harness):
    h = harness(cfg=socket_config(lease_ahead=2), max_epochs=1)
    sim = Sim(h)
    sim.join("a", missing={IDS[3]})
    sim.run_until(lambda: sim.accounted() == len(IDS), "an epoch")
    assert [(r.id, r.producer) for r in h.rejected] == [(IDS[3], "coordinator")]
    assert "missing on every producer host (test)" in h.rejected[0].reason
    assert h.coord.rejected_in_epoch(0) == 1
    assert sim.trained_ids() == collections.Counter(set(IDS) - {IDS[3]})


def test_a_clip_nobody_alive_has_waits_for_a_producer_that_has_it(harness):
    # Its lease slots as many as the epoch's batches (3): full, so it never looks for work it lacks.
    h = harness(cfg=socket_config(lease_ahead=3), max_epochs=1, dataset=fake_reference())
    sim = Sim(h)
    sim.paused.add("partial")
    sim.join("partial", {IDS[3]}, dataset=copy_described())
    sim.run_until(lambda: len(sim.leases["partial"]) == h.planner.batches_per_epoch, "the partial copy's leases")
    sim.socks["partial"].send_multipart(wire.Bye().encode())
    snapshot_until(h, lambda s: s["producers"][0]["status"] == "left", "it to leave")
    assert h.rejected == []  # nobody alive: nothing is rejected, the work waits
    sim.join("full", dataset=copy_described())
    sim.run_until(lambda: sim.accounted() == len(IDS), "the full copy to train the epoch")
    assert sim.trained_ids() == collections.Counter(IDS) and h.rejected == []


# ---------------------------------------------------------------- liveness
def test_ping_is_answered_with_pong_and_rtt_is_kept(harness):
    h = harness(cfg=socket_config())
    sock = h.producer("p")
    h.recv(sock, wire.WELCOME)
    sock.send_multipart(wire.Heartbeat(ready=0, working=0, ping=12.5, rtt_ms=0.75).encode())
    beat = h.recv(sock, wire.HEARTBEAT, skip=(wire.LEASE,))
    while beat.pong is None:  # the coordinator's own beats carry no pong
        beat = h.recv(sock, wire.HEARTBEAT, skip=(wire.LEASE,))
    assert beat.pong == 12.5
    snapshot_until(h, lambda s: s["producers"][0]["rtt_ms"] == 0.75, "rtt")


def test_an_unknown_producer_is_told_to_say_hello_again(harness):
    h = harness(cfg=socket_config())
    sock = h.socket()
    sock.send_multipart(wire.Heartbeat(ready=0, working=0).encode())
    refuse = h.recv(sock, wire.REFUSE)
    assert refuse.rejoin is True
    assert h.coord.snapshot()["rejected_messages"]["unknown_peer"] == 1


def test_a_lease_not_prepared_in_time_is_revoked_and_replanned(harness):
    h = harness(cfg=socket_config(lease_ahead=1, lease_timeout_s=0.5))
    sock = h.producer("slow")
    h.recv(sock, wire.WELCOME)
    lease = h.recv(sock, wire.LEASE)
    revoke = h.recv(sock, wire.REVOKE)
    assert revoke.lease == lease.lease
    again = h.recv(sock, wire.LEASE)
    assert again.ids == lease.ids and again.lease != lease.lease


def test_a_restarted_producer_takes_over_the_old_ones_leases_at_once(harness):
    h = harness(cfg=socket_config(lease_ahead=2))
    old = h.producer("p0@h", launcher=42)
    h.recv(old, wire.WELCOME)
    ids = sorted(tuple(h.recv(old, wire.LEASE).ids) for _ in range(2))
    new = h.producer("p0@h", launcher=42)
    h.recv(new, wire.WELCOME)
    assert sorted(tuple(h.recv(new, wire.LEASE).ids) for _ in range(2)) == ids
    snap = snapshot_until(h, lambda s: s["failovers"] and s["failovers"][0]["reissued"] == 2, "the re-issue")
    assert [p["id"] for p in snap["producers"]] == ["p0@h"]
    assert snap["producers"][0]["connections"] == 2
    assert snap["failovers"][0]["status"] == "restarted"
    other = h.producer("p0@h", launcher=7)  # another launcher on a host with the same name
    assert h.recv(other, wire.WELCOME).producer_name == "p0@h#2"


def test_stop_waits_for_the_producers_bye(harness):
    h = harness(cfg=socket_config())
    sock = h.producer("p")
    h.recv(sock, wire.WELCOME)
    h.stop.set()
    h.recv(sock, wire.STOP, skip=(wire.HEARTBEAT, wire.LEASE))
    assert h.coord._thread.is_alive()  # still waiting for the BYE
    sock.send_multipart(wire.Bye().encode())
    h.coord.join(5)
    assert not h.coord._thread.is_alive()


# ---------------------------------------------------------------- hostile connections
def test_an_oversized_frame_closes_that_connection_only(harness):
    h = harness(cfg=socket_config(max_message_mb=1))
    honest = h.producer("honest")
    h.recv(honest, wire.WELCOME)
    attacker = h.socket()
    attacker.send(b"x" * (2 << 20))
    snapshot_until(h, lambda s: s["rejected_messages"].get("connection_dropped", 0) >= 1, "the drop")
    honest.send_multipart(wire.Heartbeat(ready=0, working=0, ping=1.0).encode())
    assert h.recv(honest, wire.HEARTBEAT, skip=(wire.LEASE,)) is not None
    assert h.coord.failure is None


# ---------------------------------------------------------------- CURVE
@pytest.fixture
def keys(tmp_path: Path) -> Path:
    make_keys(tmp_path / "keys", ["client"])
    make_keys(tmp_path / "stranger", ["client"])  # a pair the trainer does not know
    return tmp_path


def test_curve_admits_allowed_keys_only(harness, keys: Path):
    h = harness(cfg=socket_config(), keys=load_server_keys(keys / "keys"))
    allowed = load_client_keys(keys / "keys")
    stranger = load_client_keys(keys / "stranger")
    intruder = h.socket(curve_secretkey=stranger.secret, curve_publickey=stranger.public,
                        curve_serverkey=allowed.server_public)
    plain = h.socket()
    for name, sock in (("intruder", intruder), ("plain", plain)):
        try:
            sock.send_multipart(hello_of(name).encode(), flags=zmq.NOBLOCK)
        except zmq.Again:  # its handshake failed before the HELLO was queued: no pipe to send on
            pass
    good = h.socket(curve_secretkey=allowed.secret, curve_publickey=allowed.public,
                    curve_serverkey=allowed.server_public)
    h.producer("good", sock=good)
    assert h.recv(good, wire.WELCOME).producer_name == "good"
    snap = snapshot_until(h, lambda s: s["rejected_messages"].get("unauthenticated", 0) >= 1
                          and s["rejected_messages"].get("handshake_failed", 0) >= 1, "both refusals")
    assert [p["id"] for p in snap["producers"]] == ["good"]  # neither of the others got as far as a HELLO
