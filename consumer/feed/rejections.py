"""rejected.jsonl of an open run, and what its rejections say of a run that trains nothing.

Each rejected clip is written once (a clip a producer cannot read fails again every epoch; a
resumed run keeps the rows of the sessions before). The reasons are counted, so that a run
in which every clip failed the same user transform, or was rejected, ends with one line
naming it (consumer/feed/feed.py asks while it waits, and at the end).
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

from ...shared.dataset.layouts import Rejection
from ...shared.metrics import JsonlWriter, read_jsonl
from ...shared.runfiles import REJECTED

# A rejection's reason as counted for the one line of a run that trained nothing.
REASON_CHARS = 300
# The start of a rejection reason naming the user transform (or declared field) that failed it.
TRANSFORM_FAILURE = re.compile(r"(?:transform|producer model) (field \S+|[\w.]+:\w+)")


class RejectionLog:
    """The run's rejected.jsonl (opened by :meth:`open`) and its counts (module docstring)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / REJECTED
        self.count = 0
        self.writer: JsonlWriter | None = None
        self._before: set[tuple[str, str]] = set()  # rows a resumed run's rejected.jsonl holds
        self._by_producer: set[str] = set()  # clips a producer (or the coordinator) rejected
        self._transforms: collections.Counter[str] = collections.Counter()  # "transform X" or ""
        self._reasons: collections.Counter[str] = collections.Counter()  # why producers (or leases) rejected clips

    def keep_before(self) -> None:
        """A resumed run: the rows written before count, and are not written again."""
        self._before = {(str(r.get("id")), str(r.get("reason"))) for r in read_jsonl(self.path)}
        self._by_producer = {i for i, _ in self._before}
        self.count = len(self._before)

    def open(self) -> None:
        self.writer = JsonlWriter(self.path)

    def record(self, rejections: list[Rejection]) -> None:
        """Write each rejected clip once."""
        assert self.writer is not None
        for r in rejections:
            if (r.id, r.reason) in self._before:
                continue
            if r.producer != "index":
                if r.id in self._by_producer:
                    continue
                self._by_producer.add(r.id)
                self._reasons[r.reason[:REASON_CHARS]] += 1
                failed = TRANSFORM_FAILURE.match(r.reason)  # which transform (or declared field) failed
                self._transforms[failed.group(0) if failed else ""] += 1
            self.writer.write(r.to_json())
            self.count += 1

    def flush(self) -> None:
        """The rows written so far on disk: the index's rejections are there once the run is open."""
        assert self.writer is not None
        self.writer.flush()

    def all_failed_one_transform(self, step: int, at_least: int = 1) -> str:
        """The one line when no clip trained (``step`` 0) and every clip a producer rejected (at
        least ``at_least``) failed the same user transform ("" otherwise)."""
        if step or len(self._transforms) != 1:
            return ""
        (family, count), = self._transforms.items()
        if not family or count < at_least:
            return ""
        fix = ("the model or take it out of transforms.models" if family.startswith("producer model")
               else "the transform or take it out of transforms.user")
        return f"every clip failed {family} ({count} rejected, reasons in rejected.jsonl): fix {fix}"

    def nothing_trained(self, step: int, epochs_completed: int) -> str:
        """The one line when the planned epochs ended with no step trained because every clip
        was rejected while the run went on ("" otherwise): the most common reason."""
        if step or not epochs_completed or not self._reasons:
            return ""
        reason, count = self._reasons.most_common(1)[0]
        return (f"nothing could train: every clip was rejected ({sum(self._reasons.values())}, reasons in "
                f"rejected.jsonl); {count} for: {reason}")


__all__ = ["RejectionLog"]
