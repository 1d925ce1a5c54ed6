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
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from stoker.consumer.pipeline.shard_order import grouped_chunks, shard_indices
from stoker.shared.batch import batch_dims
from stoker.shared.config import BatchingConfig, Config, batch_schema
from stoker.shared.dataset import Sample, SampleTable
from stoker.shared.errors import UserError
from stoker.shared.vocab import Vocabulary

log = logging.getLogger(__name__)


def round_up(value: Any, multiple: int) -> Any:
    """``value`` (an int, or an array of them) rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Bucket:
    index: int
    max_tokens: int  # L: padded token length of this bucket's batches
    max_frames: int  # T: padded mel length of this bucket's batches
    sample_ids: tuple[str, ...]
    rows: int  # B: rows of this bucket's batches

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.rows, self.max_tokens, self.max_frames)


@dataclass(frozen=True)
class PlannedBatch:
    epoch: int
    index: int  # position within the epoch
    bucket: int
    ids: tuple[str, ...]
    shape: tuple[int, int]  # (L, T)
    rows: int  # B: the batch's rows (ids fill the first len(ids); more only with fixed rows)


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


def make_buckets(samples: Sequence[Sample], cfg: BatchingConfig, replicas: int = 1) -> list[Bucket]:
    """Group samples into at most ``cfg.num_buckets`` shape buckets by mel length; a batch of
    a bucket has rows for ``replicas`` replica batches. Every bucket but the last holds a
    multiple of its rows (:func:`fill_buckets`). From the columns of a SampleTable: no
    Sample is made."""
    ids, frames, tokens = _lengths(samples)
    groups = _groups(ids, frames, cfg, replicas, samples.id_keys() if isinstance(samples, SampleTable) else None)
    return _fill([(_bucket(n, g, frames, tokens, cfg, replicas), g) for n, g in enumerate(groups)], ids, frames,
                 tokens, cfg, replicas)


def _lengths(samples: Sequence[Sample]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(ids, mel frames, tokens) of the samples: a table's columns, or the Samples' fields."""
    if isinstance(samples, SampleTable):
        return (samples.ids(), samples.column("num_frames").astype(np.int64),
                samples.column("num_tokens").astype(np.int64))
    return ([s.id for s in samples], np.fromiter((s.num_frames for s in samples), np.int64, len(samples)),
            np.fromiter((s.num_tokens for s in samples), np.int64, len(samples)))


def _by_length(ids: list[str], frames: np.ndarray, keys: np.ndarray | None = None) -> np.ndarray:
    """The positions of the samples ordered by (mel frames, id); ``keys``: the ids as ASCII
    bytes (SampleTable.id_keys), when the caller has them."""
    if keys is not None:
        return np.lexsort((keys, frames))
    if all(i.isascii() for i in ids):  # bytes order is str order: a sort in C
        return np.lexsort((np.array([i.encode() for i in ids], dtype=bytes), frames))
    return np.array(sorted(range(len(ids)), key=lambda n: (int(frames[n]), ids[n])), np.int64)


def _groups(ids: list[str], frames: np.ndarray, cfg: BatchingConfig, replicas: int,
            keys: np.ndarray | None = None) -> list[np.ndarray]:
    """The positions of each bucket's samples by mel length alone, ordered by (frames, id)."""
    if not ids:
        return []
    ordered = _by_length(ids, frames, keys)
    if cfg.max_frames > 0:
        sorted_frames = frames[ordered]
        bounds = frame_budget_bounds(sorted_frames, cfg, replicas)
        edges = np.searchsorted(round_up(sorted_frames, cfg.frames_multiple), bounds, side="right")
        return [g for g in np.split(ordered, edges[:-1]) if len(g)]
    return [g for g in np.array_split(ordered, min(cfg.num_buckets, len(ordered))) if len(g)]


