"""Tests for shared/dataset/parquet.py and shared/dataset/parquet_layout.py: Parquet files written by the
Hugging Face ``datasets`` library indexed a row per clip, each row's audio read by its locator a row
group at a time, columns found by their usual names or data.columns, and every fault (a corrupt row
group, audio that does not decode, a file that is not Parquet) a rejection naming the file and row."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from stoker.consumer.index.groups import shard_numbers
from stoker.producer.audio import AudioError, load_audio, load_member
from stoker.shared import config as config_mod
from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.shared.dataset.agreement import Reference, metadata_sha256, scan_dataset
from stoker.shared.dataset.corpus.registry import locate
from stoker.consumer.index.index import build_index
from stoker.shared.dataset.types import DatasetError
from stoker.shared.dataset import parquet
from stoker.shared.dataset.parquet import RowReader, pyarrow_modules
from stoker.shared.dataset.storage import Reader
from stoker.shared.dataset.corpus.address import address_of
from stoker.shared.dataset.corpus.registry import format_of
from stoker.shared.dataset.layouts import LayoutError
from stoker.shared.dataset.parquet_layout import ROW_LOCATOR, parse_column_map
from tests.factories import clip_member
from tests.parquet_data import corrupt_row_group, loose_copy, make_parquet, write_parquet

FEATURES = FeaturesConfig()


def _data(path: str | Path, **kw) -> DataConfig:
    return DataConfig(path=str(path), **{"index_workers": 1, **kw})


def test_rows_index_every_clip_with_its_id_text_speaker_language_and_row(tmp_path: Path) -> None:
    made = make_parquet(tmp_path / "pq", files=2, per_file=6, row_group=4)
    index = build_index(_data(tmp_path / "pq"), FEATURES)
    assert index.rejected == []
    assert {s.id: (s.text, s.speaker, s.language) for s in index.samples} == made.clips
    reader = RowReader(tmp_path / "pq")
    for sample in index.samples:
        match = ROW_LOCATOR.match(sample.audio)
        assert (match["file"], int(match["group"]), int(match["row"])) == made.rows[sample.id]
        assert reader.read(sample.audio) == made.audio[sample.id]
    assert index.stats.headers_read == 0  # the duration column: no audio read


def test_without_a_duration_column_the_headers_are_read_from_the_bytes_as_loose_files_index(tmp_path: Path) -> None:
    made = make_parquet(tmp_path / "pq", durations=False)
    index = build_index(_data(tmp_path / "pq"), FEATURES)
    assert index.stats.headers_read == len(made.clips)
    loose = build_index(_data(loose_copy(made, tmp_path / "loose")), FEATURES)
    assert ({s.id: (s.num_frames, s.duration_s) for s in index.samples}
            == {s.id: (s.num_frames, s.duration_s) for s in loose.samples})


def test_rows_without_an_id_column_are_the_file_stem_and_row_number(tmp_path: Path) -> None:
    make_parquet(tmp_path / "pq", files=2, per_file=5, row_group=2, ids=False)
    index = build_index(_data(tmp_path / "pq"), FEATURES)
    assert sorted(s.id for s in index.samples) == sorted(f"train-{f:03d}_{r}" for f in range(2) for r in range(5))
    assert index.sample("train-001_4").audio == "train-001.parquet#2:0"


def test_columns_are_found_by_their_usual_names_or_as_data_columns_maps_them(tmp_path: Path) -> None:
    made = make_parquet(tmp_path / "cv", names=("sentence", "client_id", "locale"))
    index = build_index(_data(tmp_path / "cv"), FEATURES)
    assert {s.id: (s.text, s.speaker, s.language) for s in index.samples} == made.clips
    made = make_parquet(tmp_path / "own", names=("words", "who", "tongue"))
    with pytest.raises(DatasetError, match="no usable clip"):
        build_index(_data(tmp_path / "own"), FEATURES)
    root, pattern = locate(str(tmp_path / "own"), "metadata.csv").where
    fmt = format_of(pattern)
    entries, rejected = fmt.parse(fmt.read(root, pattern), "")
    assert entries == [] and {r.reason for r in rejected if r.id == "PQ0009"} == {
        "row 1 of row group 0 of train-001.parquet lacks 'text'"}
    mapped = build_index(_data(tmp_path / "own", columns="text=words|speaker=who|language=tongue"), FEATURES)
    assert {s.id: (s.text, s.speaker, s.language) for s in mapped.samples} == made.clips


@pytest.mark.parametrize("spec, problem", [("text=|speaker=who", "'text=' is not ROLE=COLUMN"),
                                           ("txt=words", "unknown role 'txt'"), ("text=a|text=b", "'text' is named twice")])
def test_a_column_map_that_cannot_work_is_one_line(spec: str, problem: str) -> None:
    with pytest.raises(LayoutError, match=problem):
        parse_column_map(spec)
    with pytest.raises(config_mod.ConfigError, match=problem):
        config_mod.from_dict({"data": {"columns": spec}})


def test_data_names_parquet_files_as_a_directory_a_file_or_a_glob(tmp_path: Path) -> None:
    made = make_parquet(tmp_path / "pq", files=3, per_file=2)
    assert locate(str(tmp_path / "pq"), "metadata.csv").where == (tmp_path / "pq", "*.parquet")
    for given, count in ((tmp_path / "pq", 6), (made.paths[1], 2), (tmp_path / "pq" / "train-00[02].parquet", 4)):
        assert len(build_index(_data(given, index_cache="off"), FEATURES).samples) == count
    with pytest.raises(DatasetError, match="no Parquet file matches"):
        build_index(_data(tmp_path / "pq" / "test-*.parquet"), FEATURES)


def test_a_producer_scan_agrees_with_the_index_and_a_copy_is_agreed_by_file_names_and_sizes(tmp_path: Path) -> None:
    make_parquet(tmp_path / "pq")
    index = build_index(_data(tmp_path / "pq"), FEATURES)
    root, pattern = locate(str(tmp_path / "pq"), "metadata.csv").where
    assert scan_dataset(root, pattern).fingerprint == index.dataset_fingerprint
    shutil.copytree(tmp_path / "pq", tmp_path / "copy")
    assert metadata_sha256(tmp_path / "copy", pattern) == Reference.of(index).sha256()
    make_parquet(tmp_path / "copy", files=1, per_file=3)  # another first file: another copy
    assert metadata_sha256(tmp_path / "copy", pattern) != Reference.of(index).sha256()


def test_a_row_decodes_to_the_same_samples_as_its_loose_file(tmp_path: Path) -> None:
    made = make_parquet(tmp_path / "pq")
    loose = loose_copy(made, tmp_path / "loose")
    index = build_index(_data(tmp_path / "pq"), FEATURES)
    reader = Reader(tmp_path / "pq")
    for sample in index.samples:
        wav = next((loose / "wavs").glob(f"{sample.id}.*"))
        np.testing.assert_array_equal(load_member(reader, address_of(sample.audio), 16000), load_audio(wav, 16000))


def test_a_lease_s_rows_are_read_a_row_group_at_a_time_each_once_then_taken_in_any_order(tmp_path: Path,
                                                                                         monkeypatch) -> None:
    made = make_parquet(tmp_path / "pq", files=2, per_file=8, row_group=4)
    index = build_index(_data(tmp_path / "pq"), FEATURES)
    monkeypatch.setattr(parquet, "KEPT_GROUP_BYTES", 1)  # one group kept: fewer than the lease spans
    pq = pyarrow_modules()[1]
    reads: list[tuple[int, int]] = []  # (file object, row group) of each row group read
    plain = pq.ParquetFile.read_row_group

    def spy(self, group, *args, **kw):
        reads.append((id(self), group))
        return plain(self, group, *args, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    reader = RowReader(tmp_path / "pq")
    wanted = {s.audio: s.id for s in reversed(index.samples)}  # a lease's order: any
    reader.prefetch(wanted)
    assert len(reads) == len(set(reads)) == 4  # each of the 4 row groups once
    for name, sample_id in wanted.items():
        assert reader.read(name) == made.audio[sample_id]
    assert len(reads) == 4  # taken from what was read ahead


def test_a_corrupt_row_group_is_a_rejection_per_row_naming_its_file_and_row(tmp_path: Path) -> None:
    made = make_parquet(tmp_path / "pq", files=2, per_file=8, row_group=4)
    corrupt_row_group(made.paths[1], 1)
    index = build_index(_data(tmp_path / "pq"), FEATURES)
    lost = {i for i, (file, group, _) in made.rows.items() if file == "train-001.parquet" and group == 1}
    assert {s.id for s in index.samples} == set(made.clips) - lost
    assert sorted(r.reason.split(" cannot")[0] for r in index.rejected) == \
        [f"row {r} of row group 1 of train-001.parquet" for r in range(4)]
    assert {r.file for r in index.rejected} == {f"train-001.parquet#1:{r}" for r in range(4)}


def test_a_row_group_corrupt_only_in_its_audio_is_rejected_by_the_reader_naming_file_and_row(tmp_path: Path) -> None:
    made = make_parquet(tmp_path / "pq", files=1, per_file=8, row_group=4)
    pq = pyarrow_modules()[1]
    meta = pq.ParquetFile(made.paths[0]).metadata.row_group(1).column(0)  # audio.bytes of group 1
    assert meta.path_in_schema == "audio.bytes"
    data = bytearray(made.paths[0].read_bytes())
    data[meta.data_page_offset:meta.data_page_offset + 12] = b"\xff" * 12
    made.paths[0].write_bytes(bytes(data))
    index = build_index(_data(tmp_path / "pq"), FEATURES)  # the duration column: the audio is not read
    assert len(index.samples) == 8
    reader = Reader(tmp_path / "pq")
    assert load_member(reader, address_of("train-000.parquet#0:3"), 22050).size  # another group reads
    with pytest.raises(AudioError, match=r"unreadable: row 2 of row group 1 of train-000.parquet: row group 1 of "
                                         r"train-000.parquet cannot be read"):
        load_member(reader, address_of("train-000.parquet#1:2"), 22050)


def test_an_undecodable_row_is_rejected_by_the_index_or_by_the_reader_naming_file_and_row(tmp_path: Path) -> None:
    good = clip_member(1, 0.8, "wav")
    rows = {"id": ["ok", "junk"], "text": ["Some words.", "More words."],
            "audio": [{"bytes": good, "path": "ok.wav"},
                      {"bytes": b"this is no audio at all\n" * 40, "path": "j.flac"}]}
    write_parquet(tmp_path / "headers" / "train.parquet", rows, row_group=2)
    index = build_index(_data(tmp_path / "headers"), FEATURES)  # no duration column: the header is read
    assert [s.id for s in index.samples] == ["ok"]
    [rejection] = index.rejected
    assert rejection.id == "junk" and rejection.kind == "unreadable-audio" and rejection.file == "train.parquet#0:1"
    write_parquet(tmp_path / "timed" / "train.parquet", {**rows, "duration": [0.8, 0.8]}, row_group=2)
    index = build_index(_data(tmp_path / "timed"), FEATURES)  # a duration column: nothing read until a producer does
    assert sorted(s.id for s in index.samples) == ["junk", "ok"]
    with pytest.raises(AudioError, match="audio file unreadable: row 1 of row group 0 of train.parquet"):
        load_member(Reader(tmp_path / "timed"), address_of(index.sample("junk").audio), 22050)


def test_a_file_that_is_not_parquet_is_one_rejection_naming_it(tmp_path: Path) -> None:
    make_parquet(tmp_path / "pq", files=1, per_file=4)
    (tmp_path / "pq" / "zz.parquet").write_bytes(b"not a parquet file at all" * 10)
    index = build_index(_data(tmp_path / "pq"), FEATURES)
    assert len(index.samples) == 4
    [rejection] = index.rejected
    assert rejection.id == "file:zz.parquet" and rejection.reason.startswith("Parquet file zz.parquet cannot be read")


def test_a_path_column_names_audio_files_beside_the_parquet_file(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "clips").mkdir(parents=True)
    for n in range(3):
        (root / "clips" / f"c{n}.flac").write_bytes(clip_member(n, 0.7 + 0.1 * n))
    write_parquet(root / "data" / "train.parquet", {"file": [f"../clips/c{n}.flac" for n in range(3)],
                                                    "sentence": [f"Clip {n}." for n in range(3)]},
                  row_group=2, audio="")
    index = build_index(_data(root / "data"), FEATURES)
    assert index.rejected == []
    assert {s.id: s.audio for s in index.samples} == {f"train_{n}": f"../clips/c{n}.flac" for n in range(3)}
    assert index.stats.headers_read == 3


def test_a_row_whose_audio_struct_holds_no_bytes_is_the_file_its_path_names(tmp_path: Path) -> None:
    pa, pq = pyarrow_modules()
    root = tmp_path / "corpus"
    (root / "clips").mkdir(parents=True)
    (root / "clips" / "b.wav").write_bytes(clip_member(2, 0.9, "wav"))
    audio = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"audio": pa.array([{"bytes": clip_member(1, 0.8), "path": "a.flac"},
                                         {"bytes": None, "path": "clips/b.wav"}], audio),
                      "text": ["First clip.", "Second clip."]})
    pq.write_table(table, root / "train.parquet")
    index = build_index(_data(root / "train.parquet"), FEATURES)
    assert index.rejected == []
    assert {s.id: s.audio for s in index.samples} == {"train_0": "train.parquet#0:0", "train_1": "clips/b.wav"}
    assert index.sample("train_1").duration_s == pytest.approx(0.9, abs=1e-4)


def test_an_epoch_is_grouped_by_file_and_row_group(tmp_path: Path) -> None:
    made = make_parquet(tmp_path / "pq", files=2, per_file=6, row_group=4)
    index = build_index(_data(tmp_path / "pq"), FEATURES)
    numbers = shard_numbers(index.samples)
    groups = {(f, g) for f, g, _ in made.rows.values()}
    assert len(set(numbers.tolist())) == len(groups) == 4
    by_group = {}
    for row, sample in enumerate(index.samples):
        by_group.setdefault(made.rows[sample.id][:2], set()).add(int(numbers[row]))
    assert all(len(n) == 1 for n in by_group.values()) and len({min(n) for n in by_group.values()}) == 4


def test_without_pyarrow_a_parquet_dataset_is_one_line_naming_the_extra(tmp_path: Path, monkeypatch) -> None:
    make_parquet(tmp_path / "pq", files=1, per_file=2)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DatasetError, match=r"needs pyarrow: pip install 'stoker\[parquet\]'"):
        build_index(_data(tmp_path / "pq", index_cache="off"), FEATURES)


def test_a_warm_start_finds_the_index_by_the_files_stamps_without_reading_the_listing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Warm, a Parquet dataset's index is found by its files' names, sizes and stamps: the
    listing (every row's columns, or its cached copy) is not read; a file rewritten is read again."""
    from stoker.shared.dataset.corpus import parquet as corpus_parquet

    made = make_parquet(tmp_path / "pq", files=2, per_file=6, row_group=4)
    data = DataConfig(path=str(made.root), index_cache=str(tmp_path / "cache"))
    cold = build_index(data, FeaturesConfig())
    with monkeypatch.context() as m:
        for method in ("read", "audio", "walked"):
            m.setattr(corpus_parquet.Parquet, method, lambda *args: pytest.fail("the listing was read"))
        warm = build_index(data, FeaturesConfig())
    assert warm.stats.cache == "hit" and list(warm.samples) == list(cold.samples)
    write_parquet(made.paths[1], {"id": ["new"], "text": ["A new row."], "duration": [0.9],
                                  "audio": [{"bytes": clip_member(5, 0.9, "wav"), "path": "new.wav"}]}, row_group=1)
    again = build_index(data, FeaturesConfig())
    assert again.stats.cache != "hit" and "new" in {s.id for s in again.samples}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_large_parquet_dataset_built_in_pieces_is_the_listing_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      workers: int) -> None:
    """Built in pieces (consumer/index/parquet_pieces.py: a file's rows as manifest lines in a
    helper process), the index is the listing's: the same samples in the same order, the same
    rejections naming the same rows, the same vocabulary and fingerprints."""
    from stoker.consumer.index import parquet_pieces
    from stoker.shared.dataset import shards

    made = make_parquet(tmp_path / "pq", files=3, per_file=7, row_group=3)
    good = clip_member(90, 0.9, "wav")
    write_parquet(tmp_path / "pq" / "train-003.parquet", {  # rules' rejections and a repeat across files
        "id": ["long", "PQ0002", "blank", "fine"], "text": ["Far too long.", "A repeat.", "", "Fine words."],
        "duration": [99.0, 0.9, 0.9, 0.9], "audio": [{"bytes": good, "path": "g.wav"}] * 4}, row_group=2)
    data = DataConfig(path=str(made.root), index_cache=str(tmp_path / "one"), index_workers=workers)
    monkeypatch.setattr(parquet_pieces, "PARQUET_CHUNKED_MIN_ROWS", 1 << 40)
    one = build_index(data, FEATURES)
    monkeypatch.setattr(parquet_pieces, "PARQUET_CHUNKED_MIN_ROWS", 1)
    monkeypatch.setattr(parquet_pieces, "PIECE_ROWS", 4)  # a row group or two a piece: pieces of a file
    monkeypatch.setattr(shards, "list_file", lambda *args: pytest.fail("the rows were listed"))
    pieces = build_index(dataclasses.replace(data, index_cache=str(tmp_path / "pieces")), FEATURES)
    assert pieces.stats.workers == workers and pieces.stats.cache == "miss"
    assert list(pieces.samples) == list(one.samples) and len(one.samples) == 22
    assert pieces.rejected == one.rejected and {r.id for r in one.rejected} == {"long", "PQ0002", "blank"}
    assert "row 1 of row group 0 of train-003.parquet" in next(r.reason for r in one.rejected if r.id == "PQ0002")
    assert pieces.vocabulary.state_dict() == one.vocabulary.state_dict()
    assert {k: v for k, v in pieces.agreement.items() if k != "metadata_sha256"} == \
        {k: v for k, v in one.agreement.items() if k != "metadata_sha256"}
    warm = build_index(dataclasses.replace(data, index_cache=str(tmp_path / "pieces")), FEATURES)
    assert warm.stats.cache == "hit" and list(warm.samples) == list(one.samples)
