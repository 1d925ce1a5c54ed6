"""A manifest with durations built in pieces (consumer/index/chunked.py and pieces.py) is the
index the one-process build makes: the same samples in the same order, the same rejections with
the same reasons and lines, the same vocabulary, fingerprints and cache file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stoker.shared.config import DataConfig, FeaturesConfig, TextConfig
from stoker.consumer.index.index import build_index
from stoker.consumer.index import chunked as chunked_module
from stoker.shared.dataset.corpus import manifest as manifest_module
from stoker.shared.dataset.corpus.base import Located
from stoker.consumer.index import index as index_module
from stoker.consumer.index import pieces as pieces_module
from stoker.consumer.index import spill as spill_module
from stoker.shared.dataset import table as table_module

FEATURES = FeaturesConfig()


def _lines() -> list[bytes]:
    """A manifest's lines (each ending in a line end), good ones and some of every fault."""
    rows: list[bytes] = []
    for i in range(60):
        row = {"audio_filepath": f"audio/a{i % 3}.wav", "id": f"c{i:03d}", "text": f"clip number {i}, said.",
               "duration": 0.5 + (i % 7) / 10, "speaker": f"s{i % 4}"}
        if i % 11 == 3:
            row["language"] = "de"
            row["text"] = f"Grüße Nummer {i}."
        rows.append(json.dumps(row, ensure_ascii=i % 2 == 0).encode() + (b"\r\n" if i % 9 == 4 else b"\n"))
    bad = {
        5: b'{"audio_filepath": "audio/a0.wav", "text": "no end"\n',  # not JSON
        9: b'[1, 2]\n',  # not an object
        12: b'{"audio_filepath": "audio/a0.wav", "id": "c001", "text": "a repeat", "duration": 1.0}\n',
        17: b'\n',  # blank
        20: b'{"audio_filepath": "audio/a1.wav", "id": "snow", "text": "\xe2\x98\x83\xe2\x98\x83 x", '
            b'"duration": 1.0}\n',  # loses characters
        24: b'{"audio_filepath": "audio/a1.wav", "id": "bad\xff", "text": "x", "duration": 1.0}\n',  # not UTF-8
        27: b'{"audio_filepath": "audio/a1.wav", "id": "long", "text": "too long", "duration": 99.0}\n',
        31: b'{"audio_filepath": "audio/a1.wav", "id": "empty", "text": "", "duration": 1.0}\n',
        33: b'{"audio_filepath": "audio/a1.wav", "id": "xx", "text": "unknown language", "language": "zz", '
            b'"duration": 1.0}\n',
        38: b'{"audio_filepath": "audio/a1.wav", "id": "many", "text": "' + b"word " * 80 + b'", "duration": 1.0}\n',
        44: b'{"audio_filepath": "audio/a1.wav", "id": "c040", "text": "a later repeat", "duration": 1.0}\n',
        50: b'{"audio_filepath": "audio/a2.wav", "id": "snow", "text": "again", "duration": 1.0}\n',
        55: b'{"audio_filepath": "audio/a2.wav", "id": "lone", "text": "\\ud800", "duration": 1.0}\n',
        58: b'{"id": "noaudio", "text": "x", "duration": 1.0}\r',
    }
    for at in sorted(bad, reverse=True):
        rows.insert(at, bad[at])
    rows.append(b'{"audio_filepath": "audio/a0.wav", "id": "c059", "text": "the last, a repeat", "duration": 2.0}')
    return [b"\xef\xbb\xbf" + rows[0], *rows[1:]]


def _build(root: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, chunked: bool, workers: int = 1,
           max_lost_frac: float = 0.0):
    monkeypatch.setattr(index_module, "CHUNKED_MIN_BYTES", 1 if chunked else 1 << 40)
    monkeypatch.setattr(chunked_module, "BUILD_CHUNK_BYTES", 700)  # a few lines a piece
    data = DataConfig(path=str(root), metadata_file="train.jsonl", index_cache=str(cache), index_workers=workers,
                      max_tokens=200)
    return build_index(data, FEATURES, TextConfig(max_lost_frac=max_lost_frac))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("workers", "max_lost_frac"), [(1, 0.0), (2, 0.0), (1, 0.7)])
