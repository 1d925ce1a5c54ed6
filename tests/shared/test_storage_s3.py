"""Tar shards and a JSON-lines manifest in an S3-compatible object store (moto's server on
loopback): indexed as from a directory, read back by a producer through a connection that
drops mid-response, its log-mels cached by the objects' ETags; a mix naming audio by URL; a
missing bucket or manifest is one line."""

from __future__ import annotations

import json
import logging
import tarfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import soundfile

from stoker.consumer.coordinator.lease_tables import TokenTable
from stoker.producer.batches import BatchMaker
from stoker.shared import wire
from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.shared.dataset.agreement import Reference, check_agreement, describe_copy
from stoker.consumer.index.index import build_index
from stoker.shared.dataset.types import DatasetError
from stoker.shared.dataset.corpus.address import member_of
from stoker.shared.dataset.corpus.registry import locate
from stoker.shared.dataset.storage import COUNTS, READ_RETRIES, Reader, RetryingFile, StorageError
from tests.factories import make_dataset, make_shards
from tests.objectstore import DroppingProxy, S3Server, use_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # a server and a proxy on loopback sockets

FEATURES = FeaturesConfig()


def _members(paths: list[Path]) -> dict[tuple[str, str], bytes]:
    out = {}
    for path in paths:
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                out[path.name, member.name] = tar.extractfile(member).read()
    return out


def _lease_batch(of: Any, maker: BatchMaker, ids: list[str]) -> Any:
    """``maker``'s batch of clips ``ids`` of index ``of``, leased as the coordinator leases it."""
    carried = TokenTable(of.samples, of.vocabulary).lease_fields(ids)
    longest = max(s.num_frames for s in of.samples)
    lease = wire.Lease(lease=1, epoch=0, index=0, ids=tuple(ids), shape=(64, longest), rows=4,
                       tokens=tuple(tuple(t) for t in carried["tokens"]), texts=carried["texts"],
                       files=carried["files"], durations=tuple(carried["durations"]))
    return maker.make(lease)


def _batches_agree_through_a_cut(proxy: DroppingProxy, caplog: Any, index: Any, local: Any, root: Path,
                                 ids: list[str]) -> Callable[[Any, BatchMaker], Any]:
    """A batch of ``ids`` read from the store with a connection cut mid-read (retried, counted)
    equals the one read from the local copy bit for bit, and no credential is logged. Returns
    the batch function of these ids (index, maker -> batch)."""
    def batch(of: Any, maker: BatchMaker) -> Any:
        return _lease_batch(of, maker, ids)

    proxy.arm(1)  # a clip's read, cut mid-body: retried, counted with the batch
    with caplog.at_level(logging.WARNING, "stoker.shared.dataset.storage"):
        remote = batch(index, BatchMaker(index.root, {}, FEATURES, None, "p0"))
    expected = batch(local, BatchMaker(root, {}, FEATURES, None, "p1"))
    assert proxy.dropped == 1 and remote.batch.read_retries == 1
    assert remote.batch.ids == expected.batch.ids == tuple(ids) and remote.batch.rejected == ()
    assert remote.arrays.keys() == expected.arrays.keys()
    for name, array in expected.arrays.items():  # the same clips, so the same mels, bit for bit
        np.testing.assert_array_equal(remote.arrays[name], array, err_msg=name)
    assert all("testing" not in r.getMessage() for r in caplog.records)  # no credential in a log line
    return batch


