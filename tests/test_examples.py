"""The example models of docs/examples/: the autoregressive one (ar_tts.py) keeps the user
model contract of docs/MODELS.md, learns, and generates by itself, deterministically."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from stoker.shared import config as config_mod
from stoker.shared.batch import batch_dims, collate, example, schema_for
from stoker.shared.mel import pad_values
from tests.factories import sentence, tone
from tests.procs import read_jsonl, run_cli

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import ar_tts  # noqa: E402  (found on docs/examples, as a user's module is on PYTHONPATH)

pytestmark = pytest.mark.slow  # TensorFlow or processes: not a unit test

N_MELS = 80
FIELDS = "speaker_id,language_id,stop"
LOSS_NAMES = {"mel_l1", "postnet_l1", "stop"}


def demo_clips(count: int, seconds: float = 0.3) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    """(tokens, log-mels, vocabulary size) of ``count`` demo-like clips: sentences encoded by
    the character front-end, log-mels of voiced-like tones (two pitches one after the other)."""
    from stoker.producer.features import log_mel_spectrogram_numpy
    from stoker.shared.text import Characters
    from stoker.shared.vocab import Vocabulary

    frontend = Characters()
    units = [u.units for u in frontend.units([sentence(i, words=3) for i in range(count)], "en")]
    vocab = Vocabulary.build(frontend, units, ["en"], ["default"])
    tokens = [vocab.encode(u) for u in units]
    mels = []
    for i in range(count):
        audio = np.concatenate([tone(seconds * (1 + 0.2 * i), seed=i), 0.3 * tone(seconds, seed=100 + i)])
        mels.append(log_mel_spectrogram_numpy(audio).astype(np.float32))
    return tokens, mels, vocab.size


def batch_of(tokens: list[np.ndarray], mels: list[np.ndarray], fields: str = FIELDS, size: int | None = None,
             speakers: list[int] | None = None) -> dict[str, np.ndarray]:
    schema = schema_for(fields)
    speakers = speakers or [i % 2 for i in range(len(tokens))]
    rows = [example(t, m, schema, speaker_id=s) for t, m, s in zip(tokens, mels, speakers)]
    dims = batch_dims(size or len(rows), (max(map(len, tokens)) + 2, max(map(len, mels)) + 3), N_MELS)
    return collate(rows, dims, pad_values(schema, config_mod.FeaturesConfig(), "off"), schema)


def total_loss(out: dict) -> float:
    return float(sum(float(v) for v in out["losses"].values()))


def fit(model, batch: dict, steps: int, learning_rate: float = 3e-3) -> list[float]:
    """A plain Adam loop on one fixed batch, on the sum of the model's own losses."""
    optimizer = tf.keras.optimizers.Adam(learning_rate)

    @tf.function
    def step(inputs):
        with tf.GradientTape() as tape:
            loss = tf.add_n(list(model(inputs, training=True)["losses"].values()))
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        return loss

    return [float(step(batch)) for _ in range(steps)]


def conditioning(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k not in ("mel", "mel_lengths", "stop")}


@pytest.fixture(scope="module")
def clips():
    return demo_clips(4)


def test_teacher_forced_call_keeps_the_contract(clips) -> None:
    tokens, mels, vocab_size = clips
    tf.keras.utils.set_random_seed(0)
    model = ar_tts.build(vocab_size=vocab_size, n_mels=N_MELS)
    batch = batch_of(tokens, mels, size=6)  # two empty rows, as a short batch with fixed rows has
    B, T = batch["mel"].shape[:2]
    out = model(batch, training=False)
    assert set(out) == {"mel", "stop_logits", "losses"} and set(out["losses"]) == LOSS_NAMES
    assert out["mel"].shape == (B, T, N_MELS) and out["mel"].dtype == tf.float32
    assert out["stop_logits"].shape == (B, T)
    for name, value in out["losses"].items():
        assert value.shape == () and np.isfinite(float(value)) and float(value) > 0, name
    assert 2_000_000 > sum(int(np.prod(v.shape)) for v in model.trainable_weights) > 100_000

    # The stop field, when the run has it, is the target derived from the lengths.
    plain = model({k: v for k, v in batch.items() if k != "stop"}, training=False)["losses"]
    assert float(plain["stop"]) == pytest.approx(float(out["losses"]["stop"]), rel=1e-6)

    # Teacher forcing: frame t of the mel input reaches the decoder at t+1, never before.
    changed = {**batch, "mel": batch["mel"].copy()}
    changed["mel"][0, 5] += 3.0
    logits, again = out["stop_logits"].numpy(), model(changed, training=False)["stop_logits"].numpy()
    assert np.array_equal(logits[0, :6], again[0, :6]) and not np.allclose(logits[0, 6:], again[0, 6:])
    assert np.array_equal(logits[1:], again[1:])

    # The frame losses are means over the valid frames: the padding's values do not count.
    padded = {**batch, "mel": batch["mel"].copy()}
    for row, length in enumerate(batch["mel_lengths"]):
        padded["mel"][row, length:] = 7.0
    moved = model(padded, training=False)["losses"]
    for name in ("mel_l1", "stop"):
        assert float(moved[name]) == pytest.approx(float(out["losses"][name]), rel=1e-5)


