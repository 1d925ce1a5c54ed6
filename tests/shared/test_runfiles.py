"""shared/runfiles.py: whole-file writes and the run files' names."""

from __future__ import annotations

import json

import pytest

from stoker.shared import runfiles


def test_write_atomic_replaces_whole_and_leaves_no_temporary(tmp_path) -> None:
    target = tmp_path / "sub" / "live.json"
    runfiles.write_atomic(target, "first")
    runfiles.write_atomic(target, b"second", durable=True)
    assert target.read_bytes() == b"second"
    assert sorted(p.name for p in target.parent.iterdir()) == ["live.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch) -> None:
    target = tmp_path / "summary.json"
    runfiles.write_json(target, {"steps": 1})

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runfiles.os, "replace", broken)
    with pytest.raises(OSError, match="No space left"):
        runfiles.write_json(target, {"steps": 2})
    assert json.loads(target.read_text()) == {"steps": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_write_json_keeps_non_ascii_and_round_trips(tmp_path) -> None:
    obj = {"symbols": ["س", "ل", "ا", "م"], "n": 3}
    runfiles.write_json(tmp_path / "vocab.json", obj, indent=None)
    text = (tmp_path / "vocab.json").read_text(encoding="utf-8")
    assert "سلام" not in text and "س" in text and json.loads(text) == obj


def test_names_are_distinct() -> None:
    names = [runfiles.CONFIG, runfiles.SUMMARY, runfiles.METRICS, runfiles.SAMPLES, runfiles.REJECTED, runfiles.LIVE,
             runfiles.GPU, runfiles.VALIDATION, runfiles.VOCAB, runfiles.MEL_STATS, runfiles.TB_DIR,
             runfiles.CKPT_DIR]
    assert len(set(names)) == len(names)
