"""consumer/feed/feed.py on a small dataset, without producers: what the feed core says of
a run that trained nothing."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from stoker.consumer.feed.feed import FeedCore, PreparedRun
from stoker.shared.config import Config
from stoker.shared.dataset.layouts import Rejection
from stoker.shared.metrics import read_jsonl
from tests.factories import make_dataset

pytestmark = pytest.mark.timeout(60)


def test_a_run_whose_every_clip_was_rejected_ends_with_one_line_naming_the_reason(tmp_path) -> None:
    make_dataset(tmp_path / "data", count=4)
    cfg = Config()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(tmp_path / "data")),
                              pipeline=dataclasses.replace(cfg.pipeline, bind="tcp://127.0.0.1:*"))
    core = FeedCore(PreparedRun(cfg, tmp_path / "run"), threading.Event())
    try:
        failing = "its batch's lease failed 4 times: its producer's connection closed while sending it"
        core._record_rejections([Rejection(f"c{i}", failing, "coordinator") for i in range(3)]
                                + [Rejection("c3", "decode error", "p0@vm")])
        assert core.nothing_trained() == ""  # the epochs are not over yet
        core.epochs_completed = 1
        assert core.nothing_trained() == ("nothing could train: every clip was rejected (4, reasons in "
                                          f"rejected.jsonl); 3 for: {failing}")
        core.step = 1
        assert core.nothing_trained() == ""  # a run that trained something completed
    finally:
        core.close()
    assert [r["id"] for r in read_jsonl(tmp_path / "run" / "rejected.jsonl")] == ["c0", "c1", "c2", "c3"]


@pytest.mark.parametrize("steady", [True, False])
def test_the_trainer_process_keeps_its_heap_steady_unless_configured_not_to(tmp_path, monkeypatch,
                                                                           steady: bool) -> None:
    import stoker.consumer.feed.feed as feed_module

    calls: list[bool] = []
    monkeypatch.setattr(feed_module, "steady_heap", lambda: calls.append(True) or True)
    make_dataset(tmp_path / "data", count=4)
    cfg = Config()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(tmp_path / "data")),
                              pipeline=dataclasses.replace(cfg.pipeline, bind="tcp://127.0.0.1:*"),
                              trainer=dataclasses.replace(cfg.trainer, steady_heap=steady))
    core = FeedCore(PreparedRun(cfg, tmp_path / "run"), threading.Event())
    core.close()
    assert calls == ([True] if steady else [])
