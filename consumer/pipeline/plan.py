"""Batch planning: which samples form which batch, and in which padded shape.

Planning is separate from collation (shared/batch.py pads arrays) and from
serialization (shared/wire.py), as lhotse separates its samplers from collate_vectors.

Buckets: each bucket has a shape (B, L, T) = (its rows, its longest text, its longest
clip), L and T rounded up to ``tokens_multiple`` and ``frames_multiple``. Two ways:

- Fixed rows (``max_frames`` 0, the default): samples are sorted by mel length and cut
  into ``num_buckets`` groups of (nearly) equal count; every batch has ``batch_size`` rows.
- Frame budget (``max_frames`` N > 0): every batch holds about N frames: a bucket of
  T frames has B = max(1, N // T) rows (short clips: many rows, long clips: few), so the
  memory a batch needs is about the same in every bucket. The bucket bounds are chosen to
  waste the fewest padded frames (:func:`frame_budget_bounds`: an exact dynamic program
  over the clips' rounded lengths), which puts more buckets where clips are dense.

Model replicas (``devices.replicas`` N > 1, tf.distribute in the trainer): a planned batch is
the global batch of one step, N x B rows, which the trainer splits into N replica batches
of B rows, one per replica, all of the bucket's shape. Each replica's B is the one above.

Trainer workers (a multi-host job, ``workers`` W > 1): every worker plans the same epochs,
of global batches for all of them (W x replicas x B rows), and trains its share of each:
worker w takes every W-th sample of a global batch from the w-th on, in rows for its own
replicas. So each step trains one global batch across the workers, all in its bucket's
shape, and every sample is trained by exactly one worker. A worker's share may be empty
(a global batch of fewer samples than workers): it still takes its step, on empty rows.

Full batches: a bucket's leftover clips (its count mod its rows) move up into the next
bucket, the longest of them first (:func:`fill_buckets`): they are no longer than its
clips, so its T stays (its L is recomputed), and every bucket but the last holds a multiple
of its rows. So an epoch has at most one batch with fewer clips than its bucket's rows: the last
bucket's remainder. Its B is the number of its clips (only real rows), a shape that recurs
every epoch, so :attr:`EpochPlanner.shapes` lists it and the trainer traces it once.

``batching.fixed_rows`` (with either way of bucketing above; always on with model replicas
or trainer workers, which split every batch into equal parts): every batch keeps its
bucket's B rows, the remainder's filled with empty rows (length 0), and the ``row_mask``
batch field [B] says which rows are real (shared/batch.py). Either way every valid sample
is in exactly one batch per epoch, none is dropped.

The plan of an epoch is a pure function of (index, config, epoch): batches within each
bucket and the order of batches are shuffled with a generator seeded by (seed, epoch).
For clips of tar shards the batches are grouped by shard (``batching.shard_window``:
consumer/pipeline/shard_order.py).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence, overload

import numpy as np

from .shard_order import gather_batches, grouped_batches, shard_numbers
from ...shared.batch import batch_dims
from ...shared.config import BatchingConfig, Config, batch_schema
from ...shared.dataset import UNMEASURED, Sample, SampleTable
from ...shared.errors import UserError
from ...shared.vocab import Vocabulary

log = logging.getLogger(__name__)


def round_up(value: Any, multiple: int) -> Any:
    """``value`` (an int, or an array of them) rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


@dataclass(frozen=True, eq=False)
class Bucket:
    index: int
    max_tokens: int  # L: padded token length of this bucket's batches
    max_frames: int  # T: padded mel length of this bucket's batches
    members: np.ndarray  # its clips: rows of ``table``, ordered by (mel frames, id)
    rows: int  # B: rows of this bucket's batches
    table: SampleTable = field(repr=False)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.rows, self.max_tokens, self.max_frames)

    @property
    def sample_ids(self) -> tuple[str, ...]:
        """Its clips' ids, in member order (decoded on each call: for small plans and messages)."""
        return tuple(self.table.strings("id", self.members))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Bucket):
            return NotImplemented
        return (self.index, self.shape) == (other.index, other.shape) and self.sample_ids == other.sample_ids

    __hash__ = None  # type: ignore[assignment]  # compared by value, like the tuple of ids it replaced


@dataclass(frozen=True)
class PlannedBatch:
    epoch: int
    index: int  # position within the epoch
    bucket: int
    ids: tuple[str, ...]
    shape: tuple[int, int]  # (L, T)
    rows: int  # B: the batch's rows (ids fill the first len(ids); more only with fixed rows)
    # Each id's row in the table its tokens come from (the planner's; a validation pass's own
    # table for its batches); () where unknown: looked up by id (SampleTable.find_rows). A
    # handle, not part of what the batch is: two batches of the same ids are equal.
    clips: tuple[int, ...] = field(default=(), compare=False)


