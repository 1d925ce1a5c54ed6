"""The TensorFlow part of consumer/feed/checkpoint.py: a trainer's ``trackables()`` (a small Keras
model and its optimizer) saved with the step and restored into fresh objects."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from stoker.consumer.feed.checkpoint import CheckpointError, RunCheckpoints
from stoker.consumer.plan import EpochPlanner
from stoker.shared.config import BatchingConfig, Config
from tests.factories import make_samples

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PLANNER = EpochPlanner(make_samples(20, seed=5), BatchingConfig(batch_size=4, num_buckets=2))


class KerasTrainer:
    """A minimal trainer exposing ``trackables()`` as the consumer's trainers do."""

    name = "keras-test"
    uses_tensorflow = True

    def __init__(self) -> None:
        keras.utils.set_random_seed(1)
        self.model = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
        self.optimizer = keras.optimizers.Adam(1e-2)
        self.x = tf.constant(np.linspace(-1, 1, 24, dtype=np.float32).reshape(8, 3))
        self.y = tf.reduce_sum(self.x, axis=1, keepdims=True)

    def trackables(self) -> dict:
        return {"model": self.model, "optimizer": self.optimizer}

    def step(self) -> float:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((self.model(self.x) - self.y) ** 2)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return float(loss)


def checkpoints(run_dir, planner: EpochPlanner = PLANNER, fingerprint: str = "data-1") -> RunCheckpoints:
    cfg = Config()
    return RunCheckpoints(run_dir, dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, model="tiny")),
                          planner, fingerprint)


def three_steps_saved(trainer: Any, tmp_path: Path) -> Path:
    """``trainer`` trains the plan's first three batches; the checkpoint of step 3, saved."""
    saving = checkpoints(tmp_path)
    saving.attach(trainer)
    for batch in PLANNER.plan(0)[:3]:
        trainer.step()
        saving.position.record(0, batch.ids)
    return saving.save(3)


def test_model_optimizer_and_step_are_restored(tmp_path):
    first = KerasTrainer()
    path = three_steps_saved(first, tmp_path)
    assert sorted(p.name for p in path.iterdir()) == ["MANIFEST.json", "position.json", "position.msgpack",
                                                      "state.data-00000-of-00001", "state.index"]
    expected = [first.step() for _ in range(2)]  # what training goes on to do from step 3

    second = KerasTrainer()  # fresh weights; Keras builds them (and the optimizer's slots) at the first step
    resuming = checkpoints(tmp_path)
    assert resuming.resume().step == 3
    resuming.attach(second)
    assert [second.step() for _ in range(2)] == pytest.approx(expected, rel=1e-6)
    assert int(second.optimizer.iterations.numpy()) == 5
    assert resuming.position.remaining(PLANNER.plan(0)) == PLANNER.plan(0)[3:]


def test_a_fresh_plan_restores_the_model_and_optimizer_over_a_changed_dataset(tmp_path):
    first = KerasTrainer()
    three_steps_saved(first, tmp_path)
    expected = [first.step() for _ in range(2)]
    changed = EpochPlanner(make_samples(26, seed=5), BatchingConfig(batch_size=4, num_buckets=2))
    with pytest.raises(CheckpointError, match="6 added"):
        checkpoints(tmp_path, changed, "data-2").resume()
    second = KerasTrainer()
    resuming = checkpoints(tmp_path, changed, "data-2")
    assert resuming.resume(fresh_plan=True).step == 3
    resuming.attach(second)
    assert [second.step() for _ in range(2)] == pytest.approx(expected, rel=1e-6)  # the weights and the optimizer
    assert int(second.optimizer.iterations.numpy()) == 5
    assert resuming.position.remaining(changed.plan(0)) == changed.plan(0)  # the new plan from its start


def test_checkpoint_without_model_state_cannot_restore_a_model(tmp_path):
    class Stateless:
        name, uses_tensorflow = "stateless", False

        def trackables(self) -> None:
            return None

    saving = checkpoints(tmp_path)
    saving.attach(Stateless())
    saving.position.record(0, PLANNER.plan(0)[0].ids)
    saving.save(1)
    resuming = checkpoints(tmp_path)
    resuming.resume()
    with pytest.raises(CheckpointError, match=r"holds \[\], the trainer exposes \['model', 'optimizer'\]"):
        resuming.attach(KerasTrainer())


class Nested(keras.Model):
    """A user model whose layers live in a list and a dict (as many real models keep them)."""

    def __init__(self, vocab_size: int, n_mels: int) -> None:
        super().__init__()
        self.embed = keras.layers.Embedding(vocab_size, 16)
        self.blocks = [keras.layers.Dense(16, activation="relu") for _ in range(3)]
        self.heads = {"mel": keras.layers.Dense(n_mels), "gate": keras.layers.Dense(1)}
        self.attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)

    def call(self, inputs, training=False):
        text = self.embed(inputs["tokens"])
        for block in self.blocks:
            text = block(text)
        text = self.attention(text, text)
        frames = tf.shape(inputs["mel"])[1]
        pooled = tf.reduce_mean(text, axis=1, keepdims=True)
        h = tf.tile(pooled, [1, frames, 1])
        return {"mel": self.heads["mel"](h) * tf.sigmoid(self.heads["gate"](h))}


def nested(vocab_size: int, n_mels: int) -> keras.Model:
    return Nested(vocab_size, n_mels)


@pytest.mark.parametrize("spec", ["tiny", "small", "tests.consumer.feed.test_checkpoint_tf:nested"])
def test_every_weight_of_a_model_is_restored(tmp_path, spec):
    """Saved as the trainer saves, restored into a freshly built model (other random weights):
    every variable equal, and the model's output the same."""
    from stoker.consumer.training import tts

    def built(seed: int):
        keras.utils.set_random_seed(seed)
        model = tts.build(spec, 40, 16)
        model(batch, training=False)
        return model

    batch = tts.dummy_inputs(2, 16, 32, 16, -11.5, 40)
    first = built(1)
    tf.train.Checkpoint(**tts.restorable(first)).write(str(tmp_path / "state"))
    second = built(2)
    assert not all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(first.variables, second.variables))
    tf.train.Checkpoint(**tts.restorable(second)).read(str(tmp_path / "state")).assert_existing_objects_matched()
    assert len(first.variables) == len(second.variables)
    for a, b in zip(first.variables, second.variables):
        assert np.array_equal(a.numpy(), b.numpy()), a.path
    np.testing.assert_array_equal(tts.outputs_of(first(batch))["mel"], tts.outputs_of(second(batch))["mel"])