def test_the_chunked_build_is_the_one_process_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     workers: int, max_lost_frac: float) -> None:
    root = tmp_path / "data"
    root.mkdir()
    (root / "train.jsonl").write_bytes(b"".join(_lines()))
    one = _build(root, tmp_path / "one", monkeypatch, chunked=False, max_lost_frac=max_lost_frac)
    with monkeypatch.context() as m:  # the rows in id order from the fingerprints' sort, not a second one
        m.setattr(table_module, "fixed_width", lambda *args: pytest.fail("the ids are sorted again"))
        pieces = _build(root, tmp_path / "pieces", monkeypatch, chunked=True, workers=workers,
                        max_lost_frac=max_lost_frac)
    assert len(pieces_module.manifest_ranges(root / "train.jsonl", 700)) > 5  # many pieces, repeats across them
    assert pieces.stats.workers == workers
    assert list(pieces.samples) == list(one.samples) and len(one.samples) > 40
    assert pieces.rejected == one.rejected
    reasons = " ".join(r.reason for r in one.rejected)
    assert any(s.id == "snow" for s in one.samples) == (max_lost_frac > 0)  # lost characters, yet a clip
    for fault in ("is not JSON", "duplicate id on manifest line", "not valid UTF-8", "longer than", "empty text",
                  "unknown language", "exceeds data.max_tokens", "lone surrogate", "lacks 'audio_filepath'"):
        assert fault in reasons
    assert pieces.lost == one.lost and one.lost["clips"] == 1
    assert pieces.vocabulary.state_dict() == one.vocabulary.state_dict()
    assert pieces.samples.speakers == one.samples.speakers and pieces.samples.languages == one.samples.languages
    assert pieces.fingerprint == one.fingerprint and pieces.agreement == one.agreement
    (one_file,) = (tmp_path / "one").iterdir()
    (pieces_file,) = (tmp_path / "pieces").iterdir()
    assert pieces_file.read_bytes() == one_file.read_bytes()
    ids = one.samples.ids()  # the rows in id order, taken from the fingerprints' sort of the pieces' ids
    by_id = sorted(range(len(ids)), key=ids.__getitem__)
    assert pieces.samples.id_order().tolist() == by_id and (by_id != list(range(len(ids)))) == (max_lost_frac > 0)
    warm = _build(root, tmp_path / "pieces", monkeypatch, chunked=True, max_lost_frac=max_lost_frac)
    assert warm.stats.cache == "hit" and list(warm.samples) == list(one.samples)


