"""The coordinator's scheduler: who prepares which planned batch, and when it may be sent.

A pure state machine with no sockets: the router loop (consumer/coordinator/coordinator.py)
feeds it events (:meth:`Scheduler.on_message`, :meth:`~Scheduler.on_free`,
:meth:`~Scheduler.tick`, the socket monitor's connection events, validation passes asked and
left), each with the time, and sends what it leaves in its outbox
(:meth:`~Scheduler.take_outbox`). Its parts, each with its own state: the peers (peers.py),
the leases (leases.py), the credits (credits.py), the re-planning (replan.py) and the figures
(figures.py). docs/design/scheduling.md, "Leases and exactly-once", "The scheduler's parts",
tells the long story.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ..buffer import BatchQueue, QueuedBatch, QueueFull
from .credits import Credits
from .figures import Failover, Figures
from .lease_tables import ReferenceTable, TokenTable
from .leases import Lease, Leases, LeaseWriter, ValidationSet, is_validation, mismatch
from .peers import Peer, Peers
from ..plan import EpochPlanner, PlannedBatch
from ..position import InputPosition
from .replan import Replanner
from ...producer.transforms import load_user
from ...shared import wire
from ...shared.batch import FRAMES, batch_dims
from ...shared.config import Config, batch_fields, batch_schema
from ...shared.dataset.agreement import Reference
from ...shared.dataset.layouts import Rejection
from ...shared.mel import user_mel_function
from ...shared.melstats import MelStats
from ...shared.text import PAD_ID

log = logging.getLogger("consumer.coordinator")

# A message for the producer with that identity, and the protocol version to encode it in
# (another only for a REFUSE to a producer of that version).
Outgoing = tuple[bytes, wire.Body, int]


def transform_versions(cfg: Config) -> dict[str, str]:
    """The versions of the user transforms (producer/transforms.py), of the user's mel function
    (features.user, shared/mel.py) and of the producer models, which every producer must run too."""
    versions = {spec: version for spec, _, version in load_user(cfg.transforms.user)}
    if cfg.features.user:
        versions[cfg.features.user] = user_mel_function(cfg.features.user)[1]
    if cfg.transforms.models:  # the producer models' source and weights (producer/models.py)
        from ...producer.models import model_versions  # loads the models in a child: only with a model configured

        versions.update(model_versions(cfg.transforms.models))
    return versions


class Scheduler:
    """The state machine over the peers, leases, credits and re-planning (module docstring).
    ``queue``: the bounded queue delivered batches go into (its capacity and depth decide the
    credits); ``resume``: the input position a resumed run leases the rest of."""

    def __init__(self, cfg: Config, planner: EpochPlanner, queue: BatchQueue, max_epochs: int | None = None,
                 on_rejected: Callable[[list[Rejection]], None] | None = None,
                 dataset: Reference | None = None, resume: InputPosition | None = None,
                 tokens: TokenTable | None = None, references: ReferenceTable | None = None,
                 mel_norm: dict[str, Any] | None = None, now: float = 0.0,
                 validation: ValidationSet | None = None) -> None:
        self.cfg = cfg
        self.transform_versions = transform_versions(cfg)
        # transforms.mel_norm: the statistics producers normalise with (None: off); and the ones measured.
        self.mel_norm = mel_norm
        self.mel_stats = MelStats.empty(cfg.features.n_mels)
        self.schema = batch_schema(cfg)
        self.planner = planner
        self.ordered = planner.workers > 1  # a worker's share: batches reach the trainer in plan order
        self.queue = queue
        self.validation = validation
        self.on_rejected = on_rejected or (lambda rejections: None)
        self._now = now  # the time of the event being handled
        self._last_beat = now
        self._outbox: list[Outgoing] = []
        self.figures = Figures()
        self.peers = Peers(cfg, dataset, self._send, self.figures.count, self._welcome, self._on_dropped,
                           lambda peer: bool(self.leases.credited(peer)), self.figures.lock)
        self.figures.producers = self.peers.producers  # the per-producer figures deliveries add to
        self.leases = Leases()
        self.writer = LeaseWriter(tokens, references, validation, dataset, "clip" in self.schema.names)
        # The id token rows are padded with: the vocabulary's (a user tokenizer's own pad id).
        self.token_pad = tokens.vocabulary.padding_id if tokens is not None else PAD_ID
        self.replan = Replanner(planner, self.ordered, max_epochs, resume, self._reject)
        self.credits = Credits(queue, validation.queue if validation is not None else None, self.leases,
                               self.replan, self.ordered, self._send)
        self.validation_finished = 0  # the last pass finished (read by the trainer's thread)
        self._max_bytes = cfg.pipeline.max_message_bytes

    # ------------------------------------------------------------ figures for the trainer
    def alive(self) -> int:
        return self.peers.alive()

    def first_open_epoch(self) -> int:
        """The first epoch not yet wholly trained where the run resumed from a position; 0 otherwise."""
        resume = self.replan.resume
        return resume.first_open() if resume is not None else 0

    def rejected_in_epoch(self, epoch: int) -> int:
        """Samples of ``epoch`` rejected while the run went on (they will not be trained)."""
        return self.figures.rejected_in_epoch(epoch)

    def snapshot(self) -> dict[str, Any]:
        return self.figures.snapshot(self.peers.refusals)

    # ------------------------------------------------------------ sending
    def _send(self, identity: bytes, msg: wire.Body, version: int = wire.PROTOCOL_VERSION) -> None:
        self._outbox.append((identity, msg, version))

    def take_outbox(self) -> list[Outgoing]:
        """The messages to send, in order; the outbox is empty afterwards."""
        out, self._outbox = self._outbox, []
        return out

    def _welcome(self, peer: Peer) -> wire.Welcome:
        return wire.Welcome(
            producer_index=peer.index, producer_name=peer.name,
            config=wire.ProducerConfig(self.cfg.features, self.cfg.transforms, self.cfg.faults),
            fields=batch_fields(self.cfg), fixed_rows=self.planner.fixed_rows,
            ref_frames=self.cfg.batching.ref_frames, transform_versions=self.transform_versions,
            metadata_file=self.cfg.data.metadata_file,
            feature_cache=self.cfg.data.feature_cache,
            heartbeat_interval_s=self.cfg.pipeline.heartbeat_interval_s,
            heartbeat_timeout_s=self.cfg.pipeline.heartbeat_timeout_s, mel_norm=self.mel_norm,
            token_pad=self.token_pad)

    # ------------------------------------------------------------ events
    def on_message(self, identity: bytes, frames: list[Any], now: float, fd: int = -1) -> None:
        """A message from ``identity`` (the frames after its identity frame), received on the
        connection ``fd`` (-1: a transport without one)."""
        self._now = now
        if not frames:
            self.figures.count("frame_count")
            return
        peer = self.peers.heard(identity, now, fd)
        try:
            msg = wire.decode(frames, max_bytes=self._max_bytes)
        except wire.OtherVersion as exc:
            self.figures.count(exc.reason, exc.detail)
            if exc.kind == wire.HELLO:  # a producer of another version: refused, in its own
                self.peers.other_version(identity, exc)
            return
        except wire.ProtocolError as exc:
            self.figures.count(exc.reason, exc.detail)
            return
        try:
            if msg.kind == wire.HELLO:
                self.peers.saying_hello(identity, fd)
                joined = self.peers.hello(identity, wire.Hello.from_header(msg.fields), now, fd)
                if joined is not None:
                    self._assign(joined)
            elif peer is None:
                self.figures.count("unknown_peer", msg.kind)
                if msg.kind in (wire.HEARTBEAT, wire.READY, wire.BATCH):
                    self.peers.nudge(identity, now)
            elif msg.kind == wire.BATCH:  # typed in _on_batch, once its lease is known
                self._on_batch(peer, msg)
            else:
                self._on_body(peer, wire.parse(msg), msg.kind, now)
        except wire.ProtocolError as exc:
            self.figures.count(exc.reason, exc.detail)

    def _on_body(self, peer: Peer, body: wire.Body, kind: str, now: float) -> None:
        """A typed message of a peer, but a BATCH."""
        if isinstance(body, wire.Ready):
            if not self.leases.ready(peer.identity, body.lease, now):
                self.figures.count("unknown_lease", "ready")
                return
            self.credits.grant(now)
        elif isinstance(body, wire.Heartbeat):
            self.peers.heartbeat(peer, body, now)
        elif isinstance(body, wire.Error):
            text = f"{body.type}: {body.message} (in {body.where})"[:1000]
            log.error("producer %s reported %s", peer.name, text)
            self.figures.error(peer.name, text)
            if body.fatal:
                self.peers.left(peer, "crashed")
        elif isinstance(body, wire.Bye):
            log.info("producer %s left, returning %d leases", peer.name, len(peer.leases))
            self.peers.left(peer, "left")
        else:
            self.figures.count("unexpected_kind", kind)

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
        self.credits.grant(now)

    def tick(self, now: float) -> None:
        """Time passed: heartbeats when due, then the liveness and expiry checks."""
        self._now = now
        if now - self._last_beat >= self.cfg.pipeline.heartbeat_interval_s:
            for identity in list(self.peers.live):
                self._send(identity, wire.Heartbeat())
            self._last_beat = now
        self.peers.expire(now)
        pipeline = self.cfg.pipeline
        stale, stuck = self.leases.expired(now, pipeline.heartbeat_timeout_s, pipeline.lease_timeout_s)
        if stale:
            log.warning("%d credited batches not delivered within %.1f s; re-planning them", len(stale),
                        pipeline.heartbeat_timeout_s)
        if stuck:
            log.warning("%d leases not prepared within pipeline.lease_timeout_s=%.0f s; re-planning them",
                        len(stuck), pipeline.lease_timeout_s)
        if stale or stuck:
            self._revoke(stale, failure="its credit was not used within pipeline.heartbeat_timeout_s (a batch "
                                        "above pipeline.max_message_mb is dropped by the socket)")
            self._revoke(stuck, failure="not prepared within pipeline.lease_timeout_s")
            self._assign_all()
        self.credits.grant(now)

    def stop(self) -> list[bytes]:
        """The run is over: STOP to every producer; the identities that will answer on a connection."""
        for identity in self.peers.live:
            self._send(identity, wire.Stop("run over"))
        self.peers.stopped()
        return self.peers.on_connections()

    def owner_of(self, fd: int) -> bytes | None:
        """The identity that last spoke on connection ``fd``."""
        return self.peers.owner_of(fd)

    # ------------------------------------------------------------ validation passes
    def start_validation(self, number: int, now: float) -> None:
        """Lease validation pass ``number`` (numbers increase; a pass still leasing is
        cancelled first). With no clip held out it is finished at once."""
        self._now = now
        self.cancel_validation(self.replan.validation_pass, now)
        if self.validation is None or not self.validation.batches:
            self._finish_validation(number)
            return
        self.replan.start_pass(number, self.validation.batches)
        self._assign_all()
        self.credits.grant(now)

    def cancel_validation(self, number: int, now: float) -> None:
        """The trainer left pass ``number`` before its end: its pending batches are dropped and
        its leases not credited yet revoked (credited ones still arrive; the trainer skips
        batches of a pass it is not in)."""
        self._now = now
        if not number or number != self.replan.validation_pass:
            return
        self.replan.end_pass()
        self._revoke([lease.id for lease in self.leases.of_pass(number) if lease.state != "credited"])
        self._finish_validation(number)

    def _check_validation_done(self) -> None:
        """The pass is finished when nothing of it is pending or leased."""
        number = self.replan.validation_pass
        if not number or self.replan.validation_pending or self.leases.of_pass(number):
            return
        self.replan.end_pass()
        self._finish_validation(number)

    def _finish_validation(self, number: int) -> None:
        with self.figures.lock:
            self.validation_finished = max(self.validation_finished, number)

    # ------------------------------------------------------------ leasing
    def _lease(self, peer: Peer, batch: PlannedBatch) -> None:
        lease = self.leases.issue(batch, peer.identity, self._now)
        peer.leases.add(lease.id)
        message = self.writer.message(lease, peer.remote)
        lease.positions = message.positions  # what its batch's clip field must hold (mismatch checks)
        self._send(peer.identity, message)
        self.figures.leased(peer.name, batch, self._now - peer.joined_t, time.time())

    def _assign(self, peer: Peer) -> None:
        """Fill the peer's free lease slots: the pass's batches in slots of their own beside the
        training ones."""
        ahead = self.cfg.pipeline.lease_ahead
        while self.replan.validation_pending and len(self.leases.of(peer, True)) < ahead:
            batch = self.replan.take_validation_for(peer)
            if batch is None:
                if self.replan.reject_unplaceable_validation(list(self.peers.live.values())):
                    self._check_validation_done()
                    continue
                break
            self._lease(peer, batch)
        while len(self.leases.of(peer, False)) < ahead:
            batch = self.replan.take_for(peer)
            if batch is None:
                if self.replan.pending and self.replan.reject_unplaceable(list(self.peers.live.values())):
                    continue  # work nobody alive can do was rejected; look again
                return
            self._lease(peer, batch)

    def _assign_all(self) -> None:
        for peer in sorted(self.peers.live.values(), key=lambda p: len(p.leases)):
            self._assign(peer)
        if self.ordered and self.peers.live:
            victim = self.replan.room_in_window(self.credits.window(), self.queue.capacity, self.leases)
            if victim is not None:
                self._revoke([victim.id])
                self._assign_all()

    def _release(self, lease_ids: list[int], orphaned_by: Failover | None = None, failure: str = "") -> None:
        """Put leased batches back at the front of the plan (replan.py); ``failure``: how
        their leases failed."""
        released = []
        for lease_id in lease_ids:
            lease = self.leases.pop(lease_id)
            if lease is None:
                continue
            if lease.state == "credited":
                self.credits.returned(lease)
            peer = self.peers.live.get(lease.identity)
            if peer is not None:
                peer.leases.discard(lease_id)
            released.append(lease)
        reissued = self.replan.put_back(released, failure, lambda batch: self.figures.orphaned(batch, orphaned_by))
        if failure and self.replan.validation_pass:
            self._check_validation_done()  # its last batch may have been rejected
        if reissued:
            self.figures.reissue(reissued)

    def _revoke(self, lease_ids: list[int], failure: str = "") -> None:
        """Re-plan leases a live producer still holds, and tell it to forget them."""
        for lease_id in lease_ids:
            lease = self.leases.get(lease_id)
            if lease is not None and lease.identity in self.peers.live:
                self._send(lease.identity, wire.Revoke(lease_id))
        self._release(lease_ids, failure=failure)

    def _on_dropped(self, peer: Peer, status: str) -> None:
        """A peer is gone (consumer/coordinator/peers.py): its leases go back to the front of the plan."""
        now = self._now
        failover = None
        if peer.leases:
            failover = Failover(producer=peer.name, status=status, leases=len(peer.leases),
                                silent_s=round(now - peer.last_seen, 3),
                                last_heard_unix=time.time() - (now - peer.last_seen), declared_unix=time.time())
        # The batches in flight when it went (credited) count as failed: one above the socket's
        # limit drops every producer that sends it; the ones it was preparing had no chance yet.
        sending = self.leases.credited(peer)
        self._release([i for i in sorted(peer.leases) if i not in sending], orphaned_by=failover)
        self._release(sending, orphaned_by=failover, failure="" if status == "left" else
                      "its producer's connection closed while sending it (a batch above pipeline.max_message_mb "
                      "is dropped by the socket, or the producer died)")
        if failover is not None:
            self.figures.failover(failover)
        self._assign_all()
        self.credits.grant(now)

    def _reject(self, epoch: int, rejections: list[Rejection]) -> None:
        """Clips of ``epoch`` (or of validation pass ``-epoch``) rejected."""
        if not rejections:
            return
        self.figures.rejected(epoch, len(rejections))
        self.on_rejected(rejections)

    # ------------------------------------------------------------ deliveries
    def _on_batch(self, peer: Peer, msg: wire.Message) -> None:
        """A BATCH: checked against its lease, queued, its rejections and misses accounted."""
        lease, reason = self.leases.for_delivery(peer.identity, msg.fields.get("lease"))
        if lease is None:
            self.figures.count(reason, str(msg.fields.get("lease")))
            return
        try:  # typed only now: a malformed batch of a credited lease is re-planned, not left to time out
            batch = wire.Batch.from_header(msg.fields)
            # Fixed rows: the lease's rows, the empty ones marked; else only the clips delivered.
            rows = lease.batch.rows if self.planner.fixed_rows else len(batch.ids)
            f = self.cfg.features
            dims = batch_dims(rows, lease.batch.shape, f.n_mels, f.hop_length, self.cfg.batching.ref_frames)
            problem = mismatch(lease, batch, msg.arrays, self.schema, dims)
        except wire.ProtocolError as exc:
            problem = str(exc)
        if problem is not None:
            self.figures.count("bad_batch", f"lease {lease.id}: {problem}")
            log.warning("batch of lease %d from %s does not match its plan (%s); re-planning it",
                        lease.id, peer.name, problem)
            self._release([lease.id], failure=f"its batch did not match the plan ({problem})")
            self._assign_all()
            self.credits.grant(self._now)
            return
        self.replan.delivered(lease.batch)
        delivered = list(batch.ids)
        validation = is_validation(lease.batch)
        if (delivered or (self.ordered and not validation)) and not self._enqueue(peer, batch, msg.arrays, lease):
            return
        self.credits.returned(lease)
        self.leases.pop(lease.id)
        peer.leases.discard(lease.id)
        rejections = [Rejection(e.id, e.reason[:300] or "rejected by producer", peer.name) for e in batch.rejected]
        self.figures.delivered(peer.name, batch, lease, len(delivered), len(rejections), len(batch.missed))
        for r in rejections:
            log.warning("producer %s rejected %s: %s", peer.name, r.id, r.reason)
        self._reject(lease.batch.epoch, rejections)
        if batch.missed:
            self.replan.missed(peer, lease.batch, [(e.id, e.reason) for e in batch.missed])
            self.figures.lacks(peer.name, len(peer.lacks))
        # Every producer with a free slot, not only this one: one that lacks clips may have
        # found nothing it could take a moment ago, and there may be new work now.
        self._assign_all()
        if validation:
            self._check_validation_done()
        if not delivered and (validation or not self.ordered):
            self.credits.grant(self._now)  # the credit came back without filling a slot

    def _enqueue(self, peer: Peer, msg: wire.Batch, arrays: dict[str, Any], lease: Lease) -> bool:
        """The batch into the bounded queue (and its mel statistics counted); False if it was
        full, which credits make impossible: then it is re-planned, not lost."""
        batch = lease.batch
        validation = is_validation(batch)
        queue = self.validation.queue if validation and self.validation is not None else self.queue
        frames = arrays[FRAMES]
        clips = None if validation else self.planner.clips_of(batch, msg.ids)
        item = QueuedBatch(lease=lease.id, epoch=batch.epoch, index=batch.index, ids=list(msg.ids), clips=clips,
                           arrays=arrays, producer=peer.name, frames=int(frames.sum()),
                           frames_computed=int(frames.shape[0] * batch.shape[1]),
                           whole=clips is not None and self.planner.is_whole(batch.epoch, batch.index, clips))
        try:
            queue.put(item)
        except QueueFull:
            log.error("queue full on delivery of lease %d; re-planning it", lease.id)
            self.figures.count("queue_full")
            self._release([lease.id])
            return False
        stats = None if validation else MelStats.from_fields(msg.mel_stats, self.cfg.features.n_mels)
        if stats is not None:
            with self.figures.lock:
                self.mel_stats.add(stats)
        return True
