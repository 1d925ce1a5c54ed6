"""One rank of a user's DDP job: docs/examples/ddp_trainer.py with what each step trained noted
inside the step. Run by torchrun as ``-m tests.ddp_user REPORT_DIR ARGS`` (the example's ARGS)
from the project root. With ``KILL_RANK`` and ``KILL_AT_STEP``, on torchrun's first attempt
that rank kills itself with SIGKILL right after the checkpoint of that step is saved (a crash
at a known point, with no time for any cleanup); torchrun (``--max-restarts``) then restarts
the job, which goes on from that checkpoint.

REPORT_DIR/rank-R-attempt-A.json (A: torchrun's restart count) holds this rank's pid, its
steps (tests/trained.py's Recorder: each batch's rows as the step received them, with the
feed's epoch), each step's batch shape and device, and the process group's backend. It is written after every checkpoint, every rank's
before any rank goes on (so the killed attempt's reports hold the steps its checkpoint holds),
and when the feed closes at the end of the plan."""

import json
import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist

import stoker
from tests.trained import Recorder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))

import ddp_trainer as example  # noqa: E402

report_dir, *argv = sys.argv[1:]
RANK, ATTEMPT = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
KILL_RANK, KILL_AT = int(os.environ.get("KILL_RANK", "-1")), int(os.environ.get("KILL_AT_STEP", "0"))
recorder = Recorder()
shapes: list[list[list[int]]] = []
devices: list[str] = []  # where each step's batch was (the feed stages it there)
feeds: list[stoker.Feed] = []


def write_report() -> None:
    report = {"pid": os.getpid(), "steps": recorder.steps, "shapes": shapes, "devices": devices,
              "backend": dist.get_backend(),
              "batches_per_epoch": feeds[-1].batches_per_epoch}
    (Path(report_dir) / f"rank-{RANK}-attempt-{ATTEMPT}.json").write_text(json.dumps(report))


def noted(step):
    """The example's step, its batch noted first: what the step trained, in the feed's epoch."""
    def step_noted(model, optimizer, data):
        tokens, mel, token_lengths, mel_lengths = data
        batch = {"tokens": tokens, "mel": mel, "token_lengths": token_lengths, "mel_lengths": mel_lengths}
        recorder.note(batch, feeds[-1].epoch)
        shapes.append([list(tokens.shape), list(mel.shape)])
        devices.append(str(mel.device))
        return step(model, optimizer, data)
    return step_noted


def save_then_die(save):
    def save_noted(directory, model, optimizer, feed):
        path = save(directory, model, optimizer, feed)
        write_report()
        dist.barrier()  # every rank's report counts the checkpoint's steps before one of them dies
        if ATTEMPT == 0 and RANK == KILL_RANK and feed.step >= KILL_AT:
            print(f"rank {RANK}: killing myself after the checkpoint of step {feed.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return path
    return save_noted


_enter, _close = stoker.Feed.__enter__, stoker.Feed.close


def enter(self):
    feeds.append(self)
    return _enter(self)


def close(self, exc=None):
    """The report of a plan trained to its end (not of a rank that failed when its peer died)."""
    if not self._closed and exc is None:
        write_report()
    return _close(self, exc)


stoker.Feed.__enter__, stoker.Feed.close = enter, close
example.train_step = noted(example.train_step)
example.save_checkpoint = save_then_die(example.save_checkpoint)

if __name__ == "__main__":
    sys.exit(example.main(argv))