def rows_for(max_frames: int, cfg: BatchingConfig, replicas: int = 1) -> int:
    """Rows of a planned batch of a bucket of ``max_frames`` (T): ``replicas`` x B, with B
    ``batch_size``, or under a frame budget N the most rows whose frames fit in N (at least one)."""
    if cfg.max_frames <= 0:
        return cfg.batch_size * replicas
    return max(1, cfg.max_frames // max_frames) * replicas


def frame_budget_bounds(frames: Sequence[int], cfg: BatchingConfig, replicas: int = 1) -> list[int]:
    """The frame bounds (T of each bucket, ascending) that waste the fewest frames.

    The waste of a bucket of bound T holding clips of f_i frames is its padding,
    sum(T - f_i), plus a charge for its leftover clips (count mod rows, with B = N // T rows
    per replica, ``replicas`` x B in all): :func:`fill_buckets` moves them up into the next
    bucket, where they are padded further, or (the last bucket, under fixed rows) they
    leave (-count mod rows) empty rows; the charge is what those empty rows would cost,
    (-count mod rows) x T frames, which steers the bounds towards buckets of whole batches,
    so that few clips move (docs/BENCHMARKS.md: without it more move and more padding is
    computed in more shapes). Bounds are
    multiples of ``frames_multiple`` at or above the clips' rounded lengths; over those m
    candidate values an exact dynamic program (cost of a bucket in O(1) from prefix sums)
    finds the best partition into at most ``num_buckets`` buckets in
    O(num_buckets x m^2), m <= longest clip / frames_multiple.
    """
    values, inverse = np.unique(round_up(np.asarray(frames, np.int64), cfg.frames_multiple), return_inverse=True)
    counts = np.bincount(inverse).astype(np.int64)
    sums = np.bincount(inverse, weights=np.asarray(frames, np.float64))
    cum_n = np.concatenate([[0], np.cumsum(counts)])
    cum_f = np.concatenate([[0.0], np.cumsum(sums)])
    m = len(values)
    k_max = min(cfg.num_buckets, m)
    rows = np.array([rows_for(int(v), cfg, replicas) for v in values], np.int64)

    def cost(starts: np.ndarray, end: int) -> np.ndarray:
        """Waste of buckets covering candidates starts..end (inclusive), bound values[end]."""
        n = cum_n[end + 1] - cum_n[starts]
        bound = float(values[end])
        return n * bound - (cum_f[end + 1] - cum_f[starts]) + ((-n) % rows[end]) * bound

    best = np.full((k_max + 1, m), np.inf)
    choice = np.zeros((k_max + 1, m), np.int64)
    for end in range(m):
        best[1, end] = cost(np.array([0]), end)[0]
    for k in range(2, k_max + 1):
        for end in range(k - 1, m):
            starts = np.arange(k - 1, end + 1)  # this bucket's first candidate
            total = best[k - 1, starts - 1] + cost(starts, end)
            j = int(np.argmin(total))
            best[k, end], choice[k, end] = total[j], starts[j]
    k = int(np.argmin(best[1:, m - 1])) + 1  # fewer buckets when more would not waste less
    bounds, end = [], m - 1
    while k >= 1:
        bounds.append(int(values[end]))
        start = choice[k, end] if k > 1 else 0
        end, k = start - 1, k - 1
    return bounds[::-1]


def as_table(samples: Sequence[Sample]) -> SampleTable:
    """``samples`` as a SampleTable (a list of Samples is put in columns; a table is itself)."""
    return samples if isinstance(samples, SampleTable) else SampleTable.from_samples(samples)


def make_buckets(samples: Sequence[Sample], cfg: BatchingConfig, replicas: int = 1) -> list[Bucket]:
    """Group samples into at most ``cfg.num_buckets`` shape buckets by mel length; a batch of
    a bucket has rows for ``replicas`` replica batches. Every bucket but the last holds a
    multiple of its rows (:func:`fill_buckets`). From the columns of a SampleTable: no
    Sample is made."""
    table = as_table(samples)
    frames, tokens = _lengths(table)
    pairs = [(_bucket(table, n, g, frames, tokens, cfg, replicas), g)
             for n, g in enumerate(_groups(table, frames, cfg, replicas))]
    return fill_buckets(table, pairs, frames, tokens, cfg, replicas)


def _lengths(table: SampleTable) -> tuple[np.ndarray, np.ndarray]:
    """(mel frames, tokens) of every clip of the table."""
    return table.column("num_frames").astype(np.int64), table.column("num_tokens").astype(np.int64)


def _by_length(table: SampleTable, frames: np.ndarray) -> np.ndarray:
    """The rows ordered by (mel frames, id): the table's id order, then a stable sort by
    frames (a radix sort in C when they fit 16 bits)."""
    order = table.id_order()
    keys = frames[order]
    if len(keys) and keys.max() < 1 << 16:
        keys = keys.astype(np.uint16)
    return order[np.argsort(keys, kind="stable")]


def _groups(table: SampleTable, frames: np.ndarray, cfg: BatchingConfig, replicas: int) -> list[np.ndarray]:
    """The rows of each bucket's clips by mel length alone, ordered by (frames, id)."""
    if not len(table):
        return []
    ordered = _by_length(table, frames)
    if cfg.max_frames > 0:
        sorted_frames = frames[ordered]
        bounds = frame_budget_bounds(sorted_frames, cfg, replicas)
        edges = np.searchsorted(round_up(sorted_frames, cfg.frames_multiple), bounds, side="right")
        return [g for g in np.split(ordered, edges[:-1]) if len(g)]
    return [g for g in np.array_split(ordered, min(cfg.num_buckets, len(ordered))) if len(g)]


def _bucket(table: SampleTable, index: int, members: np.ndarray, frames: np.ndarray, tokens: np.ndarray,
            cfg: BatchingConfig, replicas: int) -> Bucket:
    """The bucket of the clips at rows ``members``."""
    longest = round_up(int(frames[members].max()), cfg.frames_multiple)
    return Bucket(index=index, max_tokens=round_up(int(tokens[members].max()), cfg.tokens_multiple),
                  max_frames=longest, members=members, rows=rows_for(longest, cfg, replicas), table=table)


def group_buckets(samples: Sequence[Sample], cfg: BatchingConfig, replicas: int = 1) -> list[Bucket]:
    """The buckets by mel length alone: equal counts (fixed rows) or the frame budget's
    bounds (:func:`frame_budget_bounds`); their leftover clips not yet moved."""
    table = as_table(samples)
    frames, tokens = _lengths(table)
    return [_bucket(table, n, g, frames, tokens, cfg, replicas)
            for n, g in enumerate(_groups(table, frames, cfg, replicas))]


def fill_buckets(table: SampleTable, pairs: Sequence[tuple[Bucket, np.ndarray]], frames: np.ndarray,
                 tokens: np.ndarray, cfg: BatchingConfig, replicas: int) -> list[Bucket]:
    """Buckets of whole batches, from (bucket, its rows ordered by mel length) pairs and the
    table's lengths: from the shortest bucket up, the leftover clips of each
    (its count mod its rows, the longest of its clips) move into the next bucket. They are
    no longer than that bucket's clips, so its T and rows stay; its L is recomputed, and
    its T too when a bucket's longest clips left it (unless its rows would change). The
    last bucket keeps its leftover (the epoch's one batch with fewer clips than rows); a
    bucket left with no clip is dropped (the others renumbered)."""
    out: list[Bucket] = []
    carried = np.zeros(0, np.int64)  # leftover clips of the buckets below, shortest first
    for n, (bucket, members) in enumerate(pairs):
        members = np.concatenate([carried, members])  # still ordered by mel length
        keep = len(members) if n == len(pairs) - 1 else len(members) - len(members) % bucket.rows
        members, carried = members[:keep], members[keep:]
        if not len(members):
            continue
        made = _bucket(table, len(out), members, frames, tokens, cfg, replicas)
        frames_bound = made.max_frames if rows_for(made.max_frames, cfg, replicas) == bucket.rows \
            else bucket.max_frames
        out.append(replace(made, max_frames=frames_bound, rows=bucket.rows))
    return out


# Epoch plans kept once made: the scheduler and the input position each plan the epochs being
# trained (and the one leased ahead), and at millions of clips a plan takes seconds to make.
PLANS_KEPT = 2


class EpochPlan(Sequence[PlannedBatch]):
    """An epoch's planned batches in training order, held as arrays: the table rows of the
    clips of one batch after another (``clips``), where each batch starts, and its bucket. A
    :class:`PlannedBatch` is made only for the batch asked for, so a plan of ten million
    clips costs a few bytes a clip, not a Python object each. With trainer workers, a batch
    is this worker's share of the global batch (every W-th clip from the w-th on)."""

    def __init__(self, planner: "EpochPlanner", epoch: int, clips: np.ndarray, sizes: np.ndarray,
                 buckets: np.ndarray) -> None:
        self.planner = planner
        self.epoch = epoch
        self.clips = clips
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.buckets = buckets

    def __len__(self) -> int:
        return len(self.buckets)

    @overload
    def __getitem__(self, i: int) -> PlannedBatch: ...

    @overload
    def __getitem__(self, i: slice) -> list[PlannedBatch]: ...

    def __getitem__(self, i: int | slice) -> PlannedBatch | list[PlannedBatch]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        planner = self.planner
        bucket = planner.buckets[int(self.buckets[i])]
        clips = self.clips[self.starts[i]:self.starts[i + 1]]
        rows = bucket.rows
        if planner.workers > 1:
            clips, rows = clips[planner.worker::planner.workers], rows // planner.workers
        elif not planner.fixed_rows:
            rows = len(clips)
        return PlannedBatch(epoch=self.epoch, index=i, bucket=bucket.index,
                            ids=tuple(planner.table.strings("id", clips)),
                            shape=(bucket.max_tokens, bucket.max_frames), rows=rows, clips=tuple(clips.tolist()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, EpochPlan | list | tuple):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compared by value, like the list of batches it replaced

    def __repr__(self) -> str:
        return f"EpochPlan(epoch {self.epoch}, {len(self)} batches)"

    def sizes(self) -> np.ndarray:
        """The clips of each batch (this worker's share of them)."""
        whole = np.diff(self.starts)
        if self.planner.workers == 1:
            return whole
        workers, worker = self.planner.workers, self.planner.worker
        return np.maximum(0, (whole - worker + workers - 1) // workers)

    def homes(self) -> np.ndarray:
        """Each table row's batch in this plan (-1: none, or another worker's share)."""
        home = np.full(len(self.planner.table), -1, row_type(len(self)))
        whole = np.diff(self.starts)
        batch = np.repeat(np.arange(len(self), dtype=home.dtype), whole)
        if self.planner.workers == 1:
            home[self.clips] = batch
        else:
            place = np.arange(len(self.clips)) - np.repeat(self.starts[:-1], whole)
            mine = place % self.planner.workers == self.planner.worker
            home[self.clips[mine]] = batch[mine]
        return home


def row_type(count: int) -> type:
    """The integer type for row numbers below ``count``: 4 bytes while they fit."""
    return np.int32 if count < 1 << 31 else np.int64


class EpochPlanner:
    """Deterministic epoch plans over fixed buckets; each batch is one step's, for
    ``replicas`` model replicas, and (``workers`` > 1) worker ``worker``'s share of it.
    Clips are rows of :attr:`table` throughout; their ids only in the batches made."""

    def __init__(self, samples: Sequence[Sample], cfg: BatchingConfig, replicas: int = 1, workers: int = 1,
                 worker: int = 0) -> None:
        self.cfg = cfg
        self.replicas = replicas
        self.workers, self.worker = workers, worker
        self.table = as_table(samples)
        # Batches split into equal parts (one per replica, per worker) keep their bucket's rows.
        self.fixed_rows = cfg.fixed_rows or replicas * workers > 1
        self.buckets = make_buckets(self.table, cfg, replicas * workers)
        # Clips of tar shards: batches grouped by shard (consumer/pipeline/shard_order.py).
        self.shards = shard_numbers(self.table) if cfg.shard_window > 0 else None
        self._shares: dict[int, int] = {}  # epoch -> this worker's samples in it
        self._plans: dict[int, EpochPlan] = {}  # the latest epochs planned (PLANS_KEPT)
        self._homes: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # of the latest epochs (PLANS_KEPT)
        self.batches_per_epoch = sum(-(-len(b.members) // b.rows) for b in self.buckets)
        # Every valid sample is in every epoch; the coordinator may re-plan a missed one into
        # an extra batch, so an epoch is complete when all its samples are trained or rejected.
        self.samples_per_epoch = sum(len(b.members) for b in self.buckets)

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """The planned batch shapes (B, L, T): all the trainer will see of the plan (with
        replicas, B is this worker's rows, ``replicas`` x a replica batch's): the buckets',
        and without fixed rows the last bucket's remainder's, of only its clips (its full
        shape too only when it has a full batch)."""
        if self.fixed_rows:
            return [(b.rows // self.workers, b.max_tokens, b.max_frames) for b in self.buckets]
        shapes = [(b.rows, b.max_tokens, b.max_frames) for b in self.buckets if len(b.members) >= b.rows]
        last = self.buckets[-1] if self.buckets else None
        if last is not None and len(last.members) % last.rows:
            shapes.append((len(last.members) % last.rows, last.max_tokens, last.max_frames))
        return shapes

    def with_ids(self, batch: PlannedBatch, ids: tuple[str, ...], *others: PlannedBatch) -> PlannedBatch:
        """``batch`` holding ``ids`` (a part of it, or more clips of its bucket, from ``others``):
        B stays the bucket's with fixed rows, else it is their count. Their rows are taken
        from the batches they come from."""
        known: dict[str, int] = {}
        for source in (batch, *others):
            if len(source.clips) == len(source.ids):
                known.update(zip(source.ids, source.clips))
        clips = tuple(known[i] for i in ids) if all(i in known for i in ids) else ()
        return replace(batch, ids=ids, clips=clips, rows=batch.rows if self.fixed_rows else len(ids))

    def clips_of(self, batch: PlannedBatch, ids: Sequence[str] | None = None) -> list[int]:
        """The table rows of ``ids`` (default: the batch's), from the batch where it has them,
        else looked up (-1 for an id the table lacks)."""
        ids = batch.ids if ids is None else ids
        if len(batch.clips) == len(batch.ids):
            known = dict(zip(batch.ids, batch.clips))
            if all(i in known for i in ids):
                return [known[i] for i in ids]
        return self.table.find_rows(list(ids))

    def bucket_rows(self, batch: PlannedBatch) -> int:
        """The most clips a batch of ``batch``'s bucket holds (this worker's share of them)."""
        return self.buckets[batch.bucket].rows // self.workers

    def samples_in(self, epoch: int) -> int:
        """The samples this worker trains in ``epoch`` (all of them for a single worker)."""
        if self.workers == 1:
            return self.samples_per_epoch
        if epoch not in self._shares:
            self._shares[epoch] = int(self.plan(epoch).sizes().sum())
        return self._shares[epoch]

    def homes(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Each table row's planned batch in ``epoch`` (its index, -1: none) and each batch's
        sample count: made once per epoch and shared by every InputPosition (they are read
        only), so a copy of a position costs its progress, not a map of every clip."""
        homes = self._homes.get(epoch)
        if homes is None:
            plan = self.plan(epoch)
            homes = self._homes[epoch] = (plan.homes(), plan.sizes())
            while len(self._homes) > PLANS_KEPT:
                del self._homes[min(self._homes)]
        return homes

    def plan(self, epoch: int) -> EpochPlan:
        """The epoch's batches in the order they are trained (``index``); with workers, this
        worker's share of each."""
        cached = self._plans.get(epoch)
        if cached is None:
            cached = self._plans[epoch] = self._global_plan(epoch)
            while len(self._plans) > PLANS_KEPT:
                del self._plans[min(self._plans)]
        return cached

    def _global_plan(self, epoch: int) -> EpochPlan:
        rng = np.random.default_rng([self.cfg.seed, epoch])
        kind = row_type(len(self.table))
        if not self.buckets:
            return EpochPlan(self, epoch, np.zeros(0, kind), np.zeros(0, np.int64), np.zeros(0, np.int64))
        if self.shards is not None:
            clips, sizes, positions = grouped_batches([(b.rows, b.members) for b in self.buckets], self.shards,
                                                      self.cfg.shard_window, rng)
        else:
            parts, batch_sizes, bucket_of = [], [], []
            for position, bucket in enumerate(self.buckets):
                members = bucket.members.astype(kind)
                rng.shuffle(members)
                parts.append(members)
                starts = np.arange(0, len(members), bucket.rows)
                batch_sizes.append(np.minimum(bucket.rows, len(members) - starts))
                bucket_of.append(np.full(len(starts), position, np.int64))
            whole = np.concatenate(batch_sizes)
            order = rng.permutation(len(whole))
            clips = gather_batches(np.concatenate(parts), whole, order)
            sizes, positions = whole[order], np.concatenate(bucket_of)[order]
        return EpochPlan(self, epoch, clips.astype(kind, copy=False), sizes, positions)


def validation_batches(samples: Sequence[Sample], planner: EpochPlanner) -> list[PlannedBatch]:
    """The held-out clips' batches, the same at every validation pass: each clip in the
    smallest training bucket shape (L, T, then its rows) that holds its text and its mel, so
    a model traced for the training shapes traces nothing new; clips no training bucket
    holds go into buckets of their own, made as training buckets are. Within a bucket the
    clips are in id order, cut into batches of the bucket's rows (the last one partial: of
    its clips only, unless rows are fixed).
    A pure function of the clips and the training plan; ``epoch`` is 0 (the scheduler
    marks each pass's)."""
    cfg = planner.cfg
    fitting = sorted(planner.buckets, key=lambda b: (b.max_frames, b.max_tokens, b.index))
    groups: dict[int, list[Sample]] = {}
    leftover = []
    for s in sorted(samples, key=lambda s: s.id):
        bucket = next((b for b in fitting if b.max_frames >= s.num_frames and b.max_tokens >= s.num_tokens), None)
        if bucket is None:
            leftover.append(s)
        else:
            groups.setdefault(bucket.index, []).append(s)
    shapes = {b.index: (b.max_tokens, b.max_frames, b.rows // planner.workers) for b in planner.buckets}
    for extra in make_buckets(leftover, cfg, planner.replicas):
        index = len(planner.buckets) + extra.index
        members = set(extra.sample_ids)
        groups[index] = [s for s in leftover if s.id in members]
        shapes[index] = (extra.max_tokens, extra.max_frames, extra.rows)
    batches: list[PlannedBatch] = []
    row = {s.id: n for n, s in enumerate(samples)}  # their rows in a table of them (TokenTable(samples))
    for bucket_index in sorted(groups):
        tokens, frames, rows = shapes[bucket_index]
        ids = [s.id for s in groups[bucket_index]]
        for start in range(0, len(ids), rows):
            chunk = tuple(ids[start:start + rows])
            batches.append(PlannedBatch(epoch=0, index=len(batches), bucket=bucket_index, ids=chunk,
                                        shape=(tokens, frames), rows=rows if planner.fixed_rows else len(chunk),
                                        clips=tuple(row[i] for i in chunk)))
    return batches


# Room a BATCH message keeps beside its arrays, under pipeline.max_message_mb, for its header:
# its fixed fields and figures (lease, timings, cache counts), plus per row an id and, for a
# clip rejected, its reason (the coordinator keeps 300 characters), plus the mel statistics (two
# float64 per channel, 9 bytes each in msgpack). A real header is below this.
HEADER_FIXED_BYTES = 4 << 10
HEADER_ROW_BYTES = 384
HEADER_CHANNEL_BYTES = 18


def header_bytes(cfg: Config, rows: int) -> int:
    """The most a BATCH header of ``rows`` rows takes (HEADER_FIXED_BYTES and its companions)."""
    return HEADER_FIXED_BYTES + HEADER_ROW_BYTES * rows + HEADER_CHANNEL_BYTES * cfg.features.n_mels


class MessageTooLarge(UserError):
    """A planned batch would not cross the wire: above ``pipeline.max_message_mb`` (one line)."""


def message_bytes(cfg: Config, rows: int, shape: Sequence[int]) -> dict[str, int]:
    """Each field's bytes in a BATCH of ``rows`` rows of bucket ``shape`` = (L, T): the run's
    batch schema (its optional and declared fields too) at that bucket's dimensions."""
    f = cfg.features
    return batch_schema(cfg).nbytes(batch_dims(rows, shape, f.n_mels, f.hop_length, cfg.batching.ref_frames))


def check_message_size(cfg: Config, shapes: Iterable[tuple[int, int, int]]) -> None:
    """Refuse a plan whose largest batch (``shapes``: (B, L, T) of every planned batch,
    training and validation) is over ``pipeline.max_message_mb`` with its header: the
    coordinator's socket would drop every producer that sends it (MessageTooLarge, one line
    naming the bucket, its size and the settings that fix it)."""
    limit = cfg.pipeline.max_message_mb << 20
    sized = [(sum(message_bytes(cfg, b, (l, t)).values()) + header_bytes(cfg, b), (b, l, t)) for b, l, t in shapes]
    if not sized:
        return
    size, (rows, tokens, frames) = max(sized)
    if size <= limit:
        return
    fields = message_bytes(cfg, rows, (tokens, frames))
    heaviest = ", ".join(f"{name} {n / 2**20:.1f}" for name, n in sorted(fields.items(), key=lambda kv: -kv[1])
                         if n >= size / 10)  # the fields that make it large
    seconds = frames * cfg.features.hop_length / cfg.features.sample_rate_hz
    budget = cfg.batching.max_frames
    rows_fix = (f"lower the frame budget batching.max_frames (now {budget})" if budget else
                f"fewer rows: a frame budget batching.max_frames, or a lower batching.batch_size (now "
                f"{cfg.batching.batch_size})")
    raise MessageTooLarge(
        f"the planned batch of bucket (B={rows}, L={tokens}, T={frames}: clips up to {seconds:.0f} s) is "
        f"{size / 2**20:.1f} MB on the wire ({heaviest} MB), over pipeline.max_message_mb="
        f"{cfg.pipeline.max_message_mb}: raise pipeline.max_message_mb, leave long clips out with a lower "
        f"data.max_audio_s (now {cfg.data.max_audio_s:g}), or {rows_fix}")


class PositionError(UserError):
    """A saved input position does not fit this run's epoch plan (one line)."""


@dataclass
class _EpochProgress:
    home: np.ndarray  # table row -> index of its planned batch in this epoch's plan, -1: none (the planner's, shared)
    sizes: np.ndarray  # samples of each planned batch (shared too)
    done: set[int] = field(default_factory=set)
    partial: dict[int, set[int]] = field(default_factory=dict)  # planned index -> rows trained so far
    count: int = 0  # samples trained: kept as they are recorded (asked at every step)

    def add(self, row: int) -> bool:
        index = int(self.home[row]) if 0 <= row < len(self.home) else -1
        if index < 0 or index in self.done:
            return False
        got = self.partial.setdefault(index, set())
        if row in got:
            return False
        got.add(row)
        self.count += 1
        if len(got) == self.sizes[index]:
            self.done.add(index)
            del self.partial[index]
        return True

    def mark_done(self, index: int) -> None:
        """Planned batch ``index`` trained whole."""
        if index not in self.done:
            self.done.add(index)
            self.count += int(self.sizes[index]) - len(self.partial.pop(index, ()))

    def trained(self) -> int:
        return self.count


class InputPosition:
    """How far training got through the epoch plans: the sampler state that a checkpoint saves
    (:meth:`state_dict`) and a resume loads (:meth:`from_state_dict`).

    For every epoch, which of its planned batches were trained. It records the sample ids
    of each trained batch and maps them to the planned batch they belong to in the epoch's
    plan (a pure function of the index, the batching config and the epoch), so a planned
    batch is *done* when all its samples were trained, however they travelled: a producer
    lacking some clips delivers a planned batch in parts, and a missed clip re-planned by
    the coordinator rides in another batch of its bucket or in an extra batch of its own.
    An epoch is *complete* when every sample was trained or rejected
    (:meth:`update_complete`). Several epochs can be open at once, since the coordinator
    leases ahead across the epoch boundary.

    Its state: per open epoch the indices of the done planned batches and the ids trained
    from batches not yet done; complete epochs as ``complete_below`` (all epochs before it)
    and ``complete`` (later ones, when leasing ahead finished one first).
    """

    def __init__(self, planner: EpochPlanner) -> None:
        self.planner = planner
        self.complete: set[int] = set()  # epochs whose every sample was trained or rejected
        self._epochs: dict[int, _EpochProgress] = {}

    def _progress(self, epoch: int) -> _EpochProgress:
        progress = self._epochs.get(epoch)
        if progress is None:
            home, sizes = self.planner.homes(epoch)
            progress = self._epochs[epoch] = _EpochProgress(home, sizes)
        return progress

    def record(self, epoch: int, ids: Sequence[str], index: int | None = None,
               clips: Sequence[int] | None = None) -> None:
        """The samples ``ids`` of ``epoch`` were trained (one batch, planned or re-planned);
        ``clips``: their table rows, where the caller has them (else looked up by id).
        ``index``: the planned batch they are, taken whole (trainer workers step through the
        plan in order, a step per planned batch): it is done, however many samples it had."""
        progress = self._progress(epoch)
        if index is not None and 0 <= index < len(progress.sizes):
            progress.mark_done(index)
        else:
            rows = clips if clips is not None and len(clips) == len(ids) else self.planner.table.find_rows(list(ids))
            strays = [i for i, row in zip(ids, rows) if not progress.add(row)]
            if strays:
                log.warning("epoch %d: %d trained samples are not in its plan or were trained before: %s", epoch,
                            len(strays), strays[:5])
        for done in [e for e in self._epochs if e in self.complete]:  # their ids are needed no more
            del self._epochs[done]

    def first_open(self) -> int:
        epoch = 0
        while epoch in self.complete:
            epoch += 1
        return epoch

    def trained_counts(self) -> dict[int, int]:
        """Samples trained per open epoch (the trainer's completion count starts from these)."""
        return {e: p.trained() for e, p in self._epochs.items() if e not in self.complete}

    def done_batches(self, epoch: int) -> set[int]:
        progress = self._epochs.get(epoch)
        return set(progress.done) if progress is not None else set()

    def remaining(self, batches: Iterable[PlannedBatch]) -> list[PlannedBatch]:
        """The part of an epoch's plan still to train: done planned batches left out, partly
        trained ones cut to their untrained samples (same index, bucket and shape)."""
        return [left for left in map(self.left_of, batches) if left is not None]

    def is_done(self, epoch: int, index: int) -> bool:
        """Whether planned batch ``index`` of ``epoch`` was trained whole."""
        progress = self._epochs.get(epoch)
        return epoch in self.complete or (progress is not None and index in progress.done)

    def left_of(self, batch: PlannedBatch) -> PlannedBatch | None:
        """What is still to train of a planned batch: itself, its untrained samples (same
        index, bucket and shape), or None when it was trained."""
        if self.is_done(batch.epoch, batch.index):
            return None
        progress = self._epochs.get(batch.epoch)
        trained = progress.partial.get(batch.index) if progress is not None else None
        if not trained or not batch.ids:  # an empty share of a global batch: its step is still to take
            return batch
        rows = self.planner.clips_of(batch)
        ids = tuple(i for i, row in zip(batch.ids, rows) if row not in trained)
        if not ids:
            return None
        return batch if len(ids) == len(batch.ids) else self.planner.with_ids(batch, ids)

    def state_dict(self) -> dict[str, Any]:
        below = self.first_open()
        return {
            "complete_below": below,
            "complete": sorted(e for e in self.complete if e > below),
            "open": {str(e): {"done": sorted(p.done),
                              "ids": sorted(self.planner.table.strings(
                                  "id", sorted(row for rows in p.partial.values() for row in rows)))}
                     for e, p in sorted(self._epochs.items()) if e not in self.complete},
        }

    @classmethod
    def from_state_dict(cls, data: Any, planner: EpochPlanner) -> "InputPosition":
        """Rebuild a position; PositionError when it does not fit the plan."""
        position = cls(planner)
        try:
            below = data["complete_below"]
            position.complete = set(range(int(below))) | {int(e) for e in data["complete"]}
            for key, entry in data["open"].items():
                epoch = int(key)
                progress = position._progress(epoch)
                for index in entry["done"]:
                    index = int(index)
                    if not 0 <= index < len(progress.sizes):
                        raise ValueError(f"epoch {epoch} has no planned batch {index}")
                    progress.mark_done(index)
                ids = [str(i) for i in entry["ids"]]
                for sample_id, row in zip(ids, planner.table.find_rows(ids) if ids else []):
                    if row < 0 or progress.home[row] < 0:
                        raise ValueError(f"sample {sample_id!r} is not in the plan of epoch {epoch}")
                    progress.add(row)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PositionError(f"the input position does not fit this run's epoch plan ({exc})") from None
        return position

    def copy(self) -> "InputPosition":
        """An independent copy (for the coordinator, which plans in its own thread)."""
        other = InputPosition(self.planner)
        other.complete = set(self.complete)
        other._epochs = {e: _EpochProgress(p.home, p.sizes, set(p.done), {i: set(r) for i, r in p.partial.items()},
                                           p.count) for e, p in self._epochs.items()}
        return other

    def trained(self, epoch: int) -> int:
        """Samples of ``epoch`` trained so far (all of them once it is complete)."""
        if epoch in self.complete:
            return self.planner.samples_in(epoch)
        progress = self._epochs.get(epoch)
        return progress.trained() if progress is not None else 0

    def update_complete(self, epochs: int | None, rejected_in_epoch: Callable[[int], int]) -> int:
        """Mark the epochs whose every sample was trained or rejected; the number complete.

        ``epochs``: the run's epoch budget (None: look at the epochs trained so far);
        ``rejected_in_epoch``: the samples of an epoch rejected while the run went on.
        """
        candidates = set(range(epochs)) if epochs else set(self._epochs)
        for epoch in sorted(candidates - self.complete):
            if self.planner.workers > 1:  # a worker steps through every planned batch, its share empty or not
                progress = self._epochs.get(epoch)
                if progress is not None and len(progress.done) == len(progress.sizes):
                    self.complete.add(epoch)
            elif self.trained(epoch) + rejected_in_epoch(epoch) >= self.planner.samples_in(epoch):
                self.complete.add(epoch)
        return len(self.complete)


class ReferenceTable:
    """The reference clip of each planned clip, for the ``ref_mel`` batch field: another clip
    of the same speaker, chosen per epoch by a pure function of (seed, epoch, clip id), so a
    re-planned or resumed batch gets the same reference and each epoch another one. A
    speaker with one clip is its own reference (logged once, with the count)."""

    def __init__(self, samples: Sequence[Sample], seed: int) -> None:
        self.seed = seed
        table = self._table = as_table(samples)
        count = len(table)
        speaker = self._speaker = table.column("speaker")  # read once: a view's column is a copy
        # Each speaker's clips ordered by id, as positions in the table; each clip's rank among them.
        order = table.id_order()
        order = order[np.argsort(speaker[order], kind="stable")]
        starts = np.searchsorted(speaker[order], np.arange(len(table.speakers) + 1))
        self._clips = order
        self._start = starts  # the clips of speaker code c: order[starts[c]:starts[c + 1]]
        self._rank = np.empty(count, np.int64)
        self._rank[order] = np.arange(count) - starts[speaker[order]]
        alone = [table.speakers[c] for c in range(len(table.speakers)) if starts[c + 1] - starts[c] == 1]
        if alone:
            log.info("ref_mel: %d speaker(s) have one clip, which is its own reference (%s)", len(alone),
                     ", ".join(alone[:5]))

    def __call__(self, epoch: int, ids: Sequence[str], clips: Sequence[int] | None = None) -> list[str]:
        """The reference clip id of each of ``ids`` in ``epoch``; ``clips``: their table rows,
        where the caller has them (else looked up)."""
        refs = []
        speakers = self._speaker
        rows = clips if clips is not None and len(clips) == len(ids) else self._table.find_rows(list(ids))
        for sample_id, row in zip(ids, rows):
            if row < 0:
                raise KeyError(sample_id)
            code = speakers[row]
            first, count = int(self._start[code]), int(self._start[code + 1] - self._start[code])
            if count == 1:
                refs.append(sample_id)
                continue
            position = int(self._rank[row])
            digest = hashlib.sha256(f"{self.seed}:{epoch}:{sample_id}".encode()).digest()
            k = int.from_bytes(digest[:8], "little") % (count - 1)  # any clip of the speaker but itself
            refs.append(self._table.string("id", int(self._clips[first + (k if k < position else k + 1)])))
        return refs


class TokenTable:
    """The token ids of each planned sample, as its lease carries them to a producer.

    The trainer tokenizes (its index holds each text's units, made once by the text
    front-end and cached), so a producer, here or on another host, needs no front-end,
    phonemizer or vocabulary of its own, and its tokens cannot differ from the index's.
    """

    def __init__(self, samples: Sequence[Sample], vocabulary: Vocabulary) -> None:
        self.vocabulary = vocabulary
        self._table = as_table(samples)
        speakers = {name: n for n, name in enumerate(vocabulary.speakers)}
        languages = {code: n for n, code in enumerate(vocabulary.languages)}
        # The table's speaker and language codes as the vocabulary's ids.
        self._speakers = [speakers.get(name, 0) for name in self._table.speakers]
        self._languages = [languages.get(code, 0) for code in self._table.languages]
        # Read once: a view's column is a copy, and every lease reads them.
        self._columns = tuple(self._table.column(n) for n in ("speaker", "language", "duration_s"))
        # Each clip's audio file as indexed (size, mtime), where the index listed them (table.FILE_COLUMNS).
        self._stamps = ((self._table.column("file_size"), self._table.column("file_mtime_ns"))
                        if self._table.has("file_size") else None)

    def __call__(self, ids: Sequence[str]) -> list[list[int]]:
        return [self.vocabulary.encode(self._table.string("units", r)).tolist() for r in self._rows(ids)]

    def _rows(self, ids: Sequence[str], clips: Sequence[int] | None = None) -> Sequence[int]:
        """The table rows of ``ids``: ``clips`` where the caller has them, else looked up."""
        if clips is not None and len(clips) == len(ids):
            return clips
        rows = self._table.find_rows(ids)
        if min(rows, default=0) < 0:
            raise KeyError(ids[rows.index(-1)])
        return rows

    def files(self, ids: Sequence[str]) -> dict[str, str]:
        """The audio locators of clips ``ids`` the table holds (a validation clip's reference may be
        one it lacks: the validation set names those)."""
        table = self._table
        if not ids:  # no lookup: the first would map every id of the table
            return {}
        return {i: table.string("audio", r) for i, r in zip(ids, table.find_rows(ids)) if r >= 0}

    def lease_fields(self, ids: Sequence[str], clips: Sequence[int] | None = None) -> dict[str, Any]:
        """What a lease carries for its clips: token ids, speaker ids, language ids, and their
        texts, audio locators and durations ({id: ...}), so that a producer reads no metadata; and
        the size and mtime of each clip's audio file as indexed ({id: [size, mtime_ns]}: a file the
        index listed), which a producer on the trainer's host checks its file against when it reads
        it (agreement.stamp_problem). ``clips``: their table rows, where the caller has them."""
        table = self._table
        rows = self._rows(ids, clips)
        speaker, language, duration = self._columns
        stamps = None
        if self._stamps is not None:
            size, mtime = self._stamps
            stamps = {i: [int(size[r]), int(mtime[r])] for i, r in zip(ids, rows) if size[r] != UNMEASURED}
        return {"tokens": [self.vocabulary.encode(table.string("units", r)).tolist() for r in rows],
                "speakers": [self._speakers[speaker[r]] for r in rows],
                "languages": [self._languages[language[r]] for r in rows],
                "texts": {i: table.string("text", r) for i, r in zip(ids, rows)},
                "files": {i: table.string("audio", r) for i, r in zip(ids, rows)},
                "durations": tuple(float(duration[r]) for r in rows), "stamps": stamps or None}
