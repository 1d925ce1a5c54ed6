"""The step logs of an open run: metrics.jsonl, samples.jsonl, trained.jsonl, validation_samples.jsonl.

A confirmed step's row waits here with its loss handle until the end of its logging interval,
when the interval's losses are fetched at once (the one device sync) by the loop's resolver
and the rows written (consumer/feed/feed.py says what the row's figures measure).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from ...shared.metrics import JsonlWriter
from ...shared.runfiles import METRICS, SAMPLES, TRAINED, VALIDATION_SAMPLES

log = logging.getLogger("consumer")


@dataclasses.dataclass
class Resolved:
    """What a resolver makes of an interval's loss handles: a loss per step, and optionally
    each step's named terms."""

    losses: list[float | None]
    terms: Sequence[dict[str, float] | None] | None = None


def resolve_floats(handles: Sequence[Any]) -> Resolved:
    """The default resolver: each handle a number (a float, a NumPy or TensorFlow scalar),
    or a dict with ``loss`` and named terms, or None."""
    losses: list[float | None] = []
    terms: list[dict[str, float] | None] = []
    for handle in handles:
        named: dict[str, float] | None = None
        if isinstance(handle, dict):
            named = {str(k): float(v) for k, v in handle.items() if k != "loss" and v is not None}
            handle = handle.get("loss")
        losses.append(None if handle is None else float(handle))
        terms.append(named or None)
    return Resolved(losses, terms)


class StepLog:
    """The run's step logs (module docstring); samples and validation samples with
    ``record_samples``, trained.jsonl from the first step a trainer notes."""

    def __init__(self, run_dir: Path, record_samples: bool) -> None:
        self.run_dir = run_dir
        self.metrics = JsonlWriter(run_dir / METRICS)
        self.samples = JsonlWriter(run_dir / SAMPLES) if record_samples else None
        self.trained: JsonlWriter | None = None
        self.validation = JsonlWriter(run_dir / VALIDATION_SAMPLES) if record_samples else None
        self.last_loss: float | None = None
        self._pending: list[tuple[dict[str, Any], Any]] = []  # rows whose loss is not fetched yet
        self._lock = threading.Lock()
        # One interval's rows written at a time: Keras may confirm steps (and flush) from threads of its own.
        self._flushing = threading.Lock()

    def add(self, row: dict[str, Any], handle: Any, ids: list[str]) -> None:
        """A confirmed step's row, written when its loss is (:meth:`flush`); its ids to samples.jsonl now."""
        if self.samples is not None:
            self.samples.write({"step": row["step"], "epoch": row["epoch"], "ids": ids})
        with self._lock:
            self._pending.append((row, handle))

    def note_trained(self, step: int, epoch: int, rows: list[dict[str, Any]]) -> None:
        """What the step received, as its trainer noted it (trained.jsonl)."""
        if self.trained is None:
            self.trained = JsonlWriter(self.run_dir / TRAINED)
        self.trained.write({"step": step, "epoch": epoch, "rows": rows})

    def flush(self, resolve: Callable[[Sequence[Any]], Resolved], check: bool) -> list[dict[str, Any]]:
        """The interval's losses fetched at once and its rows written; the rows. ``check=False``:
        a failing run keeps its rows without losses when they cannot be fetched."""
        with self._flushing:
            with self._lock:
                pending, self._pending = self._pending, []
            if not pending:
                return []
            try:
                resolved = resolve([handle for _, handle in pending])
            except Exception as exc:  # already failing (check=False): keep the rows, without losses
                if check:
                    raise
                log.warning("losses of the last %d steps unavailable: %s", len(pending), exc)
                resolved = Resolved([None] * len(pending))
            terms = resolved.terms or [None] * len(pending)
            rows = []
            for (row, _), loss, named in zip(pending, resolved.losses, terms):
                row["loss"] = loss if loss is None or math.isfinite(loss) else None
                if named:  # each term of the loss (a mean), as the step computed it: metrics.jsonl "terms"
                    row["terms"] = {k: round(v, 6) if math.isfinite(v) else None for k, v in named.items()}
                self.metrics.write(row)
                rows.append(row)
            finite = [r["loss"] for r in rows if r["loss"] is not None]
            if finite:
                self.last_loss = finite[-1]
            return rows

    def flush_files(self) -> None:
        """Every row so far on disk (before a checkpoint counts them)."""
        self.metrics.flush()
        for log_file in (self.samples, self.trained):
            if log_file is not None:
                log_file.flush()

    def writers(self) -> list[JsonlWriter]:
        return [w for w in (self.metrics, self.samples, self.trained, self.validation) if w is not None]


def live_text(step: int, expected: int | None, last_loss: float | None, window: dict[str, Any], capacity: int) -> str:
    """The live line of progress (consumer/feed/progress.py) from the telemetry's window."""
    total = f"/{expected}" if expected else ""
    loss = f"  loss {last_loss:.4f}" if last_loss is not None else ""
    wait = window["wait_frac"]
    return (f"step {step}{total}{loss}  {window['samples_per_s'] or 0:.1f} samples/s  "
            f"queue {window['queue_depth_mean'] or 0:.1f}/{capacity}  wait {100 * (wait or 0):.1f}%")


def progress_line(step: int, expected: int | None, loss: float | None, recent: list[dict[str, Any]], capacity: int,
                  alive: int) -> str:
    """The log line at the end of a logging interval, from its ``recent`` rows."""
    wait = sum(r["wait_ms"] for r in recent)
    busy = wait + sum(r["step_ms"] for r in recent)
    samples = sum(r["samples"] for r in recent)
    depth = sum(r["queue_depth"] for r in recent) / len(recent)
    loss_text = f"loss {loss:.4f}  " if loss is not None else ""
    return (f"step {step}{f'/{expected}' if expected else ''}  {loss_text}"
            f"{samples / (busy / 1000) if busy else 0.0:.1f} samples/s  queue {depth:.1f}/{capacity}  "
            f"wait {100 * wait / busy if busy else 0.0:.1f}%  producers {alive}")


__all__ = ["Resolved", "StepLog", "live_text", "progress_line", "resolve_floats"]
