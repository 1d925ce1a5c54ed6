"""A stoker job under Slurm: one ``srun python run.py slurm [train flags]`` line starts the
trainer (task 0) and producers on every other task's node. Each task finds its role and
the placement in Slurm's environment; the trainer hands its endpoint and the job's fresh
keys to the producer tasks through the run directory. With ``--launcher torchrun SCRIPT``
each task (one per node) is that node's torchrun instead, its ranks the user's script on
stoker.Feed. docs/SLURM.md tells the whole story (placement, the hand-over, scancel and resume).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NoReturn, Sequence

from . import service
from .console import print_summary
from .launcher import CONSUMER_READY_TIMEOUT_S
from .shared.config import Config
from .shared.errors import UserError
from .shared.keys import DEFAULT_CLIENT, SECRET_MODE, make_keys
from .shared.proc import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USER, setup_logging
from .shared.runfiles import HANDOVER_DIR, HANDOVER_FILE, HANDOVER_KEYS, write_json
from .shared.runlock import RunLock

log = logging.getLogger("stoker.slurm")

HANDOVER_DIR_MODE = 0o700
# The run directory of a new run without --run-dir: one per job, the same on every task.
DEFAULT_RUN_DIR = "runs/slurm-{job_id}"
# Producer tasks wait this long for the trainer's endpoint: the trainer itself gives its
# consumer CONSUMER_READY_TIMEOUT_S (indexing a large dataset, importing TensorFlow) and
# checks the dataset and the model before that.
HANDOVER_WAIT_S = CONSUMER_READY_TIMEOUT_S + 300.0
# How often a producer task looks at the hand-over file (waiting for it, or for "over").
POLL_S = 0.5
# Bind addresses that name no host: the endpoint handed over carries the node's name instead.
WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]")
DEFAULT_BIND = "tcp://0.0.0.0:*"
PRODUCER_NODES = ("other", "any")
TORCHRUN = "torchrun"
LAUNCHERS = ("stoker", TORCHRUN)
# torchrun's rendezvous port on the step's first node, by default: one of its own for each job
# (the job id's), the same on every task.
RDZV_PORT_BASE, RDZV_PORTS = 20000, 20000
# handover states
READY, FAILED, OVER = "ready", "failed", "over"


@dataclass(frozen=True)
class Step:
    """What the Slurm environment says about this task and its job step."""

    job_id: str
    proc_id: int
    ntasks: int
    node: str  # the node this task runs on (SLURMD_NODENAME)
    nodes: tuple[str, ...]  # the step's nodes, in Slurm's order
    tasks_per_node: tuple[int, ...]  # tasks on each of ``nodes``
    het_size: int  # components of a heterogeneous job; 1 for a plain job
    cpus_per_task: int | None  # SLURM_CPUS_PER_TASK, else this node's CPUs over its tasks

    @property
    def is_trainer(self) -> bool:
        return self.proc_id == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Step":
        if not env.get("SLURM_JOB_ID"):
            raise UserError("stoker slurm runs inside a Slurm job, as the command of an srun line in the job "
                            "script (docs/SLURM.md); SLURM_JOB_ID is not set")
        missing = [name for name in ("SLURM_PROCID", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE",
                                     "SLURMD_NODENAME") if not env.get(name)]
        if missing:
            raise UserError(f"stoker slurm must be started by srun in the job script (srun python run.py slurm "
                            f"...), not by the batch script itself: {missing[0]} is not set")
        nodes = tuple(expand_hostlist(env["SLURM_STEP_NODELIST"]))
        counts = tuple(expand_counts(env["SLURM_STEP_TASKS_PER_NODE"]))
        if len(nodes) != len(counts):
            raise UserError(f"SLURM_STEP_NODELIST ({len(nodes)} nodes) and SLURM_STEP_TASKS_PER_NODE "
                            f"({len(counts)} entries) disagree")
        node = env["SLURMD_NODENAME"]
        cpus: int | None = None
        if env.get("SLURM_CPUS_PER_TASK", "").isdigit():
            cpus = int(env["SLURM_CPUS_PER_TASK"])
        elif env.get("SLURM_CPUS_ON_NODE", "").isdigit() and node in nodes:
            cpus = max(1, int(env["SLURM_CPUS_ON_NODE"]) // counts[nodes.index(node)])
        return cls(job_id=env["SLURM_JOB_ID"], proc_id=_int(env, "SLURM_PROCID"), ntasks=sum(counts), node=node,
                   nodes=nodes, tasks_per_node=counts, het_size=int(env.get("SLURM_HET_SIZE") or 1),
                   cpus_per_task=cpus)


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise UserError(f"{name}={env[name]!r} is not a number") from None


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


_BRACKET = re.compile(r"\[([^\]]*)\]")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def expand_hostlist(text: str) -> list[str]:
    """A Slurm host list (``node[01-03,7],gpu[1-2]-ib``) as node names, in order; what
    ``scontrol show hostnames`` prints, without needing scontrol."""
    hosts: list[str] = []
    for item in _split_top(text.strip()):
        hosts.extend(_expand_item(item, text))
    return hosts


def _expand_item(item: str, whole: str) -> list[str]:
    match = _BRACKET.search(item)
    if match is None:
        if "[" in item or "]" in item:
            raise UserError(f"cannot read the Slurm host list {whole!r}")
        return [item]
    heads = []
    for part in match.group(1).split(","):
        numbers = _RANGE.fullmatch(part)
        if numbers is None:
            raise UserError(f"cannot read the Slurm host list {whole!r}")
        low, high = numbers.group(1), numbers.group(2) or numbers.group(1)
        heads += [f"{n:0{len(low)}d}" for n in range(int(low), int(high) + 1)]
    prefix = item[:match.start()]
    return [prefix + head + rest for head in heads for rest in _expand_item(item[match.end():], whole)]


_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def expand_counts(text: str) -> list[int]:
    """``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) as one count per node (``[2, 2, 2, 1]``)."""
    counts: list[int] = []
    for part in text.split(","):
        match = _COUNT.fullmatch(part.strip())
        if match is None:
            raise UserError(f"cannot read SLURM_STEP_TASKS_PER_NODE={text!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


@dataclass(frozen=True)
class Placement:
    trainer_node: str
    producer_tasks: int  # tasks of the step that start producers
    beside_trainer: int  # of those, on the trainer's node


def place(step: Step, producer_nodes: str, local_producers: int | str) -> Placement:
    """Where the trainer and the producer tasks run; UserError (one line) when the step
    leaves no room for producers as asked. The same answer on every task of a step."""
    # Task 0 runs on the step's first node under Slurm's block, cyclic and plane
    # distributions; task 0 itself knows its node for certain.
    trainer_node = step.node if step.is_trainer else step.nodes[0]
    per_node = dict(zip(step.nodes, step.tasks_per_node))
    beside = per_node.get(trainer_node, 1) - 1
    placement = Placement(trainer_node, step.ntasks - 1, beside)
    if placement.producer_tasks == 0:
        if local_producers != 0:
            return placement  # a trainer with local producers only
        if step.het_size > 1:
            raise UserError(f"the job step has no task for producers: the job is heterogeneous ({step.het_size} "
                            f"components) but srun started only the trainer's component; start them all: "
                            f"srun --het-group=0-{step.het_size - 1} python run.py slurm ...")
        raise UserError(f"the Slurm allocation has no node for producers: the job step runs 1 task (the trainer, "
                        f"on {trainer_node}) and --producers 0 starts none beside it; give producers nodes (a "
                        f"heterogeneous job with a producer component, or sbatch --nodes=N --ntasks-per-node=1) "
                        f"or --producers N for producers on the trainer's node")
    if producer_nodes == "other" and beside:
        where = f"step nodes: {','.join(step.nodes)}"
        if beside == placement.producer_tasks:
            raise UserError(f"the Slurm allocation has no node for producers apart from the trainer's node "
                            f"{trainer_node} ({where}): ask for more nodes with one task each (sbatch --nodes=N "
                            f"--ntasks-per-node=1, or a heterogeneous job), or add --producer-nodes any to run "
                            f"producers beside the trainer")
        raise UserError(f"{beside} of {placement.producer_tasks} producer tasks would share the trainer's node "
                        f"{trainer_node} ({where}): use --ntasks-per-node=1, or add --producer-nodes any")
    return placement


# ---------------------------------------------------------------- the hand-over file

def handover_dir(run_dir: Path) -> Path:
    return run_dir / HANDOVER_DIR


def write_handover(run_dir: Path, job_id: str, state: str, **fields: Any) -> None:
    write_json(handover_dir(run_dir) / HANDOVER_FILE, {"job_id": job_id, "state": state, **fields})


def read_handover(run_dir: Path, job_id: str) -> dict[str, Any] | None:
    """This job's hand-over record, or None while there is none (or only an older job's)."""
    try:
        record = json.loads((handover_dir(run_dir) / HANDOVER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("job_id") != job_id:
        return None
    return record


def wait_handover(run_dir: Path, job_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        record = read_handover(run_dir, job_id)
        if record is not None:
            return record
        if time.monotonic() > deadline:
            raise UserError(f"no trainer endpoint for job {job_id} in {handover_dir(run_dir) / HANDOVER_FILE} "
                            f"after {timeout_s:.0f} s: the trainer task did not start (see its error), or "
                            f"{run_dir} is not on a filesystem shared with the trainer's node")
        time.sleep(POLL_S)


def job_keys(run_dir: Path) -> Path:
    """The directory of this job's keys (made by :func:`make_job_keys`)."""
    return handover_dir(run_dir) / HANDOVER_KEYS