def _bucket(index: int, members: np.ndarray, frames: np.ndarray, tokens: np.ndarray, cfg: BatchingConfig,
            replicas: int, ids: list[str] | None = None) -> Bucket:
    """The bucket of the samples at ``members`` (their ids only when ``ids`` is given)."""
    longest = round_up(int(frames[members].max()), cfg.frames_multiple)
    return Bucket(index=index, max_tokens=round_up(int(tokens[members].max()), cfg.tokens_multiple),
                  max_frames=longest, sample_ids=tuple(ids[j] for j in members.tolist()) if ids is not None else (),
                  rows=rows_for(longest, cfg, replicas))


def group_buckets(samples: Sequence[Sample], cfg: BatchingConfig, replicas: int = 1) -> list[Bucket]:
    """The buckets by mel length alone: equal counts (fixed rows) or the frame budget's
    bounds (:func:`frame_budget_bounds`); their leftover clips not yet moved."""
    ids, frames, tokens = _lengths(samples)
    return [_bucket(n, g, frames, tokens, cfg, replicas, ids) for n, g in enumerate(_groups(ids, frames, cfg,
                                                                                             replicas))]


def fill_buckets(buckets: Sequence[Bucket], samples: Sequence[Sample], cfg: BatchingConfig,
                 replicas: int = 1) -> list[Bucket]:
    """Buckets of whole batches: from the shortest bucket up, the leftover clips of each
    (its count mod its rows, the longest of its clips) move into the next bucket. They are
    no longer than that bucket's clips, so its T and rows stay; its L is recomputed, and
    its T too when a bucket's longest clips left it (unless its rows would change). The
    last bucket keeps its leftover (the epoch's one batch with fewer clips than rows); a
    bucket left with no clip is dropped (the others renumbered)."""
    ids, frames, tokens = _lengths(samples)
    position = {sample_id: n for n, sample_id in enumerate(ids)}
    pairs = [(b, np.array([position[i] for i in b.sample_ids], np.int64)) for b in buckets]
    return _fill(pairs, ids, frames, tokens, cfg, replicas)


def _fill(pairs: Sequence[tuple[Bucket, np.ndarray]], ids: list[str], frames: np.ndarray, tokens: np.ndarray,
          cfg: BatchingConfig, replicas: int) -> list[Bucket]:
    """:func:`fill_buckets` over each bucket's sample positions (ordered by mel length)."""
    out: list[Bucket] = []
    carried = np.zeros(0, np.int64)  # leftover clips of the buckets below, shortest first
    for n, (bucket, members) in enumerate(pairs):
        members = np.concatenate([carried, members])  # still ordered by mel length
        keep = len(members) if n == len(pairs) - 1 else len(members) - len(members) % bucket.rows
        members, carried = members[:keep], members[keep:]
        if not len(members):
            continue
        made = _bucket(len(out), members, frames, tokens, cfg, replicas, ids)
        frames_bound = made.max_frames if rows_for(made.max_frames, cfg, replicas) == bucket.rows \
            else bucket.max_frames
        out.append(replace(made, max_frames=frames_bound, rows=bucket.rows))
    return out


# Epoch plans kept once made: the scheduler and the input position each plan the epochs being
# trained (and the one leased ahead), and at millions of clips a plan takes seconds to make.
PLANS_KEPT = 2


