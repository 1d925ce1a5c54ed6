"""A user's PyTorch or JAX trainer: docs/examples/torch_loop.py or jax_loop.py with what each
step trained noted inside the step, and what the run imported checked before the feed closes.
Run as ``python -m tests.framework_user torch|jax REPORT ARGS`` (the example's ARGS) from the
project root; with ``KILL_AT_STEP`` it kills itself with SIGKILL right after the checkpoint
of that step is saved (a crash at a known point, with no time for any cleanup).

REPORT (JSON) holds the steps (tests/trained.py's Recorder: each batch's rows as the step
received them, with the feed's epoch), the types and devices of the batch values, the names of
the process's threads seen at the steps, and what imported
TensorFlow: the modules of this process and, for each producer process the feed started,
the TensorFlow libraries mapped into it (/proc/PID/maps). It is written when the feed
closes, and at the kill."""

import json
import os
import signal
import sys
import threading
from pathlib import Path

import psutil

import stoker
from tests.trained import Recorder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))

# A TensorFlow library, by the name of its shared objects (e.g. _pywrap_tensorflow_internal.so,
# libtensorflow_framework.so.2, libtensorflow_cc.so.2).
TF_LIBRARY = "tensorflow"
TF_MODULES = ("tensorflow", "keras", "tf_keras")

framework, report_path, *argv = sys.argv[1:]
example = __import__({"torch": "torch_loop", "jax": "jax_loop"}[framework])
BATCH_TYPE = example.torch.Tensor if framework == "torch" else example.jax.Array  # what the feed must hand out
KILL_AT = int(os.environ.get("KILL_AT_STEP", "0"))
recorder = Recorder()
feeds: list[stoker.Feed] = []
types: set[str] = set()
foreign: list[str] = []  # batch values that are not the framework's
devices: set[str] = set()  # where the batch values were
threads: set[str] = set()  # the names of this process's threads at each step


def producer_libraries() -> dict[int, list[str]]:
    """Each live producer of this process: the TensorFlow libraries mapped into it."""
    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            if "stoker.producer.worker" not in " ".join(child.cmdline()):
                continue
            maps = Path(f"/proc/{child.pid}/maps").read_text()
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            continue  # gone meanwhile: restarted ones are checked as they are found
        found[child.pid] = sorted({Path(line.split()[-1]).name for line in maps.splitlines()
                                   if TF_LIBRARY in line.split()[-1]})
    return found


def write_report() -> None:
    report = {"steps": recorder.steps, "types": sorted(types), "foreign": foreign, "producers": producer_libraries(),
              "devices": sorted(devices), "threads": sorted(threads),
              "modules": sorted(m for m in sys.modules if m.split(".")[0] in TF_MODULES)}
    Path(report_path).write_text(json.dumps(report))


def noted(step):
    """The example's step, its batch noted first: what the step trained, in the feed's epoch."""
    def step_noted(*args):
        batch = args[-1]
        types.update(f"{type(v).__module__}.{type(v).__name__}" for v in batch.values())
        foreign.extend(f"{k}: {type(v).__name__}" for k, v in batch.items() if not isinstance(v, BATCH_TYPE))
        devices.update(str(v.device) if framework == "torch" else ",".join(map(str, v.devices()))
                       for v in batch.values())
        threads.update(t.name for t in threading.enumerate())
        recorder.note(batch, feeds[-1].epoch)
        return step(*args)
    return step_noted


def save_then_die(save):
    def save_noted(path, *args):
        save(path, *args)
        step = feeds[-1].step
        if KILL_AT and step >= KILL_AT:
            write_report()
            print(f"killing myself after the checkpoint of step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    return save_noted


_enter, _close = stoker.Feed.__enter__, stoker.Feed.close


def enter(self):
    feeds.append(self)
    return _enter(self)


def close(self, exc=None):
    """What the run imported, while its producers still run (they stop as the feed closes)."""
    if not self._closed:
        write_report()
    return _close(self, exc)


stoker.Feed.__enter__, stoker.Feed.close = enter, close
example.train_step = noted(example.train_step)
example.save_checkpoint = save_then_die(example.save_checkpoint)

if __name__ == "__main__":
    sys.exit(example.main(argv))
