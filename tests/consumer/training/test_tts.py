"""The model definitions and the loss (consumer/training/tts.py), checked against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from stoker.consumer.training import tts
from stoker.consumer.training.tts import ModelError
from tests.factories import make_batch

pytestmark = pytest.mark.slow  # TensorFlow or processes: not a unit test


def test_check_spec_names_presets_synthetic_and_user_models() -> None:
    assert tts.check_spec("tiny") == tts.check_spec("small") == tts.check_spec("base") == "preset"
    assert tts.check_spec("synthetic:5") == "synthetic"
    assert tts.check_spec("my_pkg.models:build") == "user"
    for bad in ("huge", "pkg.mod", "pkg.mod:", ":fn", "pkg..mod:fn", "pkg.mod:not-an-identifier"):
        with pytest.raises(ModelError, match="package.module:function"):
            tts.check_spec(bad)


def test_presets_parameter_counts() -> None:
    counts = {name: tts.count_params(_built(name)) for name in ("tiny", "small", "base")}
    assert counts["tiny"] < 2_000_000 < counts["small"] < 20_000_000
    assert 10_000_000 <= counts["base"] < 100_000_000  # "base in the tens of millions"


def _built(preset: str):
    model = tts.build(preset, 38, 80)
    out = model(tts.dummy_inputs(2, 8, 16, 80, -11.5, 38), training=False)
    assert tuple(out["mel"].shape) == (2, 16, 80) and tuple(out["log_frames"].shape) == (2,)
    return model


def test_objective_matches_numpy_masked_losses() -> None:
    import tensorflow as tf

    batch = make_batch(batch_size=4, valid=3, seed=1)
    rng = np.random.default_rng(2)
    pred = rng.standard_normal(batch["mel"].shape).astype(np.float32)
    log_frames = rng.standard_normal(4).astype(np.float32) + 3
    out = {"mel": tf.constant(pred), "log_frames": tf.constant(log_frames), "loss": tf.constant(0.25)}
    numerator, valid, terms = tts.objective(tf, out, {k: tf.constant(v) for k, v in batch.items()},
                                            l2_weight=0.5, length_weight=0.1)
    lengths = batch["mel_lengths"]
    mask = (np.arange(batch["mel"].shape[1])[None, :] < lengths[:, None])[..., None]
    err = (pred - batch["mel"]) * mask
    v = lengths.sum()
    l1 = np.abs(err).sum() / (v * 80)
    l2 = np.square(err).sum() / (v * 80)
    length = (lengths * (log_frames - np.log(np.maximum(lengths, 1))) ** 2).sum() / v
    expected = l1 + 0.5 * l2 + 0.1 * length + 0.25
    assert float(valid) == v
    assert float(numerator) / float(valid) == pytest.approx(expected, rel=1e-5)
    assert set(terms) == {"mel_l1", "mel_l2", "length", "extra"}


def test_empty_rows_do_not_count() -> None:
    """The loss of a batch of only its real rows (the default) equals that of the same rows
    with empty ones after them (fixed rows, row_mask 0 there): every term is masked by lengths."""
    import tensorflow as tf

    full = make_batch(batch_size=2, valid=2, seed=3)
    padded = {k: np.concatenate([v, np.zeros_like(v)], axis=0) for k, v in full.items()}
    padded["mel"][2:] = 123.0  # whatever an empty row holds, it is masked out
    padded["row_mask"] = np.array([1, 1, 0, 0], np.float32)
    pred = np.zeros_like(padded["mel"])
    log_frames = np.array([2.0, 3.0, 9.0, 9.0], np.float32)
    a = tts.objective(tf, {"mel": tf.constant(pred[:2]), "log_frames": tf.constant(log_frames[:2])},
                      {k: tf.constant(v) for k, v in full.items()}, 0.5, 0.1)
    b = tts.objective(tf, {"mel": tf.constant(pred), "log_frames": tf.constant(log_frames)},
                      {k: tf.constant(v) for k, v in padded.items()}, 0.5, 0.1)
    assert float(a[0]) == pytest.approx(float(b[0])) and float(a[1]) == float(b[1])


def test_outputs_contract_errors_name_the_contract() -> None:
    with pytest.raises(ModelError, match="without 'mel'.*contract|without 'mel'.*docs/MODELS.md"):
        tts.outputs_of({"pred": 1})
    assert tts.outputs_of({"mel": 1, "alignment": 2}) == {"mel": 1, "alignment": 2}  # extra outputs pass
    with pytest.raises(ModelError, match="'losses' output is a list, not a dict of named scalars"):
        tts.outputs_of({"mel": 1, "losses": [1, 2]})
    with pytest.raises(ModelError, match=r"output 'mel' has shape \[2, 17, 80\].*expected \[2, 16, 80\]"):
        tts.check_outputs("x:y", np.zeros((2, 17, 80)), 2, 16, 80)


@pytest.mark.parametrize("name, message", [
    ("not_a_model", "returned object, not a keras.Model"),
    ("raises", "building the model failed: RuntimeError: no weights file"),
    ("missing", "has no function missing"),
])
def test_user_builders_refused_with_one_line(name: str, message: str) -> None:
    with pytest.raises(ModelError, match=message) as info:
        tts.build(f"tests.consumer.training.user_models:{name}", 38, 80)
    assert "\n" not in str(info.value)


def test_user_module_that_cannot_be_imported() -> None:
    with pytest.raises(ModelError, match="cannot import no_such_module_xyz.*PYTHONPATH"):
        tts.build("no_such_module_xyz:build", 38, 80)
