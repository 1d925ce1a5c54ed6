"""A producer's connection to its trainer: the DEALER socket, its handshake, HELLO, heartbeats
and reconnecting.

The link tells "no answer yet" from "answered, but not as a stoker trainer" by its socket
monitor (:class:`Refused`, one line); joined, it beats every ``heartbeat_interval_s`` with a
ping the trainer answers, and after ``heartbeat_timeout_s`` of the trainer's silence it
connects again with a back-off. What a producer says and does is producer/worker.py's;
docs/design/protocol.md, "Producers on other hosts", has the story.
"""

from __future__ import annotations

import errno
import logging
import time
import uuid
from typing import Any, Callable, Iterator

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..shared import wire
from ..shared.config import PipelineConfig
from ..shared.errors import UserError
from ..shared.keys import ClientKeys, short

log = logging.getLogger("producer")

# Without a WELCOME this long after HELLO, say HELLO again (the consumer may have restarted).
HELLO_RETRY_S = 2.0
# Reconnect back-off after the consumer went silent: doubles up to the maximum.
RECONNECT_MIN_S = 0.5
RECONNECT_MAX_S = 8.0
# While a connection cannot be made (trainer down, link cut), ZeroMQ retries it with its
# own back-off from 100 ms up to this: a returning link is found within it, at the cost
# of one connection attempt per interval.
CONNECT_RETRY_MAX_S = 2.0
# The consumer only sends small control messages (a lease lists one batch's ids); a
# larger frame is refused by the socket, so a hostile endpoint cannot make us allocate.
MAX_INBOUND_BYTES = 16 << 20
# Handshakes that fail without detail (the peer closed the connection during it): give
# up after this many in a row, not at the first glitch.
HANDSHAKE_FAILURES_FATAL = 3
# Messages read per wake-up before the loop looks at its other duties.
RECV_BURST = 64
# While no trainer answers (not started yet, unreachable), say so this often.
WAITING_NOTE_S = 15.0
# A ZeroMQ peer answers the greeting at once (its I/O threads do, however busy the trainer
# is), a CURVE one within a few round trips; a peer that accepted the connection and has not
# finished the handshake in this long does not speak ZeroMQ (a web server waits for a line).
HANDSHAKE_TIMEOUT_S = 5.0
MONITOR_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                  | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)


class Refused(UserError):
    """The trainer will not have this producer; the message is one line for the user."""


