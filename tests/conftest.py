"""Session set-up shared by every test directory.

Model replicas on a host without GPUs are logical CPU devices, and TensorFlow can split
the CPU only before it sets up its devices. A test that trains replicas in this process
asks for the ``replica_devices`` fixture; when the session holds one, the CPU is split
into ``REPLICA_DEVICES`` logical devices right after collection, before any test runs
(a run without such a test never imports TensorFlow here). Tests of one device are
unaffected: they use the first.

No test may leave a process behind: ``no_leftover_processes`` checks every test.

The package and the tests' modules are compiled once, before any test: the suite starts about a
thousand Python processes, and where bytecode is not written (PYTHONDONTWRITEBYTECODE) each would
otherwise compile every stoker module it imports (the suite's own processes write theirs).

Every process of the session (pytest's, and all the processes its tests start, which inherit
the environment) runs OpenMP and the BLAS libraries on one thread: the suite runs two workers per
core, each with processes of its own, and a pool of threads per process, each spinning while it
waits for work, spends CPU the host does not have (on a busy 2-core host, a file computing with
PyTorch took three times the CPU-seconds, for the same results). A variable already set is kept.

pytest-xdist hands each worker a whole file at a time, in collection order: files are
collected longest first (each test's seconds from the last session that ran it, kept in
pytest's cache; a file no session here has timed, as in a fresh clone on CI, by its seconds in
FILE_SECONDS, which ``--write-file-seconds`` rewrites from a session's), so that no long file
starts last and keeps one worker busy alone.
"""

from __future__ import annotations

import collections
import compileall
import errno
import json
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import psutil
import pytest

REPLICA_DEVICES = 2  # the fewest that show replicas doing different work

# One thread for OpenMP (PyTorch's CPU ops) and the BLAS libraries (numpy's), in every process
# of the session: set before any of them is imported.
ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
for _name, _value in ONE_THREAD_ENV.items():
    os.environ.setdefault(_name, _value)


# Each test's seconds (set-up, call and teardown) of the last session that ran it, in pytest's
# cache; a test never timed counts UNTIMED_SLOW_S when marked slow (it starts processes or
# TensorFlow), nothing otherwise.
TEST_SECONDS = "stoker/test_seconds"
UNTIMED_SLOW_S = 10.0
_timed: dict[str, float] = {}
# Each file's seconds (its tests' set-up, call and teardown) in a whole suite's session, committed:
# the order of a session without pytest's cache, which a file's tests timed in the cache override.
FILE_SECONDS = Path(__file__).resolve().parent / "file_seconds.json"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--write-file-seconds", action="store_true",
                     help=f"write each file's seconds of this session into {FILE_SECONDS.name} (run the whole suite)")


def _file_seconds() -> dict[str, float]:
    try:
        return json.loads(FILE_SECONDS.read_text())
    except FileNotFoundError:
        return {}


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _test_seconds(config: pytest.Config) -> dict[str, float]:
    """The cached seconds; a worker has them from the controller, so that every worker
    collects the same order (xdist requires it) whatever another session writes meanwhile."""
    worker_input = getattr(config, "workerinput", None)
    if worker_input is not None:
        return worker_input.get(TEST_SECONDS, {})
    cache = getattr(config, "cache", None)
    return cache.get(TEST_SECONDS, {}) if cache is not None else {}


# The folders of the checkout whose modules the suite's processes import (stoker/'s links to the
# layers are not followed: the layers are compiled where they live, which is where they are cached).
COMPILED = ("stoker", "shared", "producer", "consumer", "benchmarks", "tests", "docs/examples")


def pytest_configure(config: pytest.Config) -> None:
    """The controller (or a session without workers) compiles the checkout's modules, once; every
    pytest process keeps the test modules as its assertion rewriting made them (each worker would
    otherwise rewrite them all again)."""
    sys.dont_write_bytecode = False
    if hasattr(config, "workerinput"):
        return
    for folder in COMPILED:
        if (config.rootpath / folder).is_dir():
            compileall.compile_dir(config.rootpath / folder, quiet=2)


# pytest-xdist workers per core for ``-n auto``: most of the suite's time is spent waiting on the
# processes a test starts (runs, producers, servers), which leaves a core to another worker.
WORKERS_PER_CORE = 2


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: WORKERS_PER_CORE workers per core this process may use."""
    return WORKERS_PER_CORE * len(psutil.Process().cpu_affinity() or [None])


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """xdist's controller, per worker: the cached seconds go with the worker's input."""
    node.workerinput[TEST_SECONDS] = _test_seconds(node.config)


def _longest_files_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    seconds = _test_seconds(config)
    committed = _file_seconds()
    per_file: dict[str, float] = collections.defaultdict(float)
    timed: set[str] = set()
    for item in items:
        name = _file_of(item.nodeid)
        untimed = UNTIMED_SLOW_S if item.get_closest_marker("slow") else 0.0
        per_file[name] += seconds.get(item.nodeid, untimed)
        if item.nodeid in seconds:
            timed.add(name)
    for name in per_file.keys() - timed:
        per_file[name] = committed.get(name, per_file[name])
    items.sort(key=lambda item: -per_file[_file_of(item.nodeid)])  # stable: each file's own order kept


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _timed[report.nodeid] = _timed.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The controller (or a session without workers) keeps the seconds of the tests it ran,
    beside those of earlier sessions whose files still exist; with ``--write-file-seconds``, each
    file's in FILE_SECONDS."""
    config = session.config
    if hasattr(config, "workerinput") or not _timed:
        return
    if config.getoption("write_file_seconds"):
        per_file: dict[str, float] = collections.defaultdict(float)
        for nodeid, s in _timed.items():
            per_file[_file_of(nodeid)] += s
        ordered = {name: round(s, 1) for name, s in sorted(per_file.items(), key=lambda kv: -kv[1])}
        FILE_SECONDS.write_text(json.dumps(ordered, indent=0) + "\n")
    cache = getattr(config, "cache", None)
    if cache is None:
        return
    kept = {nodeid: s for nodeid, s in cache.get(TEST_SECONDS, {}).items()
            if (config.rootpath / _file_of(nodeid)).exists()}
    kept.update({nodeid: round(s, 2) for nodeid, s in _timed.items()})
    cache.set(TEST_SECONDS, kept)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # xdist hands files out in its workers' order; a plain session keeps its own
        _longest_files_first(config, items)
    if any("replica_devices" in getattr(item, "fixturenames", ()) for item in items):
        from stoker.shared.tfsetup import split_cpu

        split_cpu(REPLICA_DEVICES)


