"""End-to-end: checkpoints of a real run, a crash (SIGKILL to every process of the run),
``python run.py --resume RUN_DIR``, Ctrl-C, and the one-line errors of a resume that cannot be."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import re
import shutil
import signal
import socket
import threading
from pathlib import Path
from typing import Iterator

import psutil
import pytest
import zmq

from stoker.consumer.feed.checkpoint import CKPT_DIR, POSITION, Checkpointer
from stoker.producer.batches import BatchMaker
from stoker.producer.worker import Producer
from stoker.shared.dataset.corpus.registry import read_metadata
from stoker.shared.dataset.files import DEMO_DATA_DIR
from tests.procs import RunProcess, holding_run_lock, read_json, read_jsonl, run_cli
from tests.test_run import NUMPY_FEATURES
from tests.trained import check_run

pytestmark = pytest.mark.slow  # TensorFlow or processes: not a unit test

DEMO_IDS = {e.id for e in read_metadata(DEMO_DATA_DIR)[0]}
# Batches of 4 make 16 steps an epoch on the 64 demo clips (21 with --max-frames 800), and
# steps of 60 ms keep a run short.
SMALL_RUN = ["--model", "synthetic:60", "--batch-size", "4", "--producers", "1", "--model-start-delay", "0.2",
             *NUMPY_FEATURES]
CHECKPOINT_LINE = r"checkpoint at step (\d+) saved"
# The runs that must be interrupted mid-epoch have no producer of their own, only gated_producer's,
# which prepares this many batches and no more until the test lets it: a run cannot train past
# that step, so a kill or a full disk lands mid-epoch by construction, however fast the host.
GATE_BATCHES = 5  # a checkpoint every 3 steps: the one at step 3, and none after it
DISK_GATE_BATCHES = 8  # checkpoints at steps 3 and 6
# Seconds allowed for start-up of a run.py process (interpreter, imports, dataset scan).
START_S = 60


def endpoint_of(run: RunProcess) -> str:
    line = run.wait_for_line(r"consumer listening on tcp://", START_S)
    return re.search(r"(tcp://\S+)", line).group(1)


@contextlib.contextmanager
def gated_producer(endpoint: str, batches: int, monkeypatch: pytest.MonkeyPatch, data: Path = DEMO_DATA_DIR,
                   name: str = "gated") -> Iterator[threading.Event]:
    """A producer in this process, on the trainer's ``data`` as a local one (it reads no
    metadata), that prepares ``batches`` batches, then none until the event it yields is set;
    the block's end sets it and stops the producer. Each ``name`` has a gate of its own."""
    opened = threading.Event()
    gates = getattr(BatchMaker.make, "gates", None)
    if gates is None:  # the first gated producer of the test: BatchMaker.make asks each maker's gate
        gates = {}
        real_make = BatchMaker.make

        def make(maker: BatchMaker, lease):
            if maker.name in gates:
                limit, made, gate = gates[maker.name]
                if next(made) >= limit:
                    gate.wait()
            return real_make(maker, lease)

        make.gates = gates
        monkeypatch.setattr(BatchMaker, "make", make)
    gates[name] = (batches, itertools.count(), opened)
    stop = threading.Event()
    ctx = zmq.Context()
    producer = Producer(endpoint, data, name, stop, context=ctx, scan=False)
    thread = threading.Thread(target=producer.run, name="gated-producer", daemon=True)
    thread.start()
    try:
        yield opened
    finally:
        opened.set()
        stop.set()
        thread.join(30)
        if not thread.is_alive():
            ctx.destroy(linger=0)
    assert not thread.is_alive(), "the gated producer did not stop"


def crash(run: RunProcess) -> None:
    """SIGKILL every process of the run, all stopped first (SIGSTOP): none can save, clean up or,
    as the launcher does when its consumer dies, write the summary from the run's files."""
    run.remember_children()
    procs = [*run.descendants.values(), psutil.Process(run.proc.pid)]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
    run.wait(timeout=10)
    gone, alive = psutil.wait_procs(list(run.descendants.values()), timeout=5)
    assert not alive, f"survivors: {alive}"


def kill_a_producer_then_crash(run: RunProcess) -> None:
    """Once the run trains: SIGKILL one of its two local producers (its leases move, the launcher
    restarts it); after the run's second checkpoint, :func:`crash` the whole run."""
    run.wait_for_line(r"step 2/", timeout=60)
    producers = [p for p in run.remember_children().values() if "stoker.producer.worker" in _command(p)]
    assert len(producers) == 2
    producers[0].kill()
    run.wait_for_line(r"crashed .*restarting it", timeout=30)
    run.descendants.pop(producers[0].pid)  # gone: crash() kills the rest
    run.wait_for_line(CHECKPOINT_LINE, timeout=60, count=2)
    crash(run)


