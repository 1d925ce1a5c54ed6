"""SampleTable.prefix_numbers (shared/dataset/table.py): each clip's string up to its last
separator, numbered, as a plain pass over the strings numbers them (the Parquet row groups of a
plan's leases: consumer/shard_order.py)."""

from __future__ import annotations

import numpy as np

from stoker.shared.dataset import table as table_module
from stoker.shared.dataset.table import NUMBER_COLUMNS, STRING_COLUMNS, SampleTable, pack_strings


def _table(audio: list[str]) -> SampleTable:
    n = len(audio)
    numbers = {name: np.zeros(n, kind) for name, kind in NUMBER_COLUMNS.items()}
    strings = {name: pack_strings(audio if name == "audio" else [f"c{i}" for i in range(n)])
               for name in STRING_COLUMNS}
    return SampleTable(numbers, strings, ["s"], ["en"])


def _plain(audio: list[str]) -> tuple[list[str], list[int]]:
    prefixes = [a[:a.rfind(":")] for a in audio]
    names = sorted(set(prefixes), key=prefixes.index)
    return names, [names.index(p) for p in prefixes]


def test_prefixes_are_numbered_as_a_plain_pass_numbers_them(monkeypatch) -> None:
    monkeypatch.setattr(table_module, "PREFIX_SCAN_ROWS", 7)  # runs that span pieces of the scan
    rng = np.random.default_rng(3)
    files = ["a.parquet", "bb.parquet", "é/c.parquet", "a.parquet"]
    audio = [f"{files[f]}#{g}:{r}" for f in range(4) for g in range(rng.integers(1, 4))
             for r in range(rng.integers(1, 9))]
    audio += ["a.parquet#0:99", "bb.parquet#12:0", "x#:1"]  # a group seen before; a longer one; an empty group
    names, numbers = table_module.SampleTable.prefix_numbers(_table(audio), "audio", ord(":"))
    want_names, want = _plain(audio)
    assert [names[n] for n in numbers.tolist()] == [want_names[n] for n in want]
    assert len(names) == len(want_names)
    rows = np.array([5, 0, len(audio) - 2, 3])
    names, numbers = _table(audio).take(rows).prefix_numbers("audio", ord(":"))  # only the prefixes of these clips
    assert [names[n] for n in numbers.tolist()] == [audio[r][:audio[r].rfind(":")] for r in rows]
    assert len(names) == len({audio[r][:audio[r].rfind(":")] for r in rows})
    assert _table(["a.parquet#0:1", "no-separator"]).prefix_numbers("audio", ord(":")) is None