def make_job_keys(run_dir: Path) -> Path:
    """Fresh CURVE keys for this job (a resumed run's older ones are replaced): the
    server pair and one client pair, every file 0600 in a 0700 directory."""
    directory = handover_dir(run_dir)
    directory.mkdir(mode=HANDOVER_DIR_MODE, exist_ok=True)
    os.chmod(directory, HANDOVER_DIR_MODE)
    keys = job_keys(run_dir)
    if keys.exists():
        shutil.rmtree(keys)
    make_keys(keys, [DEFAULT_CLIENT])
    for path in keys.rglob("*"):
        os.chmod(path, HANDOVER_DIR_MODE if path.is_dir() else SECRET_MODE)
    return keys


def advertised(endpoint: str, host: str) -> str:
    """The bound ``endpoint`` as producers on other nodes reach it: a wildcard address
    becomes ``host``."""
    scheme, _, rest = endpoint.partition("://")
    address, _, port = rest.rpartition(":")
    if address in WILDCARD_HOSTS:
        address = host
    return f"{scheme}://{address}:{port}"


# ---------------------------------------------------------------- the tasks

@dataclass(frozen=True)
class Task:
    """What a task of ``python run.py slurm`` is asked, beside the config keys: a YAML file, a
    run to resume (with a fresh plan), where producer tasks may run, producers per task."""

    config: str | None = None
    resume: str | None = None
    fresh_plan: bool = False
    producer_nodes: str = "other"
    task_producers: int | None = None


