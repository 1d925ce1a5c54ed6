"""The columnar index: samples through the table and a cache file come back equal, value for value."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stoker.shared.dataset.cache import open_index, write_cache
from stoker.consumer.index.index import build_index
from stoker.shared.dataset.table import SampleTable
from stoker.shared.dataset.types import Sample
from stoker.shared.dataset import table as table_module
from stoker.shared.config import DataConfig, FeaturesConfig
from tests.factories import make_dataset

SAMPLES = [
    Sample("a1", "Hello there.", 13, 120, 1.5, "wavs/a1.wav", 1, "en", "default", "hello there."),
    Sample("b\u00e9", "Gr\u00fc\u00dfe, \u0633\u0644\u0627\u0645", 9, 87, 1.0875, "wavs/b\u00e9.flac", 2, "de", "anna",
           "gr\u00fc\u00dfe"),
    Sample("c3", "", 1, 3, 0.0346, "/abs/path/c3.wav", 7, "fa", "default", ""),
    Sample("odd\udcff", "x", 2, 2**31 - 1, 1e6, "wavs/odd\udcff.wav", 2**40, "en", "z", "x"),
]


def test_samples_round_trip_through_the_table() -> None:
    table = SampleTable.from_samples(SAMPLES)
    assert len(table) == len(SAMPLES)
    assert list(table) == SAMPLES
    assert table[-1] == SAMPLES[-1] and table[1:3] == SAMPLES[1:3]
    assert table.column("num_frames").tolist() == [s.num_frames for s in SAMPLES]
    assert table.strings("id") == [s.id for s in SAMPLES]
    assert table.row_of("c3") == 2
    view = table.take([3, 0])
    assert list(view) == [SAMPLES[3], SAMPLES[0]]
    assert view.column("duration_s").tolist() == [1e6, 1.5]
    assert view.strings("text") == ["x", "Hello there."] and view.row_of("a1") == 1
    with pytest.raises(IndexError):
        table[len(SAMPLES)]


def test_samples_round_trip_through_a_mapped_cache_file(tmp_path: Path) -> None:
    table = SampleTable.from_samples(SAMPLES)
    path = tmp_path / "index.idx"
    assert write_cache([path], {"key": "k", "extra": [1, "two"]}, {**table.sections(), "reuse": b"r"})
    cached = open_index(path)
    assert cached.header["key"] == "k" and cached.header["extra"] == [1, "two"]
    assert bytes(cached.sections["reuse"]) == b"r"
    back = SampleTable.from_sections(cached.sections, table.speakers, table.languages)
    assert list(back) == SAMPLES
    assert isinstance(back.column("num_tokens"), np.ndarray) and not back.column("num_tokens").flags.writeable


def test_strings_left_in_the_file_read_as_the_mapped_ones(tmp_path: Path) -> None:
    """A warm load leaves the texts, audio locators and units in the cache file, read a slice at a
    time (FileBlob): every way of reading them gives the mapped sections' strings, and a table
    stored again from them is the same."""
    table = SampleTable.from_samples(SAMPLES * 2000)  # more strings than FILE_READ_STRINGS at once
    path = tmp_path / "index.idx"
    write_cache([path], {}, table.sections())
    cached = open_index(path)
    blobs = {name: cached.blob(name) for name in ("s.text", "s.audio")}
    assert all(isinstance(b, table_module.FileBlob) for b in blobs.values())
    mapped = SampleTable.from_sections(cached.sections, table.speakers, table.languages)
    read = SampleTable.from_sections({**cached.sections, **blobs}, table.speakers, table.languages)
    assert read[5] == mapped[5] == SAMPLES[1] and read.strings("text", [3, 0]) == [SAMPLES[3].text, SAMPLES[0].text]
    assert read.strings("audio") == mapped.strings("audio") and read.take([7, 2])[0] == SAMPLES[3]
    assert bytes(blobs["s.text"][2:9]) == bytes(cached.sections["s.text"][2:9])
    again = {k: bytes(v) if isinstance(v, (bytes, memoryview)) else v.tobytes() for k, v in read.sections().items()}
    assert again == {k: bytes(v) if isinstance(v, (bytes, memoryview)) else v.tobytes()
                     for k, v in table.sections().items()}


def test_an_empty_table_round_trips(tmp_path: Path) -> None:
    table = SampleTable.from_samples([])
    path = tmp_path / "empty.idx"
    write_cache([path], {}, table.sections())
    assert list(SampleTable.from_sections(open_index(path).sections, [], [])) == []


def test_a_warm_index_equals_the_built_one_value_for_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    make_dataset(tmp_path / "data", count=6)
    data = DataConfig(path=str(tmp_path / "data"))
    cold = build_index(data, FeaturesConfig())
    warm = build_index(data, FeaturesConfig())
    assert warm.stats.cache == "hit"
    assert list(warm.samples) == list(cold.samples) and len(warm.samples) == 6
    for name in ("num_tokens", "num_frames", "duration_s", "line", "speaker", "language"):
        assert warm.samples.column(name).tolist() == cold.samples.column(name).tolist()
    assert warm.sample(cold.samples[3].id) == cold.samples[3]


def test_ids_are_found_by_hash_and_checked_against_the_id(monkeypatch: pytest.MonkeyPatch) -> None:
    table = SampleTable.from_samples(SAMPLES)
    assert table.find_rows(["c3", "nope", "b\u00e9", "odd\udcff", "a1"]) == [2, -1, 1, 3, 0]
    with pytest.raises(KeyError):
        table.row_of("a")
    # every id hashed alike: each hit is still told apart by the id itself
    monkeypatch.setattr(table_module, "hash_strings", lambda offsets, blob, rows: np.zeros(len(rows), np.uint64))
    collided = SampleTable.from_samples(SAMPLES)
    assert collided.find_rows(["odd\udcff", "c3", "zz"]) == [3, 2, -1]
    assert collided.take([2, 3]).find_rows(["odd\udcff", "a1"]) == [1, -1]


def test_ascii_ids_become_keys_that_sort_as_the_ids() -> None:
    ids = ["b2", "a10", "a9", "", "zz", "a", "B"]
    table = SampleTable.from_samples([SAMPLES[0]._replace(id=i) for i in ids])
    keys = table.id_keys()
    assert [k.decode() for k in keys] == ids
    assert [ids[n] for n in np.argsort(keys, kind="stable")] == sorted(ids)
    assert [k.decode() for k in table.take([4, 0]).id_keys()] == ["zz", "b2"]
    assert SampleTable.from_samples(SAMPLES).id_keys() is None  # an undecodable byte: sorted as str by the caller
    utf8 = ["\u00e9t\u00e9", "ete", "\U0001f600", "\uffff", "z", "\u00e9"]  # UTF-8 orders as the code points
    keys = SampleTable.from_samples([SAMPLES[0]._replace(id=i) for i in utf8]).id_keys()
    assert [utf8[n] for n in np.argsort(keys, kind="stable")] == sorted(utf8)
    assert SampleTable.from_samples([SAMPLES[0]._replace(id=i) for i in ["a", "a\x00"]]).id_keys() is None


ID_SETS = {
    "ascii, one length": ["c07", "c02", "c11", "c00", "c05"],
    "ascii, lengths differ": ["b2", "a10", "a9", "", "zz", "a", "B", "a10"],
    "non-ascii": ["\u00e9t\u00e9", "ete", "\U0001f600", "\uffff", "z", "\u00e9", "\u0633\u0644\u0627\u0645"],
    "surrogate escapes": ["odd\udcff", "odd\ue000", "odd", "odd\udc80", "od"],
    "a nul": ["a\x00", "a", "a\x00b", "", "a\x00"],
}


@pytest.mark.parametrize("ids", ID_SETS.values(), ids=ID_SETS.keys())
def test_id_order_is_the_rows_sorted_by_id_as_python_sorts_them(ids: list[str], tmp_path: Path) -> None:
    expected = sorted(range(len(ids)), key=ids.__getitem__)
    table = SampleTable.from_samples([SAMPLES[0]._replace(id=i) for i in ids])
    assert table.id_order().tolist() == expected and table.id_order().dtype == np.int64
    view = table.take([4, 2, 0, 1])  # a view: made on demand, of the view's rows
    picked = [ids[n] for n in (4, 2, 0, 1)]
    assert view.id_order().tolist() == sorted(range(4), key=picked.__getitem__)
    path = tmp_path / "index.idx"
    write_cache([path], {}, table.sections())
    back = SampleTable.from_sections(open_index(path).sections, table.speakers, table.languages)
    assert back.id_order().tolist() == expected


def test_a_stored_table_maps_its_id_order_and_keeps_units_equal_to_texts_once(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    same = [s._replace(units=s.text) for s in SAMPLES]
    table = SampleTable.from_samples(same)
    sections = table.sections()
    assert "s.units" not in sections and "o.units" not in sections  # the texts' sections serve both
    assert "s.units" in SampleTable.from_samples(SAMPLES).sections()
    path = tmp_path / "index.idx"
    write_cache([path], {}, sections)

    def no_sort(*args, **kwargs):
        raise AssertionError("a stored table's id order is read, not made")

    monkeypatch.setattr(table_module, "fixed_width", no_sort)
    monkeypatch.setattr(SampleTable, "ids", no_sort)
    back = SampleTable.from_sections(open_index(path).sections, table.speakers, table.languages)
    assert list(back) == same
    order = back.id_order()
    assert order.tolist() == sorted(range(len(same)), key=[s.id for s in same].__getitem__)
    assert not order.flags.writeable  # a view of the mapped file
