"""The launcher's reporting of a consumer that died: its signal by name, and a fallback
summary whose figures come from the run's own files. Pure: fake children and run files."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

from stoker.launcher import (CONNECT_LATER, Child, Supervisor, cgroup_oom_kills, ensure_summary, killed_reason,
                             oom_record, producer_child, recovered_epochs)
from stoker.shared import config as config_mod
from stoker.shared.proc import EXIT_FAILED

PID = 4242
OOM_LINES = [
    "6,900,1000,-;python invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0",
    f"3,901,1001,-;Out of memory: Killed process {PID} (python) total-vm:9000000kB, anon-rss:8000000kB",
    f"6,902,1002,-;oom_reaper: reaped process {PID} (python), now anon-rss:0kB",
]


def consumer(killed: bool = False) -> Child:
    child = Child("consumer", "consumer", [], None, proc=SimpleNamespace(pid=PID))  # type: ignore[arg-type]
    child.killed = killed
    return child


def test_a_sigkill_from_the_oom_killer_is_named_by_the_kernel_log(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("\n".join(["6,1,1,-;unrelated", *OOM_LINES]) + "\n")
    assert oom_record(PID, str(log)) == OOM_LINES[1].split(";", 1)[1]
    assert killed_reason(consumer(), signal.SIGKILL, str(log)) == (
        f"consumer killed by SIGKILL: the kernel's out-of-memory killer (Out of memory: Killed process {PID} "
        "(python) total-vm:9000000kB, anon-rss:8000000kB); give it more memory or a smaller batch")


def test_a_sigkill_with_no_oom_record_came_from_elsewhere(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text(OOM_LINES[1].replace(str(PID), "999") + "\n")
    assert oom_record(PID, str(log)) == ""
    assert killed_reason(consumer(), signal.SIGKILL, str(log)) == (
        f"consumer killed by SIGKILL from outside stoker (not the out-of-memory killer: the kernel log has no "
        f"record of pid {PID})")


def test_an_unreadable_kernel_log_says_possibly_the_oom_killer(tmp_path: Path) -> None:
    unreadable = str(tmp_path / "no-kmsg")
    assert oom_record(PID, unreadable) is None
    assert killed_reason(consumer(), signal.SIGKILL, unreadable) == (
        "consumer killed by SIGKILL from outside stoker: possibly the out-of-memory killer (the kernel log is not "
        "readable here; dmesg on this host tells), or another process's kill -9")


def test_an_oom_kill_counted_by_the_cgroup_names_the_oom_killer_without_the_kernel_log(tmp_path: Path) -> None:
    child = consumer()
    child.oom_kills = 2  # when it started
    unreadable = str(tmp_path / "no-kmsg")
    assert killed_reason(child, signal.SIGKILL, unreadable, oom_kills=lambda: 3) == (
        "consumer killed by SIGKILL: the out-of-memory killer (this cgroup's oom_kill count went from 2 to 3 while "
        "it ran); give it more memory or a smaller batch")
    assert "possibly the out-of-memory killer" in killed_reason(child, signal.SIGKILL, unreadable, oom_kills=lambda: 2)


def test_the_cgroup_oom_kill_count_is_read_from_cgroup_v2_or_v1(tmp_path: Path) -> None:
    (tmp_path / "self").write_text("0::/user.slice/run-1\n")
    (tmp_path / "v2" / "user.slice" / "run-1").mkdir(parents=True)
    (tmp_path / "v2" / "user.slice" / "run-1" / "memory.events").write_text(
        "low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert cgroup_oom_kills(str(tmp_path / "v2"), str(tmp_path / "self")) == 2
    (tmp_path / "self").write_text("4:memory:/docker/abc\n0::/\n")
    (tmp_path / "v1" / "memory").mkdir(parents=True)  # a container sees its own cgroup at the root
    (tmp_path / "v1" / "memory" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert cgroup_oom_kills(str(tmp_path / "v1"), str(tmp_path / "self")) == 5
    assert cgroup_oom_kills(str(tmp_path / "none"), str(tmp_path / "no-self")) is None


def test_other_signals_and_the_launchers_own_kill_are_said_as_they_are(tmp_path: Path) -> None:
    assert killed_reason(consumer(), signal.SIGSEGV, str(tmp_path / "none")) == "consumer killed by SIGSEGV"
    assert killed_reason(consumer(killed=True), signal.SIGKILL, str(tmp_path / "none")) == (
        "consumer killed by SIGKILL (by the launcher: it did not stop after SIGTERM)")
    assert killed_reason(consumer(), 77, str(tmp_path / "none")) == "consumer killed by signal 77"


def write_checkpoint(run_dir: Path, step: int, complete_below: int, samples_per_epoch: int,
                     batches_per_epoch: int) -> None:
    directory = run_dir / "ckpt" / f"ckpt-{step:06d}"
    directory.mkdir(parents=True)
    position = {"format": 1, "step": step,
                "plan": {"samples_per_epoch": samples_per_epoch, "batches_per_epoch": batches_per_epoch},
                "position": {"complete_below": complete_below, "complete": [], "open": {}}}
    (directory / "position.json").write_text(json.dumps(position))


def metrics_rows(epochs: int, batches: int, rows: int) -> list[dict]:
    return [{"step": e * batches + b + 1, "epoch": e, "t": 0.1, "queue_depth": 1, "wait_ms": 1.0, "step_ms": 5.0,
             "loss": None, "samples": rows, "frames": 10, "frames_computed": 20}
            for e in range(epochs) for b in range(batches)]


def test_the_fallback_summary_takes_its_figures_from_the_runs_files(tmp_path: Path) -> None:
    """15 epochs of 4 batches of 16: the checkpoint at step 56 saw 14 complete; the rows after
    it finish the 15th; a 16th is begun. The launcher's summary says 15, not 0."""
    write_checkpoint(tmp_path, 40, complete_below=10, samples_per_epoch=64, batches_per_epoch=4)
    write_checkpoint(tmp_path, 56, complete_below=14, samples_per_epoch=64, batches_per_epoch=4)
    rows = metrics_rows(15, 4, 16) + metrics_rows(16, 4, 16)[60:62]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert recovered_epochs(tmp_path, rows) == {"epochs_completed": 15, "batches_per_epoch": 4,
                                                "checkpoint_step": 56}
    cfg = config_mod.load(None)
    reason = "consumer killed by SIGKILL from outside stoker (not the out-of-memory killer)"
    ensure_summary(cfg, tmp_path, EXIT_FAILED, "", 12.0, reason=reason)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit_reason"] == reason and summary["written_by"] == "launcher"
    assert (summary["steps"], summary["samples"], summary["epochs_completed"]) == (62, 62 * 16, 15)
    assert summary["checkpoint"] == {"latest_step": 56}


