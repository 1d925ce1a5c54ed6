"""Users' models with their own loss terms, loss functions and optimizers, for the trainer tests
(``--model tests.consumer.training.loss_models:NAME``, ``trainer.loss`` / ``trainer.optimizer`` = ``...:NAME``)."""

from __future__ import annotations

import keras
import tensorflow as tf

from tests.consumer.training.user_models import FramesModel

# The weight of the model's "level" term: its value is the mean of the prediction, times this.
LEVEL_WEIGHT = 0.5


class WithTerms(FramesModel):
    """Returns the mel, a stop-like extra output, and two named loss terms of its own:
    "fit" (the masked L1 it computes itself) and "level" (LEVEL_WEIGHT x the mean prediction)."""

    def call(self, inputs, training=False):
        mel = super().call(inputs, training)
        mask = tf.sequence_mask(inputs["mel_lengths"], tf.shape(mel)[1], dtype=tf.float32)[..., None]
        frames = tf.maximum(tf.reduce_sum(mask) * tf.cast(tf.shape(mel)[2], tf.float32), 1.0)
        fit = tf.reduce_sum(tf.abs(mel - inputs["mel"]) * mask) / frames
        return {"mel": mel, "stop_logits": mel[..., 0], "attention": tf.zeros([tf.shape(mel)[0], 3, 3]),
                "losses": {"fit": fit, "level": LEVEL_WEIGHT * tf.reduce_mean(mel)}}


class NoTerms(FramesModel):
    pass


class VectorTerm(FramesModel):
    def call(self, inputs, training=False):
        mel = super().call(inputs, training)
        return {"mel": mel, "losses": {"per_row": tf.reduce_mean(mel, axis=[1, 2])}}


def with_terms(vocab_size: int, n_mels: int) -> keras.Model:
    return WithTerms(vocab_size, n_mels)


def no_terms(vocab_size: int, n_mels: int) -> keras.Model:
    return NoTerms(vocab_size, n_mels)


def vector_term(vocab_size: int, n_mels: int) -> keras.Model:
    return VectorTerm(vocab_size, n_mels)


def huber(batch, outputs):
    """A user loss function: the masked Huber loss of the mel, and a small named penalty."""
    mel = outputs["mel"]
    mask = tf.sequence_mask(batch["mel_lengths"], tf.shape(mel)[1], dtype=tf.float32)[..., None]
    err = tf.abs(mel - batch["mel"])
    quad = tf.minimum(err, 1.0)
    per = 0.5 * quad ** 2 + (err - quad)
    frames = tf.maximum(tf.reduce_sum(mask) * tf.cast(tf.shape(mel)[2], tf.float32), 1.0)
    return {"huber": tf.reduce_sum(per * mask) / frames, "penalty": 0.0 * tf.reduce_mean(mel)}


def per_row_loss(batch, outputs):
    return tf.reduce_mean(outputs["mel"], axis=[1, 2])  # not a scalar: refused


def sgd(learning_rate):
    return keras.optimizers.SGD(learning_rate=learning_rate, momentum=0.9)


def not_an_optimizer(learning_rate):
    return "adam"


# The reference frames the end-to-end test runs with (batching.ref_frames), checked by FieldsChecker.
CHECKED_REF_FRAMES = 64


class FieldsChecker(WithTerms):
    """Asserts, inside the traced step, the documented shapes of every optional field: audio
    [B, T x hop] with a length per real row, ref_mel [B, R, F] with a reference for every
    real row, speaker_id [B], stop [B, T]; and conditions its mel on the reference's mean."""

    def call(self, inputs, training=False):
        mel, frames = inputs["mel"], tf.shape(inputs["mel"])[1]
        real = inputs["mel_lengths"] > 0
        checks = [
            tf.debugging.assert_equal(tf.shape(inputs["audio"])[1], frames * 256, message="audio is [B, T x hop]"),
            tf.debugging.assert_equal(tf.shape(inputs["ref_mel"])[1], CHECKED_REF_FRAMES,
                                      message="ref_mel is [B, R, F]"),
            tf.debugging.assert_equal(tf.shape(inputs["stop"]), tf.shape(mel)[:2], message="stop is [B, T]"),
            tf.debugging.assert_equal(real, inputs["audio_lengths"] > 0, message="audio for every real row"),
            tf.debugging.assert_equal(real, inputs["ref_mel_lengths"] > 0, message="a reference for every real row"),
            tf.debugging.assert_less_equal(inputs["audio_lengths"], inputs["mel_lengths"] * 256,
                                           message="audio fits its mel"),
        ]
        with tf.control_dependencies(checks):
            out = super().call(inputs, training)
        reference = tf.reduce_mean(inputs["ref_mel"], axis=[1, 2])[:, None, None]
        out["mel"] = out["mel"] + 0.0 * reference
        return out


def fields_checker(vocab_size: int, n_mels: int) -> keras.Model:
    return FieldsChecker(vocab_size, n_mels)
