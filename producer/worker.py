"""A producer process: planned batches (leases) in, padded batches out, against credits.

Two threads: the io thread keeps the link to the trainer (producer/link.py) and the lease
book (LEASE in, READY when a batch is prepared, BATCH on its CREDIT, BYE on stop); the compute
thread prepares the leases (producer/batches.py), the lowest (epoch, index) first, so that
re-planned work goes before new work. docs/DESIGN.md has the story (Processes, Producers on
other hosts: joining, missing clips, liveness and reconnection; Shutdown protocol).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import queue
import socket as pysocket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import zmq

from .batches import BatchMaker
from .link import HELLO_RETRY_S, Link, Refused
from .models import frameworks_of
from .models_tf import FRAMEWORK as TF_MODELS
from .transforms import TransformSetupError, load_user
from ..shared import wire
from ..shared.batch import schema_for
from ..shared.dataset import deferred, describe_copy, locate
from ..shared.dataset.storage import shown
from ..shared.errors import UserError
from ..shared.keys import ClientKeys, load_client_keys
from ..shared.layouts import COLUMNS_AUTO
from ..shared.mel import MelFunctionError, user_mel_function
from ..shared.melstats import load
from ..shared.proc import EXIT_FAILED, EXIT_OK, EXIT_USER, StatusWriter, die_with_parent, flush_sockets, \
    install_stop_handlers, parent_alive, setup_logging
from ..shared.tfsetup import configure_tensorflow

log = logging.getLogger("producer")

# The io thread wakes at least this often to send heartbeats and check its parent.
POLL_INTERVAL_MS = 100
# How long the compute thread waits for work before re-checking the stop flag.
WORK_POLL_S = 0.2
# Closing the socket after BYE or an ERROR: give the last message this long to leave.
FINAL_LINGER_MS = 500


class Producer:
    """One producer: its link to the trainer, its lease book and its compute thread."""

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
        self.metadata_file = metadata_file
        self.scan = scan  # False: hashes no metadata (agreement.deferred: the trainer's own files)
        self.config_schema = config_schema or wire.ConfigSchema.local()  # the config keys it takes (HELLO)
        self.host = pysocket.gethostname()
        self.link = Link(self.ctx, endpoint, name, self.host, keys, self._hello)
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
        self._described: dict[str, Any] | None = None  # the HELLO's dataset (None: agreement.deferred)
        self._scanned: set[tuple[str, str]] = set()  # (metadata file, data.columns) described so far

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
        tf_models = TF_MODELS in frameworks_of(welcome.transform_versions)  # PyTorch's and JAX's need none
        if features.backend == "tf" or tf_models:
            _, tf_device = configure_tensorflow(self.memory_mb)
            device = tf_device if features.backend == "tf" else None
            model_device = tf_device if tf_models else None
        cache_dir = welcome.feature_cache
        log.info("%s computing log-mels with %s on %s%s", self.name, features.backend, device or "CPU",
                 f"; feature cache {cache_dir}" if cache_dir else "")
        transforms = welcome.config.transforms
        schema = schema_for(welcome.fields, transforms.fields, transforms.model_fields)
        mel_norm = load(welcome.mel_norm, features.n_mels) if welcome.mel_norm else None
        return BatchMaker(self.root, {}, features, device, self.name, self.host, feature_cache=cache_dir,
                          faults=welcome.config.faults, schema=schema, ref_frames=welcome.ref_frames,
                          transforms=transforms, mel_norm=mel_norm, fixed_rows=welcome.fixed_rows,
                          model_device=model_device, model_memory_mb=self.memory_mb)

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

    # ---------------------------------------------------------------- io thread
    def _hello(self, session: str) -> wire.Hello:
        """The HELLO of a connection's session: who this producer is, its config schema and its dataset."""
        described = self._described if self._described is not None else deferred(self.metadata_file)
        return wire.Hello(producer=self.name, host=self.host, pid=os.getpid(), config=self.config_schema,
                          launcher=os.getppid(), session=session, dataset=described)

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

    def _send_batch(self, lease_id: int) -> None:
        with self._ready_lock:
            frames = self._ready.pop(lease_id, None)
        if frames is None:
            self._credited.add(lease_id)
            return
        if self.link.send_frames(frames):
            self.link.first("batch delivered", time.monotonic())
        else:  # the link is down; the consumer revokes the credit and re-plans the batch
            log.warning("%s: could not send the batch of lease %d: consumer not reachable", self.name, lease_id)
        self._held.discard(lease_id)

    def _forget(self, lease_id: int) -> None:
        self._held.discard(lease_id)
        self._credited.discard(lease_id)
        with self._ready_lock:
            self._ready.pop(lease_id, None)

    def _handle(self, msg: wire.Body, now: float) -> bool:
        """Act on one consumer message; return False when the producer must stop."""
        if isinstance(msg, wire.Welcome):
            if self._welcome is None:
                self._check_transforms(msg)
            self._welcome = msg
            log.info("%s joined %s as producer %s (%s)", self.name, self.endpoint, msg.producer_name,
                     msg.producer_index)
        elif isinstance(msg, wire.Lease):
            self.link.first("lease", now)
            self._held.add(msg.lease)
            self._work.put((msg.epoch, msg.index, next(self._order), self._generation, msg))
        elif isinstance(msg, wire.Credit):
            if msg.lease in self._held:
                self._send_batch(msg.lease)
        elif isinstance(msg, wire.Revoke):
            self._forget(msg.lease)
        elif isinstance(msg, wire.Stop):
            log.info("%s: consumer says stop (%s)", self.name, msg.reason)
            self.link.send(wire.Bye(tuple(sorted(self._held))))  # the consumer waits for this
            return False
        elif isinstance(msg, wire.Refuse):
            self._on_refuse(msg, now)
        return True

    def _on_refuse(self, msg: wire.Refuse, now: float) -> None:
        """HELLO again when the trainer does not know this producer (its work dropped) or reads
        another metadata file (described first); else Refused, the trainer's reason its line."""
        wanted = msg.metadata_file
        columns = msg.columns if msg.columns is not None else COLUMNS_AUTO
        if msg.rejoin:
            if now - self.link.last_hello < HELLO_RETRY_S:
                return  # answers a message sent before our latest HELLO
            if self.link.welcomed:
                log.warning("%s: the consumer does not know this producer any more; joining again", self.name)
                self._reset_work()
                self.link.welcomed = False
            self.link.say_hello()
        elif wanted is not None and (wanted, columns) not in self._scanned and "/" not in wanted:
            log.info("%s: the trainer reads %s (columns %r); describing that instead", self.name, wanted, columns)
            self._describe(wanted, columns)
            self.link.say_hello()
        else:
            raise Refused(f"the trainer at {self.endpoint} refused this producer: {msg.reason[:1000]}")

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
        link = self.link
        link.open()
        link.poller.register(wake, zmq.POLLIN)
        link.say_hello()
        try:
            while not self.stop.is_set():
                events = dict(link.poller.poll(POLL_INTERVAL_MS))
                now = time.monotonic()
                if wake in events and not self._on_wake(wake.recv()):
                    link.close(FINAL_LINGER_MS)
                    if isinstance(self._failure, UserError):  # a model that differs or fails: one line
                        return self._refused(self._failure)
                    self.status.error(self._failure or RuntimeError("compute thread failed"), self.name)
                    return EXIT_FAILED
                link.on_events(events)
                if link.sock in events and not all(self._handle(msg, now) for msg in link.receive(now)):
                    break  # STOP was answered with BYE already
                if not parent_alive(self.parent_pid):
                    log.warning("%s: parent process is gone, exiting", self.name)
                    return EXIT_FAILED
                if not self._keep_alive(now):
                    break
            else:
                if self._held:
                    log.info("%s: leaving, returning %d leases", self.name, len(self._held))
                link.send(wire.Bye(tuple(sorted(self._held))))
            return EXIT_OK
        except Refused as exc:
            return self._refused(exc)
        finally:
            self.stop.set()
            worker.join(timeout=2.0)
            link.close(FINAL_LINGER_MS)
            wake.close()

    def _on_wake(self, token: bytes) -> bool:
        """The compute thread finished a lease (or failed: False, after a fatal ERROR is sent)."""
        if token == b"failed":
            exc = self._failure or RuntimeError("compute thread failed")
            self.link.send(wire.Error.of(exc, self.name, fatal=True))
            return False
        lease_id = int(token)
        if lease_id in self._credited:
            self._credited.discard(lease_id)
            self._send_batch(lease_id)
        elif lease_id in self._held:
            self.link.send(wire.Ready(lease_id))
        else:  # revoked while it was being prepared
            self._forget(lease_id)
        return True

    def _keep_alive(self, now: float) -> bool:
        """Heartbeats once joined, HELLO until then; when the trainer has been silent too long,
        the leases dropped and the link made again. False when stopped while waiting to reconnect."""
        link = self.link
        if not link.welcomed:
            link.court(now)
            return True
        with self._ready_lock:
            ready = len(self._ready)
        link.beat(now, ready, len(self._held) - ready)
        if not link.silent(now):
            return True
        log.warning("%s: consumer silent for %.1f s; dropping %d leases and reconnecting in %.1f s",
                    self.name, now - link.last_heard, len(self._held), link.backoff)
        self._reset_work()
        return link.reconnect(self.stop)


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