def test_without_a_checkpoint_the_epochs_are_unknown_not_zero(tmp_path: Path) -> None:
    rows = metrics_rows(1, 3, 8)
    assert recovered_epochs(tmp_path, rows) == {"epochs_completed": None, "batches_per_epoch": 0,
                                                "checkpoint_step": None}


def test_the_runs_own_producers_read_no_metadata_and_remote_ones_scan() -> None:
    local = producer_child(0, ["tcp://127.0.0.1:5555"], "data", None, None, "INFO", "here", local=True)
    remote = producer_child(0, ["tcp://10.0.0.1:5555"], "data", None, None, "INFO", "there")
    assert "--local" in local.argv and "--local" not in remote.argv


def test_a_producer_of_several_trainers_connects_to_each() -> None:
    """The ranks of a host share a pool: each producer has a link to every rank's endpoint."""
    child = producer_child(1, ["tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"], "data", None, None, "INFO", "here",
                           local=True)
    assert [child.argv[i + 1] for i, a in enumerate(child.argv) if a == "--connect"] == ["tcp://127.0.0.1:5555",
                                                                                        "tcp://127.0.0.1:5556"]


def test_a_producer_started_before_its_trainer_binds_gets_the_endpoint_on_stdin_and_keeps_it() -> None:
    """The feed starts its producers beside the coordinator: the endpoint goes on the waiting
    process's stdin, and a restart has it on its command line."""
    child = producer_child(0, [], "data", None, None, "INFO", "here", local=True)
    assert CONNECT_LATER in child.argv and "--connect" not in child.argv
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "wb") as stdin, os.fdopen(read_fd, "rb") as seen:
        child.proc = SimpleNamespace(stdin=stdin)  # type: ignore[assignment]
        Supervisor(plan=None).connect([child], ["tcp://127.0.0.1:5555"])  # type: ignore[arg-type]
        assert stdin.closed and seen.read() == b"tcp://127.0.0.1:5555\n"
    assert CONNECT_LATER not in child.argv
    assert child.argv[child.argv.index("--connect") + 1] == "tcp://127.0.0.1:5555"


def test_producers_whose_trainer_never_bound_see_the_end_of_their_stdin() -> None:
    child = producer_child(0, [], "data", None, None, "INFO", "here", local=True)
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "wb") as stdin, os.fdopen(read_fd, "rb") as seen:
        child.proc = SimpleNamespace(stdin=stdin)  # type: ignore[assignment]
        Supervisor(plan=None).connect([child], [])  # type: ignore[arg-type]
        assert stdin.closed and seen.read() == b""
