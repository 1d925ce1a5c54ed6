"""A warm start looks at no audio file: a clip's file changed or deleted since the index was built
is found when a producer reads it (real processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.consumer.index.index import build_index
from tests.factories import add_clip, make_dataset
from tests.procs import read_json, read_jsonl, run_cli
from tests.trained import check_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

FAST = ["--model", "synthetic:1", "--model-start-delay", "0.2", "--set", "features.backend=numpy"]


def test_a_file_changed_or_deleted_since_indexing_is_rejected_when_read_and_the_rest_trains_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the index cache warm, a clip rewritten with another length under its name and one
    deleted are each a counted rejection naming the file (never trained with the index's stale
    length, never a crash); every other clip trains once per epoch."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    root = tmp_path / "data"
    ids = make_dataset(root, count=12)
    build_index(DataConfig(path=str(root)), FeaturesConfig())  # the cache the run finds warm
    changed, deleted = ids[3], ids[5]
    before = (root / "wavs" / f"{changed}.wav").stat().st_size
    after = add_clip(root, changed, 2.0, metadata=False).stat().st_size  # same name, another length
    (root / "wavs" / f"{deleted}.wav").unlink()
    run_dir = tmp_path / "run"
    result = run_cli("--data", str(root), "--epochs", "2", "--batch-size", "4", "--producers", "2",
                     "--record-samples", "--run-dir", str(run_dir), *FAST)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    summary = read_json(run_dir / "summary.json")
    assert summary["index"]["cache"] == "hit" and summary["index"]["headers_read"] == 0
    rows = {row["id"]: row for row in read_jsonl(run_dir / "rejected.jsonl")}
    assert sorted(rows) == sorted([changed, deleted]) and summary["rejected"] == 2  # each once, both epochs tried it
    assert rows[changed]["reason"] == (f"wavs/{changed}.wav changed since the index was built "
                                       f"(size {before} -> {after})")
    assert rows[deleted]["reason"] == f"audio file missing: wavs/{deleted}.wav (deleted since the index was built)"
    assert all(row["producer"].startswith("p") for row in rows.values())
    assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == 2
    check_run(run_dir, 2, set(ids) - {changed, deleted})
