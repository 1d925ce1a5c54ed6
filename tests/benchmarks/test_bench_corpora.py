"""The corpora the benchmarks generate: benchmarks/corpus.py's Shar directory is the
layout lhotse's own reader reads, and stoker indexes it as the loose clips; the scale
benchmark's Parquet files are indexed from their duration column, in pieces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile
from lhotse import CutSet

from stoker.benchmarks import corpus, scale
from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.consumer.index import parquet_pieces
from stoker.consumer.index.index import build_index


def test_the_shar_directory_is_read_by_lhotse_and_indexed_as_the_loose_clips(tmp_path: Path) -> None:
    root = tmp_path / "clips"
    corpus.make_clips(root, 5)
    shar = corpus.make_clip_shar(root, per_shard=2)
    loose = build_index(DataConfig(path=str(root), index_cache="off"), FeaturesConfig())
    packed = build_index(DataConfig(path=str(shar), index_cache="off"), FeaturesConfig())
    assert [(s.id, s.text, s.num_frames) for s in packed.samples] == \
        [(s.id, s.text, s.num_frames) for s in loose.samples] and packed.rejected == []
    fields = {"cuts": sorted(shar.glob("cuts.*.jsonl.gz")), "recording": sorted(shar.glob("recording.*.tar"))}
    cuts = list(CutSet.from_shar(fields=fields))  # lhotse's own reader: the layout is its
    assert [c.id for c in cuts] == [s.id for s in loose.samples]
    for cut in cuts:
        audio, _ = soundfile.read(str(root / "wavs" / f"{cut.id}.wav"), dtype="float32")
        assert np.allclose(cut.load_audio()[0], audio, atol=1e-4)


def test_the_parquet_rows_are_indexed_from_their_durations_in_pieces(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(scale, "PARQUET_FILE_ROWS", 20)
    monkeypatch.setattr(scale, "PARQUET_GROUP_ROWS", 6)
    monkeypatch.setattr(parquet_pieces, "PARQUET_CHUNKED_MIN_ROWS", 1)
    root = scale.make_parquet(tmp_path / "pq", 50)
    assert len(list(root.glob(scale.PARQUET_PATTERN))) == 3
    index = build_index(DataConfig(path=str(root), metadata_file=scale.PARQUET_PATTERN, index_workers=2,
                                   index_cache=str(tmp_path / "cache")), FeaturesConfig())
    assert len(index.samples) == 50 and index.rejected == [] and index.stats.workers == 2
    assert index.stats.headers_read == 0 and len({s.text for s in index.samples}) == 50
    assert [s.duration_s for s in index.samples] == [scale.AUDIO_SECONDS[i % scale.AUDIO_FILES] for i in range(50)]
