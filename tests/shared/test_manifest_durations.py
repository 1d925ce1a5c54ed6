"""Manifests with durations: indexed without opening an audio file; a clip whose audio is not
that long is a counted rejection when a producer reads it, never a crash."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from stoker.consumer.coordinator.lease_tables import TokenTable
from stoker.producer.batches import DURATION_TOLERANCE_S, BatchMaker
from stoker.shared import wire
from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.consumer.index.index import build_index
from stoker.shared.dataset.corpus import manifest as manifest_module
from stoker.shared.dataset.corpus.manifest import Manifest
from stoker.consumer.index import reuse as reuse_module
from stoker.shared.dataset import probe as probe_module
from stoker.shared.mel import num_frames
from tests.factories import make_dataset

FEATURES = FeaturesConfig()


def _manifest(root: Path, rows: list[dict]) -> DataConfig:
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return DataConfig(path=str(root), metadata_file="train.jsonl", index_cache="off")


def test_a_manifest_with_durations_is_indexed_without_opening_audio(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args, **kwargs):
        raise AssertionError("an audio file was opened")

    monkeypatch.setattr(probe_module, "probe_audio", never)
    monkeypatch.setattr("stoker.consumer.index.parallel.probe_audio", never)
    # the files need not exist to be indexed: each clip reuses one of two, or names none at all
    rows = [{"audio_filepath": f"audio/c{i % 2}.wav", "id": f"clip{i}", "text": f"clip number {i}.",
             "duration": 0.5 + i / 10, "speaker": i % 3} for i in range(6)]
    rows.append({"audio_filepath": "audio/far.wav", "id": "long", "text": "too long", "duration": 99.0})
    rows.append({"audio_filepath": "audio/x.wav", "id": "nan", "text": "x", "duration": float("nan")})
    index = build_index(_manifest(tmp_path, rows), FEATURES)
    assert index.stats.headers_read == 0
    assert [s.id for s in index.samples] == [f"clip{i}" for i in range(6)]
    for i, sample in enumerate(index.samples):
        assert sample.duration_s == 0.5 + i / 10
        assert sample.audio == f"audio/c{i % 2}.wav" and sample.speaker == str(i % 3)
        assert sample.num_frames == num_frames(round(sample.duration_s * FEATURES.sample_rate_hz), FEATURES)
    reasons = {r.id: r.reason for r in index.rejected}
    assert "longer than data.max_audio_s" in reasons["long"]
    assert "not a finite number" in reasons["nan"]


@pytest.mark.parametrize("stamped", [True, False])
def test_a_small_manifest_is_read_once_and_found_again_by_its_stamp_or_that_hash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stamped: bool) -> None:
    """Built, a small manifest is read once and never hashed apart; found again by its stamp
    (size and mtime) without a read, or, where there is no stamp (a store that gives none), by
    the hash of one more read."""
    reads: list[str] = []
    read = Manifest.read  # the build's read, and the read of a manifest to hash
    monkeypatch.setattr(Manifest, "read", lambda self, root, name: reads.append(name) or read(self, root, name))
    monkeypatch.setattr(reuse_module, "file_sha256", lambda where: pytest.fail("the manifest was hashed apart"))
    if not stamped:
        monkeypatch.setattr(manifest_module, "file_stamp", lambda where: "")
    rows = [{"audio_filepath": f"audio/c{i}.wav", "text": f"clip {i}.", "duration": 1.0} for i in range(4)]
    data = dataclasses.replace(_manifest(tmp_path, rows), index_cache=str(tmp_path / "cache"))
    built = build_index(data, FEATURES)
    assert built.stats.cache == "miss" and reads == ["train.jsonl"]
    again = build_index(data, FEATURES)
    assert again.stats.cache == "hit" and reads == ["train.jsonl"] * (1 if stamped else 2)
    assert list(again.samples) == list(built.samples) and len(built.samples) == 4


def test_a_clip_whose_audio_disagrees_with_its_duration_is_rejected_when_read(tmp_path: Path) -> None:
    ids = make_dataset(tmp_path, count=3, durations=[0.8, 0.8, 0.8])
    rows = [{"audio_filepath": f"wavs/{i}.wav", "text": f"clip {n}", "duration": d}
            for n, (i, d) in enumerate(zip(ids, [0.8, 1.6, 0.8 + DURATION_TOLERANCE_S / 2]))]
    rows.append({"audio_filepath": "wavs/absent.wav", "text": "not on this host", "duration": 0.8})
    index = build_index(_manifest(tmp_path, rows), FEATURES)
    assert len(index.samples) == 4 and index.stats.headers_read == 0
    tokens = TokenTable(index.samples, index.vocabulary)
    all_ids = [s.id for s in index.samples]
    carried = tokens.lease_fields(all_ids)
    longest = max(s.num_frames for s in index.samples)
    lease = wire.Lease(lease=1, epoch=0, index=0, ids=tuple(all_ids), shape=(64, longest), rows=4,
                       tokens=tuple(tuple(t) for t in carried["tokens"]), texts=carried["texts"],
                       files=carried["files"], durations=tuple(carried["durations"]))
    maker = BatchMaker(tmp_path, {}, FEATURES, None, "p0")  # reads no metadata: the lease names the clips
    prepared = maker.make(lease)
    batch = prepared.batch
    assert batch.ids == (ids[0], ids[2])
    assert [(e.id, e.reason.split(":")[0]) for e in batch.rejected] == [
        (ids[1], "audio of 0.800 s where the index says 1.600 s")]
    assert [e.id for e in batch.missed] == ["absent"]
