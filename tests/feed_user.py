"""A user's trainer: docs/examples/feed_loop.py with what each step trained noted, and (with
``KILL_AT_STEP``) killed with SIGKILL by itself right after the checkpoint of that step is saved
(a crash at a known point, with no time for any cleanup). Run as ``python -m tests.feed_user ARGS``
(feed_loop.py's) from the project root.

Each step's rows (shared/batch.py row_identities) go to the run directory's trained.jsonl as the
loop confirms the step, with the feed's step and epoch; a feed resumed from a state cuts that file
back to the state's step, as it does metrics.jsonl."""

import json
import os
import signal
import sys
from pathlib import Path

import tensorflow as tf

import stoker
from stoker.shared.runfiles import TRAINED
from tests.trained import Recorder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))

import feed_loop  # noqa: E402

KILL_AT = int(os.environ.get("KILL_AT_STEP", "0"))
_save = tf.train.CheckpointManager.save
_next, _step_done = stoker.Feed.__next__, stoker.Feed.step_done


def save_then_die(self, checkpoint_number=None, **kwargs):
    path = _save(self, checkpoint_number=checkpoint_number, **kwargs)
    if KILL_AT and checkpoint_number is not None and checkpoint_number >= KILL_AT:
        print(f"killing myself after the checkpoint of step {checkpoint_number}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return path


def next_noted(self):
    self._trained_batch = batch = _next(self)
    return batch


def step_done_noted(self, loss=None, **terms):
    """The step on the batch last handed out ended: its rows to trained.jsonl, then confirmed."""
    recorder = Recorder()
    recorder.note(self._trained_batch, self.epoch)
    _step_done(self, loss, **terms)
    row = {**recorder.steps[0], "step": self.step}
    with open(Path(self._core.run_dir) / TRAINED, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


tf.train.CheckpointManager.save = save_then_die
stoker.Feed.__next__, stoker.Feed.step_done = next_noted, step_done_noted

if __name__ == "__main__":
    sys.exit(feed_loop.main())
