"""Your own training loop on stoker's batches: the custom-loop example of docs/FEED.md.

    python docs/examples/feed_loop.py --epochs 5 --run-dir runs/feed-loop --checkpoint ckpts/feed-loop

The model is docs/examples/conv_tts.py's; the step, the loss, the optimizer and the
checkpoints are this script's own, as in a user's trainer. stoker.Feed replaces only the
data loader: it starts the producers, hands out each batch as a dict of tensors on the
model device, and writes the run files (``python run.py diagnose RUN_DIR`` reads them).

At the end of every epoch the loss on the held-out clips (``trainer.val_clips`` of them,
never trained) is printed: ``feed.validation()`` is one pass over them, in batches the
producers make as they make training batches.

The feed's input position is saved in the same ``tf.train.Checkpoint`` as the model and
the optimizer (``feed.trackable()``). Run the same command again after a crash, even a
``kill -9``: the checkpoint is restored before the feed starts, so the feed goes on where
the checkpoint was taken and every clip is still trained once per epoch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

import keras
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stoker  # noqa: E402
from conv_tts import build  # noqa: E402


def loss_of(batch: dict[str, Any], out: dict[str, Any]) -> Any:
    """The mean absolute mel error over the valid frames (padding left out), plus the
    squared error of the predicted log length over the rows that are not empty."""
    mask = tf.sequence_mask(batch["mel_lengths"], tf.shape(batch["mel"])[1], dtype=tf.float32)[..., None]
    error = tf.abs(tf.cast(out["mel"], tf.float32) - batch["mel"]) * mask
    mel_l1 = tf.reduce_sum(error) / (tf.reduce_sum(mask) * tf.cast(tf.shape(batch["mel"])[2], tf.float32))
    rows = tf.cast(batch["mel_lengths"] > 0, tf.float32)
    log_length = tf.math.log(tf.maximum(tf.cast(batch["mel_lengths"], tf.float32), 1.0))
    length = tf.reduce_sum(rows * tf.square(tf.cast(out["log_frames"], tf.float32) - log_length)) / tf.reduce_sum(rows)
    return mel_l1 + 0.1 * length


def build_model(vocab_size: int, n_mels: int) -> keras.Model:
    """conv_tts's model, built on a one-row batch so its variables exist before a restore."""
    model = build(vocab_size=vocab_size, n_mels=n_mels)
    model({"tokens": tf.ones([1, 4], tf.int32), "token_lengths": tf.constant([4]),
           "mel": tf.zeros([1, 8, n_mels]), "mel_lengths": tf.constant([8])})
    return model


def train(options: dict[str, Any], checkpoint_dir: str | None, checkpoint_every: int,
          learning_rate: float = 2e-3) -> list[float]:
    """Train on the feed; the loss of every step."""
    feed = stoker.Feed(**options)
    model = build_model(feed.vocabulary.size, feed.n_mels)
    optimizer = keras.optimizers.Adam(learning_rate)
    optimizer.build(model.trainable_variables)
    manager = None
    if checkpoint_dir:
        checkpoint = tf.train.Checkpoint(model=model, weights=model.weights, optimizer=optimizer,
                                         feed=feed.trackable())
        manager = tf.train.CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=2)
        if manager.latest_checkpoint:
            checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
            print(f"restored {manager.latest_checkpoint} (the feed goes on from step {feed.state_dict()['step']})")

    @tf.function(input_signature=[feed.element_spec])  # one trace for every bucket shape
    def train_step(batch: dict[str, Any]) -> Any:
        with tf.GradientTape() as tape:
            out = model(batch, training=True)
            loss = loss_of(batch, out)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function(input_signature=[feed.element_spec])
    def eval_step(batch: dict[str, Any]) -> Any:
        return loss_of(batch, model(batch, training=False))

    losses = []
    with feed:
        for batch in feed:
            loss = train_step(batch)
            feed.step_done(loss=loss)
            losses.append(float(loss))
            if feed.step % feed.batches_per_epoch == 0:  # an epoch's end: one pass over the held-out clips
                validation = [float(eval_step(b)) for b in feed.validation()]
                if validation:
                    print(f"step {feed.step}: validation loss {sum(validation) / len(validation):.4f}", flush=True)
            if manager is not None and feed.step % checkpoint_every == 0:
                manager.save(checkpoint_number=feed.step)
    return losses


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="dataset directory (default: stoker's demo data)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--checkpoint", metavar="DIR", help="save (and restore) model, optimizer and feed here")
    parser.add_argument("--checkpoint-every", type=int, default=4, metavar="STEPS")
    parser.add_argument("--record-samples", action="store_true")
    args = parser.parse_args(argv)
    options = {"data": args.data, "epochs": args.epochs, "producers": args.producers,
               "batch_size": args.batch_size, "run_dir": args.run_dir, "record_samples": args.record_samples or None}
    losses = train(options, args.checkpoint, args.checkpoint_every)
    if losses:
        print(f"{len(losses)} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
