"""The coordinator's scheduler: who prepares which planned batch, and when it may be sent.

A pure state machine with no sockets: the router loop (consumer/pipeline/coordinator.py) feeds it
events (:meth:`Scheduler.on_message` with a producer's frames, :meth:`~Scheduler.on_free`
when the trainer takes a batch, :meth:`~Scheduler.tick` as time passes, the connection
events of the socket monitor) and sends what it leaves in its outbox
(:meth:`~Scheduler.take_outbox`: identity, message of shared/wire.py, protocol version).
Delivered batches go into the bounded queue. Every event carries the time, so its tests drive it with events
and a clock of their own and assert the messages, without sockets or timeouts.

Peers (consumer/pipeline/peers.py) is the part that knows who has joined and who is presumed gone
(HELLO and the dataset agreement, names, connections, heartbeats, silence); dropping a
peer calls back here, and its leases are re-planned.

Leases (work): the epoch plan (consumer/pipeline/plan.py) is handed out batch by batch. Each
producer holds up to ``lease_ahead`` leases. A lease is identified by a fresh integer;
re-issuing a planned batch creates a new lease id, so a late delivery of the old one is
recognised and dropped. A producer that says BYE, reports a fatal ERROR, whose
connection closes without BYE (its process died: the kernel closed the socket) or that
is silent for ``heartbeat_timeout_s`` (frozen, or cut off by the network) loses its
leases: their planned batches go back to the front of the pending list, and the next
free lease slot of a live producer takes them. A lease not prepared within
``lease_timeout_s`` is revoked (REVOKE) and re-planned. That keeps "every valid sample
exactly once per epoch" while any producer is alive. A resumed run passes its input
position (consumer/pipeline/position.InputPosition): planning starts at its first open epoch and
leases only the planned batches (or the parts of them) not trained at the checkpoint.

Misses: a producer that does not have a leased clip (deleted, or an unfinished copy)
delivers the rest of the batch and reports the clip as *missed*. The scheduler notes
that this producer lacks it and re-plans it in the same epoch and bucket shape: merged
into a pending batch of that bucket with room, or as a small batch of its own. A sample
is rejected (rejected.jsonl) only when every live producer lacks it and no other work is
left for them; with no producer alive it waits.

Rows: a batch carries only its real rows (B = the clips delivered, whether a clip was
rejected, or the batch was re-planned, split, or is the rest of a partly trained one),
unless the run's rows are fixed (``batching.fixed_rows``, replicas, workers:
EpochPlanner.fixed_rows); then it keeps the lease's rows, the empty ones marked by
``row_mask``. WELCOME tells the producer which.

Credits (flow): a producer tells READY when a leased batch is prepared. The scheduler
sends a CREDIT for a ready lease only while ``queued batches + credits in flight <
capacity``, to the producer holding the fewest credits first, then lowest (epoch, index),
so the queue can never overflow, its depth is exact, and a producer that freezes blocks
at most its share of it. A credit not used within the heartbeat timeout is revoked and
its batch re-planned. Batches of a later epoch than the earliest one with a batch still
to credit leave one slot free, so that a trainer taking an epoch at a time (the feed's
``epochs()`` and ``as_dataset()``) finds that epoch's last batches room in the queue.

Trainer workers (the plan is one worker's share, consumer/pipeline/plan.py): every worker must
take the same planned batch at each step, so batches reach the trainer in plan order, one
per planned batch. Credits go only to the ``capacity`` earliest planned batches not yet
trained (the window), so the queue always has room for the one the trainer waits for; a
producer lacking a clip gets the whole batch and reports the clip missed, which is
rejected rather than re-planned into a batch of its own; and a batch whose every clip was
rejected (or a worker's empty share) still goes into the queue, as empty rows.

Validation passes (consumer/pipeline/validation.py): the held-out clips, planned once into
batches of the training buckets' shapes (consumer/pipeline/plan.validation_batches), are leased
when the trainer asks for a pass (:meth:`Scheduler.start_validation`) through the same
producers, with the epoch ``-pass`` that marks them: producers prepare the lowest epoch
first, so a pass goes before training work. They have lease slots of their own (up to
``lease_ahead`` per producer beside the training ones) and credits of their own, for a
queue of their own (``ValidationSet.queue``): while the trainer validates, the training
queue stays full and the producers' training leases wait for credits, and neither
blocks the pass. A producer gone mid-pass has its validation leases re-planned into the
same pass, misses are re-planned within it, so every held-out clip (but those rejected)
is in exactly one delivered batch per pass; the pass is finished
(``validation_finished``) when its last batch is delivered. Validation batches never
move the input position, the epochs or the mel statistics.

Anything malformed or unexpected is dropped and counted by reason (``rejected_messages``
in summary.json); nothing a peer sends can stop the scheduler.

It is one file of some 600 lines on purpose: leases, credits and re-planning change
together on nearly every event (a delivery frees a credit, re-plans misses and leases
again), so split further, each part would reach into the others' state.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .buffer import BatchQueue, QueuedBatch, QueueFull
from .pending import Pending
from .lease_tables import ReferenceTable, TokenTable
from .plan import EpochPlanner, PlannedBatch
from .position import InputPosition
from ...producer.transforms import load_user
from ...shared import wire
from ...shared.batch import FRAMES, batch_dims
from ...shared.config import Config, batch_fields, batch_schema
from .peers import Peer, Peers, ProducerStats
from ...shared.dataset import Reference
from ...shared.layouts import Rejection
from ...shared.mel import user_mel_function
from ...shared.melstats import MelStats

log = logging.getLogger("consumer.coordinator")

# A producer that lacks clips looks this far into the pending list for a batch it can
# take (whole or in part); beyond it, it waits for others to take the front.
ASSIGN_SCAN_LIMIT = 256
# A message for the producer with that identity, and the protocol version to encode it in
# (another only for a REFUSE to a producer of that version).
Outgoing = tuple[bytes, wire.Body, int]
# The epoch a validation clip's reference clip is chosen for: the same one at every pass.
VALIDATION_REFERENCES = -1
# A planned batch whose lease failed this often the same way (its producer's connection dropped
# or it died holding it, its credit unused, a batch not of its plan, not prepared in time) fails
# for a reason of its own, not its producers': its clips are rejected for the epoch (or the
# pass) and the run goes on. A producer killed now and then holds a given batch once or twice.
MAX_LEASE_FAILURES = 4


@dataclass
class ValidationSet:
    """The held-out clips as the scheduler leases them (module docstring)."""

    batches: list[PlannedBatch]  # consumer/pipeline/plan.validation_batches: the same at every pass
    queue: BatchQueue  # where their batches go, with credits of its own
    tokens: TokenTable | None = None  # their token ids (None only where no producer makes batches)
    references: ReferenceTable | None = None  # their reference clips, among themselves (ref_mel on)
    # Each clip's text and audio file, which the leases carry: data.eval_file's clips are in no
    # producer's metadata.
    texts: dict[str, str] = dataclasses.field(default_factory=dict)
    files: dict[str, str] = dataclasses.field(default_factory=dict)


def _missing_everywhere(sample_id: str, hosts: str, peers: list[Peer]) -> str:
    """The rejection of a clip every live producer lacks, with the reason the first of them gave."""
    why = next((p.why[sample_id] for p in peers if sample_id in p.why), "")
    return f"audio file missing on every producer host ({hosts})" + (f": {why}" if why else "")


def is_validation(batch: PlannedBatch) -> bool:
    """A batch of a validation pass (epoch ``-pass``), not of the training plan."""
    return batch.epoch < 0


@dataclass
class Lease:
    id: int
    batch: PlannedBatch
    identity: bytes
    state: str = "working"  # working -> ready -> credited -> (delivered: removed)
    issued_t: float = 0.0
    ready_t: float = 0.0
    credited_t: float = 0.0


@dataclass
class Failover:
    """A producer that left or died holding leases, and how fast its work moved on."""

    producer: str
    status: str
    leases: int
    silent_s: float  # from its last message to being declared gone
    last_heard_unix: float
    declared_unix: float
    reissued: int = 0
    reissued_unix: float | None = None  # when the last of its batches was leased to another

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        done = self.reissued_unix
        out["reissue_after_last_heard_s"] = round(done - self.last_heard_unix, 3) if done else None
        out["reissue_after_declared_s"] = round(done - self.declared_unix, 3) if done else None
        return out


class Scheduler:
    """Leases, credits, re-planning, misses and rejections, peers and their liveness (module
    docstring). ``queue``: the bounded queue delivered batches go into (its capacity and
    depth decide the credits)."""

    def __init__(self, cfg: Config, planner: EpochPlanner, queue: BatchQueue, max_epochs: int | None = None,
                 on_rejected: Callable[[list[Rejection]], None] | None = None,
                 dataset: Reference | None = None, resume: InputPosition | None = None,
                 tokens: TokenTable | None = None, references: ReferenceTable | None = None,
                 mel_norm: dict[str, Any] | None = None, now: float = 0.0,
                 validation: ValidationSet | None = None) -> None:
        self.cfg = cfg
        # Token ids for the leases; None only where no producer makes batches (tests, benchmarks of the queue).
        self.tokens = tokens
        # Each clip's reference clip, with the ref_mel batch field on (None: off).
        self.references = references
        # The user transforms' versions (producer/transforms.py) and the user's mel function's
        # (features.user, shared/mel.py), which every producer must run too.
        self.transform_versions = {spec: version for spec, _, version in load_user(cfg.transforms.user)}
        if cfg.features.user:
            self.transform_versions[cfg.features.user] = user_mel_function(cfg.features.user)[1]
        if cfg.transforms.models:  # the producer models' source and weights (producer/models.py)
            from ...producer.models import model_versions  # imports TensorFlow: only with a model configured

            self.transform_versions.update(model_versions(cfg.transforms.models))
        # transforms.mel_norm: the statistics producers normalise with (None: off); and the ones measured.
        self.mel_norm = mel_norm
        self.mel_stats = MelStats.empty(cfg.features.n_mels)
        self.schema = batch_schema(cfg)
        self.planner = planner
        self.ordered = planner.workers > 1  # a worker's share: batches reach the trainer in plan order
        self.queue = queue
        self.max_epochs = max_epochs
        self.on_rejected = on_rejected or (lambda rejections: None)
        self._now = now  # the time of the event being handled
        self._last_beat = now
        self._outbox: list[Outgoing] = []
        self._pending = Pending()
        # A resumed run leases only what its checkpoint's input position left (consumer/pipeline/position.py).
        self.resume = resume
        self._next_epoch = resume.first_open() if resume is not None else 0
        self._next_lease = 1
        self._leases: dict[int, Lease] = {}
        self._credits_out = 0
        # Validation passes: the held-out clips, the pass being leased (0: none), its pending
        # batches and credits, and the last pass finished (read by the trainer thread).
        self.validation = validation
        self._val_pass = 0
        self._val_pending = Pending()
        self._val_credits_out = 0
        self.validation_finished = 0
        self._orphans: dict[tuple[int, int], Failover] = {}  # re-planned batches of a gone producer
        # (epoch, index) of a planned batch -> how its leases failed, and how often (MAX_LEASE_FAILURES).
        self._failures: dict[tuple[int, int], collections.Counter[str]] = {}
        self._lock = threading.Lock()  # guards the stats below, read by other threads
        self.dropped: collections.Counter[str] = collections.Counter()
        self.reissued = 0
        self.missed = 0
        self.failovers: list[Failover] = []
        self._epoch_rejected: collections.Counter[int] = collections.Counter()
        self._max_bytes = cfg.pipeline.max_message_mb << 20
        self.peers = Peers(cfg, dataset, self._send, self._count, self._welcome, self._on_dropped,
                           self._holds_credits, self._lock)
        # The scheduler reads the membership: the live peers, and the per-producer figures it adds to.
        self._peers = self.peers.live
        self.producers: dict[str, ProducerStats] = self.peers.producers

    # ------------------------------------------------------------ stats for the trainer
    def alive(self) -> int:
        return self.peers.alive()

    def rejected_in_epoch(self, epoch: int) -> int:
        """Samples of ``epoch`` rejected while the run went on (they will not be trained)."""
        with self._lock:
            return self._epoch_rejected[epoch]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "producers": [p.to_json() for p in self.producers.values()],
                "rejected_messages": dict(self.dropped),
                "reissued_leases": self.reissued,
                "missed_samples": self.missed,
                "refused_producers": list(self.peers.refusals),
                "failovers": [f.to_json() for f in self.failovers],
            }

    # ------------------------------------------------------------ sending
    def _send(self, identity: bytes, msg: wire.Body, version: int = wire.PROTOCOL_VERSION) -> None:
        self._outbox.append((identity, msg, version))

    def take_outbox(self) -> list[Outgoing]:
        """The messages to send, in order; the outbox is empty afterwards."""
        out, self._outbox = self._outbox, []
        return out

    # ------------------------------------------------------------ plan and leases
    def _plan_more(self) -> bool:
        """Plan the next epoch with work left (a resumed one may have none); False at the last."""
        while self.max_epochs is None or self._next_epoch < self.max_epochs:
            self._pending.add_plan(self.planner.plan(self._next_epoch), self.resume)
            self._next_epoch += 1
            if self._pending:
                return True
        return False

    def _take_for(self, peer: Peer) -> PlannedBatch | None:
        """The next pending batch this producer can prepare; split off the clips it lacks."""
        if not self._pending and not self._plan_more():
            return None
        if not peer.lacks or self.ordered:
            return self._pending.popleft()
        return self._usable(self._pending, peer)

    def _usable(self, pending: Pending, peer: Peer) -> PlannedBatch | None:
        """The first of ``pending`` with clips this producer has, taken out; the clips it lacks
        stay in place."""
        for pos, batch in enumerate(pending.head(ASSIGN_SCAN_LIMIT)):
            usable = tuple(i for i in batch.ids if i not in peer.lacks)
            if not usable:
                continue
            if len(usable) == len(batch.ids):
                del pending[pos]
                return batch
            # Same epoch, bucket and shape: the part it lacks stays in place for another producer.
            pending[pos] = self.planner.with_ids(batch, tuple(i for i in batch.ids if i in peer.lacks))
            return self.planner.with_ids(batch, usable)
        return None

    def _lease(self, peer: Peer, batch: PlannedBatch) -> None:
        now = self._now
        tokens, references, ref_epoch = self.tokens, self.references, batch.epoch
        texts = files = None
        if is_validation(batch) and self.validation is not None:
            held = self.validation
            tokens, references, ref_epoch = held.tokens, held.references, VALIDATION_REFERENCES
            named = {*batch.ids, *(references(ref_epoch, batch.ids) if references is not None else ())}
            texts = {i: held.texts[i] for i in named if i in held.texts}
            files = {i: held.files[i] for i in named if i in held.files}
        lease = Lease(self._next_lease, batch, peer.identity, issued_t=now)
        self._next_lease += 1
        self._leases[lease.id] = lease
        peer.leases.add(lease.id)
        carried = tokens.lease_fields(batch.ids, batch.clips) if tokens is not None else {}
        refs = tuple(references(ref_epoch, batch.ids, batch.clips)) if references is not None else None
        if tokens is not None:  # the texts and audio of the clips and their references: no producer reads metadata
            texts = {**carried["texts"], **(texts or {})}
            files = {**carried["files"], **tokens.files([r for r in refs or () if r not in carried["files"]]),
                     **(files or {})}
        # A producer on another host reads its own copy: each file's size on the trainer (a stat each);
        # one on this host the trainer's files, each checked against the index's size and mtime.
        sizes = self.peers.dataset.sizes(files) if files and peer.remote and self.peers.dataset is not None else None
        stamps = carried.get("stamps") if not peer.remote else None
        self._send(peer.identity, wire.Lease(
            lease=lease.id, epoch=batch.epoch, index=batch.index, ids=tuple(batch.ids),
            shape=(batch.shape[0], batch.shape[1]), rows=batch.rows,
            tokens=tuple(tuple(row) for row in carried.get("tokens", ())),
            speakers=tuple(carried.get("speakers", ())), languages=tuple(carried.get("languages", ())),
            refs=refs, texts=texts, files=files, durations=carried.get("durations"), sizes=sizes, stamps=stamps))
        orphan = self._orphans.pop((batch.epoch, batch.index), None)
        with self._lock:
            stats = self.producers.get(peer.name)
            if stats is not None and stats.first_lease_ms is None:
                stats.first_lease_ms = round((now - peer.joined_t) * 1e3, 3)
            if orphan is not None:
                orphan.reissued += 1
                orphan.reissued_unix = time.time()

    def _held(self, peer: Peer, validation: bool) -> int:
        """The producer's leases of validation passes (``validation``) or of the training plan."""
        return sum(1 for i in peer.leases if i in self._leases and is_validation(self._leases[i].batch) == validation)

    def _assign(self, peer: Peer) -> None:
        self._assign_validation(peer)
        while self._held(peer, False) < self.cfg.pipeline.lease_ahead:
            batch = self._take_for(peer)
            if batch is None:
                if self._pending and self._reject_unplaceable():
                    continue  # work nobody alive can do was rejected; look again
                return
            self._lease(peer, batch)

    def _assign_all(self) -> None:
        for peer in sorted(self._peers.values(), key=lambda p: len(p.leases)):
            self._assign(peer)
        if self.ordered and self._make_room():
            self._assign_all()

    def _assign_validation(self, peer: Peer) -> None:
        """The pass's batches, in lease slots of their own beside the training ones."""
        while self._val_pending and self._held(peer, True) < self.cfg.pipeline.lease_ahead:
            batch = self._usable(self._val_pending, peer)
            if batch is None:
                if self._reject_unplaceable_validation():
                    continue
                return
            self._lease(peer, batch)

    def _make_room(self) -> bool:
        """In plan order: a batch of the credit window still pending while every producer's
        lease slots hold later work (a producer died holding the earliest ones) would wait
        for ever; revoke the latest lease outside the window, so that a slot takes it. True
        if one was revoked."""
        window = self._window()
        waiting = any((b.epoch, b.index) in window for b in self._pending.head(self.queue.capacity))
        if not waiting or not self._peers:
            return False
        later = [lease for lease in self._leases.values() if lease.state != "credited"
                 and not is_validation(lease.batch) and (lease.batch.epoch, lease.batch.index) not in window]
        if not later:
            return False
        victim = max(later, key=lambda lease: (lease.batch.epoch, lease.batch.index))
        log.info("planned batch %d of epoch %d waits for a lease slot; revoking lease %d (batch %d) to make one",
                 min(window)[1], min(window)[0], victim.id, victim.batch.index)
        self._revoke([victim.id])
        return True

    def _release(self, lease_ids: list[int], orphaned_by: Failover | None = None, failure: str = "") -> None:
        """Put leased batches back at the front of the plan, in plan order; ``failure``: how
        their leases failed (a batch that failed so MAX_LEASE_FAILURES times is rejected)."""
        batches, checks = [], []
        for lease_id in lease_ids:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                continue
            failed = self._failed(lease, failure) if failure else False
            validation = is_validation(lease.batch)
            if lease.state == "credited" and validation:
                self._val_credits_out -= 1
            elif lease.state == "credited":
                self._credits_out -= 1
            peer = self._peers.get(lease.identity)
            if peer is not None:
                peer.leases.discard(lease_id)
            if failed:
                if validation or not self.ordered:
                    continue
                batches.append(self.planner.with_ids(lease.batch, ()))  # in plan order: still a step, empty
                continue
            if validation:  # back into its pass; one cancelled meanwhile needs it no more
                if lease.batch.epoch == -self._val_pass:
                    checks.append(lease.batch)
                continue
            batches.append(lease.batch)
            if orphaned_by is not None:
                self._orphans[(lease.batch.epoch, lease.batch.index)] = orphaned_by
        for batch in sorted(checks, key=lambda b: b.index, reverse=True):
            self._val_pending.appendleft(batch)
        if failure and self._val_pass:
            self._check_validation_done()  # its last batch may have been rejected
        for batch in sorted(batches, key=lambda b: (b.epoch, b.index), reverse=True):
            self._pending.appendleft(batch)
        if batches and self.ordered:  # leased later ones may come back after earlier ones: keep plan order
            self._pending.sort_made(key=lambda b: (b.epoch, b.index))
        if batches or checks:
            with self._lock:
                self.reissued += len(batches) + len(checks)

    def _failed(self, lease: Lease, failure: str) -> bool:
        """Count a failed lease of its planned batch; at MAX_LEASE_FAILURES the same way, its
        clips are rejected (True): the batch is not leased again."""
        batch = lease.batch
        counts = self._failures.setdefault((batch.epoch, batch.index), collections.Counter())
        counts[failure] += 1
        if counts[failure] < MAX_LEASE_FAILURES:
            return False
        del self._failures[(batch.epoch, batch.index)]
        where = f"validation pass {-batch.epoch}" if is_validation(batch) else f"epoch {batch.epoch}"
        reason = f"its batch's lease failed {MAX_LEASE_FAILURES} times: {failure}"
        log.error("planned batch %d of %s (%d clips, bucket (L, T) %s): lease failed %d times the same way (%s); "
                  "rejecting its clips for this %s", batch.index, where, len(batch.ids), tuple(batch.shape),
                  MAX_LEASE_FAILURES, failure, "pass" if is_validation(batch) else "epoch")
        if is_validation(batch) and batch.epoch != -self._val_pass:
            return True  # a cancelled pass: nothing to reject from
        self._reject(batch.epoch, [Rejection(i, reason, "coordinator") for i in batch.ids])
        return True

    def _revoke(self, lease_ids: list[int], failure: str = "") -> None:
        """Re-plan leases a live producer still holds, and tell it to forget them."""
        for lease_id in lease_ids:
            lease = self._leases.get(lease_id)
            if lease is not None and lease.identity in self._peers:
                self._send(lease.identity, wire.Revoke(lease_id))
        self._release(lease_ids, failure=failure)

    def _holds_credits(self, peer: Peer) -> bool:
        return any(self._leases[i].state == "credited" for i in peer.leases if i in self._leases)

    def _on_dropped(self, peer: Peer, status: str) -> None:
        """A peer is gone (consumer/pipeline/peers.py): its leases go back to the front of the plan."""
        now = self._now
        failover = None
        if peer.leases:
            failover = Failover(producer=peer.name, status=status, leases=len(peer.leases),
                                silent_s=round(now - peer.last_seen, 3),
                                last_heard_unix=time.time() - (now - peer.last_seen), declared_unix=time.time())
        # The batches in flight when it went (credited) count as failed: one above the socket's
        # limit drops every producer that sends it; the ones it was preparing had no chance yet.
        sending = [i for i in sorted(peer.leases) if i in self._leases and self._leases[i].state == "credited"]
        self._release([i for i in sorted(peer.leases) if i not in sending], orphaned_by=failover)
        self._release(sending, orphaned_by=failover, failure="" if status == "left" else
                      "its producer's connection closed while sending it (a batch above pipeline.max_message_mb "
                      "is dropped by the socket, or the producer died)")
        if failover is not None:
            with self._lock:
                self.failovers.append(failover)
        self._assign_all()
        self._grant()

    def _grant(self) -> None:
        """Credits for free slots: to the producer holding the fewest, then in plan order.

        Spreading them means a producer that freezes while holding credits blocks at most
        its share of the queue until it is presumed dead, not the whole queue.
        """
        self._grant_validation()
        free = self.queue.capacity - len(self.queue) - self._credits_out
        if free <= 0:
            return
        ready = [lease for lease in self._leases.values() if lease.state == "ready" and not is_validation(lease.batch)]
        if self.ordered:
            window = self._window()
            ready = [lease for lease in ready if (lease.batch.epoch, lease.batch.index) in window]
            self._credits_out += self._credit(ready, free)
            return
        first = self._first_uncredited_epoch()
        earliest = [lease for lease in ready if first is None or lease.batch.epoch <= first]
        given = self._credit(earliest, free)
        # Later epochs' batches leave one slot free while the earliest epoch still has batches to
        # send: a loop that takes an epoch at a time (the feed's epochs) waits for those, and
        # they must find room in the queue.
        later = [lease for lease in ready if first is not None and lease.batch.epoch > first]
        given += self._credit(later, free - given - 1)
        self._credits_out += given

    def _first_uncredited_epoch(self) -> int | None:
        """The earliest epoch with a planned batch not yet credited (pending, or leased and not
        credited); None when every planned batch so far has its credit."""
        epochs = [lease.batch.epoch for lease in self._leases.values()
                  if lease.state != "credited" and not is_validation(lease.batch)]
        if self._pending:
            epochs.append(min(b.epoch for b in self._pending.head(ASSIGN_SCAN_LIMIT)))
        return min(epochs, default=None)

    def _grant_validation(self) -> None:
        """Credits for the validation queue's free slots, apart from the training queue's."""
        if self.validation is None:
            return
        free = self.validation.queue.capacity - len(self.validation.queue) - self._val_credits_out
        ready = [lease for lease in self._leases.values() if lease.state == "ready" and is_validation(lease.batch)]
        self._val_credits_out += self._credit(ready, free)

    def _credit(self, ready: list[Lease], free: int) -> int:
        """CREDIT for up to ``free`` of the ``ready`` leases, to the producer holding the fewest
        credits first, then in plan order; how many were sent."""
        if not ready or free <= 0:
            return 0
        held = collections.Counter(lease.identity for lease in self._leases.values() if lease.state == "credited")
        now = self._now
        count = min(free, len(ready))
        for _ in range(count):
            lease = min(ready, key=lambda x: (held[x.identity], x.batch.epoch, x.batch.index))
            ready.remove(lease)
            held[lease.identity] += 1
            lease.state = "credited"
            lease.credited_t = now
            self._send(lease.identity, wire.Credit(lease.id))
        return count

    def _window(self) -> set[tuple[int, int]]:
        """The ``capacity`` earliest planned batches not trained yet: queued, leased or pending."""
        capacity = self.queue.capacity
        positions = set(self.queue.positions())
        positions.update((lease.batch.epoch, lease.batch.index) for lease in self._leases.values()
                         if not is_validation(lease.batch))
        positions.update((b.epoch, b.index) for b in self._pending.head(capacity))
        return set(sorted(positions)[:capacity])

    # ------------------------------------------------------------ misses and rejections
    def _reject(self, epoch: int, rejections: list[Rejection]) -> None:
        if not rejections:
            return
        if epoch >= 0:  # a validation pass's rejections count in no training epoch
            with self._lock:
                self._epoch_rejected[epoch] += len(rejections)
        self.on_rejected(rejections)

    def _replan_missed(self, template: PlannedBatch, ids: list[str]) -> None:
        """Missed clips go back into the same epoch (or validation pass) and bucket shape, for
        another producer (without fixed rows, a batch of only real rows: B is its clips')."""
        if is_validation(template) and template.epoch != -self._val_pass:
            return  # a cancelled pass
        validation = is_validation(template)
        pending = self._val_pending if validation else self._pending
        room = template.rows if validation else self.planner.bucket_rows(template)  # a pass's own buckets too
        made = pending.made()  # into a batch made already; the plan's batches not made yet are full
        for pos, batch in enumerate(made):
            if batch.epoch == template.epoch and batch.bucket == template.bucket \
                    and len(batch.ids) + len(ids) <= room:
                made[pos] = self.planner.with_ids(batch, batch.ids + tuple(ids), template)
                return
        pending.appendleft(self.planner.with_ids(template, tuple(ids)))

    def _reject_unplaceable_validation(self) -> bool:
        """Leave out of the pass the clips every live producer lacks; True if there were any."""
        peers = list(self._peers.values())
        common = set.intersection(*(p.lacks for p in peers)) if peers else set()
        lost = [i for batch in self._val_pending.made() for i in batch.ids if i in common]
        if not lost:
            return False
        hosts = ", ".join(sorted({p.host for p in peers}))
        log.warning("%d validation clips are missing on every producer host alive (%s); leaving them out of "
                    "validation pass %d", len(lost), hosts, self._val_pass)
        self.on_rejected([Rejection(i, _missing_everywhere(i, hosts, peers), "coordinator") for i in lost])
        kept = (self.planner.with_ids(b, tuple(i for i in b.ids if i not in common)) for b in self._val_pending.made())
        self._val_pending = Pending(b for b in kept if b.ids)
        self._check_validation_done()
        return True

    def _reject_unplaceable(self) -> bool:
        """Reject pending clips that every live producer lacks; True if there were any.

        Called only when a producer has a free lease slot and nothing it can take: the
        clips are rejected as late as possible, so a producer that joins meanwhile with
        the file still trains them.
        """
        peers = list(self._peers.values())
        if not peers:
            return False
        common = set.intersection(*(p.lacks for p in peers))
        if not common:
            return False
        hosts = ", ".join(sorted({p.host for p in peers}))
        kept: list[PlannedBatch] = []
        changed = False
        head = self._pending.head(ASSIGN_SCAN_LIMIT)  # as far as a producer looks for work (_usable)
        for batch in head:
            lost = [i for i in batch.ids if i in common]
            if not lost:
                kept.append(batch)
                continue
            changed = True
            for sample_id in lost:
                log.warning("sample %s is missing on every producer host alive (%s); rejecting it for epoch %d",
                            sample_id, hosts, batch.epoch)
            self._reject(batch.epoch, [Rejection(i, _missing_everywhere(i, hosts, peers), "coordinator")
                                       for i in lost])
            rest = tuple(i for i in batch.ids if i not in common)
            if rest or self.ordered:  # in plan order every planned batch is a step, empty or not
                kept.append(self.planner.with_ids(batch, rest))
        self._pending.replace_head(len(head), kept)
        return changed

    # ------------------------------------------------------------ receiving
    def _count(self, reason: str, detail: str = "") -> None:
        with self._lock:
            self.dropped[reason] += 1
            first = self.dropped[reason] == 1
        # The first of each reason is worth a warning; repeats (a flood) only at debug level.
        log.log(logging.WARNING if first else logging.DEBUG, "dropped a message (%s) %s; further ones are "
                "counted in summary.json", reason, detail)

    def _check_batch(self, batch: wire.Batch, arrays: dict[str, Any], lease: Lease) -> str | None:
        """Why this BATCH does not match its lease, or None if it does."""
        delivered = batch.ids
        # Fixed rows: the lease's rows, the empty ones marked; else only the clips delivered.
        rows = lease.batch.rows if self.planner.fixed_rows else len(delivered)
        problem = self.schema.check(arrays, batch_dims(rows, lease.batch.shape, self.cfg.features.n_mels,
                                                       self.cfg.features.hop_length, self.cfg.batching.ref_frames))
        if problem:
            return problem
        accounted = [*delivered, *(e.id for e in batch.rejected), *(e.id for e in batch.missed)]
        if len(accounted) != len(lease.batch.ids) or set(accounted) != set(lease.batch.ids):
            return "its clips are not the lease's"
        return self.schema.check_rows(arrays, len(delivered)) or None

    def _on_batch(self, peer: Peer, msg: wire.Message, now: float) -> None:
        lease = self._credited_lease(peer, msg)
        if lease is None:
            return
        try:  # typed only now: a malformed batch of a credited lease is re-planned, not left to time out
            batch = wire.Batch.from_header(msg.fields)
            problem = self._check_batch(batch, msg.arrays, lease)
        except wire.ProtocolError as exc:
            problem = str(exc)
        if problem is not None:
            self._count("bad_batch", f"lease {lease.id}: {problem}")
            log.warning("batch of lease %d from %s does not match its plan (%s); re-planning it",
                        lease.id, peer.name, problem)
            self._release([lease.id], failure=f"its batch did not match the plan ({problem})")
            self._assign_all()
            self._grant()
            return
        self._failures.pop((lease.batch.epoch, lease.batch.index), None)
        delivered = list(batch.ids)
        validation = is_validation(lease.batch)
        if (delivered or (self.ordered and not validation)) and not self._enqueue(peer, batch, msg.arrays, lease):
            return
        if validation:
            self._val_credits_out -= 1
        else:
            self._credits_out -= 1
        del self._leases[lease.id]
        peer.leases.discard(lease.id)
        rejections = [Rejection(e.id, e.reason[:300] or "rejected by producer", peer.name) for e in batch.rejected]
        missed = [(e.id, e.reason) for e in batch.missed]
        self._tally(peer, batch, lease, len(delivered), len(rejections), len(missed))
        for r in rejections:
            log.warning("producer %s rejected %s: %s", peer.name, r.id, r.reason)
        self._reject(lease.batch.epoch, rejections)
        if missed:
            peer.lacks.update(i for i, _ in missed)
            peer.why.update((i, reason[:200]) for i, reason in missed)
            with self._lock:
                stats = self.producers.get(peer.name)
                if stats is not None:
                    stats.lacks = len(peer.lacks)
        if missed and self.ordered and not validation:  # no extra batch: every worker takes the same steps
            self._reject(lease.batch.epoch, [Rejection(i, f"audio file missing on host {peer.host} "
                                                      f"({reason[:200]})", peer.name) for i, reason in missed])
        elif missed:
            ids = [i for i, _ in missed]
            for sample_id, reason in missed:
                log.warning("producer %s (host %s) does not have %s (%s); re-planning it onto another producer",
                            peer.name, peer.host, sample_id, reason[:300])
            self._replan_missed(lease.batch, ids)
        # Every producer with a free slot, not only this one: one that lacks clips may have
        # found nothing it could take a moment ago, and there may be new work now.
        self._assign_all()
        if validation:
            self._check_validation_done()
        if not delivered and (validation or not self.ordered):
            self._grant()  # the credit came back without filling a slot

    def _credited_lease(self, peer: Peer, msg: wire.Message) -> Lease | None:
        """The lease a BATCH is for, when it is this peer's and credited; else counted, None."""
        lease_id = msg.fields.get("lease")
        valid_id = isinstance(lease_id, int) and not isinstance(lease_id, bool)
        lease = self._leases.get(lease_id) if valid_id else None
        if lease is None:
            self._count("unknown_lease", str(lease_id))
        elif lease.identity != peer.identity:
            self._count("wrong_producer", str(lease_id))
        elif lease.state != "credited":
            self._count("uncredited", str(lease_id))
        else:
            return lease
        return None

    def _enqueue(self, peer: Peer, msg: wire.Batch, arrays: dict[str, Any], lease: Lease) -> bool:
        """The batch into the bounded queue (and its mel statistics counted); False if it was
        full, which credits make impossible: then it is re-planned, not lost."""
        batch = lease.batch
        validation = is_validation(batch)
        queue = self.validation.queue if validation and self.validation is not None else self.queue
        frames = arrays[FRAMES]
        item = QueuedBatch(lease=lease.id, epoch=batch.epoch, index=batch.index, ids=list(msg.ids),
                           clips=None if validation else self.planner.clips_of(batch, msg.ids),
                           arrays=arrays, producer=peer.name, frames=int(frames.sum()),
                           frames_computed=int(frames.shape[0] * batch.shape[1]))
        try:
            queue.put(item)
        except QueueFull:
            log.error("queue full on delivery of lease %d; re-planning it", lease.id)
            self._count("queue_full")
            self._release([lease.id])
            return False
        stats = None if validation else MelStats.from_fields(msg.mel_stats, self.cfg.features.n_mels)
        if stats is not None:
            with self._lock:
                self.mel_stats.add(stats)
        return True

    def _tally(self, peer: Peer, msg: wire.Batch, lease: Lease, delivered: int, rejected: int,
               missed: int) -> None:
        """The delivering producer's figures for summary.json."""
        cache = msg.cache or {}

        with self._lock:
            stats = self.producers[peer.name]
            stats.batches += 1
            stats.samples += delivered
            stats.rejected += rejected
            stats.misses += missed
            self.missed += missed
            if msg.prep_ms is not None:
                stats.prep_ms_total += msg.prep_ms
            # Time the prepared batch waited for its credit: high when the trainer is the limit.
            stats.credit_wait_ms_total += max(0.0, lease.credited_t - lease.ready_t) * 1e3
            stats.cache_hits += cache.get("hits", 0)
            stats.cache_computed += cache.get("computed", 0)
            stats.cache_stale += cache.get("stale", 0)
            stats.cache_corrupt += cache.get("corrupt", 0)
            stats.read_retries += msg.read_retries or 0
            stats.model_runs += cache.get("model_runs", 0)
            stats.model_hits += cache.get("model_hits", 0)

    def _welcome(self, peer: Peer) -> wire.Welcome:
        return wire.Welcome(
            producer_index=peer.index, producer_name=peer.name,
            config=wire.ProducerConfig(self.cfg.features, self.cfg.transforms, self.cfg.faults),
            fields=batch_fields(self.cfg), fixed_rows=self.planner.fixed_rows,
            ref_frames=self.cfg.batching.ref_frames, transform_versions=self.transform_versions,
            metadata_file=self.cfg.data.metadata_file,
            feature_cache=self.cfg.data.feature_cache,
            heartbeat_interval_s=self.cfg.pipeline.heartbeat_interval_s,
            heartbeat_timeout_s=self.cfg.pipeline.heartbeat_timeout_s, mel_norm=self.mel_norm)

    # ------------------------------------------------------------ validation passes
    def start_validation(self, number: int, now: float) -> None:
        """Lease validation pass ``number`` (numbers increase; a pass still leasing is
        cancelled first). With no clip held out it is finished at once."""
        self._now = now
        self.cancel_validation(self._val_pass, now)
        if self.validation is None or not self.validation.batches:
            self._finish_validation(number)
            return
        self._val_pass = number
        self._val_pending = Pending(dataclasses.replace(b, epoch=-number) for b in self.validation.batches)
        self._assign_all()
        self._grant()

    def cancel_validation(self, number: int, now: float) -> None:
        """The trainer left pass ``number`` before its end: its pending batches are dropped and
        its leases not credited yet revoked (credited ones still arrive; the trainer skips
        batches of a pass it is not in)."""
        self._now = now
        if not number or number != self._val_pass:
            return
        self._val_pass = 0
        self._val_pending.clear()
        self._revoke([lease.id for lease in self._leases.values()
                      if lease.batch.epoch == -number and lease.state != "credited"])
        self._finish_validation(number)

    def _check_validation_done(self) -> None:
        """The pass is finished when nothing of it is pending or leased."""
        number = self._val_pass
        if not number or self._val_pending or any(lease.batch.epoch == -number for lease in self._leases.values()):
            return
        self._val_pass = 0
        self._finish_validation(number)

    def _finish_validation(self, number: int) -> None:
        with self._lock:
            self.validation_finished = max(self.validation_finished, number)

    def on_message(self, identity: bytes, frames: list[Any], now: float, fd: int = -1) -> None:
        """A message from ``identity`` (the frames after its identity frame), received on the
        connection ``fd`` (-1: a transport without one)."""
        self._now = now
        if not frames:
            self._count("frame_count")
            return
        peer = self.peers.heard(identity, now, fd)
        try:
            msg = wire.decode(frames, max_bytes=self._max_bytes)
        except wire.OtherVersion as exc:
            self._count(exc.reason, exc.detail)
            if exc.kind == wire.HELLO:  # a producer of another version: refused, in its own
                self.peers.other_version(identity, exc)
            return
        except wire.ProtocolError as exc:
            self._count(exc.reason, exc.detail)
            return
        try:
            if msg.kind == wire.HELLO:
                self.peers.saying_hello(identity, fd)
                joined = self.peers.hello(identity, wire.Hello.from_header(msg.fields), now, fd)
                if joined is not None:
                    self._assign(joined)
                return
            if peer is None:
                self._count("unknown_peer", msg.kind)
                if msg.kind in (wire.HEARTBEAT, wire.READY, wire.BATCH):
                    self.peers.nudge(identity, now)
                return
            if msg.kind == wire.BATCH:  # typed in _on_batch, once its lease is known
                self._on_batch(peer, msg, now)
                return
            body = wire.parse(msg)
            if isinstance(body, wire.Ready):
                lease = self._leases.get(body.lease)
                if lease is None or lease.identity != identity or lease.state != "working":
                    self._count("unknown_lease", "ready")
                    return
                lease.state = "ready"
                lease.ready_t = now
                self._grant()
            elif isinstance(body, wire.Heartbeat):
                self.peers.heartbeat(peer, body, now)
            elif isinstance(body, wire.Error):
                text = f"{body.type}: {body.message} (in {body.where})"[:1000]
                log.error("producer %s reported %s", peer.name, text)
                with self._lock:
                    self.producers[peer.name].last_error = text
                if body.fatal:
                    self.peers.left(peer, "crashed")
            elif isinstance(body, wire.Bye):
                log.info("producer %s left, returning %d leases", peer.name, len(peer.leases))
                self.peers.left(peer, "left")
            else:
                self._count("unexpected_kind", msg.kind)
        except wire.ProtocolError as exc:
            self._count(exc.reason, exc.detail)

    def on_handshake_failed(self, unauthenticated: bool, value: int) -> None:
        """A connection failed its security handshake (CURVE): its close follows."""
        self.peers.handshake_failed(unauthenticated, value)

    def on_connection_closed(self, fd: int, now: float) -> None:
        """The connection on ``fd`` closed."""
        self._now = now
        self.peers.connection_closed(fd, now)

    def on_connection_accepted(self, fd: int) -> None:
        """A connection was accepted on ``fd`` (the kernel reuses descriptors)."""
        self.peers.connection_accepted(fd)

    def on_free(self, now: float) -> None:
        """The trainer took a batch: a queue slot is free."""
        self._now = now
        self._grant()

    def tick(self, now: float) -> None:
        """Time passed: heartbeats when due, then the liveness and expiry checks."""
        self._now = now
        if now - self._last_beat >= self.cfg.pipeline.heartbeat_interval_s:
            for identity in list(self._peers):
                self._send(identity, wire.Heartbeat())
            self._last_beat = now
        self._housekeeping(now)

    def stop(self) -> list[bytes]:
        """The run is over: STOP to every producer; the identities that will answer on a connection."""
        for identity in self._peers:
            self._send(identity, wire.Stop("run over"))
        self.peers.stopped()
        return self.peers.on_connections()

    def owner_of(self, fd: int) -> bytes | None:
        """The identity that last spoke on connection ``fd``."""
        return self.peers.owner_of(fd)

    def _housekeeping(self, now: float) -> None:
        self.peers.expire(now)
        timeout = self.cfg.pipeline.heartbeat_timeout_s
        stale = [lease.id for lease in self._leases.values()
                 if lease.state == "credited" and now - lease.credited_t > timeout]
        if stale:
            log.warning("%d credited batches not delivered within %.1f s; re-planning them", len(stale), timeout)
        stuck = [lease.id for lease in self._leases.values()
                 if lease.state == "working" and now - lease.issued_t > self.cfg.pipeline.lease_timeout_s]
        if stuck:
            log.warning("%d leases not prepared within pipeline.lease_timeout_s=%.0f s; re-planning them",
                        len(stuck), self.cfg.pipeline.lease_timeout_s)
        if stale or stuck:
            self._revoke(stale, failure="its credit was not used within pipeline.heartbeat_timeout_s (a batch "
                                        "above pipeline.max_message_mb is dropped by the socket)")
            self._revoke(stuck, failure="not prepared within pipeline.lease_timeout_s")
            self._assign_all()
        self._grant()
