"""End-to-end: a dataset holding every fault, and the caches across runs (real processes)."""

from __future__ import annotations

import collections
import json

import pytest

from tests.factories import make_dataset, make_faulty_dataset
from tests.procs import read_json, read_jsonl, run_cli
from tests.trained import check_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

FAST = ["--model", "synthetic:1", "--model-start-delay", "0.2", "--set", "features.backend=numpy"]


def test_every_fault_is_rejected_with_its_reason_and_every_valid_clip_trained_once_per_epoch(tmp_path):
    faulty = make_faulty_dataset(tmp_path / "data")
    run_dir = tmp_path / "run"
    result = run_cli("--data", str(faulty.root), "--epochs", "2", "--batch-size", "4", "--producers", "2",
                     "--record-samples", "--run-dir", str(run_dir), "--set", f"data.max_audio_s={faulty.max_audio_s}",
                     *FAST)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    rows = read_jsonl(run_dir / "rejected.jsonl")
    by_id = collections.defaultdict(list)
    for row in rows:
        by_id[row["id"]].append(row)
    for sample_id, reason in faulty.index_rejections:
        assert reason in [r["reason"] for r in by_id[sample_id]], (sample_id, by_id[sample_id])
    for sample_id, start, end in faulty.loose_rejections:
        (row,) = by_id[sample_id]
        assert row["reason"].startswith(start) and row["reason"].endswith(end)
    for sample_id, start in faulty.producer_rejections.items():
        (row,) = by_id[sample_id]  # once, although both epochs tried it
        assert row["reason"].startswith(start) and row["producer"].startswith("p")
    index_rows = [r for r in rows if r["producer"] == "index"]
    assert all("line" in r for r in index_rows)
    assert len(rows) == len(faulty.index_rejections) + len(faulty.loose_rejections) + len(faulty.producer_rejections)
    summary = read_json(run_dir / "summary.json")
    assert summary["rejected"] == len(rows)
    assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == 2
    check_run(run_dir, 2, set(faulty.valid))
    assert summary["index"]["cache"] == "miss"


def test_precompute_then_train_reads_every_clip_and_a_corrupt_entry_is_recomputed(tmp_path):
    faulty = make_faulty_dataset(tmp_path / "data")
    cache = tmp_path / "features"
    common = ["--data", str(faulty.root), "--set", f"data.max_audio_s={faulty.max_audio_s}",
              "--set", f"data.feature_cache={cache}", "--set", "features.backend=numpy"]
    first = run_cli("precompute", "--producers", "2", "--batch-size", "4", "--run-dir", str(tmp_path / "pre"),
                    *common)
    assert first.returncode == 0, first.stderr[-3000:]
    valid = len(faulty.valid)
    assert f"precompute done: {valid} clips" in first.stdout
    assert f"{valid} computed, 0 already cached" in first.stdout
    pre = read_json(tmp_path / "pre" / "summary.json")
    assert pre["feature_cache"]["computed"] == valid and len(pre["producers"]) == 2
    assert pre["index"]["cache"] == "miss"
    (entries_dir,) = [p for p in cache.iterdir() if p.is_dir()]
    assert len(list(entries_dir.glob("*.mel"))) == valid

    entry = entries_dir / f"{faulty.valid[3]}.mel"
    blob = bytearray(entry.read_bytes())
    blob[-1] ^= 0x5A
    entry.write_bytes(bytes(blob))
    run_dir = tmp_path / "train"
    train = run_cli("--epochs", "2", "--batch-size", "4", "--producers", "2", "--record-samples",
                    "--run-dir", str(run_dir), "--model", "synthetic:1", "--model-start-delay", "0.2", *common)
    assert train.returncode == 0, train.stderr[-3000:]
    summary = read_json(run_dir / "summary.json")
    assert summary["index"]["cache"] == "hit" and summary["index"]["headers_read"] == 0
    fc = summary["feature_cache"]
    # Epochs overlap across producers (leases run ahead), so the second epoch's read of the
    # damaged entry may come before the first epoch's rewrite: then it is found corrupt twice.
    assert fc["dir"] == str(cache) and fc["stale"] == 0 and fc["corrupt"] in (1, 2)
    assert fc["computed"] == fc["corrupt"] and fc["hits"] + fc["computed"] == 2 * valid
    check_run(run_dir, 2, set(faulty.valid))


def test_precompute_user_errors_are_one_line(tmp_path):
    result = run_cli("precompute", "--producers", "0", "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "stoker: error: pipeline.producers (--producers): precompute needs at least one local producer, got 0")
    result = run_cli("precompute", "--data", str(tmp_path / "nope"))
    assert result.returncode == 2 and "does not exist" in result.stderr.strip().splitlines()[-1]


def test_a_manifest_with_durations_trains_from_them_and_a_wrong_one_is_rejected_once(tmp_path):
    root = tmp_path / "data"
    ids = make_dataset(root, count=8, durations=[0.8] * 8)
    rows = [{"audio_filepath": f"wavs/{i}.wav", "text": f"clip {i}", "duration": 0.8} for i in ids]
    rows[3]["duration"] = 1.6  # the manifest is wrong about this one
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    run_dir = tmp_path / "run"
    result = run_cli("--data", str(root), "--set", "data.metadata_file=train.jsonl", "--epochs", "2",
                     "--batch-size", "4", "--producers", "2", "--record-samples", "--run-dir", str(run_dir), *FAST)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = read_jsonl(run_dir / "rejected.jsonl")  # once, although both epochs read it
    assert row["id"] == ids[3] and row["producer"].startswith("p")
    assert row["reason"].startswith("audio of 0.800 s where the index says 1.600 s")
    summary = read_json(run_dir / "summary.json")
    assert summary["rejected"] == 1 and summary["index"]["headers_read"] == 0
    check_run(run_dir, 2, set(ids) - {ids[3]})
