"""``run.py synth`` (consumer/training/synth.py): a checkpointed model turns text into a mel and a PNG."""

from __future__ import annotations

import numpy as np
import pytest

from stoker.consumer.feed.checkpoint import CKPT_DIR, Checkpointer
from stoker.consumer.training.synth import SynthError, synthesize
from stoker.shared import config as config_mod
from stoker.shared.runfiles import VOCAB
from stoker.shared.text import Characters, make_frontend
from stoker.shared.vocab import Vocabulary, load_vocabulary
from stoker.shared.mel import pad_values
from tests.consumer.training.fake_runs import SAVED_MODELS, TRAINED_TEXTS, fake_run as _run_dir
from tests.procs import run_cli

pytestmark = pytest.mark.slow  # TensorFlow or processes: not a unit test


def test_synth_writes_mel_and_png(tmp_path) -> None:
    run_dir = _run_dir(tmp_path)
    result = synthesize(run_dir, "Printing, in the only sense with which we are concerned.", tmp_path / "o" / "mel.npy")
    mel = np.load(result.mel_path)
    assert mel.shape == (result.frames, 80) and mel.dtype == np.float32 and np.isfinite(mel).all()
    assert 1 <= result.frames <= 5000 and result.checkpoint.endswith("ckpt-000007")
    assert result.png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fixed = synthesize(run_dir, "Hello.", tmp_path / "fixed.npy", frames=50)
    assert np.load(fixed.mel_path).shape == (50, 80)


def test_synth_restores_every_weight_and_is_deterministic(tmp_path) -> None:
    """The mel synth writes is what the saved model computes (every weight restored), twice the same."""
    from stoker.consumer.training import tts
    from stoker.consumer.training.synth import encode_for_run, one_batch
    from stoker.shared.batch import SCHEMA

    run_dir = _run_dir(tmp_path)
    text = "Where is the ball?"
    first = np.load(synthesize(run_dir, text, tmp_path / "a.npy", frames=48).mel_path)
    again = np.load(synthesize(run_dir, text, tmp_path / "b.npy", frames=48).mel_path)
    np.testing.assert_array_equal(first, again)
    cfg = config_mod.load(run_dir / "config.yaml")
    tokens, _ = encode_for_run(run_dir, cfg, text, "en")
    inputs = one_batch(tokens, 48, cfg.features.n_mels, pad_values(SCHEMA, cfg.features, "off"), SCHEMA)
    expected = np.asarray(tts.outputs_of(SAVED_MODELS[run_dir](inputs, training=False))["mel"])[0]
    np.testing.assert_allclose(first, expected, rtol=1e-5, atol=1e-5)


def test_synth_refuses_a_checkpoint_without_the_weights_list(tmp_path) -> None:
    run_dir = _run_dir(tmp_path, weights=False)
    import tensorflow as tf

    from stoker.consumer.training import tts

    cfg = config_mod.load(run_dir / "config.yaml")
    net = tts.build("tiny", 40, cfg.features.n_mels)
    net(tts.dummy_inputs(1, 8, 16, cfg.features.n_mels, -11.5, 40))
    Checkpointer(run_dir / CKPT_DIR, keep=1).save(3, {"state": ["model"], "model": "tiny"},
                                                  tf.train.Checkpoint(model=net))
    with pytest.raises(SynthError, match="older stoker and misses some model weights"):
        synthesize(run_dir, "Hello.", tmp_path / "mel.npy", frames=10)


def test_synth_refusals(tmp_path) -> None:
    run_dir = _run_dir(tmp_path, weights=False)
    with pytest.raises(SynthError, match="no checkpoint in"):
        synthesize(run_dir, "Hello.", tmp_path / "mel.npy")
    with pytest.raises(SynthError, match="nothing to say"):
        synthesize(run_dir, "  ", tmp_path / "mel.npy")
    with pytest.raises(SynthError, match="--frames must be between"):
        synthesize(run_dir, "Hello.", tmp_path / "mel.npy", frames=0)
    # the run's vocabulary decides: a letter outside it (not English, in no English text) is refused
    # by name, not dropped
    with pytest.raises(SynthError, match=r"cannot represent: '\u0159' U\+0159"):
        synthesize(run_dir, "Dvo\u0159\u00e1k.", tmp_path / "mel.npy")
    (run_dir / VOCAB).unlink()
    with pytest.raises(SynthError, match="vocabulary is missing"):
        synthesize(run_dir, "Hello.", tmp_path / "mel.npy")