def run_task(env: Mapping[str, str], overrides: Mapping[str, Any], task: Task = Task()) -> int:
    """``python run.py slurm``: this task's role in the job step (``env``: Slurm's), with the
    config keys ``overrides`` gives; they are read, never changed."""
    given = dict(overrides)
    setup_logging("launcher", given.get("run.log_level") or "INFO")
    if task.producer_nodes not in PRODUCER_NODES:
        raise UserError(f"--producer-nodes {task.producer_nodes}: expected one of {', '.join(PRODUCER_NODES)}")
    if given.get("pipeline.keys"):
        raise UserError("pipeline.keys: stoker slurm makes the job's own keys in RUN_DIR/slurm/keys; leave it out")
    step = Step.from_env(env)
    given.setdefault("pipeline.producers", 0)  # remote producers only: the producer tasks
    run_dir = Path(task.resume or given.get("run.run_dir") or DEFAULT_RUN_DIR.format(job_id=step.job_id))
    run_dir = run_dir.expanduser().resolve()
    try:
        # What every task finds alike from the same flags and environment: each task stops at
        # once, and only the trainer's says why (one line, not one per task).
        place(step, task.producer_nodes, given["pipeline.producers"])
        cfg, resume_dir = _config(task, given, run_dir, step)
    except UserError as exc:
        if step.is_trainer:
            raise
        log.debug("task %d stops: %s", step.proc_id, exc)
        return EXIT_USER
    if step.is_trainer:
        return trainer_task(task, cfg, resume_dir, step, run_dir)
    return producer_task(task, given, step, run_dir)


