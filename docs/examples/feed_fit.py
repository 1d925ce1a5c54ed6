"""Keras ``fit`` on stoker's batches: the ``as_dataset()`` example of docs/FEED.md.

    python docs/examples/feed_fit.py --epochs 5 --run-dir runs/feed-fit

``feed.as_dataset()`` is a ``tf.data.Dataset`` of the feed's batches (each a dict of the
batch fields), so a Keras model trains on it with ``fit``; the model says what its loss
is by overriding ``compute_loss`` (the batch is ``x``; there is no separate ``y``). Each
iteration of the dataset is one epoch of the feed's plan, so a Keras epoch is a feed
epoch without ``steps_per_epoch``. ``feed.callback()`` confirms each step fit trained:
the feed's state and metrics.jsonl count those, not the batches tf.data took ahead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

import keras

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stoker  # noqa: E402
from conv_tts import ConvAttentionTTS  # noqa: E402
from feed_loop import loss_of  # noqa: E402


class FitTTS(ConvAttentionTTS):
    """conv_tts's model with its loss, for ``fit``: the batch dict is ``x``."""

    def compute_loss(self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None,
                     training: bool = True) -> Any:
        return loss_of(x, y_pred)


def train(options: dict[str, Any], learning_rate: float = 2e-3) -> list[float]:
    """Train with fit; the mean loss of each Keras epoch."""
    with stoker.Feed(**options) as feed:
        model = FitTTS(feed.vocabulary.size, feed.n_mels)
        model.compile(optimizer=keras.optimizers.Adam(learning_rate))
        history = model.fit(feed.as_dataset(), epochs=options["epochs"], callbacks=[feed.callback()],
                            shuffle=False, verbose=0)  # the feed's plan is shuffled already
    return [float(v) for v in history.history["loss"]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="dataset directory (default: stoker's demo data)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--record-samples", action="store_true")
    args = parser.parse_args(argv)
    losses = train({"data": args.data, "epochs": args.epochs, "producers": args.producers,
                    "batch_size": args.batch_size, "run_dir": args.run_dir,
                    "record_samples": args.record_samples or None})
    print(f"{len(losses)} epochs: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
