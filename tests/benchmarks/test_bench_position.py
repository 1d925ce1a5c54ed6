"""benchmarks/position.py at its smallest: the report's structure and its checks passed; no
timings judged."""

from __future__ import annotations

from stoker.benchmarks import position


def test_position_benchmark_structure() -> None:
    result = position.run((20_000,), repeats=2)
    (row,) = result["sizes"]
    assert row["clips"] == 20_000 and [c["world"] for c in row["exactly_once"]] == list(position.WORLD_SIZES)
    assert all(c["once"] == c["planned"] == 20_000 and c["batches_whole"] for c in row["exactly_once"])
    assert row["save_s"]["n"] == row["restore_s"]["n"] == 2 and 0 < row["bytes"] < position.TARGET_BYTES
    assert [t["what"].split(" at ")[0] for t in result["targets"]] == ["bytes", "restore_s"]
    text = position.render(result)
    assert "20,000 clips" in text and "position bytes" in text and "x5000 from 20,000" in text
