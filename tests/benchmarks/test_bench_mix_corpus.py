"""The scale benchmark's mix of three corpora: each dataset read as its own library reads it, and
the mix indexed whole, every clip with its text, speaker and duration."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import soundfile

from stoker.benchmarks import mix_corpus
from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.consumer.index.index import build_index


def test_texts_are_a_clips_own_of_about_a_hundred_characters() -> None:
    texts = mix_corpus.Texts(np.random.default_rng(0))
    offsets, blob = texts.chunk(0, 2000)
    made = [blob[a:b].decode("ascii") for a, b in zip(offsets.tolist(), offsets[1:].tolist())]
    assert len(set(made)) == 2000  # each has its clip's own word
    assert 90 <= np.mean([len(t) for t in made]) <= 115
    assert all(t[0].isupper() and t.endswith(".") and t[:-1].replace(" ", "").isalpha() for t in made)
    counts = [len(t.split()) for t in made]
    assert min(counts) >= mix_corpus.WORDS_PER_TEXT[0] and max(counts) <= mix_corpus.WORDS_PER_TEXT[1]


def test_the_mix_is_read_by_lhotse_datasets_and_stoker_with_every_clip(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(mix_corpus, "CHUNK", 70)  # several chunks a dataset, and row groups across them
    monkeypatch.setattr(mix_corpus, "PARQUET_GROUP_ROWS", 35)
    monkeypatch.setattr(mix_corpus, "PARQUET_FILE_ROWS", 140)
    mix = mix_corpus.write_mix(tmp_path, 601)
    lengths = {f"a{n}": soundfile.info(str(tmp_path / "manifest" / "audio" / f"a{n}.wav")).duration
               for n in range(mix_corpus.AUDIO_FILES)}
    manifest = [json.loads(line) for line in (tmp_path / "manifest" / "manifest.jsonl").read_text().splitlines()]
    cuts = [json.loads(line) for line in gzip.decompress((tmp_path / "cuts" / "cuts.jsonl.gz").read_bytes())
            .decode().splitlines()]
    files = sorted((tmp_path / "parquet").glob("*.parquet"))
    parquet = pq.read_table(files).to_pylist()
    assert [len(manifest), len(parquet), len(cuts)] == mix_corpus.sizes(601) == [200, 200, 201]
    assert len(files) == 2 and pq.ParquetFile(files[0]).metadata.num_row_groups == 4
    from datasets import Audio, load_dataset  # as a user of datasets reads the files

    rows = load_dataset("parquet", data_files=[str(f) for f in files], split="train")
    rows = rows.cast_column("audio", Audio(decode=False))
    assert rows.features["audio"] == Audio(decode=False) and rows[7]["text"] == parquet[7]["text"]
    audio = rows[7]["audio"]["bytes"]
    assert abs(soundfile.info(io.BytesIO(audio)).duration - parquet[7]["duration"]) < 1e-3
    from lhotse import CutSet  # as a user of lhotse reads the cuts

    loaded = CutSet.from_file(tmp_path / "cuts" / "cuts.jsonl.gz").to_eager()
    assert [c.id for c in loaded] == [c["id"] for c in cuts]
    assert [c.supervisions[0].text for c in loaded] == [c["supervisions"][0]["text"] for c in cuts]
    # every clip of the mix, as its dataset gives it: duration as long as its file, text, speaker
    given = {f"manifest:{r['id']}": (r["text"], r["speaker"], r["duration"]) for r in manifest}
    assert all(abs(lengths[r["audio_filepath"][6:-4]] - r["duration"]) < 1e-3 for r in manifest)
    given.update({f"parquet:{r['id']}": (r["text"], r["speaker"], r["duration"]) for r in parquet})
    given.update({f"cuts:{c['id']}": (c["supervisions"][0]["text"], c["supervisions"][0]["speaker"], c["duration"])
                  for c in cuts})
    assert all(abs(lengths[c.recording.id] - c.duration) < 1e-3 for c in loaded)
    index = build_index(DataConfig(path=str(tmp_path), metadata_file=mix.name, index_cache="off"), FeaturesConfig())
    assert index.rejected == [] and index.stats.headers_read == 0
    got = {s.id: (s.text, s.speaker, s.duration_s) for s in index.samples}
    assert got == given
    assert len({t for t, _, _ in given.values()}) == 601
    assert len({s for _, s, _ in given.values()}) > 0.25 * 601  # speakers of the three datasets' own
    assert mix_corpus.write_mix(tmp_path / "again", 601).read_text() == mix.read_text()
    assert (tmp_path / "again" / "manifest" / "manifest.jsonl").read_bytes() == \
        (tmp_path / "manifest" / "manifest.jsonl").read_bytes()  # the same corpus at every run