def test_shards_in_s3_index_as_local_ones_and_a_dropped_connection_costs_a_counted_retry(tmp_path, monkeypatch,
                                                                                          caplog):
    shards = make_shards(tmp_path / "shards", shards=2, per_shard=4)
    with S3Server() as server, DroppingProxy(server.endpoint, after_bytes=20 << 10) as proxy:
        server.upload(shards.root, "corpus", "train")
        use_env(server.env(proxy.endpoint), monkeypatch)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        proxy.arm(1)  # an audio header's read, cut: retried, counted in the index's figures
        index = build_index(DataConfig(path="s3://corpus/train/", index_workers=1), FEATURES)
        assert proxy.dropped == 1 and index.stats.read_retries == 1 and index.rejected == []
        local = build_index(DataConfig(path=str(shards.root), index_workers=1), FEATURES)
        assert [(s.id, s.text, s.num_frames, s.speaker) for s in index.samples] == \
               [(s.id, s.text, s.num_frames, s.speaker) for s in local.samples]
        assert all(s.audio.startswith("s3://corpus/train/train-00") for s in index.samples)
        assert index.root == tmp_path / "cache" / "stoker" / "remote" / index.root.name

        expected = _members(shards.paths)
        reader = Reader()
        proxy.arm(2)
        before = COUNTS.retries
        with caplog.at_level(logging.WARNING, "stoker.shared.dataset.storage"):
            for sample in index.samples:  # every member, through connections cut mid-response
                locator = member_of(sample.audio)
                data = reader.read(locator.shard, locator.offset, locator.size)
                assert data == expected[locator.shard.rpartition("/")[2], locator.member]
        reader.close()
        assert proxy.done.is_set() and proxy.dropped == 1 + 2
        assert COUNTS.retries - before == 2  # each drop one retry, nothing lost
        assert all("testing" not in r.getMessage() for r in caplog.records)  # no credential in a log line
        assert sum("failed (ClientPayloadError); retry " in r.getMessage() for r in caplog.records) == 1 + 2

        proxy.arm(READ_RETRIES + 1)  # a store that fails every try: the read fails, with a reason
        locator = member_of(index.samples[0].audio)
        with pytest.raises(StorageError, match=f"cannot read s3://corpus/train/train-000.tar at byte "
                                               f"{locator.offset}: .* \\(after {READ_RETRIES} retries\\)"):
            Reader().read(locator.shard, locator.offset, locator.size)
        with pytest.raises(DatasetError, match=r"^no tar shard matches s3://nothing/here/\*\.tar$"):
            build_index(DataConfig(path="s3://nothing/here/", index_workers=1), FEATURES)



