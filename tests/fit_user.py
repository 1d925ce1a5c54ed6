"""docs/examples/feed_fit.py with what each of fit's training steps trained noted from inside
the step (its loss, where Keras hands it the batch), to the run directory's trained.jsonl with
the feed's epoch. Run as ``python -m tests.fit_user ARGS`` (feed_fit.py's) from the project root."""

import json
import sys
from pathlib import Path

import tensorflow as tf

import stoker
from stoker.shared.runfiles import TRAINED
from tests.trained import IDENTIFYING, Recorder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))

import feed_fit  # noqa: E402

_enter, _compute_loss = stoker.Feed.__enter__, feed_fit.FitTTS.compute_loss
feeds: list[stoker.Feed] = []
recorder = Recorder()


def enter_noted(self):
    feeds.append(self)
    return _enter(self)


def note(*arrays):
    """One step's batch, seen inside the step: its rows to trained.jsonl."""
    feed = feeds[-1]
    recorder.note(dict(zip(IDENTIFYING, (a.numpy() for a in arrays))), feed.epoch)
    with open(Path(feed._core.run_dir) / TRAINED, "a", encoding="utf-8") as f:
        f.write(json.dumps(recorder.steps[-1]) + "\n")


def compute_loss_noted(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
    if training:
        tf.py_function(note, [x[k] for k in IDENTIFYING], [])
    return _compute_loss(self, x, y, y_pred, sample_weight, training)


stoker.Feed.__enter__ = enter_noted
feed_fit.FitTTS.compute_loss = compute_loss_noted

if __name__ == "__main__":
    sys.exit(feed_fit.main())
