"""Batch planning: the shape buckets, and each epoch's plan of batches over them.

Which samples form which batch, in which padded shape (B, L, T): the buckets (equal counts
or a frame budget, leftover clips moved up so that batches are full) and an epoch's planned
batches, a pure function of (index, config, epoch) shuffled by (seed, epoch). Apart from
collation (shared/batch.py) and serialization (shared/wire.py), as lhotse keeps its samplers
apart from collate_vectors. docs/design/batches.md and docs/design/training.md, "Several trainer hosts",
tell the long story: the ways of bucketing, full batches, fixed rows, replicas and workers' shares.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, replace
from typing import Any, Sequence, overload

import numpy as np
import xxhash

from .planfiles import BUCKETS, PlanFiles
from .shard_order import gather_batches, grouped_batches
from ..shared.config import BatchingConfig
from ..shared.dataset.table import SampleTable
from ..shared.dataset.types import Sample
from ..shared.dataset.cache import SECTION_ALIGN
from .index.groups import shard_numbers
from ..shared.dataset.table import NUMBER_COLUMNS, buffer_of


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


# The sections of the id column in an index cache file (shared/dataset/table.py SampleTable.sections).
ID_SECTIONS = ("o.id", "s.id")
# The sections the buckets are a function of: the ids (their order) and the lengths.
BUCKET_SECTIONS = (*ID_SECTIONS, "n.num_frames", "n.num_tokens")


def id_digest(table: SampleTable) -> bytes:
    """A digest of the whole index's id column (the table a view is of): :func:`column_digest`."""
    return column_digest(table, ID_SECTIONS)


def column_digest(table: SampleTable, sections: Sequence[str]) -> bytes:
    """A digest of columns of the whole index (the table a view is of), made once: where the
    table is mapped from an index cache file, the xxh3-64 checksums its header stores of the
    columns' sections (written at the index build); else the same checksums made of the columns
    (each section with its padding, as the file would hold it), so a run over a table just built
    and its resume over the cache file agree."""
    whole = table.whole()
    cached = whole.stored_in
    stored = cached.header.get("sections", {}) if cached is not None else {}
    if all(name in stored for name in sections):
        return np.array([int(stored[name][2]) for name in sections], "<u8").tobytes()
    checksums = []
    for name in sections:
        digest = xxhash.xxh3_64()
        data = _section(whole, name)
        if data is not None:
            view = memoryview(data).cast("B")
            digest.update(view)
            digest.update(bytes(-view.nbytes % SECTION_ALIGN))
        checksums.append(digest.intdigest())
    return np.array(checksums, "<u8").tobytes()


def _section(table: SampleTable, name: str) -> Any:
    """The bytes of section ``name`` of a whole table as its cache file would hold them (None: it
    has no such column, as a benchmark's table of numbers alone has no ids)."""
    kind, _, column = name.partition(".")
    if kind == "n":
        return np.ascontiguousarray(table.column(column), NUMBER_COLUMNS[column]) if table.has(column) else None
    strings = table._strings.get(column)
    if strings is None:
        return None
    offsets, blob = strings
    return np.ascontiguousarray(offsets, np.int64) if kind == "o" else buffer_of(blob)


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