@pytest.fixture
def replica_devices() -> list[str]:
    """The logical CPU devices of this test process, one per model replica."""
    from stoker.shared.tfsetup import split_cpu

    return split_cpu(REPLICA_DEVICES)


# A test's processes may still be exiting when it ends: this long, and they count as left behind.
LEFTOVER_GRACE_S = 10.0


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` that still run (an exited one not yet reaped is a zombie: it runs nothing)."""
    running = []
    for proc in procs:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                running.append(proc)
        except psutil.NoSuchProcess:
            pass
    return running


def _described(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid}: {' '.join(proc.cmdline())[:300]}"
    except psutil.Error:
        return f"pid {proc.pid}"


def _process_helpers() -> set[int]:
    """multiprocessing's resource tracker and fork server: one each per process, started by the
    first test that needs them and living as long as this process, not a test's to stop."""
    return {pid for pid in (getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None),
                            getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)) if pid}


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    """Fail a test that leaves a process behind: after it (and its fixtures' clean-up), the
    descendants of this process that it started and that still run after LEFTOVER_GRACE_S are
    killed, so the next test starts clean, and named. Processes that ran before it (pytest-xdist's,
    those of module and session fixtures) are not its."""
    me = psutil.Process()
    before = set(me.children(recursive=True))
    yield
    multiprocessing.active_children()  # reaps multiprocessing's finished children
    helpers = _process_helpers()
    started = _running([p for p in me.children(recursive=True) if p not in before and p.pid not in helpers])
    psutil.wait_procs(started, timeout=LEFTOVER_GRACE_S)
    leftover = _running(started)
    if not leftover:
        return
    named = [_described(p) for p in leftover]
    for proc in leftover:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(leftover, timeout=LEFTOVER_GRACE_S)
    pytest.fail(f"the test left {len(named)} process(es) running (killed now):\n" + "\n".join(named), pytrace=False)


# The disk-full tests' filesystem: room for a short run's files and a few checkpoints.
SMALL_DISK = "2m"


class SmallDisk:
    """A tmpfs of SMALL_DISK mounted at ``path``; :meth:`fill` takes every free byte."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.filler = path / "filler"

    def fill(self) -> None:
        """Write the filler until the filesystem is full (ENOSPC); :meth:`free` gives it back."""
        chunk = b"\0" * 4096
        with open(self.filler, "ab", buffering=0) as f:
            while True:
                try:
                    f.write(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        with open(self.filler, "ab", buffering=0) as f:  # the last partial page, too
            for _ in range(4096):
                try:
                    f.write(b"\0")
                except OSError:
                    break

    def free(self) -> None:
        self.filler.unlink()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    """A small filesystem of its own (tmpfs, mounted as root), for disk-full tests; the test is
    skipped, with the reason, where mounting is not permitted."""
    path = tmp_path / "disk"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK}", "tmpfs", str(path)],
                             capture_output=True, text=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"a small tmpfs cannot be mounted here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield SmallDisk(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


# The gpu marker: a test that needs an NVIDIA GPU (real NVML, CUDA in a child process) runs
# only where NVML sees one (tests/gpu.sh runs them on a GPU host) and is skipped elsewhere,
# saying why. NVML is asked once per session, and only when such a test is about to run.
NVIDIA_GPU_ABSENT = pytest.StashKey[str]()


def nvidia_gpu_absent() -> str:
    """Why no NVIDIA GPU can be used here; "" when NVML sees at least one."""
    try:
        import pynvml  # nvidia-ml-py: the gpu extra, or the GPU host's own
    except ImportError:
        return "no NVIDIA GPU visible: nvidia-ml-py (pynvml) is not installed"
    try:
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        return f"no NVIDIA GPU visible: NVML cannot be used ({exc})"
    return "" if count else "no NVIDIA GPU visible: NVML finds no device"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test marked gpu, with the reason, where no NVIDIA GPU is visible."""
    if item.get_closest_marker("gpu") is None:
        return
    if NVIDIA_GPU_ABSENT not in item.config.stash:
        item.config.stash[NVIDIA_GPU_ABSENT] = nvidia_gpu_absent()
    reason = item.config.stash[NVIDIA_GPU_ABSENT]
    if reason:
        pytest.skip(reason)