def test_optional_fields_condition_the_model_and_any_subset_trains(clips) -> None:
    tokens, mels, vocab_size = clips
    tf.keras.utils.set_random_seed(0)
    model = ar_tts.build(vocab_size=vocab_size, n_mels=N_MELS)
    full = batch_of(tokens, mels)
    ref = np.full((len(tokens), 40, N_MELS), np.log(1e-5), np.float32)
    ref[:, :30] = mels[0][:30]
    with_ref = {**full, "ref_mel": ref, "ref_mel_lengths": np.array([30, 30, 0, 30], np.int32)}
    base = model(with_ref, training=False)["mel"].numpy()
    other_speaker = model({**with_ref, "speaker_id": 1 - full["speaker_id"]}, training=False)["mel"].numpy()
    assert not np.allclose(base, other_speaker)
    other_ref = {**with_ref, "ref_mel": ref + 1.0}
    moved = model(other_ref, training=False)["mel"].numpy()
    assert not np.allclose(base[0], moved[0]) and np.array_equal(base[2], moved[2])  # row 2 has no reference
    for fields in ("", "stop", "speaker_id", "language_id,stop"):
        out = model(batch_of(tokens, mels, fields=fields), training=True)
        assert set(out["losses"]) == LOSS_NAMES and np.isfinite(total_loss(out)), fields


def test_mixed_precision_keeps_float32_outputs_and_losses(clips) -> None:
    """On a GPU stoker sets the mixed_float16 policy before building: the outputs stay float32."""
    import keras

    tokens, mels, vocab_size = clips
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = ar_tts.build(vocab_size=vocab_size, n_mels=N_MELS)
        batch = batch_of(tokens[:2], mels[:2])
        out = model({**batch, "ref_mel": batch["mel"], "ref_mel_lengths": batch["mel_lengths"]}, training=True)
        made = model.generate(conditioning(batch), max_frames=3)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert out["mel"].dtype == out["stop_logits"].dtype == made["mel"].dtype == tf.float32
    assert all(v.dtype == tf.float32 and np.isfinite(float(v)) for v in out["losses"].values())


@pytest.mark.timeout(90)
def test_it_learns_a_fixed_batch(clips) -> None:
    tokens, mels, vocab_size = clips
    tf.keras.utils.set_random_seed(1)
    model = ar_tts.build(vocab_size=vocab_size, n_mels=N_MELS)
    losses = fit(model, batch_of(tokens, mels), steps=30)  # the last 5: ~0.31 of the first
    assert all(np.isfinite(losses))
    assert min(losses[-5:]) < 0.5 * losses[0], losses[::10]


@pytest.fixture(scope="module")
def overfit(clips):
    """A model trained on one clip until it knows it by heart, with that clip's batch."""
    tokens, mels, vocab_size = clips
    tf.keras.utils.set_random_seed(2)
    model = ar_tts.build(vocab_size=vocab_size, n_mels=N_MELS)
    batch = batch_of(tokens[:1], mels[:1])
    losses = fit(model, batch, steps=150)  # the last ~0.12 of the first; the first frames ~half the baseline error
    return model, batch, losses


@pytest.mark.timeout(120)
def test_generation_stops_and_follows_the_clip_it_learned(overfit) -> None:
    model, batch, losses = overfit
    assert losses[-1] < 0.2 * losses[0]
    target = batch["mel"][0, :batch["mel_lengths"][0]]
    made = model.generate(conditioning(batch), max_frames=len(target) + 40)
    mel, length = made["mel"].numpy()[0], int(made["mel_lengths"].numpy()[0])
    first = 8
    error = np.abs(mel[:first] - target[:first]).mean()
    baseline = np.abs(target[:first] - target.mean(axis=0)).mean()  # predicting the clip's average frame
    assert error < 0.4 and error < 0.5 * baseline, (error, baseline)
    assert abs(length - len(target)) <= 4, (length, len(target))  # the stop logit learned where it ends


