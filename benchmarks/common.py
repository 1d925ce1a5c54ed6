"""Helpers shared by the benchmark modules: statistics, machine facts, child processes.

Every figure is a ratio against a baseline measured in the same run (this machine is
small, shared and noisy), summarised as the median over repetitions with min and max.
A ratio is always stored with the two measured numbers it came from, so a reader can
recompute it: ``{"value": num / den, "numerator": num, "denominator": den}``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import queue as queue_mod
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy
import zmq

from ..shared.dataset.files import DEMO_DATA_DIR
from ..shared.proc import with_stoker_path

# The benchmarks run stoker as its users do, as programs: ``python -m stoker ...`` (the
# same as ``python run.py`` and the ``stoker`` command), with this stoker on PYTHONPATH.
STOKER = (sys.executable, "-m", "stoker")
DEMO_DATA = DEMO_DATA_DIR

# Children that do not stop on their own within this many seconds after their work is
# done are terminated (SIGTERM), then killed.
JOIN_TIMEOUT_S = 10.0
# A benchmark's training child (a whole run of stoker) that takes longer than this has hung.
CHILD_TIMEOUT_S = 400.0
# Steps/s of a training child is taken over the steps after these: the first executions of
# each bucket shape (0.9 s for the first step on 2 cores) would otherwise decide a short run's figure.
SETTLING_STEPS = 8
# A training child's environment over os.environ: TensorFlow's start-up chatter off, this stoker
# importable (the user's PYTHONPATH, with this stoker's directory only where a child needs it).
QUIET_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": with_stoker_path(os.environ).get("PYTHONPATH", "")}


class BenchError(RuntimeError):
    """A benchmark could not produce its numbers (a child failed, timed out, ...)."""


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of repeated measurements (and the values themselves)."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("no values")
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals),
            "values": [round(v, 6) for v in vals]}


def ratio(numerator: float, denominator: float, **extra: Any) -> dict[str, Any]:
    """A ratio with the two numbers it came from; both must be positive measurements."""
    if not (numerator > 0 and denominator > 0):
        raise BenchError(f"ratio of non-positive numbers {numerator!r} / {denominator!r}")
    return {"value": numerator / denominator, "numerator": numerator, "denominator": denominator, **extra}


def least_squares_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Slope of the least-squares line through (xs, ys)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("need at least two points")
    mx = sum(xs) / len(xs)
    my = sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("all x equal")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }
    try:
        info["usable_cores"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    info["zmq"] = zmq.zmq_version()
    info["pyzmq"] = zmq.__version__
    info["numpy"] = numpy.__version__
    return info


def spawn_context() -> Any:
    """Children are fresh interpreters (never forked), as the project requires."""
    return multiprocessing.get_context("spawn")


def collect(result_queue: Any, roles: Sequence[str], procs: Sequence[Any], timeout_s: float) -> dict[str, dict]:
    """Wait for one result dict per role from ``result_queue``; raise on error or timeout.

    A child posts ``{"role": ..., "ok": True, ...}`` or ``{"role": ..., "ok": False,
    "error": text}``. A child that dies without posting is noticed at once.
    """
    results: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(roles):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BenchError(f"timed out after {timeout_s:.0f} s waiting for {sorted(set(roles) - set(results))}")
        try:
            item = result_queue.get(timeout=min(0.5, remaining))
        except queue_mod.Empty:
            dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
            if dead:
                # a last look: the child may have posted its error just before exiting
                try:
                    item = result_queue.get(timeout=0.5)
                except queue_mod.Empty:
                    raise BenchError(f"child {dead[0].name} exited with status {dead[0].exitcode} "
                                     "without a result") from None
            else:
                continue
        if not item.get("ok"):
            raise BenchError(f"{item.get('role')} failed: {item.get('error')}")
        results[item["role"]] = item
    return results


def stop_children(procs: Sequence[Any], timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Join children with a timeout; terminate, then kill, whatever is still running."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        if p.pid is None:  # never started
            continue
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.pid is not None and p.is_alive():
            p.kill()
            p.join(2.0)


def close_queue(q: Any) -> None:
    try:
        q.close()
        q.cancel_join_thread()
    except (OSError, ValueError):
        pass


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain, left-aligned text table."""
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def targets_table(targets: Sequence[dict[str, Any]], value: str = ".4f", limit: str = "g") -> str:
    """A section's targets (``what``, ``value``, ``limit``, ``met``) as a table, the numbers in the
    given formats."""
    return table(["target", "value", "limit", "result"],
                 [[t["what"], format(t["value"], value), format(t["limit"], limit), "met" if t["met"] else "NOT met"]
                  for t in targets])


def run_alone(name: str, run: Any, render: Any, out: str | None) -> int:
    """``python -m stoker.benchmarks.NAME``: ``run(log)`` with its progress on stderr, then
    :func:`report`; a BenchError is one line and exit status 1."""
    try:
        result = run(lambda text: print(text, file=sys.stderr, flush=True))
    except BenchError as exc:
        print(f"{name} benchmark failed: {exc}", file=sys.stderr)
        return 1
    return report(render(result), result, out)


def report(text: str, result: Any, out: str | None) -> int:
    """A benchmark module's ending: its table on stdout, its figures as JSON in ``out`` (if
    given); exit status 0."""
    sys.stdout.write(text + "\n")
    if out:
        write_json(Path(out), result)
    return 0


def write_json(path: Path, result: Any) -> None:
    """``result`` as JSON in ``path``, whole or not at all (written beside it, then renamed):
    a benchmark killed at its deadline leaves the last figures it kept."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    os.replace(part, path)


def tree_command(module: str, spec: dict[str, Any], tree: Path) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of ``python -m MODULE child SPEC`` on ``tree``'s stoker."""
    return ([sys.executable, "-m", module, "child", json.dumps(spec)],
            {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(tree)})


def tree_child(module: str, spec: dict[str, Any], tree: Path, log_path: Path, result_prefix: str) -> dict[str, Any]:
    """``python -m MODULE child SPEC`` run on ``tree``'s stoker (another checkout, e.g. the commit
    before a change): the JSON after ``result_prefix`` on its stdout; its stderr in ``log_path``,
    whose tail a BenchError gives when it fails."""
    argv, env = tree_command(module, spec, tree)
    with open(log_path, "wb") as log_file:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=log_file, env=env, timeout=CHILD_TIMEOUT_S,
                              cwd=tree)
    lines = [line for line in done.stdout.decode("utf-8", "replace").splitlines() if line.startswith(result_prefix)]
    if done.returncode != 0 or not lines:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise BenchError(f"{spec['kind']} of {tree} exited with status {done.returncode}:\n{tail}")
    return json.loads(lines[-1][len(result_prefix):])
