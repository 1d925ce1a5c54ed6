"""Held-out validation clips (consumer/feed/validation.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from stoker.consumer.feed import validation
from stoker.consumer.buffer import BatchQueue
from stoker.consumer.coordinator.lease_tables import TokenTable
from stoker.consumer.plan import EpochPlanner, validation_batches
from stoker.consumer.coordinator.leases import ValidationSet
from stoker.consumer.coordinator.scheduler import Scheduler
from stoker.producer.audio import load_audio
from stoker.producer.batches import BatchMaker
from stoker.producer.features import log_mel_spectrogram_numpy
from stoker.shared import config as config_mod, wire
from stoker.shared.config import batch_schema
from stoker.consumer.index.index import build_index
from stoker.shared.dataset.table import SampleTable
from stoker.shared.dataset.corpus.registry import beside
from stoker.shared.runfiles import VALIDATION
from tests.consumer.harness import hello_of
from tests.factories import make_dataset, make_samples
from tests.objectstore import S3Server, use_env
from tests.speech import make_train_eval_dataset


def test_split_is_deterministic_and_bounded() -> None:
    samples = make_samples(100)
    train, held = validation.split(samples, 4, seed=1)
    assert len(held) == 4 and len(train) == 96
    assert {s.id for s in train}.isdisjoint(s.id for s in held)
    assert sorted(validation.split(list(reversed(samples)), 4, seed=1)[1]) == sorted(held)  # order does not matter...
    assert validation.split(samples, 4, seed=2)[1] != held  # ...the seed does
    assert len(validation.split(samples, 50, seed=1)[1]) == 10  # at most a tenth
    assert validation.split(samples[:9], 4, seed=1) == (samples[:9], [])  # too few clips to spare any
    assert validation.split(samples, 0, seed=1) == (samples, [])


def test_a_table_and_its_samples_hold_out_the_same_clips_and_train_on_the_rest() -> None:
    samples = make_samples(200)
    table = SampleTable.from_samples(samples)
    train, held = validation.split(table, 5, seed=3)
    assert held == validation.split(samples, 5, seed=3)[1]
    assert list(train) == [s for s in samples if s not in held]  # a view of the rest, in order
    assert sorted(train.id_order().tolist()) == list(range(195))
    assert [train[n].id for n in train.id_order()] == sorted(s.id for s in train)


def test_a_resumed_run_holds_out_the_clips_it_recorded(tmp_path) -> None:
    """A resume holds out what validation.json names (as an earlier stoker version chose them),
    with the same settings; other settings, or a clip gone from the dataset, choose anew."""
    samples = make_samples(100)
    index = SimpleNamespace(samples=SampleTable.from_samples(samples))
    cfg = config_mod.load(None, {"trainer.val_clips": 3, "batching.seed": 5})
    fresh = validation.hold_out(index, cfg, tmp_path)[1]
    chosen = [samples[0].id, samples[7].id, samples[42].id]  # not the hash's choice
    assert sorted(s.id for s in fresh) != chosen
    record = {"source": "hash", "val_clips": 3, "seed": 5, "ids": chosen}
    (tmp_path / VALIDATION).write_text(json.dumps(record))
    train, held, _ = validation.hold_out(index, cfg, tmp_path, resume=True)
    assert [s.id for s in held] == chosen and len(train) == 97 and not {s.id for s in train} & set(chosen)
    assert json.loads((tmp_path / VALIDATION).read_text())["ids"] == chosen
    for changed in ({**record, "seed": 6}, {**record, "ids": [*chosen[:2], "gone"]}):
        (tmp_path / VALIDATION).write_text(json.dumps(changed))
        assert validation.hold_out(index, cfg, tmp_path, resume=True)[1] == fresh


def test_a_validation_lease_names_the_eval_files_clips_so_a_producer_that_indexed_only_training_makes_them(
        tmp_path) -> None:
    _, held_ids = make_train_eval_dataset(tmp_path)
    cfg = config_mod.load(None, {"data.path": str(tmp_path), "data.metadata_file": "metadata_train.csv",
                                 "data.eval_file": "metadata_eval.csv", "data.index_cache": "off",
                                 "features.backend": "numpy", "batching.batch_size": 4})
    index = build_index(cfg.data, cfg.features, cfg.text)
    train, held, _ = validation.hold_out(index, cfg, tmp_path)
    planner = EpochPlanner(train, cfg.batching)
    held_set = ValidationSet(validation_batches(held, planner), BatchQueue(2), TokenTable(held, index.vocabulary),
                             texts={s.id: s.text for s in held}, files={s.id: s.audio for s in held})
    scheduler = Scheduler(cfg, planner, BatchQueue(3), max_epochs=0, validation=held_set)
    scheduler.on_message(b"p", hello_of("p").encode(), 0.0)
    scheduler.start_validation(1, 0.0)
    leases = [wire.read(msg.encode())[0] for _, msg, _ in scheduler.take_outbox() if isinstance(msg, wire.Lease)]
    # A producer of the training file: it knows none of the eval file's clips but from their leases.
    maker = BatchMaker(index.root, {s.id: s.text for s in train}, cfg.features, None, "p",
                       files={s.id: s.audio for s in train}, schema=batch_schema(cfg))
    made = {}
    for lease in leases:
        prepared = maker.make(lease)
        assert prepared.batch.missed == () and prepared.batch.rejected == ()
        for row, clip in enumerate(prepared.batch.ids):
            made[clip] = prepared.arrays["mel"][row, :prepared.arrays["mel_lengths"][row]]
    assert sorted(made) == sorted(held_ids) == sorted(s.id for s in held)
    for clip, mel in made.items():
        audio = load_audio(index.root / "wavs" / f"{clip}.wav", cfg.features.sample_rate_hz)
        np.testing.assert_allclose(mel, log_mel_spectrogram_numpy(audio, cfg.features, dtype=np.float32),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(120)  # moto's S3 server on a loopback socket
def test_an_eval_file_beside_a_manifest_in_s3_is_held_out_and_its_lease_names_the_clips_texts_and_urls(
        tmp_path, monkeypatch) -> None:
    root = tmp_path / "corpus"
    ids = make_dataset(root, count=6)
    texts = {i: f"clip number {n}." for n, i in enumerate(ids)}
    for name, chosen in (("train.jsonl", ids[:4]), ("eval.jsonl", ids[4:])):
        (root / name).write_text("".join(json.dumps({"audio_filepath": f"wavs/{i}.wav", "text": texts[i]}) + "\n"
                                         for i in chosen), encoding="utf-8")
    with S3Server() as server:
        server.upload(root, "corpus", "ljs")
        server.upload(root / "wavs", "corpus", "ljs/wavs")
        use_env(server.env(), monkeypatch)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        for named in ({"data.path": "s3://corpus/ljs/train.jsonl"},  # the manifest's URL, or its directory's
                      {"data.path": "s3://corpus/ljs/", "data.metadata_file": "train.jsonl"}):
            cfg = config_mod.load(None, {**named, "data.eval_file": "eval.jsonl", "data.index_workers": 1,
                                         "features.backend": "numpy", "batching.batch_size": 4})
            index = build_index(cfg.data, cfg.features, cfg.text)
            train, held, rejected = validation.hold_out(index, cfg, tmp_path)
            assert rejected == [] and [s.id for s in train] == ids[:4]
            assert [(s.id, s.text, s.audio) for s in held] == \
                   [(i, texts[i], f"s3://corpus/ljs/wavs/{i}.wav") for i in ids[4:]]
            assert json.loads((tmp_path / VALIDATION).read_text()) == \
                   {"source": "eval_file", "file": "eval.jsonl", "ids": ids[4:]}
            planner = EpochPlanner(train, cfg.batching)
            held_set = ValidationSet(validation_batches(held, planner), BatchQueue(2),
                                     TokenTable(held, index.vocabulary), texts={s.id: s.text for s in held},
                                     files={s.id: s.audio for s in held})
            scheduler = Scheduler(cfg, planner, BatchQueue(3), max_epochs=0, validation=held_set)
            scheduler.on_message(b"p", hello_of("p").encode(), 0.0)
            scheduler.start_validation(1, 0.0)
            leases = [wire.read(msg.encode())[0] for _, msg, _ in scheduler.take_outbox()
                      if isinstance(msg, wire.Lease)]
            named_in = {clip: (lease.texts[clip], lease.files[clip]) for lease in leases for clip in lease.ids}
            assert named_in == {i: (texts[i], f"s3://corpus/ljs/wavs/{i}.wav") for i in ids[4:]}


def test_the_eval_file_is_looked_for_beside_the_metadata_a_url_names() -> None:
    assert beside("s3://b/c/train.jsonl", "eval.jsonl") == "s3://b/c/"
    assert beside("s3://b/LJSpeech/metadata_train.csv", "metadata_eval.csv") == "s3://b/LJSpeech/"
    assert beside("s3://b/LJSpeech/", "metadata_eval.csv") == "s3://b/LJSpeech/"  # a directory URL already
    assert beside("s3://b/c/train.jsonl", "gs://d/eval.jsonl") == "gs://d/eval.jsonl"  # a URL of its own
    assert beside("/data/LJSpeech", "metadata_eval.csv") == "/data/LJSpeech"
