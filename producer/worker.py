"""A producer process: planned batches (leases) in, padded batches out, against credits.

Two threads:
  io thread       owns the DEALER socket: HELLO, heartbeats, LEASE -> work queue,
                  READY when a batch is prepared, BATCH when the consumer grants a
                  CREDIT for it, BYE on stop. Polls with a timeout; never blocks.
  compute thread  reads audio, computes log-mels (TensorFlow ops on the data device, or
                  the numpy reference), collates to the bucket shape, encodes the frames,
                  and hands the lease id to the io thread over an inproc socket. It takes
                  the lowest (epoch, index) first, so re-planned work goes before new work.

Joining: a producer reads no metadata of its own: its leases carry its clips' texts, audio
locators and durations, and each clip is checked when read. Before its HELLO a producer on
another host hashes the metadata file it was pointed at (shared/dataset/agreement.py
describe_copy: its SHA-256, no parse, no audio listing: about a second per GB) and describes
it, beside its config schema (shared/wire.py); a trainer whose metadata differs, or that
speaks another protocol version or sends config keys this producer lacks, answers REFUSE
with the reason, which the producer logs and exits with status 2. Its leases carry each
file's byte size on the trainer: a file of another size here is not the trainer's and is
reported missed with the reason, as an absent one is. A producer the trainer's launcher
starts on the trainer's host (``--local``) reads the trainer's own files: it hashes nothing
(agreement.deferred). With ``--keys`` the socket is a CURVE client; a trainer
that rejects the key (or speaks no CURVE) fails the handshake, which the producer sees on
its socket monitor and reports the same way.

A producer keeps up to ``lease_ahead`` batches leased; prepared ones wait for their
credit, so a credit is answered at once. A clip whose file is not on this host is
reported as *missed* (the consumer re-plans it onto another producer); one that cannot
be read is *rejected*; both leave the batch, which is delivered with the rest. Any
other failure is sent to the consumer as an ERROR message and ends the process with
status 1 (the launcher restarts local producers).

Liveness and reconnection: while joined, the producer sends HEARTBEAT (with a ping the
consumer answers, giving the round trip) every ``heartbeat_interval_s``. If the consumer
is silent for ``heartbeat_timeout_s`` (trainer restarted, network down) the producer
drops its leases (the consumer re-plans them), closes the socket and connects again
after a back-off that doubles up to RECONNECT_MAX_S, saying HELLO until welcomed. The
socket is ``IMMEDIATE``: nothing queues for a connection that is not up, so a long
outage leaves no backlog of stale messages.

Shutdown: STOP from the consumer, SIGTERM/SIGINT, or a dead parent. On SIGTERM/SIGINT
the producer sends BYE with the leases it still holds, so they are re-planned at once.

What a batch is made of is producer/batches.py's; this file is the producer's side of the
protocol and its two threads, one idea of some 580 lines that reads best whole.
"""

from __future__ import annotations

import argparse
import errno
import itertools
import logging
import os
import queue
import socket as pysocket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from .transforms import TransformSetupError, load_user
from ..shared import wire
from ..shared.batch import schema_for
from ..shared.config import PipelineConfig
from ..shared.dataset import deferred, describe_copy, locate
from ..shared.dataset.storage import shown
from .batches import BatchMaker
from ..shared.errors import UserError
from ..shared.keys import ClientKeys, load_client_keys, short
from ..shared.layouts import COLUMNS_AUTO
from ..shared.mel import MelFunctionError, user_mel_function
from ..shared.melstats import load
from ..shared.proc import EXIT_FAILED, EXIT_OK, EXIT_USER, StatusWriter, die_with_parent, flush_sockets, \
    install_stop_handlers, parent_alive, setup_logging
from ..shared.tfsetup import configure_tensorflow

log = logging.getLogger("producer")

# The io thread wakes at least this often to send heartbeats and check its parent.
POLL_INTERVAL_MS = 100
# Without a WELCOME this long after HELLO, say HELLO again (the consumer may have restarted).
HELLO_RETRY_S = 2.0
# Reconnect back-off after the consumer went silent: doubles up to the maximum.
RECONNECT_MIN_S = 0.5
RECONNECT_MAX_S = 8.0
# While a connection cannot be made (trainer down, link cut), ZeroMQ retries it with its
# own back-off from 100 ms up to this: a returning link is found within it, at the cost
# of one connection attempt per interval.
CONNECT_RETRY_MAX_S = 2.0
# How long the compute thread waits for work before re-checking the stop flag.
WORK_POLL_S = 0.2
# Closing the socket after BYE or an ERROR: give the last message this long to leave.
FINAL_LINGER_MS = 500
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


