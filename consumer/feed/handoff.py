"""The trainer process's side of the coordinator process (consumer/coordinator/coordproc.py).

:class:`CoordinatorProcess` spawns it (never forks: the trainer may have imported TensorFlow
or torch) and hands it the run in one start file. Then the thread that asks the trainer's queue
for a batch receives (:meth:`CoordinatorProcess.receive`, the queues' pump): each batch
descriptor becomes a :class:`QueuedBatch` of read-only views of its shared-memory slot in the
queue, and the figures the coordinator publishes are kept. No thread of the feed's takes the
interpreter while the loop's step runs. It offers what the feed core asked of the in-process coordinator
(alive, snapshot, rejected_in_epoch, validation passes, mel statistics, failure). The messages
are consumer/protocol.py's; the rule for slots and shutdown are in docs/design/processes.md, "The
coordinator process".
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import msgpack
import numpy as np
import zmq

from .. import protocol as proto
from ..buffer import BatchQueue, QueuedBatch, QueueFull
from ..plan import as_table, row_type
from ..position import InputPosition
from ..protocol import BindError
from ..slots import SlotFile, slot_bytes
from .validation import VALIDATION_QUEUE_CAPACITY
from ...shared import config as config_mod
from ...shared.dataset.cache import write_index
from ...shared.errors import UserError
from ...shared.dataset.layouts import Rejection
from ...shared.melstats import MelStats
from ...shared.proc import caller_path
from ...shared.runfiles import VOCAB

log = logging.getLogger("consumer.coordinator")

# Where the slots live: memory, not a disk (the system's temporary directory where it has no room).
SHM_DIR = Path("/dev/shm")
# The coordinator process reads the start file, plans and binds within this (a large index's columns).
START_TIMEOUT_S = 300.0
# A thread waiting for a message looks at the coordinator process this often, and lets another
# thread that asks meanwhile receive (one socket, one thread at a time).
RECEIVE_SLICE_S = 0.05
# On close: the coordinator process says STOP to every producer (coordinator.STOP_ACK_S), its
# sockets linger, it says goodbye; then it is killed.
BYE_TIMEOUT_S = 4.0
# The directory holding this stoker package: first on the coordinator process's PYTHONPATH.
PACKAGE = __package__ or ""
PACKAGE_PARENT = Path(sys.modules[PACKAGE.partition(".")[0]].__file__ or ".").parent.parent


class CoordinatorError(UserError):
    """The coordinator process could not start for a reason the user fixes (one line)."""


class CoordinatorGone(RuntimeError):
    """The coordinator process failed or ended without its goodbye; the message is one line."""


def write_start(path: Path, prepared: Any, position: InputPosition | None, mel_norm: dict[str, Any] | None,
                slots: dict[str, int]) -> list[int]:
    """DIR/start: the run as the coordinator process needs it (coordproc._parts reads it): the
    config, the planner's settings, the clips' columns, the input position to resume from and the
    slots. Columns held in a mapped index cache file are not copied: the process is given that
    file's descriptor (returned here, to pass to it) and a view's rows; others are written (a
    view's rows with its table's columns)."""
    cfg, planner = prepared.cfg, prepared.planner
    index = prepared.index
    header: dict[str, Any] = {
        "cfg": config_mod.to_dict(cfg), "planner": [planner.replicas, planner.workers, planner.worker],
        "check": [planner.batches_per_epoch, [list(s) for s in planner.shapes]],
        "max_epochs": cfg.trainer.epochs, "resume": position.state_dict() if position is not None else None,
        "vocabulary": str(prepared.run_dir / VOCAB), "mel_norm": mel_norm, "slots": slots,
        "refs": "ref_mel" in config_mod.batch_schema(cfg).names, "val_positions": prepared.val_positions,
        "dataset": [str(index.root), index.metadata_file, index.columns, index.agreement["metadata_sha256"]],
        "buckets": [[b.max_tokens, b.max_frames, b.rows, len(b.members)] for b in planner.buckets],
        "plan_files": str(planner.files.directory) if planner.files is not None else None}
    # The buckets the trainer process made: the coordinator process maps their file (plan files), or
    # takes them from here, not making them again.
    sections: dict[str, Any] = {}
    if planner.files is None:
        members = np.concatenate([b.members for b in planner.buckets] or [np.zeros(0, np.int64)])
        sections[proto.BUCKET_MEMBERS] = members.astype(row_type(len(planner.table)), copy=False)
        header["members_dtype"] = sections[proto.BUCKET_MEMBERS].dtype.str
    passed: set[int] = set()
    for name, samples in (("train", prepared.train_samples), ("val", prepared.val_samples)):
        table = as_table(samples)
        rows = table._rows  # a view (a hold-out): its table's columns go once, with the rows it keeps
        cached = table.stored_in
        if cached is not None and cached.reader is not None:
            header[name] = {"index_fd": cached.reader.fileno(), "checked": cached.checked}
            passed.add(cached.reader.fileno())
            if rows is not None:
                sections[f"{name}.rows"] = np.ascontiguousarray(rows, np.int64)
            continue
        if rows is not None:
            table = table.whole()
            sections[f"{name}.rows"] = np.ascontiguousarray(rows, np.int64)
        header[name] = {"speakers": table.speakers, "languages": table.languages}
        sections.update({f"{name}.{key}": value for key, value in table.sections().items()})
    with open(path, "wb") as f:
        write_index(f, header, sections)
    return sorted(passed)


class CoordinatorProcess:
    """The coordinator in a process of its own, as the feed core sees it (module docstring).
    Its constructor starts it and returns once its ROUTER socket is bound (``endpoint``);
    BindError and other start failures are raised here, as one line."""

    def __init__(self, prepared: Any, queue: BatchQueue, val_queue: BatchQueue, stop: threading.Event,
                 on_rejected: Callable[[list[Rejection]], None], position: InputPosition | None,
                 mel_norm: dict[str, Any] | None) -> None:
        self.queue, self.val_queue, self.stop, self.on_rejected = queue, val_queue, stop, on_rejected
        self.n_mels = prepared.cfg.features.n_mels
        self.failure: BaseException | None = None
        self.endpoint = ""
        self._alive = 0
        self._validation_finished = 0
        self._epochs: dict[int, int] = {}
        self._snapshot: dict[str, Any] = {"producers": [], "rejected_messages": {}, "reissued_leases": 0,
                                          "missed_samples": 0, "refused_producers": [], "failovers": []}
        self._mel: MelStats = MelStats.empty(self.n_mels)
        self._bye = threading.Event()
        self._send_lock = threading.Lock()
        self._receiving = threading.Lock()  # the socket from the coordinator process: one thread at a time
        self._closed = False
        self.dir = Path(tempfile.mkdtemp(prefix="stoker-coordinator-"))
        self.ctx = zmq.Context.instance()
        self._up = self.ctx.socket(zmq.PULL)
        self._up.linger = 0
        self._down = self.ctx.socket(zmq.PUSH)
        self._down.linger = 0
        self.proc: subprocess.Popen | None = None
        try:
            self._start(prepared, position, mel_norm)
        except BaseException:
            self.close(0.0)
            raise

    def _start(self, prepared: Any, position: InputPosition | None, mel_norm: dict[str, Any] | None) -> None:
        capacity = prepared.cfg.pipeline.buffer_size
        hold = capacity + 1
        shapes = [*prepared.planner.shapes, *((b.rows, *b.shape) for b in prepared.val_batches)]
        slots = {"count": 2 * capacity + 1 + VALIDATION_QUEUE_CAPACITY, "hold": hold,
                 "val": VALIDATION_QUEUE_CAPACITY, "size": slot_bytes(prepared.cfg, shapes)}
        started = time.monotonic()
        self.slots = self._slot_file(slots)
        passed = write_start(self.dir / proto.START, prepared, position, mel_norm,
                             {**slots, "path": str(self.slots.path)})
        self._up.bind(f"ipc://{self.dir / proto.UP}")
        env = dict(os.environ)
        # This stoker first, then the caller's import path (a user's module it names imports here too).
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(
            p for p in (str(PACKAGE_PARENT), *caller_path(), *env.get("PYTHONPATH", "").split(os.pathsep)) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", proto.COORDINATOR_MODULE, str(self.dir), str(os.getpid())],
                                     env=env, start_new_session=True, stdin=subprocess.DEVNULL, pass_fds=passed)
        ready = self._wait_ready()
        self.endpoint = ready["endpoint"]
        # Both files mapped, the child connected: nothing is left behind on a crash (the child
        # removes the directory when it hears from this end).
        for path in (self.dir / proto.START, self.slots.path, self.dir / proto.UP):
            path.unlink(missing_ok=True)
        self._down.connect(f"ipc://{self.dir / proto.DOWN}")
        self._tell(proto.HELLO)
        log.info("coordinator process %d ready in %.2f s (%d slots of %.1f MB in %s; the clips' columns %s)",
                 self.proc.pid, time.monotonic() - started, slots["count"], slots["size"] / 2**20,
                 self.slots.path.parent, "mapped from the index cache file" if passed else "in the start file")

    def _slot_file(self, slots: dict[str, int]) -> SlotFile:
        """The slots, in memory (/dev/shm); where it has no room for them (a container's 64 MB), in
        the system's temporary directory (a file in the page cache), said once."""
        count, size = slots["count"], slots["size"]
        if SHM_DIR.is_dir():
            try:
                return SlotFile(SHM_DIR / f"{self.dir.name}-{proto.SLOTS}", count, size, create=True)
            except OSError as exc:
                log.warning("no room for the batch slots (%d MB) in %s (%s); they are in %s", count * size >> 20,
                            SHM_DIR, exc.strerror or exc, self.dir)
        return SlotFile(self.dir / proto.SLOTS, count, size, create=True)

    def _wait_ready(self) -> dict[str, Any]:
        """The coordinator process's first message: ready, or its start failure raised here."""
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._up.poll(round(RECEIVE_SLICE_S * 1000)):
                message = msgpack.unpackb(self._up.recv(), raw=False, strict_map_key=False)
                if message["kind"] == proto.READY:
                    return message
                if message["kind"] == proto.ERROR:
                    raise self._error(message)
            elif self.proc.poll() is not None:
                raise CoordinatorGone(f"the coordinator process ended while starting (exit status "
                                      f"{self.proc.returncode}); its log says why")
        raise CoordinatorGone(f"the coordinator process did not start within {START_TIMEOUT_S:.0f} s")

    @staticmethod
    def _error(message: dict[str, Any]) -> BaseException:
        """An error of the coordinator process as this process raises it: the same one line."""
        text = message["message"]
        if message["type"] == BindError.__name__:
            return BindError(text)
        if message["user_error"]:
            return CoordinatorError(text)
        return CoordinatorGone(f"the coordinator process failed ({message['where']}): {message['type']}: {text}")

    # ------------------------------------------------------------ receiving
    def receive(self, seconds: float) -> None:
        """The coordinator process's messages, handled: batches into the queues, rejections, the
        published figures. Waits up to ``seconds`` for the first (at most RECEIVE_SLICE_S: the
        caller looks at its queue and asks again), then takes whatever else has arrived. A
        coordinator process found gone while waiting, without goodbye, ends the run
        (``failure``, stop). The queues call it in the thread that asks for a batch
        (BatchQueue.pump); a thread that finds another receiving takes only what is there."""
        if not self._receiving.acquire(blocking=False):
            if not self._receiving.acquire(timeout=max(seconds, 0.0)):
                return
            seconds = 0.0  # what the other thread took is in the queues: the caller looks first
        try:
            if not self._closed and not self._drain(seconds) and seconds > 0:
                self._check_alive()
        finally:
            self._receiving.release()

    def _drain(self, seconds: float) -> bool:
        """Waits up to ``seconds`` (RECEIVE_SLICE_S at most) for a message, then takes every one
        there is; whether any came. The caller holds the receiving lock."""
        if not self._up.poll(round(min(max(seconds, 0.0), RECEIVE_SLICE_S) * 1000)):
            return False
        while True:
            try:
                raw = self._up.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            self._take(raw)

    def _take(self, raw: bytes) -> None:
        try:
            self._on_message(msgpack.unpackb(raw, raw=False, strict_map_key=False))
        except Exception as exc:  # rejected.jsonl on a full disk: it ends the run, the goodbye still comes
            if self.failure is None:
                self.failure = exc
                log.error("taking the coordinator process's message failed: %s", exc)
            self.stop.set()

    def _check_alive(self) -> None:
        """No message came: a coordinator process that ended without goodbye ends the run."""
        assert self.proc is not None
        if self.proc.poll() is None or self._bye.is_set():
            return
        if self.failure is None:
            self.failure = CoordinatorGone(f"the coordinator process (pid {self.proc.pid}) ended "
                                           f"unexpectedly (exit status {self.proc.returncode}); the run stops")
            log.error("%s", self.failure)
        self.stop.set()

    def _on_message(self, message: dict[str, Any]) -> None:
        kind = message["kind"]
        if kind == proto.BATCH:
            self._on_batch(message)
        elif kind == proto.REJECTED:
            self._count_rejected(message["epochs"])
            self.on_rejected([Rejection(**row) for row in message["rows"]])
        elif kind == proto.STATE:
            self._alive, self._validation_finished = message["alive"], message["validation_finished"]
            self._count_rejected(message["epochs"])
            self._snapshot = message.get("snapshot", self._snapshot)
        elif kind == proto.ERROR:
            self.failure = self._error(message)
            self.stop.set()
        elif kind == proto.BYE:
            self._snapshot = message["snapshot"]
            self._mel = MelStats.from_fields(message["mel_stats"], self.n_mels) or self._mel
            self._bye.set()

    def _count_rejected(self, epochs: dict[Any, int]) -> None:
        """The coordinator process's rejected counts of epochs (only those not zero; counts only
        grow), into a new dict: the trainer's thread reads the one it has without a lock."""
        if any(self._epochs.get(int(e)) != n for e, n in epochs.items()):
            self._epochs = {**self._epochs, **{int(e): n for e, n in epochs.items()}}

    def _on_batch(self, message: dict[str, Any]) -> None:
        """A batch in its slot: views of it into the training queue (the slot is released when
        the trainer no longer needs it: :meth:`release`); a validation batch is copied out at
        once (a pass's batches are all held together) and its slot released."""
        slot = message["slot"]
        arrays = self.slots.views(message["layout"])
        validation = message["queue"] == "val"
        if validation:
            arrays = {name: np.array(array) for name, array in arrays.items()}
            self._tell(proto.RELEASE + str(slot).encode())
        item = QueuedBatch(arrays=arrays, slot=slot, **{name: message[name] for name in proto.BATCH_FIELDS})
        try:
            (self.val_queue if validation else self.queue).put(item)
        except QueueFull:  # the credits make it impossible; the batch is lost, and says so
            log.error("queue full on delivery of lease %d from the coordinator process", item.lease)

    # ------------------------------------------------------------ the trainer's messages
    def _tell(self, token: bytes) -> None:
        with self._send_lock:
            try:
                self._down.send(token, flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the coordinator process is gone: receiving says so
                log.debug("coordinator process not told %r: %s", token, exc)

    def taken(self, item: QueuedBatch) -> None:
        """``item`` left the trainer's queue: a free place in it (the coordinator may credit it)."""
        self._tell(proto.TAKE + str(item.slot).encode())

    def release(self, item: QueuedBatch) -> None:
        """The trainer no longer reads training batch ``item``'s slot (its step is confirmed): it
        may be written again. Once per batch (a validation batch's slot is released on arrival)."""
        if item.slot >= 0:
            self._tell(proto.RELEASE + str(item.slot).encode())
            item.slot = -1

    def start_validation(self, number: int) -> None:
        self._tell(proto.WAKE_VALIDATE + str(number).encode())

    def cancel_validation(self, number: int) -> None:
        self._tell(proto.WAKE_CANCEL + str(number).encode())

    # ------------------------------------------------------------ the published figures
    @property
    def mel_stats(self) -> MelStats:
        return self._mel

    def alive(self) -> int:
        return self._alive

    def rejected_in_epoch(self, epoch: int) -> int:
        return self._epochs.get(epoch, 0)

    def rejected_epochs(self) -> Iterable[int]:
        """The epochs with samples rejected (InputPosition.update_complete looks at no other untrained one)."""
        return self._epochs.keys()

    def validation_finished(self) -> int:
        return self._validation_finished

    def snapshot(self) -> dict[str, Any]:
        return self._snapshot

    # ------------------------------------------------------------ closing
    def close(self, timeout: float = BYE_TIMEOUT_S) -> None:
        """The shutdown protocol: stop to the coordinator process (it says STOP to every producer,
        then goodbye with its last figures, and exits); killed if it does not within ``timeout``."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            self._tell(proto.STOP)
            deadline = time.monotonic() + timeout
            with self._receiving:
                while not self._bye.is_set() and time.monotonic() < deadline:
                    exited = proc.poll() is not None  # what it sent before it exited is still to be read
                    if not self._drain(deadline - time.monotonic()) and exited:
                        break
            if not self._bye.is_set():
                log.warning("the coordinator process did not say goodbye within %.0f s; killing it", timeout)
            try:
                proc.wait(timeout if self._bye.is_set() else 0.1)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with self._receiving:  # no thread is receiving, and none will
            self._closed = True
            self._up.close()
        self._down.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        if hasattr(self, "slots"):
            self.slots.path.unlink(missing_ok=True)  # a start that failed before the child mapped it


__all__ = ["CoordinatorError", "CoordinatorGone", "CoordinatorProcess", "write_start"]
