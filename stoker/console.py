"""The command line's output: results for the user on stdout (logs go to stderr), and the
lines that close a run (``python run.py``, ``precompute``, a Slurm job's trainer task)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .shared.metrics import HOST_CPU_LIMIT
from .shared.runfiles import REJECTED, SUMMARY


def out(text: str = "") -> None:
    """A line for the user on stdout."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def print_precompute_summary(run_dir: Path, cache_dir: str) -> None:
    try:
        s = json.loads((run_dir / SUMMARY).read_text())
    except (OSError, ValueError):
        out(f"no summary in {run_dir}")
        return
    cache = s.get("feature_cache") or {}
    clips = s.get("samples", 0)
    wall = s.get("wall_s") or 0.0
    rate = clips / wall if wall > 0 else 0.0
    complete = (s.get("epochs_completed") or 0) >= 1
    out(f"precompute {'done' if complete else 'INCOMPLETE (' + str(s.get('exit_reason')) + ')'}: {clips} clips in "
        f"{wall:.1f} s ({rate:.1f} clips/s, {len(s.get('producers') or [])} producers): "
        f"{cache.get('computed', 0)} computed, {cache.get('hits', 0)} already cached, "
        f"{cache.get('corrupt', 0)} corrupt entries recomputed, {s.get('rejected', 0)} clips rejected "
        f"(see {run_dir / REJECTED})")
    out(f"  feature cache {cache_dir}; train with --set data.feature_cache={cache_dir}")


def print_summary(run_dir: Path) -> None:
    try:
        s = json.loads((run_dir / SUMMARY).read_text())
    except (OSError, ValueError):
        out(f"no summary in {run_dir}")
        return
    loss = ""
    if s.get("loss_first") is not None:
        loss = f"  loss {s['loss_first']:.4f} -> {s['loss_last']:.4f}"
    wait = s.get("data_wait_frac")
    out(f"stoker run {run_dir}: {s['exit_reason']}")
    epochs = s.get("epochs_completed", 0)
    out(f"  {s['steps']} steps, {s['samples']} samples, {'?' if epochs is None else epochs} epochs in "
        f"{s['wall_s']:.1f} s; {s['steps_per_s']:.2f} steps/s, {s['samples_per_s']:.1f} samples/s{loss}")
    out(f"  trainer waited for data {100 * (wait or 0):.1f}% of its time; queue depth mean "
        f"{s.get('queue_depth_mean') or 0:.2f} of {s.get('capacity')}; {s['starved_steps']} starved steps; "
        f"{s['rejected']} samples rejected")
    out(f"  verdict: {s['verdict']}; recommended producers: {s['recommended_producers']}")
    host = s.get("host_cpu") or {}
    if s.get("limit") == HOST_CPU_LIMIT:
        out(f"  the host's CPU is the limit: its {host.get('cores')} cores were {100 * host['busy_frac']:.0f}% busy "
            f"with the trainer and {host.get('local_producers')} producers; more producers here cannot help: run "
            f"them on another host (python run.py produce --connect ...) or use the data GPU (--data-gpu N)")
