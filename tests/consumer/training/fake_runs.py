"""A fake run directory: a config, a vocabulary and a checkpoint of a freshly built model, as a
training run leaves them (for synth and export)."""

from __future__ import annotations

from stoker.consumer.feed.checkpoint import CKPT_DIR, Checkpointer
from stoker.shared import config as config_mod
from stoker.shared.runfiles import CONFIG, VOCAB
from stoker.shared.text import Characters
from stoker.shared.vocab import Vocabulary, save_vocabulary

# The texts of the fake run's dataset: its vocabulary is the English characters (and any other of theirs).
TRAINED_TEXTS = ("Printing, in the only sense with which we are at present concerned.", "Hello there!",
                 "Where is the big red ball?")


# The model each fake run saved, to compare synth's output with.
SAVED_MODELS: dict = {}


def fake_run(tmp_path, model: str = "tiny", weights: bool = True, vocab: Vocabulary | None = None, fields: str = ""):
    """``tmp_path/run`` with the config of ``model``, a vocabulary of TRAINED_TEXTS and (``weights``)
    a checkpoint of the model at step 7, which SAVED_MODELS keeps."""
    import tensorflow as tf

    from stoker.consumer.training import tts
    from stoker.shared.batch import schema_for

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = config_mod.load(None, {"trainer.model": model, "batching.fields": fields})
    config_mod.save(cfg, run_dir / CONFIG)
    if vocab is None:
        frontend = Characters()
        vocab = Vocabulary.build(frontend, [u.units for u in frontend.units(TRAINED_TEXTS, "en")], ["en"], ["default"])
    save_vocabulary(vocab, run_dir / VOCAB)
    if weights:
        net = tts.build(model, vocab.size, cfg.features.n_mels)
        net(tts.dummy_inputs(1, 8, 16, cfg.features.n_mels, -11.5, vocab.size, schema_for(fields)))
        state = tf.train.Checkpoint(**tts.restorable(net), step=tf.Variable(7, dtype=tf.int64))
        Checkpointer(run_dir / CKPT_DIR, keep=1).save(7, {"state": ["model", "weights"], "model": model}, state)
        SAVED_MODELS[run_dir] = net
    return run_dir