def test_synth_uses_the_run_vocabulary_not_todays(tmp_path) -> None:
    """A Persian run synthesizes Persian, any sentence of it: the ids come from the run's vocab.json,
    which holds the front-end's whole inventory of the run's languages, not only the texts' symbols."""
    from stoker.consumer.training.synth import encode_for_run

    texts = ["امروز هوا آفتابی است.", "سلام دنیا"]
    new = "ژاله، این کتاب about مؤسسه است؟"  # letters and (phonemized) symbols neither text has
    for name, frontend in (("characters", Characters()), ("phonemes", make_frontend("phonemes"))):
        trained = [u.units for u in frontend.units(texts, "fa")]
        vocab = Vocabulary.build(frontend, trained, ["fa"], ["default"])
        (tmp_path / name).mkdir()
        run_dir = _run_dir(tmp_path / name, vocab=vocab)
        cfg = config_mod.load(run_dir / "config.yaml")
        tokens, used = encode_for_run(run_dir, cfg, "سلام دنیا", "fa")
        assert used == vocab and used.decode(tokens) == trained[1] and tokens[-1] == 1
        # the Arabic yeh (U+064A) is the Persian one after normalisation: the same ids
        again, _ = encode_for_run(run_dir, cfg, "سلام دن\u064aا", "fa")
        assert again.tolist() == tokens.tolist()
        units = frontend.units([new], "fa")[0].units
        unseen = set(units) - set("".join(trained))
        assert ({"ɐ", "،"} if name == "phonemes" else {"ژ", "ؤ", "،"}) <= unseen
        result = synthesize(run_dir, new, tmp_path / f"{name}.npy", frames=20, language="fa")
        assert result.tokens == len(units) + 1 and np.load(result.mel_path).shape == (20, 80)
        assert encode_for_run(run_dir, cfg, new, "fa")[0].tolist() == vocab.encode(units).tolist()
        if name == "characters":
            with pytest.raises(SynthError, match="U\\+06A4"):  # veh: Arabic script, but no Persian letter
                encode_for_run(run_dir, cfg, "\u06a4\u06a4", "fa")


def test_synth_corrupt_checkpoint(tmp_path) -> None:
    run_dir = _run_dir(tmp_path)
    data = next((run_dir / CKPT_DIR).glob("ckpt-*/state.data-*"))
    data.write_bytes(b"\0" * data.stat().st_size)
    with pytest.raises(SynthError, match="corrupt"):
        synthesize(run_dir, "Hello.", tmp_path / "mel.npy")


@pytest.mark.timeout(60)
def test_synth_cli_errors_are_one_line(tmp_path) -> None:
    missing = run_cli("synth", str(tmp_path / "nope"), "--text", "hi")
    assert missing.returncode == 2 and missing.stderr.strip().endswith("is not a directory")
    run_dir = _run_dir(tmp_path, model="synthetic:5", weights=False)
    synthetic = run_cli("synth", str(run_dir), "--text", "hi")
    assert synthetic.returncode == 2
    assert synthetic.stderr.strip().splitlines()[-1] == (
        f"stoker: error: run {run_dir} trained the stand-in trainer synthetic:5, which has no model to synthesize with")


def test_synth_passes_the_speaker_and_language_the_model_was_trained_with(tmp_path) -> None:
    frontend = Characters()
    vocab = Vocabulary.build(frontend, [u.units for u in frontend.units(TRAINED_TEXTS, "en")], ["en", "fa"],
                             ["anna", "bob"])
    run_dir = _run_dir(tmp_path, model="tests.consumer.training.user_models:conditioned", vocab=vocab,
                       fields="speaker_id,language_id,stop")
    first = synthesize(run_dir, "Hello there!", tmp_path / "a.npy", frames=30, speaker="anna")
    second = synthesize(run_dir, "Hello there!", tmp_path / "b.npy", frames=30, speaker="bob")
    again = synthesize(run_dir, "Hello there!", tmp_path / "c.npy", frames=30, speaker="bob")
    a, b, c = (np.load(r.mel_path) for r in (first, second, again))
    assert not np.allclose(a, b) and np.array_equal(b, c)  # the speaker reaches the model, the same twice
    with pytest.raises(SynthError, match="--speaker 'carl' is not one of the run's speakers \\(anna, bob\\)"):
        synthesize(run_dir, "Hello there!", tmp_path / "d.npy", frames=30, speaker="carl")
    with pytest.raises(SynthError, match="--language de is not one of the run's languages \\(en, fa\\)"):
        synthesize(run_dir, "Hello there!", tmp_path / "d.npy", frames=30, language="de")


