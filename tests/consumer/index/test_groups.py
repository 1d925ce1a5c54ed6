"""Each clip's shard or row group, numbered (consumer/index/groups.py): from the locators, and as
the index cache stores them for a warm start."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.consumer.index.index import build_index
from stoker.shared.dataset.table import SampleTable
from stoker.consumer.index import groups
from stoker.shared.dataset.cache import open_index
from stoker.shared.dataset.corpus.address import member_of
from stoker.shared.dataset.table import GROUPS_SECTION
from tests.factories import make_samples
from tests.parquet_data import make_parquet


def test_shards_are_numbered_in_name_order_from_the_locators_a_piece_at_a_time(monkeypatch) -> None:
    """Each clip's shard by row, numbered in name order, as the locators' own parse gives it
    (members of a shard not together, names that hold ".tar"), read a few clips at a time; a
    clip that is no shard member anywhere, or a shard whose first locator is malformed, makes it
    None (a later malformed member is rejected when a producer reads it)."""
    names = ["b/x.tar.tar", "a.tar", "b/x.tar", "c d.tar"]
    audio = [f"{names[(n * 7) % 4]}#k{n}.tar.flac@{n}+9" for n in range(50)]
    samples = [s._replace(audio=a) for s, a in zip(make_samples(50, seed=4), audio)]
    monkeypatch.setattr(groups, "SHARD_SCAN_ROWS", 8)
    table = SampleTable.from_samples(samples)
    number = {name: n for n, name in enumerate(sorted(names))}
    assert groups.shard_numbers(table).tolist() == [number[member_of(a).shard] for a in audio]
    assert table.strings_between("audio", 3, 11) == audio[3:11] == table.take(range(50)).strings_between(
        "audio", 3, 11)
    for odd in ("wavs/loose.wav", "z.tar#member-without-place"):
        changed = [s._replace(audio=odd) if n == 20 else s for n, s in enumerate(samples)]
        assert groups.shard_numbers(SampleTable.from_samples(changed)) is None


def test_a_warm_index_gives_each_clips_row_group_as_its_build_stored_it_without_reading_the_locators(
        tmp_path: Path, monkeypatch) -> None:
    make_parquet(tmp_path / "pq", files=3, per_file=6, row_group=2)
    data = DataConfig(path=str(tmp_path / "pq"), index_workers=1)
    cold = build_index(data, FeaturesConfig())
    computed = groups.shard_numbers(SampleTable.from_samples(list(cold.samples)))  # from the locators
    assert len(set(computed.tolist())) == 9
    stored = open_index(Path(cold.stats.cache_file)).sections[GROUPS_SECTION]
    assert np.frombuffer(stored, np.int64).tolist() == computed.tolist()

    def unread(*args, **kwargs):
        raise AssertionError("a warm start read the locators")

    monkeypatch.setattr(SampleTable, "prefix_numbers", unread)
    monkeypatch.setattr(SampleTable, "strings_between", unread)
    warm = build_index(data, FeaturesConfig())
    assert warm.stats.cache == "hit"
    assert groups.shard_numbers(warm.samples).tolist() == computed.tolist()
    rows = np.arange(len(warm.samples))[np.isin(computed, [1, 4, 8])]  # a view of three row groups: 0, 1, 2 again
    monkeypatch.undo()
    view = warm.samples.take(rows[::-1])
    assert groups.shard_numbers(view).tolist() == groups.shard_numbers(
        SampleTable.from_samples(list(view))).tolist() == np.searchsorted([1, 4, 8], computed[rows[::-1]]).tolist()


def test_a_view_copied_as_its_whole_tables_sections_keeps_its_groups_without_reading_the_locators(
        tmp_path: Path, monkeypatch) -> None:
    """As the coordinator process gets a cold start's table: the whole table's sections and the view's rows."""
    make_parquet(tmp_path / "pq", files=2, per_file=6, row_group=2)
    index = build_index(DataConfig(path=str(tmp_path / "pq"), index_workers=1, index_cache="off"), FeaturesConfig())
    view = index.samples.take([11, 0, 5, 6])
    expected = groups.shard_numbers(SampleTable.from_samples(list(view))).tolist()
    whole = view.whole()
    copied = SampleTable.from_sections({k: bytes(memoryview(v)) for k, v in whole.sections().items()},
                                       whole.speakers, whole.languages)
    assert GROUPS_SECTION in whole.sections()
    monkeypatch.setattr(SampleTable, "prefix_numbers", lambda *a, **k: pytest.fail("the locators were read"))
    assert groups.shard_numbers(copied.take([11, 0, 5, 6])).tolist() == expected == [3, 0, 1, 2]