def _command(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:  # a short-lived child of the run, gone since it was listed
        return ""


def latest_step(run_dir: Path) -> int:
    return Checkpointer(run_dir / CKPT_DIR, keep=1).checkpoints()[-1][0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("batching", "steps_per_epoch"), [((), 16), (("--max-frames", "800"), 21)],
                         ids=["fixed-rows", "frame-budget"])
def test_kill_9_mid_epoch_then_resume_trains_every_batch_once(tmp_path, monkeypatch, batching, steps_per_epoch):
    run_dir = tmp_path / "run"
    with RunProcess(*SMALL_RUN, *batching, "--producers", "0", "--epochs", "1", "--record-samples",
                    "--run-dir", str(run_dir), "--set", "trainer.checkpoint_every_steps=3") as run:
        with gated_producer(endpoint_of(run), GATE_BATCHES, monkeypatch):
            run.wait_for_line(CHECKPOINT_LINE, timeout=60)
            crash(run)  # at step 3, 4 or 5 of the epoch: its producer has prepared no more
    ckpt_step = latest_step(run_dir)
    before = read_jsonl(run_dir / "samples.jsonl")
    assert not (run_dir / "summary.json").exists()
    assert ckpt_step == 3 and len(before) <= GATE_BATCHES < steps_per_epoch, (ckpt_step, len(before))
    done_then = {i for r in before if r["step"] <= ckpt_step for i in r["ids"]}

    result = run_cli("--resume", str(run_dir), "--producers", "1", timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"took over the lock of host .*: pid \d+ is not running", result.stderr)  # the killed launcher's
    rows = read_jsonl(run_dir / "samples.jsonl")
    check_run(run_dir, 1, DEMO_IDS)  # every planned sample of the epoch, none twice
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert rows[:ckpt_step] == [r for r in before if r["step"] <= ckpt_step]
    after = [i for r in rows[ckpt_step:] for i in r["ids"]]
    assert not done_then & set(after), "a batch done at the checkpoint was trained again"
    per_batch = collections.Counter(tuple(r["ids"]) for r in rows)
    assert max(per_batch.values()) == 1
    summary = read_json(run_dir / "summary.json")
    assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == 1
    assert summary["resumed_from_step"] == ckpt_step
    assert summary["steps"] == len(rows) == len(read_jsonl(run_dir / "metrics.jsonl"))
    assert summary["samples"] == len(DEMO_IDS)
    assert latest_step(run_dir) == len(rows)  # the end of the run is checkpointed too


@pytest.mark.timeout(90)
def test_ctrl_c_saves_a_checkpoint_and_resume_extends_the_steps(tmp_path):
    run_dir = tmp_path / "run"
    with RunProcess(*SMALL_RUN, "--steps", "100000", "--run-dir", str(run_dir),
                    "--set", "trainer.log_every_steps=2") as run:
        run.wait_for_line(r"step 4/", timeout=60)
        run.remember_children()
        run.proc.send_signal(signal.SIGINT)
        assert run.wait(timeout=15) == 130, run.output()
        gone, alive = psutil.wait_procs(list(run.descendants.values()), timeout=2)
        assert not alive, f"orphans: {alive}"
    steps = read_json(run_dir / "summary.json")["steps"]
    assert latest_step(run_dir) == steps >= 4  # checkpoint_every_steps=100 was never reached: saved on stop

    result = run_cli("--resume", str(run_dir), "--steps", str(steps + 3), timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(run_dir / "summary.json")
    assert summary["steps"] == steps + 3 and summary["resumed_from_step"] == steps
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, steps + 4))
    assert "trainer:\n" in (run_dir / "config.yaml").read_text()
    assert f"steps: {steps + 3}" in (run_dir / "config.yaml").read_text()


