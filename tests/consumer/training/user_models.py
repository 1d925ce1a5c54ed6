"""Users' models for the contract tests (``--model tests.consumer.training.user_models:NAME``).

Each builder has the documented signature ``function(vocab_size=..., n_mels=...)``.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import layers


class FramesModel(keras.Model):
    """Embeds the mean token of each row and broadcasts it over the frames: small, learns a level."""

    def __init__(self, vocab_size: int, n_mels: int, out_frames_delta: int = 0, poison: bool = False) -> None:
        super().__init__()
        self.embed = layers.Embedding(vocab_size, 16)
        self.out = layers.Dense(n_mels, dtype="float32")
        self.delta = out_frames_delta
        self.poison = poison

    def call(self, inputs, training=False):
        frames = tf.shape(inputs["mel"])[1] + self.delta
        pooled = tf.reduce_mean(self.embed(inputs["tokens"]), axis=1)  # [B, 16]
        mel = self.out(tf.tile(pooled[:, None, :], [1, frames, 1]))
        if self.poison:
            mel = mel * float("nan")
        return mel


def good(vocab_size: int, n_mels: int) -> keras.Model:
    return FramesModel(vocab_size, n_mels)


def nan_loss(vocab_size: int, n_mels: int) -> keras.Model:
    """Every loss is NaN."""
    return FramesModel(vocab_size, n_mels, poison=True)


def wrong_shape(vocab_size: int, n_mels: int) -> keras.Model:
    """Returns one frame too many."""
    return FramesModel(vocab_size, n_mels, out_frames_delta=1)


def not_a_model(vocab_size: int, n_mels: int) -> object:
    return object()


def raises(vocab_size: int, n_mels: int) -> keras.Model:
    raise RuntimeError("no weights file at /nonexistent")


class UnknownOutput(FramesModel):
    def call(self, inputs, training=False):
        return {"mel": super().call(inputs, training), "alignment": inputs["tokens"]}


def unknown_output(vocab_size: int, n_mels: int) -> keras.Model:
    return UnknownOutput(vocab_size, n_mels)


# What a model that conditions on speaker and language is told about a run: a few ids suffice here.
MAX_SPEAKERS = 8
MAX_LANGUAGES = 4


class Conditioned(FramesModel):
    """Adds speaker and language embeddings, and checks the stop target's documented form:
    0 before each row's last valid frame, 1 from it on (padding included)."""

    def __init__(self, vocab_size: int, n_mels: int) -> None:
        super().__init__(vocab_size, n_mels)
        self.speaker = layers.Embedding(MAX_SPEAKERS, n_mels)
        self.language = layers.Embedding(MAX_LANGUAGES, n_mels)

    def call(self, inputs, training=False):
        frames = tf.shape(inputs["mel"])[1]
        expected = tf.cast(tf.range(frames)[None, :] >= inputs["mel_lengths"][:, None] - 1, tf.float32)
        tf.debugging.assert_equal(inputs["stop"], expected, message="stop target")
        mel = super().call(inputs, training)
        bias = self.speaker(inputs["speaker_id"]) + self.language(inputs["language_id"])  # [B, F]
        return mel + bias[:, None, :]


def conditioned(vocab_size: int, n_mels: int) -> keras.Model:
    return Conditioned(vocab_size, n_mels)


class Generating(FramesModel):
    """Has its own generation loop (docs/MODELS.md): row b gets min(3 + 2 x tokens, max_frames)
    frames, frame t being the one-pass prediction's level + t + the speaker id, so a test
    reads from the mel how long it is, where it starts and whom it was for."""

    def __init__(self, vocab_size: int, n_mels: int, broken: bool = False) -> None:
        super().__init__(vocab_size, n_mels)
        self.broken = broken

    def generate(self, inputs, max_frames):
        if "mel" in inputs or "mel_lengths" in inputs:
            raise ValueError("generate() was given the target")
        lengths = tf.minimum(3 + 2 * inputs["token_lengths"], max_frames)
        level = self.out(tf.reduce_mean(self.embed(inputs["tokens"]), axis=1))  # [B, F]
        speaker = tf.cast(inputs["speaker_id"], tf.float32)[:, None, None]
        mel = level[:, None, :] + tf.range(max_frames, dtype=tf.float32)[None, :, None] + speaker
        return {"mel": mel} if self.broken else {"mel": mel, "mel_lengths": lengths}


def generating(vocab_size: int, n_mels: int) -> keras.Model:
    return Generating(vocab_size, n_mels)


def generating_without_lengths(vocab_size: int, n_mels: int) -> keras.Model:
    return Generating(vocab_size, n_mels, broken=True)


class Lengthed(FramesModel):
    """Predicts the same log(frames) for every row: one trained weight (zero when built)."""

    def __init__(self, vocab_size: int, n_mels: int) -> None:
        super().__init__(vocab_size, n_mels)
        self.log_frames = self.add_weight(shape=(), initializer="zeros", name="log_frames")

    def call(self, inputs, training=False):
        rows = tf.shape(inputs["tokens"])[:1]
        return {"mel": super().call(inputs, training), "log_frames": tf.fill(rows, self.log_frames)}


def lengthed(vocab_size: int, n_mels: int) -> keras.Model:
    return Lengthed(vocab_size, n_mels)