def test_generation_is_deterministic_and_bounded(clips) -> None:
    tokens, mels, vocab_size = clips
    tf.keras.utils.set_random_seed(3)
    model = ar_tts.build(vocab_size=vocab_size, n_mels=N_MELS)
    batch = batch_of(tokens, mels, size=5)  # row 4 empty
    inputs = conditioning(batch)
    model(batch, training=False)
    first, second = model.generate(inputs, max_frames=12), model.generate(inputs, max_frames=12)
    assert np.array_equal(first["mel"].numpy(), second["mel"].numpy())
    lengths = first["mel_lengths"].numpy()
    assert np.array_equal(lengths, second["mel_lengths"].numpy())
    assert lengths[4] == 0 and np.all(lengths[:4] >= 1) and np.all(lengths <= 12)
    assert first["mel"].shape[0] == 5 and first["mel"].shape[2] == N_MELS and first["mel"].shape[1] <= 12

    model.stop.bias.assign([50.0])  # every frame says "last": one frame per row
    stopped = model.generate(inputs, max_frames=12)
    assert stopped["mel_lengths"].numpy().tolist() == [1, 1, 1, 1, 0] and stopped["mel"].shape[1] == 1
    model.stop.bias.assign([-50.0])  # never: the bound ends every row
    bounded = model.generate(inputs, max_frames=7)
    assert bounded["mel_lengths"].numpy().tolist() == [7, 7, 7, 7, 0] and bounded["mel"].shape[1] == 7


def test_synth_restores_the_example_and_lets_it_decide_the_length(tmp_path) -> None:
    """synth on a checkpoint of ar_tts: the restored stop layer decides how many frames come out."""
    from stoker.consumer.training import tts
    from stoker.consumer.feed.checkpoint import CKPT_DIR, Checkpointer
    from stoker.consumer.training.synth import generation_limit, synthesize
    from stoker.shared.runfiles import VOCAB
    from stoker.shared.text import Characters
    from stoker.shared.vocab import Vocabulary, save_vocabulary

    frontend = Characters()
    vocab = Vocabulary.build(frontend, [u.units for u in frontend.units(["Hello there!"], "en")], ["en"],
                             ["anna", "bob"])
    tokens = len("Hello there!") + 1  # EOS
    cases = (("stops", 50.0, None, 1), ("never", -50.0, None, generation_limit(tokens)), ("bounded", -50.0, 9, 9))
    for name, stop_bias, frames, expected in cases:
        run_dir = tmp_path / name
        run_dir.mkdir()
        cfg = config_mod.load(None, {"trainer.model": "ar_tts:build", "batching.fields": FIELDS})
        config_mod.save(cfg, run_dir / "config.yaml")
        save_vocabulary(vocab, run_dir / VOCAB)
        net = tts.build("ar_tts:build", vocab.size, N_MELS)
        net(tts.dummy_inputs(1, 8, 16, N_MELS, -11.5, vocab.size, schema_for(FIELDS)))
        net.stop.bias.assign([stop_bias])
        state = tf.train.Checkpoint(**tts.restorable(net), step=tf.Variable(3, dtype=tf.int64))
        Checkpointer(run_dir / CKPT_DIR, keep=1).save(3, {"state": ["model", "weights"], "model": "ar_tts:build"},
                                                      state)
        result = synthesize(run_dir, "Hello there!", tmp_path / f"{name}.npy", frames=frames, speaker="bob")
        mel = np.load(result.mel_path)
        assert result.frames == expected == len(mel) and mel.shape[1] == N_MELS and np.isfinite(mel).all(), name


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ar_example_trains_end_to_end(tmp_path) -> None:
    run_dir = tmp_path / "run"
    env = {"PYTHONPATH": "docs/examples"}
    result = run_cli("--model", "ar_tts:build", "--steps", "80", "--producers", "1", "--batch-size", "8",
                     "--run-dir", str(run_dir), "--set", "trainer.loss=model", "--set", f"batching.fields={FIELDS}",
                     "--set", "trainer.log_every_steps=10", "--set", "trainer.val_every_steps=30",
                     "--model-start-delay", "0", env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [row["loss"] for row in read_jsonl(run_dir / "metrics.jsonl")]
    assert len(losses) == 80 and all(np.isfinite(losses))
    assert np.mean(losses[-10:]) < 0.5 * losses[0], losses[::10]  # the last steps' mean: one step is noisy
    out = tmp_path / "said" / "mel.npy"
    synth = run_cli("synth", str(run_dir), "--text", "The dog barked.", "--out", str(out), env=env, timeout=90)
    assert synth.returncode == 0, synth.stderr[-2000:]
    mel = np.load(out)
    assert mel.ndim == 2 and mel.shape[1] == N_MELS and 1 <= len(mel) <= 10 * 16 + 50 and np.isfinite(mel).all()
    assert out.with_suffix(".png").exists() and f"mel of {len(mel)} frames" in synth.stdout
