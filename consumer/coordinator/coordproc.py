"""The coordinator process: the ROUTER socket, the scheduler and the receive path, out of the
trainer's interpreter (``python -m stoker.consumer.coordinator.coordproc DIR PARENT_PID``).

The trainer process (consumer/feed/handoff.py) writes DIR/start (the run's config, the
training and held-out clips' columns or the index cache file's descriptor, the input position)
and spawns this process, which
binds the ROUTER socket and runs the :class:`~.coordinator.Coordinator` loop in its main
thread. Delivered batches go into the slots of a shared file (consumer/slots.py); the
trainer process gets a descriptor per batch. The protocol's files, messages and errors are
consumer/protocol.py's; its rules (slots, credits, shutdown) are in docs/design/processes.md, "The
coordinator process".
"""

from __future__ import annotations

import collections
import logging
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np
import zmq

from ..buffer import QueuedBatch, QueueFull
from .coordinator import Coordinator
from .lease_tables import ReferenceTable, TokenTable
from ..plan import EpochPlanner, stored_buckets, validation_batches
from ..planfiles import PlanFiles
from ..position import InputPosition
from ..protocol import (BATCH, BATCH_FIELDS, BUCKET_MEMBERS, BYE, DOWN, HELLO, READY, REJECTED, RELEASE, START, STATE,
                        STOP, TAKE, UP, error_message)
from .scheduler import ValidationSet
from ..slots import SlotFile, SlotTooSmall
from ...shared import config as config_mod
from ...shared.dataset.agreement import Reference
from ...shared.dataset.cache import open_index
from ..index.reuse import cached_table
from ...shared.dataset.table import SampleTable
from ...shared.keys import load_server_keys
from ...shared.dataset.layouts import Rejection
from ...shared.proc import install_stop_handlers, parent_alive, setup_logging
from ...shared.vocab import load_vocabulary

log = logging.getLogger("consumer.coordinator")

# The figures the trainer reads (producers, rejected messages, ...) are sent at most this often.
SNAPSHOT_EVERY_S = 0.5
# Epochs whose rejected counts are sent, after the last one with a batch delivered or a clip rejected.
EPOCHS_AHEAD = 2


class SlotQueue:
    """The scheduler's bounded queue (``capacity``, ``len``, ``positions``, ``put``) as slots.

    ``len`` counts the batches sent to the trainer and not taken from its queue, and also
    holds credits back while the trainer keeps more than ``hold`` slots it took (their batch
    still in use: consumer/feed/handoff.py), so every credit in flight has a free slot."""

    def __init__(self, capacity: int, slots: list[int], hold: int, file: SlotFile, queue: str,
                 send: Callable[[dict[str, Any]], None]) -> None:
        self.capacity, self.hold, self.file, self.queue = capacity, hold, file, queue
        self._slots = set(slots)
        self._free = collections.deque(slots)
        self._untaken: dict[int, tuple[int, int]] = {}  # slot -> (epoch, index), sent and not taken
        self._send = send

    def __len__(self) -> int:
        return max(len(self._untaken), len(self._slots) - len(self._free) - self.hold)

    def owns(self, slot: int) -> bool:
        return slot in self._slots

    def positions(self) -> list[tuple[int, int]]:
        return list(self._untaken.values())

    def put(self, item: QueuedBatch) -> None:
        if len(self._untaken) >= self.capacity or not self._free:
            raise QueueFull(f"queue at capacity {self.capacity}, {len(self._free)} free slots")
        slot = self._free.popleft()
        try:
            layout = self.file.write(slot, item.arrays)
        except SlotTooSmall as exc:
            self._free.appendleft(slot)
            raise QueueFull(str(exc)) from None
        self._untaken[slot] = (item.epoch, item.index)
        self._send({"kind": BATCH, "queue": self.queue, "slot": slot, "layout": layout,
                    **{name: getattr(item, name) for name in BATCH_FIELDS}})

    def taken(self, slot: int) -> None:
        self._untaken.pop(slot, None)

    def release(self, slot: int) -> None:
        """The slot may be written again (a validation batch's is, copied out, before it is taken)."""
        if slot not in self._free:
            self._free.append(slot)


