"""The input position: what a checkpoint saves of the epoch plans trained, and what a resume
leases from it."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from stoker.benchmarks.position import BATCHING, exactly_once, once_each, synthetic_table, train_part
from stoker.consumer.plan import EpochPlanner
from stoker.consumer.position import InputPosition, PositionError
from stoker.shared.config import BatchingConfig
from tests.factories import make_samples


def _cfg(**kw) -> BatchingConfig:
    return BatchingConfig(**{"batch_size": 16, "num_buckets": 4, "frames_multiple": 16, "tokens_multiple": 8,
                             "seed": 1234, **kw})


def test_position_marks_an_epoch_complete_when_every_sample_is_trained_or_rejected() -> None:
    samples = make_samples(40, seed=21)
    planner = EpochPlanner(samples, _cfg(batch_size=8))
    position = InputPosition(planner)
    plan = planner.plan(0)
    for batch in plan[:-1]:
        position.record(0, batch.ids)
    rejected = {0: 0}
    assert position.update_complete(1, rejected.get) == 0
    assert position.trained(0) == 40 - len(plan[-1].ids)
    rejected[0] = len(plan[-1].ids)  # the last batch's clips were all rejected meanwhile
    assert position.update_complete(1, rejected.get) == 1 and position.complete == {0}
    assert position.trained(0) == planner.samples_per_epoch
    # The state round-trips through JSON; a fresh epoch opens where the last one ended.
    again = InputPosition.from_state_dict(json.loads(json.dumps(position.state_dict())), planner)
    assert again.complete == {0} and again.first_open() == 1 and again.remaining(planner.plan(1)) == planner.plan(1)
    copy = position.copy()
    copy.record(1, plan[0].ids)
    assert position.trained(1) == 0 and copy.trained(1) == len(plan[0].ids)


def test_a_workers_position_counts_planned_batches_taken_even_empty_ones() -> None:
    samples = make_samples(9, seed=21)
    planner = EpochPlanner(samples, _cfg(batch_size=4, num_buckets=1), workers=2, worker=1)
    plan = planner.plan(0)  # 9 clips in global batches of 8: the second's share for worker 1 is empty
    assert [len(b.ids) for b in plan] == [4, 0]
    position = InputPosition(planner)
    assert [b.index for b in position.remaining(plan)] == [0, 1]
    position.record(0, plan[0].ids[:3], index=plan[0].index)  # one of its clips was rejected: still done
    assert [b.index for b in position.remaining(plan)] == [1] and position.update_complete(1, lambda e: 0) == 0
    position.record(0, [], index=plan[1].index)
    assert position.remaining(plan) == [] and position.update_complete(1, lambda e: 0) == 1
    again = InputPosition.from_state_dict(position.state_dict(), planner)
    assert again.complete == {0}


@pytest.mark.parametrize("fixed", [False, True], ids=["real-rows", "fixed-rows"])
def test_a_partly_trained_batch_resumes_with_only_its_untrained_rows(fixed: bool) -> None:
    """On resume a planned batch cut to its untrained clips keeps index, bucket and shape; its
    B is those clips (only real rows) unless rows are fixed."""
    samples = make_samples(40, seed=21)
    planner = EpochPlanner(samples, _cfg(batch_size=8, fixed_rows=fixed))
    position = InputPosition(planner)
    plan = planner.plan(0)
    position.record(0, plan[0].ids[:3])
    position.record(0, plan[1].ids, clips=plan[1].clips)  # rows given by the batch, or looked up: the same
    state = position.state_dict()
    (entry,) = state["open"]
    places = np.flatnonzero(np.unpackbits(np.frombuffer(entry["places"], np.uint8))[:40])
    assert entry["places_as"] == "bits"  # 3 places of 4 bytes: more than a bit for each of the 40 clips
    assert entry["epoch"] == 0 and places.tolist() == [0, 1, 2]  # batch 0's first 3 clips in the planned order
    assert np.flatnonzero(np.unpackbits(np.frombuffer(entry["done"], np.uint8))).tolist() == [plan[1].index]
    again = InputPosition.from_state_dict(state, planner)
    left = again.remaining(plan)
    assert position.copy().remaining(plan) == left and position.copy().state_dict() == state
    assert [b.index for b in left] == [0] + [b.index for b in plan[2:]]
    cut = left[0]
    assert cut.ids == plan[0].ids[3:] and (cut.bucket, cut.shape) == (plan[0].bucket, plan[0].shape)
    assert cut.rows == (8 if fixed else 5)
    assert sorted([*plan[0].ids[:3], *plan[1].ids, *(i for b in left for i in b.ids)]) == sorted(s.id for s in samples)


def _delivery(rng: np.random.Generator, planner: EpochPlanner, epoch: int) -> tuple[int, list[int]]:
    """A random batch as the coordinator could deliver it: a planned batch whole, part of one,
    with rows twice, with rows of another batch or outside the table, or rows in another order."""
    plan = planner.plan(epoch)
    index = int(rng.integers(len(plan)))
    rows = list(plan[index].clips)
    kind = rng.integers(6)
    if kind == 1:
        rows = rows[:int(rng.integers(1, len(rows) + 1))]
    elif kind == 2:
        rows = rows + [rows[int(rng.integers(len(rows)))]]
    elif kind == 3:
        rows = rows[1:] + [int(rng.choice(list(plan[int(rng.integers(len(plan)))].clips)))]
    elif kind == 4:
        rows = rows[1:] + [int(rng.choice([-1, len(planner.table), len(planner.table) + 7]))]
    rng.shuffle(rows)
    return index, rows


@pytest.mark.parametrize("seed", range(6))
def test_a_batch_counted_whole_leaves_the_position_as_counting_each_row_does(seed: int, caplog) -> None:
    """InputPosition.record with ``whole`` (EpochPlanner.is_whole said so) against row by row: the
    same state, counts and warnings, through partial batches, duplicates, strays and repeats."""
    rng = np.random.default_rng(seed)
    planner = EpochPlanner(make_samples(60, seed=seed), _cfg(batch_size=int(rng.choice([4, 8, 16]))))
    fast, rows_only = InputPosition(planner), InputPosition(planner)
    wholes = 0
    for _ in range(120):
        epoch = int(rng.integers(3))
        index, rows = _delivery(rng, planner, epoch)
        ids = [planner.table.string("id", r) if 0 <= r < len(planner.table) else f"NOT{r}" for r in rows]
        whole = index if planner.is_whole(epoch, index, rows) else None
        wholes += whole is not None
        caplog.clear()
        fast.record(epoch, ids, None, rows, whole)
        told = [r.getMessage() for r in caplog.records]
        caplog.clear()
        rows_only.record(epoch, ids, None, rows)
        assert [r.getMessage() for r in caplog.records] == told
        assert fast.state_dict() == rows_only.state_dict()
        assert fast.trained_counts() == rows_only.trained_counts()
        assert [fast.done_batches(e) for e in range(3)] == [rows_only.done_batches(e) for e in range(3)]
    assert wholes  # the fast way was taken


def test_is_whole_wants_every_clip_of_the_batch_once() -> None:
    planner = EpochPlanner(make_samples(40, seed=3), _cfg(batch_size=8))
    batch = planner.plan(1)[2]
    rows = list(batch.clips)
    assert planner.is_whole(1, 2, rows) and planner.is_whole(1, 2, rows[::-1])
    assert not planner.is_whole(1, 2, rows[1:]) and not planner.is_whole(1, 2, rows[1:] + rows[:1] * 2)
    assert not planner.is_whole(1, 3, rows) and not planner.is_whole(1, len(planner.plan(1)), rows)
    assert not planner.is_whole(1, 2, [])
    planner.plan(2), planner.plan(3)  # epoch 1's plan no longer kept: not made again to answer
    assert not planner.is_whole(1, 2, rows)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_update_complete_looking_at_begun_and_rejected_epochs_only_marks_what_a_full_scan_does(seed: int,
                                                                                           workers: int) -> None:
    """The epochs complete, against the rule applied to every epoch of the budget."""
    rng = np.random.default_rng(seed)
    planner = EpochPlanner(make_samples(30, seed=seed), _cfg(batch_size=8), workers=workers, worker=workers - 1)
    budget = 12
    position = InputPosition(planner)
    rejected: dict[int, int] = {}

    def complete(epoch: int) -> bool:
        if workers > 1:
            return len(position.done_batches(epoch)) == len(planner.plan(epoch))
        return position.trained(epoch) + rejected.get(epoch, 0) >= planner.samples_in(epoch)

    for _ in range(80):
        epoch = int(rng.integers(budget + 2))
        if rng.random() < 0.3:  # rejections, some of a whole epoch nothing of which was trained
            rejected[epoch] = min(planner.samples_in(epoch), rejected.get(epoch, 0) + int(rng.integers(1, 40)))
        else:
            plan = planner.plan(epoch)
            batch = plan[int(rng.integers(len(plan)))]
            position.record(epoch, batch.ids, batch.index if workers > 1 else None, batch.clips)
        expected = position.complete | {e for e in range(budget) if complete(e)}
        assert position.update_complete(budget, lambda e: rejected.get(e, 0), list(rejected)) == len(expected)
        assert position.complete == expected


# --------------------------------------------------------------------------- at scale, over the plan's arrays
# The unit tests' size; benchmarks/position.py runs the same checks at 10^8 clips.
LARGE = 1_000_000


@pytest.fixture(scope="module")
def large_table():
    return synthetic_table(LARGE, seed=3)


@pytest.mark.parametrize("world", [1, 2, 8])
def test_every_clip_of_an_epoch_is_in_exactly_one_batch_of_exactly_one_ranks_share(large_table, world: int) -> None:
    """Each rank plans on its own: the same global batches, and its share of each; counted with
    bincounts over the shares, every clip is in one rank's, once."""
    counted = exactly_once(large_table, world, epoch=1)
    assert counted["planned"] == LARGE and counted["once"] == LARGE and counted["not_once"] == 0
    assert counted["unplanned_in_a_share"] == 0 and counted["batches_whole"]
    ranks = [EpochPlanner(large_table, BATCHING, workers=world, worker=rank) for rank in (0, world - 1)]
    first, last = (planner.plan(1) for planner in ranks)
    assert np.array_equal(first.clips, last.clips) and np.array_equal(first.starts, last.starts)
    for planner, plan in zip(ranks, (first, last)):  # a rank's own share is the one counted, and its row map's
        place, batch = plan.share()
        assert all(np.array_equal(a, b) for a, b in zip((place, batch), first.share(planner.worker)))
        home = plan.batch_of(np.arange(LARGE))  # each row's batch of this rank's share, from the shared places
        assert np.array_equal(home[plan.clips[place]], batch) and np.count_nonzero(home >= 0) == len(place)
        assert [plan.batch_of_row(int(r)) for r in plan.clips[place[:50]]] == batch[:50].tolist()
        assert np.array_equal(np.bincount(batch, minlength=len(plan)), plan.sizes())


