"""The Keras trainer (consumer/training/trainer.py): it learns, accumulates exactly, skips NaN,
traces once per bucket shape, keeps the user-model contract, picks precision and XLA
by device. Small shapes (B=4, L=16, T=32) keep each case to a few seconds on a CPU."""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import pytest

from stoker.consumer.training import trainer as trainers
from stoker.consumer.training.optim import lr_at
from stoker.consumer.training.trainer import (Health, KerasTrainer, ModelError, choose_jit_compile, choose_precision)
from stoker.shared import config as config_mod
from stoker.shared.mel import pad_values
from tests.factories import TOKEN_IDS, make_batch

pytestmark = pytest.mark.slow  # TensorFlow or processes: not a unit test

SHAPE = (16, 32)  # (L, T) of every test batch
# A small user model: mechanics that do not need the real one are traced in a fraction of tiny's time.
GOOD = "tests.consumer.training.user_models:good"


def _cfg(**trainer) -> config_mod.Config:
    base = config_mod.Config()
    settings = {"warmup_steps": 0, "lr_decay": "constant", **trainer}
    return dataclasses.replace(base, batching=dataclasses.replace(base.batching, batch_size=4),
                               trainer=dataclasses.replace(base.trainer, **settings))


def _trainer(shapes=((4, *SHAPE),), **trainer) -> KerasTrainer:
    return KerasTrainer(_cfg(**trainer), "/CPU:0", shapes, total_batches=100, vocab_size=TOKEN_IDS)


def _weights(trainer: KerasTrainer) -> list[np.ndarray]:
    return [v.numpy().copy() for v in trainer.model.trainable_variables]


@pytest.fixture(autouse=True)
def _float32_policy():
    yield
    import keras

    keras.mixed_precision.set_global_policy("float32")


def _speech_like_batch() -> dict[str, np.ndarray]:
    """A batch whose mels have a speech-like level and smooth structure (learnable, unlike noise)."""
    batch = make_batch(4, *SHAPE, seed=0)
    t = np.arange(SHAPE[1])[None, :, None]
    f = np.arange(80)[None, None, :]
    mel = -6.0 + 2.0 * np.sin(f / 9.0 + t / 5.0) - f / 40.0
    valid = t < batch["mel_lengths"][:, None, None]
    batch["mel"] = np.where(valid, mel, batch["mel"]).astype(np.float32)
    return batch


@pytest.fixture(scope="module")
def trained() -> tuple[KerasTrainer, list]:
    """The real model trained 40 steps on one batch: built and traced once for the tests that use it."""
    trainer = _trainer(learning_rate=3e-3)
    staged = trainer.stage(_speech_like_batch())
    return trainer, trainer.resolve([trainer.step(staged) for _ in range(40)])


def test_loss_falls_on_a_fixed_batch(trained) -> None:
    trainer, losses = trained
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.5 * losses[0]
    assert trainer.updates == 40 and trainer.health() == Health(0, 0)
    # The loop traces ahead, validates and draws what a trainer with a model has; the synthetic one has none.
    assert isinstance(trainer, trainers.ModelTrainer)
    assert not isinstance(trainers.SyntheticTrainer(1.0), trainers.ModelTrainer)


def test_gradient_accumulation_equals_the_large_batch_gradient() -> None:
    """K=2 micro-batches, then one update == one update on both as a single batch (plain SGD,
    so the update is the gradient itself; different valid frames per micro-batch)."""
    import keras

    first, second = make_batch(4, *SHAPE, valid=4, seed=1), make_batch(4, *SHAPE, valid=2, seed=2)
    assert first["mel_lengths"].sum() != second["mel_lengths"].sum()
    both = {k: np.concatenate([first[k], second[k]]) for k in first}

    def sgd_trainer(accum: int) -> KerasTrainer:
        keras.utils.set_random_seed(0)
        return KerasTrainer(_cfg(grad_accum=accum, clip_norm=0.0), "/CPU:0", [(4, *SHAPE)], total_batches=10,
                            vocab_size=TOKEN_IDS,
                            optimizer=keras.optimizers.SGD(learning_rate=1.0))

    accumulated, large = sgd_trainer(2), sgd_trainer(1)
    start = _weights(accumulated)
    assert all(np.array_equal(a, b) for a, b in zip(start, _weights(large)))
    accumulated.step(accumulated.stage(first))
    assert all(np.array_equal(a, b) for a, b in zip(start, _weights(accumulated)))  # no update after 1 of 2
    accumulated.step(accumulated.stage(second))
    large.step(large.stage(both))
    assert accumulated.updates == large.updates == 1
    for before, a, b in zip(start, _weights(accumulated), _weights(large)):
        np.testing.assert_allclose(before - a, before - b, rtol=2e-4, atol=1e-6)
    assert any(not np.allclose(before, a) for before, a in zip(start, _weights(accumulated)))


