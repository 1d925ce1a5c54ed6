"""lhotse Shar directories read as datasets (shared/dataset/shar.py, through shards.py's listing):
the Shar written by lhotse itself; a cut that is not all of its member, a truncated member and a
shard without its cuts file are rejections naming the cut or the shard; an edited cuts file is
read again."""

from __future__ import annotations

import gzip
import json
import tarfile
from pathlib import Path

import pytest

from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.shared.dataset.corpus.registry import locate
from stoker.consumer.index.index import build_index
from tests.test_shar_run import write_shar

pytestmark = pytest.mark.timeout(120)

FEATURES = FeaturesConfig(sample_rate_hz=22050)


def _index(shar: Path, tmp_path: Path):
    return build_index(DataConfig(path=str(shar), index_cache=str(tmp_path / "cache")), FEATURES)


def _edit_cuts(path: Path, change) -> None:
    lines = [json.loads(line) for line in gzip.decompress(path.read_bytes()).splitlines()]
    path.write_bytes(gzip.compress(b"".join(json.dumps(change(c)).encode() + b"\n" for c in lines)))


def test_a_shar_directory_is_its_cuts_with_their_members_and_an_edit_is_read_again(tmp_path: Path) -> None:
    shar, ids = write_shar(tmp_path / "corpus", clips=12, shard_size=5)
    assert locate(str(shar), "metadata.csv").where == (shar.resolve(), "recording*.tar")
    index = _index(shar, tmp_path)
    assert [s.id for s in index.samples] == ids and index.rejected == [] and index.stats.headers_read == 0
    first = index.sample("cut006")
    assert first.audio.startswith("recording.000001.tar#cut006.flac@") and first.speaker == "spk0"
    assert first.duration_s == pytest.approx(0.9)  # a window of its recording: its own member, 0.9 s
    _edit_cuts(shar / "cuts.000001.jsonl.gz",
               lambda c: {**c, "supervisions": [{**c["supervisions"][0], "text": "An edited text."}]})
    again = _index(shar, tmp_path)
    assert again.stats.cache != "hit" and again.sample("cut006").text == "An edited text."


def test_faults_are_rejections_naming_the_cut_or_the_shard(tmp_path: Path) -> None:
    shar, ids = write_shar(tmp_path / "corpus", clips=12, shard_size=5)
    _edit_cuts(shar / "cuts.000000.jsonl.gz", lambda c: {**c, "duration": 0.25} if c["id"] == "cut001" else c)
    tar = shar / "recording.000001.tar"
    with tarfile.open(tar) as opened:
        last = opened.getmembers()[-2]  # cut009.flac (its recording's JSON follows it)
    assert last.name == "cut009.flac"
    tar.write_bytes(tar.read_bytes()[:last.offset_data + last.size // 2])  # cut short in its audio
    (shar / "cuts.000002.jsonl.gz").unlink()
    index = _index(shar, tmp_path)
    reasons = {r.id: r.reason for r in index.rejected}
    assert "cut001" in reasons and "line 2 of cuts.000000.jsonl.gz" in reasons["cut001"]
    assert "a cut of a Shar shard is read whole" in reasons["cut001"]
    assert "is truncated" in reasons["cut009"] and "recording.000001.tar" in reasons["cut009"]
    assert "the cuts of Shar shard recording.000002.tar" in reasons["shard:recording.000002.tar"]
    assert [s.id for s in index.samples] == [i for i in ids[:10] if i not in ("cut001", "cut009")]
