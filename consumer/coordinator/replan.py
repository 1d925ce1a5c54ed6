"""The scheduler's re-planning: what is still to lease, and what comes back to it.

The planned batches wait in the pending list (consumer/coordinator/pending.py), epoch after
epoch (a resumed run from its first open one, less what its input position trained). A
lease lost, revoked or refused puts its batch back at the front in plan order; clips a
producer missed go back into their epoch and bucket shape; clips every live producer lacks,
and a batch whose lease failed ``MAX_LEASE_FAILURES`` times the same way, are rejected. The
validation pass being leased has a pending list of its own. docs/design/scheduling.md,
"Leases and exactly-once", and docs/design/protocol.md, "Missing clips", tell the long story.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Callable

from .leases import Lease, Leases, is_validation
from .peers import Peer
from .pending import Pending
from ..plan import EpochPlanner, PlannedBatch
from ..position import InputPosition
from ...shared.dataset.layouts import Rejection

log = logging.getLogger("consumer.coordinator")

# A producer that lacks clips looks this far into the pending list for a batch it can
# take (whole or in part); beyond it, it waits for others to take the front.
ASSIGN_SCAN_LIMIT = 256
# A planned batch whose lease failed this often the same way (its producer's connection dropped
# or it died holding it, its credit unused, a batch not of its plan, not prepared in time) fails
# for a reason of its own, not its producers': its clips are rejected for the epoch (or the
# pass) and the run goes on. A producer killed now and then holds a given batch once or twice.
MAX_LEASE_FAILURES = 4


def _missing_everywhere(sample_id: str, hosts: str, peers: list[Peer]) -> str:
    """The rejection of a clip every live producer lacks, with the reason the first of them gave."""
    why = next((p.why[sample_id] for p in peers if sample_id in p.why), "")
    return f"audio file missing on every producer host ({hosts})" + (f": {why}" if why else "")


class Replanner:
    """The pending work of the training plan and of the validation pass being leased (module
    docstring). ``ordered``: trainer workers' plan order (every planned batch is a step, an
    empty one too); ``reject(epoch, rejections)`` rejects clips of an epoch (or of pass
    ``-epoch``)."""

    def __init__(self, planner: EpochPlanner, ordered: bool, max_epochs: int | None,
                 resume: InputPosition | None, reject: Callable[[int, list[Rejection]], None]) -> None:
        self.planner = planner
        self.ordered = ordered
        self.max_epochs = max_epochs
        self.reject = reject
        self.pending = Pending()
        # A resumed run leases only what its checkpoint's input position left (consumer/position.py).
        self.resume = resume
        self._next_epoch = resume.first_open() if resume is not None else 0
        self.validation_pass = 0  # the pass being leased (0: none), and its pending batches
        self.validation_pending = Pending()
        # (epoch, index) of a planned batch -> how its leases failed, and how often (MAX_LEASE_FAILURES).
        self._failures: dict[tuple[int, int], collections.Counter[str]] = {}

    # ------------------------------------------------------------ taking work
    def _plan_more(self) -> bool:
        """Plan the next epoch with work left (a resumed one may have none); False at the last."""
        while self.max_epochs is None or self._next_epoch < self.max_epochs:
            self.pending.add_plan(self.planner.plan(self._next_epoch), self.resume)
            self._next_epoch += 1
            if self.pending:
                return True
        return False

    def take_for(self, peer: Peer) -> PlannedBatch | None:
        """The next pending batch this producer can prepare; split off the clips it lacks."""
        if not self.pending and not self._plan_more():
            return None
        if not peer.lacks or self.ordered:
            return self.pending.popleft()
        return self._usable(self.pending, peer)

    def take_validation_for(self, peer: Peer) -> PlannedBatch | None:
        """The next batch of the pass this producer can prepare (split as :meth:`take_for`)."""
        return self._usable(self.validation_pending, peer) if self.validation_pending else None

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

    def earliest_pending_epoch(self) -> int | None:
        """The earliest epoch among the pending batches a producer looks at (None: none)."""
        return min((b.epoch for b in self.pending.head(ASSIGN_SCAN_LIMIT)), default=None)

    # ------------------------------------------------------------ validation passes
    def start_pass(self, number: int, batches: list[PlannedBatch]) -> None:
        """Pass ``number`` is leased: its batches (planned with epoch 0) pending as epoch ``-number``."""
        self.validation_pass = number
        self.validation_pending = Pending(dataclasses.replace(b, epoch=-number) for b in batches)

    def end_pass(self) -> None:
        """The pass is left or finished: nothing of it is pending any more."""
        self.validation_pass = 0
        self.validation_pending.clear()

    # ------------------------------------------------------------ putting back
    def put_back(self, leases: list[Lease], failure: str, orphaned: Callable[[PlannedBatch], None]) -> int:
        """Released leases' batches back at the front of their pending list, in plan order;
        ``failure``: how their leases failed (a batch that failed so MAX_LEASE_FAILURES times is
        rejected; "": not a failure); ``orphaned(batch)`` notes each training batch put back. How
        many were put back."""
        batches, checks = [], []
        for lease in leases:
            validation = is_validation(lease.batch)
            if failure and self._failed(lease.batch, failure):
                if not validation and self.ordered:
                    batches.append(self.planner.with_ids(lease.batch, ()))  # in plan order: still a step, empty
                continue
            if validation:  # back into its pass; one cancelled meanwhile needs it no more
                if lease.batch.epoch == -self.validation_pass:
                    checks.append(lease.batch)
                continue
            batches.append(lease.batch)
            orphaned(lease.batch)
        for batch in sorted(checks, key=lambda b: b.index, reverse=True):
            self.validation_pending.appendleft(batch)
        for batch in sorted(batches, key=lambda b: (b.epoch, b.index), reverse=True):
            self.pending.appendleft(batch)
        if batches and self.ordered:  # leased later ones may come back after earlier ones: keep plan order
            self.pending.sort_made(key=lambda b: (b.epoch, b.index))
        return len(batches) + len(checks)

    def delivered(self, batch: PlannedBatch) -> None:
        """A lease of ``batch`` delivered: its failures are forgotten."""
        self._failures.pop((batch.epoch, batch.index), None)

    def _failed(self, batch: PlannedBatch, failure: str) -> bool:
        """Count a failed lease of its planned batch; at MAX_LEASE_FAILURES the same way, its
        clips are rejected (True): the batch is not leased again."""
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
        if is_validation(batch) and batch.epoch != -self.validation_pass:
            return True  # a cancelled pass: nothing to reject from
        self.reject(batch.epoch, [Rejection(i, reason, "coordinator") for i in batch.ids])
        return True

    def missed(self, peer: Peer, planned: PlannedBatch, missed: list[tuple[str, str]]) -> None:
        """Clips ``peer`` reported missed (id, reason) in a batch of ``planned``: it lacks them;
        they are re-planned for another producer, or in plan order rejected (no extra batch:
        every worker takes the same steps)."""
        peer.lacks.update(i for i, _ in missed)
        peer.why.update((i, reason[:200]) for i, reason in missed)
        if self.ordered and not is_validation(planned):
            self.reject(planned.epoch, [Rejection(i, f"audio file missing on host {peer.host} ({reason[:200]})",
                                                  peer.name) for i, reason in missed])
            return
        for sample_id, reason in missed:
            log.warning("producer %s (host %s) does not have %s (%s); re-planning it onto another producer",
                        peer.name, peer.host, sample_id, reason[:300])
        self.replan_missed(planned, [i for i, _ in missed])

    def replan_missed(self, template: PlannedBatch, ids: list[str]) -> None:
        """Missed clips go back into the same epoch (or validation pass) and bucket shape, for
        another producer (without fixed rows, a batch of only real rows: B is its clips')."""
        validation = is_validation(template)
        if validation and template.epoch != -self.validation_pass:
            return  # a cancelled pass
        pending = self.validation_pending if validation else self.pending
        room = template.rows if validation else self.planner.bucket_rows(template)  # a pass's own buckets too
        made = pending.made()  # into a batch made already; the plan's batches not made yet are full
        for pos, batch in enumerate(made):
            if batch.epoch == template.epoch and batch.bucket == template.bucket \
                    and len(batch.ids) + len(ids) <= room:
                made[pos] = self.planner.with_ids(batch, batch.ids + tuple(ids), template)
                return
        pending.appendleft(self.planner.with_ids(template, tuple(ids)))

    # ------------------------------------------------------------ rejecting
    def reject_unplaceable(self, peers: list[Peer]) -> bool:
        """Reject pending clips that every live producer (``peers``) lacks; True if there were any.

        Called only when a producer has a free lease slot and nothing it can take: the
        clips are rejected as late as possible, so a producer that joins meanwhile with
        the file still trains them.
        """
        common = set.intersection(*(p.lacks for p in peers)) if peers else set()
        if not common:
            return False
        hosts = ", ".join(sorted({p.host for p in peers}))
        kept: list[PlannedBatch] = []
        changed = False
        head = self.pending.head(ASSIGN_SCAN_LIMIT)  # as far as a producer looks for work (_usable)
        for batch in head:
            lost = [i for i in batch.ids if i in common]
            if not lost:
                kept.append(batch)
                continue
            changed = True
            for sample_id in lost:
                log.warning("sample %s is missing on every producer host alive (%s); rejecting it for epoch %d",
                            sample_id, hosts, batch.epoch)
            self.reject(batch.epoch, [Rejection(i, _missing_everywhere(i, hosts, peers), "coordinator")
                                      for i in lost])
            rest = tuple(i for i in batch.ids if i not in common)
            if rest or self.ordered:  # in plan order every planned batch is a step, empty or not
                kept.append(self.planner.with_ids(batch, rest))
        self.pending.replace_head(len(head), kept)
        return changed

    def reject_unplaceable_validation(self, peers: list[Peer]) -> bool:
        """Leave out of the pass the clips every live producer lacks; True if there were any."""
        common = set.intersection(*(p.lacks for p in peers)) if peers else set()
        lost = [i for batch in self.validation_pending.made() for i in batch.ids if i in common]
        if not lost:
            return False
        hosts = ", ".join(sorted({p.host for p in peers}))
        log.warning("%d validation clips are missing on every producer host alive (%s); leaving them out of "
                    "validation pass %d", len(lost), hosts, self.validation_pass)
        self.reject(-self.validation_pass, [Rejection(i, _missing_everywhere(i, hosts, peers), "coordinator")
                                            for i in lost])
        kept = (self.planner.with_ids(b, tuple(i for i in b.ids if i not in common))
                for b in self.validation_pending.made())
        self.validation_pending = Pending(b for b in kept if b.ids)
        return True

    def room_in_window(self, window: set[tuple[int, int]], capacity: int, leases: Leases) -> Lease | None:
        """In plan order: a batch of the credit window still pending while every producer's
        lease slots hold later work (a producer died holding the earliest ones) would wait
        for ever; the latest lease outside the window, to revoke so that a slot takes it
        (None: no batch waits, or no lease to revoke). ``capacity``: the queue's."""
        if not any((b.epoch, b.index) in window for b in self.pending.head(capacity)):
            return None
        later = [lease for lease in leases if lease.state != "credited"
                 and not is_validation(lease.batch) and (lease.batch.epoch, lease.batch.index) not in window]
        if not later:
            return None
        victim = max(later, key=lambda lease: (lease.batch.epoch, lease.batch.index))
        log.info("planned batch %d of epoch %d waits for a lease slot; revoking lease %d (batch %d) to make one",
                 min(window)[1], min(window)[0], victim.id, victim.batch.index)
        return victim
