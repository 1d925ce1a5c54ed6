"""The coordinator: the trainer's ROUTER socket and the loop that serves it.

It runs in the coordinator process's main thread (consumer/coordinator/coordproc.py: a run's), or in a
thread of its own (the tests' harness, benchmarks/memory.py), and is the only user of the ROUTER socket. Everything it
decides, it asks the scheduler (consumer/coordinator/scheduler.py, a state machine with no sockets:
leases, credits, re-planning, misses, rejections, peers and liveness); what is left here
is the socket's side:

- binding (with CURVE authentication when keys are given, and a socket monitor);
- the loop: each producer message, with the connection it came on, goes to
  :meth:`Scheduler.on_message`; the trainer's "a slot is free" wake-ups to
  :meth:`~Scheduler.on_free`, and its validation passes asked and left to
  :meth:`~Scheduler.start_validation` / :meth:`~Scheduler.cancel_validation`; the
  monitor's connection events to the scheduler's connection methods; and every
  ``POLL_INTERVAL_MS`` a :meth:`~Scheduler.tick`. After each, the scheduler's outbox is
  sent.
- stopping: STOP to every producer, then a bounded wait for their BYEs or closed
  connections, so that closing does not drop the STOP unread.

The socket itself refuses frames over ``pipeline.max_message_mb`` by closing that
connection unread; the monitor reports such closures (a connection closed without BYE,
which also covers a producer killed outright) and failed CURVE handshakes.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..buffer import BatchQueue
from .lease_tables import ReferenceTable, TokenTable
from .leases import ValidationSet
from ..plan import EpochPlanner
from ..position import InputPosition
from ..protocol import WAKE_CANCEL, WAKE_VALIDATE, BindError
from .scheduler import Scheduler
from ...shared import wire
from ...shared.config import Config
from ...shared.dataset.agreement import Reference
from ...shared.errors import UserError
from ...shared.keys import ServerKeys, short
from ...shared.dataset.layouts import Rejection
from ...shared.melstats import MelStats

log = logging.getLogger("consumer.coordinator")

# The loop wakes at least this often for heartbeats and expiry even when nothing arrives.
POLL_INTERVAL_MS = 100
# On stop, wait this long for every producer to answer STOP with BYE before closing:
# a producer's socket drops unread messages when its connection closes, so closing
# right after sending STOP could lose it.
STOP_ACK_S = 1.0
# Then give anything still queued this long to leave.
STOP_LINGER_MS = 500
# At most this many messages (or monitor events) per wake-up, then heartbeats get their turn.
BURST = 64
# Socket events the coordinator watches.
MONITOR_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class Coordinator:
    """The ROUTER socket and its loop around a :class:`Scheduler` (module docstring)."""

    def __init__(self, cfg: Config, planner: EpochPlanner, queue: BatchQueue, stop: threading.Event,
                 max_epochs: int | None = None, on_rejected: Callable[[list[Rejection]], None] | None = None,
                 context: zmq.Context | None = None,
                 dataset: Reference | None = None,
                 keys: ServerKeys | None = None, resume: InputPosition | None = None,
                 tokens: TokenTable | None = None, references: ReferenceTable | None = None,
                 mel_norm: dict[str, Any] | None = None, validation: ValidationSet | None = None) -> None:
        self.cfg = cfg
        self.queue = queue
        self.stop = stop
        self.scheduler = Scheduler(cfg, planner, queue, max_epochs=max_epochs, on_rejected=on_rejected,
                                   dataset=dataset, resume=resume, tokens=tokens,
                                   references=references, mel_norm=mel_norm, now=time.monotonic(),
                                   validation=validation)
        self.ctx = context or zmq.Context.instance()
        self.keys = keys
        self.endpoint = ""
        self._router: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._auth: Any = None
        self._wake_addr = f"inproc://consumer-wake-{uuid.uuid4().hex}"
        self._wake_local = threading.local()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self._max_bytes = cfg.pipeline.max_message_bytes

    # ------------------------------------------------------------ lifecycle
    def bind(self, endpoint: str) -> str:
        """Bind the ROUTER socket (in the caller's thread, so errors surface there)."""
        router = self.ctx.socket(zmq.ROUTER)
        router.linger = 0
        router.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
        # A producer that reconnects after a network outage keeps its identity; the old
        # connection may still look open here, and without hand-over the new one is refused.
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if self.keys is not None:
            from zmq.auth.thread import ThreadAuthenticator  # only with --keys (40 ms to import)

            self._auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("consumer.auth"))
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(self.keys.authorized_dir))
            router.curve_secretkey = self.keys.secret
            router.curve_publickey = self.keys.public
            router.curve_server = True
        self._monitor = router.get_monitor_socket(events=MONITOR_EVENTS,
                                                  addr=f"inproc://consumer-monitor-{uuid.uuid4().hex}")
        try:
            router.bind(endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets(router)
            raise BindError(f"cannot bind {endpoint}: {exc.strerror}") from None
        self._router = router
        self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.keys is not None:
            log.info("CURVE on: server key %s, %d allowed producer keys in %s", short(self.keys.public),
                     self.keys.allowed, self.keys.authorized_dir)
        self._wake = self.ctx.socket(zmq.PULL)
        self._wake.linger = 0
        self._wake.bind(self._wake_addr)
        return self.endpoint

    def _close_sockets(self, router: zmq.Socket, linger_ms: int = 0) -> None:
        if self._monitor is not None:
            try:
                router.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close()
            self._monitor = None
        router.close(linger=linger_ms)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run_guarded, name="coordinator", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def notify_free(self) -> None:
        """Called from the trainer thread when it takes a batch: a slot is free."""
        try:
            self._waker().send(b"", flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a wake-up is already pending; one is enough

    def _waker(self) -> zmq.Socket:
        """This thread's end of the wake-up socket."""
        sock = getattr(self._wake_local, "sock", None)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.linger = 0
            sock.connect(self._wake_addr)
            self._wake_local.sock = sock
        return sock

    def start_validation(self, number: int) -> None:
        """From the trainer thread: lease validation pass ``number`` (the loop asks the scheduler)."""
        self._waker().send(WAKE_VALIDATE + str(number).encode(), flags=zmq.NOBLOCK)

    def cancel_validation(self, number: int) -> None:
        """From the trainer thread: it left validation pass ``number`` before its end."""
        try:
            self._waker().send(WAKE_CANCEL + str(number).encode(), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # the loop has stopped: no pass is leased any more

    def validation_finished(self) -> int:
        """The last validation pass whose every batch was delivered (or which was left)."""
        return self.scheduler.validation_finished

    def close_notifier(self) -> None:
        sock = getattr(self._wake_local, "sock", None)
        if sock is not None:
            sock.close()
            self._wake_local.sock = None

    # ------------------------------------------------------------ the scheduler's figures, for the trainer
    @property
    def mel_stats(self) -> MelStats:
        return self.scheduler.mel_stats

    def alive(self) -> int:
        return self.scheduler.alive()

    def rejected_in_epoch(self, epoch: int) -> int:
        """Samples of ``epoch`` rejected while the run went on (they will not be trained)."""
        return self.scheduler.rejected_in_epoch(epoch)

    def snapshot(self) -> dict[str, Any]:
        return self.scheduler.snapshot()

    # ------------------------------------------------------------ the loop
    def _flush(self) -> None:
        """Send what the scheduler decided, in order."""
        router = self._router
        assert router is not None
        for identity, msg, version in self.scheduler.take_outbox():
            try:
                router.send_multipart([identity, *msg.encode(version=version)], flags=zmq.NOBLOCK)
            except zmq.Again:
                log.warning("could not send %s to %s: its queue is full", msg.KIND, identity)
            except zmq.ZMQError as exc:
                log.warning("could not send %s to %s: %s", msg.KIND, identity, exc)

    def _on_frames(self, frames: list[Any], now: float) -> None:
        if len(frames) < 2:
            self.scheduler.on_message(b"", [], now)
            return
        first = frames[0]
        identity = bytes(first.bytes if hasattr(first, "bytes") else first)
        try:  # the connection it came on (-1 for transports without one)
            fd = first.get(zmq.SRCFD) if isinstance(first, zmq.Frame) else -1
        except zmq.ZMQError:
            fd = -1
        self.scheduler.on_message(identity, frames[1:], now, fd)

    def _on_monitor_event(self, event: dict[str, Any], now: float) -> None:
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.scheduler.on_handshake_failed(True, value)
        elif kind in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
            self.scheduler.on_handshake_failed(False, value)
        elif kind == zmq.EVENT_DISCONNECTED:
            self.scheduler.on_connection_closed(value, now)
        elif kind == zmq.EVENT_ACCEPTED:
            self.scheduler.on_connection_accepted(value)

    def _on_wake(self, token: bytes, now: float) -> None:
        """A wake-up from the trainer: a free slot (empty), or a validation pass asked or left."""
        if token.startswith(WAKE_VALIDATE):
            self.scheduler.start_validation(int(token[len(WAKE_VALIDATE):]), now)
        elif token.startswith(WAKE_CANCEL):
            self.scheduler.cancel_validation(int(token[len(WAKE_CANCEL):]), now)

    def _say_stop(self, router: zmq.Socket) -> None:
        """STOP to every producer, then wait (bounded) for their BYEs or their connections to close."""
        waiting = set(self.scheduler.stop())
        self._flush()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        deadline = time.monotonic() + STOP_ACK_S
        while waiting and time.monotonic() < deadline:
            events = dict(poller.poll(POLL_INTERVAL_MS))
            if self._monitor is not None and self._monitor in events:
                try:
                    event = recv_monitor_message(self._monitor, flags=zmq.NOBLOCK)
                except zmq.Again:
                    event = {}
                if event.get("event") == zmq.EVENT_DISCONNECTED:
                    waiting.discard(self.scheduler.owner_of(event["value"]) or b"")
            if router not in events:
                continue
            try:
                frames = router.recv_multipart(flags=zmq.NOBLOCK)
                msg = wire.decode(frames[1:], max_bytes=self._max_bytes)
            except (zmq.Again, wire.ProtocolError, IndexError):
                continue
            if msg.kind in (wire.BYE, wire.ERROR):
                waiting.discard(bytes(frames[0]))
        if waiting:
            log.debug("%d producers did not acknowledge STOP", len(waiting))

    def _run_guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # the trainer sees it via .failure and stops with the error
            self.failure = exc
            if isinstance(exc, UserError):  # rejected.jsonl on a full disk: the trainer's one line says it
                log.error("coordinator stopped: %s", exc)
            else:
                log.exception("coordinator failed")
            self.stop.set()

    def _run(self) -> None:
        router = self._router
        assert router is not None and self._monitor is not None
        monitor = self._monitor
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        last_tick = time.monotonic()
        try:
            while not self.stop.is_set():
                events = dict(poller.poll(POLL_INTERVAL_MS))
                now = time.monotonic()
                if self._wake in events:
                    while True:
                        try:
                            self._on_wake(self._wake.recv(flags=zmq.NOBLOCK), now)
                        except zmq.Again:
                            break
                    self.scheduler.on_free(now)
                if monitor in events:
                    for _ in range(BURST):
                        try:
                            self._on_monitor_event(recv_monitor_message(monitor, flags=zmq.NOBLOCK), now)
                        except zmq.Again:
                            break
                if router in events:
                    for _ in range(BURST):
                        try:
                            frames = router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_frames(frames, now)
                        self._flush()
                if now - last_tick >= POLL_INTERVAL_MS / 1000:
                    self.scheduler.tick(now)
                    last_tick = now
                self._flush()
        finally:
            self._say_stop(router)
            self._close_sockets(router, STOP_LINGER_MS)
            self._wake.close()