def _config(task: Task, given: Mapping[str, Any], run_dir: Path, step: Step) -> tuple[Config, Path | None]:
    """The trainer's config, with the job's keys, and the run directory it resumes (None: a new
    run). A new run binds DEFAULT_BIND unless the user chose pipeline.bind: the default's
    loopback address is out of reach of producer tasks on other nodes (said in one line)."""
    keys = {"pipeline.keys": str(job_keys(run_dir))}
    if task.resume:
        if task.config is not None:
            raise UserError("--resume continues with RUN_DIR/config.yaml; change keys with flags or --set, "
                            "not --config")
        return service.resume_config(task.resume, {**given, **keys})
    cfg = service.resolve(task.config, {**given, **keys, "run.run_dir": str(run_dir)})
    if "pipeline.bind" not in given and cfg.pipeline.bind == Config().pipeline.bind:
        if step.is_trainer:
            log.info("pipeline.bind: %s -> %s, which producer tasks on other nodes reach (give pipeline.bind to "
                     "choose)", cfg.pipeline.bind, DEFAULT_BIND)
        cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, bind=DEFAULT_BIND))
    return cfg, None


def trainer_task(task: Task, cfg: Config, resume_dir: Path | None, step: Step, run_dir: Path) -> int:
    """Train, and tell the producer tasks through the hand-over file: the endpoint once
    bound, the error when the run cannot start, "over" when it ends. A run directory of
    another run that is not this job's (no slurm/ in it) is left as it is."""
    code = EXIT_FAILED
    # Before the keys and the hand-over file are written: a job requeued while the old one still
    # runs leaves the old one's files alone (RunLocked, one line); the launch takes it again.
    lock = RunLock.acquire(run_dir)
    try:
        code = _train(task, cfg, resume_dir, step, run_dir)
        return code
    except UserError as exc:
        if handover_dir(run_dir).is_dir():
            write_handover(run_dir, step.job_id, FAILED, error=str(exc))
        raise
    finally:
        record = read_handover(run_dir, step.job_id) or {}
        if handover_dir(run_dir).is_dir() and record.get("state", READY) == READY:
            kept = {k: v for k, v in record.items() if k not in ("job_id", "state")}
            write_handover(run_dir, step.job_id, OVER, **kept, code=code)
        lock.release()


def _train(task: Task, cfg: Config, resume_dir: Path | None, step: Step, run_dir: Path) -> int:
    if resume_dir is None:
        service.make_run_dir(str(run_dir))
    make_job_keys(run_dir)
    host = socket.gethostname()

    def ready(endpoint: str) -> None:
        public = advertised(endpoint, host)
        write_handover(run_dir, step.job_id, READY, endpoint=public, node=step.node, data=cfg.data.path)
        log.info("trainer on %s: endpoint %s handed over in %s", step.node, public,
                 handover_dir(run_dir) / HANDOVER_FILE)

    code, _, _ = service.launch(cfg, resume_dir, run_dir=run_dir, on_ready=ready, fresh_plan=task.fresh_plan)
    print_summary(run_dir)
    return code