class Link:
    """One producer's connection to one trainer (its io thread's alone). ``hello`` makes the
    HELLO of a connection's session; the link says it when the connection is up, again until a
    WELCOME, and after reconnecting. ``poller``: the io thread's, shared by a producer's links
    (one of its own by default)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, name: str, host: str, keys: ClientKeys | None,
                 hello: Callable[[str], wire.Hello], poller: zmq.Poller | None = None) -> None:
        self.ctx, self.endpoint, self.name, self.host, self.keys = ctx, endpoint, name, host, keys
        self._hello = hello
        self.identity = f"{name}-{uuid.uuid4().hex[:8]}".encode()
        self.poller = poller if poller is not None else zmq.Poller()
        self.sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._handshake_failures = 0
        self._handshake_timed_out = False  # one of those failures: the peer never finished a greeting
        self._in_handshake = False  # a connection is up and its handshake has no outcome yet
        self._session = ""  # new for each connection; the consumer treats repeated HELLOs of one as one
        self._firsts: set[str] = set()  # the firsts of this connection logged ("lease", "batch delivered")
        self.welcomed = False  # joined on this connection (a WELCOME, not refused since)
        self.was_welcomed = False  # joined once: a WELCOME it cannot read then is another version's
        self.connected_t = self.last_hello = self.last_beat = self.last_heard = self.last_waiting_note = 0.0
        self.hello_sent = False
        self.backoff = RECONNECT_MIN_S
        self.reopen_at: float | None = None  # closed after the trainer's silence: connect again then
        # Until the WELCOME says the trainer's settings, the config's defaults (written once, there).
        self.interval = PipelineConfig.heartbeat_interval_s
        self.timeout = PipelineConfig.heartbeat_timeout_s
        self.rtt_ms: float | None = None

    def open(self) -> None:
        """A new connection (a socket not yet up: ZeroMQ connects in the background)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.identity = self.identity
        # Queue nothing for a connection that is not up: no stale HELLOs or heartbeats
        # pile up while the trainer is away, and a send then fails at once (EAGAIN).
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_BYTES)
        sock.copy_threshold = wire.COPY_THRESHOLD_BYTES  # small batches: a memcpy beats zero-copy
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(CONNECT_RETRY_MAX_S * 1000))
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_TIMEOUT_S * 1000))
        if self.keys is not None:
            sock.curve_secretkey = self.keys.secret
            sock.curve_publickey = self.keys.public
            sock.curve_serverkey = self.keys.server_public
        self._monitor = sock.get_monitor_socket(events=MONITOR_EVENTS,
                                                addr=f"inproc://producer-monitor-{uuid.uuid4().hex}")
        sock.connect(self.endpoint)
        self.sock = sock
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self._monitor, zmq.POLLIN)
        self.connected_t = self.last_heard = self.last_beat = time.monotonic()
        self._firsts.clear()
        self._session = uuid.uuid4().hex[:12]

    def close(self, linger_ms: int = 0) -> None:
        """Close the connection, giving its last message ``linger_ms`` to leave."""
        sock = self.sock
        if sock is None or sock.closed:
            return
        # Read what is waiting first: the kernel resets a connection closed with unread
        # input, and a reset can lose our last message (BYE) on its way out.
        for _ in range(RECV_BURST):
            try:
                sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                break
        self.poller.unregister(sock)
        if self._monitor is not None:
            self.poller.unregister(self._monitor)
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close()
            self._monitor = None
        sock.close(linger=linger_ms)

    def send(self, msg: wire.Body) -> bool:
        """Send one message now; False when it cannot leave (the caller retries or gives it up)."""
        try:
            self.sock.send_multipart(msg.encode(), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:  # not connected (IMMEDIATE) or the link is full: the caller retries
            log.debug("could not send %s: consumer not reachable", msg.KIND)
            return False

    def send_frames(self, frames: list[Any]) -> bool:
        """Send a message already encoded (a prepared BATCH), zero-copy above the threshold."""
        try:
            self.sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def say_hello(self) -> bool:
        """Send this connection's HELLO; False when it could not leave yet."""
        self.hello_sent = self.send(self._hello(self._session))
        if self.hello_sent:
            self.last_hello = time.monotonic()
        return self.hello_sent

    def first(self, what: str, now: float) -> None:
        """Log the first ``what`` of this connection, with the time since connecting."""
        if what not in self._firsts:
            self._firsts.add(what)
            log.info("%s: first %s %.2f s after connecting", self.name, what, now - self.connected_t)

    def on_events(self, events: dict[Any, int]) -> None:
        """The socket monitor's news: a handshake's outcome (Refused when it is final); HELLO as
        soon as the handshake succeeds, not at the next retry."""
        if self._monitor is None or self._monitor not in events:
            return
        while True:
            try:
                event = recv_monitor_message(self._monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self.on_monitor_event(event)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self.welcomed and not self.hello_sent:
                self.say_hello()

    def on_monitor_event(self, event: dict[str, Any]) -> None:
        """Count a handshake's failure, or raise Refused when it shows the peer is no trainer of
        ours (or refuses our keys)."""
        kind, value = event["event"], int(event["value"])
        if kind == zmq.EVENT_CONNECTED:
            self._in_handshake = True
            return
        if kind == zmq.EVENT_DISCONNECTED and not self._in_handshake:
            return  # a link that had its handshake (or its failure, already counted) went down
        in_handshake, self._in_handshake = self._in_handshake, False
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._handshake_failures = 0
            self._handshake_timed_out = False
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            key = f" (public key {short(self.keys.public)})" if self.keys else ""
            raise Refused(f"the trainer at {self.endpoint} rejected this producer's CURVE key{key}: add its .key "
                          "file to the trainer's keys/authorized directory")
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            raise Refused(f"security handshake with {self.endpoint} failed: {self._security_hint()}")
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            # ZeroMQ gives up on a connection after a protocol failure (it does not retry): final.
            raise Refused(self._not_a_trainer("it speaks ZeroMQ but broke its handshake protocol"))
        elif kind == zmq.EVENT_DISCONNECTED and in_handshake:
            # Dropped with no handshake event: ZeroMQ found a socket type that does not pair
            # with ours (a PUB, a REQ, ...) and, as after any protocol failure, does not retry.
            raise Refused(self._not_a_trainer("it speaks ZeroMQ, but with a socket of another kind"))
        elif in_handshake:
            # Closed during the handshake (a trainer restarting, a wrong server key, another
            # service) or no handshake in HANDSHAKE_TIMEOUT_S: retried, not final at the first.
            self._handshake_failures += 1
            self._handshake_timed_out |= kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and value == errno.EAGAIN
            if self._handshake_failures >= HANDSHAKE_FAILURES_FATAL:
                raise Refused(self._failed_handshakes())

    def _failed_handshakes(self) -> str:
        """Why HANDSHAKE_FAILURES_FATAL handshakes in a row failed, as one line."""
        if self._handshake_timed_out:
            return self._not_a_trainer(
                f"it accepted the connection but did not answer ZeroMQ's greeting in {HANDSHAKE_TIMEOUT_S:g} "
                "s: another service, such as a web server, listens there")
        if self.keys is not None:  # a trainer holding another server key closes the link so
            return f"security handshake with {self.endpoint} failed: {self._security_hint()}"
        # A trainer using --keys closes a keyless producer's link so too, when libzmq reports
        # no mechanism mismatch first: both causes are named.
        return (f"{self.endpoint} closed the connection during ZeroMQ's handshake: "
                f"{self._security_hint()}, or it is not a stoker trainer's endpoint")

    def _security_hint(self) -> str:
        return ("the trainer does not use --keys, or server.key is not the trainer's" if self.keys
                else "the trainer uses --keys: pass --keys DIR with server.key and a client key pair")

    def _not_a_trainer(self, why: str) -> str:
        return f"{self.endpoint} answered, but not as a stoker trainer ({why}): is this the trainer's endpoint?"

    def receive(self, now: float) -> Iterator[wire.Body]:
        """A bounded burst of the consumer's messages, typed, each read after the one before is
        handled (heartbeats and the compute thread's news get their turn after it)."""
        for _ in range(RECV_BURST):
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self._read(frames)
            if msg is None:
                continue
            self.last_heard = now
            self.backoff = RECONNECT_MIN_S
            if isinstance(msg, wire.Welcome):
                self.interval, self.timeout = msg.heartbeat_interval_s, msg.heartbeat_timeout_s
                self.welcomed = self.was_welcomed = True
            elif isinstance(msg, wire.Heartbeat) and msg.pong is not None and 0 <= now - msg.pong <= wire.MAX_RTT_S:
                self.rtt_ms = round((now - msg.pong) * 1e3, 3)
            yield msg

    def _read(self, frames: list[Any]) -> wire.Body | None:
        """One consumer message, typed; None (logged) when malformed. Refused (one line) for a
        REFUSE of another protocol version (every version reads its reason) and for a first
        WELCOME this producer cannot read (its config keys or version differ: another stoker
        version), which saying HELLO again would not change."""
        try:
            msg = wire.decode(frames)
        except wire.OtherVersion as exc:
            reason = exc.reason_refused()
            if reason is None:
                log.warning("dropped a message of protocol version %d from the consumer (this producer speaks %d)",
                            exc.version, wire.PROTOCOL_VERSION)
                return None
            raise Refused(f"the trainer at {self.endpoint} (protocol version {exc.version}, this producer "
                          f"{wire.PROTOCOL_VERSION}) refused this producer: {reason}") from None
        except wire.ProtocolError as exc:
            log.warning("dropped a malformed message from the consumer: %s", exc)
            return None
        try:
            return wire.parse(msg)
        except wire.ProtocolError as exc:
            if msg.kind == wire.WELCOME and not self.was_welcomed:
                raise Refused(f"the trainer at {self.endpoint} sent a WELCOME this producer cannot take ({exc}): "
                              f"run the trainer's stoker version on host {self.host}") from None
            log.warning("dropped a malformed message from the consumer: %s", exc)
            return None

    def beat(self, now: float, ready: int, working: int) -> None:
        """A heartbeat, when one is due: the leases ready and in work, a ping and the last round trip."""
        if now - self.last_beat >= self.interval:
            self.send(wire.Heartbeat(ready=ready, working=working, ping=now, rtt_ms=self.rtt_ms))
            self.last_beat = now

    def court(self, now: float) -> None:
        """Not joined: HELLO again when due, and say now and then that no trainer answers yet."""
        if not self.hello_sent or now - self.last_hello >= HELLO_RETRY_S:
            self.say_hello()
        if now - max(self.connected_t, self.last_waiting_note) >= WAITING_NOTE_S:
            if self._handshake_failures:  # something answers there, but not (yet) as a trainer
                log.info("%s: waiting for the trainer at %s (a connection is accepted there, but %d ZeroMQ "
                         "handshake(s) failed in %.0f s)", self.name, self.endpoint, self._handshake_failures,
                         now - self.connected_t)
            else:
                log.info("%s: waiting for the trainer at %s (no answer for %.0f s)", self.name, self.endpoint,
                         now - self.connected_t)
            self.last_waiting_note = now

    def silent(self, now: float) -> bool:
        """Joined, and the trainer has said nothing for the heartbeat timeout."""
        return self.welcomed and now - self.last_heard > self.timeout

    def drop(self, now: float) -> None:
        """Close after the trainer's silence; :meth:`reopen` connects again once the back-off
        (doubled for next time) is over, without holding up the producer's other links."""
        self.welcomed = False
        self.close()
        self.reopen_at = now + self.backoff
        self.backoff = min(self.backoff * 2, RECONNECT_MAX_S)

    def reopen(self, now: float) -> None:
        """Connect again and say HELLO, when a :meth:`drop`'s back-off is over."""
        if self.reopen_at is not None and now >= self.reopen_at:
            self.reopen_at = None
            self.open()
            self.say_hello()