class EpochPlanner:
    """Deterministic epoch plans over fixed buckets; each batch is one step's, for
    ``replicas`` model replicas, and (``workers`` > 1) worker ``worker``'s share of it."""

    def __init__(self, samples: Sequence[Sample], cfg: BatchingConfig, replicas: int = 1, workers: int = 1,
                 worker: int = 0) -> None:
        self.cfg = cfg
        self.replicas = replicas
        self.workers, self.worker = workers, worker
        # Batches split into equal parts (one per replica, per worker) keep their bucket's rows.
        self.fixed_rows = cfg.fixed_rows or replicas * workers > 1
        self.buckets = make_buckets(samples, cfg, replicas * workers)
        # Clips of tar shards: batches grouped by shard (consumer/pipeline/shard_order.py).
        self.shards = shard_indices(samples) if cfg.shard_window > 0 else None
        self._shares: dict[int, int] = {}  # epoch -> this worker's samples in it
        self._plans: dict[int, list[PlannedBatch]] = {}  # the latest epochs planned (PLANS_KEPT)
        self._homes: dict[int, tuple[dict[str, int], list[int]]] = {}  # of the latest epochs (PLANS_KEPT)
        self.batches_per_epoch = sum(-(-len(b.sample_ids) // b.rows) for b in self.buckets)
        # Every valid sample is in every epoch; the coordinator may re-plan a missed one into
        # an extra batch, so an epoch is complete when all its samples are trained or rejected.
        self.samples_per_epoch = sum(len(b.sample_ids) for b in self.buckets)

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """The planned batch shapes (B, L, T): all the trainer will see of the plan (with
        replicas, B is this worker's rows, ``replicas`` x a replica batch's): the buckets',
        and without fixed rows the last bucket's remainder's, of only its clips (its full
        shape too only when it has a full batch)."""
        if self.fixed_rows:
            return [(b.rows // self.workers, b.max_tokens, b.max_frames) for b in self.buckets]
        shapes = [(b.rows, b.max_tokens, b.max_frames) for b in self.buckets if len(b.sample_ids) >= b.rows]
        last = self.buckets[-1] if self.buckets else None
        if last is not None and len(last.sample_ids) % last.rows:
            shapes.append((len(last.sample_ids) % last.rows, last.max_tokens, last.max_frames))
        return shapes

    def with_ids(self, batch: PlannedBatch, ids: tuple[str, ...]) -> PlannedBatch:
        """``batch`` holding ``ids`` (a part of it, or more clips of its bucket): B stays the
        bucket's with fixed rows, else it is their count."""
        return replace(batch, ids=ids, rows=batch.rows if self.fixed_rows else len(ids))

    def bucket_rows(self, batch: PlannedBatch) -> int:
        """The most clips a batch of ``batch``'s bucket holds (this worker's share of them)."""
        return self.buckets[batch.bucket].rows // self.workers

    def samples_in(self, epoch: int) -> int:
        """The samples this worker trains in ``epoch`` (all of them for a single worker)."""
        if self.workers == 1:
            return self.samples_per_epoch
        if epoch not in self._shares:
            self._shares[epoch] = sum(len(b.ids) for b in self.plan(epoch))
        return self._shares[epoch]

    def homes(self, epoch: int) -> tuple[dict[str, int], list[int]]:
        """Each sample's planned batch in ``epoch`` (sample id -> index) and each batch's sample
        count: made once per epoch and shared by every InputPosition (they are read only), so
        a copy of a position costs its progress, not a map of every clip."""
        homes = self._homes.get(epoch)
        if homes is None:
            plan = self.plan(epoch)
            homes = self._homes[epoch] = ({i: b.index for b in plan for i in b.ids}, [len(b.ids) for b in plan])
            while len(self._homes) > PLANS_KEPT:
                del self._homes[min(self._homes)]
        return homes

    def plan(self, epoch: int) -> list[PlannedBatch]:
        """The epoch's batches in the order they are trained (``index``); with workers, this
        worker's share of each."""
        cached = self._plans.get(epoch)
        if cached is None:
            batches = self._global_plan(epoch)
            if self.workers > 1:
                batches = [replace(b, ids=b.ids[self.worker::self.workers], rows=b.rows // self.workers)
                           for b in batches]
            cached = self._plans[epoch] = batches
            while len(self._plans) > PLANS_KEPT:
                del self._plans[min(self._plans)]
        return list(cached)

    def _global_plan(self, epoch: int) -> list[PlannedBatch]:
        rng = np.random.default_rng([self.cfg.seed, epoch])
        chunks: list[tuple[Bucket, tuple[str, ...]]] = []
        if self.shards is not None:
            chunks = [(self.buckets[n], ids) for n, ids in grouped_chunks(
                [(b.rows, b.sample_ids) for b in self.buckets], self.shards, self.cfg.shard_window, rng)]
            order = np.arange(len(chunks))  # already in training order
        else:
            for bucket in self.buckets:
                ids = list(bucket.sample_ids)
                rng.shuffle(ids)
                for start in range(0, len(ids), bucket.rows):
                    chunks.append((bucket, tuple(ids[start:start + bucket.rows])))
            order = rng.permutation(len(chunks))
        return [
            PlannedBatch(epoch=epoch, index=i, bucket=chunks[j][0].index, ids=chunks[j][1],
                         shape=(chunks[j][0].max_tokens, chunks[j][0].max_frames),
                         rows=chunks[j][0].rows if self.fixed_rows else len(chunks[j][1]))
            for i, j in enumerate(order)
        ]


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
    for bucket_index in sorted(groups):
        tokens, frames, rows = shapes[bucket_index]
        ids = [s.id for s in groups[bucket_index]]
        for start in range(0, len(ids), rows):
            chunk = tuple(ids[start:start + rows])
            batches.append(PlannedBatch(epoch=0, index=len(batches), bucket=bucket_index, ids=chunk,
                                        shape=(tokens, frames), rows=rows if planner.fixed_rows else len(chunk)))
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
    home: dict[str, int]  # sample id -> index of its planned batch in this epoch's plan (the planner's, shared)
    sizes: list[int]  # samples of each planned batch (shared too)
    done: set[int] = field(default_factory=set)
    partial: dict[int, set[str]] = field(default_factory=dict)  # planned index -> ids trained so far

    def add(self, sample_id: str) -> bool:
        index = self.home.get(sample_id)
        if index is None or index in self.done:
            return False
        got = self.partial.setdefault(index, set())
        if sample_id in got:
            return False
        got.add(sample_id)
        if len(got) == self.sizes[index]:
            self.done.add(index)
            del self.partial[index]
        return True

    def trained(self) -> int:
        return sum(self.sizes[i] for i in self.done) + sum(len(ids) for ids in self.partial.values())

    def trained_ids(self) -> set[str]:
        return {i for i, index in self.home.items() if index in self.done}.union(*self.partial.values())


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

    def record(self, epoch: int, ids: Iterable[str], index: int | None = None) -> None:
        """The samples ``ids`` of ``epoch`` were trained (one batch, planned or re-planned).
        ``index``: the planned batch they are, taken whole (trainer workers step through the
        plan in order, a step per planned batch): it is done, however many samples it had."""
        progress = self._progress(epoch)
        if index is not None and 0 <= index < len(progress.sizes):
            progress.done.add(index)
            progress.partial.pop(index, None)
        else:
            strays = [i for i in ids if not progress.add(i)]
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

    def remaining(self, batches: list[PlannedBatch]) -> list[PlannedBatch]:
        """The part of an epoch's plan still to train: done planned batches left out, partly
        trained ones cut to their untrained samples (same index, bucket and shape)."""
        if not batches:
            return []
        epoch = batches[0].epoch
        if epoch in self.complete:
            return []
        progress = self._epochs.get(epoch)
        if progress is None:
            return list(batches)
        left = []
        for batch in batches:
            if batch.index in progress.done:
                continue
            if not batch.ids:  # a worker's empty share of a global batch: its step is still to take
                left.append(batch)
                continue
            trained = progress.partial.get(batch.index, set())
            ids = tuple(i for i in batch.ids if i not in trained)
            if ids:
                left.append(batch if len(ids) == len(batch.ids) else self.planner.with_ids(batch, ids))
        return left

    def state_dict(self) -> dict[str, Any]:
        below = self.first_open()
        return {
            "complete_below": below,
            "complete": sorted(e for e in self.complete if e > below),
            "open": {str(e): {"done": sorted(p.done),
                              "ids": sorted(i for ids in p.partial.values() for i in ids)}
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
                    progress.done.add(index)
                for sample_id in entry["ids"]:
                    if sample_id not in progress.home:
                        raise ValueError(f"sample {sample_id!r} is not in the plan of epoch {epoch}")
                    progress.add(sample_id)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PositionError(f"the input position does not fit this run's epoch plan ({exc})") from None
        return position

    def copy(self) -> "InputPosition":
        """An independent copy (for the coordinator, which plans in its own thread)."""
        return InputPosition.from_state_dict(self.state_dict(), self.planner)

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
        table = samples if isinstance(samples, SampleTable) else SampleTable.from_samples(samples)
        self._table = table
        ids = table.ids()
        speaker = table.column("speaker")
        # Each speaker's clips ordered by id, as positions in the table; each clip's rank among them.
        order = np.array(sorted(range(len(ids)), key=ids.__getitem__), np.int64)
        order = order[np.argsort(speaker[order], kind="stable")]
        starts = np.searchsorted(speaker[order], np.arange(len(table.speakers) + 1))
        self._clips = order
        self._start = starts  # the clips of speaker code c: order[starts[c]:starts[c + 1]]
        self._rank = np.empty(len(ids), np.int64)
        self._rank[order] = np.arange(len(ids)) - starts[speaker[order]]
        alone = [table.speakers[c] for c in range(len(table.speakers)) if starts[c + 1] - starts[c] == 1]
        if alone:
            log.info("ref_mel: %d speaker(s) have one clip, which is its own reference (%s)", len(alone),
                     ", ".join(alone[:5]))

    def __call__(self, epoch: int, ids: Sequence[str]) -> list[str]:
        """The reference clip id of each of ``ids`` in ``epoch``."""
        refs = []
        speakers = self._table.column("speaker")
        for sample_id in ids:
            row = self._table.row_of(sample_id)
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
        self._table = samples if isinstance(samples, SampleTable) else SampleTable.from_samples(samples)
        speakers = {name: n for n, name in enumerate(vocabulary.speakers)}
        languages = {code: n for n, code in enumerate(vocabulary.languages)}
        # The table's speaker and language codes as the vocabulary's ids.
        self._speakers = [speakers.get(name, 0) for name in self._table.speakers]
        self._languages = [languages.get(code, 0) for code in self._table.languages]

    def __call__(self, ids: Sequence[str]) -> list[list[int]]:
        return [self.vocabulary.encode(self._table.string("units", r)).tolist() for r in self._rows(ids)]

    def _rows(self, ids: Sequence[str]) -> list[int]:
        rows = self._table.find_rows(ids)
        if min(rows, default=0) < 0:
            raise KeyError(ids[rows.index(-1)])
        return rows

    def files(self, ids: Sequence[str]) -> dict[str, str]:
        """The audio locators of clips ``ids`` the table holds (a validation clip's reference may be
        one it lacks: the validation set names those)."""
        table = self._table
        return {i: table.string("audio", r) for i, r in zip(ids, table.find_rows(ids)) if r >= 0}

    def lease_fields(self, ids: Sequence[str]) -> dict[str, Any]:
        """What a lease carries for its clips: token ids, speaker ids, language ids, and their
        texts, audio locators and durations ({id: ...}), so that a producer reads no metadata."""
        table = self._table
        rows = self._rows(ids)
        speaker, language, duration = (table.column(n) for n in ("speaker", "language", "duration_s"))
        return {"tokens": [self.vocabulary.encode(table.string("units", r)).tolist() for r in rows],
                "speakers": [self._speakers[speaker[r]] for r in rows],
                "languages": [self._languages[language[r]] for r in rows],
                "texts": {i: table.string("text", r) for i, r in zip(ids, rows)},
                "files": {i: table.string("audio", r) for i, r in zip(ids, rows)},
                "durations": tuple(float(duration[r]) for r in rows)}
