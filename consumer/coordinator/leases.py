"""The scheduler's leases: each planned batch handed to one producer under a fresh id.

A lease goes working -> ready -> credited -> delivered (then it is gone). Re-issuing a
planned batch makes a new id, so a late delivery of an old one is told apart and dropped;
a lease not prepared in time, or whose credit is not used, has expired. The LEASE message is
written here too. docs/design/scheduling.md, "Leases and exactly-once", tells the long story.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ..buffer import BatchQueue
from .lease_tables import ReferenceTable, TokenTable
from .peers import Peer
from ..plan import PlannedBatch
from ...shared import wire
from ...shared.batch import BatchSchema
from ...shared.dataset.agreement import Reference

# The epoch a validation clip's reference clip is chosen for: the same one at every pass.
VALIDATION_REFERENCES = -1


def is_validation(batch: PlannedBatch) -> bool:
    """A batch of a validation pass (epoch ``-pass``), not of the training plan."""
    return batch.epoch < 0


@dataclass
class ValidationSet:
    """The held-out clips as the scheduler leases them, a pass at a time (docs/design/scheduling.md,
    "Validation passes")."""

    batches: list[PlannedBatch]  # consumer/plan.validation_batches: the same at every pass
    queue: BatchQueue  # where their batches go, with credits of its own
    tokens: TokenTable | None = None  # their token ids (None only where no producer makes batches)
    references: ReferenceTable | None = None  # their reference clips, among themselves (ref_mel on)
    # Each clip's text and audio file, which the leases carry: data.eval_file's clips are in no
    # producer's metadata.
    texts: dict[str, str] = dataclasses.field(default_factory=dict)
    files: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclass
class Lease:
    """A planned batch leased to the producer ``identity``, and when it moved on."""

    id: int
    batch: PlannedBatch
    identity: bytes
    state: str = "working"  # working -> ready -> credited -> (delivered: removed)
    issued_t: float = 0.0
    ready_t: float = 0.0
    credited_t: float = 0.0
    positions: tuple[int, ...] = ()  # its clips' positions in the run's clip list, as the LEASE carried them


def mismatch(lease: Lease, batch: wire.Batch, arrays: dict[str, Any], schema: BatchSchema,
             dims: Mapping[str, int]) -> str | None:
    """Why a BATCH does not match its lease (its arrays against ``schema`` at the lease's
    dimensions ``dims``, its clips against the lease's), or None if it does."""
    problem = schema.check(arrays, dims)
    if problem:
        return problem
    accounted = [*batch.ids, *(e.id for e in batch.rejected), *(e.id for e in batch.missed)]
    if len(accounted) != len(lease.batch.ids) or set(accounted) != set(lease.batch.ids):
        return "its clips are not the lease's"
    if lease.positions and "clip" in arrays:
        position = dict(zip(lease.batch.ids, lease.positions))
        if arrays["clip"][:len(batch.ids)].tolist() != [position[i] for i in batch.ids]:
            return "its clip field does not name the lease's clips in its rows' order"
    return schema.check_rows(arrays, len(batch.ids)) or None


class Leases:
    """The leases out, by id (module docstring)."""

    def __init__(self) -> None:
        self._by_id: dict[int, Lease] = {}
        self._next_id = 1

    def issue(self, batch: PlannedBatch, identity: bytes, now: float) -> Lease:
        """A new lease of ``batch`` for ``identity``, under an id never used before."""
        lease = Lease(self._next_id, batch, identity, issued_t=now)
        self._next_id += 1
        self._by_id[lease.id] = lease
        return lease

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._by_id.values()))

    def __getitem__(self, lease_id: int) -> Lease:
        return self._by_id[lease_id]

    def get(self, lease_id: int) -> Lease | None:
        return self._by_id.get(lease_id)

    def pop(self, lease_id: int) -> Lease | None:
        return self._by_id.pop(lease_id, None)

    def of(self, peer: Peer, validation: bool) -> list[Lease]:
        """The peer's leases of validation passes (``validation``) or of the training plan."""
        return [self._by_id[i] for i in peer.leases
                if i in self._by_id and is_validation(self._by_id[i].batch) == validation]

    def credited(self, peer: Peer) -> list[int]:
        """The ids of the peer's credited leases (batches it may be sending), in order."""
        return [i for i in sorted(peer.leases) if i in self._by_id and self._by_id[i].state == "credited"]

    def credits_held(self) -> collections.Counter[bytes]:
        """Credited leases per producer identity."""
        return collections.Counter(lease.identity for lease in self._by_id.values() if lease.state == "credited")

    def of_pass(self, number: int) -> list[Lease]:
        """The leases of validation pass ``number``."""
        return [lease for lease in self._by_id.values() if lease.batch.epoch == -number]

    def ready(self, identity: bytes, lease_id: int, now: float) -> bool:
        """READY from ``identity``: its working lease's batch is prepared; False (nothing
        changed) for a lease that is not its, or not working."""
        lease = self._by_id.get(lease_id)
        if lease is None or lease.identity != identity or lease.state != "working":
            return False
        lease.state, lease.ready_t = "ready", now
        return True

    def for_delivery(self, identity: bytes, lease_id: object) -> tuple[Lease | None, str]:
        """The credited lease a BATCH from ``identity`` is for; else None and the reason it is
        dropped (a late duplicate of a re-issued lease is ``unknown_lease``)."""
        valid_id = isinstance(lease_id, int) and not isinstance(lease_id, bool)
        lease = self._by_id.get(lease_id) if valid_id else None  # type: ignore[arg-type]
        if lease is None:
            return None, "unknown_lease"
        if lease.identity != identity:
            return None, "wrong_producer"
        if lease.state != "credited":
            return None, "uncredited"
        return lease, ""

    def expired(self, now: float, credit_s: float, prepare_s: float) -> tuple[list[int], list[int]]:
        """The credited leases not delivered within ``credit_s`` and the working ones not
        prepared within ``prepare_s``."""
        stale = [lease.id for lease in self._by_id.values()
                 if lease.state == "credited" and now - lease.credited_t > credit_s]
        stuck = [lease.id for lease in self._by_id.values()
                 if lease.state == "working" and now - lease.issued_t > prepare_s]
        return stale, stuck


