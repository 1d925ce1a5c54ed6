"""stoker under Slurm (stoker/slurm.py, docs/SLURM.md).

The unit tests read Slurm's environment (host lists, tasks per node, heterogeneous jobs)
and place the trainer and the producer tasks without Slurm. The cluster tests start a real
Slurm cluster on this host (slurmctld and two slurmd daemons, each emulating one node, all
on loopback ports of their own) and submit stoker jobs with sbatch: the example job script
(a heterogeneous job), a job step over two nodes stopped by scancel and then resumed, and
allocations with no node for producers. They need Debian's Slurm (slurm-wlm); running as
root with apt-get, the cluster fixture installs it when it is missing, and the tests say why
they skip where it can be neither found nor installed.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from stoker.shared.errors import UserError
from stoker.shared.proc import EXIT_OK, EXIT_USER
from stoker.shared.runlock import RunLocked
from stoker.slurm import (FAILED, HANDOVER_DIR, HANDOVER_FILE, HANDOVER_KEYS, OVER, READY, Step, advertised, expand_counts,
                          expand_hostlist, place, read_handover, wait_handover, write_handover)
from tests.procs import ROOT, free_port, holding_run_lock, read_json
from tests.trained import check_run

EXAMPLE = ROOT / "docs" / "examples" / "slurm" / "stoker.sbatch"
SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "sinfo")
# slurm-wlm's daemons and commands without its recommends (plugins for databases, HDF5,
# InfluxDB...): 8 packages, about 6 s to install on the project's machine once apt's lists are there.
DEBIAN_PACKAGES = ("slurmctld", "slurmd", "slurm-client")
APT_TIMEOUT_S = 300.0
# The cluster's nodes: two slurmd daemons on this host (slurmd -N), so that producers run on
# another node than the trainer, as on a real cluster.
NODES = ("node1", "node2")
CPUS_PER_NODE = 2
CLUSTER_UP_S = 30.0
JOB_TIMEOUT_S = 60.0
# Between scancel's SIGTERM and SIGKILL: past the deadline of every wait for a job, so that a
# cancelled job that ended within it stopped on SIGTERM by itself (stoker's own stop bound is
# under 10 s, stoker/launcher.py), never by Slurm's SIGKILL.
KILL_WAIT_S = int(2 * JOB_TIMEOUT_S)
COMMAND_TIMEOUT_S = 20.0
POLL_S = 0.1
# Every cluster test's bound: a first one may install slurm-wlm and starts the cluster.
CLUSTER_TEST_TIMEOUT_S = int(APT_TIMEOUT_S + CLUSTER_UP_S + 3 * JOB_TIMEOUT_S)
TERMINAL = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}
# What the jobs train: the demo data, a model that holds each step 5 ms, no warm-up.
QUICK = ("--model", "synthetic:5", "--model-start-delay", "0")


# ---------------------------------------------------------------- unit: the Slurm environment

def test_host_lists_expand_as_scontrol_show_hostnames_does():
    assert expand_hostlist("node[01-03,7],gpu1") == ["node01", "node02", "node03", "node7", "gpu1"]
    assert expand_hostlist("rack[1-2]-n[8-9]") == ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]
    assert expand_hostlist("a,b") == ["a", "b"]
    with pytest.raises(UserError, match="cannot read the Slurm host list"):
        expand_hostlist("node[1-x]")
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("1") == [1]


def step_env(**overrides: str) -> dict[str, str]:
    env = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_STEP_NODELIST": "gpu1,cpu[1-2]",
           "SLURM_STEP_TASKS_PER_NODE": "1(x3)", "SLURMD_NODENAME": "gpu1", "SLURM_CPUS_ON_NODE": "8"}
    env.update(overrides)
    return {k: v for k, v in env.items() if v}


def test_step_from_the_environment():
    step = Step.from_env(step_env(SLURM_HET_SIZE="2"))
    assert step.nodes == ("gpu1", "cpu1", "cpu2") and step.ntasks == 3 and step.is_trainer
    assert step.het_size == 2 and step.cpus_per_task == 8
    assert Step.from_env(step_env(SLURM_PROCID="2", SLURMD_NODENAME="cpu2", SLURM_CPUS_PER_TASK="4")).cpus_per_task == 4
    with pytest.raises(UserError, match="SLURM_JOB_ID is not set"):
        Step.from_env({})
    with pytest.raises(UserError, match="started by srun.*SLURM_STEP_NODELIST"):
        Step.from_env(step_env(SLURM_STEP_NODELIST=""))


def test_producer_tasks_on_other_nodes():
    placement = place(Step.from_env(step_env()), "other", 0)
    assert (placement.trainer_node, placement.producer_tasks, placement.beside_trainer) == ("gpu1", 2, 0)
    # a producer task works out the same placement
    assert place(Step.from_env(step_env(SLURM_PROCID="1", SLURMD_NODENAME="cpu1")), "other", 0) == placement


def test_no_node_for_producers_is_one_line():
    one_node = step_env(SLURM_STEP_NODELIST="gpu1", SLURM_STEP_TASKS_PER_NODE="2")
    with pytest.raises(UserError, match="no node for producers apart from the trainer's node gpu1") as exc:
        place(Step.from_env(one_node), "other", 0)
    assert "\n" not in str(exc.value)
    assert place(Step.from_env(one_node), "any", 0).beside_trainer == 1
    alone = step_env(SLURM_STEP_NODELIST="gpu1", SLURM_STEP_TASKS_PER_NODE="1")
    with pytest.raises(UserError, match="no node for producers: the job step runs 1 task"):
        place(Step.from_env(alone), "other", 0)
    assert place(Step.from_env(alone), "other", 2).producer_tasks == 0  # local producers only
    with pytest.raises(UserError, match="heterogeneous .* srun --het-group=0-1"):
        place(Step.from_env({**alone, "SLURM_HET_SIZE": "2"}), "other", 0)
    mixed = step_env(SLURM_STEP_NODELIST="gpu1,cpu1", SLURM_STEP_TASKS_PER_NODE="2,1")
    with pytest.raises(UserError, match="1 of 2 producer tasks would share the trainer's node gpu1"):
        place(Step.from_env(mixed), "other", 0)


def test_endpoint_handover(tmp_path):
    assert advertised("tcp://0.0.0.0:5555", "gpu1") == "tcp://gpu1:5555"
    assert advertised("tcp://10.1.2.3:5555", "gpu1") == "tcp://10.1.2.3:5555"
    write_handover(tmp_path, "41", OVER, code=0)  # a previous job's record: not this job's
    assert read_handover(tmp_path, "42") is None
    with pytest.raises(UserError, match="no trainer endpoint for job 42"):
        wait_handover(tmp_path, "42", timeout_s=0.0)
    write_handover(tmp_path, "42", READY, endpoint="tcp://gpu1:5555")
    assert wait_handover(tmp_path, "42", timeout_s=0.0)["endpoint"] == "tcp://gpu1:5555"


def run_slurm_task(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], *argv: str) -> int:
    """``python run.py slurm ARGV`` as the task ``env`` describes, in this process."""
    from stoker.cli import build_parser, cmd_slurm

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # setup_logging's handler goes with the test
    monkeypatch.setattr(root, "level", root.level)
    return cmd_slurm(build_parser().parse_args(["slurm", *argv]), env)


def test_producer_tasks_end_quietly_with_the_trainers_error(tmp_path, monkeypatch, capsys):
    producer = step_env(SLURM_PROCID="1", SLURMD_NODENAME="cpu1")
    write_handover(tmp_path, "42", FAILED, error="the dataset is empty")
    assert run_slurm_task(monkeypatch, producer, "--run-dir", str(tmp_path)) == EXIT_USER
    write_handover(tmp_path, "42", OVER, code=0)  # the trainer was done before this task looked
    assert run_slurm_task(monkeypatch, producer, "--run-dir", str(tmp_path)) == EXIT_OK
    # a placement every task finds: the producer task stops without a word, the trainer's says why
    one_node = {"SLURM_STEP_NODELIST": "gpu1", "SLURM_STEP_TASKS_PER_NODE": "2"}
    assert run_slurm_task(monkeypatch, {**producer, **one_node, "SLURMD_NODENAME": "gpu1"},
                          "--run-dir", str(tmp_path / "new")) == EXIT_USER
    with pytest.raises(UserError, match="no node for producers"):
        run_slurm_task(monkeypatch, {**step_env(), **one_node}, "--run-dir", str(tmp_path / "new"))
    assert "error" not in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_a_task_reads_its_overrides_and_changes_none(tmp_path, monkeypatch):
    """run_task takes the config keys as given and works on its own copy: the caller needs none."""
    from stoker.slurm import Task, run_task

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # setup_logging's handler goes with the test
    given = {"run.run_dir": str(tmp_path / "run"), "trainer.steps": 3}
    one_node = step_env(SLURM_PROCID="1", SLURMD_NODENAME="gpu1", SLURM_STEP_NODELIST="gpu1",
                        SLURM_STEP_TASKS_PER_NODE="2")
    assert run_task(one_node, given, Task()) == EXIT_USER  # no node for producers: this task stops quietly
    assert given == {"run.run_dir": str(tmp_path / "run"), "trainer.steps": 3}


def test_the_trainer_binds_where_other_nodes_reach_it_unless_the_user_chose_and_says_so(tmp_path, caplog):
    from stoker.slurm import DEFAULT_BIND, Task, _config

    caplog.set_level(logging.INFO, logger="stoker.slurm")
    trainer = Step.from_env(step_env())
    cfg, resume_dir = _config(Task(), {}, tmp_path, trainer)
    assert cfg.pipeline.bind == DEFAULT_BIND and resume_dir is None
    assert [r.getMessage() for r in caplog.records] == [
        f"pipeline.bind: tcp://127.0.0.1:* -> {DEFAULT_BIND}, which producer tasks on other nodes reach (give "
        f"pipeline.bind to choose)"]
    caplog.clear()
    mine = tmp_path / "mine.yaml"
    mine.write_text("pipeline:\n  bind: tcp://10.0.0.1:*\n")
    assert _config(Task(config=str(mine)), {}, tmp_path, trainer)[0].pipeline.bind == "tcp://10.0.0.1:*"
    assert _config(Task(), {"pipeline.bind": "tcp://10.0.0.2:*"}, tmp_path, trainer)[0].pipeline.bind == \
        "tcp://10.0.0.2:*"
    assert not caplog.records


def test_a_requeued_trainer_task_leaves_a_running_jobs_run_directory_alone(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    write_handover(run_dir, "42", READY, endpoint="tcp://gpu1:5555")  # job 42's trainer still runs
    handover = (run_dir / "slurm" / "endpoint.json").read_text()
    with holding_run_lock(run_dir) as owner, pytest.raises(RunLocked, match=f"in use by host .*, pid {owner.pid}"):
        run_slurm_task(monkeypatch, step_env(SLURM_JOB_ID="43"), "--run-dir", str(run_dir))
    assert (run_dir / "slurm" / "endpoint.json").read_text() == handover  # its producers still find it
    assert sorted(p.name for p in (run_dir / "slurm").iterdir()) == ["endpoint.json"]  # no keys of job 43


# ---------------------------------------------------------------- unit: torchrun jobs

TORCHRUN_EXAMPLE = ROOT / "docs" / "examples" / "slurm" / "torchrun.sbatch"


class Execed(Exception):
    """What a stand-in os.execve raises with its arguments."""


def execed(path: str, argv: list[str], env: dict[str, str]) -> None:
    raise Execed(path, argv, env)


def srun_line_of(script: Path, tmp_path: Path, *args: str) -> list[str]:
    """The srun command line job script ``script`` runs with ``args``, recorded by a stand-in srun."""
    bin_dir, recorded = tmp_path / "bin", tmp_path / "srun-args"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {recorded}\n')
    (bin_dir / "srun").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", str(script), *args], env=env, check=True, timeout=COMMAND_TIMEOUT_S)
    return recorded.read_text().splitlines()


def test_the_torchrun_job_script_starts_one_torchrun_per_node_meeting_at_the_first(tmp_path, monkeypatch):
    """docs/examples/slurm/torchrun.sbatch: each task of its srun line is its node's torchrun of
    the user's script, with the job's nodes, this node's rank among them and one rendezvous."""
    user = ["docs/examples/ddp_trainer.py", "--data", "data/demo", "--run-dir", "runs/ddp", "--checkpoint", "ck"]
    srun = srun_line_of(TORCHRUN_EXAMPLE, tmp_path, *user)
    monkeypatch.setattr(os, "execve", execed)
    assert srun[:4] == ["--ntasks-per-node=1", "python", "run.py", "slurm"]
    second = step_env(SLURM_PROCID="1", SLURMD_NODENAME="cpu1", SLURM_JOB_ID="1234")
    with pytest.raises(Execed) as started:  # execve never returns: torchrun takes the task's process over
        run_slurm_task(monkeypatch, second, *srun[4:])
    path, argv, env = started.value.args
    assert path == sys.executable and argv == [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "3", "--node-rank", "1", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu1:21234", "--rdzv-id", "1234", "--max-restarts", "1", *user]
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and env["SLURM_JOB_ID"] == "1234"


@pytest.mark.parametrize(("env", "argv", "says"), [
    (step_env(SLURM_STEP_TASKS_PER_NODE="2,1(x2)"), ["--launcher", "torchrun", "train.py"],
     "--launcher torchrun runs one task per node (that node's torchrun starts its ranks); the step runs 2,1,1 "
     "task(s)"),
    (step_env(SLURM_HET_SIZE="2"), ["--launcher", "torchrun", "train.py"],
     "--launcher torchrun runs one task per node"),
    (step_env(), ["--launcher", "torchrun"], "--launcher torchrun needs the training script"),
    (step_env(), ["--data", "d", "--launcher", "torchrun", "train.py"],
     "--launcher torchrun starts your script, which makes its own stoker.Feed: give --data to the script"),
    (step_env(), ["train.py"], "train.py: stoker slurm takes a script with --launcher torchrun only"),
])
def test_a_torchrun_job_stoker_cannot_start_is_one_line(monkeypatch, env, argv, says):
    monkeypatch.setattr(os, "execve", execed)
    with pytest.raises(UserError) as info:
        run_slurm_task(monkeypatch, env, *argv)
    assert str(info.value).startswith(says) and "\n" not in str(info.value)


# ---------------------------------------------------------------- the cluster

def _missing() -> list[str]:
    return [name for name in SLURM_BINARIES if shutil.which(name) is None]


def _install_slurm() -> str:
    """Install Debian's Slurm with apt-get; '' when done, else why not."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *DEBIAN_PACKAGES]
    result = subprocess.run(command, capture_output=True, text=True, timeout=APT_TIMEOUT_S, env=env,
                            stdin=subprocess.DEVNULL)
    if result.returncode != 0:  # a machine whose package lists were never fetched
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, timeout=APT_TIMEOUT_S, env=env,
                       stdin=subprocess.DEVNULL)
        result = subprocess.run(command, capture_output=True, text=True, timeout=APT_TIMEOUT_S, env=env,
                                stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        return f"apt-get install {' '.join(DEBIAN_PACKAGES)} failed: {lines[-1] if lines else result.returncode}"
    return ""


def require_slurm() -> None:
    """Skip, saying why, where Slurm is missing and cannot be installed, or cannot run."""
    missing = _missing()
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        reason = _install_slurm()
        if reason:
            pytest.skip(f"slurm-wlm is not installed ({', '.join(missing)} not on PATH) and {reason}")
        missing = _missing()
    if missing:
        pytest.skip(f"slurm-wlm is not installed: {', '.join(missing)} not on PATH (apt-get install slurm-wlm; "
                    f"this test installs it itself only as root with apt-get)")
    if os.geteuid() != 0:
        pytest.skip("the test cluster's slurmd runs jobs as root (SlurmUser=root); this test runs as uid "
                    f"{os.geteuid()}")


def slurm_conf(directory: Path, host: str, ctld_port: int, node_ports: list[int]) -> str:
    nodes = "\n".join(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
                      f"CPUs={CPUS_PER_NODE} State=UNKNOWN" for name, port in zip(NODES, node_ports))
    return f"""\
ClusterName=stokertest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool-%n
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd-%n.pid
SlurmctldLogFile={directory}/slurmctld.log
SlurmdLogFile={directory}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
# Heterogeneous jobs are scheduled by the backfill scheduler only; every second, not every 30 s.
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
KillWait={KILL_WAIT_S}
{nodes}
PartitionName=test Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.conf = directory / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []
        # The commands talk to this cluster only; a surrounding Slurm job's variables are left out.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        self.env["SLURM_CONF"] = str(self.conf)
        self.env["STOKER"] = f"{sys.executable} {ROOT / 'run.py'}"

    def start(self) -> None:
        (self.dir / "state").mkdir()
        host = socket.gethostname().split(".")[0]  # hostname -s: slurmctld runs where SlurmctldHost names
        self.conf.write_text(slurm_conf(self.dir, host, free_port(), [free_port() for _ in NODES]))
        self.daemons.append(self._daemon("slurmctld", "slurmctld", "-D", "-i"))
        for name in NODES:
            self.daemons.append(self._daemon(f"slurmd-{name}", "slurmd", "-D", "-N", name))
        deadline = time.monotonic() + CLUSTER_UP_S
        while self.node_states() != {"idle"}:
            exited = [d.args[0] for d in self.daemons if d.poll() is not None]
            if exited or time.monotonic() > deadline:
                raise AssertionError(f"the test cluster did not come up ({exited or 'nodes not idle'}):\n"
                                     + self.logs())
            time.sleep(POLL_S)

    def _daemon(self, name: str, *argv: str) -> subprocess.Popen:
        with open(self.dir / f"{name}.out", "wb") as out:
            return subprocess.Popen([*argv, "-f", str(self.conf)], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self.env, cwd=self.dir)

    def run(self, *argv: str, check: bool = True) -> str:
        result = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=COMMAND_TIMEOUT_S,
                                cwd=ROOT, stdin=subprocess.DEVNULL)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: {result.stderr.strip()}")
        return result.stdout

    def node_states(self) -> set[str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%t", check=False)
        return set(out.split()) if out.strip() else set()

    def submit(self, out: Path, *argv: str) -> str:
        return self.run("sbatch", "--parsable", f"--output={out}", f"--chdir={ROOT}", *argv).strip().split(";")[0]

    def states(self, job: str) -> list[str]:
        """The states of the job's components (one for a plain job)."""
        return self.run("squeue", "-h", "-t", "all", "-j", job, "-o", "%T").split()

    def wait_job(self, job: str, timeout: float = JOB_TIMEOUT_S) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            states = self.states(job)
            if states and all(s in TERMINAL for s in states):
                return states
            if time.monotonic() > deadline:  # with why Slurm keeps it, and the daemons' logs
                reasons = self.run("squeue", "-h", "-t", "all", "-j", job, "-o", "%T %r", check=False).strip()
                raise AssertionError(f"job {job} still {states} after {timeout} s ({reasons}):\n{self.logs()}")
            time.sleep(POLL_S)

    def stop(self) -> None:
        """Cancel what is left, let it end, then stop the daemons this fixture started."""
        if self.daemons and self.daemons[0].poll() is None:
            for job in set(self.run("squeue", "-h", "-o", "%F", check=False).split()):
                self.run("scancel", job, check=False)
            deadline = time.monotonic() + KILL_WAIT_S + 10
            while self.run("squeue", "-h", check=False).strip() and time.monotonic() < deadline:
                time.sleep(POLL_S)
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.terminate()
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=COMMAND_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(timeout=COMMAND_TIMEOUT_S)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                         for p in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_slurm()
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def job_output(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("stoker: error:")]


def demo_ids() -> set[str]:
    return {line.split("|")[0] for line in (ROOT / "data" / "demo" / "metadata.csv").read_text().splitlines()
            if line.strip()}


@pytest.mark.slow
@pytest.mark.timeout(CLUSTER_TEST_TIMEOUT_S)
def test_heterogeneous_job_trains_with_producers_on_the_other_node(cluster, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = cluster.submit(out, str(EXAMPLE), "--run-dir", str(run_dir), "--bind", "tcp://127.0.0.1:*", *QUICK,
                         "--epochs", "2", "--record-samples")
    states = cluster.wait_job(job)
    output = job_output(out)
    assert states == ["COMPLETED", "COMPLETED"], output + cluster.logs()
    summary = read_json(run_dir / "summary.json")
    assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == 2
    held_out = set(read_json(run_dir / "validation.json")["ids"]) if (run_dir / "validation.json").exists() else set()
    check_run(run_dir, 2, demo_ids() - held_out)  # every sample exactly once per epoch, as the steps saw it
    # component 0 (the trainer) got the first node, component 1 (producers) the second
    producers = summary["producers"]
    assert producers and all(p["id"].endswith(f"@{NODES[1]}") for p in producers), producers
    assert sum(p["samples"] for p in producers) == summary["samples"]
    handover = read_json(run_dir / HANDOVER_DIR / HANDOVER_FILE)
    assert handover["job_id"] == job and handover["state"] == OVER and handover["node"] == NODES[0]
    keys = run_dir / HANDOVER_DIR / HANDOVER_KEYS
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in keys.rglob("*") if p.is_file())
    assert "key" not in EXAMPLE.read_text().split("exec srun")[1]  # the job script hands over no key
    assert not error_lines(output) and "Traceback" not in output


@pytest.mark.slow
@pytest.mark.timeout(CLUSTER_TEST_TIMEOUT_S)
def test_scancel_stops_cleanly_and_resume_continues(cluster, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    # Job steps instead of a heterogeneous job: two nodes, one task each, the same srun line.
    flags = ["--run-dir", str(run_dir), "--bind", "tcp://127.0.0.1:*", "--model", "synthetic:50",
             "--model-start-delay", "0", "--steps", "2000"]
    job = cluster.submit(out, "--nodes=2", "--ntasks-per-node=1",
                         f"--wrap=srun --kill-on-bad-exit=0 $STOKER slurm {' '.join(flags)}")
    live = run_dir / "live.json"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (live.exists() and (read_json(live).get("step") or 0) >= 5):  # training, mid-run
        assert time.monotonic() < deadline, job_output(out) + cluster.logs()
        assert not any(s in TERMINAL for s in cluster.states(job)), job_output(out)
        time.sleep(POLL_S)
    cluster.run("scancel", job)
    assert cluster.wait_job(job) == ["CANCELLED"]  # within JOB_TIMEOUT_S: before a SIGKILL could come
    output = job_output(out)
    summary = read_json(run_dir / "summary.json")
    assert summary["exit_reason"] == "interrupted", output
    assert summary.get("written_by") != "launcher", output  # the consumer's own summary, not a fallback
    checkpoints = sorted((run_dir / "ckpt").iterdir())
    assert checkpoints, output
    assert "Traceback" not in output

    # --resume in a new job (the example script): fresh keys, a new endpoint, the rest of the run
    out2 = tmp_path / "resume.out"
    steps = summary["steps"] + 4
    job2 = cluster.submit(out2, str(EXAMPLE), "--resume", str(run_dir), "--steps", str(steps))
    states = cluster.wait_job(job2)
    output2 = job_output(out2)
    assert states == ["COMPLETED", "COMPLETED"], output2 + cluster.logs()
    resumed = read_json(run_dir / "summary.json")
    assert resumed["exit_reason"] == "completed" and resumed["steps"] == steps, output2
    assert resumed["resumed_from_step"] == summary["steps"], output2
    assert read_json(run_dir / HANDOVER_DIR / HANDOVER_FILE)["job_id"] == job2


@pytest.mark.slow
@pytest.mark.timeout(CLUSTER_TEST_TIMEOUT_S)
@pytest.mark.parametrize("layout, message", [
    (["--nodes=1", "--ntasks=2", f"--wrap=srun $STOKER slurm {' '.join(QUICK)}"],
     "no node for producers apart from the trainer's node"),
    (["--ntasks=1", ":", "--ntasks=1", f"--wrap=srun $STOKER slurm {' '.join(QUICK)}"],
     "srun started only the trainer's component"),
], ids=["one-node", "het-job-step-without-producer-component"])
def test_no_node_for_producers_ends_with_one_line(cluster, tmp_path, layout, message):
    out = tmp_path / "job.out"
    job = cluster.submit(out, *layout)
    states = cluster.wait_job(job)
    output = job_output(out)
    assert "FAILED" in states, output
    lines = error_lines(output)
    assert len(lines) == 1 and message in lines[0], output
    assert "Traceback" not in output
    assert not list((ROOT / "runs").glob(f"slurm-{job}*"))  # nothing was started or written
