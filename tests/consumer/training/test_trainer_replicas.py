"""The Keras trainer with model replicas (tf.distribute.MirroredStrategy over logical CPU
devices): each replica gets its own part of the global batch, in one shape, on its own
device; one step of N replicas is one step on the global batch; gradient accumulation
with replicas equals the large-batch gradient; the non-finite guard and checkpoints keep
their meaning."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from stoker.consumer.training.trainer import Health, KerasTrainer
from stoker.shared import config as config_mod
from tests.factories import TOKEN_IDS, make_batch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SHAPE = (16, 32)  # (L, T) of every test batch
GOOD = "tests.consumer.training.user_models:good"  # a small user model: the mechanics, not the preset


def _cfg(**trainer) -> config_mod.Config:
    base = config_mod.Config()
    settings = {"warmup_steps": 0, "lr_decay": "constant", "clip_norm": 0.0, "model": GOOD, **trainer}
    return dataclasses.replace(base, batching=dataclasses.replace(base.batching, batch_size=4),
                               trainer=dataclasses.replace(base.trainer, **settings))


def _sgd_trainer(devices, rows: int, **trainer) -> KerasTrainer:
    """Plain SGD at rate 1: an update is the gradient itself, so updates compare gradients."""
    import keras

    keras.utils.set_random_seed(0)
    return KerasTrainer(_cfg(**trainer), devices, [(rows, *SHAPE)], total_batches=10, vocab_size=TOKEN_IDS,
                        optimizer=lambda: keras.optimizers.SGD(learning_rate=1.0))


def _weights(trainer: KerasTrainer) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in trainer.model.trainable_variables]


def _same_start(a: KerasTrainer, b: KerasTrainer) -> list[np.ndarray]:
    for target, source in zip(b.model.trainable_variables, a.model.trainable_variables):
        target.assign(source.numpy())
    return _weights(a)


def _updates_match(start, a: KerasTrainer, b: KerasTrainer) -> None:
    for before, x, y in zip(start, _weights(a), _weights(b)):
        np.testing.assert_allclose(before - x, before - y, rtol=2e-4, atol=1e-6)
    assert any(not np.allclose(before, x) for before, x in zip(start, _weights(a)))


def test_each_replica_gets_its_own_rows_in_one_shape_on_its_device(replica_devices) -> None:
    trainer = _sgd_trainer(replica_devices, 8)
    batch = make_batch(8, *SHAPE, valid=7, seed=3)
    staged = trainer.stage(batch)
    for name, value in staged.items():
        parts = value.values
        assert [p.device.split("/")[-1] for p in parts] == ["device:CPU:0", "device:CPU:1"]
        assert [tuple(p.shape) for p in parts] == [(4, *batch[name].shape[1:])] * 2
        np.testing.assert_array_equal(np.concatenate([p.numpy() for p in parts]), batch[name])
    first, second = (p.numpy() for p in staged["tokens"].values)
    assert not np.array_equal(first, second)


def test_two_replicas_update_as_one_step_on_the_global_batch(replica_devices) -> None:
    batch = make_batch(8, *SHAPE, valid=6, seed=4)  # the second replica's rows are partly empty
    replicated, single = _sgd_trainer(replica_devices, 8), _sgd_trainer("/CPU:0", 8)
    start = _same_start(single, replicated)
    losses = [t.resolve([t.step(t.stage(batch))])[0] for t in (replicated, single)]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    assert replicated.updates == single.updates == 1
    _updates_match(start, replicated, single)
    assert replicated.stats()["replicas"] == 2 and replicated.stats()["traces"] == 1


def test_gradient_accumulation_with_replicas_equals_the_large_batch_gradient(replica_devices) -> None:
    """2 replicas x 2 accumulated batches of 4 rows each == one update on the 16 rows at once."""
    first, second = make_batch(8, *SHAPE, valid=8, seed=5), make_batch(8, *SHAPE, valid=3, seed=6)
    assert first["mel_lengths"].sum() != second["mel_lengths"].sum()
    both = {k: np.concatenate([first[k], second[k]]) for k in first}
    accumulated, large = _sgd_trainer(replica_devices, 8, grad_accum=2), _sgd_trainer("/CPU:0", 16)
    start = _same_start(large, accumulated)
    accumulated.step(accumulated.stage(first))
    assert all(np.array_equal(a, b) for a, b in zip(start, _weights(accumulated)))  # no update after 1 of 2
    accumulated.step(accumulated.stage(second))
    large.step(large.stage(both))
    assert accumulated.updates == large.updates == 1
    _updates_match(start, accumulated, large)


def test_a_non_finite_step_is_skipped_on_every_replica(replica_devices) -> None:
    trainer = _sgd_trainer(replica_devices, 8)
    before = _weights(trainer)
    poisoned = make_batch(8, *SHAPE, seed=7)
    poisoned["mel"][6, 0, 0] = np.inf  # in the second replica's rows only
    losses = trainer.resolve([trainer.step(trainer.stage(poisoned)) for _ in range(2)])
    assert all(not np.isfinite(x) for x in losses)
    assert trainer.health() == Health(bad_in_row=2, bad_total=2) and trainer.updates == 0
    assert all(np.array_equal(a, b) for a, b in zip(before, _weights(trainer)))
    for variable in trainer.model.trainable_variables:  # the mirrored copies stay the same
        copies = [c.numpy() for c in variable.value.values]
        assert all(np.array_equal(copies[0], c) for c in copies[1:])


def test_a_checkpoint_of_replicas_restores_into_one_device_and_back(replica_devices, tmp_path) -> None:
    import tensorflow as tf

    batch = make_batch(8, *SHAPE, seed=8)
    replicated = _sgd_trainer(replica_devices, 8)
    for _ in range(2):
        replicated.step(replicated.stage(batch))
    saved = tf.train.Checkpoint(**replicated.trackables()).save(str(tmp_path / "ckpt"))
    single = _sgd_trainer("/CPU:0", 8)
    tf.train.Checkpoint(**single.trackables()).restore(saved).assert_existing_objects_matched()
    again = _sgd_trainer(replica_devices, 8)
    tf.train.Checkpoint(**again.trackables()).restore(saved).assert_existing_objects_matched()
    for a, b, c in zip(_weights(replicated), _weights(single), _weights(again)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    assert single.updates == again.updates == 2
    # the next step from the restored state is the same on one device and on two replicas
    start = _weights(single)
    single.step(single.stage(batch))
    again.step(again.stage(batch))
    _updates_match(start, again, single)


def test_the_trainers_staging_splits_each_batch_per_replica_also_one_whose_staging_failed(replica_devices) -> None:
    """The feed stages the trainer's batches with its staging (as a stoker.Feed's): the queue's
    stage splits a batch per replica, and a batch that reached the loop as host arrays (its
    staging failed) is split when it is taken, so the step only ever gets per-replica parts."""
    trainer = _sgd_trainer(replica_devices, 8)
    staging = trainer.staging()
    batch = make_batch(8, *SHAPE, seed=9)
    staged = staging.stage(batch)
    assert staging.take(staged) is staged
    for parts in (staged, staging.take(batch)):
        for name, value in parts.items():
            np.testing.assert_array_equal(np.concatenate([p.numpy() for p in value.values]), batch[name])
    assert staging.device == ", ".join(trainer.devices)