def stored_buckets(samples: Sequence[Sample], shapes: Sequence[Sequence[int]], members: np.ndarray) -> list[Bucket]:
    """The buckets another process made (:func:`make_buckets`), from each one's (L, T, B, clip
    count) and all their members one bucket after another: the same buckets, not made again."""
    table = as_table(samples)
    ends = np.cumsum([int(shape[3]) for shape in shapes], dtype=np.int64)
    if len(members) != (int(ends[-1]) if len(ends) else 0):
        raise ValueError(f"{len(members)} bucket members for buckets of {ends[-1] if len(ends) else 0} clips")
    return [Bucket(index=n, max_tokens=int(tokens), max_frames=int(frames), members=part, rows=int(rows), table=table)
            for n, ((tokens, frames, rows, _), part) in enumerate(zip(shapes, np.split(members, ends[:-1])))]


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
                 buckets: np.ndarray, place: np.ndarray | None = None) -> None:
        self.planner = planner
        self.epoch = epoch
        self.clips = clips
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.buckets = buckets
        self._place = place  # table row -> its place in ``clips`` (-1: none); made on first use

    @property
    def place(self) -> np.ndarray:
        """Each table row's place in :attr:`clips` (-1: not in the plan): one array for every
        worker, the map from a trained clip to its batch (:meth:`batch_of`)."""
        if self._place is None:
            self._place = places_of(self.clips, len(self.planner.table))
        return self._place

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

    def whole(self, index: int, rows: Sequence[int]) -> bool:
        """Whether ``rows`` are every clip of batch ``index`` (this worker's share), each once."""
        if not 0 <= index < len(self):
            return False
        clips = self.clips[self.starts[index]:self.starts[index + 1]]
        if self.planner.workers > 1:
            clips = clips[self.planner.worker::self.planner.workers]
        return 0 < len(rows) == len(clips) and np.array_equal(np.sort(np.asarray(rows, clips.dtype)), np.sort(clips))

    def share(self, worker: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Worker ``worker``'s clips of the plan (default: the planner's): their places in
        :attr:`clips` (the epoch's planned order, ascending) and each one's batch. Every worker
        plans the same global batches and takes every W-th clip of each from the w-th on."""
        workers = self.planner.workers
        worker = self.planner.worker if worker is None else worker
        whole = np.diff(self.starts)
        batch = np.repeat(np.arange(len(self), dtype=row_type(len(self))), whole)
        place = np.arange(len(self.clips), dtype=np.int64)
        if workers == 1:
            return place, batch
        mine = (place - self.starts[:-1][batch]) % workers == worker
        return place[mine], batch[mine]

    def order(self) -> np.ndarray:
        """The table rows of the epoch's clips in training order, batch after batch (with workers,
        this worker's share of each batch)."""
        if self.planner.workers == 1:
            return self.clips
        return self.clips[self.share()[0]]

    def batch_of(self, rows: np.ndarray) -> np.ndarray:
        """Each of table ``rows``' batch in this plan (this worker's share of it; -1: none, or
        another worker's share), from :attr:`place`: no map of every row is made per worker."""
        rows = np.asarray(rows, np.int64)
        inside = (rows >= 0) & (rows < len(self.planner.table))
        if not inside.any():  # (an empty table has no place to look in)
            return np.full(len(rows), -1, np.int64)
        place = np.where(inside, self.place[np.where(inside, rows, 0)], -1).astype(np.int64)
        batch = np.searchsorted(self.starts, place, side="right") - 1
        mine = place >= 0
        if self.planner.workers > 1:
            mine &= (place - self.starts[np.maximum(batch, 0)]) % self.planner.workers == self.planner.worker
        return np.where(mine, batch, -1)

    def batch_of_row(self, row: int) -> int:
        """:meth:`batch_of` of one row (a step records a few: no arrays made)."""
        if not 0 <= row < len(self.planner.table):
            return -1
        place = int(self.place[row])
        if place < 0:
            return -1
        batch = int(np.searchsorted(self.starts, place, side="right")) - 1
        workers = self.planner.workers
        if workers > 1 and (place - int(self.starts[batch])) % workers != self.planner.worker:
            return -1
        return batch

    def arrays(self) -> dict[str, np.ndarray]:
        """The plan as the arrays a plan file keeps (consumer/planfiles.py)."""
        return {"clips": self.clips, "sizes": np.diff(self.starts), "buckets": self.buckets, "place": self.place}


def places_of(clips: np.ndarray, rows: int) -> np.ndarray:
    """Each of ``rows`` table rows' place in ``clips`` (-1: none)."""
    place = np.full(rows, -1, row_type(max(rows, len(clips))))
    place[clips] = np.arange(len(clips), dtype=place.dtype)
    return place


def row_type(count: int) -> type:
    """The integer type for row numbers below ``count``: 4 bytes while they fit."""
    return np.int32 if count < 1 << 31 else np.int64


class EpochPlanner:
    """Deterministic epoch plans over fixed buckets; each batch is one step's, for
    ``replicas`` model replicas, and (``workers`` > 1) worker ``worker``'s share of it.
    Clips are rows of :attr:`table` throughout; their ids only in the batches made."""

    def __init__(self, samples: Sequence[Sample], cfg: BatchingConfig, replicas: int = 1, workers: int = 1,
                 worker: int = 0, buckets: Sequence[Bucket] | None = None, files: PlanFiles | None = None) -> None:
        self.cfg = cfg
        self.replicas = replicas
        self.workers, self.worker = workers, worker
        self.table = as_table(samples)
        # Batches split into equal parts (one per replica, per worker) keep their bucket's rows.
        self.fixed_rows = cfg.fixed_rows or replicas * workers > 1
        # Where the buckets and epoch plans are kept for every process of the host
        # (consumer/planfiles.py; None: made in this process).
        self.files = files
        # ``buckets``: made already, by the process that hands this one the plan (stored_buckets).
        self.buckets = list(buckets) if buckets is not None else self._made_buckets()
        # Clips of tar shards: batches grouped by shard (consumer/shard_order.py).
        self.shards = shard_numbers(self.table) if cfg.shard_window > 0 else None
        self._shares: dict[int, int] = {}  # epoch -> this worker's samples in it
        self._plans: dict[int, EpochPlan] = {}  # the latest epochs planned (PLANS_KEPT)
        self._sizes: dict[int, list[int]] = {}  # of the latest epochs (PLANS_KEPT)
        self._key: str | None = None  # made on first use (:attr:`key`)
        self._global_key: str | None = None  # (:attr:`global_key`)
        self.batches_per_epoch = sum(-(-len(b.members) // b.rows) for b in self.buckets)
        # Every valid sample is in every epoch; the coordinator may re-plan a missed one into
        # an extra batch, so an epoch is complete when all its samples are trained or rejected.
        self.samples_per_epoch = sum(len(b.members) for b in self.buckets)

    @property
    def key(self) -> str:
        """A digest of all that this worker's epoch plans are a function of: the seed, the workers'
        split, each bucket's shape and clips (as table rows, in member order) and, for clips of
        shards, the shard window and their shards. An input position saved over other plans is
        refused by it (consumer/position.py). Made once, in C (xxh3 over the arrays: some
        0.1 s at 10^8 clips)."""
        if self._key is None:
            self._key = self._digest(with_worker=True)
        return self._key

    @property
    def global_key(self) -> str:
        """The key of the global plans every worker of the job shares (their plan files,
        consumer/planfiles.py): :attr:`key` without this worker's number, with the
        index's id digest (:func:`id_digest`) and, for a view of the index (a hold-out), the
        buckets' clips as its rows, so that plans of other clips never share a file."""
        if self._global_key is None:
            digest = xxhash.xxh3_128(self._digest(with_worker=False).encode())
            digest.update(id_digest(self.table))
            if self.table.whole() is not self.table:
                for bucket in self.buckets:
                    digest.update(np.ascontiguousarray(self.table.stored_rows(bucket.members), np.int64))
            self._global_key = digest.hexdigest()
        return self._global_key

    def _digest(self, with_worker: bool) -> str:
        digest = xxhash.xxh3_128()
        worker = [self.worker] if with_worker else []
        digest.update(json.dumps([self.cfg.seed, self.fixed_rows, self.replicas, self.workers, *worker,
                                  len(self.table)]).encode())
        for bucket in self.buckets:
            digest.update(json.dumps([*bucket.shape, len(bucket.members)]).encode())
            digest.update(np.ascontiguousarray(bucket.members, np.int64))
        if self.shards is not None:  # the window orders only the batches of shards
            digest.update(json.dumps([self.cfg.shard_window]).encode())
            digest.update(np.ascontiguousarray(self.shards, np.int64))
        return digest.hexdigest()

    def _made_buckets(self) -> list[Bucket]:
        """:func:`make_buckets`, or, with plan files, the buckets of the host's file of them (made
        there by the first process to want them): keyed by all they are a function of, the
        batching config, the split and the index's columns of ids, frames and tokens (their
        digests made at the index build, :func:`column_digest`)."""
        split = self.replicas * self.workers
        if self.files is None:
            return make_buckets(self.table, self.cfg, split)
        digest = xxhash.xxh3_128(json.dumps([dataclasses.asdict(self.cfg), split, len(self.table)]).encode())
        digest.update(column_digest(self.table, BUCKET_SECTIONS))
        if self.table.whole() is not self.table:
            digest.update(np.ascontiguousarray(self.table.stored_rows(np.arange(len(self.table))), np.int64))

        def make() -> dict[str, np.ndarray]:
            made = make_buckets(self.table, self.cfg, split)
            shapes = np.array([[b.max_tokens, b.max_frames, b.rows, len(b.members)] for b in made], np.int64)
            members = np.concatenate([b.members for b in made] or [np.zeros(0, np.int64)])
            return {"shapes": shapes, "members": members.astype(row_type(len(self.table)))}

        arrays = self.files.get(digest.hexdigest() + BUCKETS, make)
        return stored_buckets(self.table, arrays["shapes"].reshape(-1, 4).tolist(), arrays["members"])

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

    def is_whole(self, epoch: int, index: int, rows: Sequence[int]) -> bool:
        """Whether ``rows`` are every clip of planned batch ``index`` of ``epoch``, each once
        (the input position counts such a batch done at once: InputPosition.record). False
        where the epoch's plan is no longer kept: it is not made again for this."""
        plan = self._plans.get(epoch)
        return plan is not None and plan.whole(index, rows)

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

    def batch_sizes(self, epoch: int) -> list[int]:
        """Each planned batch's sample count in ``epoch`` (this worker's share): made once per
        epoch and shared by every InputPosition. A list: a step looks one up, and a NumPy scalar
        costs more to make."""
        sizes = self._sizes.get(epoch)
        if sizes is None:
            sizes = self._sizes[epoch] = self.plan(epoch).sizes().tolist()
            while len(self._sizes) > PLANS_KEPT:
                del self._sizes[min(self._sizes)]
        return sizes

    def plan(self, epoch: int) -> EpochPlan:
        """The epoch's batches in the order they are trained (``index``); with workers, this
        worker's share of each."""
        cached = self._plans.get(epoch)
        if cached is None:
            if self.files is None:
                cached = self._global_plan(epoch)
            else:  # mapped from the host's file of it, made there by the first process to want it
                arrays = self.files.epoch(self.global_key, epoch, lambda: self._global_plan(epoch).arrays())
                cached = EpochPlan(self, epoch, arrays["clips"], arrays["sizes"], arrays["buckets"], arrays["place"])
            self._plans[epoch] = cached
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

