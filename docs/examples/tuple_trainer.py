"""A user's own trainer on stoker's batches, as the first users' trainers are shaped: a step
that takes ``(tokens, mel, token_lengths, mel_lengths)`` tuples, a fixed number of steps per
epoch, Keras ``fit`` on a tf.data pipeline of the user's own (a ``map`` to the tuple and a
``prefetch``), validation on held-out clips after every epoch, and checkpoints of its own
that hold the feed's state beside the weights.

    python docs/examples/tuple_trainer.py --epochs 5 --run-dir runs/tuple --checkpoint ckpts/tuple

Run the same command again after a crash, even a ``kill -9``: the newest checkpoint is
restored (weights, optimizer, the feed's state) and training goes on from there, with
every clip trained once per epoch. Two things make that hold although tf.data takes
batches ahead of training:

- ``feed.callback()`` comes first in ``callbacks``: it confirms each step that ``fit``
  ran, so ``feed.state_dict()`` counts the batches the model trained, not the ones the
  ``prefetch`` holds;
- the checkpoint saves ``feed.state_dict()`` with the weights, in one directory made
  whole before it is named (a crash leaves the previous checkpoint as it was).

Held-out clips (``trainer.val_clips``, or ``data.eval_file``) come from
``feed.validation()``: batches made by the same producers, never in a training batch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

import keras
import tensorflow as tf
from keras import layers

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stoker  # noqa: E402
from stoker.shared.batch import row_identities  # noqa: E402

STATE = "feed_state.json"  # the feed's state in a checkpoint directory, beside the weights
TRAINED = "trained.json"  # what the model trained, per step (--record-trained)


def to_tuple(batch: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """The user's own batch format: what their trainer took before stoker."""
    return batch["tokens"], batch["mel"], batch["token_lengths"], batch["mel_lengths"]


def masked_l1(mel: Any, predicted: Any, mel_lengths: Any) -> Any:
    """The mean absolute error of each row over its valid frames, averaged over the rows: a
    per-row mean, as most TTS trainers compute it (a row of padding only would dilute it)."""
    mask = tf.sequence_mask(mel_lengths, tf.shape(mel)[1], dtype=tf.float32)[..., None]
    per_row = tf.reduce_sum(tf.abs(predicted - mel) * mask, axis=[1, 2])
    per_row /= tf.maximum(tf.reduce_sum(mask, axis=[1, 2]), 1.0) * tf.cast(tf.shape(mel)[2], tf.float32)
    return tf.reduce_mean(per_row)


class TupleTTS(keras.Model):
    """A small text-to-mel model whose steps take the 4-tuple. ``record``: a list that gets,
    from inside each training step, what identifies every row the step trained (its tokens,
    frames and a digest of its mel: stoker.shared.batch.row_identities)."""

    def __init__(self, vocab_size: int, n_mels: int, dim: int = 64,
                 record: list[dict[str, Any]] | None = None) -> None:
        super().__init__(name="tuple_tts")
        self.embed = layers.Embedding(vocab_size, dim)
        self.encoder = [layers.Conv1D(dim, 5, padding="same", activation="relu") for _ in range(2)]
        self.query = layers.Dense(dim)
        self.attention = layers.MultiHeadAttention(num_heads=2, key_dim=dim // 2)
        self.out = layers.Dense(n_mels)
        self.record = record
        self.loss_tracker = keras.metrics.Mean(name="loss")  # the epoch's mean, as fit reports it

    @property
    def metrics(self) -> list[Any]:
        return [self.loss_tracker]

    def call(self, inputs: tuple[Any, Any, Any], training: bool = False) -> Any:
        tokens, token_lengths, mel_lengths = inputs
        frames = tf.reduce_max(mel_lengths)
        x = self.embed(tokens)
        for conv in self.encoder:
            x = x + conv(x)
        progress = tf.cast(tf.range(frames), tf.float32)[None, :] / tf.cast(tf.maximum(mel_lengths, 1), tf.float32)[
            :, None]
        angles = progress[..., None] * tf.range(1.0, 17.0)[None, None, :] * 3.14159
        q = self.query(tf.concat([tf.sin(angles), tf.cos(angles)], axis=-1))
        token_mask = tf.sequence_mask(token_lengths, tf.shape(tokens)[1])
        h = q + self.attention(q, x, attention_mask=token_mask[:, None, :] & tf.ones([1, frames, 1], tf.bool))
        return self.out(h)

    def _loss(self, data: tuple[Any, Any, Any, Any], training: bool) -> Any:
        tokens, mel, token_lengths, mel_lengths = data
        predicted = self((tokens, token_lengths, mel_lengths), training=training)
        frames = tf.shape(predicted)[1]
        return masked_l1(mel[:, :frames], predicted, mel_lengths)

    def train_step(self, data: tuple[Any, Any, Any, Any]) -> dict[str, Any]:
        if self.record is not None:  # what this step trains, seen from inside it
            tf.py_function(self._note, list(data), [])
        with tf.GradientTape() as tape:
            loss = self._loss(data, training=True)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}

    def test_step(self, data: tuple[Any, Any, Any, Any]) -> dict[str, Any]:
        self.loss_tracker.update_state(self._loss(data, training=False))
        return {"loss": self.loss_tracker.result()}

    def _note(self, tokens: Any, mel: Any, token_lengths: Any, mel_lengths: Any) -> None:
        """Each real row of the step's batch: its tokens, frames and a digest of its mel."""
        assert self.record is not None
        self.record.extend(row_identities({"tokens": tokens.numpy(), "mel": mel.numpy(),
                                           "token_lengths": token_lengths.numpy(), "mel_lengths": mel_lengths.numpy()}))