@pytest.mark.parametrize("world", [1, 2, 8])
def test_a_position_restored_mid_epoch_leaves_exactly_the_untrained_clips_each_once(large_table, world: int) -> None:
    """Half the batches trained whole and a thousand in part, saved (msgpack bytes) and restored:
    the trained rows and the rest are the rank's share, each once; the restored position saves
    the same bytes and counts the same samples."""
    planner = EpochPlanner(large_table, BATCHING, workers=world, worker=world - 1)
    position = InputPosition(planner)
    trained = train_part(position, 0, np.random.default_rng(world))
    saved = msgpack.packb(position.state_dict(), use_bin_type=True)
    assert len(saved) < 100_000  # bit arrays: a bit per batch, 4 bytes per clip of the batches trained in part
    again = InputPosition.from_state_dict(msgpack.unpackb(saved, raw=False), planner)
    plan = planner.plan(0)
    share = plan.clips[plan.share()[0]]
    rest = again.untrained(0)
    assert once_each(trained, rest, share, LARGE) and len(rest) == planner.samples_in(0) - len(trained)
    assert again.trained(0) == position.trained(0) == len(trained)
    assert msgpack.packb(again.state_dict(), use_bin_type=True) == saved
    assert [again.is_done(0, i) for i in range(0, len(plan), 997)] == [position.is_done(0, i)
                                                                      for i in range(0, len(plan), 997)]


