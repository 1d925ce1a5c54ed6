"""Tests for shared/dataset/shards.py: WebDataset-style tar shards indexed as a dataset, each clip
located in its shard, every faulty member a rejection naming the shard and the member."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import fsspec
import numpy as np
import pytest
import soundfile

from stoker.producer.audio import AudioError, AudioMissing, load_audio, load_member
from stoker.service import data_path
from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.shared.dataset.agreement import scan_dataset
from stoker.shared.dataset.corpus.registry import locate
from stoker.consumer.index.index import build_index
from stoker.shared.dataset import storage
from stoker.shared.dataset.cache import remote_root
from stoker.shared.dataset.corpus import url as url_module
from stoker.shared.dataset.corpus.address import Member, address_of, member_of
from stoker.shared.dataset.corpus.registry import format_of
from stoker.shared.dataset.shards import expand_braces
from stoker.shared.dataset.storage import Reader
from stoker.shared.dataset.probe import probe_url
from stoker.shared.dataset.layouts import COLUMNS_AUTO, parse_manifest
from tests.factories import add_shard, clip_member, loose_copy, make_shards, tone

FEATURES = FeaturesConfig()


def _data(path: str | Path, **kw) -> DataConfig:
    return DataConfig(path=str(path), **{"index_workers": 1, **kw})


def _member_bytes(path: Path, member: str) -> bytes:
    with tarfile.open(path) as tar:
        return tar.extractfile(member).read()


def test_shards_index_every_clip_with_its_text_speaker_language_and_member(tmp_path: Path) -> None:
    shards = make_shards(tmp_path / "shards")
    index = build_index(_data(tmp_path / "shards"), FEATURES)
    assert index.rejected == []
    got = {s.id: (s.text, s.speaker, s.language) for s in index.samples}
    assert got == shards.clips
    for sample in index.samples:
        locator = member_of(sample.audio)
        shard, member = shards.members[sample.id]
        assert (locator.shard, locator.member) == (shard, member)
        raw = (tmp_path / "shards" / shard).read_bytes()[locator.offset:locator.offset + locator.size]
        assert raw == _member_bytes(tmp_path / "shards" / shard, member)
    assert index.stats.headers_read == len(shards.clips)  # no JSON gave a duration: every header read


def test_the_same_clips_index_alike_from_shards_and_from_loose_files(tmp_path: Path) -> None:
    shards = make_shards(tmp_path / "shards")
    loose = loose_copy(shards, tmp_path / "loose")
    from_shards = {s.id: (s.num_frames, s.num_tokens, s.duration_s) for s in
                   build_index(_data(tmp_path / "shards"), FEATURES).samples}
    from_files = {s.id: (s.num_frames, s.num_tokens, s.duration_s) for s in build_index(_data(loose), FEATURES).samples}
    assert from_shards == from_files


def test_json_durations_skip_the_audio_headers(tmp_path: Path) -> None:
    shards = make_shards(tmp_path / "shards", durations=True)
    index = build_index(_data(tmp_path / "shards"), FEATURES)
    with_json = [i for i, (_, speaker, _) in shards.clips.items() if speaker != "default"]
    assert index.stats.headers_read == len(shards.clips) - len(with_json)
    exact = {s.id: s for s in build_index(_data(tmp_path / "shards", index_cache="off"), FEATURES).samples}
    for sample in index.samples:  # the duration given is the file's, to the microsecond
        assert sample.num_frames == exact[sample.id].num_frames
        assert sample.duration_s == pytest.approx(exact[sample.id].duration_s, abs=1e-6)


def test_faulty_members_are_rejections_naming_shard_and_member(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    shards = make_shards(root, shards=2, per_shard=3)
    good = clip_member(7)
    add_shard(root, "train-002.tar", {
        "JUNK.flac": b"this is no audio at all\n" * 40, "JUNK.txt": b"Junk bytes named like audio.",
        "NOTEXT.flac": good,
        "NOAUDIO.txt": b"Text without a clip.",
        "BADJSON.flac": good, "BADJSON.json": b"{not json",
        "SH0000.flac": good, "SH0000.txt": b"The same id as a clip of the first shard.",
        "OK1.flac": good, "OK1.json": json.dumps({"text": "A good clip.", "speaker": 3}).encode(),
    })
    cut = add_shard(root, "train-003.tar", {"OK2.flac": good, "OK2.txt": b"Before the cut.",
                                            "CUT.flac": clip_member(8, 1.5), "CUT.txt": b"Cut short."})
    raw = cut.read_bytes()
    with tarfile.open(cut) as tar:
        member = tar.getmember("CUT.flac")
    cut.write_bytes(raw[:member.offset_data + member.size // 2])
    index = build_index(_data(root), FEATURES)
    reasons = {r.id: r.reason for r in index.rejected}
    assert reasons["JUNK"].startswith("audio file unreadable: train-002.tar#JUNK.flac@")
    assert reasons["NOTEXT"].startswith("no text (a .txt member, or a .json member with 'text') for NOTEXT.* of "
                                        "shard train-002.tar")
    assert reasons["NOAUDIO"] == "no audio member for NOAUDIO.* of shard train-002.tar (members: NOAUDIO.txt)"
    assert reasons["BADJSON"].startswith("BADJSON.json is not JSON")
    assert reasons["SH0000"] == ("duplicate id SH0000: SH0000.* of shard train-002.tar "
                                 "(first in shard train-000.tar)")
    assert reasons["CUT"] == (f"member CUT.flac of shard train-003.tar is truncated: the shard holds "
                              f"{member.size // 2} of its {member.size} bytes")
    assert {s.id for s in index.samples} == set(shards.clips) | {"OK1", "OK2"}
    assert {s.id: s.speaker for s in index.samples}["OK1"] == "3"


def test_an_unreadable_tar_header_ends_its_shard_with_one_rejection(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    shards = make_shards(root, shards=1, per_shard=4)
    path = add_shard(root, "train-001.tar", {"A.flac": clip_member(1), "A.txt": b"First clip.",
                                             "B.flac": clip_member(2), "B.txt": b"Second clip."})
    raw = bytearray(path.read_bytes())
    with tarfile.open(path) as tar:
        second = tar.getmember("B.flac").offset
    raw[second:second + 512] = b"\x07" * 512  # a header that is no header
    path.write_bytes(bytes(raw))
    index = build_index(_data(root), FEATURES)
    assert [r.reason for r in index.rejected if r.id == "shard:train-001.tar"] == [
        f"shard train-001.tar has an unreadable tar header at byte {second} (invalid header): the members after "
        f"it are not indexed"]
    assert {s.id for s in index.samples} == set(shards.clips) | {"A"}


def test_data_names_shards_as_a_directory_a_file_a_brace_pattern_or_a_glob(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    make_shards(root, shards=3, per_shard=2)
    assert locate(str(root), "metadata.csv").where == (root.resolve(), "*.tar")
    assert locate(str(root / "train-001.tar"), "metadata.csv").where == (root.resolve(), "train-001.tar")
    assert expand_braces("train-{000..002}.tar") == ["train-000.tar", "train-001.tar", "train-002.tar"]
    assert expand_braces("{a,b}-{8..10}.tar") == ["a-8.tar", "a-9.tar", "a-10.tar", "b-8.tar", "b-9.tar", "b-10.tar"]
    counts = {pattern: len(build_index(_data(root / pattern), FEATURES, ).samples)
              for pattern in ("train-{000..001}.tar", "train-00[12].tar", "train-002.tar")}
    assert counts == {"train-{000..001}.tar": 4, "train-00[12].tar": 4, "train-002.tar": 2}


def test_a_producer_scan_of_shards_agrees_with_the_index(tmp_path: Path) -> None:
    make_shards(tmp_path / "shards", shards=2, per_shard=3)
    index = build_index(_data(tmp_path / "shards"), FEATURES)
    root, metadata_file = locate(str(tmp_path / "shards"), "metadata.csv").where
    scan = scan_dataset(root, metadata_file)
    assert (scan.metadata_fp, scan.audio_fp) == (index.scan.metadata_fp, index.scan.audio_fp)
    assert scan.files == {s.id: s.audio for s in index.samples}
    assert all(isinstance(address_of(name), Member) for name in scan.files.values())


def test_a_member_decodes_to_the_same_samples_as_its_loose_file(tmp_path: Path) -> None:
    shards = make_shards(tmp_path / "shards", shards=2, per_shard=3)
    loose = loose_copy(shards, tmp_path / "loose")
    index = build_index(_data(tmp_path / "shards"), FEATURES)
    reader = Reader(tmp_path / "shards")
    for sample in index.samples:
        member = shards.members[sample.id][1].rpartition("/")[2]
        expected = load_audio(loose / "wavs" / member, 16000)
        np.testing.assert_array_equal(load_member(reader, member_of(sample.audio), 16000), expected)
    stereo = tmp_path / "stereo.wav"  # 16-bit PCM read without libsndfile: the same samples, any channels
    soundfile.write(str(stereo), tone(0.7, 16000, seed=5, channels=2), 16000, subtype="PCM_16")
    add_shard(tmp_path / "shards", "train-009.tar", {"ST.wav": stereo.read_bytes(), "ST.txt": b"Two channels."})
    sample = {s.id: s for s in build_index(_data(tmp_path / "shards"), FEATURES).samples}["ST"]
    for rate in (16000, 22050):
        np.testing.assert_array_equal(load_member(reader, member_of(sample.audio), rate), load_audio(stereo, rate))
    reader.close()


def test_the_shards_listing_is_cached_until_a_shard_changes(tmp_path: Path, monkeypatch) -> None:
    from stoker.shared.dataset import shards as shards_module

    made = make_shards(tmp_path / "shards", shards=2, per_shard=3)
    first = shards_module.read_shards(made.root, "*.tar")
    walked: list[str] = []
    real_open = shards_module.open_file
    monkeypatch.setattr(shards_module, "open_file", lambda path: walked.append(path) or real_open(path))
    shards_module._LISTINGS.clear()  # a new process: only the cache file is left
    again = shards_module.read_shards(made.root, "*.tar")
    assert walked == [] and (again.lines, again.audio, again.rejected) == (first.lines, first.audio, first.rejected)
    add_shard(made.root, "train-002.tar", {"NEW.flac": clip_member(3), "NEW.txt": b"One more clip."})
    shards_module._LISTINGS.clear()
    changed = shards_module.read_shards(made.root, "*.tar")
    assert len(walked) == 3 and len(changed.lines) == len(first.lines) + 1


def test_a_url_is_shown_without_its_credentials() -> None:
    from stoker.shared.dataset.storage import shown

    assert shown("https://user:secret@host/c/train-{000..009}.tar") == "https://host/c/train-{000..009}.tar"
    assert shown("cannot GET https://host/a.tar?X-Amz-Credential=AKIA&X-Amz-Signature=f00 (403)") == \
        "cannot GET https://host/a.tar?... (403)"
    assert shown("s3://bucket/train-000.tar#clips/a.flac@512+100") == "s3://bucket/train-000.tar#clips/a.flac@512+100"


def test_a_shard_changed_since_indexing_is_a_rejection_when_read(tmp_path: Path) -> None:
    shards = make_shards(tmp_path / "shards", shards=1, per_shard=3)
    index = build_index(_data(tmp_path / "shards"), FEATURES)
    last = max(index.samples, key=lambda s: member_of(s.audio).offset)
    locator = member_of(last.audio)
    shards.paths[0].write_bytes(shards.paths[0].read_bytes()[:locator.offset + 100])  # cut after the index
    with pytest.raises(AudioError, match=rf"^audio file unreadable: member {locator.member} of shard train-000.tar: "
                                         rf"train-000.tar holds 100 of the {locator.size} bytes from byte "
                                         rf"{locator.offset} \(changed since it was indexed\?\)$"):
        load_member(Reader(tmp_path / "shards"), member_of(last.audio), 22050)
    (tmp_path / "shards" / "train-000.tar").unlink()
    with pytest.raises(AudioMissing, match="no such shard"):
        load_member(Reader(tmp_path / "shards"), member_of(last.audio), 22050)


def test_a_batch_s_members_are_read_in_shard_and_offset_order_then_taken_in_any_order(tmp_path: Path) -> None:
    shards = make_shards(tmp_path / "shards", shards=3, per_shard=4)
    index = build_index(_data(tmp_path / "shards"), FEATURES)
    order: list[tuple[str, int]] = []

    class Spy(Reader):
        def read(self, name: str, offset: int, size: int) -> bytes:
            order.append((name, offset))
            return super().read(name, offset, size)

    reader = Spy(tmp_path / "shards")
    wanted = [member_of(s.audio) for s in reversed(index.samples)]  # a lease's order: any
    expected = {m: _member_bytes(tmp_path / "shards" / m.shard, m.member) for m in wanted}
    reader.prefetch((m.shard, m.offset, m.size) for m in wanted)
    assert order == sorted(order) and len(order) == len(shards.clips)
    for path in shards.paths:
        path.unlink()  # what was read ahead is served without the shards
    reader.close()
    for m in wanted:
        assert reader.read(m.shard, m.offset, m.size) == expected[m]
    with pytest.raises(FileNotFoundError):  # taken once: a second read goes to the (gone) shard
        reader.read(wanted[0].shard, wanted[0].offset, wanted[0].size)


def test_data_names_a_manifest_at_a_url_whose_relative_audio_is_beside_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    url = "s3://corpus/ljs/train.jsonl"
    root = remote_root(url)
    assert locate(url, "metadata.csv").where == locate("s3://corpus/ljs/", "train.jsonl").where == (root, url)
    assert root.parent == tmp_path / "cache" / "stoker" / "remote"
    lj, held_out = "s3://corpus/lj/metadata.csv", "s3://corpus/lj/eval.csv"  # what the store holds
    monkeypatch.setattr(url_module, "remote_stat", lambda where: (1, 1) if where in (lj, held_out) else None)
    assert locate("s3://corpus/ljs/", "metadata.csv").metadata_file == "s3://corpus/ljs/*.tar"  # no metadata.csv: shards
    assert locate("s3://corpus/lj", "metadata.csv").where == locate(lj, "metadata.csv").where == (remote_root(lj), lj)
    assert data_path(root, url) == url and data_path(remote_root(lj), lj) == lj  # what producers are given
    # data.metadata_file's: the directory, where data.eval_file is found beside it
    assert data_path(remote_root(lj), lj, "metadata.csv") == "s3://corpus/lj/"
    assert locate("s3://corpus/lj/", "eval.csv").where == (remote_root(held_out), held_out)
    mix = "s3://corpus/mixes/all.yaml"  # a mix at a URL is its own metadata file
    assert locate(mix, "metadata.csv").where == (remote_root(mix), mix) and data_path(remote_root(mix), mix) == mix
    entries, _ = format_of(lj).entries(b"a|A.|A.\nb|B.|B.\n", lj, COLUMNS_AUTO)  # an LJSpeech layout's: wavs/ beside
    assert [e.audio for e in entries] == ["s3://corpus/lj/wavs/a.wav", "s3://corpus/lj/wavs/b.wav"]
    entries, _ = parse_manifest(b"".join(json.dumps({"audio_filepath": a, "text": "t", "id": f"c{n}"}).encode() + b"\n"
                                         for n, a in enumerate(["wavs/a.wav", "./b.wav", "s3://other/c.wav",
                                                                "/data/d.wav"])))
    assert [e.audio for e in format_of(url).resolve(entries, url)] == [
        "s3://corpus/ljs/wavs/a.wav", "s3://corpus/ljs/b.wav", "s3://other/c.wav", "/data/d.wav"]


def test_an_ljspeech_layout_at_a_url_lists_wavs_once_preferring_suffixes_and_reads_headers_only(tmp_path: Path,
                                                                                              monkeypatch) -> None:
    fs = fsspec.filesystem("memory")
    base = f"memory://{tmp_path.name}/lj"
    whole = tmp_path / "a.wav"
    soundfile.write(str(whole), tone(1.0, 22050), 22050, subtype="PCM_16")
    data = whole.read_bytes()
    for name, body in [("a.wav", data), ("a.flac", b"x"), ("b.flac", data), ("c.txt", b"x"), ("d.wav", data[:9000])]:
        fs.pipe(f"{base}/wavs/{name}", body)
    found = format_of(f"{base}/metadata.csv").audio(Path(), f"{base}/metadata.csv", b"", COLUMNS_AUTO)
    assert sorted((i, f.name, f.size) for i, f in found.items()) == [
        ("a", f"{base}/wavs/a.wav", len(data)), ("b", f"{base}/wavs/b.flac", len(data)),
        ("d", f"{base}/wavs/d.wav", 9000)]
    nothing = f"memory://{tmp_path.name}/none/metadata.csv"
    assert format_of(nothing).audio(Path(), nothing, b"", COLUMNS_AUTO) == {}
    reads: list[int] = []
    original = storage.RetryingFile.read

    def counted(self, size=-1):
        got = original(self, size)
        reads.append(len(got))
        return got

    monkeypatch.setattr(storage.RetryingFile, "read", counted)
    probe = probe_url(f"{base}/wavs/a.wav")
    assert (probe.error, probe.frames, probe.rate) == ("", 22050, 22050) and sum(reads) <= 4096  # the header only
    assert probe_url(f"{base}/wavs/d.wav").error == "audio file truncated"
    assert probe_url(f"{base}/wavs/gone.wav").error == "audio file missing"