def test_nan_loss_is_skipped_and_counted() -> None:
    trainer = _trainer(model="tests.consumer.training.user_models:nan_loss")
    before = _weights(trainer)
    staged = trainer.stage(make_batch(4, *SHAPE))
    losses = trainer.resolve([trainer.step(staged) for _ in range(3)])
    assert all(math.isnan(x) for x in losses)
    assert trainer.health() == Health(bad_in_row=3, bad_total=3)
    assert trainer.updates == 0
    assert all(np.array_equal(a, b) for a, b in zip(before, _weights(trainer)))


def test_a_good_step_resets_the_bad_run() -> None:
    trainer = _trainer(model=GOOD)
    good = trainer.stage(make_batch(4, *SHAPE))
    poisoned = make_batch(4, *SHAPE)
    poisoned["mel"][0, 0, 0] = np.inf
    bad = trainer.stage(poisoned)
    trainer.resolve([trainer.step(bad), trainer.step(bad), trainer.step(good), trainer.step(bad)])
    assert trainer.health() == Health(bad_in_row=1, bad_total=3)
    assert trainer.updates == 1


def test_one_trace_per_bucket_shape_and_retraces_are_logged(caplog) -> None:
    shapes = [(6, 16, 32), (3, 24, 48)]  # per-bucket rows, as a frame budget plans them
    trainer = _trainer(shapes=shapes, model=GOOD)
    trainer.prepare(shapes)
    assert trainer.stats()["traces"] == 2
    for _ in range(3):
        for B, L, T in shapes:
            trainer.step(trainer.stage(make_batch(B, L, T)))
    assert trainer.stats()["traces"] == 2 and trainer.retraces == 0
    with caplog.at_level(logging.WARNING, logger="stoker.consumer.training.trainer"):
        trainer.step(trainer.stage(make_batch(4, 8, 16)))
    assert trainer.retraces == 1
    assert "not one of the plan's 2 bucket shapes" in caplog.text


def test_evaluate_and_predict(trained) -> None:
    trainer, _ = trained  # what evaluate and predict give does not depend on the weights: the trained model serves
    batch = make_batch(4, *SHAPE, valid=3)
    loss = trainer.evaluate([trainer.stage(batch)])
    assert loss is not None and math.isfinite(loss)
    assert trainer.evaluate([]) is None
    out = trainer.predict(batch)
    assert out["mel"].shape == (4, 32, 80) and out["log_frames"].shape == (4,)


def test_user_model_trains() -> None:
    trainer = _trainer(model="tests.consumer.training.user_models:good", learning_rate=1e-2)
    staged = trainer.stage(make_batch(4, *SHAPE))
    losses = trainer.resolve([trainer.step(staged) for _ in range(20)])
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name, message", [
    ("wrong_shape", r"output 'mel' has shape \[4, 33, 80\] for a batch of B=4, T=32, F=80; expected \[4, 32, 80\]"),
])
def test_user_model_breaking_the_contract_is_refused(name: str, message: str) -> None:
    with pytest.raises(ModelError, match=message) as info:
        _trainer(model=f"tests.consumer.training.user_models:{name}")
    assert "docs/MODELS.md" in str(info.value)


def test_precision_and_xla_follow_the_device() -> None:
    import keras

    assert choose_precision("auto", on_gpu=True) == "mixed_float16"
    assert choose_precision("auto", on_gpu=False) == "float32"
    assert choose_precision("mixed_bfloat16", on_gpu=True) == "mixed_bfloat16"
    assert choose_jit_compile(None, on_gpu=True) is True
    assert choose_jit_compile(None, on_gpu=False) is False
    assert choose_jit_compile(False, on_gpu=True) is False
    trainer = _trainer(model=GOOD)  # the CPU: float32, no XLA, no loss scaling
    assert (trainer.precision, trainer.jit_compile, trainer.loss_scaling) == ("float32", False, False)
    assert not isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)


def test_mixed_float16_uses_loss_scaling() -> None:
    """What a GPU gets by default, forced here on the CPU: policy, scaled optimizer, float32 output."""
    import keras

    trainer = _trainer(precision="mixed_float16", model=GOOD)
    assert trainer.loss_scaling and isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
    assert keras.mixed_precision.global_policy().name == "mixed_float16"
    out = trainer.predict(make_batch(4, *SHAPE))
    assert out["mel"].dtype == np.float32
    loss = trainer.resolve([trainer.step(trainer.stage(make_batch(4, *SHAPE)))])[0]
    assert math.isfinite(loss)


