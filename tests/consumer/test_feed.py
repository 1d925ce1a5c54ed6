"""consumer/feed.py without processes: what the feed core says of a run that trained nothing."""

from __future__ import annotations

import threading

from stoker.consumer.feed import FeedCore
from stoker.shared.config import Config
from stoker.shared.layouts import Rejection
from stoker.shared.metrics import JsonlWriter, read_jsonl


def test_a_run_whose_every_clip_was_rejected_ends_with_one_line_naming_the_reason(tmp_path) -> None:
    core = FeedCore(Config(), tmp_path, threading.Event())
    core.rejected = JsonlWriter(tmp_path / "rejected.jsonl")
    failing = "its batch's lease failed 4 times: its producer's connection closed while sending it"
    core._record_rejections([Rejection(f"c{i}", failing, "coordinator") for i in range(3)]
                            + [Rejection("c3", "decode error", "p0@vm")])
    core.rejected.close()
    assert core.nothing_trained() == ""  # the epochs are not over yet
    core.epochs_completed = 1
    line = core.nothing_trained()
    assert line == ("nothing could train: every clip was rejected (4, reasons in rejected.jsonl); 3 for: "
                    f"{failing}")
    assert [r["id"] for r in read_jsonl(tmp_path / "rejected.jsonl")] == ["c0", "c1", "c2", "c3"]
    core.step = 1
    assert core.nothing_trained() == ""  # a run that trained something completed
