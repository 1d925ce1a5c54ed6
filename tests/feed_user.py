"""A user's trainer that dies: docs/examples/feed_loop.py, killed with SIGKILL by itself right
after the checkpoint of step ``KILL_AT_STEP`` is saved (a crash at a known point, with no
time for any cleanup). Run as ``python -m tests.feed_user ARGS`` (feed_loop.py's) from the project root."""

import os
import signal
import sys
from pathlib import Path

import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))

import feed_loop  # noqa: E402

KILL_AT = int(os.environ["KILL_AT_STEP"])
_save = tf.train.CheckpointManager.save


def save_then_die(self, checkpoint_number=None, **kwargs):
    path = _save(self, checkpoint_number=checkpoint_number, **kwargs)
    if checkpoint_number is not None and checkpoint_number >= KILL_AT:
        print(f"killing myself after the checkpoint of step {checkpoint_number}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return path


tf.train.CheckpointManager.save = save_then_die

if __name__ == "__main__":
    sys.exit(feed_loop.main())
