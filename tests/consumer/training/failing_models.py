"""Users' models that fail on purpose, each under one setting (``--model tests.consumer.training.failing_models:NAME``)."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import layers


class HalfUnsafe(keras.Model):
    """Adds a float32 tensor to its own activations: fine in float32, a dtype error in mixed_float16."""

    def __init__(self, vocab_size: int, n_mels: int) -> None:
        super().__init__()
        self.embed = layers.Embedding(vocab_size, 8)
        self.out = layers.Dense(n_mels)

    def call(self, inputs, training=False):
        h = self.out(self.embed(inputs["tokens"]))
        h = h + tf.ones(tf.shape(h), dtype=tf.float32)  # the user's bug under mixed precision
        frames = tf.shape(inputs["mel"])[1]
        return tf.tile(tf.reduce_mean(h, axis=1, keepdims=True), [1, frames, 1])


class NumpyInside(keras.Model):
    """Calls numpy through tf.numpy_function: runs eagerly and in a graph, cannot be compiled by XLA."""

    def __init__(self, vocab_size: int, n_mels: int) -> None:
        super().__init__()
        self.embed = layers.Embedding(vocab_size, 8)
        self.out = layers.Dense(n_mels, dtype="float32")

    def call(self, inputs, training=False):
        h = tf.reduce_mean(self.embed(inputs["tokens"]), axis=1, keepdims=True)
        h = tf.numpy_function(lambda x: np.tanh(x), [h], tf.float32)
        h.set_shape([None, 1, 8])
        frames = tf.shape(inputs["mel"])[1]
        return tf.tile(self.out(h), [1, frames, 1])


def half_unsafe(vocab_size: int, n_mels: int) -> keras.Model:
    return HalfUnsafe(vocab_size, n_mels)


def numpy_inside(vocab_size: int, n_mels: int) -> keras.Model:
    return NumpyInside(vocab_size, n_mels)
