"""The index cache: a hit reads no header; every change rebuilds exactly what it must."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from stoker.consumer.index import parallel as parallel_module
from stoker.shared.config import DataConfig, FeaturesConfig, TextConfig
from stoker.shared.dataset.cache import index_cache_file
from stoker.consumer.index.index import build_index
from stoker.consumer.index.indexed import DatasetIndex
from stoker.shared.dataset import table as table_module
from tests.factories import add_clip, append_metadata, make_dataset
from tests.shared.user_tokenizers import TOKENIZER_ENV, train_bpe, write_editable

FEATURES = FeaturesConfig()
CLIPS = 10


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))  # never the real user's cache
    data = tmp_path / "data"
    make_dataset(data, count=CLIPS)
    append_metadata(data, ["GONE|no audio for this one|no audio for this one"])
    return data


def _data(root: Path, **kw) -> DataConfig:
    return DataConfig(path=str(root), **kw)


def _same(a: DatasetIndex, b: DatasetIndex) -> None:
    assert a.samples == b.samples
    assert a.rejected == b.rejected
    assert a.fingerprint == b.fingerprint


def test_second_build_is_a_hit_that_reads_no_header(root: Path) -> None:
    cold = build_index(_data(root), FEATURES)
    assert (cold.stats.cache, cold.stats.headers_read, cold.stats.headers_reused) == ("miss", CLIPS, 0)
    assert cold.stats.texts_tokenized == CLIPS + 1
    (cache_file,) = [p for p in index_cache_file(root, _data(root)) if p.exists()]
    assert cache_file.parent == root / ".stoker"
    warm = build_index(_data(root), FEATURES)
    assert (warm.stats.cache, warm.stats.headers_read, warm.stats.texts_tokenized) == ("hit", 0, 0)
    assert warm.stats.cache_file == str(cache_file)
    _same(cold, warm)


def _later(path: Path) -> None:
    """Move ``path``'s mtime a second on (a change its stamp shows, whatever the clock's grain)."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def test_touching_one_wav_and_the_metadata_rereads_that_header_only(root: Path) -> None:
    """A warm load looks at no audio file; a touched metadata file (the way to index again a file
    changed in place) makes it list them, and read again only the header that changed."""
    build_index(_data(root), FEATURES)
    _later(root / "wavs" / "T0003.wav")
    _later(root / "metadata.csv")
    index = build_index(_data(root), FEATURES)
    assert (index.stats.cache, index.stats.headers_read, index.stats.headers_reused) == ("stale", 1, CLIPS - 1)
    assert index.stats.texts_tokenized == 0
    assert build_index(_data(root), FEATURES).stats.cache == "hit"


def test_a_rewritten_wav_changes_its_sample(root: Path) -> None:
    before = build_index(_data(root), FEATURES).by_id()["T0002"]
    add_clip(root, "T0002", 2.0, metadata=False)  # same name, new length
    _later(root / "metadata.csv")
    index = build_index(_data(root), FEATURES)
    assert index.stats.headers_read == 1
    after = index.by_id()["T0002"]
    assert after.num_frames == 1 + 44100 // FEATURES.hop_length != before.num_frames


def test_a_new_clip_reads_only_its_header(root: Path) -> None:
    build_index(_data(root), FEATURES)
    add_clip(root, "NEW", 1.0)
    index = build_index(_data(root), FEATURES)
    assert (index.stats.headers_read, index.stats.headers_reused, index.stats.texts_tokenized) == (1, CLIPS, 1)
    assert "NEW" in index.by_id()


def test_an_edited_text_is_tokenized_again_alone(root: Path) -> None:
    build_index(_data(root), FEATURES)
    meta = root / "metadata.csv"
    lines = meta.read_text(encoding="utf-8").splitlines()
    lines[4] = "T0004|A brand new sentence for this clip.|A brand new sentence for this clip."
    meta.write_text("\n".join(lines) + "\n", encoding="utf-8")
    index = build_index(_data(root), FEATURES)
    assert (index.stats.cache, index.stats.headers_read, index.stats.texts_tokenized) == ("stale", 0, 1)
    assert index.by_id()["T0004"].text == "A brand new sentence for this clip."


