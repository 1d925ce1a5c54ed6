"""A user's tuple trainer that dies: docs/examples/tuple_trainer.py (Keras ``fit`` on the feed's
dataset, mapped and prefetched), killed with SIGKILL by itself right after the checkpoint
of step ``KILL_AT_STEP`` is saved. Run as ``python -m tests.tuple_user ARGS`` (tuple_trainer.py's)
from the project root."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))

import tuple_trainer  # noqa: E402

KILL_AT = int(os.environ["KILL_AT_STEP"])


def die_after(step: int) -> None:
    if step >= KILL_AT:
        print(f"killing myself after the checkpoint of step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


tuple_trainer.after_checkpoint = die_after

if __name__ == "__main__":
    sys.exit(tuple_trainer.main())
