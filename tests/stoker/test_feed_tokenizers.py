"""stoker.Feed with a Hugging Face tokenizer as ``text.frontend``: the batch carries its own ids.

A real Feed (producers, coordinator) over the demo data, the tokenizer built by a factory the
index's processes import; inside the step each row's ids are checked against the tokenizer's
own ``encode`` of the text of the clip the ``clip`` field names, and padding against its pad id.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import stoker
from tests.procs import free_port
from tests.shared.user_tokenizers import EOS, PAD, TOKENIZER_ENV, UNK, train_bpe
from tests.stoker.test_feed import assert_no_producers_left

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROJECT = Path(__file__).resolve().parents[2]
DEMO = PROJECT / "data" / "demo"
HF = "tests.shared.user_tokenizers:hf_tokenizer"


def test_a_hugging_face_tokenizers_ids_size_and_pad_id_are_what_the_batch_carries(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    texts = [line.split("|")[2] for line in (DEMO / "metadata.csv").read_text(encoding="utf-8").splitlines()]
    # its pad id 2, not stoker's 0: a batch padded with 0 fails below
    tokenizer = train_bpe(texts, tmp_path / "bpe.json", vocab_size=180, specials=(UNK, EOS, PAD))
    pad = tokenizer.token_to_id(PAD)
    assert pad == 2
    monkeypatch.setenv(TOKENIZER_ENV, str(tmp_path / "bpe.json"))  # the producers and the index's helpers inherit it
    given = {"data": str(DEMO), "producers": 2, "batch_size": 12, "epochs": 1, "framework": "numpy",
             "run_dir": str(tmp_path / "run"), "bind": f"tcp://127.0.0.1:{free_port()}", "model_start_delay": 0.0,
             "log_level": "WARNING",
             "set": {"text.frontend": HF, "trainer.val_clips": 0, "batching.fields": "clip",
                     "batching.fixed_rows": True}}
    trained, padded, empty = [], 0, 0
    with stoker.Feed(**given) as feed:
        vocabulary, clips = feed.vocabulary, feed.clips
        assert vocabulary.size == tokenizer.get_vocab_size() == 180
        assert (vocabulary.pad_id, vocabulary.eos_id, vocabulary.padding_id) == (pad, tokenizer.token_to_id(EOS), pad)
        for _, batches in feed.epochs():
            for batch in batches:
                tokens, lengths = batch["tokens"], batch["token_lengths"]
                for row, position in enumerate(batch["clip"].tolist()):
                    n = int(lengths[row])
                    assert (tokens[row, n:] == pad).all()  # past the row's ids, and all of an empty row
                    padded += tokens.shape[1] - n
                    if position == -1:
                        empty += 1
                        continue
                    clip = clips[position]
                    assert tokens[row, :n].tolist() == tokenizer.encode(clip.text).ids
                    trained.append(position)
                feed.step_done()
    assert len(trained) == len(set(trained)) == len(texts) and padded > 0 and empty > 0
    assert_no_producers_left(os.getpid())