def test_synth_runs_a_model_s_own_generation_loop(tmp_path) -> None:
    frontend = Characters()
    vocab = Vocabulary.build(frontend, [u.units for u in frontend.units(TRAINED_TEXTS, "en")], ["en"], ["anna", "bob"])
    run_dir = _run_dir(tmp_path, model="tests.consumer.training.user_models:generating", vocab=vocab,
                       fields="speaker_id,stop")
    anna = synthesize(run_dir, "Hello there!", tmp_path / "a.npy", speaker="anna")
    mel = np.load(anna.mel_path)
    tokens = len("Hello there!") + 1  # EOS
    # generate() made 3 + 2 x tokens frames (under the default bound of 10 x tokens + 50), trimmed to that
    assert anna.frames == 3 + 2 * tokens == mel.shape[0] and mel.shape[1] == 80 and anna.tokens == tokens
    assert np.allclose(np.diff(mel, axis=0), 1.0)  # frame t is the level + t: the loop's frames, from the first
    bob = np.load(synthesize(run_dir, "Hello there!", tmp_path / "b.npy", speaker="bob").mel_path)
    assert np.allclose(bob - mel, 1.0)  # the speaker id reached generate()
    capped = synthesize(run_dir, "Hello there!", tmp_path / "c.npy", frames=10, speaker="anna")
    assert capped.frames == 10 and np.array_equal(np.load(capped.mel_path), mel[:10])  # --frames bounds it

    broken = tmp_path / "broken"
    broken.mkdir()
    run_dir = _run_dir(broken, model="tests.consumer.training.user_models:generating_without_lengths", vocab=vocab,
                       fields="speaker_id")
    with pytest.raises(SynthError, match=r"generate\(\) must return a dict with 'mel' \[B, T, F\] and 'mel_lengths'"):
        synthesize(run_dir, "Hello there!", tmp_path / "d.npy")


def test_generation_limit_grows_with_the_text_and_is_capped() -> None:
    from stoker.consumer.training.synth import MAX_FRAMES, generation_limit

    assert generation_limit(13) == 180 and generation_limit(1) == 60 and generation_limit(10_000) == MAX_FRAMES


def test_synth_takes_the_length_from_the_trained_weights(tmp_path) -> None:
    import tensorflow as tf

    from stoker.consumer.training import tts

    model = "tests.consumer.training.user_models:lengthed"
    run_dir = _run_dir(tmp_path, model=model, weights=False)
    vocab = load_vocabulary(run_dir / VOCAB)
    net = tts.build(model, vocab.size, 80)
    net(tts.dummy_inputs(1, 8, 16, 80, -11.5, vocab.size))
    net.log_frames.assign(np.log(37.0))
    state = tf.train.Checkpoint(**tts.restorable(net), step=tf.Variable(7, dtype=tf.int64))
    Checkpointer(run_dir / CKPT_DIR, keep=1).save(7, {"state": ["model", "weights"], "model": model}, state)
    result = synthesize(run_dir, "Hello there!", tmp_path / "mel.npy")
    assert result.frames == 37 == len(np.load(result.mel_path))  # not exp(0) = 1 of the freshly built model


def test_a_reference_recording_becomes_the_batchs_ref_mel(tmp_path) -> None:
    """--reference: the recording's log-mel as producers make a reference (cropped around its
    middle to batching.ref_frames), in the synthesized batch; refused for a run without ref_mel."""
    import soundfile

    from stoker.consumer.training.synth import one_batch, reference_mel
    from stoker.producer.features import log_mel_spectrogram_numpy
    from stoker.shared.batch import schema_for
    from tests.factories import tone

    wav = tmp_path / "voice.wav"
    soundfile.write(str(wav), tone(4.0, 22050, seed=3), 22050, subtype="FLOAT")
    run_dir = _run_dir(tmp_path, fields="ref_mel")
    cfg = config_mod.load(run_dir / "config.yaml")
    ref = reference_mel(run_dir, cfg, wav)
    full = log_mel_spectrogram_numpy(soundfile.read(str(wav), dtype="float32")[0], cfg.features, dtype=np.float32)
    start = (len(full) - cfg.batching.ref_frames) // 2
    np.testing.assert_allclose(ref, full[start:start + cfg.batching.ref_frames], rtol=1e-5, atol=1e-5)
    schema = schema_for("ref_mel")
    pads = pad_values(schema, config_mod.FeaturesConfig(), "off")
    batch = one_batch(np.array([5, 1], np.int32), 16, 80, pads, schema, hop_length=256,
                      ref_frames=cfg.batching.ref_frames, ref_mel=ref)
    assert batch["ref_mel_lengths"].tolist() == [cfg.batching.ref_frames]
    np.testing.assert_array_equal(batch["ref_mel"][0], ref)
    result = synthesize(run_dir, "Hello there!", tmp_path / "said.npy", frames=20, reference=wav)
    assert np.load(result.mel_path).shape == (20, 80)
    (tmp_path / "plain").mkdir()
    plain = _run_dir(tmp_path / "plain")
    with pytest.raises(SynthError, match="--reference needs a run trained with the ref_mel field"):
        synthesize(plain, "Hello there!", tmp_path / "x.npy", frames=20, reference=wav)
    with pytest.raises(SynthError, match="--reference .*missing"):
        synthesize(run_dir, "Hello there!", tmp_path / "x.npy", frames=20, reference=tmp_path / "none.wav")