class Producer:
    def __init__(self, endpoint: str, data_root: Path, name: str, stop: threading.Event,
                 parent_pid: int | None = None, memory_mb: int | None = None,
                 status: StatusWriter | None = None, context: zmq.Context | None = None,
                 keys: ClientKeys | None = None, metadata_file: str = "metadata.csv",
                 config_schema: wire.ConfigSchema | None = None, scan: bool = True) -> None:
        self.endpoint = endpoint
        self.root = data_root
        self.name = name
        self.stop = stop
        self.parent_pid = parent_pid
        self.memory_mb = memory_mb
        self.status = status or StatusWriter(None)
        self.ctx = context or zmq.Context.instance()
        self.keys = keys
        self.metadata_file = metadata_file
        self.scan = scan  # False: hashes no metadata (module docstring, Joining)
        self.config_schema = config_schema or wire.ConfigSchema.local()  # the config keys it takes (HELLO)
        self.identity = f"{name}-{uuid.uuid4().hex[:8]}".encode()
        self.host = pysocket.gethostname()
        self._wake_addr = f"inproc://producer-wake-{uuid.uuid4().hex}"
        self._work: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()  # ties in (epoch, index) keep arrival order
        self._ready: dict[int, list[Any]] = {}
        self._ready_lock = threading.Lock()
        self._held: set[int] = set()  # leases given to us and not yet delivered
        self._credited: set[int] = set()  # credits that arrived before their batch was ready
        self._generation = 0  # bumps on reconnect; work of an older generation is dropped
        self._failure: BaseException | None = None
        self._welcome: wire.Welcome | None = None
        self._welcomed = threading.Event()
        self._described: dict[str, Any] | None = None  # the HELLO's dataset (None: agreement.deferred)
        self._scanned: set[tuple[str, str]] = set()  # (metadata file, data.columns) described so far
        self._monitor: zmq.Socket | None = None
        self._handshake_failures = 0
        self._handshake_timed_out = False  # one of those failures: the peer never finished a greeting
        self._in_handshake = False  # a connection is up and its handshake has no outcome yet
        self._connected_t = 0.0
        self._last_hello = 0.0
        self._first_batch_logged = False
        self._session = ""  # new for each connection; the consumer treats repeated HELLOs of one as one
        self._first_lease_logged = False
        self.rtt_ms: float | None = None

    # ---------------------------------------------------------------- compute thread
    def _compute(self) -> None:
        wake = self.ctx.socket(zmq.PAIR)
        wake.linger = 0
        wake.connect(self._wake_addr)
        maker: BatchMaker | None = None
        try:
            while not self.stop.is_set():
                if maker is None and self._welcome is not None and self._welcome.config.transforms.models:
                    maker = self._make_maker()  # at joining: a producer model that differs refuses before any lease
                    self._check_models(maker)
                try:
                    *_, generation, lease = self._work.get(timeout=WORK_POLL_S)
                except queue.Empty:
                    continue
                if generation != self._generation or lease.lease not in self._held:
                    continue  # dropped on reconnect, or revoked while waiting
                if maker is None:
                    maker = self._make_maker()
                    self._check_models(maker)
                prepared = maker.make(lease)
                frames = prepared.batch.encode(prepared.arrays)
                if generation != self._generation:
                    continue
                with self._ready_lock:
                    self._ready[lease.lease] = frames
                wake.send(str(lease.lease).encode())
        except BaseException as exc:  # reported by the io thread as an ERROR message
            self._failure = exc
            if not isinstance(exc, UserError):  # a user's error is its one line (run())
                log.exception("producer %s failed while preparing a batch", self.name)
            wake.send(b"failed")
        finally:
            wake.close()

    def _make_maker(self) -> BatchMaker:
        welcome = self._welcome
        assert welcome is not None  # leases come after the WELCOME
        features = welcome.config.features
        device = model_device = None
        if features.backend == "tf" or welcome.config.transforms.models:
            _, model_device = configure_tensorflow(self.memory_mb)
            device = model_device if features.backend == "tf" else None
        cache_dir = welcome.feature_cache
        log.info("%s computing log-mels with %s on %s%s", self.name, features.backend, device or "CPU",
                 f"; feature cache {cache_dir}" if cache_dir else "")
        transforms = welcome.config.transforms
        schema = schema_for(welcome.fields, transforms.fields, transforms.model_fields)
        mel_norm = load(welcome.mel_norm, features.n_mels) if welcome.mel_norm else None
        return BatchMaker(self.root, {}, features, device, self.name, self.host, feature_cache=cache_dir,
                          faults=welcome.config.faults, schema=schema, ref_frames=welcome.ref_frames,
                          transforms=transforms, mel_norm=mel_norm, fixed_rows=welcome.fixed_rows,
                          model_device=model_device)

    # ---------------------------------------------------------------- io thread
    def _connect(self) -> zmq.Socket:
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
        self._connected_t = time.monotonic()
        self._first_lease_logged = self._first_batch_logged = False
        self._session = uuid.uuid4().hex[:12]
        return sock

    def _close(self, sock: zmq.Socket, linger_ms: int = 0) -> None:
        # Read what is waiting first: the kernel resets a connection closed with unread
        # input, and a reset can lose our last message (BYE) on its way out.
        for _ in range(RECV_BURST):
            try:
                sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                break
        if self._monitor is not None:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close()
            self._monitor = None
        sock.close(linger=linger_ms)

    def _send(self, sock: zmq.Socket, msg: wire.Body) -> bool:
        try:
            sock.send_multipart(msg.encode(), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:  # not connected (IMMEDIATE) or the link is full: the caller retries
            log.debug("could not send %s: consumer not reachable", msg.KIND)
            return False

    def _hello(self, sock: zmq.Socket) -> bool:
        described = self._described if self._described is not None else deferred(self.metadata_file)
        sent = self._send(sock, wire.Hello(producer=self.name, host=self.host, pid=os.getpid(),
                                           config=self.config_schema, launcher=os.getppid(),
                                           session=self._session, dataset=described))
        if sent:
            self._last_hello = time.monotonic()
        return sent

    def _describe(self, metadata_file: str, columns: str = COLUMNS_AUTO) -> None:
        started = time.monotonic()
        self._described = describe_copy(self.root, metadata_file, columns)
        self._scanned.add((metadata_file, columns))
        log.info("%s: dataset %s (%s), SHA-256 %s (%.2f s)", self.name, self.root, shown(metadata_file),
                 self._described["sha256"][:16], time.monotonic() - started)

    def _reset_work(self) -> None:
        self._generation += 1
        with self._ready_lock:
            self._ready.clear()
        self._held.clear()
        self._credited.clear()

    def _send_batch(self, sock: zmq.Socket, lease_id: int) -> None:
        with self._ready_lock:
            frames = self._ready.pop(lease_id, None)
        if frames is None:
            self._credited.add(lease_id)
            return
        try:
            sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            if not self._first_batch_logged:
                self._first_batch_logged = True
                log.info("%s: first batch delivered %.2f s after connecting", self.name,
                         time.monotonic() - self._connected_t)
        except zmq.Again:  # the link is down; the consumer revokes the credit and re-plans the batch
            log.warning("%s: could not send the batch of lease %d: consumer not reachable", self.name, lease_id)
        self._held.discard(lease_id)

    def _forget(self, lease_id: int) -> None:
        self._held.discard(lease_id)
        self._credited.discard(lease_id)
        with self._ready_lock:
            self._ready.pop(lease_id, None)

    def _check_transforms(self, welcome: wire.Welcome) -> None:
        """The user transforms (and mel function, features.user) the trainer runs must run here,
        in the same version; Refused (one line, exit status 2) when one is missing or differs."""
        transforms = welcome.config.transforms
        user_mel = welcome.config.features.user
        theirs = welcome.transform_versions
        try:
            mine = {spec: version for spec, _, version in load_user(transforms.user)}
            if user_mel:
                mine[user_mel] = user_mel_function(user_mel)[1]
        except (TransformSetupError, MelFunctionError) as exc:
            raise Refused(f"the trainer's transforms cannot run on host {self.host}: {exc}") from None
        for spec, version in mine.items():
            if theirs.get(spec) != version:
                raise Refused(f"transform {spec} is version {version} on host {self.host} and {theirs.get(spec)} on "
                              f"the trainer: every host must run the same transform code")

    def _check_models(self, maker: BatchMaker) -> None:
        """The producer models (producer/models.py) must be the trainer's: the same source and
        weights; Refused (one line, exit status 2) when one differs."""
        assert self._welcome is not None
        theirs = self._welcome.transform_versions
        for m in maker.models.models if maker.models is not None else ():
            if theirs.get(f"model:{m.spec}") != m.version:
                raise Refused(f"producer model {m.spec} is version {m.version} on host {self.host} and "
                              f"{theirs.get(f'model:{m.spec}')} on the trainer: every host must run the same model "
                              f"code and weights")

    def _handle(self, sock: zmq.Socket, msg: wire.Body, now: float) -> bool:
        """Act on one consumer message; return False when the producer must stop."""
        if isinstance(msg, wire.Welcome):
            first = self._welcome is None
            if first:
                self._check_transforms(msg)
            self._welcome = msg
            self._welcomed.set()
            log.info("%s joined %s as producer %s (%s)", self.name, self.endpoint, msg.producer_name,
                     msg.producer_index)
        elif isinstance(msg, wire.Lease):
            if not self._first_lease_logged:
                self._first_lease_logged = True
                log.info("%s: first lease %.2f s after connecting", self.name, now - self._connected_t)
            self._held.add(msg.lease)
            self._work.put((msg.epoch, msg.index, next(self._order), self._generation, msg))
        elif isinstance(msg, wire.Credit):
            if msg.lease in self._held:
                self._send_batch(sock, msg.lease)
        elif isinstance(msg, wire.Revoke):
            self._forget(msg.lease)
        elif isinstance(msg, wire.Heartbeat):
            pong = msg.pong
            if pong is not None and 0 <= now - pong <= wire.MAX_RTT_S:
                self.rtt_ms = round((now - pong) * 1e3, 3)
        elif isinstance(msg, wire.Stop):
            log.info("%s: consumer says stop (%s)", self.name, msg.reason)
            self._send(sock, wire.Bye(tuple(sorted(self._held))))  # the consumer waits for this
            return False
        elif isinstance(msg, wire.Refuse):
            reason = msg.reason[:1000]
            wanted = msg.metadata_file
            columns = msg.columns if msg.columns is not None else COLUMNS_AUTO
            if msg.rejoin:
                if now - self._last_hello < HELLO_RETRY_S:
                    return True  # answers a message sent before our latest HELLO
                if self._welcomed.is_set():
                    log.warning("%s: the consumer does not know this producer any more; joining again", self.name)
                    self._reset_work()
                    self._welcomed.clear()
                self._hello(sock)
            elif wanted is not None and (wanted, columns) not in self._scanned and "/" not in wanted:
                log.info("%s: the trainer reads %s (columns %r); describing that instead", self.name, wanted,
                         columns)
                self._describe(wanted, columns)
                self._hello(sock)
            else:
                raise Refused(f"the trainer at {self.endpoint} refused this producer: {reason}")
        return True

    def _on_monitor_event(self, event: dict[str, Any]) -> None:
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
                if self._handshake_timed_out:
                    raise Refused(self._not_a_trainer(
                        f"it accepted the connection but did not answer ZeroMQ's greeting in {HANDSHAKE_TIMEOUT_S:g} "
                        "s: another service, such as a web server, listens there"))
                if self.keys is not None:  # a trainer holding another server key closes the link so
                    raise Refused(f"security handshake with {self.endpoint} failed: {self._security_hint()}")
                # A trainer using --keys closes a keyless producer's link so too, when libzmq reports
                # no mechanism mismatch first: both causes are named.
                raise Refused(f"{self.endpoint} closed the connection during ZeroMQ's handshake: "
                              f"{self._security_hint()}, or it is not a stoker trainer's endpoint")

    def _security_hint(self) -> str:
        return ("the trainer does not use --keys, or server.key is not the trainer's" if self.keys
                else "the trainer uses --keys: pass --keys DIR with server.key and a client key pair")

    def _not_a_trainer(self, why: str) -> str:
        return f"{self.endpoint} answered, but not as a stoker trainer ({why}): is this the trainer's endpoint?"

    def _refused(self, exc: UserError) -> int:
        self.status.send("error", type=type(exc).__name__, message=str(exc), where=self.name, user_error=True)
        # Under a launcher, it prints the one line; run alone, this log line is it.
        log.log(logging.DEBUG if self.status.connected else logging.ERROR, "%s", exc)
        return EXIT_USER

    def run(self) -> int:
        """Serve until STOP, a signal or a dead parent; return the exit status."""
        if self.scan:
            self._describe(self.metadata_file)
        wake = self.ctx.socket(zmq.PAIR)
        wake.linger = 0
        wake.bind(self._wake_addr)
        worker = threading.Thread(target=self._compute, name=f"{self.name}-compute", daemon=True)
        worker.start()
        started = time.monotonic()
        link = _Link(self._connect(), zmq.Poller(), last_heard=started, last_beat=started)
        self._watch(link)
        link.poller.register(wake, zmq.POLLIN)
        link.hello_sent = self._hello(link.sock)
        try:
            while not self.stop.is_set():
                events = dict(link.poller.poll(POLL_INTERVAL_MS))
                now = time.monotonic()
                if wake in events and not self._on_wake(link.sock, wake.recv()):
                    if isinstance(self._failure, UserError):  # a model that differs or fails: one line
                        self._close(link.sock, FINAL_LINGER_MS)
                        return self._refused(self._failure)
                    self.status.error(self._failure or RuntimeError("compute thread failed"), self.name)
                    self._close(link.sock, FINAL_LINGER_MS)
                    return EXIT_FAILED
                if self._monitor is not None and self._monitor in events:
                    self._on_monitor_events(link)
                if link.sock in events and not self._receive(link, now):
                    break  # STOP was answered with BYE already
                if not parent_alive(self.parent_pid):
                    log.warning("%s: parent process is gone, exiting", self.name)
                    return EXIT_FAILED
                if not self._keep_alive(link, now):
                    break
            else:
                if self._held:
                    log.info("%s: leaving, returning %d leases", self.name, len(self._held))
                self._send(link.sock, wire.Bye(tuple(sorted(self._held))))
            return EXIT_OK
        except Refused as exc:
            return self._refused(exc)
        finally:
            self.stop.set()
            worker.join(timeout=2.0)
            if not link.sock.closed:
                self._close(link.sock, FINAL_LINGER_MS)
            wake.close()

    def _watch(self, link: "_Link") -> None:
        link.poller.register(link.sock, zmq.POLLIN)
        assert self._monitor is not None
        link.poller.register(self._monitor, zmq.POLLIN)

    def _unwatch(self, link: "_Link") -> None:
        link.poller.unregister(link.sock)
        if self._monitor is not None:
            link.poller.unregister(self._monitor)

    def _on_wake(self, sock: zmq.Socket, token: bytes) -> bool:
        """The compute thread finished a lease (or failed: False, after a fatal ERROR is sent)."""
        if token == b"failed":
            exc = self._failure or RuntimeError("compute thread failed")
            self._send(sock, wire.Error.of(exc, self.name, fatal=True))
            return False
        lease_id = int(token)
        if lease_id in self._credited:
            self._credited.discard(lease_id)
            self._send_batch(sock, lease_id)
        elif lease_id in self._held:
            self._send(sock, wire.Ready(lease_id))
        else:  # revoked while it was being prepared
            self._forget(lease_id)
        return True

    def _on_monitor_events(self, link: "_Link") -> None:
        assert self._monitor is not None
        while True:
            try:
                event = recv_monitor_message(self._monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_monitor_event(event)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self._welcomed.is_set() and not link.hello_sent:
                link.hello_sent = self._hello(link.sock)  # the link is up: join now, not at the next retry

    def _receive(self, link: "_Link", now: float) -> bool:
        """A bounded burst of the consumer's messages (heartbeats and the wake socket get their
        turn after it); False once told STOP."""
        for _ in range(RECV_BURST):
            try:
                frames = link.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = self._read(frames)
            if msg is None:
                continue
            link.last_heard = now
            link.backoff = RECONNECT_MIN_S
            if isinstance(msg, wire.Welcome):
                link.interval = msg.heartbeat_interval_s
                link.timeout = msg.heartbeat_timeout_s
            if not self._handle(link.sock, msg, now):
                return False
        return True

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
            if msg.kind == wire.WELCOME and self._welcome is None:
                raise Refused(f"the trainer at {self.endpoint} sent a WELCOME this producer cannot take ({exc}): "
                              f"run the trainer's stoker version on host {self.host}") from None
            log.warning("dropped a malformed message from the consumer: %s", exc)
            return None

    def _keep_alive(self, link: "_Link", now: float) -> bool:
        """Heartbeats once welcomed; HELLO again until then; reconnect when the consumer has
        been silent too long. False when stopped while waiting to reconnect."""
        if self._welcomed.is_set() and now - link.last_beat >= link.interval:
            with self._ready_lock:
                ready = len(self._ready)
            self._send(link.sock, wire.Heartbeat(ready=ready, working=len(self._held) - ready, ping=now,
                                                 rtt_ms=self.rtt_ms))
            link.last_beat = now
        if not self._welcomed.is_set():
            if not link.hello_sent or now - self._last_hello >= HELLO_RETRY_S:
                link.hello_sent = self._hello(link.sock)
            if now - max(self._connected_t, link.last_waiting_note) >= WAITING_NOTE_S:
                if self._handshake_failures:  # something answers there, but not (yet) as a trainer
                    log.info("%s: waiting for the trainer at %s (a connection is accepted there, but %d ZeroMQ "
                             "handshake(s) failed in %.0f s)", self.name, self.endpoint, self._handshake_failures,
                             now - self._connected_t)
                else:
                    log.info("%s: waiting for the trainer at %s (no answer for %.0f s)", self.name, self.endpoint,
                             now - self._connected_t)
                link.last_waiting_note = now
        elif now - link.last_heard > link.timeout:
            log.warning("%s: consumer silent for %.1f s; dropping %d leases and reconnecting in %.1f s",
                        self.name, now - link.last_heard, len(self._held), link.backoff)
            self._reset_work()
            self._welcomed.clear()
            self._unwatch(link)
            self._close(link.sock)
            if self.stop.wait(link.backoff):
                return False
            link.backoff = min(link.backoff * 2, RECONNECT_MAX_S)
            link.sock = self._connect()
            self._watch(link)
            link.hello_sent = self._hello(link.sock)
            link.last_heard = time.monotonic()
        return True


@dataclass
class _Link:
    """A producer's connection to its consumer, and what it knows of the consumer's liveness."""

    sock: zmq.Socket
    poller: zmq.Poller
    last_heard: float
    last_beat: float = 0.0
    hello_sent: bool = False
    backoff: float = RECONNECT_MIN_S
    # Until the WELCOME says the trainer's settings, the config's defaults (written once, there).
    interval: float = PipelineConfig.heartbeat_interval_s
    timeout: float = PipelineConfig.heartbeat_timeout_s
    last_waiting_note: float = 0.0

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.producer.worker")
    parser.add_argument("--connect", required=True)
    parser.add_argument("--data", default="")
    parser.add_argument("--name", default=f"p0@{pysocket.gethostname()}")
    parser.add_argument("--keys", default="", help="CURVE keys directory (server.key and a client key pair)")
    parser.add_argument("--metadata-file", default="metadata.csv")
    parser.add_argument("--local", action="store_true",
                        help="started on the trainer's host: read no metadata, join at once (leases carry the clips)")
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--gpu-memory-mb", type=int, default=None)
    parser.add_argument("--status-fd", type=int, default=None)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    setup_logging(args.name, args.log_level)
    status = StatusWriter(args.status_fd)
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        die_with_parent(args.parent_pid)
        root, metadata_file = locate(args.data, args.metadata_file)
        keys = load_client_keys(Path(args.keys)) if args.keys else None
        producer = Producer(args.connect, root, args.name, stop, args.parent_pid, args.gpu_memory_mb, status,
                            keys=keys, metadata_file=metadata_file, scan=not args.local)
        code = producer.run()
        flush_sockets(FINAL_LINGER_MS / 1000)  # the BYE must reach the consumer: it re-plans our leases at once
        return code
    except UserError as exc:  # the dataset or the keys: the user's to fix
        status.error(exc, args.name, user_error=True)
        log.log(logging.DEBUG if status.connected else logging.ERROR, "%s", exc)
        return EXIT_USER
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_FAILED
    except Exception as exc:
        status.error(exc, args.name)
        log.exception("producer %s failed", args.name)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
