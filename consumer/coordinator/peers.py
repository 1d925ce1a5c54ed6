"""The producers as peers: who has joined, under which name and on which connection, and
who is presumed gone. A part of the scheduler (consumer/coordinator/scheduler.py), with no sockets;
dropping a peer calls the scheduler back (``on_drop``), which re-plans its leases.

Joining, refusals and liveness: docs/design/protocol.md, "Versions at joining",
"Dataset agreement", "Liveness and reconnection".
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from ...shared import wire
from ...shared.config import Config
from ...shared.dataset.agreement import Reference, check_agreement, is_deferred

log = logging.getLogger("consumer.coordinator")

# Tell an unknown identity to say HELLO again at most this often: a restarted trainer
# brings its producers back at once, and a flood of garbage gets no amplification.
REJOIN_NUDGE_INTERVAL_S = 1.0
# Bounds on per-identity bookkeeping, so hostile peers cannot grow it without limit.
IDENTITY_MEMORY = 4096
# Refusals kept for summary.json (each also logged; repeats of one reason at debug level).
REFUSALS_KEPT = 100
# A closed connection is held against its producer this long before the producer is
# presumed dead: the kernel reuses file descriptors, so the close of an older connection
# (a refused oversized frame, a fuzzer) can be reported after a producer's new connection
# took the same descriptor, whose ACCEPTED event then follows at once in the event stream.
DISCONNECT_GRACE_S = 0.5


@dataclass
class Peer:
    identity: bytes
    name: str
    host: str
    pid: int
    index: int
    last_seen: float
    leases: set[int] = field(default_factory=set)
    lacks: set[str] = field(default_factory=set)  # sample ids this producer has no audio for
    why: dict[str, str] = field(default_factory=dict)  # the reason it gave for each of them (its miss)
    fd: int = -1  # the socket's file descriptor of its current connection
    joined_t: float = 0.0
    base_name: str = ""  # the name it asked for (``name`` may carry a #N suffix)
    launcher: int | None = None  # pid of the process that started it, on its host
    session: str | None = None  # one per connection of the producer: repeated HELLOs carry the same
    remote: bool = False  # it read its own copy (not agreement.deferred): its leases carry the files' sizes


@dataclass
class ProducerStats:
    id: str
    host: str
    pid: int | None = None  # its process on its host (the latest, after a restart)
    batches: int = 0
    samples: int = 0
    rejected: int = 0
    status: str = "alive"
    connections: int = 0
    misses: int = 0  # leased clips this producer did not have (re-planned elsewhere)
    lacks: int = 0  # clips it missed (absent on its host, or not the trainer's file): not leased to it again
    rtt_ms: float | None = None  # last heartbeat round trip it measured
    first_lease_ms: float | None = None  # from its (last) HELLO to its first lease
    prep_ms_total: float = 0.0
    credit_wait_ms_total: float = 0.0
    last_error: str = ""
    # Feature cache, summed over this producer's batches (see producer/feature_cache.py).
    cache_hits: int = 0
    cache_computed: int = 0  # log-mels computed from audio (no valid entry) and stored
    cache_stale: int = 0
    cache_corrupt: int = 0
    read_retries: int = 0  # reads of tar shards retried (shared/dataset/storage.py)
    # Producer models (producer/models.py): batches a model ran on, clips whose outputs the cache held.
    model_runs: int = 0
    model_hits: int = 0

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["prep_ms_mean"] = round(self.prep_ms_total / self.batches, 3) if self.batches else None
        out["credit_wait_ms_mean"] = round(self.credit_wait_ms_total / self.batches, 3) if self.batches else None
        del out["prep_ms_total"], out["credit_wait_ms_total"]
        return out


class Peers:
    """Membership and liveness (docs/design/protocol.md, "Producers on other hosts"). ``send`` queues a message, ``count`` counts
    a dropped one, ``welcome`` gives a peer's WELCOME, ``on_drop(peer, status)`` is the
    scheduler's, ``holds_credits(peer)`` whether it holds credited leases; ``lock`` guards the
    figures other threads read (``producers``, ``refusals``)."""

    def __init__(self, cfg: Config, dataset: Reference | None,
                 send: Callable[..., None], count: Callable[..., None], welcome: Callable[[Peer], wire.Welcome],
                 on_drop: Callable[[Peer, str], None], holds_credits: Callable[[Peer], bool],
                 lock: threading.Lock) -> None:
        self.cfg = cfg
        # None: accept any producer's dataset (tests, benchmarks)
        self.dataset = dataset
        self.send, self.count, self.welcome = send, count, welcome
        self.on_drop, self.holds_credits, self.lock = on_drop, holds_credits, lock
        self.live: dict[bytes, Peer] = {}
        self.producers: dict[str, ProducerStats] = {}
        self.refusals: list[dict[str, str]] = []
        self._fd_owner: dict[int, bytes] = {}  # connection -> identity that spoke on it
        self._gone: set[bytes] = set()  # identities that said BYE or were refused: their close is expected
        self._nudged: dict[bytes, float] = {}
        self._unmatched_handshake_failures = 0
        self._suspects: dict[int, tuple[bytes, float]] = {}  # fd -> (identity, when its close was seen)
        self._refusal_reasons_seen: set[str] = set()
        # What the trainer sends in WELCOME: a producer's schema must hold every key of it.
        self.config_schema = wire.ConfigSchema.local()

    def alive(self) -> int:
        with self.lock:
            return sum(1 for p in self.producers.values() if p.status == "alive")

    def drop(self, peer: Peer, status: str) -> None:
        """``peer`` is gone (``status``: left, crashed, dead, reconnected, restarted)."""
        self.live.pop(peer.identity, None)
        with self.lock:
            stats = self.producers.get(peer.name)
            if stats is not None:
                stats.status = status
        self.on_drop(peer, status)

    def left(self, peer: Peer, status: str) -> None:
        """It said so (BYE, a fatal ERROR): the close of its connection is expected."""
        self._remember(self._gone, peer.identity)
        self.drop(peer, status)

    def heard(self, identity: bytes, now: float, fd: int) -> Peer | None:
        """A message from ``identity`` on connection ``fd``: its peer, now known alive, or None."""
        if fd >= 0 and fd not in self._fd_owner:
            self._remember(self._fd_owner, fd, identity)
        peer = self.live.get(identity)
        if peer is not None:
            peer.last_seen = now
            if fd >= 0:
                peer.fd = fd
                self._fd_owner[fd] = identity
        return peer

    def saying_hello(self, identity: bytes, fd: int) -> None:
        """A HELLO came on ``fd``: that connection is this identity's."""
        if fd >= 0:
            self._fd_owner[fd] = identity

    def owner_of(self, fd: int) -> bytes | None:
        """The identity that last spoke on connection ``fd``."""
        return self._fd_owner.get(fd)

    def on_connections(self) -> list[bytes]:
        """The peers with a connection (they can answer STOP with BYE): not those whose
        connection closed and is held against them (DISCONNECT_GRACE_S): no BYE comes on it."""
        closed = {(identity, fd) for fd, (identity, _) in self._suspects.items()}
        return [identity for identity, peer in self.live.items() if peer.fd >= 0 and (identity, peer.fd) not in closed]

    def stopped(self) -> None:
        with self.lock:
            for stats in self.producers.values():
                if stats.status == "alive":
                    stats.status = "stopped"

    def _refuse(self, identity: bytes, name: str, host: str, reason: str, version: int = wire.PROTOCOL_VERSION,
                **extra: Any) -> None:
        self.send(identity, wire.Refuse(reason, **extra), version)
        self._remember(self._gone, identity)
        first = reason not in self._refusal_reasons_seen
        if first and len(self._refusal_reasons_seen) < IDENTITY_MEMORY:
            self._refusal_reasons_seen.add(reason)
        log.log(logging.WARNING if first else logging.DEBUG, "refused producer %s from %s: %s", name, host, reason)
        with self.lock:
            if len(self.refusals) < REFUSALS_KEPT:
                self.refusals.append({"producer": name, "host": host, "reason": reason})

    @staticmethod
    def _remember(store: set[Any] | dict[Any, Any], key: Any, value: Any = None) -> None:
        """Add to a bounded set or map: hostile peers must not grow it without limit."""
        if len(store) >= IDENTITY_MEMORY and key not in store:
            store.clear()  # forgetting costs at most a log line, a nudge or a miscounted close
        if isinstance(store, set):
            store.add(key)
        else:
            store[key] = value

    def other_version(self, identity: bytes, hello: wire.OtherVersion) -> None:
        """A HELLO of another protocol version: REFUSE, in that version (its layout is every
        version's), so that the producer exits with the reason rather than waiting."""
        name, host = hello.fields.get("producer"), hello.fields.get("host")
        name = name[:200] if isinstance(name, str) else "?"
        host = host[:200] if isinstance(host, str) else "?"
        self._refuse(identity, name, host, f"the producer speaks protocol version {hello.version} and the trainer "
                     f"{wire.PROTOCOL_VERSION}: run the trainer's stoker version on host {host}",
                     version=hello.version)

    def hello(self, identity: bytes, msg: wire.Hello, now: float, fd: int) -> Peer | None:
        """A producer's HELLO: refused (its config schema or dataset differs: REFUSE), welcomed
        again (a retry of its session), or admitted (WELCOME): the new peer, to be given work;
        None otherwise. A reconnection, or the restart of a producer that is still a peer,
        drops the old one."""
        name = msg.producer[:200]
        host = msg.host[:200]
        differs = msg.config.differs(self.config_schema)
        if differs:
            self._refuse(identity, name, host, f"the producer's config schema differs from the trainer's "
                         f"({differs}): run the trainer's stoker version on host {host}")
            return None
        if self.dataset is not None:
            agreement = check_agreement(self.dataset, msg.dataset, host)
            if not agreement.ok:
                extra = ({"metadata_file": agreement.metadata_file, "columns": agreement.columns}
                         if agreement.metadata_file else {})
                self._refuse(identity, name, host, agreement.reason, **extra)
                return None
        launcher, session = msg.launcher, msg.session
        old = self.live.get(identity)
        if old is not None and session is not None and old.session == session:
            self.send(identity, self.welcome(old))  # a HELLO retry crossed our WELCOME
            return None
        if old is not None:  # reconnected with the same identity: it dropped its work
            self.drop(old, "reconnected")
        for other in list(self.live.values()):
            if (launcher is not None and other.base_name == name and other.host == host
                    and other.launcher == launcher):
                # Its launcher restarted it: the old process is gone, its work need not wait for the timeout.
                log.info("producer %s restarted on %s (pid %d, was %d); re-planning the %d leases of the old one",
                         other.name, host, msg.pid, other.pid, len(other.leases))
                self.drop(other, "restarted")
        self._gone.discard(identity)
        taken = {p.name for p in self.live.values()}
        unique, n = name, 2
        while unique in taken:  # two hosts with one hostname, or two launchers on one host
            unique, n = f"{name}#{n}", n + 1
        peer = Peer(identity, unique, host, msg.pid, len(self.live), now, fd=fd, joined_t=now, base_name=name,
                    launcher=launcher, session=session, remote=not is_deferred(msg.dataset))
        self.live[identity] = peer
        with self.lock:
            stats = self.producers.setdefault(unique, ProducerStats(id=unique, host=host))
            stats.status = "alive"
            stats.host, stats.pid = host, msg.pid
            stats.connections += 1
            stats.lacks = 0
            stats.first_lease_ms = None
        log.info("producer %s joined from %s (pid %d)%s", unique, host, peer.pid,
                 "; its audio files are checked against the trainer's as it reads them" if peer.remote else "")
        self.send(identity, self.welcome(peer))
        return peer

    def nudge(self, identity: bytes, now: float) -> None:
        """An identity we do not know talks as if it had joined: ask it to say HELLO again."""
        if identity in self._gone or now - self._nudged.get(identity, -REJOIN_NUDGE_INTERVAL_S) < REJOIN_NUDGE_INTERVAL_S:
            return
        self._remember(self._nudged, identity, now)
        self.send(identity, wire.Refuse("unknown producer (the trainer restarted, or declared it dead): say HELLO "
                                        "again", rejoin=True))

    def heartbeat(self, peer: Peer, msg: wire.Heartbeat, now: float) -> None:
        if msg.ping is not None:
            self.send(peer.identity, wire.Heartbeat(pong=msg.ping))
        rtt = msg.rtt_ms
        if rtt is not None and 0 <= rtt <= wire.MAX_RTT_S * 1e3:
            with self.lock:
                self.producers[peer.name].rtt_ms = round(float(rtt), 3)

    def handshake_failed(self, unauthenticated: bool, value: int) -> None:
        """A connection failed its security handshake (CURVE): its close follows."""
        self._unmatched_handshake_failures += 1
        if unauthenticated:
            self.count("unauthenticated", f"(a producer key not in the allow-list; ZAP status {value})")
        else:
            self.count("handshake_failed", f"(security mismatch or not ZeroMQ; code {value:#x})")

    def connection_closed(self, fd: int, now: float) -> None:
        """The connection on ``fd`` closed."""
        identity = self._fd_owner.pop(fd, None)
        if identity is None and self._unmatched_handshake_failures > 0:
            self._unmatched_handshake_failures -= 1  # the close that follows a failed handshake
            return
        if identity is not None and identity in self._gone:
            return  # closed after BYE or a refusal: expected
        peer = self.live.get(identity) if identity is not None else None
        if peer is not None and peer.fd != fd:
            return  # an old connection handed over to the producer's new one
        self.count("connection_dropped", "(closed without BYE: a frame above pipeline.max_message_mb, a broken "
                                          "stream, or a producer that died)")
        if peer is not None:
            # Its process died (the kernel closed the connection) or the transport cut it:
            # nothing more will come on it, so its work moves soon rather than after the
            # heartbeat timeout; unless a connection accepted on the same descriptor follows
            # within DISCONNECT_GRACE_S, which shows the close was of an older connection.
            self._suspects[fd] = (identity, now)

    def connection_accepted(self, fd: int) -> None:
        """A connection was accepted on ``fd`` (the kernel reuses descriptors)."""
        if fd in self._suspects:
            identity, _ = self._suspects.pop(fd)
            self._fd_owner[fd] = identity
            log.debug("a connection closed on fd %d was an older one; producer %s is on its new one", fd,
                      self.live[identity].name if identity in self.live else "?")

    def _presume_dead_if_closed(self, now: float) -> None:
        """Producers whose connection closed DISCONNECT_GRACE_S ago with no new one on its fd."""
        for fd, (identity, seen) in list(self._suspects.items()):
            if now - seen < DISCONNECT_GRACE_S:
                continue
            del self._suspects[fd]
            peer = self.live.get(identity)
            if peer is None or peer.fd != fd or identity in self._gone:
                continue
            credited = self.holds_credits(peer)
            log.warning("the connection of producer %s closed without BYE: presumed dead, re-planning its %d "
                        "leases%s", peer.name, len(peer.leases),
                        f" (if this repeats, its batches may exceed pipeline.max_message_mb="
                        f"{self.cfg.pipeline.max_message_mb})" if credited else "")
            self.drop(peer, "dead")

    def expire(self, now: float) -> None:
        """Drop the peers presumed gone by now: closed without a new connection, or silent."""
        self._presume_dead_if_closed(now)
        timeout = self.cfg.pipeline.heartbeat_timeout_s
        for peer in list(self.live.values()):
            if now - peer.last_seen > timeout:
                log.warning("producer %s silent for %.1f s: presumed dead, re-planning its %d leases",
                            peer.name, now - peer.last_seen, len(peer.leases))
                self.drop(peer, "dead")