def test_a_manifest_with_a_clip_without_duration_takes_the_one_process_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "data"
    root.mkdir()
    lines = _lines()
    lines.insert(30, b'{"audio_filepath": "audio/none.wav", "id": "nodur", "text": "no duration"}\n')
    (root / "train.jsonl").write_bytes(b"".join(lines))
    one = _build(root, tmp_path / "one", monkeypatch, chunked=False)
    pieces = _build(root, tmp_path / "pieces", monkeypatch, chunked=True)
    assert list(pieces.samples) == list(one.samples) and pieces.rejected == one.rejected
    assert any(r.id == "nodur" and r.kind == "missing-audio" for r in pieces.rejected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunked", [False, True])
def test_a_manifest_cache_is_found_by_the_manifest_stamp_then_by_its_content(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunked: bool) -> None:
    root = tmp_path / "data"
    root.mkdir()
    manifest = root / "train.jsonl"
    manifest.write_bytes(b"".join(_lines()))
    cold = _build(root, tmp_path / "cache", monkeypatch, chunked)

    def never(*args, **kwargs):
        raise AssertionError("the manifest is read")

    with monkeypatch.context() as m:  # its size and mtime as cached: not a byte of it read
        for module, name in ((index_module, "sha256_of"), (manifest_module.Manifest, "read"),
                             (chunked_module, "manifest_ranges")):
            m.setattr(module, name, never)
        warm = _build(root, tmp_path / "cache", monkeypatch, chunked)
    assert warm.stats.cache == "hit" and list(warm.samples) == list(cold.samples)
    stat = manifest.stat()
    os.utime(manifest, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # touched: the same bytes
    with monkeypatch.context() as m:  # found by its content's hash, nothing parsed
        m.setattr(Located, "clips", never)  # the build's entries (the audio listing's parse is the key's)
        m.setattr(chunked_module, "_run_chunks", never)
        touched = _build(root, tmp_path / "cache", monkeypatch, chunked)
    assert touched.stats.cache == "hit" and list(touched.samples) == list(cold.samples)
    manifest.write_bytes(b"".join(_lines()).replace(b"clip number 7,", b"clip numero 7,"))  # edited
    edited = _build(root, tmp_path / "cache", monkeypatch, chunked)
    assert edited.stats.cache == "stale" and edited.sample("c007").text == "clip numero 7, said."
    monkeypatch.setattr(manifest_module, "file_stamp", lambda where: "")  # a store that gives no version nor time
    _build(root, tmp_path / "unstamped", monkeypatch, chunked)
    with monkeypatch.context() as m:  # found by the manifest's hash: read once (whole, a small one), not parsed
        if chunked:
            m.setattr(manifest_module.Manifest, "read", never)
        else:
            m.setattr(Located, "clips", never)
        m.setattr(chunked_module, "manifest_ranges", never)
        again = _build(root, tmp_path / "unstamped", monkeypatch, chunked)
    assert again.stats.cache == "hit" and list(again.samples) == list(edited.samples)


@pytest.mark.timeout(60)
def test_a_clean_manifest_of_sorted_ids_is_the_one_process_build(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every line clean (each piece checked a column at a time), the ids of one width and in order
    (their fingerprint lines hashed as they are): the same index and cache file."""
    root = tmp_path / "data"
    root.mkdir()
    (root / "train.jsonl").write_bytes(b"".join(
        json.dumps({"audio_filepath": f"audio/a{i % 3}.wav", "id": f"c{i:03d}", "text": f"Clip `{i}`,  said.",
                    "duration": 0.5 + (i % 7) / 10, "speaker": i % 4}).encode() + b"\n" for i in range(80)))
    one = _build(root, tmp_path / "one", monkeypatch, chunked=False)
    pieces = _build(root, tmp_path / "pieces", monkeypatch, chunked=True, workers=2)
    assert len(pieces_module.manifest_ranges(root / "train.jsonl", 700)) > 5
    assert list(pieces.samples) == list(one.samples) and len(one.samples) == 80 and one.rejected == []
    assert pieces.agreement == one.agreement and pieces.vocabulary.state_dict() == one.vocabulary.state_dict()
    (one_file,) = (tmp_path / "one").iterdir()
    (pieces_file,) = (tmp_path / "pieces").iterdir()
    assert pieces_file.read_bytes() == one_file.read_bytes()


def _one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The dataset of :func:`_lines` and its one-process index."""
    root = tmp_path / "data"
    root.mkdir()
    (root / "train.jsonl").write_bytes(b"".join(_lines()))
    return root, _build(root, tmp_path / "one", monkeypatch, chunked=False)


@pytest.mark.timeout(60)
def test_the_chunked_build_merges_a_few_keys_at_a_time_into_the_same_index(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The runs read two keys at a time (many rounds, repeats across them): the same cache file;
    no run file is left."""
    root, one = _one_process(tmp_path, monkeypatch)
    monkeypatch.setattr(spill_module, "MIN_BLOCK_ROWS", 2)
    monkeypatch.setattr(spill_module, "MERGE_BUDGET_BYTES", 1)
    pieces = _build(root, tmp_path / "pieces", monkeypatch, chunked=True, workers=2)
    assert list(pieces.samples) == list(one.samples) and pieces.rejected == one.rejected
    (one_file,) = (tmp_path / "one").iterdir()
    (pieces_file,) = (tmp_path / "pieces").iterdir()  # the spill directory beside it is gone
    assert pieces_file.read_bytes() == one_file.read_bytes()


@pytest.mark.timeout(60)
def test_the_chunked_build_without_a_cache_maps_a_file_of_its_own(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    root, one = _one_process(tmp_path, monkeypatch)
    monkeypatch.setattr(index_module, "CHUNKED_MIN_BYTES", 1)
    monkeypatch.setattr(chunked_module, "BUILD_CHUNK_BYTES", 700)
    data = DataConfig(path=str(root), metadata_file="train.jsonl", index_cache="off", max_tokens=200)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    off = build_index(data, FEATURES, TextConfig())
    assert off.stats.cache == "off" and list(off.samples) == list(one.samples) and off.agreement == one.agreement
    assert list((tmp_path / "tmp").iterdir()) == []  # its spill directory removed, the file mapped still


@pytest.mark.timeout(60)
def test_the_runs_are_given_back_as_the_cache_is_written_so_the_disk_peaks_at_the_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After each section the cache file's write adds, the run files and the cache file written
    so far hold no more than the runs did before it began (they held both at the end); the same
    cache file."""
    root, one = _one_process(tmp_path, monkeypatch)
    held: list[int] = []
    add = chunked_module.IndexWriter.add

    def measured(writer, name, data) -> None:
        if str(writer.f.name).endswith(".run"):  # a piece's run file, not the cache file
            add(writer, name, data)
            return
        spill = next((tmp_path / "pieces").glob(".spill-*"))
        if not held:
            held.append(sum(p.stat().st_size for p in spill.glob("*.run")))
        add(writer, name, data)
        writer.f.flush()
        held.append(sum(p.stat().st_size for p in spill.glob("*.run")) + writer.f.tell())

    monkeypatch.setattr(chunked_module.IndexWriter, "add", measured)
    pieces = _build(root, tmp_path / "pieces", monkeypatch, chunked=True, workers=2)
    assert len(held) > 10 and max(held[1:]) <= held[0]
    assert list(pieces.samples) == list(one.samples)
    (one_file,) = (tmp_path / "one").iterdir()
    (pieces_file,) = (tmp_path / "pieces").iterdir()
    assert pieces_file.read_bytes() == one_file.read_bytes()


@pytest.mark.timeout(60)
def test_a_cache_write_that_fails_after_the_runs_were_given_back_is_built_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The disk full halfway through the cache file: its runs are gone, so the build is done
    again (one warning) and its cache file is the one-process build's."""
    root, one = _one_process(tmp_path, monkeypatch)
    add = chunked_module.IndexWriter.add
    failed: list[str] = []

    def full_once(writer, name, data) -> None:
        if name == "s.text" and not failed:
            failed.append(name)
            raise OSError(28, "No space left on device")
        add(writer, name, data)

    monkeypatch.setattr(chunked_module.IndexWriter, "add", full_once)
    with caplog.at_level("WARNING"):
        pieces = _build(root, tmp_path / "pieces", monkeypatch, chunked=True)
    assert failed and "building it again" in caplog.text
    assert list(pieces.samples) == list(one.samples) and pieces.rejected == one.rejected
    (one_file,) = (tmp_path / "one").iterdir()
    (pieces_file,) = (tmp_path / "pieces").iterdir()
    assert pieces_file.read_bytes() == one_file.read_bytes()