class Checkpoints(keras.callbacks.Callback):
    """The trainer's own checkpoints: weights, optimizer and the feed's state every
    ``every`` steps, each in a directory written whole under a temporary name first."""

    def __init__(self, directory: Path, feed: stoker.Feed, every: int) -> None:
        super().__init__()
        self.directory, self.feed, self.every = directory, feed, every
        self.steps = 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            self.save()

    def save(self) -> None:
        state = self.feed.state_dict()
        final = self.directory / f"step-{state['step']:08d}"
        if final.exists():
            return
        partial = self.directory / f".partial-{state['step']:08d}"
        shutil.rmtree(partial, ignore_errors=True)
        tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer).write(str(partial / "weights"))
        (partial / STATE).write_text(json.dumps(state))
        if self.model.record is not None:
            (partial / TRAINED).write_text(json.dumps(list(self.model.record)))
        os.replace(partial, final)
        after_checkpoint(state["step"])


def after_checkpoint(step: int) -> None:
    """Called after every checkpoint (a test makes it crash the process there)."""


def latest(directory: Path) -> Path | None:
    done = sorted(directory.glob("step-*")) if directory.is_dir() else []
    return done[-1] if done else None


def train(options: dict[str, Any], checkpoint_dir: Path, checkpoint_every: int, record_trained: bool,
          learning_rate: float = 2e-3) -> dict[str, Any]:
    """Train ``options["epochs"]`` epochs (or what is left of them after a crash); the loss of
    each Keras epoch and the validation loss after it."""
    restored = latest(checkpoint_dir)
    resume = json.loads((restored / STATE).read_text()) if restored else None
    trained = json.loads((restored / TRAINED).read_text()) if restored and record_trained else []
    feed = stoker.Feed(**options, resume=resume)
    model = TupleTTS(feed.vocabulary.size, feed.n_mels, record=trained if record_trained else None)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate))
    tokens, lengths = tf.ones([1, 4], tf.int32), tf.constant([4])
    model((tokens, lengths, tf.constant([8])))  # variables built before the restore
    model.optimizer.build(model.trainable_variables)
    if restored:
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(str(restored / "weights")).expect_partial()
        print(f"restored {restored.name}: the feed goes on from step {resume['step']}", flush=True)
    history: dict[str, list[float]] = {"loss": [], "val_loss": []}
    with feed:
        steps_per_epoch = feed.batches_per_epoch  # fixed, as in the user's trainer
        done = resume["step"] if resume else 0
        # Every epoch left as one stream (repeat), mapped to the user's tuples and prefetched.
        data = feed.as_dataset().repeat().map(to_tuple).prefetch(2)
        validation = feed.validation_dataset().map(to_tuple)
        saver = Checkpoints(checkpoint_dir, feed, checkpoint_every)
        callbacks = [feed.callback(), saver]  # the feed's first: it confirms the step the others save
        if done % steps_per_epoch:  # resumed mid-epoch: the rest of that epoch first
            fitted = model.fit(data, epochs=1, steps_per_epoch=steps_per_epoch - done % steps_per_epoch,
                               validation_data=validation, callbacks=callbacks, verbose=0)
            extend(history, fitted.history)
        first = -(-done // steps_per_epoch)
        if first < options["epochs"]:
            fitted = model.fit(data, initial_epoch=first, epochs=options["epochs"], steps_per_epoch=steps_per_epoch,
                               validation_data=validation, callbacks=callbacks, verbose=0)
            extend(history, fitted.history)
        saver.save()
    return history


def extend(history: dict[str, list[float]], more: dict[str, list[Any]]) -> None:
    for key in history:
        history[key].extend(float(v) for v in more.get(key, []))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="dataset directory (default: stoker's demo data)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="save (and restore) the trainer here")
    parser.add_argument("--checkpoint-every", type=int, default=4, metavar="STEPS")
    parser.add_argument("--record-trained", action="store_true",
                        help=f"keep what identifies every row trained (noted inside the step) in each checkpoint's "
                             f"{TRAINED}")
    args = parser.parse_args(argv)
    options = {"data": args.data, "epochs": args.epochs, "producers": args.producers,
               "batch_size": args.batch_size, "run_dir": args.run_dir}
    history = train(options, Path(args.checkpoint), args.checkpoint_every, args.record_trained)
    if history["loss"]:
        print(f"{len(history['loss'])} epochs: loss {history['loss'][0]:.4f} -> {history['loss'][-1]:.4f}; "
              f"validation {' '.join(f'{v:.4f}' for v in history['val_loss'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
