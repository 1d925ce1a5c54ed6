"""Tests for consumer/plan.py: bucketing and deterministic per-epoch batch plans."""

from __future__ import annotations

import collections
import random

import pytest

from consumer.plan import EpochPlanner, make_buckets
from shared.config import BatchingConfig
from shared.dataset import Sample
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
]
CASE_IDS = ["default", "odd-sizes", "one-bucket", "batch-of-one", "large"]


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
            assert 1 <= len(batch.ids) <= cfg.batch_size
            max_tokens, max_frames = batch.shape
            assert max_tokens % cfg.tokens_multiple == 0
            assert max_frames % cfg.frames_multiple == 0
            assert batch.shape == planner.shapes[batch.bucket]
            for sample_id in batch.ids:
                assert by_id[sample_id].num_tokens <= max_tokens
                assert by_id[sample_id].num_frames <= max_frames
            shapes.add(batch.shape)
    assert len(shapes) <= cfg.num_buckets
    assert len(set(planner.shapes)) <= cfg.num_buckets
    assert shapes == set(planner.shapes)


@pytest.mark.parametrize(("samples", "cfg"), CASES, ids=CASE_IDS)
def test_batches_per_epoch_matches_plan(samples: list[Sample], cfg: BatchingConfig) -> None:
    planner = EpochPlanner(samples, cfg)
    for epoch in range(EPOCHS):
        assert planner.batches_per_epoch == len(planner.plan(epoch))
    # Only a bucket's last batch may be partial.
    plan = planner.plan(0)
    partial = collections.Counter(b.bucket for b in plan if len(b.ids) < cfg.batch_size)
    assert all(n == 1 for n in partial.values())


def test_bucket_shapes_are_tight_rounded_maxima() -> None:
    samples = make_samples(120, seed=7)
    cfg = _cfg()
    buckets = make_buckets(samples, cfg)
    assert len(buckets) == cfg.num_buckets
    by_id = {s.id: s for s in samples}
    sizes = [len(b.sample_ids) for b in buckets]
    assert max(sizes) - min(sizes) <= 1  # nearly equal counts
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
    assert len(planner.buckets) == 3
    plan = planner.plan(0)
    assert planner.batches_per_epoch == len(plan) == 3
    assert sorted(i for b in plan for i in b.ids) == sorted(s.id for s in samples)
    one = EpochPlanner(samples[:1], cfg)
    assert [b.ids for b in one.plan(0)] == [(samples[0].id,)]


def test_equal_lengths() -> None:
    samples = [Sample(f"E{i:03d}", "x", 10, 100, 1.0) for i in range(40)]
    planner = EpochPlanner(samples, _cfg(batch_size=8))
    assert set(planner.shapes) == {(16, 112)}
    # 40 samples in 4 buckets of 10: each bucket needs ceil(10 / 8) = 2 batches.
    assert planner.batches_per_epoch == len(planner.plan(0)) == 8
    assert sorted(len(b.ids) for b in planner.plan(0)) == [2, 2, 2, 2, 8, 8, 8, 8]


def test_no_samples() -> None:
    planner = EpochPlanner([], _cfg())
    assert planner.buckets == [] and planner.batches_per_epoch == 0 and planner.plan(0) == []
