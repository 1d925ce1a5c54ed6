"""Run files and their merge (consumer/index/spill.py): the runs' sorted keys merged a block at a
time are a stable sort of the runs laid end to end, ties and all, whatever the block."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stoker.consumer.index import spill as spill_module
from stoker.consumer.index.spill import Run, gathered, merged, span_strings, write_run


def _runs(tmp_path: Path, keys: list[np.ndarray]) -> list[Run]:
    runs = []
    for n, run in enumerate(keys):
        order = np.argsort(run, kind="stable")
        lines = [f"{n}:{k}|".encode() for k in order.tolist()]  # each key's own line, in the run's order
        offsets = np.concatenate([[0], np.cumsum([len(b) for b in lines])]).astype(np.int64)
        write_run(tmp_path / f"run-{n}", {"n": n}, {"key": run[order], "lines.o": offsets, "lines.s": b"".join(lines)})
        runs.append(Run(tmp_path / f"run-{n}"))
    return runs


@pytest.mark.parametrize("block", [1, 3, 64])
def test_the_merged_runs_are_a_stable_sort_of_the_runs_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  block: int) -> None:
    monkeypatch.setattr(spill_module, "MIN_BLOCK_ROWS", block)
    monkeypatch.setattr(spill_module, "MERGE_BUDGET_BYTES", 1)
    rng = np.random.default_rng(7)
    keys = [rng.integers(0, 20, size).astype(np.uint64) for size in (0, 1, 37, 50, 5, 50)]  # many ties, one empty
    runs = _runs(tmp_path, keys)
    whole = np.concatenate([np.sort(k, kind="stable") for k in keys])
    starts = np.cumsum([0] + [len(k) for k in keys])
    expected = np.argsort(whole, kind="stable")
    got, lines = [], []
    for joined, perm, spans in merged(runs, "key", [np.uint64] * len(runs), np.uint64, 8):
        assert all(stop > first for _, first, stop in spans)
        laid = np.concatenate([np.arange(first, stop) + starts[k] for k, first, stop in spans])
        got.append(laid[perm])
        lines.append(gathered(*span_strings(runs, "lines", spans), perm))
    assert np.concatenate(got).tolist() == expected.tolist()
    every = b"".join(f"{n}:{k}|".encode() for n, key in enumerate(keys) for k in np.argsort(key, kind="stable").tolist())
    assert sorted(b"".join(lines).split(b"|")) == sorted(every.split(b"|"))  # each line once, with its key
    assert runs[2].header["n"] == 2


def test_keys_of_different_widths_merge_as_strings(tmp_path: Path) -> None:
    keys = [np.array([b"b", b"a", b"ab"], "S2"), np.array([b"abc", b"a", b"b"], "S3")]
    runs = _runs(tmp_path, keys)
    out = []
    for joined, perm, _ in merged(runs, "key", ["S2", "S3"], "S3", 0):
        out.extend(joined[perm].tolist())
    assert out == sorted([b"b", b"a", b"ab", b"abc", b"a", b"b"])


def test_a_run_reads_slices_of_its_arrays_and_strings(tmp_path: Path) -> None:
    offsets = np.array([0, 2, 2, 5], np.int64)
    write_run(tmp_path / "r", {}, {"a": np.arange(10, dtype=np.int32), "s.o": offsets, "s.s": b"abcde"})
    run = Run(tmp_path / "r")
    assert run.array("a", np.int32, 3, 6).tolist() == [3, 4, 5] and run.length("a", np.int32) == 10
    piece, blob = run.strings("s", 1, 3)
    assert piece.tolist() == [0, 0, 3] and blob == b"cde"
    run.close()