class ChildCoordinator(Coordinator):
    """The coordinator loop in this process's main thread: the trainer's messages come on the
    wake-up socket (an ipc endpoint of DIR), and after each event the batches delivered and
    the figures that changed go to the trainer process on ``up``."""

    def __init__(self, directory: Path, up: zmq.Socket, parent_pid: int, stop: threading.Event,
                 make: Callable[["ChildCoordinator"], dict[str, Any]]) -> None:
        self.up = up
        self.directory = directory
        self.parent_pid = parent_pid
        self._outbox: list[dict[str, Any]] = []
        self._sent: dict[str, Any] = {}
        self._snapshot_t = 0.0
        self.orphaned = False  # the trainer died: its producers must see what they saw of a dead trainer
        self._last_epoch = 0
        self.queues: list[SlotQueue] = []
        super().__init__(stop=stop, on_rejected=self._on_rejected, **make(self))
        self._wake_addr = f"ipc://{directory / DOWN}"

    def send(self, message: dict[str, Any]) -> None:
        """A message to the trainer process, now (dropped if it has been gone for a while: its
        queue full; the loop stops at its next look at the parent)."""
        try:
            self.up.send(msgpack.packb(message, use_bin_type=True))
        except zmq.Again:
            log.debug("the trainer process does not take %s", message["kind"])

    def defer(self, message: dict[str, Any]) -> None:
        """A batch's descriptor, sent after the event that delivered it (:meth:`_flush`)."""
        self._last_epoch = max(self._last_epoch, int(message["epoch"]))
        self._outbox.append(message)

    def _epochs(self) -> dict[int, int]:
        """The rejected counts (not zero) of the epochs being leased: a few either side of the last
        with a batch delivered or a clip rejected (the window moves with them)."""
        first = max(self.scheduler.first_open_epoch(), self._last_epoch - EPOCHS_AHEAD)  # an epoch's count moves no more once it is behind
        counts = {e: self.scheduler.rejected_in_epoch(e) for e in range(first, self._last_epoch + EPOCHS_AHEAD + 1)}
        counts = {e: n for e, n in counts.items() if n}
        self._last_epoch = max(self._last_epoch, *counts) if counts else self._last_epoch
        return counts

    def _on_rejected(self, rejections: list[Rejection]) -> None:
        """Rejections go before the batch of the same event, with the epochs' counts."""
        self.send({"kind": REJECTED, "rows": [r.to_json() for r in rejections], "epochs": self._epochs()})

    def _on_wake(self, token: bytes, now: float) -> None:
        if token.startswith((TAKE, RELEASE)):
            slot = int(token.partition(b":")[2])
            for queue in self.queues:
                if queue.owns(slot):
                    (queue.taken if token.startswith(TAKE) else queue.release)(slot)
        elif token == STOP:
            self.stop.set()
        elif token == HELLO:  # both ends connected: nothing is left for a crash to leave behind
            (self.directory / DOWN).unlink(missing_ok=True)
            shutil.rmtree(self.directory, ignore_errors=True)
        else:
            super()._on_wake(token, now)

    def _say_stop(self, router: zmq.Socket) -> None:
        """STOP to every producer, unless the trainer process died: then, as when the coordinator
        lived in it, no STOP reaches them; they find the trainer silent, drop their leases and
        reconnect, so remote producers rejoin a restarted trainer (local ones the launcher stops)."""
        if not self.orphaned:
            super()._say_stop(router)

    def _flush(self) -> None:
        super()._flush()
        out, self._outbox = self._outbox, []
        for message in out:  # a validation pass's last batch before the state that says it is finished
            self.send(message)
        now = time.monotonic()
        state = {"alive": self.alive(), "validation_finished": self.validation_finished(), "epochs": self._epochs()}
        if now - self._snapshot_t >= SNAPSHOT_EVERY_S:
            self._snapshot_t = now
            state["snapshot"] = self.snapshot()
            if not parent_alive(self.parent_pid):
                log.error("the trainer process is gone; stopping without a word to the producers")
                self.orphaned = True
                self.stop.set()
        if any(self._sent.get(k) != v for k, v in state.items()):
            self._sent.update(state)
            self.send({"kind": STATE, **state})


def _table(start: Any, prefix: str) -> SampleTable:
    """A table of the start file: its columns (sections ``prefix``.*, or the index cache file
    whose descriptor the trainer process passed) and, for a view, its rows."""
    header = start.header[prefix]
    sections = {k[len(prefix) + 1:]: v for k, v in start.sections.items() if k.startswith(prefix + ".")}
    rows = sections.pop("rows", None)
    if "index_fd" in header:  # the very file the trainer process mapped, even if a new one took its name
        cached = open_index(Path(f"/dev/fd/{header['index_fd']}"), check=False)
        cached.checked = header["checked"]
        table = cached_table(cached)
    else:
        table = SampleTable.from_sections(sections, header["speakers"], header["languages"], checksummed=True)
    return table.take(np.frombuffer(rows, np.int64)) if rows is not None else table


