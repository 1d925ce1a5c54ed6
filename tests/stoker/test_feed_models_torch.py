"""PyTorch producer models through stoker.Feed(framework="torch"), no process importing
TensorFlow: docs/examples/neural_features_torch.py's encoders in the producers give each batch
the codes and speaker embeddings the same modules give here, every clip is trained once per
epoch through a producer killed mid-epoch, and a later run reads every output from the cache
(no model call, counted in the models: tests/producer/user_models_torch.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stoker
from tests.factories import make_dataset
from tests.procs import read_json, read_jsonl
from tests.stoker.test_feed import assert_no_producers_left, options, producer_procs
from tests.trained import Recorder, check_trained, clips_of

torch = pytest.importorskip("torch")
from tests.producer import user_models_torch as um  # noqa: E402  (imports torch)
from tests.producer.test_models_torch import SPEC, alone, assert_relative  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

PROJECT = Path(__file__).resolve().parents[2]


def test_torch_encoders_in_the_producers_every_clip_once_through_a_kill_and_a_later_run_calls_no_model(
        tmp_path, monkeypatch):
    root = tmp_path / "data"
    ids = set(make_dataset(root, count=16))
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PROJECT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("NEURAL_FEATURES_WEIGHTS", str(tmp_path / "weights"))
    monkeypatch.setenv(um.CALLS_FILE, str(calls))
    sets = {"trainer.val_clips": 0, "transforms.model_fields": um.nft.MODEL_FIELDS, "batching.fields": "ref_mel",
            "data.feature_cache": str(tmp_path / "cache")}
    models = f"{SPEC}:codec,{SPEC}:speaker"
    codec, speaker = um.nft.codec(), um.nft.speaker()

    def check(batch: dict[str, Any]) -> None:
        b = {k: v.numpy() for k, v in batch.items()}
        for row in range(len(b["mel_lengths"])):
            codes, embedding = alone(b, row, codec, speaker)
            np.testing.assert_array_equal(b["codes"][row, :-(-int(b["mel_lengths"][row]) // um.nft.GROUP)], codes)
            assert_relative(b["speaker_embedding"][row], embedding)

    trained, kept = Recorder(), []
    with stoker.Feed(**options(tmp_path, root, epochs=2, record_samples=True, set=sets, framework="torch",
                               producer_models=models)) as feed:
        for n, batch in enumerate(feed):
            if n == 2:  # a producer dies mid-epoch: its leases go to the other, it is restarted
                producer_procs(os.getpid())[0].kill()
            assert isinstance(batch["codes"], torch.Tensor)
            check(batch)
            trained.note(batch, feed.epoch)
            kept.append({k: v.clone() for k, v in batch.items()})
            feed.step_done()
    check_trained(trained.steps, clips_of(tmp_path / "run"), 2, ids)
    first = read_jsonl(calls)
    assert {c["model"] for c in first} == {"codec", "speaker"} and not any(c["tensorflow"] for c in first)
    assert os.getpid() not in {c["pid"] for c in first}  # the models ran in the producers, not here
    # A later run on the same cache, its first epoch's references those of the first run's:
    # every batch's codes and embeddings are read from the cache, no model is called.
    with stoker.Feed(**options(tmp_path, root, epochs=1, set=sets, framework="torch", producer_models=models,
                               producers=1, run_dir=str(tmp_path / "later"))) as feed:
        for batch in feed:
            check(batch)
            feed.step_done()
    assert read_jsonl(calls) == first
    producers = read_json(tmp_path / "later" / "summary.json")["producers"]
    assert sum(p["model_runs"] for p in producers) == 0 and sum(p["model_hits"] for p in producers) == 2 * len(ids)
    assert_no_producers_left(os.getpid())
    # The example's model trains on these fields: a few steps on one batch lower its loss.
    torch.manual_seed(0)
    model = um.nft.CodesTTS(int(max(b["tokens"].max() for b in kept)) + 1, um.nft.N_MELS)
    optimizer = torch.optim.Adam(model.parameters(), 3e-3)
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        loss = sum(model(kept[0]))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0], losses
