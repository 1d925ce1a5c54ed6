"""Tar shards in an S3-compatible object store (moto's server on loopback): indexed as from a
directory, read back by a producer's reader through a connection that drops mid-shard; a
missing bucket is one line."""

from __future__ import annotations

import logging
import tarfile
from pathlib import Path

import pytest

from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.shared.dataset import DatasetError, build_index
from stoker.shared.dataset.shards import Locator
from stoker.shared.dataset.storage import COUNTS, READ_RETRIES, Reader, StorageError
from tests.factories import make_shards
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
                locator = Locator.parse(sample.audio)
                data = reader.read(locator.shard, locator.offset, locator.size)
                assert data == expected[locator.shard.rpartition("/")[2], locator.member]
        reader.close()
        assert proxy.done.is_set() and proxy.dropped == 1 + 2
        assert COUNTS.retries - before == 2  # each drop one retry, nothing lost
        assert all("testing" not in r.getMessage() for r in caplog.records)  # no credential in a log line
        assert sum("failed (ClientPayloadError); retry " in r.getMessage() for r in caplog.records) == 1 + 2

        proxy.arm(READ_RETRIES + 1)  # a store that fails every try: the read fails, with a reason
        locator = Locator.parse(index.samples[0].audio)
        with pytest.raises(StorageError, match=f"cannot read s3://corpus/train/train-000.tar at byte "
                                               f"{locator.offset}: .* \\(after {READ_RETRIES} retries\\)"):
            Reader().read(locator.shard, locator.offset, locator.size)
        with pytest.raises(DatasetError, match=r"^no tar shard matches s3://nothing/here/\*\.tar$"):
            build_index(DataConfig(path="s3://nothing/here/", index_workers=1), FEATURES)

