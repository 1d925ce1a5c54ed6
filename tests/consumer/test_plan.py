"""Tests for consumer/plan.py: bucketing and deterministic per-epoch batch plans."""

from __future__ import annotations

import collections
import itertools
import random
import statistics

from dataclasses import replace

import pytest

from stoker.consumer.plan import EpochPlanner, frame_budget_bounds, group_buckets, make_buckets, rows_for
from stoker.consumer.position import InputPosition, PositionError
from stoker.consumer.shard_order import top_shard_share
from stoker.shared.config import BatchingConfig, FeaturesConfig
from stoker.shared.dataset.table import SampleTable
from stoker.shared.dataset.types import Sample
from stoker.shared.mel import pad_values
from tests.factories import make_samples

EPOCHS = 5


def _cfg(**kw) -> BatchingConfig:
    base = dict(batch_size=16, num_buckets=4, frames_multiple=16, tokens_multiple=8, seed=1234)
    base.update(kw)
    return BatchingConfig(**base)


CASES = [
    (make_samples(203, seed=1), _cfg()),
    (make_samples(64, seed=2), _cfg(batch_size=7, num_buckets=3, frames_multiple=10, tokens_multiple=5)),
    (make_samples(50, seed=3), _cfg(batch_size=64, num_buckets=1)),
    (make_samples(33, seed=4), _cfg(batch_size=1, num_buckets=8, frames_multiple=1, tokens_multiple=1)),
    (make_samples(500, seed=5, max_frames=3000), _cfg(batch_size=32, num_buckets=6)),
    (make_samples(203, seed=11), _cfg(max_frames=4000)),
    (make_samples(500, seed=12, max_frames=3000), _cfg(max_frames=12000, num_buckets=8, frames_multiple=10)),
    (make_samples(40, seed=13), _cfg(max_frames=700, num_buckets=3)),  # some clips longer than the budget
]
CASE_IDS = ["default", "odd-sizes", "one-bucket", "batch-of-one", "large", "budget", "budget-large",
            "budget-below-longest"]


@pytest.mark.parametrize(("samples", "cfg"), CASES, ids=CASE_IDS)
def test_every_sample_exactly_once_per_epoch(samples: list[Sample], cfg: BatchingConfig) -> None:
    planner = EpochPlanner(samples, cfg)
    all_ids = sorted(s.id for s in samples)
    for epoch in range(EPOCHS):
        plan = planner.plan(epoch)
        counts = collections.Counter(i for batch in plan for i in batch.ids)
        assert sorted(counts) == all_ids  # no loss
        assert max(counts.values()) == 1  # no duplicate


@pytest.mark.parametrize(("samples", "cfg"), CASES, ids=CASE_IDS)
def test_batches_fit_their_shape(samples: list[Sample], cfg: BatchingConfig) -> None:
    planner = EpochPlanner(samples, cfg)
    by_id = {s.id: s for s in samples}
    shapes = set()
    for epoch in range(EPOCHS):
        plan = planner.plan(epoch)
        assert [b.index for b in plan] == list(range(len(plan)))
        for batch in plan:
            assert batch.epoch == epoch
            assert 1 <= len(batch.ids) == batch.rows  # only real rows
            max_tokens, max_frames = batch.shape
            assert max_tokens % cfg.tokens_multiple == 0
            assert max_frames % cfg.frames_multiple == 0
            assert batch.shape == (planner.buckets[batch.bucket].max_tokens, planner.buckets[batch.bucket].max_frames)
            for sample_id in batch.ids:
                assert by_id[sample_id].num_tokens <= max_tokens
                assert by_id[sample_id].num_frames <= max_frames
            shapes.add((batch.rows, *batch.shape))
    # The buckets' shapes and the one short batch's: every shape the trainer sees, the same each epoch.
    assert len(planner.shapes) <= cfg.num_buckets + 1
    assert shapes == set(planner.shapes)


@pytest.mark.parametrize(("samples", "cfg"), CASES, ids=CASE_IDS)
def test_batches_per_epoch_matches_plan(samples: list[Sample], cfg: BatchingConfig) -> None:
    planner = EpochPlanner(samples, cfg)
    for epoch in range(EPOCHS):
        assert planner.batches_per_epoch == len(planner.plan(epoch))


