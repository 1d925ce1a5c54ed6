"""``python run.py watch RUN_DIR``: the live state of a running trainer, once a second.

Reads ``live.json`` (consumer/feed/telemetry.py), which the consumer rewrites every second,
and prints one line per refresh: step, queue depth, wait share, samples/s, producers
alive. On a terminal the line is redrawn in place; otherwise (a log file) one line is
written per refresh. It ends when the run's summary.json appears, with the verdict.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any, Callable, TextIO

from .shared.runfiles import LIVE, SUMMARY

# Refresh period: live.json itself changes once a second.
REFRESH_S = 1.0


def read_live(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / LIVE).read_text())
    except (OSError, ValueError):
        return None  # not written yet, or replaced while we read: next refresh


def format_live(live: dict[str, Any]) -> str:
    w = live.get("window", {})
    step, total = live.get("step"), live.get("total_steps")
    if step is None:
        return f"waiting for the first batches; producers alive {live.get('producers_alive', 0)}"
    parts = [f"step {step}" + (f"/{total}" if total else ""),
             f"queue {live.get('queue_depth')}/{live.get('capacity')} (mean {w.get('queue_depth_mean')})"]
    if w.get("wait_frac") is not None:
        parts.append(f"wait {100 * w['wait_frac']:.1f}%")
        parts.append(f"{w.get('samples_per_s') or 0:.1f} samples/s")
    parts.append(f"producers alive {live.get('producers_alive', 0)}")
    return "  ".join(parts)


def watch(run_dir: Path, stream: TextIO = sys.stdout, stop: threading.Event | None = None,
          emit: Callable[[str], None] | None = None, max_refreshes: int | None = None) -> dict[str, Any] | None:
    """Show the live line until the run ends; return its summary (None if stopped first)."""
    stop = stop or threading.Event()
    tty = stream.isatty()
    refreshes = 0
    while not stop.is_set():
        summary_path = run_dir / SUMMARY
        if summary_path.exists():
            summary = json.loads(summary_path.read_text())
            if tty:
                stream.write("\n")
            return summary
        live = read_live(run_dir)
        line = format_live(live) if live else "waiting for the run to start"
        if emit is not None:
            emit(line)
        elif tty:
            stream.write("\r" + line.ljust(100))
            stream.flush()
        else:
            stream.write(line + "\n")
            stream.flush()
        refreshes += 1
        if max_refreshes is not None and refreshes >= max_refreshes:
            return None
        stop.wait(REFRESH_S)
    return None