def producer_task(task: Task, given: Mapping[str, Any], step: Step, run_dir: Path) -> int:
    record = wait_handover(run_dir, step.job_id, HANDOVER_WAIT_S)
    if record["state"] != READY:
        log.debug("the trainer task ended before it was ready (%s): no producers here", record)
        return EXIT_USER if record["state"] == FAILED else EXIT_OK
    count = task.task_producers or step.cpus_per_task or 1
    log.info("producer task %d on %s: %d producer(s) for %s", step.proc_id, step.node, count, record["endpoint"])
    over = threading.Event()
    # Until the producers' launcher takes SIGTERM over (its first act), the stop arrives here.
    signal.signal(signal.SIGTERM, _interrupt)
    threading.Thread(target=_watch_trainer, args=(run_dir, step.job_id, over), daemon=True).start()
    try:
        code = service.produce(record["endpoint"], record["data"], count, data_gpu=given.get("devices.data_gpu"),
                               data_gpu_memory_mb=given.get("devices.data_gpu_memory_mb"),
                               keys=str(job_keys(run_dir)), log_level=given.get("run.log_level") or "INFO",
                               host=step.node)
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    if over.is_set() and code == EXIT_INTERRUPTED:
        return EXIT_OK  # stopped because the trainer's run is over, not by a signal
    return code


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def _watch_trainer(run_dir: Path, job_id: str, over: threading.Event) -> None:
    """Stop this task's producers once the trainer has ended: producers whose trainer died
    without sending STOP would otherwise reconnect until the job's time limit."""
    while True:
        record = read_handover(run_dir, job_id)
        if record is not None and record.get("state") != READY:
            log.info("the trainer's run is over (%s): stopping this task's producers",
                     record.get("error") or f"status {record.get('code')}")
            over.set()
            os.kill(os.getpid(), signal.SIGTERM)  # the launcher's own stop: drain, BYE, join
            return
        time.sleep(POLL_S)


# ---------------------------------------------------------------- torchrun jobs

@dataclass(frozen=True)
class TorchrunJob:
    """What ``python run.py slurm --launcher torchrun`` is asked: the script and its arguments,
    the ranks of each node, how often torchrun may restart the job, its rendezvous port."""

    script: tuple[str, ...]
    nproc_per_node: int = 1
    max_restarts: int = 0
    rdzv_port: int | None = None  # None: RDZV_PORT_BASE + the job id modulo RDZV_PORTS


def torchrun_command(step: Step, job: TorchrunJob) -> tuple[list[str], dict[str, str]]:
    """This task's torchrun: its command line (this node's agent of the job's ``nodes x
    nproc_per_node`` ranks, meeting at the step's first node) and the environment it adds.
    UserError (one line) for a step that is not one task per node."""
    if not job.script:
        raise UserError("--launcher torchrun needs the training script: python run.py slurm --launcher torchrun "
                        "[--nproc-per-node N] SCRIPT [ARGS...]")
    if step.het_size > 1 or set(step.tasks_per_node) != {1}:
        raise UserError(f"--launcher torchrun runs one task per node (that node's torchrun starts its ranks); the "
                        f"step runs {','.join(map(str, step.tasks_per_node))} task(s) on its nodes "
                        f"{','.join(step.nodes)}: srun --ntasks-per-node=1 (a plain job, not a heterogeneous one)")
    if job.nproc_per_node < 1 or job.max_restarts < 0:
        raise UserError(f"--nproc-per-node {job.nproc_per_node}, --max-restarts {job.max_restarts}: expected at "
                        f"least 1 rank per node and 0 restarts or more")
    port = job.rdzv_port or RDZV_PORT_BASE + int(re.sub(r"\D", "", step.job_id) or 0) % RDZV_PORTS
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(step.nodes)),
               "--node-rank", str(step.nodes.index(step.node)), "--nproc-per-node", str(job.nproc_per_node),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{step.nodes[0]}:{port}", "--rdzv-id", step.job_id,
               "--max-restarts", str(job.max_restarts), *job.script]
    # torch's workers share the rendezvous store by default, which keeps the last attempt's
    # addresses: a restarted job's process group then cannot connect (docs/design/training.md, "torchrun ranks").
    return command, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_task(env: Mapping[str, str], job: TorchrunJob, overrides: Sequence[str] = ()) -> NoReturn:
    """``python run.py slurm --launcher torchrun``: this node's torchrun in this process's place
    (scancel's SIGTERM reaches torchrun, which stops its ranks). ``overrides``: stoker flags given
    too, which are the script's to take, not this command's."""
    if overrides:
        raise UserError(f"--launcher torchrun starts your script, which makes its own stoker.Feed: give "
                        f"{', '.join(overrides)} to the script (after its name), not to stoker slurm")
    setup_logging("launcher", "INFO")
    step = Step.from_env(env)
    command, extra = torchrun_command(step, job)
    log.info("task %d on %s: %s", step.proc_id, step.node, " ".join(command))
    os.execve(command[0], command, {**env, **extra})
