"""The scheduler's leases (consumer/coordinator/leases.py), driven through the scheduler on a virtual
clock: a BATCH is taken only against its credited lease and in its shape; late, foreign and
mismatched ones are dropped; a LEASE carries what its producer needs."""

from __future__ import annotations

import numpy as np

from stoker.consumer.buffer import BatchQueue
from stoker.consumer.coordinator.lease_tables import TokenTable
from stoker.consumer.coordinator.leases import Lease, mismatch
from stoker.consumer.plan import EpochPlanner, PlannedBatch
from stoker.consumer.coordinator.scheduler import Scheduler
from stoker.shared import wire
from stoker.shared.batch import batch_dims, schema_for
from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.shared.dataset.agreement import Reference, deferred, describe_copy
from stoker.consumer.index.index import build_index
from tests.consumer.harness import hello_of, make_config
from tests.consumer.coordinator.scheduler_bench import Bench
from tests.factories import make_batch, make_dataset


def _rejecting(b: Bench, lease: wire.Lease, rows: int, mask: bool = False) -> None:
    """``p1`` delivers ``lease`` without its first clip (rejected) in a batch of ``rows`` rows."""
    ids = lease.ids[1:]
    tokens, frames = lease.shape
    arrays = make_batch(rows, tokens, frames, 8, valid=len(ids))
    if mask:
        arrays["row_mask"] = (np.arange(rows) < len(ids)).astype(np.float32)
    b.send(b"p1", wire.Batch(lease.lease, lease.epoch, lease.index, ids,
                             rejected=(wire.Entry(lease.ids[0], "unreadable"),)), arrays)


def test_a_batch_with_a_rejected_clip_carries_only_its_real_rows() -> None:
    """B is the clips delivered: a batch padded to the lease's rows is refused (re-planned);
    the one of only real rows is queued, as it came."""
    b = Bench(lease_ahead=1)
    lease = b.credited(b"p1")
    assert lease.rows == len(lease.ids) == 4
    _rejecting(b, lease, rows=4)  # an empty row
    again, = b.take(b"p1", wire.LEASE)
    assert b.scheduler.snapshot()["rejected_messages"] == {"bad_batch": 1} and len(b.queue) == 0
    b.send(b"p1", wire.Ready(again.lease))
    b.take(b"p1", wire.CREDIT)
    _rejecting(b, again, rows=3)
    queued = b.queue.get(0)[0]
    assert queued.ids == list(again.ids[1:]) and queued.arrays["mel_lengths"].shape == (3,)
    assert (queued.arrays["mel_lengths"] > 0).all() and queued.frames_computed == 3 * again.shape[1]


def test_with_fixed_rows_a_batch_keeps_the_leases_rows_and_marks_the_empty_ones() -> None:
    b = Bench(lease_ahead=1, fixed_rows=True)
    assert "row_mask" in b.scheduler.schema.names
    lease = b.credited(b"p1")
    welcome, = b.take(b"p1", wire.WELCOME)  # what the producer collates by
    assert welcome.fixed_rows is True and welcome.fields == "row_mask"
    _rejecting(b, lease, rows=3, mask=True)  # too few rows
    again, = b.take(b"p1", wire.LEASE)
    b.send(b"p1", wire.Ready(again.lease))
    b.take(b"p1", wire.CREDIT)
    _rejecting(b, again, rows=4)  # no row_mask
    assert b.scheduler.snapshot()["rejected_messages"] == {"bad_batch": 2} and len(b.queue) == 0
    third, = b.take(b"p1", wire.LEASE)
    b.send(b"p1", wire.Ready(third.lease))
    b.take(b"p1", wire.CREDIT)
    _rejecting(b, third, rows=4, mask=True)
    queued = b.queue.get(0)[0]
    assert queued.arrays["row_mask"].tolist() == [1.0, 1.0, 1.0, 0.0] and queued.arrays["mel_lengths"][3] == 0


def test_a_batch_that_does_not_match_its_lease_is_dropped_and_replanned() -> None:
    b = Bench(lease_ahead=1)
    lease = b.credited(b"p1")
    tokens, frames = lease.shape
    wrong = make_batch(lease.rows, tokens, frames + 16, 8, valid=len(lease.ids))
    b.send(b"p1", wire.Batch(lease.lease, lease.epoch, lease.index, lease.ids), wrong)
    again, = b.take(b"p1", wire.LEASE)
    assert again.ids == lease.ids and again.lease != lease.lease
    assert b.scheduler.snapshot()["rejected_messages"] == {"bad_batch": 1} and len(b.queue) == 0


def test_a_clip_field_that_does_not_name_the_leases_clips_in_row_order_is_a_mismatch() -> None:
    lease = Lease(1, PlannedBatch(0, 0, 0, ("a", "b", "c"), (16, 32), 3), b"p", positions=(10, 11, 12))
    batch = wire.Batch(1, 0, 0, ("c", "a"), rejected=(wire.Entry("b", "unreadable"),))
    dims, schema = batch_dims(3, (16, 32), 8), schema_for("clip")
    arrays = make_batch(3, 16, 32, 8, valid=2)
    assert mismatch(lease, batch, {**arrays, "clip": np.array([12, 10, -1], np.int32)}, schema, dims) is None
    for wrong in ([10, 12, -1], [12, 11, -1]):  # rows swapped; the rejected clip's position
        assert "clip field" in mismatch(lease, batch, {**arrays, "clip": np.array(wrong, np.int32)}, schema, dims)


def test_late_uncredited_and_foreign_batches_are_counted_and_dropped() -> None:
    b = Bench(lease_ahead=1)
    b.hello(b"p1")
    b.hello(b"p2")
    lease, = b.take(b"p1", wire.LEASE)
    b.deliver(b"p1", lease)  # no credit yet
    b.send(b"p1", wire.Ready(lease.lease))
    b.take(b"p1", wire.CREDIT)
    b.deliver(b"p2", lease)  # someone else's lease
    b.deliver(b"p1", lease)
    b.deliver(b"p1", lease)  # a late duplicate
    assert b.scheduler.snapshot()["rejected_messages"] == {"uncredited": 1, "wrong_producer": 1,
                                                           "unknown_lease": 1}
    assert len(b.queue) == 1


def test_leases_to_a_remote_copy_carry_each_files_size_on_the_trainer_and_a_local_producers_none(tmp_path) -> None:
    make_dataset(tmp_path, count=6)
    index = build_index(DataConfig(path=str(tmp_path), index_cache="off"), FeaturesConfig())
    cfg = make_config(lease_ahead=1)
    planner = EpochPlanner(index.samples, cfg.batching)
    scheduler = Scheduler(cfg, planner, BatchQueue(3), max_epochs=1, dataset=Reference.of(index),
                          tokens=TokenTable(index.samples, index.vocabulary))
    for who, dataset in ((b"remote", describe_copy(tmp_path)), (b"local", deferred("metadata.csv"))):
        scheduler.on_message(who, hello_of(who.decode(), dataset=dataset).encode(), 0.0, -1)
    leases = {who: wire.read(msg.encode())[0] for who, msg, _ in scheduler.take_outbox() if msg.KIND == wire.LEASE}
    remote, local = leases[b"remote"], leases[b"local"]
    assert remote.sizes == {i: (tmp_path / name).stat().st_size for i, name in remote.files.items()}
    assert set(remote.sizes) == set(remote.ids) and local.sizes is None and local.files
