"""shared/runfiles.py: whole-file writes and the run files' names."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from stoker.shared import runfiles
from stoker.shared.metrics import JsonlWriter


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


def test_a_writer_that_fails_in_replacing_keeps_the_old_file(tmp_path) -> None:
    target = tmp_path / "events.out.tfevents.1"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="torn"):
        with runfiles.replacing(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("torn")
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == [target.name]
    with runfiles.replacing(target, durable=True) as tmp:
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == [target.name]


def test_names_are_distinct() -> None:
    names = [runfiles.CONFIG, runfiles.RESUME_CONFIG, runfiles.SUMMARY, runfiles.METRICS, runfiles.SAMPLES,
             runfiles.REJECTED, runfiles.LIVE, runfiles.GPU, runfiles.VALIDATION, runfiles.VOCAB, runfiles.MEL_STATS,
             runfiles.TB_DIR, runfiles.CKPT_DIR, runfiles.HANDOVER_DIR, runfiles.LISTENING]
    assert len(set(names)) == len(names)
    assert len(set(runfiles.RUN_FILES)) == len(runfiles.RUN_FILES)


def test_a_run_that_trained_no_step_is_cleared_and_one_that_trained_is_not(tmp_path) -> None:
    run = tmp_path / "run"
    (run / runfiles.TB_DIR / "events").mkdir(parents=True)
    for name in (runfiles.CONFIG, runfiles.METRICS, runfiles.REJECTED, "notes.txt"):
        (run / name).write_text("" if name == runfiles.METRICS else "x", encoding="utf-8")
    (run / runfiles.SUMMARY).write_text(json.dumps({"steps": 0}), encoding="utf-8")
    (run / runfiles.CKPT_DIR).mkdir()
    assert runfiles.trained_nothing(run)
    assert sorted(runfiles.clear_untrained(run)) == sorted([runfiles.CONFIG, runfiles.SUMMARY, runfiles.METRICS,
                                                            runfiles.REJECTED, runfiles.TB_DIR, runfiles.CKPT_DIR])
    assert [p.name for p in run.iterdir()] == ["notes.txt"]  # not a run file: kept
    (run / runfiles.METRICS).write_text('{"step": 1}\n', encoding="utf-8")
    assert not runfiles.trained_nothing(run)
    (run / runfiles.METRICS).unlink()
    (run / runfiles.SUMMARY).write_text(json.dumps({"steps": 3}), encoding="utf-8")
    assert not runfiles.trained_nothing(run)
    (run / runfiles.SUMMARY).unlink()
    (run / runfiles.CKPT_DIR).mkdir()
    (run / runfiles.CKPT_DIR / "ckpt-1.index").write_text("x", encoding="utf-8")
    assert not runfiles.trained_nothing(run)


def test_a_run_file_is_named_only_here() -> None:
    """No other module of the package spells a run file's name (config.yaml, endpoint.json, ...)."""
    files = {value for name, value in vars(runfiles).items()
             if name.isupper() and isinstance(value, str) and "." in value}
    assert {"config.yaml", "config.resume.yaml", "endpoint.json"} <= files
    root = Path(runfiles.__file__).resolve().parents[1]
    spelled = [f"{path.relative_to(root)}:{node.lineno}: {node.value}"
               for layer in ("stoker", "shared", "producer", "consumer")
               for path in sorted((root / layer).rglob("*.py")) if path.name != "runfiles.py"
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
               if isinstance(node, ast.Constant) and node.value in files]
    assert not spelled, "run files named outside shared/runfiles.py:\n" + "\n".join(spelled)


def test_a_full_disk_is_one_line_naming_the_file(small_disk) -> None:
    target = small_disk.path / "run" / "summary.json"
    runfiles.write_json(target, {"steps": 1})
    log = JsonlWriter(small_disk.path / "run" / "metrics.jsonl")
    small_disk.fill()
    with pytest.raises(runfiles.RunFileError) as full:
        runfiles.write_json(target, {"steps": 2, "pad": "x" * 10000})
    assert str(full.value) == f"cannot write {target}: No space left on device (ENOSPC)"
    assert json.loads(target.read_text()) == {"steps": 1}  # the old file kept, no temporary left
    assert sorted(p.name for p in target.parent.iterdir()) == ["metrics.jsonl", "summary.json"]
    with pytest.raises(runfiles.RunFileError, match=r"cannot write .*metrics.jsonl: No space left on device"):
        log.write({"step": 1, "pad": "x" * 10000})
        log.flush()
    small_disk.free()
    log.close()


def test_file_error_reads_a_library_error_that_names_the_errno_in_words(tmp_path) -> None:
    worded = RuntimeError("{{function_node SaveV2}} state_temp/part-00000; No space left on device [Op:SaveV2]")
    error = runfiles.file_error(worded, tmp_path / "ckpt-000003")
    assert str(error) == f"cannot write {tmp_path / 'ckpt-000003'}: No space left on device (ENOSPC)"
    assert isinstance(error, OSError) and error.errno == 28
    assert runfiles.file_error(FileNotFoundError(2, "No such file or directory"), tmp_path) is None
    assert runfiles.file_error(ValueError("bad"), tmp_path) is None