# How a run splits its batches: (fixed_rows, replicas, workers); all but the first fix the rows.
LAYOUTS = [(False, 1, 1), (True, 1, 1), (False, 2, 1), (False, 1, 3)]
LAYOUT_IDS = ["real-rows", "fixed-rows", "replicas", "workers"]


@pytest.mark.parametrize(("fixed", "replicas", "workers"), LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize(("samples", "cfg"), CASES, ids=CASE_IDS)
def test_one_short_batch_per_epoch_every_clip_once_the_same_plan_twice(samples, cfg, fixed, replicas,
                                                                         workers) -> None:
    """Leftover clips move up into longer buckets, so an epoch has at most one batch with fewer
    clips than its bucket's rows (in the last bucket); its B is its clips unless the rows are
    fixed (fixed_rows, replicas, workers), when every batch has its bucket's rows. Every clip
    is in exactly one batch per epoch, in a bucket its lengths fit, and the plan is a pure
    function of (clips, config, epoch)."""
    cfg = replace(cfg, fixed_rows=fixed)
    planners = [EpochPlanner(samples, cfg, replicas, workers, w) for w in range(workers)]
    again = EpochPlanner(list(reversed(samples)), cfg, replicas, workers, workers - 1)
    assert planners[0].fixed_rows == (fixed or replicas * workers > 1)
    by_id = {s.id: s for s in samples}
    for epoch in range(3):
        plans = [p.plan(epoch) for p in planners]
        assert again.plan(epoch) == plans[-1]
        assert sorted(i for plan in plans for b in plan for i in b.ids) == sorted(by_id)
        whole = [sum((p[n].ids for p in plans), ()) for n in range(len(plans[0]))]  # the global batches
        buckets = planners[0].buckets
        short = [n for n, ids in enumerate(whole) if len(ids) < buckets[plans[0][n].bucket].rows]
        assert len(short) <= 1 and all(plans[0][n].bucket == len(buckets) - 1 for n in short)
        for plan in plans:
            for batch in plan:
                bucket_rows = buckets[batch.bucket].rows // workers
                assert batch.rows == (bucket_rows if planners[0].fixed_rows else len(batch.ids))
                assert (batch.rows, *batch.shape) in planners[0].shapes
                assert all(by_id[i].num_frames <= batch.shape[1] and by_id[i].num_tokens <= batch.shape[0]
                           for i in batch.ids)


@pytest.mark.parametrize(("samples", "cfg"), CASES, ids=CASE_IDS)
def test_moving_leftovers_up_keeps_every_bucket_within_its_bounds(samples, cfg) -> None:
    """A bucket's longest leftover clips join the next bucket, whose T (and rows) they never
    grow; every bucket but the last holds whole batches."""
    grouped, filled = group_buckets(samples, cfg), make_buckets(samples, cfg)
    assert sorted(i for b in filled for i in b.sample_ids) == sorted(s.id for s in samples)
    frames = {s.id: s.num_frames for s in samples}
    top = {i: b.max_frames for b in grouped for i in b.sample_ids}
    for bucket in filled:
        assert bucket.max_frames <= max(top[i] for i in bucket.sample_ids)
        assert bucket.max_frames >= max(frames[i] for i in bucket.sample_ids)
        assert bucket.rows == rows_for(bucket.max_frames, cfg)
    assert all(len(b.sample_ids) % b.rows == 0 for b in filled[:-1])
    assert [b.index for b in filled] == list(range(len(filled)))


@pytest.mark.parametrize(("fixed", "replicas", "workers"), LAYOUTS, ids=LAYOUT_IDS)
def test_a_per_row_mean_loss_of_each_batch_is_the_loss_of_its_clips(fixed, replicas, workers) -> None:
    """A user's loss averaged per row over a collated batch of the plan (or, with fixed rows,
    weighted by row_mask) equals the mean over its clips alone: no empty row dilutes it."""
    import numpy as np

    from stoker.shared.batch import batch_dims, collate, example, schema_for

    samples = make_samples(61, seed=31, max_frames=300)
    cfg = _cfg(batch_size=4, num_buckets=3, fixed_rows=fixed)
    planners = [EpochPlanner(samples, cfg, replicas, workers, w) for w in range(workers)]
    schema = schema_for("row_mask" if planners[0].fixed_rows else "")
    by_id = {s.id: s for s in samples}
    rng = np.random.default_rng(0)
    mels = {s.id: rng.normal(size=(s.num_frames, 2)).astype(np.float32) for s in samples}
    pads = pad_values(schema, FeaturesConfig(), "off")
    for planner in planners:
        for batch in planner.plan(0):
            if not batch.ids:
                continue
            examples = [example(np.ones(by_id[i].num_tokens, np.int32), mels[i], schema) for i in batch.ids]
            arrays = collate(examples, batch_dims(batch.rows, batch.shape, 2), pads, schema)
            valid = np.arange(batch.shape[1])[None, :] < arrays["mel_lengths"][:, None]
            per_row = np.abs(arrays["mel"] * valid[..., None]).sum(axis=(1, 2)) / np.maximum(arrays["mel_lengths"], 1)
            clips = np.mean([np.abs(mels[i]).sum() / len(mels[i]) for i in batch.ids])
            if planner.fixed_rows:
                mask = arrays["row_mask"]
                assert mask.tolist() == [1.0] * len(batch.ids) + [0.0] * (batch.rows - len(batch.ids))
                assert np.sum(per_row * mask) / np.sum(mask) == pytest.approx(clips, rel=1e-6)
            else:
                assert len(per_row) == len(batch.ids) and per_row.mean() == pytest.approx(clips, rel=1e-6)


def test_bucket_shapes_are_tight_rounded_maxima() -> None:
    samples = make_samples(120, seed=7)
    cfg = _cfg()
    buckets = make_buckets(samples, cfg)
    assert len(buckets) == cfg.num_buckets
    by_id = {s.id: s for s in samples}
    # 4 groups of 30: each one's leftover (30 mod 16, then 44 mod 16, 42 mod 16) moves up.
    assert [len(b.sample_ids) for b in buckets] == [16, 32, 32, 40]
    previous_longest = -1
    for bucket in buckets:
        members = [by_id[i] for i in bucket.sample_ids]
        longest = max(s.num_frames for s in members)
        assert bucket.max_frames == -(-longest // cfg.frames_multiple) * cfg.frames_multiple
        assert bucket.max_tokens == -(-max(s.num_tokens for s in members) // cfg.tokens_multiple) * cfg.tokens_multiple
        # Buckets are cut from samples sorted by mel length.
        assert min(s.num_frames for s in members) >= previous_longest
        previous_longest = longest


def test_same_seed_and_epoch_give_the_same_plan() -> None:
    samples = make_samples(150, seed=8)
    cfg = _cfg()
    first = EpochPlanner(samples, cfg).plan(3)
    shuffled = list(samples)
    random.Random(0).shuffle(shuffled)  # the input order must not matter
    again = EpochPlanner(shuffled, cfg).plan(3)
    assert first == again


def test_different_epochs_and_seeds_differ() -> None:
    samples = make_samples(150, seed=9)
    planner = EpochPlanner(samples, _cfg())
    plans = [tuple(b.ids for b in planner.plan(e)) for e in range(EPOCHS)]
    assert len(set(plans)) == EPOCHS
    other = EpochPlanner(samples, _cfg(seed=99)).plan(0)
    assert tuple(b.ids for b in other) != plans[0]


def test_fewer_samples_than_buckets() -> None:
    samples = make_samples(3, seed=10)
    cfg = _cfg(num_buckets=8)
    planner = EpochPlanner(samples, cfg)
    assert len(group_buckets(samples, cfg)) == 3
    assert len(planner.buckets) == 1  # the shorter clips moved up: one batch of only its 3 rows
    plan = planner.plan(0)
    assert planner.batches_per_epoch == len(plan) == 1
    assert planner.shapes == [(3, *plan[0].shape)]
    assert sorted(i for b in plan for i in b.ids) == sorted(s.id for s in samples)
    one = EpochPlanner(samples[:1], cfg)
    assert [b.ids for b in one.plan(0)] == [(samples[0].id,)]


def test_equal_lengths() -> None:
    samples = [Sample(f"E{i:03d}", "x", 10, 100, 1.0) for i in range(40)]
    planner = EpochPlanner(samples, _cfg(batch_size=8))
    assert set(planner.shapes) == {(8, 16, 112)}
    # 40 samples in 4 buckets of 10, leftovers moved up: 8, 8, 8 and 16 clips, 5 full batches.
    assert [len(b.sample_ids) for b in planner.buckets] == [8, 8, 8, 16]
    assert planner.batches_per_epoch == len(planner.plan(0)) == 5
    assert [len(b.ids) for b in planner.plan(0)] == [8] * 5


def test_no_samples() -> None:
    planner = EpochPlanner([], _cfg())
    assert planner.buckets == [] and planner.batches_per_epoch == 0 and planner.plan(0) == []


# ------------------------------------------------------------------ frame budget


def _waste(frames: list[int], bounds: list[int], cfg: BatchingConfig) -> int:
    """Padded frames plus the empty rows of each bucket's last batch, for these bounds."""
    total, low = 0, -1
    for bound in bounds:
        members = [f for f in frames if low < -(-f // cfg.frames_multiple) * cfg.frames_multiple <= bound]
        rows = rows_for(bound, cfg)
        total += sum(bound - f for f in members) + (-len(members) % rows) * bound
        low = bound
    return total


@pytest.mark.parametrize("seed", range(6))
def test_frame_budget_bounds_are_the_best_partition(seed: int) -> None:
    """The dynamic program's bounds waste no more than every other choice of bounds (brute force)."""
    rng = random.Random(seed)
    frames = [rng.randint(5, 160) for _ in range(rng.randint(10, 60))]
    cfg = _cfg(max_frames=rng.choice([200, 400, 1000]), num_buckets=rng.randint(1, 4), frames_multiple=8)
    values = sorted({-(-f // 8) * 8 for f in frames})
    best = min(_waste(frames, [*cut, values[-1]], cfg)
               for k in range(cfg.num_buckets) for cut in itertools.combinations(values[:-1], k))
    bounds = frame_budget_bounds(frames, cfg)
    assert len(bounds) <= cfg.num_buckets and bounds[-1] == values[-1] and bounds == sorted(set(bounds))
    assert _waste(frames, bounds, cfg) == best


@pytest.mark.parametrize(("samples", "cfg"), [c for c, i in zip(CASES, CASE_IDS) if i.startswith("budget")],
                         ids=[i for i in CASE_IDS if i.startswith("budget")])
def test_frame_budget_rows_hold_about_the_budget(samples: list[Sample], cfg: BatchingConfig) -> None:
    planner = EpochPlanner(samples, cfg)
    for bucket in planner.buckets:
        rows, _, frames = bucket.shape
        assert rows == max(1, cfg.max_frames // frames)
        # The most rows that fit: one more would exceed the budget (a clip longer than it gets one row).
        assert rows * frames <= cfg.max_frames or rows == 1
        assert (rows + 1) * frames > cfg.max_frames
    # Short clips get more rows than long ones.
    rows = [b.rows for b in planner.buckets]
    assert rows == sorted(rows, reverse=True) and rows[0] > 1


def test_frame_budget_wastes_less_than_equal_count_buckets() -> None:
    """Half the clips near 100 frames, half spread over 200-800: equal-count buckets spend half
    their shapes on the narrow cluster, the frame budget's bounds go where padding is."""
    rng = random.Random(0)
    frames = [rng.randint(90, 110) for _ in range(400)] + [rng.randint(200, 800) for _ in range(400)]
    samples = [Sample(f"S{i:04d}", "x", 10, f, 1.0) for i, f in enumerate(frames)]
    cfg = _cfg(max_frames=8000, num_buckets=6, frames_multiple=4)
    planner = EpochPlanner(samples, cfg)
    assert sum(1 for b in planner.buckets if b.max_frames <= 112) == 1
    fixed = EpochPlanner(samples, _cfg(num_buckets=6, frames_multiple=4))

    def useful(p: EpochPlanner) -> float:
        by_id = {s.id: s.num_frames for s in samples}
        plan = p.plan(0)
        return sum(by_id[i] for b in plan for i in b.ids) / sum(b.rows * b.shape[1] for b in plan)

    assert useful(planner) > useful(fixed)


def test_frame_budget_off_keeps_the_fixed_plan() -> None:
    """max_frames 0 is the equal-count plan of batch_size rows (before leftovers move up)."""
    samples = make_samples(203, seed=1)
    planner = EpochPlanner(samples, _cfg())
    assert {b.rows for b in planner.buckets} == {16}
    sizes = [len(b.sample_ids) for b in group_buckets(samples, _cfg())]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(("samples", "cfg"), [CASES[0], CASES[5], CASES[7]], ids=["rows", "budget", "budget-short"])
def test_with_replicas_a_batch_holds_a_replica_batch_for_each_in_one_shape(samples, cfg) -> None:
    """A planned batch is one step's: N replica batches of the bucket's B rows, every sample
    still once per epoch; the bounds are chosen for the global batch's empty rows."""
    one, three = EpochPlanner(samples, cfg), EpochPlanner(samples, cfg, replicas=3)
    if cfg.max_frames == 0:
        assert [(b.max_tokens, b.max_frames) for b in three.buckets] == [(b.max_tokens, b.max_frames)
                                                                         for b in one.buckets]
    for bucket in three.buckets:
        assert bucket.rows == 3 * rows_for(bucket.max_frames, cfg)
    for epoch in range(2):
        plan = three.plan(epoch)
        ids = [i for batch in plan for i in batch.ids]
        assert sorted(ids) == sorted(s.id for s in samples)
        assert all(len(batch.ids) <= batch.rows and batch.rows % 3 == 0 for batch in plan)
    assert three.batches_per_epoch < one.batches_per_epoch and three.replicas == 3


@pytest.mark.parametrize(("samples", "cfg"), [CASES[0], CASES[3], CASES[5]], ids=["rows", "batch-of-one", "budget"])
def test_workers_share_every_global_batch_and_train_each_sample_once(samples, cfg) -> None:
    """Three workers plan the same global batches, in the same order and shapes, and each
    takes its share: together every sample once per epoch."""
    workers = [EpochPlanner(samples, cfg, workers=3, worker=w) for w in range(3)]
    whole = EpochPlanner(samples, cfg, replicas=3)
    assert workers[0].shapes == workers[2].shapes == [(b.rows // 3, b.max_tokens, b.max_frames) for b in whole.buckets]
    for epoch in range(2):
        plans = [w.plan(epoch) for w in workers]
        assert len({len(p) for p in plans}) == 1
        for step in zip(*plans):  # one step: the same planned batch's shares, one shape
            assert len({(b.index, b.bucket, b.shape, b.rows) for b in step}) == 1
            assert len(step[0].ids) >= len(step[2].ids) >= len(step[0].ids) - 1
        ids = [i for p in plans for b in p for i in b.ids]
        assert sorted(ids) == sorted(s.id for s in samples)
        assert sum(w.samples_in(epoch) for w in workers) == len(samples)
        for worker, plan in zip(workers, plans):  # its clips in training order: its share of each batch
            assert worker.table.strings("id", plan.order().tolist()) == [i for b in plan for i in b.ids]


def _sharded(count: int, per_shard: int, seed: int = 3) -> tuple[list[Sample], dict[str, int]]:
    """Samples whose audio are members of shards of ``per_shard`` clips, and each one's shard."""
    samples = [s._replace(audio=f"train-{n // per_shard:03d}.tar#clips/{s.id}.flac@{512 + n}+1000")
               for n, s in enumerate(make_samples(count, seed=seed))]
    return samples, {s.id: n // per_shard for n, s in enumerate(samples)}


def test_shard_grouped_plans_keep_the_buckets_and_every_clip_once_per_epoch() -> None:
    samples, _ = _sharded(1000, 50)
    grouped, shuffled = EpochPlanner(samples, _cfg(shard_window=4)), EpochPlanner(samples, _cfg(shard_window=0))
    assert grouped.shards is not None and shuffled.shards is None
    assert grouped.buckets == shuffled.buckets and grouped.shapes == shuffled.shapes
    for epoch in range(3):
        plan = grouped.plan(epoch)
        assert [b.index for b in plan] == list(range(len(plan)))
        counts = collections.Counter(i for b in plan for i in b.ids)
        assert sorted(counts) == sorted(s.id for s in samples) and max(counts.values()) == 1
        assert collections.Counter(b.shape for b in plan) == collections.Counter(b.shape for b in shuffled.plan(epoch))


def test_shard_grouped_batches_draw_from_a_few_shards_yet_mix_them_each_epoch() -> None:
    """The mixing figures docs/design/scheduling.md, "Leases by shard", gives: 64 shards of 200 clips, batches of 16."""
    samples, shard = _sharded(64 * 200, 200)
    share, per_batch, per_stretch = {}, {}, {}
    for window in (0, 1, 4):
        planner = EpochPlanner(samples, _cfg(shard_window=window))
        plans = [planner.plan(epoch) for epoch in range(2)]
        share[window] = sum(top_shard_share([b.ids for b in plan], shard) for plan in plans) / 2
        per_batch[window] = statistics.mean(len({shard[i] for i in b.ids}) for plan in plans for b in plan)
        per_stretch[window] = statistics.mean(len({shard[i] for b in plan[k:k + 8] for i in b.ids})
                                              for plan in plans for k in range(0, len(plan) - 8, 8))
        if window:  # the first stretch of each epoch: other shards each epoch
            assert {shard[i] for i in plans[0][0].ids} != {shard[i] for i in plans[1][0].ids}
    assert share[0] == pytest.approx(0.124, abs=0.02) and share[1] == pytest.approx(0.92, abs=0.03)
    assert share[4] == pytest.approx(0.376, abs=0.03)  # near 1 / window: well mixed within the window
    assert per_batch[4] == pytest.approx(4.1, abs=0.3) and per_stretch[4] == pytest.approx(6.0, abs=0.5)
    assert per_stretch[0] > 50  # shuffled across all shards: 8 batches touch most of the 64


def test_a_resumed_shard_grouped_epoch_trains_exactly_the_clips_left() -> None:
    samples, _ = _sharded(400, 40)
    planner = EpochPlanner(samples, _cfg(shard_window=2))
    plan = planner.plan(0)
    position = InputPosition(planner)
    for batch in plan[:len(plan) // 2]:
        position.record(0, batch.ids)
    position.record(0, plan[len(plan) // 2].ids[:3])  # a batch trained in part
    resumed = InputPosition.from_state_dict(position.state_dict(), EpochPlanner(samples, _cfg(shard_window=2)))
    trained = [i for b in plan[:len(plan) // 2] for i in b.ids] + list(plan[len(plan) // 2].ids[:3])
    left = [i for b in resumed.remaining(plan) for i in b.ids]
    assert sorted(trained + left) == sorted(s.id for s in samples)


@pytest.mark.parametrize("budget", [0, 3000])
def test_a_plan_from_the_columns_equals_the_plan_from_the_samples(budget: int) -> None:
    clips = make_samples(300, seed=11)
    clips = [*clips, clips[5]._replace(id="tie-\u00e9"), clips[5]._replace(id="tie-a")]  # a tie, a non-ASCII id
    cfg = _cfg(max_frames=budget)
    for samples in (clips, [s for s in clips if s.id.isascii()]):
        table = SampleTable.from_samples(samples)
        assert make_buckets(table, cfg) == make_buckets(samples, cfg)
        assert EpochPlanner(table, cfg).plan(3) == EpochPlanner(samples, cfg).plan(3)


def test_the_plans_key_changes_with_what_the_plans_are_a_function_of_and_only_that() -> None:
    """EpochPlanner.key: equal for planners made alike; another seed, worker split, clip set or
    (for clips of shards) shard window is another key; a shard window over loose files plans
    the same epochs, so the same key."""
    samples, sharded = make_samples(120, seed=2), _sharded(120, 10)[0]
    key = EpochPlanner(samples, _cfg()).key
    assert EpochPlanner(samples, _cfg()).key == key == EpochPlanner(samples, _cfg(shard_window=7)).key
    others = [EpochPlanner(samples, _cfg(seed=_cfg().seed + 1)), EpochPlanner(samples[1:], _cfg()),
              EpochPlanner(samples, _cfg(), workers=2, worker=0), EpochPlanner(samples, _cfg(), workers=2, worker=1),
              EpochPlanner(sharded, _cfg(shard_window=2)), EpochPlanner(sharded, _cfg(shard_window=3))]
    assert len({key, *(p.key for p in others)}) == 1 + len(others)
    position = InputPosition(others[-2])
    position.record(0, others[-2].plan(0)[0].ids)
    with pytest.raises(PositionError, match="saved over another epoch plan"):  # the shard window changed
        InputPosition.from_state_dict(position.state_dict(), others[-1])
