"""A Parquet piece's entries made straight from its columns (consumer/index/parquet_pieces.py,
shared/dataset/parquet_layout.checked_columns) are the piece its rows' manifest lines make, parsed row by
row: the same ids, texts, durations and locators, the same rejections naming the same rows; a
row the manifest's checks would reject sends the piece down the row-by-row path."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.shared.config import DataConfig, FeaturesConfig, TextConfig
from stoker.consumer.index import parquet_pieces

NAME = "train-000.parquet"


def _rows() -> dict[str, list[Any]]:
    """Rows that every manifest check passes, of every kind the rules and the front-end tell
    apart: valid, too long, too short, an empty text, a text losing characters, non-ASCII text in
    two languages, a normalized text, no speaker or language, spaces around values."""
    rows: dict[str, list[Any]] = {n: [] for n in ("id", "text", "normalized_text", "speaker", "language",
                                                  "duration")}

    def add(sample_id, text, duration, speaker="s1", language="en", normalized=None):
        for key, value in zip(rows, (sample_id, text, normalized, speaker, language, duration)):
            rows[key].append(value)

    for i in range(8):
        add(f"c{i:03d}", f"clip number {i}, said.", 0.5 + i / 10, f"s{i % 3}")
    add("long", "Far too long.", 99.0)
    add("short", "Too short.", 0.01)
    add("blank", "", 1.0)
    add("snow", "\u2603\u2603 x", 1.0)
    add("gruss", "Grüße Nummer drei.", 1.2, language="de")
    add("farsi", "سلام دنیا", 1.3, "گوینده", "fa")
    add("norm", "Dr. Smith", 1.1, normalized="Doctor Smith")
    add("anon", "Nobody said it.", 0.9, None, None)
    add("  padded ", "  Spaces around.  ", 1.0, " s2 ")
    return rows


def _write(root: Path, rows: dict[str, list[Any]], row_group: int = 4) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    size = len(next(iter(rows.values())))
    audio = pa.StructArray.from_arrays([pa.array([b"RIFF"] * size, pa.binary()), pa.array(["a.wav"] * size)],
                                       ["bytes", "path"])
    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"audio": audio, **rows}), root / NAME, row_group_size=row_group)


def _pieces(root: Path, monkeypatch: pytest.MonkeyPatch, first_row: int = 0) -> tuple[Any, Any, bool]:
    """The piece of the whole file (its first row the file's ``first_row``, line 7) made from
    the columns, made from its lines, and whether the columns' path took it."""
    import pyarrow.parquet as pq

    groups = pq.ParquetFile(root / NAME).metadata.num_row_groups
    args = (str(root), NAME, (0, groups, first_row), 7, DataConfig(path=str(root), metadata_file="*.parquet"),
            FeaturesConfig(), TextConfig())
    taken = []
    checked = parquet_pieces.checked_columns
    with monkeypatch.context() as m:
        m.setattr(parquet_pieces, "checked_columns", lambda *a: taken.append(checked(*a)) or taken[-1])
        fast = parquet_pieces.parquet_chunk(*args)
    with monkeypatch.context() as m:
        m.setattr(parquet_pieces, "checked_columns", lambda *a: None)
        slow = parquet_pieces.parquet_chunk(*args)
    return fast, slow, taken[0] is not None


def _same(a: Any, b: Any) -> bool:
    """Deep equality of a piece's results (arrays, blobs, rejections, nested containers)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def test_a_clean_piece_made_from_its_columns_is_the_piece_its_lines_make(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, _rows())
    fast, slow, took = _pieces(tmp_path, monkeypatch)
    assert took and slow is not None and _same(fast, slow)
    rejected = {r.id: r.reason for _, r in slow["rejected"]}
    assert set(rejected) == {"long", "short", "blank", "snow"}
    assert "snow" in {sample_id for _, sample_id, _ in slow["lost"]}
    ids = slow["strings"]["id"]
    kept = [ids[1][ids[0][n]:ids[0][n + 1]].decode() for n in range(len(ids[0]) - 1)]
    assert {"farsi", "gruss", "padded", "anon", "norm"} <= set(kept)


def test_rows_without_ids_or_with_integer_ids_are_the_same_either_way(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Integer ids (made strings), and no id column (each row's own id, numbered from the
    piece's first row in its file), without a normalized text column: the same piece either way."""
    rows = _rows()
    del rows["normalized_text"]
    rows["id"] = list(range(100, 100 + len(rows["id"])))
    _write(tmp_path / "ints", rows)
    fast, slow, took = _pieces(tmp_path / "ints", monkeypatch)
    assert took and _same(fast, slow) and b"107" in slow["strings"]["id"][1]
    del rows["id"]
    _write(tmp_path / "none", rows)
    fast, slow, took = _pieces(tmp_path / "none", monkeypatch, first_row=40)
    assert took and _same(fast, slow) and b"train-000_47" in slow["strings"]["id"][1]


# A row each manifest check rejects (or a value a JSON line does not keep), and what the row-by-row parse says.
FAULTS = {
    "null text": ({"id": "nulltext", "text": None}, "lacks 'text'"),
    "id with a slash": ({"id": "a/b"}, "is not a plain file name"),
    "id starting with a dot": ({"id": ".hidden"}, "is not a plain file name"),
    "blank id": ({"id": "   "}, "has an empty 'id'"),
    "id with a control character": ({"id": "tab\there"}, "is not a plain file name"),
    "repeated id": ({"id": "c001"}, "duplicate id"),
    "speaker with a bar": ({"id": "bar", "speaker": "a|b"}, "control character or '|'"),
    "not a language code": ({"id": "lang", "language": "not a code!"}, "not a language code"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_piece_with_a_faulty_row_is_the_row_by_row_piece_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     fault: str) -> None:
    values, reason = FAULTS[fault]
    rows = _rows()
    for key in rows:
        rows[key].insert(5, {"text": "Some words.", "speaker": "s1", "language": "en", "duration": 1.0}.get(key))
        if key in values:
            rows[key][5] = values[key]
    _write(tmp_path, rows)
    fast, slow, took = _pieces(tmp_path, monkeypatch)
    assert not took and _same(fast, slow)
    assert [(r.line, reason in r.reason) for r in slow["parsed"]] == [(7 + 5, True)]


@pytest.mark.parametrize("duration", [None, math.nan])
def test_a_row_without_a_finite_duration_leaves_the_piece_to_the_one_process_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, duration: float | None) -> None:
    rows = _rows()
    rows["duration"][3] = duration
    _write(tmp_path, rows)
    fast, slow, took = _pieces(tmp_path, monkeypatch)
    assert not took and fast is None and slow is None
