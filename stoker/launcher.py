"""The launcher: starts, pins, supervises and stops the local processes of a run.

It never imports TensorFlow. Each child is a fresh interpreter (``subprocess``, never a fork)
with its device environment, a session of its own and a status pipe; a crashed producer is
restarted. Processes, supervision and the shutdown's steps and bounds: docs/design/processes.md,
"Processes", "Shutdown protocol".
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil

from .consumer.feed.checkpoint import POSITION, Checkpointer
from .shared.config import Config
from .shared.errors import UserError
from .shared.metrics import read_jsonl, summarize
from .shared.proc import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USER, caller_path, with_stoker_path
from .shared.runfiles import CKPT_DIR, METRICS, REJECTED, SUMMARY, RunFileError, write_json
from .autoscale import DECISION_INTERVAL_S, AutoScaler, LiveWindow, default_max_producers
from .devices import DevicePlan, child_env

log = logging.getLogger("launcher")

# The consumer stops after its current step; a tiny step is far below this, but a
# consumer still importing TensorFlow finishes the import before it can react.
CONSUMER_STOP_S = 7.0
# Producers have been told STOP (or SIGTERM) by then; they only need to close sockets.
PRODUCER_STOP_S = 2.0
# Between SIGTERM and SIGKILL for a child that ignores the protocol.
KILL_AFTER_S = 0.5
# Supervision loop tick: how soon a crash or a signal is noticed.
TICK_S = 0.2
# Indexing a large dataset and importing TensorFlow both happen before "ready".
CONSUMER_READY_TIMEOUT_S = 600.0
# Producers get parallelism from processes, not BLAS threads: their matrix products are
# small (mel filterbank x one batch of frames), and OpenBLAS's threads cost more than they
# save: a batch of 16 demo clips took 200 ms with its default threads and 75-85 ms with
# one, on 2 cores, and with several producers the threads also oversubscribe the cores.
# Defaults only: a variable set in the user's environment wins.
PRODUCER_ENV = {"OPENBLAS_NUM_THREADS": "1"}
# A producer started before its trainer is bound takes the endpoints on stdin (Supervisor.connect).
CONNECT_LATER = "--connect-later"



class LaunchError(UserError):
    """A run that cannot start; the message is the one line the user sees."""


@dataclass
class Child:
    role: str  # "consumer" or "producer"
    name: str
    argv: list[str]
    gpu: int | tuple[int, ...] | None  # the trainer's model GPUs may be several
    proc: subprocess.Popen | None = None
    status_fd: int = -1
    buffer: bytes = b""
    events: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0
    last_error: str = ""
    done: bool = False
    retiring: bool = False  # told to stop by the auto-scaler: its exit is not a crash
    killed: bool = False  # the launcher sent it SIGKILL (it ignored SIGTERM)
    oom_kills: int | None = None  # the cgroup's out-of-memory kills when it started (None: unknown)
    env: dict[str, str] = field(default_factory=dict)  # defaults for this child's environment


class Supervisor:
    """Starts, watches and stops the children of this process. ``import_path``: directories every
    child's PYTHONPATH starts with (devices.child_env)."""

    def __init__(self, plan: DevicePlan, log_level: str = "INFO", import_path: Sequence[str] = ()) -> None:
        self.plan = plan
        self.log_level = log_level
        self.import_path = tuple(import_path)
        self.children: list[Child] = []
        self.signalled: int | None = None

    # ------------------------------------------------------------ signals
    def install_signals(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            if self.signalled is None:
                log.info("%s received: stopping (drain, join, terminate)", signal.Signals(signum).name)
            self.signalled = signum

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    # ------------------------------------------------------------ children
    def spawn(self, child: Child) -> Child:
        read_fd, write_fd = os.pipe()
        env = child_env(os.environ, child.gpu, self.import_path)
        for key, value in child.env.items():
            env.setdefault(key, value)
        env = with_stoker_path(env)
        argv = [sys.executable, "-m", *child.argv, "--parent-pid", str(os.getpid()), "--status-fd", str(write_fd)]
        child.oom_kills = cgroup_oom_kills()
        child.proc = subprocess.Popen(argv, env=env, pass_fds=(write_fd,), start_new_session=True,
                                      stdin=subprocess.PIPE if CONNECT_LATER in child.argv else subprocess.DEVNULL)
        os.close(write_fd)
        os.set_blocking(read_fd, False)
        child.status_fd = read_fd
        child.buffer = b""
        child.done = False
        if child not in self.children:
            self.children.append(child)
        log.debug("started %s (pid %d) with CUDA_VISIBLE_DEVICES=%r", child.name, child.proc.pid,
                  env["CUDA_VISIBLE_DEVICES"])
        return child

    def connect(self, children: list[Child], endpoints: Sequence[str]) -> None:
        """Give producers started before their trainers were bound (``--connect-later``) the
        trainers' endpoints, a line on their stdin; a restart has them on its command line.
        No endpoints: their stdin is closed, and they end."""
        for child in children:
            if CONNECT_LATER not in child.argv:
                continue
            if endpoints:
                at = child.argv.index(CONNECT_LATER)
                child.argv[at:at + 1] = [a for e in endpoints for a in ("--connect", e)]
            if child.proc is None or child.proc.stdin is None:
                continue
            try:
                if endpoints:
                    child.proc.stdin.write(" ".join(endpoints).encode() + b"\n")
                child.proc.stdin.close()
            except BrokenPipeError:
                log.debug("%s ended before its trainer was bound", child.name)  # restarted with the endpoints

    def _read_status(self, child: Child) -> None:
        if child.status_fd < 0:
            return
        try:
            while True:
                chunk = os.read(child.status_fd, 65536)
                if not chunk:
                    os.close(child.status_fd)
                    child.status_fd = -1
                    break
                child.buffer += chunk
        except BlockingIOError:
            pass
        *lines, child.buffer = child.buffer.split(b"\n")
        for line in lines:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s wrote a malformed status line", child.name)
                continue
            if not isinstance(event, dict):
                continue
            if event.get("event") == "error":
                child.last_error = f"{event.get('type')}: {event.get('message')}"
                if event.get("user_error"):
                    child.last_error = str(event.get("message"))
                event["user_error"] = bool(event.get("user_error"))
            child.events.append(event)

    def poll_status(self, timeout: float) -> None:
        fds = [c.status_fd for c in self.children if c.status_fd >= 0]
        try:
            select.select(fds, [], [], timeout)  # with no pipe left, a plain timed wait
        except InterruptedError:
            pass
        for child in self.children:
            self._read_status(child)

    def terminate(self, children: list[Child], deadline_s: float) -> None:
        """SIGTERM, wait until the deadline, then SIGKILL whatever is left."""
        for c in children:
            if c.proc and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        self.wait(children, deadline_s)
        for c in children:
            if c.proc and c.proc.poll() is None:
                log.warning("%s did not stop in time; killing it", c.name)
                c.killed = True
                c.proc.kill()
        self.wait(children, KILL_AFTER_S)

    def wait(self, children: list[Child], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while any(c.proc and c.proc.poll() is None for c in children):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self.poll_status(min(TICK_S, remaining))

    def cleanup(self) -> None:
        for c in self.children:
            if c.proc and c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait(timeout=5)
            if c.status_fd >= 0:
                os.close(c.status_fd)
                c.status_fd = -1
            if c.proc and c.proc.stdin:
                c.proc.stdin.close()  # nothing buffered: connect() flushed its line

    def supervise_producers(self, producers: list[Child], limit: int, keep_going: Callable[[], bool],
                            report_user_errors: bool = True) -> None:
        """Restart crashed producers (bounded); called once per tick while the run goes on."""
        for p in producers:
            if p.done or p.proc is None:
                continue
            code = p.proc.poll()
            if code is None:
                continue
            self._read_status(p)
            if code == 0 or p.retiring or not keep_going():
                p.done = True
                continue
            reason = p.last_error or (killed_reason(p, -code) if code < 0 else f"exit status {code}")
            if code == EXIT_USER:
                if report_user_errors:
                    log.error("%s stopped: %s", p.name, reason)
                p.done = True
            elif p.restarts < limit:
                p.restarts += 1
                log.error("%s crashed (%s); restarting it (%d of %d)", p.name, reason, p.restarts, limit)
                p.last_error = ""
                self.spawn(p)
            else:
                log.error("%s crashed (%s); not restarting it again after %d restarts", p.name, reason, limit)
                p.done = True


def producer_child(index: int, endpoints: Sequence[str], data: str, gpu: int | None, memory_mb: int | None,
                   log_level: str, host: str, keys: str = "", metadata_file: str = "metadata.csv",
                   local: bool = False) -> Child:
    """A producer process serving the trainers at ``endpoints`` (one, or the ranks of a host; none:
    they come later, :meth:`Supervisor.connect`); ``local``: started beside the trainers, on their
    host, reading their files (it joins without scanning the dataset: docs/design/protocol.md,
    "Dataset agreement")."""
    name = f"p{index}@{host}"
    connect = [a for e in endpoints for a in ("--connect", e)] or [CONNECT_LATER]
    argv = ["stoker.producer.worker", *connect, "--data", data, "--name",
            name, "--log-level", log_level, "--metadata-file", metadata_file]
    if local:
        argv.append("--local")
    if memory_mb:
        argv += ["--gpu-memory-mb", str(memory_mb)]
    if keys:
        argv += ["--keys", keys]  # a directory; the secret key never appears on a command line
    return Child("producer", name, argv, gpu, env=dict(PRODUCER_ENV))


def run_training(cfg: Config, run_dir: Path, plan: DevicePlan, resume: bool = False,
                 on_ready: Callable[[str], None] | None = None, fresh_plan: bool = False) -> int:
    """Run the consumer and the local producers; return the trainer's exit status.
    ``resume``: the consumer continues from the run directory's latest checkpoint (with
    ``fresh_plan``, its model and step count, on a new epoch plan).
    ``on_ready``: called with the bound endpoint once the consumer is ready (``stoker
    slurm`` hands it to the producer tasks)."""
    sup = Supervisor(plan, cfg.run.log_level)
    sup.install_signals()
    started = time.monotonic()
    consumer = sup.spawn(Child("consumer", "consumer", consumer_argv(run_dir, plan, resume, fresh_plan),
                                 plan.model_gpus))
    producers: list[Child] = []
    code: int | None = None
    auto: AutoControl | None = None
    try:
        endpoint = wait_ready(sup, consumer)
        if endpoint is not None and on_ready is not None:
            on_ready(endpoint)
        if endpoint is not None and sup.signalled is None:
            producers = start_producers(sup, cfg, plan, [endpoint])
        if cfg.pipeline.producers_auto:
            auto = AutoControl(cfg, run_dir, sup, producers, [endpoint], plan)
        while consumer.proc.poll() is None and sup.signalled is None:
            sup.poll_status(TICK_S)
            sup.supervise_producers(producers, cfg.pipeline.producer_restarts,
                                    keep_going=lambda: consumer.proc.poll() is None and sup.signalled is None)
            if auto is not None:
                auto.step()
        if sup.signalled is not None:
            # Stop signal to everyone at once; the consumer drains and writes its summary.
            for c in [consumer, *producers]:
                if c.proc and c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            sup.wait([consumer], CONSUMER_STOP_S)
            sup.terminate([consumer], KILL_AFTER_S)
        code = consumer.proc.wait()
        sup.wait(producers, PRODUCER_STOP_S)
        sup.terminate(producers, KILL_AFTER_S)
    finally:
        sup.cleanup()
    reason = ""
    if code is None or code < 0:  # killed by a signal
        if sup.signalled is None and code is not None:
            reason = killed_reason(consumer, -code)
            log.error("%s", reason)
        code = EXIT_INTERRUPTED if sup.signalled is not None else EXIT_FAILED
    if sup.signalled is not None and code == EXIT_OK:
        code = EXIT_INTERRUPTED
    unwritten = ensure_summary(cfg, run_dir, code, consumer.last_error, time.monotonic() - started, reason=reason)
    if auto is not None and not unwritten:
        auto.record(run_dir / SUMMARY)
    if code == EXIT_USER and consumer.last_error:
        # Found after the consumer was ready (a user's model that breaks its contract, a
        # checkpoint whose state does not fit, a full disk): still the user's one line.
        raise LaunchError(consumer.last_error)
    if unwritten:
        raise LaunchError(unwritten)
    return code


def consumer_argv(run_dir: Path, plan: DevicePlan, resume: bool, fresh_plan: bool = False) -> list[str]:
    argv = ["stoker.consumer.training.main", "--run-dir", str(run_dir), *(["--resume"] if resume else []),
            *(["--fresh-plan"] if resume and fresh_plan else [])]
    if plan.model_memory_mb:
        argv += ["--gpu-memory-mb", str(plan.model_memory_mb)]
    nvml = [f"{role}={index}" for role, index in (("data", plan.data_gpu), ("model", plan.model_gpu))
            if index is not None]
    if nvml:
        argv += ["--nvml-gpus", ",".join(nvml)]
    return argv


def wait_ready(sup: Supervisor, consumer: Child) -> str | None:
    """The consumer's endpoint once it is ready; None when a stop signal came first. LaunchError
    (the user's one line) when it stopped with a user error, exited, or never became ready."""
    deadline = time.monotonic() + CONSUMER_READY_TIMEOUT_S
    while True:
        sup.poll_status(TICK_S)
        for event in consumer.events:
            if event.get("event") == "ready":
                consumer.events.clear()
                return str(event["endpoint"])
            if event.get("event") == "error" and event.get("user_error"):
                sup.wait([consumer], CONSUMER_STOP_S)
                raise LaunchError(str(event.get("message")))
        consumer.events.clear()
        if consumer.proc.poll() is not None:
            code = consumer.proc.returncode
            how = killed_reason(consumer, -code) if code < 0 else f"status {code}"
            raise LaunchError(f"the consumer exited before it was ready ({how}"
                              f"{': ' + consumer.last_error if consumer.last_error else ''})")
        if sup.signalled is not None:
            return None
        if time.monotonic() > deadline:
            raise LaunchError(f"the consumer was not ready after {CONSUMER_READY_TIMEOUT_S:.0f} s")


def start_producers(sup: Supervisor, cfg: Config, plan: DevicePlan, endpoints: Sequence[str]) -> list[Child]:
    """The run's local producers (pipeline.producers of them), started for the trainers at
    ``endpoints`` (none: before they are bound; :meth:`Supervisor.connect` gives them later)."""
    host = socket.gethostname()
    producers = [sup.spawn(producer_child(i, endpoints, cfg.data.path, plan.data_gpu, plan.data_memory_mb,
                                          cfg.run.log_level, host, keys=cfg.pipeline.keys,
                                          metadata_file=cfg.data.metadata_file, local=True))
                 for i in range(cfg.pipeline.producers)]
    if producers:
        log.info("started %d local producer(s) for %s", len(producers), ", ".join(endpoints) or "the trainer")
    return producers


class BackgroundProducers:
    """The local producers of a trainer in this process (a ``stoker.Feed``), supervised in a
    thread beside the user's loop as :func:`run_training` supervises a run's: status lines
    read, crashes restarted (at most ``pipeline.producer_restarts`` each), ``auto`` scaled.
    Without ``endpoints`` they start while the trainer binds (their imports beside its start)
    and wait for :meth:`connect`. ``close()``, once the trainer side has told them STOP, joins
    them, then terminates."""

    def __init__(self, cfg: Config, plan: DevicePlan, endpoints: Sequence[str], run_dir: Path) -> None:
        self.cfg, self.plan, self.run_dir = cfg, plan, run_dir
        # The caller's import path: a user transform or producer model beside the script imports in the producers.
        self.sup = Supervisor(plan, cfg.run.log_level, caller_path())
        self.producers: list[Child] = []
        self.auto: AutoControl | None = None
        self._closing = threading.Event()
        self._lock = threading.Lock()  # connect() against the supervision thread's restarts
        self._connected = False
        try:
            self.producers.extend(start_producers(self.sup, cfg, plan, endpoints))
            if endpoints:
                self._connect(endpoints)
        except BaseException:
            self.sup.cleanup()
            raise
        self._thread = threading.Thread(target=self._supervise, name="stoker-producers", daemon=True)
        self._thread.start()

    def connect(self, endpoints: Sequence[str]) -> None:
        """The trainers' endpoints, for producers started before they were bound."""
        with self._lock:
            self._connect(endpoints)

    def _connect(self, endpoints: Sequence[str]) -> None:
        self.sup.connect(self.producers, endpoints)
        self._connected = True
        if self.cfg.pipeline.producers_auto:
            self.auto = AutoControl(self.cfg, self.run_dir, self.sup, self.producers, endpoints, self.plan)

    def _supervise(self) -> None:
        while not self._closing.is_set():
            self.sup.poll_status(TICK_S)
            with self._lock:
                self.sup.supervise_producers(self.producers, self.cfg.pipeline.producer_restarts,
                                             keep_going=lambda: not self._closing.is_set())
                if self.auto is not None:
                    self.auto.step()

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=5.0)
        with self._lock:
            if not self._connected:  # no trainer was bound: they end at once
                self.sup.connect(self.producers, [])
                self._connected = True
        try:
            self.sup.wait(self.producers, PRODUCER_STOP_S)  # they were told STOP
            self.sup.terminate(self.producers, KILL_AFTER_S)
        finally:
            self.sup.cleanup()


class AutoControl:
    """Applies :class:`stoker.autoscale.AutoScaler` decisions to local producers."""

    def __init__(self, cfg: Config, run_dir: Path, sup: "Supervisor", producers: list[Child],
                 endpoints: Sequence[str], plan: DevicePlan) -> None:
        self.cfg, self.sup, self.producers, self.endpoints, self.plan = cfg, sup, producers, endpoints, plan
        self.host = socket.gethostname()
        self.scaler = AutoScaler(cfg.pipeline.max_producers or default_max_producers(), cfg.pipeline.buffer_size)
        self.window = LiveWindow(run_dir)
        self._psutil = psutil
        psutil.cpu_percent(interval=None)  # starts the CPU-busy measurement window
        self.next_decision = time.monotonic() + DECISION_INTERVAL_S
        self.last_count = len(producers)
        log.info("auto producers: starting with %d, at most %d", len(producers), self.scaler.max_producers)

    def active(self) -> list[Child]:
        return [p for p in self.producers if not p.done and p.proc is not None and p.proc.poll() is None
                and not p.retiring]

    def step(self) -> None:
        now = time.monotonic()
        if now < self.next_decision:
            return
        self.next_decision = now + DECISION_INTERVAL_S
        evidence = self.window.read(self._psutil.cpu_percent(interval=None) / 100)
        active = self.active()
        self.last_count = len(active)
        if evidence is None:
            return
        change = self.scaler.decide(len(active), evidence)
        for _ in range(max(change, 0)):
            index = len(self.producers)
            self.producers.append(self.sup.spawn(producer_child(
                index, self.endpoints, self.cfg.data.path, self.plan.data_gpu, self.plan.data_memory_mb,
                self.cfg.run.log_level, self.host, keys=self.cfg.pipeline.keys,
                metadata_file=self.cfg.data.metadata_file, local=True)))
        self.last_count += change
        if change < 0 and active:
            victim = active[-1]
            victim.retiring = True
            victim.proc.send_signal(signal.SIGTERM)  # it says BYE and returns its leases

    def record(self, summary_path: Path) -> None:
        try:
            summary = json.loads(summary_path.read_text())
        except (OSError, ValueError):
            return
        summary["autoscale"] = {"final_producers": self.last_count, "max_producers": self.scaler.max_producers,
                                "decisions": self.scaler.decisions}
        write_json(summary_path, summary)


def ensure_summary(cfg: Config, run_dir: Path, code: int, error: str, wall_s: float, reason: str = "") -> str:
    """Write summary.json from the run's own files if the consumer could not: the figures of
    metrics.jsonl, and the epochs of the latest checkpoint and the steps after it
    (:func:`recovered_epochs`). ``reason``: the exit reason when the caller knows it better
    than ``code`` tells (a child killed by a signal). The one line saying that it cannot be
    written either ("" when it is there)."""
    path = run_dir / SUMMARY
    if path.exists():
        return ""
    reason = reason or {EXIT_INTERRUPTED: "interrupted"}.get(
        code, f"failed: {error}" if error else f"consumer exit {code}")
    rows = read_jsonl(run_dir / METRICS)
    rejected = len(read_jsonl(run_dir / REJECTED))
    epochs = recovered_epochs(run_dir, rows)
    summary = summarize(rows, capacity=cfg.pipeline.buffer_size, batches_per_epoch=epochs["batches_per_epoch"],
                        producers=[], rejected=rejected, exit_reason=reason, wall_s=wall_s,
                        batch_size=cfg.batching.batch_size,
                        extra={"written_by": "launcher", "replicas": cfg.devices.replicas or 1,
                               "epochs_completed": epochs["epochs_completed"],
                               "checkpoint": {"latest_step": epochs["checkpoint_step"]}})
    try:
        write_json(path, summary)
    except RunFileError as exc:  # the consumer's error, if any, says what failed first
        log.warning("%s", exc)
        return f"{exc}; no summary.json" + (f" (the trainer: {error})" if error else "")
    log.warning("consumer wrote no summary; launcher wrote %s from metrics.jsonl and the checkpoints (%d steps, "
                "%d samples, %s epochs complete)", path, summary["steps"], summary["samples"],
                "?" if epochs["epochs_completed"] is None else epochs["epochs_completed"])
    return ""


def recovered_epochs(run_dir: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The epoch figures of a run whose consumer died: the epochs complete at its latest
    checkpoint (position.json), and any later one whose every planned sample a step of
    metrics.jsonl trained (a lower bound: samples rejected after the checkpoint are not
    counted). ``epochs_completed`` is None when there is no checkpoint (the plan's size is
    then unknown here)."""
    latest = Checkpointer(run_dir / CKPT_DIR, keep=1).latest()
    try:
        saved = json.loads((latest / POSITION).read_text(encoding="utf-8")) if latest is not None else None
        plan, position = saved["plan"], saved["position"]
        complete = set(range(int(position["complete_below"]))) | {int(e) for e in position["complete"]}
        per_epoch, step = int(plan["samples_per_epoch"]), int(saved["step"])
        batches = int(plan["batches_per_epoch"])
    except (OSError, ValueError, KeyError, TypeError):  # none, or unreadable: no plan figures
        return {"epochs_completed": None, "batches_per_epoch": 0, "checkpoint_step": None}
    trained: dict[int, int] = {}
    for row in rows:
        if isinstance(row.get("epoch"), int):
            trained[row["epoch"]] = trained.get(row["epoch"], 0) + int(row.get("samples", 0))
    complete |= {epoch for epoch, samples in trained.items() if per_epoch and samples >= per_epoch}
    return {"epochs_completed": len(complete), "batches_per_epoch": batches, "checkpoint_step": step}


def killed_reason(child: Child, signum: int, kernel_log: str | None = None,
                  oom_kills: Callable[[], int | None] | None = None) -> str:
    """The one line for a child killed by signal ``signum``, by the signal's name. A SIGKILL
    the launcher did not send is looked up in the kernel log: the out-of-memory killer's
    record of the child's pid names it. Without one, an out-of-memory kill counted in this
    process's cgroup since the child started (``oom_kills``: that count now) names it too;
    else, with the log readable, it came from someone else, and with the log unreadable
    (no privilege), the OOM killer is the likely sender, said as such."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    text = f"{child.name} killed by {name}"
    if signum != signal.SIGKILL:
        return text
    if child.killed:
        return f"{text} (by the launcher: it did not stop after SIGTERM)"
    pid = child.proc.pid if child.proc is not None else -1
    record = oom_record(pid, kernel_log or KERNEL_LOG)
    now = (oom_kills or cgroup_oom_kills)()
    if not record and child.oom_kills is not None and now is not None and now > child.oom_kills:
        return (f"{text}: the out-of-memory killer (this cgroup's oom_kill count went from {child.oom_kills} to "
                f"{now} while it ran); give it more memory or a smaller batch")
    if record is None:
        return (f"{text} from outside stoker: possibly the out-of-memory killer (the kernel log is not readable "
                f"here; dmesg on this host tells), or another process's kill -9")
    if record:
        return f"{text}: the kernel's out-of-memory killer ({record}); give it more memory or a smaller batch"
    return f"{text} from outside stoker (not the out-of-memory killer: the kernel log has no record of pid {pid})"


# The kernel's message buffer, one record per read (readable without CAP_SYSLOG unless
# kernel.dmesg_restrict is set); the out-of-memory killer logs the pid it kills there.
KERNEL_LOG = "/dev/kmsg"
_OOM_KILL = re.compile(r"(?:Killed process|oom-kill:.*\bpid=)\s*(\d+)")


# Where a cgroup counts its out-of-memory kills ("oom_kill N"): cgroup v2's memory.events,
# v1's memory.oom_control; each under this process's cgroup path, or at the root as a
# container sees its own cgroup.
CGROUP_FS = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


def cgroup_oom_kills(cgroup_fs: str = CGROUP_FS, proc_cgroup: str = PROC_CGROUP) -> int | None:
    """This process's cgroup's count of out-of-memory kills; None when no cgroup file says."""
    paths = {"": "", "memory": ""}  # controller ("" for v2) -> this process's path under it
    try:
        for line in Path(proc_cgroup).read_text(encoding="utf-8").splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers in paths:
                paths[controllers] = path.strip("/")
    except (OSError, ValueError):
        pass  # no cgroup paths: the root files below may still say
    root = Path(cgroup_fs)
    for candidate in (root / paths[""] / "memory.events", root / "memory.events",
                      root / "memory" / paths["memory"] / "memory.oom_control", root / "memory" / "memory.oom_control"):
        try:
            for line in candidate.read_text(encoding="utf-8").splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def oom_record(pid: int, kernel_log: str = KERNEL_LOG) -> str | None:
    """The kernel log's record of the out-of-memory killer killing ``pid`` ("" when the log
    has none; None when it cannot be read)."""
    try:
        fd = os.open(kernel_log, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    data = b""
    try:
        while True:
            try:
                chunk = os.read(fd, 8192)  # /dev/kmsg: one record a read; a file: a chunk
            except BlockingIOError:  # /dev/kmsg: no more records
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten while reading: go on with the rest
                    continue
                return None
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    found = ""
    for line in data.decode("utf-8", "replace").splitlines():
        match = _OOM_KILL.search(line)
        if match and int(match.group(1)) == pid:
            found = line.split(";", 1)[-1].strip()
    return found


def run_producers(endpoints: Sequence[str], data: str, count: int, plan: DevicePlan, restarts: int, log_level: str,
                  keys: str = "", host: str = "") -> int:
    """``run.py produce``: N producers on this host for the trainers at ``endpoints`` elsewhere
    (one, or the ranks of a job), until Ctrl-C or every trainer's STOP. Raises LaunchError with the reason when the producers were refused.
    ``host``: the name in the producers' ids (default: this host's name; ``stoker slurm``
    gives the Slurm node's)."""
    sup = Supervisor(plan, log_level)
    sup.install_signals()
    host = host or socket.gethostname()
    producers = [sup.spawn(producer_child(i, endpoints, data, plan.data_gpu, plan.data_memory_mb, log_level, host,
                                          keys=keys))
                 for i in range(count)]
    log.info("started %d producer(s) for %s", count, ", ".join(endpoints))
    try:
        while sup.signalled is None and not all(p.done for p in producers):
            sup.poll_status(TICK_S)
            sup.supervise_producers(producers, restarts, keep_going=lambda: sup.signalled is None,
                                    report_user_errors=False)
        sup.terminate(producers, PRODUCER_STOP_S)
    finally:
        sup.cleanup()
    refused = [p.last_error for p in producers if p.proc is not None and p.proc.returncode == EXIT_USER]
    if sup.signalled is not None:
        return EXIT_INTERRUPTED
    if refused:
        raise LaunchError("; ".join(dict.fromkeys(r or "a producer stopped with a user error" for r in refused)))
    failed = [p for p in producers if p.proc is not None and p.proc.returncode not in (0, -signal.SIGTERM)]
    return EXIT_FAILED if failed else EXIT_OK