def _parts(directory: Path, coordinator: ChildCoordinator) -> dict[str, Any]:
    """The coordinator's parts, from DIR/start and DIR/slots."""
    start = open_index(directory / START)
    head = start.header
    cfg = config_mod.from_dict(head["cfg"])
    train, held = _table(start, "train"), list(_table(start, "val"))
    files = PlanFiles(Path(head["plan_files"])) if head["plan_files"] is not None else None  # the trainer's too
    buckets = None  # with plan files, the trainer process's buckets are mapped from theirs
    if BUCKET_MEMBERS in start.sections:
        members = np.frombuffer(start.sections[BUCKET_MEMBERS], np.dtype(head["members_dtype"]))
        buckets = stored_buckets(train, head["buckets"], members)
    planner = EpochPlanner(train, cfg.batching, *head["planner"], buckets=buckets, files=files)
    if [planner.batches_per_epoch, [list(s) for s in planner.shapes]] != head["check"]:
        raise RuntimeError("the coordinator process planned other epochs than the trainer process")
    vocab = load_vocabulary(Path(head["vocabulary"]))
    slots = head["slots"]
    file = SlotFile(Path(slots["path"]), slots["count"], slots["size"])
    capacity = cfg.pipeline.buffer_size
    train_queue = SlotQueue(capacity, list(range(capacity + slots["hold"])), slots["hold"], file, "train",
                            coordinator.defer)
    val_queue = SlotQueue(slots["val"], list(range(capacity + slots["hold"], slots["count"])), 0, file, "val",
                          coordinator.defer)
    coordinator.queues = [train_queue, val_queue]
    refs = head["refs"]
    seed = cfg.batching.seed
    validation = ValidationSet(validation_batches(held, planner), val_queue,
                               TokenTable(held, vocab, head["val_positions"]),
                               ReferenceTable(held, seed) if refs and held else None,
                               texts={s.id: s.text for s in held}, files={s.id: s.audio for s in held if s.audio})
    dataset = head["dataset"]
    return dict(cfg=cfg, planner=planner, queue=train_queue, max_epochs=head["max_epochs"],
                dataset=Reference(Path(dataset[0]), *dataset[1:]),
                keys=load_server_keys(Path(cfg.pipeline.keys)) if cfg.pipeline.keys else None,
                resume=InputPosition.from_state_dict(head["resume"], planner) if head["resume"] is not None else None,
                tokens=TokenTable(train, vocab), references=ReferenceTable(train, seed) if refs else None,
                mel_norm=head["mel_norm"], validation=validation)


def run(directory: Path, parent_pid: int) -> int:
    """Start, serve until told to stop (or the trainer process is gone), say goodbye."""
    stop = threading.Event()
    install_stop_handlers(stop)
    ctx = zmq.Context.instance()
    up = ctx.socket(zmq.PUSH)
    up.linger = 1000
    up.sndtimeo = 1000
    up.connect(f"ipc://{directory / UP}")
    coordinator: ChildCoordinator | None = None
    try:
        try:
            coordinator = ChildCoordinator(directory, up, parent_pid, stop, lambda c: _parts(directory, c))
            setup_logging("coordinator", coordinator.cfg.run.log_level)
            endpoint = coordinator.bind(coordinator.cfg.pipeline.bind)
        except BaseException as exc:  # crosses to the trainer process as a message: its one line there
            up.send(msgpack.packb(error_message(exc, "coordinator start")))
            return 1
        coordinator.send({"kind": READY, "endpoint": endpoint})
        coordinator._run_guarded()
        failure = coordinator.failure
        if failure is not None:
            coordinator.send(error_message(failure, "coordinator"))
        coordinator.send({"kind": BYE, "snapshot": coordinator.snapshot(),
                          "mel_stats": coordinator.mel_stats.to_fields()})
        return 0 if failure is None else 1
    finally:
        up.close()
        ctx.term()
        shutil.rmtree(directory, ignore_errors=True)  # the trainer process mapped and connected what it needs


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1]), int(sys.argv[2])))