def test_a_manifest_in_s3_indexes_as_the_local_one_and_a_producer_reads_its_clips_as_the_local_files(
        tmp_path, monkeypatch, caplog):
    root = tmp_path / "corpus"
    ids = make_dataset(root, count=4)
    rows = []
    for n, sample_id in enumerate(ids):
        row = {"audio_filepath": f"wavs/{sample_id}.wav", "text": f"clip number {n}.", "speaker": n % 2}
        if n != 3:  # the last clip's length comes from its header, read through the store
            info = soundfile.info(str(root / "wavs" / f"{sample_id}.wav"))
            row["duration"] = info.frames / info.samplerate
        rows.append(row)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with S3Server() as server, DroppingProxy(server.endpoint, after_bytes=8 << 10, from_start=True) as proxy:
        server.upload(root, "corpus", "ljs")
        server.upload(root / "wavs", "corpus", "ljs/wavs")
        use_env(server.env(proxy.endpoint), monkeypatch)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        data = DataConfig(path="s3://corpus/ljs/train.jsonl", index_workers=1)
        index = build_index(data, FEATURES)
        local = build_index(DataConfig(path=str(root), metadata_file="train.jsonl", index_workers=1), FEATURES)
        assert index.rejected == [] and index.stats.headers_read == 1 and index.stats.cache == "miss"
        assert [(s.id, s.text, s.num_frames, s.duration_s, s.speaker) for s in index.samples] == \
               [(s.id, s.text, s.num_frames, s.duration_s, s.speaker) for s in local.samples]
        assert [s.audio for s in index.samples] == [f"s3://corpus/ljs/wavs/{i}.wav" for i in ids]
        assert index.root == tmp_path / "cache" / "stoker" / "remote" / index.root.name
        def never(*args, **kwargs):
            raise AssertionError("a warm start reads the manifest")

        with monkeypatch.context() as m:  # kept on this host, found by the object's size and ETag: no download
            m.setattr(RetryingFile, "read", never)
            assert build_index(data, FEATURES).stats.cache == "hit"

        batch = _batches_agree_through_a_cut(proxy, caplog, index, local, root, ids)
        # The feature cache keys a clip at a URL by the URL, its size and ETag: a second read of the
        # same clips reads no audio (one lookup each), and returns the first read's mels
        cached = BatchMaker(index.root, {}, FEATURES, None, "p2", feature_cache=str(tmp_path / "features"))
        first = batch(index, cached)
        assert (cached.cache.counts.misses, cached.cache.counts.written) == (4, 4)
        smallest = min((root / "wavs" / f"{i}.wav").stat().st_size for i in ids)
        fetched = proxy.received
        with monkeypatch.context() as m:
            m.setattr(RetryingFile, "read", never)
            again = batch(index, cached)
        assert cached.cache.counts.hits == 4 and proxy.received - fetched < smallest
        assert again.batch.ids == first.batch.ids and again.batch.rejected == ()
        np.testing.assert_allclose(again.arrays["mel"], first.arrays["mel"], atol=1e-3)  # 16-bit codes of it
        # a clip rewritten in the store: a new ETag, so its entry is stale and its new audio read
        audio, rate = soundfile.read(str(root / "wavs" / f"{ids[0]}.wav"), dtype="float32")
        soundfile.write(str(root / "wavs" / f"{ids[0]}.wav"), audio * 0.5, rate, subtype="PCM_16")
        server.upload(root / "wavs", "corpus", "ljs/wavs")
        edited = batch(index, cached)
        assert (cached.cache.counts.stale, cached.cache.counts.hits) == (1, 7)
        assert not np.allclose(edited.arrays["mel"][0], first.arrays["mel"][0], atol=1e-3)
        np.testing.assert_allclose(edited.arrays["mel"][1:], first.arrays["mel"][1:], atol=1e-3)
        # A producer on another host describes its copy (the manifest's URL) as the index stores it.
        described = describe_copy(index.root, "s3://corpus/ljs/train.jsonl")
        assert check_agreement(Reference.of(index), described, "elsewhere").ok

        with pytest.raises(DatasetError, match=r"^s3://corpus/ljs/absent\.jsonl not found$"):
            build_index(DataConfig(path="s3://corpus/ljs/absent.jsonl", index_workers=1), FEATURES)
        # the manifest rewritten in the store: a new ETag, so its new content is indexed
        rows[0]["text"] = "clip number zero."
        (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        server.upload(root, "corpus", "ljs")
        edited = build_index(data, FEATURES)
        assert edited.stats.cache == "stale" and edited.samples[0].text == "clip number zero."


def test_an_ljspeech_layout_and_a_mix_in_s3_index_as_the_local_ones_reading_headers_only_and_batch_bit_for_bit(
        tmp_path, monkeypatch, caplog):
    root = tmp_path / "LJSpeech"
    ids = make_dataset(root, count=6, durations=[2.0, 2.1, 2.2, 2.3, 2.4, 2.5])
    soundfile.write(str(root / "wavs" / f"{ids[1]}.flac"), np.zeros(2205, np.float32), 22050)  # the .wav is preferred
    (root / "wavs" / f"{ids[4]}.wav").unlink()  # missing
    corrupt = root / "wavs" / f"{ids[5]}.wav"
    corrupt.write_bytes(corrupt.read_bytes()[:20_000])  # cut short: its header declares more
    wav_bytes = sum(p.stat().st_size for p in (root / "wavs").iterdir())
    with S3Server() as server, DroppingProxy(server.endpoint, after_bytes=8 << 10, from_start=True) as proxy:
        server.upload(root, "corpus", "LJSpeech")
        server.upload(root / "wavs", "corpus", "LJSpeech/wavs")
        use_env(server.env(proxy.endpoint), monkeypatch)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        data = DataConfig(path="s3://corpus/LJSpeech", index_workers=1)
        index = build_index(data, FEATURES)
        assert proxy.received < wav_bytes / 4  # the index read the wavs' headers, not the files
        local = build_index(DataConfig(path=str(root), index_workers=1), FEATURES)
        assert [(s.id, s.text, s.num_frames, s.duration_s, s.speaker) for s in index.samples] == \
               [(s.id, s.text, s.num_frames, s.duration_s, s.speaker) for s in local.samples]
        assert [s.audio for s in index.samples] == [f"s3://corpus/LJSpeech/wavs/{i}.wav" for i in ids[:4]]
        assert index.stats.headers_read == 5 and index.stats.cache == "miss"
        url = "s3://corpus/LJSpeech/"  # each rejection names the file, at its URL
        assert [(r.id, r.kind, r.file, r.reason) for r in index.rejected] == \
               [(r.id, r.kind, url + r.file, r.reason.replace(": wavs/", f": {url}wavs/")) for r in local.rejected]
        assert [(r.id, r.kind) for r in index.rejected] == [(ids[4], "missing-audio"), (ids[5], "unreadable-audio")]
        assert index.root == tmp_path / "cache" / "stoker" / "remote" / index.root.name
        again = build_index(DataConfig(path="s3://corpus/LJSpeech/metadata.csv", index_workers=1), FEATURES)
        assert again.stats.cache == "hit" and again.root == index.root  # the metadata's URL names the same dataset

        accepted = ids[:4]
        _batches_agree_through_a_cut(proxy, caplog, index, local, root, accepted)
        described = describe_copy(*locate("s3://corpus/LJSpeech/metadata.csv", "metadata.csv").where)
        assert check_agreement(Reference.of(index), described, "elsewhere").ok


        # A mix file at a URL: its datasets a path relative to it and a URL, indexed as the local mix
        mixes = tmp_path / "mixes"
        mixes.mkdir()
        (mixes / "all.yaml").write_text("datasets:\n  - {path: ../LJSpeech, name: lj}\n"
                                        "  - {path: 's3://corpus/LJSpeech/', name: again}\n", encoding="utf-8")
        (mixes / "host.yaml").write_text("datasets:\n  - {path: /data/LJSpeech, name: lj}\n", encoding="utf-8")
        server.upload(mixes, "corpus", "mixes")
        (tmp_path / "all.yaml").write_text("datasets:\n  - {path: LJSpeech, name: lj}\n"
                                           "  - {path: LJSpeech, name: again}\n", encoding="utf-8")
        mixed = build_index(DataConfig(path="s3://corpus/mixes/all.yaml", index_workers=1), FEATURES)
        local_mix = build_index(DataConfig(path=str(tmp_path / "all.yaml"), index_workers=1), FEATURES)
        assert [(s.id, s.text, s.num_frames, s.duration_s, s.speaker) for s in mixed.samples] == \
               [(s.id, s.text, s.num_frames, s.duration_s, s.speaker) for s in local_mix.samples]
        assert sorted(s.audio for s in mixed.samples) == sorted(f"{url}wavs/{i}.wav" for i in accepted for _ in "ab")
        assert [(r.id, r.kind, r.file.replace("s3://corpus/", ""), r.reason.replace("s3://corpus/", ""))
                for r in mixed.rejected] == [(r.id, r.kind, r.file, r.reason) for r in local_mix.rejected]
        assert len(mixed.rejected) == 4
        with pytest.raises(DatasetError, match=r"^s3://corpus/mixes/host\.yaml: dataset lj: /data/LJSpeech is a path "
                                               r"of this host; the datasets of a mix at a URL are URLs or paths "
                                               r"relative to it$"):
            build_index(DataConfig(path="s3://corpus/mixes/host.yaml", index_workers=1), FEATURES)
        # A manifest naming its audio by URL (no duration: each header read through the store), in a
        # local mix and in a mix at a URL: each URL stays as written, not made relative to the mix
        named = tmp_path / "named"
        named.mkdir()
        (named / "train.jsonl").write_text("".join(json.dumps({"audio_filepath": f"{url}wavs/{i}.wav", "text": s.text})
                                                   + "\n" for i, s in zip(accepted, index.samples)), encoding="utf-8")
        server.upload(named, "corpus", "named")
        mix = "datasets:\n  - {path: %s, metadata_file: train.jsonl}\n"
        (tmp_path / "named.yaml").write_text(mix % "named", encoding="utf-8")
        (mixes / "named.yaml").write_text(mix % "../named", encoding="utf-8")
        server.upload(mixes, "corpus", "mixes")
        for where in (str(tmp_path / "named.yaml"), "s3://corpus/mixes/named.yaml"):
            by_url = build_index(DataConfig(path=where, index_workers=1), FEATURES)
            assert by_url.rejected == [] and by_url.stats.headers_read == len(accepted)
            assert [(s.id, s.audio, s.num_frames) for s in by_url.samples] == \
                   [(f"named:{s.id}", s.audio, s.num_frames) for s in index.samples]
