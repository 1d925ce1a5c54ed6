"""A producer process: planned batches (leases) in, padded batches out, against credits.

Two threads: the io thread keeps a link to each trainer it serves (producer/link.py; the
ranks of a host may share a producer) and each trainer's lease book (LEASE in, READY when a
batch is prepared, BATCH on its CREDIT, BYE on stop); the compute thread prepares the leases
(producer/batches.py), the lowest (epoch, index) first, so that re-planned work goes before
new work and ranks in step are served in step. The story: docs/design/processes.md,
"Processes", "Shutdown protocol"; docs/design/protocol.md, "Producers on other hosts" (joining,
missing clips, liveness and reconnection); docs/design/training.md, "torchrun ranks".
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import queue
import select
import socket as pysocket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import zmq

from .batches import BatchMaker
from .features import preload
from .link import HELLO_RETRY_S, Link, Refused
from .models import frameworks_of
from .models_tf import FRAMEWORK as TF_MODELS
from .transforms import TransformSetupError, load_user
from ..shared import wire
from ..shared.batch import schema_for
from ..shared.dataset.agreement import deferred, describe_copy
from ..shared.dataset.corpus.registry import locate
from ..shared.dataset.storage import shown
from ..shared.errors import UserError
from ..shared.keys import ClientKeys, load_client_keys
from ..shared.dataset.layouts import COLUMNS_AUTO
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
# A producer started before its trainer bound (--connect-later) looks for its endpoints this often.
ENDPOINTS_POLL_S = 0.2


def endpoints_from(fd: int, stop: threading.Event) -> list[str]:
    """The trainers' endpoints that the launcher writes on ``fd`` once they are bound (one line,
    space-separated); [] at the end of the file (no trainer bound) or on stop."""
    data = b""
    while not stop.is_set():
        if not select.select([fd], [], [], ENDPOINTS_POLL_S)[0]:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            return []
        data += chunk
        if b"\n" in data:
            return data.split(b"\n", 1)[0].decode().split()
    return []


def recipe(welcome: wire.Welcome) -> tuple[Any, ...]:
    """What a WELCOME says of how batches are made: trainers a producer serves at once must agree."""
    return (welcome.config, welcome.fields, welcome.fixed_rows, welcome.ref_frames, welcome.transform_versions,
            welcome.feature_cache, welcome.mel_norm, welcome.token_pad)


class Book:
    """What a producer holds for one trainer: the link, the trainer's WELCOME, the leases given
    and not delivered yet, the batches ready (guarded by the producer's lock) and the credits
    that came before their batch."""

    def __init__(self, index: int, link: Link) -> None:
        self.index = index
        self.link = link
        self.welcome: wire.Welcome | None = None
        self.held: set[int] = set()
        self.credited: set[int] = set()
        self.ready: dict[int, list[Any]] = {}
        self.generation = 0  # bumps on reconnect; work of an older generation is dropped
        self.done = False  # said BYE to the trainer's STOP: served no more


class Producer:
    """One producer: a link and a lease book per trainer it serves (the ranks of a host share a
    producer so), and its compute thread, which prepares every trainer's leases in plan order."""

    def __init__(self, endpoints: str | list[str], data_root: Path, name: str, stop: threading.Event,
                 parent_pid: int | None = None, memory_mb: int | None = None,
                 status: StatusWriter | None = None, context: zmq.Context | None = None,
                 keys: ClientKeys | None = None, metadata_file: str = "metadata.csv",
                 config_schema: wire.ConfigSchema | None = None, scan: bool = True) -> None:
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
        self.poller = zmq.Poller()
        endpoints = [endpoints] if isinstance(endpoints, str) else list(dict.fromkeys(endpoints))
        self.books = [Book(i, Link(self.ctx, e, name, self.host, keys, self._hello, self.poller))
                      for i, e in enumerate(endpoints)]
        self._wake_addr = f"inproc://producer-wake-{uuid.uuid4().hex}"
        self._work: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()  # ties in (epoch, index) keep arrival order
        self._ready_lock = threading.Lock()
        self._failure: BaseException | None = None
        self._welcome: wire.Welcome | None = None  # the settings batches are made with (recipe)
        self._described: dict[str, Any] | None = None  # the HELLO's dataset (None: agreement.deferred)
        self._scanned: set[tuple[str, str]] = set()  # (metadata file, data.columns) described so far

    # ---------------------------------------------------------------- compute thread
    def _compute(self) -> None:
        wake = self.ctx.socket(zmq.PAIR)
        wake.linger = 0
        wake.connect(self._wake_addr)
        maker: BatchMaker | None = None
        made_for: wire.Welcome | None = None  # the WELCOME maker follows (_on_welcome replaces it on a new recipe)
        try:
            while not self.stop.is_set():
                welcome = self._welcome
                if welcome is not None and (welcome is not made_for if maker is not None
                                            else bool(welcome.config.transforms.models)):
                    # at joining: a producer model that differs refuses before any lease
                    maker, made_for = self._make_maker(welcome), welcome
                try:
                    *_, book_index, generation, lease = self._work.get(timeout=WORK_POLL_S)
                except queue.Empty:
                    continue
                book = self.books[book_index]
                if generation != book.generation or lease.lease not in book.held:
                    continue  # dropped on reconnect, or revoked while waiting
                if maker is None:
                    assert self._welcome is not None  # leases come after a WELCOME
                    maker, made_for = self._make_maker(self._welcome), self._welcome
                prepared = maker.make(lease)
                frames = prepared.batch.encode(prepared.arrays)
                if generation != book.generation:
                    continue
                with self._ready_lock:
                    book.ready[lease.lease] = frames
                wake.send(f"{book_index}:{lease.lease}".encode())
        except BaseException as exc:  # reported by the io thread as an ERROR message
            self._failure = exc
            if not isinstance(exc, UserError):  # a user's error is its one line (run())
                log.exception("producer %s failed while preparing a batch", self.name)
            wake.send(b"failed")
        finally:
            wake.close()

    def _make_maker(self, welcome: wire.Welcome) -> BatchMaker:
        """A batch maker for ``welcome``'s settings, its producer models checked against the trainer's."""
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
        maker = BatchMaker(self.root, {}, features, device, self.name, self.host, feature_cache=cache_dir,
                           faults=welcome.config.faults, schema=schema, ref_frames=welcome.ref_frames,
                           transforms=transforms, mel_norm=mel_norm, fixed_rows=welcome.fixed_rows,
                           model_device=model_device, model_memory_mb=self.memory_mb, token_pad=welcome.token_pad)
        self._check_models(maker, welcome)
        return maker

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

    def _check_models(self, maker: BatchMaker, welcome: wire.Welcome) -> None:
        """The producer models (producer/models.py) must be the trainer's: the same source and
        weights; Refused (one line, exit status 2) when one differs."""
        theirs = welcome.transform_versions
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

    def _reset_work(self, book: Book) -> None:
        book.generation += 1
        with self._ready_lock:
            book.ready.clear()
        book.held.clear()
        book.credited.clear()

    def _send_batch(self, book: Book, lease_id: int) -> None:
        with self._ready_lock:
            frames = book.ready.pop(lease_id, None)
        if frames is None:
            book.credited.add(lease_id)
            return
        if book.link.send_frames(frames):
            book.link.first("batch delivered", time.monotonic())
        else:  # the link is down; the consumer revokes the credit and re-plans the batch
            log.warning("%s: could not send the batch of lease %d to %s: consumer not reachable", self.name,
                        lease_id, book.link.endpoint)
        book.held.discard(lease_id)

    def _forget(self, book: Book, lease_id: int) -> None:
        book.held.discard(lease_id)
        book.credited.discard(lease_id)
        with self._ready_lock:
            book.ready.pop(lease_id, None)

    def _handle(self, book: Book, msg: wire.Body, now: float) -> bool:
        """Act on one message of ``book``'s trainer; False when it said STOP (answered with BYE)."""
        if isinstance(msg, wire.Welcome):
            self._on_welcome(book, msg)
        elif isinstance(msg, wire.Lease):
            book.link.first("lease", now)
            book.held.add(msg.lease)
            self._work.put((msg.epoch, msg.index, next(self._order), book.index, book.generation, msg))
        elif isinstance(msg, wire.Credit):
            if msg.lease in book.held:
                self._send_batch(book, msg.lease)
        elif isinstance(msg, wire.Revoke):
            self._forget(book, msg.lease)
        elif isinstance(msg, wire.Stop):
            log.info("%s: consumer says stop (%s): %s", self.name, book.link.endpoint, msg.reason)
            book.link.send(wire.Bye(tuple(sorted(book.held))))  # the consumer waits for this
            book.done = True
            self._reset_work(book)  # its leases are not prepared for nobody
            return False
        elif isinstance(msg, wire.Refuse):
            self._on_refuse(book, msg, now)
        return True

    def _on_welcome(self, book: Book, msg: wire.Welcome) -> None:
        """Joined ``book``'s trainer: its settings are the ones batches are made with, and every
        other trainer this producer serves must have the same (Refused, one line, otherwise)."""
        for other in self.books:
            if other is not book and not other.done and other.welcome is not None \
                    and recipe(other.welcome) != recipe(msg):
                raise Refused(f"the trainers at {other.link.endpoint} and {book.link.endpoint} make batches with "
                              f"other settings (config, batch fields or transforms): a producer serves the ranks "
                              f"of one job")
        if self._welcome is None or recipe(self._welcome) != recipe(msg):
            self._check_transforms(msg)
            self._welcome = msg
        book.welcome = msg
        log.info("%s joined %s as producer %s (%s)", self.name, book.link.endpoint, msg.producer_name,
                 msg.producer_index)

    def _on_refuse(self, book: Book, msg: wire.Refuse, now: float) -> None:
        """HELLO again when the trainer does not know this producer (its work dropped) or reads
        another metadata file (described first); else Refused, the trainer's reason its line."""
        link = book.link
        wanted = msg.metadata_file
        columns = msg.columns if msg.columns is not None else COLUMNS_AUTO
        if msg.rejoin:
            if now - link.last_hello < HELLO_RETRY_S:
                return  # answers a message sent before our latest HELLO
            if link.welcomed:
                log.warning("%s: the consumer at %s does not know this producer any more; joining again", self.name,
                            link.endpoint)
                self._reset_work(book)
                link.welcomed = False
            link.say_hello()
        elif wanted is not None and (wanted, columns) not in self._scanned and "/" not in wanted:
            log.info("%s: the trainer reads %s (columns %r); describing that instead", self.name, wanted, columns)
            self._describe(wanted, columns)
            for other in self.books:
                if not other.done and not other.link.welcomed:
                    other.link.say_hello()
        else:
            raise Refused(f"the trainer at {link.endpoint} refused this producer: {msg.reason[:1000]}")

    def _refused(self, exc: UserError) -> int:
        self.status.send("error", type=type(exc).__name__, message=str(exc), where=self.name, user_error=True)
        # Under a launcher, it prints the one line; run alone, this log line is it.
        log.log(logging.DEBUG if self.status.connected else logging.ERROR, "%s", exc)
        return EXIT_USER

    def _serving(self) -> list[Book]:
        return [book for book in self.books if not book.done]

    def run(self) -> int:
        """Serve until every trainer said STOP, a signal or a dead parent; return the exit status."""
        if self.scan:
            self._describe(self.metadata_file)
        wake = self.ctx.socket(zmq.PAIR)
        wake.linger = 0
        wake.bind(self._wake_addr)
        worker = threading.Thread(target=self._compute, name=f"{self.name}-compute", daemon=True)
        worker.start()
        self.poller.register(wake, zmq.POLLIN)
        for book in self.books:
            book.link.open()
            book.link.say_hello()
        try:
            while not self.stop.is_set():
                events = dict(self.poller.poll(POLL_INTERVAL_MS))
                now = time.monotonic()
                if wake in events and not self._on_wake(wake.recv()):
                    self._close_links(FINAL_LINGER_MS)
                    if isinstance(self._failure, UserError):  # a model that differs or fails: one line
                        return self._refused(self._failure)
                    self.status.error(self._failure or RuntimeError("compute thread failed"), self.name)
                    return EXIT_FAILED
                for book in self._serving():
                    self._receive(book, events, now)
                if not self._serving():
                    break  # every trainer's STOP was answered with BYE already
                if not parent_alive(self.parent_pid):
                    log.warning("%s: parent process is gone, exiting", self.name)
                    return EXIT_FAILED
                for book in self._serving():
                    self._keep_alive(book, now)
            else:
                for book in self._serving():
                    if book.held:
                        log.info("%s: leaving %s, returning %d leases", self.name, book.link.endpoint, len(book.held))
                    if book.link.reopen_at is None:
                        book.link.send(wire.Bye(tuple(sorted(book.held))))
            return EXIT_OK
        except Refused as exc:
            return self._refused(exc)
        finally:
            self.stop.set()
            worker.join(timeout=2.0)
            self._close_links(FINAL_LINGER_MS)
            wake.close()

    def _receive(self, book: Book, events: dict[Any, int], now: float) -> None:
        """``book``'s link: its socket monitor's news and its trainer's messages; closed after STOP."""
        link = book.link
        if link.reopen_at is not None:
            return  # closed until its back-off is over
        link.on_events(events)
        if link.sock in events and not all(self._handle(book, msg, now) for msg in link.receive(now)):
            link.close(FINAL_LINGER_MS)

    def _close_links(self, linger_ms: int) -> None:
        for book in self.books:
            book.link.close(linger_ms)

    def _on_wake(self, token: bytes) -> bool:
        """The compute thread finished a lease (or failed: False, after a fatal ERROR is sent)."""
        if token == b"failed":
            exc = self._failure or RuntimeError("compute thread failed")
            for book in self._serving():
                book.link.send(wire.Error.of(exc, self.name, fatal=True))
            return False
        index, _, lease = token.partition(b":")
        book, lease_id = self.books[int(index)], int(lease)
        if lease_id in book.credited:
            book.credited.discard(lease_id)
            self._send_batch(book, lease_id)
        elif lease_id in book.held:
            book.link.send(wire.Ready(lease_id))
        else:  # revoked while it was being prepared
            self._forget(book, lease_id)
        return True

    def _keep_alive(self, book: Book, now: float) -> None:
        """Heartbeats once joined, HELLO until then; when the trainer has been silent too long,
        its leases dropped and its link made again after a back-off (the other trainers served
        meanwhile)."""
        link = book.link
        if link.reopen_at is not None:
            link.reopen(now)
            return
        if not link.welcomed:
            link.court(now)
            return
        with self._ready_lock:
            ready = len(book.ready)
        link.beat(now, ready, len(book.held) - ready)
        if not link.silent(now):
            return
        log.warning("%s: consumer silent for %.1f s; dropping %d leases and reconnecting to %s in %.1f s",
                    self.name, now - link.last_heard, len(book.held), link.endpoint, link.backoff)
        self._reset_work(book)
        link.drop(now)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.producer.worker")
    parser.add_argument("--connect", action="append", default=[],
                        help="a trainer's endpoint; once per trainer served (the ranks of a host)")
    parser.add_argument("--connect-later", action="store_true",
                        help="started before the trainer bound: its endpoints come as one line on stdin")
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
    if not args.connect and not args.connect_later:
        parser.error("--connect is required")
    setup_logging(args.name, args.log_level)
    status = StatusWriter(args.status_fd)
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        die_with_parent(args.parent_pid)
        root, metadata_file = locate(args.data, args.metadata_file).where
        keys = load_client_keys(Path(args.keys)) if args.keys else None
        endpoints = args.connect
        if args.connect_later:  # the first batch's imports while the trainer starts, then its endpoint
            preload()
            endpoints = endpoints_from(sys.stdin.fileno(), stop)
            if not endpoints:
                log.debug("%s: no trainer to serve (no endpoint came)", args.name)
                return EXIT_OK
        producer = Producer(endpoints, root, args.name, stop, args.parent_pid, args.gpu_memory_mb, status,
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