@pytest.mark.parametrize("change", [
    {"data": {"max_audio_s": 1.0}},
    {"data": {"max_tokens": 40}},
    {"features": {"hop_length": 200}},
    {"features": {"padding": "end"}},
    {"features": {"sample_rate_hz": 16000, "fmax_hz": 8000.0}},
    {"text": {"max_lost_frac": 0.5}},
])
def test_a_config_key_the_index_depends_on_rederives_it_without_reading_headers(root: Path, change: dict) -> None:
    build_index(_data(root), FEATURES)
    data = dataclasses.replace(_data(root), **change.get("data", {}))
    features = dataclasses.replace(FEATURES, **change.get("features", {}))
    text = TextConfig(**change.get("text", {}))
    index = build_index(data, features, text)
    assert (index.stats.cache, index.stats.headers_read, index.stats.texts_tokenized) == ("stale", 0, 0)
    fresh = build_index(dataclasses.replace(data, index_cache="off"), features, text)
    _same(index, fresh)  # what was re-derived equals a build from scratch
    assert fresh.stats.cache == "off" and fresh.stats.headers_read == CLIPS


@pytest.mark.parametrize("change", [{"n_mels": 64}, {"backend": "numpy"}, {"log_floor": 1e-4}, {"mel_scale": "htk"}])
def test_a_config_key_the_index_ignores_keeps_the_cache(root: Path, change: dict) -> None:
    build_index(_data(root), FEATURES)
    assert build_index(_data(root), dataclasses.replace(FEATURES, **change)).stats.cache == "hit"


def test_a_cache_file_of_an_earlier_format_is_rebuilt_with_one_line(root: Path, caplog) -> None:
    cold = build_index(_data(root), FEATURES)
    path = Path(cold.stats.cache_file)
    path.write_bytes(b"STKIDX03" + bytes(32) + (8).to_bytes(8, "little") + b"\x80" * 8)  # the old layout's start
    with caplog.at_level(logging.INFO, logger="stoker.shared.dataset"):
        rebuilt = build_index(_data(root), FEATURES)
    assert rebuilt.stats.cache == "miss" and rebuilt.stats.headers_read == CLIPS
    said = [r.getMessage() for r in caplog.records if "index cache" in r.getMessage()]
    assert len(said) == 1 and "earlier stoker's format" in said[0], said
    _same(cold, rebuilt)
    assert build_index(_data(root), FEATURES).stats.cache == "hit"  # and rewritten in this format


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty"])
def test_a_corrupt_cache_file_is_rebuilt_from_scratch(root: Path, damage: str, caplog) -> None:
    cold = build_index(_data(root), FEATURES)
    path = Path(cold.stats.cache_file)
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0x40
    elif damage == "truncate":
        blob = blob[: len(blob) // 2]
    elif damage == "garbage":
        blob = bytearray(b"not a cache at all" * 10)
    else:
        blob = bytearray()
    path.write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING, logger="stoker.shared.dataset"):
        rebuilt = build_index(_data(root), FEATURES)
    assert (rebuilt.stats.cache, rebuilt.stats.headers_read, rebuilt.stats.headers_reused) == ("corrupt", CLIPS, 0)
    assert any("is corrupt" in r.getMessage() for r in caplog.records)
    _same(cold, rebuilt)
    assert build_index(_data(root), FEATURES).stats.cache == "hit"  # and rewritten


def test_read_only_dataset_falls_back_to_the_user_cache(root: Path, tmp_path: Path, caplog) -> None:
    (root / ".stoker").write_text("a file where the cache directory would go")  # mkdir fails, as on a read-only disk
    with caplog.at_level(logging.INFO, logger="stoker.shared.dataset"):
        cold = build_index(_data(root), FEATURES)
    assert Path(cold.stats.cache_file).is_relative_to(tmp_path / "user-cache" / "stoker" / "index")
    assert any("cannot write the index cache" in r.getMessage() for r in caplog.records)
    warm = build_index(_data(root), FEATURES)
    assert warm.stats.cache == "hit" and warm.stats.cache_file == cold.stats.cache_file


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """``directory`` refuses this process's writes: bound read-only over itself where mounting is
    permitted (a read-only filesystem, which root obeys too), else by its mode (which every user
    but root obeys)."""
    def mount(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)

    if mount("--bind", str(directory), str(directory)).returncode == 0:
        try:
            remounted = mount("-o", "remount,bind,ro", str(directory))
            assert remounted.returncode == 0, remounted.stderr
            yield
        finally:
            subprocess.run(["umount", str(directory)], capture_output=True, timeout=30)
        return
    if os.geteuid() == 0:
        pytest.skip("no read-only mount here, and root writes to a directory whatever its mode")
    os.chmod(directory, 0o555)
    try:
        yield
    finally:
        os.chmod(directory, 0o755)