class LeaseWriter:
    """The LEASE message of a lease: its clips, shape and rows, and what a producer needs to
    make them without reading metadata (consumer/coordinator/lease_tables.py), from the training
    plan's tables or the validation set's."""

    def __init__(self, tokens: TokenTable | None, references: ReferenceTable | None,
                 validation: ValidationSet | None, dataset: Reference | None, positions: bool = False) -> None:
        # None only where no producer makes batches (tests, benchmarks of the queue).
        self.tokens = tokens
        self.positions = positions  # the clip batch field is on: each lease carries its clips' positions
        self.references = references  # None: the ref_mel batch field is off
        self.validation = validation
        self.dataset = dataset

    def message(self, lease: Lease, remote: bool) -> wire.Lease:
        """``remote``: the producer reads its own copy, so the lease carries each file's size."""
        batch = lease.batch
        tokens, references, ref_epoch = self.tokens, self.references, batch.epoch
        texts = files = None
        if is_validation(batch) and self.validation is not None:
            held = self.validation
            tokens, references, ref_epoch = held.tokens, held.references, VALIDATION_REFERENCES
            named = {*batch.ids, *(references(ref_epoch, batch.ids) if references is not None else ())}
            texts = {i: held.texts[i] for i in named if i in held.texts}
            files = {i: held.files[i] for i in named if i in held.files}
        carried = tokens.lease_fields(batch.ids, batch.clips) if tokens is not None else {}
        refs = tuple(references(ref_epoch, batch.ids, batch.clips)) if references is not None else None
        if tokens is not None:  # the texts and audio of the clips and their references: no producer reads metadata
            texts = {**carried["texts"], **(texts or {})}
            files = {**carried["files"], **tokens.files([r for r in refs or () if r not in carried["files"]]),
                     **(files or {})}
        # A producer on another host reads its own copy: each file's size on the trainer (a stat each);
        # one on this host the trainer's files, each checked against the index's size and mtime.
        sizes = self.dataset.sizes(files) if files and remote and self.dataset is not None else None
        stamps = carried.get("stamps") if not remote else None
        return wire.Lease(
            lease=lease.id, epoch=batch.epoch, index=batch.index, ids=tuple(batch.ids),
            shape=(batch.shape[0], batch.shape[1]), rows=batch.rows,
            tokens=tuple(tuple(row) for row in carried.get("tokens", ())),
            speakers=tuple(carried.get("speakers", ())), languages=tuple(carried.get("languages", ())),
            refs=refs, texts=texts, files=files, durations=carried.get("durations"), sizes=sizes, stamps=stamps,
            positions=carried.get("positions", ()) if self.positions else ())