@pytest.mark.parametrize("workers", [1, 2])
def test_the_untrained_rows_are_what_the_remaining_batches_hold(workers: int) -> None:
    """InputPosition.untrained (arrays) against remaining (the batches a resume leases), after a
    restore, with batches done, in part and not begun."""
    planner = EpochPlanner(make_samples(200, seed=4), _cfg(batch_size=8), workers=workers, worker=workers - 1)
    position = InputPosition(planner)
    plan = planner.plan(0)
    for batch in plan[::3]:
        position.record(0, batch.ids, batch.index if workers > 1 else None, batch.clips)
    for batch in plan[1::5]:
        position.record(0, batch.ids[:2], None, batch.clips[:2])
    again = InputPosition.from_state_dict(position.state_dict(), planner)
    left = [row for batch in again.remaining(plan) for row in planner.clips_of(batch)]
    assert again.untrained(0).tolist() == left
    assert again.untrained(1).tolist() == [row for batch in plan_rows(planner, 1) for row in batch]


def plan_rows(planner: EpochPlanner, epoch: int) -> list[list[int]]:
    return [list(batch.clips) for batch in planner.plan(epoch)]


def test_a_position_of_another_plan_or_broken_bits_is_refused_with_one_line() -> None:
    samples = make_samples(300, seed=6)
    planner = EpochPlanner(samples, _cfg(batch_size=8))
    position = InputPosition(planner)
    plan = planner.plan(0)
    for batch in plan[:5]:
        position.record(0, batch.ids)
    position.record(0, plan[5].ids[:2])
    state = position.state_dict()
    for other in (EpochPlanner(samples, _cfg(batch_size=8, seed=99)), EpochPlanner(samples[1:], _cfg(batch_size=8)),
                  EpochPlanner(samples, _cfg(batch_size=8), workers=2, worker=1)):
        with pytest.raises(PositionError, match="saved over another epoch plan") as refused:
            InputPosition.from_state_dict(state, other)
        assert "\n" not in str(refused.value)
    (entry,) = state["open"]
    done_place = int(plan.starts[2])  # a clip of batch 2, which is done
    broken = {
        "planned batches": {**entry, "batches": entry["batches"] + 1},
        "bytes for": {**entry, "done": entry["done"] + b"\0"},
        "bits set beyond": {**entry, "done": entry["done"][:-1] + bytes([entry["done"][-1] | 1])},
        "another worker's share or a done batch": {
            **entry, "places_as": "<u4", "places": np.array([done_place], "<u4").tobytes()},
        "not ascending": {**entry, "places_as": "<u4", "places": np.array([41, 40], "<u4").tobytes()},
        "places saved as": {**entry, "places_as": "f8"},
        "open twice": None,
    }
    assert np.frombuffer(entry["places"], entry["places_as"]).tolist() == [40, 41]  # batch 5's first two
    for reason, bad in broken.items():
        opened = [entry, entry] if bad is None else [bad]
        with pytest.raises(PositionError, match=reason):
            InputPosition.from_state_dict({**state, "open": opened}, planner)
    with pytest.raises(PositionError, match="form 3; this stoker reads form 2"):
        InputPosition.from_state_dict({**state, "form": 3}, planner)