def test_learning_rate_schedule() -> None:
    assert lr_at(0, 1.0, 10, 100, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_at(9, 1.0, 10, 100, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_at(99, 1.0, 10, 100, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_at(54, 1.0, 10, 100, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_at(500, 1.0, 10, None, "cosine", 0.1) == 1.0  # unknown budget: constant after warm-up
    assert lr_at(3, 2.0, 0, 100, "constant", 0.1) == 2.0
    trainer = _trainer(warmup_steps=4, learning_rate=1.0, lr_decay="cosine", model=GOOD)
    assert trainer.learning_rate() == pytest.approx(0.25)


def test_check_model_without_tensorflow_imports() -> None:
    assert trainers.check_model("synthetic:5") == 5.0
    assert trainers.check_model("tiny") is None
    assert trainers.check_model("tests.consumer.training.user_models:good") is None
    with pytest.raises(ModelError, match="no module named no_such_pkg"):
        trainers.check_model("no_such_pkg.mod:build")
    with pytest.raises(ModelError, match="MS >= 0"):
        trainers.check_model("synthetic:-1")


def test_optional_fields_reach_the_model_and_one_it_lacks_is_named() -> None:
    """speaker_id, language_id and stop, switched on, are inputs the model conditions on (it
    checks the stop target's form itself); a model reading a field the run does not switch on
    is one line naming the setting."""
    from stoker.shared.batch import batch_dims, collate, example, schema_for

    fields = "speaker_id,language_id,stop"
    base = _cfg(model="tests.consumer.training.user_models:conditioned", learning_rate=1e-2)
    cfg = dataclasses.replace(base, batching=dataclasses.replace(base.batching, fields=fields))
    trainer = KerasTrainer(cfg, "/CPU:0", [(4, *SHAPE)], total_batches=100, vocab_size=TOKEN_IDS)
    schema = schema_for(fields)
    rng = np.random.default_rng(0)
    rows = [example(rng.integers(2, TOKEN_IDS, size=5 + i), rng.standard_normal((20 + i, 80)).astype(np.float32),
                    schema, speaker_id=i % 3, language_id=i % 2) for i in range(3)]
    arrays = collate(rows, batch_dims(4, SHAPE, 80), pad_values(schema, config_mod.FeaturesConfig(), "off"), schema)
    assert arrays["speaker_id"].tolist() == [0, 1, 2, 0] and arrays["language_id"].tolist() == [0, 1, 0, 0]
    losses = trainer.resolve([trainer.step(trainer.stage(arrays)) for _ in range(20)])
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    with pytest.raises(ModelError, match=r"reads the batch field 'stop', which this run does not switch on: "
                                         r"--set batching.fields=stop \(optional fields: speaker_id, language_id, "
                                         r"stop, audio, ref_mel, row_mask, clip\)$"):
        _trainer(model="tests.consumer.training.user_models:conditioned")


def test_a_model_failing_under_mixed_precision_names_its_line_and_the_setting() -> None:
    with pytest.raises(ModelError) as info:
        _trainer(model="tests.consumer.training.failing_models:half_unsafe", precision="mixed_float16")
    said = str(info.value)
    assert "\n" not in said and "Exception encountered when calling" not in said
    assert "at failing_models.py:21 in call: h = h + tf.ones(tf.shape(h), dtype=tf.float32)" in said
    assert "try --set trainer.precision=float32" in said


def test_a_model_failing_under_xla_is_one_line_naming_the_setting() -> None:
    spec = "tests.consumer.training.failing_models:numpy_inside"
    trainer = _trainer(model=spec, jit_compile=True)  # builds: the eager call needs no XLA
    with pytest.raises(ModelError) as info:
        trainer.prepare([(4, *SHAPE)])
    said = str(info.value)
    assert "\n" not in said and said.startswith(f"--model {spec}: the training step failed on a batch of B=4")
    assert "try --set trainer.jit_compile=false" in said
    _trainer(model=spec, jit_compile=False).prepare([(4, *SHAPE)])  # the same model trains without XLA


def test_a_user_module_changing_global_settings_is_undone_with_a_warning(caplog) -> None:
    import keras
    import tensorflow as tf

    jit = tf.config.optimizer.get_jit()
    with caplog.at_level(logging.WARNING, logger="stoker.consumer.training.tts"):
        trainer = _trainer(model="tests.consumer.training.meddling_models:good")
    assert keras.mixed_precision.global_policy().name == "float32" == trainer.precision
    assert tf.config.optimizer.get_jit() == jit
    assert "importing the model set the global Keras dtype policy to mixed_float16" in caplog.text
    assert "changed TensorFlow's global XLA setting" in caplog.text
    assert all(v.dtype == "float32" for v in trainer.model.trainable_variables)


# ------------------------------------------------------------------ the model's own loss, optimizers

LOSS_MODELS = "tests.consumer.training.loss_models"


def test_a_models_own_loss_terms_are_added_and_reported() -> None:
    from tests.consumer.training.loss_models import LEVEL_WEIGHT

    trainer = _trainer(model=f"{LOSS_MODELS}:with_terms", learning_rate=0.0, warmup_steps=0)
    assert trainer.term_names == ["mel_l1", "fit", "level"]  # no length head: no length term
    batch = make_batch(4, *SHAPE, valid=3, seed=5)
    loss = trainer.resolve([trainer.step(trainer.stage(batch))])[0]
    terms = trainer.resolved_terms[0]
    mel = trainer.predict(batch)["mel"]
    mask = (np.arange(SHAPE[1])[None, :] < batch["mel_lengths"][:, None])[..., None]
    l1 = float((np.abs(mel - batch["mel"]) * mask).sum() / (mask.sum() * 80))
    assert terms["mel_l1"] == pytest.approx(l1, rel=1e-4)
    assert terms["fit"] == pytest.approx(l1, rel=1e-4)  # the model's own copy of it
    assert terms["level"] == pytest.approx(LEVEL_WEIGHT * float(mel.mean()), rel=1e-4, abs=1e-6)
    assert loss == pytest.approx(sum(terms.values()), rel=1e-5)
    assert set(trainer.predict(batch)) == {"mel", "stop_logits", "attention"}  # extra outputs kept, losses not


def test_loss_model_trains_on_the_models_terms_only() -> None:
    trainer = _trainer(model=f"{LOSS_MODELS}:with_terms", loss="model", learning_rate=1e-2)
    assert trainer.term_names == ["fit", "level"]
    staged = trainer.stage(make_batch(4, *SHAPE, seed=6))
    losses = trainer.resolve([trainer.step(staged) for _ in range(15)])
    for loss, terms in zip(losses, trainer.resolved_terms):
        assert loss == pytest.approx(terms["fit"] + terms["level"], rel=1e-5)
    assert losses[-1] < losses[0]
    val = trainer.evaluate([staged])
    assert set(trainer.evaluated_terms) == {"fit", "level"}
    assert val == pytest.approx(sum(trainer.evaluated_terms.values()), rel=1e-5)
    with pytest.raises(ModelError, match="returns no loss terms .* trainer.loss=model has nothing to train on"):
        _trainer(model=f"{LOSS_MODELS}:no_terms", loss="model")


def test_a_user_loss_function_replaces_nothing_and_adds_its_terms() -> None:
    trainer = _trainer(model=f"{LOSS_MODELS}:with_terms", loss=f"{LOSS_MODELS}:huber", learning_rate=1e-2)
    assert trainer.term_names == ["huber", "penalty", "fit", "level"]
    staged = trainer.stage(make_batch(4, *SHAPE, seed=7))
    losses = trainer.resolve([trainer.step(staged) for _ in range(10)])
    assert losses[-1] < losses[0] and all(t["penalty"] == 0.0 for t in trainer.resolved_terms)


@pytest.mark.parametrize("trainer_settings, message", [
    ({"loss": f"{LOSS_MODELS}:per_row_loss"}, r"term 'loss_fn' has shape \[4\], not a scalar"),
    ({"model": f"{LOSS_MODELS}:vector_term"}, r"its loss term 'per_row' has shape \[4\], not a scalar"),
    ({"optimizer": f"{LOSS_MODELS}:not_an_optimizer"}, "returned str, not a keras optimizer"),
    ({"optimizer": f"{LOSS_MODELS}:missing"}, "has no function missing"),
])
def test_loss_and_optimizer_contract_breaches_are_one_line(trainer_settings, message) -> None:
    settings = {"model": GOOD, **trainer_settings}
    with pytest.raises(ModelError, match=message) as info:
        _trainer(**settings)
    assert "\n" not in str(info.value)


def test_adamw_decays_a_weight_whose_gradient_is_zero_and_adam_does_not() -> None:
    """The embedding row of a token no batch uses gets no gradient: AdamW's decoupled decay
    shrinks it by lr x weight_decay per update, Adam leaves it as it was."""
    unused = TOKEN_IDS - 1
    kept = {}
    for name in ("adam", "adamw"):
        trainer = _trainer(model=GOOD, optimizer=name, weight_decay=0.1, learning_rate=1e-2, clip_norm=0.0)
        batch = make_batch(4, *SHAPE, seed=8)
        batch["tokens"] = np.minimum(batch["tokens"], unused - 1)
        row = trainer.model.embed.embeddings.numpy()[unused].copy()
        staged = trainer.stage(batch)
        trainer.resolve([trainer.step(staged) for _ in range(5)])
        kept[name] = (row, trainer.model.embed.embeddings.numpy()[unused])
    np.testing.assert_array_equal(kept["adam"][0], kept["adam"][1])
    np.testing.assert_allclose(kept["adamw"][1], kept["adamw"][0] * (1 - 1e-2 * 0.1) ** 5, rtol=1e-5)


def test_a_users_optimizer_is_used_and_checkpointed() -> None:
    trainer = _trainer(model=GOOD, optimizer=f"{LOSS_MODELS}:sgd", learning_rate=1e-2)
    assert type(trainer.optimizer).__name__ == "SGD" and trainer.optimizer.global_clipnorm == 1.0
    staged = trainer.stage(make_batch(4, *SHAPE, seed=9))
    losses = trainer.resolve([trainer.step(staged) for _ in range(10)])
    assert losses[-1] < losses[0]


def test_schedules_at_chosen_updates() -> None:
    # Noam: peaks at the end of the warm-up (update 99 is s = 100), then falls as 1/sqrt(s).
    assert lr_at(49, 1e-3, 100, None, "noam", 0.0) == pytest.approx(0.5e-3)
    assert lr_at(99, 1e-3, 100, None, "noam", 0.0) == pytest.approx(1e-3)
    assert lr_at(399, 1e-3, 100, None, "noam", 0.0) == pytest.approx(0.5e-3)
    # Cosine with restarts: warm-up 10, cycles of 100 updates from the peak down to 0.1 x peak.
    assert lr_at(9, 1.0, 10, None, "cosine_restarts", 0.1, restart=100) == pytest.approx(1.0)
    assert lr_at(59, 1.0, 10, None, "cosine_restarts", 0.1, restart=100) == pytest.approx(0.55)
    assert lr_at(108, 1.0, 10, None, "cosine_restarts", 0.1, restart=100) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.99)))
    assert lr_at(109, 1.0, 10, None, "cosine_restarts", 0.1, restart=100) == pytest.approx(1.0)  # restarted
    # The graph computes what the floats say.
    trainer = _trainer(model=GOOD, lr_decay="noam", warmup_steps=4, learning_rate=1e-3)
    staged = trainer.stage(make_batch(4, *SHAPE))
    rates = []
    for _ in range(8):
        rates.append(trainer.learning_rate())
        trainer.resolve([trainer.step(staged)])
    assert rates == pytest.approx([lr_at(s, 1e-3, 4, 100, "noam", 0.1) for s in range(8)], rel=1e-5)


def test_an_extra_output_model_trains() -> None:
    trainer = _trainer(model="tests.consumer.training.user_models:unknown_output", learning_rate=1e-2)
    staged = trainer.stage(make_batch(4, *SHAPE))
    losses = trainer.resolve([trainer.step(staged) for _ in range(10)])
    assert losses[-1] < losses[0] and trainer.term_names == ["mel_l1"]


@pytest.mark.parametrize("optimizer", ["adamw", f"{LOSS_MODELS}:sgd"])
def test_optimizer_state_survives_a_checkpoint(tmp_path, optimizer) -> None:
    """Saved after 3 steps and restored into a fresh trainer: the next steps are the same."""
    import tensorflow as tf

    settings = {"model": f"{LOSS_MODELS}:with_terms", "optimizer": optimizer, "learning_rate": 1e-2}
    first = _trainer(**settings)
    staged = first.stage(make_batch(4, *SHAPE, seed=10))
    first.resolve([first.step(staged) for _ in range(3)])
    tf.train.Checkpoint(**first.trackables()).write(str(tmp_path / "state"))
    expected = first.resolve([first.step(staged) for _ in range(2)])
    second = _trainer(**settings)
    tf.train.Checkpoint(**second.trackables()).read(str(tmp_path / "state")).assert_existing_objects_matched()
    assert second.updates == 3
    assert second.resolve([second.step(second.stage(make_batch(4, *SHAPE, seed=10))) for _ in range(2)]) == \
        pytest.approx(expected, rel=1e-6)