@pytest.mark.timeout(120)
def test_a_full_disk_ends_the_run_in_one_line_and_resume_after_freeing_space_trains_every_batch_once(small_disk,
                                                                                                  monkeypatch):
    run_dir = small_disk.path / "run"
    with RunProcess(*SMALL_RUN, "--producers", "0", "--epochs", "1", "--record-samples",
                    "--run-dir", str(run_dir), "--set", "trainer.checkpoint_every_steps=3") as run:
        with gated_producer(endpoint_of(run), DISK_GATE_BATCHES, monkeypatch) as gate:
            run.wait_for_line(CHECKPOINT_LINE, timeout=60, count=2)
            small_disk.fill()  # every byte taken mid-epoch (at step 8 at most): the run's next write meets ENOSPC
            gate.set()  # the rest of the epoch: steps to write about
            assert run.wait(timeout=60) == 2, run.output()
        output = "\n".join(run.lines)
    errors = [line for line in output.splitlines() if line.startswith("stoker: error:")]
    assert len(errors) == 1 and "Traceback" not in output, output
    assert re.match(rf"stoker: error: cannot write {re.escape(str(run_dir))}/\S+: No space left on device \(ENOSPC\)",
                    errors[0]), errors[0]
    if (run_dir / "summary.json").exists():  # the run's end freed a page or two (a checkpoint's temporary)
        assert read_json(run_dir / "summary.json")["exit_reason"] == f"failed: {errors[0][len('stoker: error: '):]}"
    else:
        assert errors[0].endswith("; summary.json not written either (No space left on device)"), errors[0]
    ckpt = Checkpointer(run_dir / CKPT_DIR, keep=1)
    assert all(p.name.startswith("ckpt-") for p in ckpt.directory.iterdir())  # no partial checkpoint left
    ckpt_step = latest_step(run_dir)
    assert Checkpointer.verify(ckpt.latest())["step"] == ckpt_step >= 6

    small_disk.free()
    result = run_cli("--resume", str(run_dir), "--producers", "1", timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(run_dir / "samples.jsonl")
    check_run(run_dir, 1, DEMO_IDS)  # nothing lost, nothing twice
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert read_json(run_dir / "summary.json")["resumed_from_step"] == ckpt_step


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    result = run_cli(*SMALL_RUN, "--steps", "4", "--run-dir", str(run_dir), timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def copy_of(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run, target)
    return target


def snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def one_error_line(result) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("stoker: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


@pytest.mark.timeout(60)
def test_corrupt_checkpoint_is_one_line_and_nothing_is_overwritten(finished_run, tmp_path):
    run_dir = copy_of(finished_run, tmp_path)
    position = run_dir / CKPT_DIR / "ckpt-000004" / POSITION
    position.write_text(position.read_text().replace('"step":4', '"step":9'))
    before = snapshot(run_dir)
    line = one_error_line(run_cli("--resume", str(run_dir), "--steps", "8", timeout=60))
    assert re.search(r"checkpoint .*ckpt-000004 is corrupt \(position.json: checksum mismatch\)", line), line
    assert snapshot(run_dir) == before


@pytest.mark.timeout(60)
def test_resume_with_another_plan_is_one_line(finished_run, tmp_path):
    run_dir = copy_of(finished_run, tmp_path)
    before = snapshot(run_dir)
    line = one_error_line(run_cli("--resume", str(run_dir), "--batch-size", "8", timeout=60))
    assert "epoch plan differs" in line and "batching.batch_size 4 then, 8 now" in line
    assert snapshot(run_dir) == before


@pytest.mark.timeout(90)
def test_resume_on_a_changed_dataset_names_the_clips_then_goes_on_with_a_fresh_plan(finished_run, tmp_path):
    run_dir = copy_of(finished_run, tmp_path)
    data = tmp_path / "data"
    shutil.copytree(DEMO_DATA_DIR, data)
    lines = (data / "metadata.csv").read_text(encoding="utf-8").splitlines()
    gone = lines[5].split("|")[0]
    (data / "metadata.csv").write_text("\n".join(lines[:5] + lines[6:]) + "\n", encoding="utf-8")
    before = snapshot(run_dir)
    line = one_error_line(run_cli("--resume", str(run_dir), "--data", str(data), "--steps", "7", timeout=60))
    assert f"1 removed ({gone})" in line and f"--resume {run_dir} --fresh-plan" in line, line
    assert snapshot(run_dir) == before
    result = run_cli("--resume", str(run_dir), "--data", str(data), "--steps", "7", "--fresh-plan", timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--fresh-plan: keeping no model state (the trainer has none) and the step count (4)" in result.stderr
    summary = read_json(run_dir / "summary.json")
    assert summary["steps"] == 7 and summary["resumed_from_step"] == 4
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, 8))
    assert [r["epoch"] for r in read_jsonl(run_dir / "metrics.jsonl")][4:] == [0, 0, 0]  # the new plan's first epoch


@pytest.mark.timeout(60)
def test_a_run_directory_in_use_is_refused_in_one_line_naming_its_owner(finished_run, tmp_path):
    run_dir = copy_of(finished_run, tmp_path)
    with holding_run_lock(run_dir) as owner:  # a Slurm requeue while the old job runs, a second terminal
        before = snapshot(run_dir)
        line = one_error_line(run_cli("--resume", str(run_dir), timeout=60))
        assert f"is in use by host {socket.gethostname()}, pid {owner.pid}" in line, line
        assert snapshot(run_dir) == before  # nothing written: no config, no log, no checkpoint
    fresh = tmp_path / "fresh"
    with holding_run_lock(fresh) as owner:  # two new runs into one directory: the first has just taken it
        line = one_error_line(run_cli(*SMALL_RUN, "--steps", "4", "--run-dir", str(fresh), timeout=60))
        assert f"is in use by host {socket.gethostname()}, pid {owner.pid}" in line, line
        assert [p.name for p in fresh.iterdir()] == ["run.lock"]
    result = run_cli("--resume", str(run_dir), "--steps", "6", timeout=60)  # the owner is gone: it is free
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, 7))


@pytest.mark.timeout(30)
def test_resume_of_nothing_is_one_line(finished_run, tmp_path):
    assert "no such run directory" in one_error_line(run_cli("--resume", str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    assert "no config.yaml" in one_error_line(run_cli("--resume", str(tmp_path / "empty")))
    run_dir = copy_of(finished_run, tmp_path)
    shutil.rmtree(run_dir / CKPT_DIR)
    assert "no checkpoint in" in one_error_line(run_cli("--resume", str(run_dir)))
    assert "not --config" in one_error_line(run_cli("--resume", str(finished_run), "--config", "x.yaml"))