def test_read_only_dataset_directory(root: Path, tmp_path: Path, caplog) -> None:
    """A dataset directory nothing may be written to (a read-only disk, another user's files):
    the index builds, its cache goes to the user cache, and the next build hits it there."""
    with read_only(root):
        with caplog.at_level(logging.INFO, logger="stoker.shared.dataset"):
            index = build_index(_data(root), FEATURES)
        assert len(index.samples) == CLIPS and not (root / ".stoker").exists()
        assert Path(index.stats.cache_file).is_relative_to(tmp_path / "user-cache")
        assert any(r.getMessage().startswith(f"cannot write the index cache in {root / '.stoker'} (")
                   for r in caplog.records), caplog.text
        assert build_index(_data(root), FEATURES).stats.cache == "hit"


def test_nothing_writable_still_indexes(root: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (root / ".stoker").write_text("blocked")
    (tmp_path / "user-cache").write_text("blocked too")
    index = build_index(_data(root), FEATURES)
    assert len(index.samples) == CLIPS and index.stats.cache_file == ""


def test_cache_off_and_cache_in_a_given_directory(root: Path, tmp_path: Path) -> None:
    off = build_index(_data(root, index_cache="off"), FEATURES)
    assert off.stats.cache == "off" and not (root / ".stoker").exists()
    elsewhere = tmp_path / "index-cache"
    first = build_index(_data(root, index_cache=str(elsewhere)), FEATURES)
    assert Path(first.stats.cache_file).parent == elsewhere and not (root / ".stoker").exists()
    assert build_index(_data(root, index_cache=str(elsewhere)), FEATURES).stats.cache == "hit"


def test_parallel_build_equals_serial_build(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel_module, "PARALLEL_MIN_SECONDS", 0.0)
    monkeypatch.setattr(parallel_module, "CHUNK_ITEMS", 3)
    serial = build_index(_data(root, index_cache="off", index_workers=1), FEATURES)
    parallel = build_index(_data(root, index_cache="off", index_workers=2), FEATURES)
    assert (serial.stats.workers, parallel.stats.workers) == (1, 2)
    assert parallel.stats.headers_read == CLIPS
    _same(serial, parallel)


def test_a_warm_load_maps_the_rows_in_id_order(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cold = build_index(_data(root), FEATURES)
    ids = cold.samples.ids()
    assert cold.samples.id_order().tolist() == sorted(range(len(ids)), key=ids.__getitem__)

    def never(*args, **kwargs):
        raise AssertionError("the warm load sorts the ids")

    monkeypatch.setattr(table_module, "fixed_width", never)
    warm = build_index(_data(root), FEATURES)
    assert warm.stats.cache == "hit" and warm.samples.id_order().tolist() == cold.samples.id_order().tolist()


class _Store:
    """A file system whose info() says ``info``."""

    def __init__(self, info: dict) -> None:
        self._info = info

    def invalidate_cache(self, path: str) -> None:
        return None

    def info(self, path: str) -> dict:
        return self._info


def test_a_file_stamp_is_its_size_and_version_or_time_and_empty_without_them(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.shared.dataset import storage

    path = tmp_path / "train.jsonl"
    path.write_text("x")
    st = path.stat()
    assert storage.file_stamp(str(path)) == f"size=1;mtime_ns={st.st_mtime_ns}"
    assert storage.file_stamp(str(tmp_path / "absent.jsonl")) == ""
    infos = [({"size": 5, "ETag": '"abc"', "LastModified": "then", "VersionId": "v2"},
              'size=5;VersionId=v2;ETag="abc"'),
             ({"size": 5, "LastModified": "then"}, "size=5;LastModified=then"),
             ({"size": 5, "generation": 17, "updated": "then"}, "size=5;generation=17"),
             ({"size": 5}, ""),  # neither a version nor a time: the content is hashed instead
             ({"ETag": "abc"}, "")]
    for info, stamp in infos:
        monkeypatch.setattr(storage, "url_fs", lambda url, info=info: (_Store(info), url))
        assert storage.file_stamp("s3://bucket/train.jsonl") == stamp


def test_feature_cache_dir_setting(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.shared.dataset.cache import feature_cache_dir

    assert feature_cache_dir("", root) == ""
    assert feature_cache_dir("auto", root) == str(root / ".stoker" / "features")
    monkeypatch.chdir(tmp_path)
    assert feature_cache_dir("rel/cache", root) == str(tmp_path / "rel" / "cache")
    other = tmp_path / "other"
    make_dataset(other, count=1)
    (other / ".stoker").write_text("blocked")
    assert feature_cache_dir("AUTO", other) == str(tmp_path / "user-cache" / "stoker" / "features")


def test_a_front_end_change_sends_every_text_through_it_again_but_reads_no_header(root: Path) -> None:
    build_index(_data(root), FEATURES)
    index = build_index(_data(root), FEATURES, TextConfig(digits="keep"))
    texts = len((root / "metadata.csv").read_text(encoding="utf-8").splitlines())  # rejected clips' texts too
    assert (index.stats.cache, index.stats.headers_read, index.stats.texts_tokenized) == ("stale", 0, texts)
    assert build_index(_data(root), FEATURES, TextConfig(digits="keep")).stats.cache == "hit"


def test_an_edited_user_tokenizer_tokenizes_again_without_a_version_bump(root: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache key holds the hash of the tokenizer's source: editing it re-tokenizes every text
    (with the edited code, in this same process) though ``__version__`` stayed."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"tokenizer_{tmp_path.name}"
    text = TextConfig(frontend=write_editable(tmp_path, name, 2))
    before = build_index(_data(root), FEATURES, text)
    assert build_index(_data(root), FEATURES, text).stats.cache == "hit"
    write_editable(tmp_path, name, 30)
    after = build_index(_data(root), FEATURES, text)
    assert (after.stats.cache, after.stats.headers_read, after.stats.texts_tokenized) == ("stale", 0, CLIPS + 1)
    for old, new in zip(before.samples, after.samples):
        assert [int(i) + 28 for i in old.units.split()] == [int(i) for i in new.units.split()]
    assert after.vocabulary == before.vocabulary  # the version names the ids a run saved: they keep loading
    assert build_index(_data(root), FEATURES, text).stats.cache == "hit"



def test_a_tokenizer_object_s_lengths_are_the_index_s_and_another_tokenizer_is_another_index(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hugging Face tokenizer's factory as the front-end: each clip's units are its ids, its
    token count their number (data.max_tokens rejects by it), the vocabulary its size; the
    same tokenizer is a cache hit, another one at the same file (in this same process, the
    settings unchanged) a re-tokenized index."""
    pytest.importorskip("tokenizers")
    lines = (root / "metadata.csv").read_text(encoding="utf-8").splitlines()
    texts = {line.split("|")[0]: line.split("|")[2] for line in lines}
    path = tmp_path / "bpe.json"
    monkeypatch.setenv(TOKENIZER_ENV, str(path))
    text = TextConfig(frontend="tests.shared.user_tokenizers:hf_tokenizer")
    vocabularies, limit = [], 0
    for size in (80, 70):
        tokenizer = train_bpe(list(texts.values()), path, vocab_size=size)
        lengths = {i: len(tokenizer.encode(t).ids) for i, t in texts.items()}
        limit = limit or sorted(lengths.values())[3 * len(lengths) // 4]  # some of the first one's texts are longer
        index = build_index(_data(root, max_tokens=limit), FEATURES, text)
        assert index.stats.cache == ("miss" if size == 80 else "stale")
        assert index.vocabulary is not None and index.vocabulary.size == tokenizer.get_vocab_size() == size
        vocabularies.append(index.vocabulary)
        for sample in index.samples:
            assert [int(i) for i in sample.units.split()] == tokenizer.encode(texts[sample.id]).ids
            assert sample.num_tokens == lengths[sample.id] <= limit
        too_long = {r.id for r in index.rejected if "data.max_tokens" in r.reason}
        assert too_long == {i for i, n in lengths.items() if n > limit} and too_long and index.samples
        assert build_index(_data(root, max_tokens=limit), FEATURES, text).stats.cache == "hit"
    assert vocabularies[0].engine["config"] != vocabularies[1].engine["config"]


class _Counted:
    """os.stat, os.scandir and os.listdir counted by the path they are given, or their dir_fd's
    directory (scan_audio stats each file relative to the audio directory's descriptor)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name in ("stat", "scandir", "listdir"):
            monkeypatch.setattr(os, name, self._counting(getattr(os, name)))

    def _counting(self, real):
        def counted(path=".", *args, **kwargs):
            fd = kwargs.get("dir_fd")
            where = os.readlink(f"/proc/self/fd/{fd}") if fd is not None else ""
            self.calls.append(os.path.join(where, os.fsdecode(path)) if not isinstance(path, int) else where)
            return real(path, *args, **kwargs)
        return counted

    def under(self, directory: Path) -> list[str]:
        return [c for c in self.calls if c == str(directory) or c.startswith(f"{directory}/")]


def test_a_warm_load_stats_and_lists_no_audio_file(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the cache warm, a start reads the cache and the metadata's stamp: no listing of wavs/
    and no stat of a clip's file (a million of them took 11.7 s), but the one clip rejected as
    missing, looked for (it may have come since). The same build, cold, lists and stats them all."""
    cold_calls = _Counted(monkeypatch)
    cold = build_index(_data(root), FEATURES)
    assert len(cold_calls.under(root / "wavs")) > CLIPS  # the cold build's listing: a stat a file, and the dir
    monkeypatch.undo()
    warm_calls = _Counted(monkeypatch)
    warm = build_index(_data(root), FEATURES)
    assert (warm.stats.cache, warm.stats.headers_read) == ("hit", 0)
    assert warm_calls.under(root / "wavs") == [str(root / "wavs" / "GONE.wav")]
    _same(cold, warm)


def test_the_index_holds_each_clips_file_as_listed(root: Path) -> None:
    """Each clip's audio file size and mtime are columns of the index (a lease carries them), the
    same from the cache as built."""
    cold = build_index(_data(root), FEATURES)
    warm = build_index(_data(root), FEATURES)
    for index in (cold, warm):
        table = index.samples
        stats = [(root / s.audio).stat() for s in table]
        assert table.column("file_size").tolist() == [st.st_size for st in stats]
        assert table.column("file_mtime_ns").tolist() == [st.st_mtime_ns for st in stats]


def test_a_clip_missing_at_indexing_whose_file_comes_is_indexed(root: Path) -> None:
    """The files of clips rejected as missing are looked for on a warm start: one that has come
    makes the start list the audio, and the clip is indexed."""
    assert "GONE" in {r.id for r in build_index(_data(root), FEATURES).rejected}
    add_clip(root, "GONE", 1.0, metadata=False)
    index = build_index(_data(root), FEATURES)
    assert index.stats.cache == "stale" and index.stats.headers_read == 1
    assert "GONE" in index.by_id() and not index.rejected


def test_a_touched_metadata_file_is_found_the_long_way_once(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A metadata file touched but not changed misses the stamp: the start lists the audio and
    finds the cache by its content, which it stamps anew, so the next start lists nothing."""
    build_index(_data(root), FEATURES)
    _later(root / "metadata.csv")
    calls = _Counted(monkeypatch)
    assert build_index(_data(root), FEATURES).stats.cache == "hit"
    assert len(calls.under(root / "wavs")) > CLIPS  # the long way: the listing
    calls.calls.clear()
    index = build_index(_data(root), FEATURES)
    assert (index.stats.cache, calls.under(root / "wavs")) == ("hit", [str(root / "wavs" / "GONE.wav")])
