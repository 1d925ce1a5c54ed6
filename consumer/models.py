"""Trainers the consumer can run: ``synthetic:MS`` and ``tiny``.

A trainer has two methods the consumer calls:
    stage(arrays) -> staged   host numpy arrays -> what step() takes (device tensors);
                              runs in the stager thread while the previous step trains
    step(staged) -> loss      one optimisation step; the loss as a float (None: no loss)

``synthetic:MS`` holds each step for MS milliseconds without using the CPU (it sleeps
until a deadline, standing in for a GPU kernel), so a run measures the input pipeline
alone. It does not import TensorFlow.

``tiny`` is a small non-autoregressive text-to-mel model trained with a masked L1 mel
loss under ``tf.function``: a character embedding and convolutional text encoder with
positional encodings; one query per output frame, encoding the frame's expected
position in the text (frame / mel_length x token_length); multi-head attention from
frames to text (padding masked); a convolutional decoder to F mel channels. Its one
traced signature has None for L and T, so buckets never retrace.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import numpy as np

from shared.config import Config

log = logging.getLogger(__name__)


class ModelError(Exception):
    """The --model value cannot be used."""


class Trainer(Protocol):
    name: str
    uses_tensorflow: bool

    def stage(self, arrays: dict[str, np.ndarray]) -> Any: ...

    def step(self, staged: Any) -> float | None: ...


class SyntheticTrainer:
    """Holds every step for a fixed time without CPU use."""

    uses_tensorflow = False

    def __init__(self, step_ms: float) -> None:
        self.step_ms = step_ms
        self.name = f"synthetic:{step_ms:g}"

    def stage(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return arrays

    def step(self, staged: dict[str, np.ndarray]) -> None:
        # Sleeping is the point here: it is the stand-in for device time, not a synchronisation.
        time.sleep(self.step_ms / 1000.0)
        return None


def _positional(tf: Any, positions: Any, dim: int) -> Any:
    """Sinusoidal encoding of (possibly fractional) positions [..., 1] -> [..., dim]."""
    half = dim // 2
    freqs = tf.exp(-np.log(10000.0) * tf.range(half, dtype=tf.float32) / half)
    angles = positions * freqs
    return tf.concat([tf.sin(angles), tf.cos(angles)], axis=-1)


def build_tiny_model(vocab_size: int, n_mels: int, dim: int = 128, heads: int = 2) -> Any:
    """The ``tiny`` Keras model: (tokens, token_lengths, mel_lengths, T) -> mel [B, T, F]."""
    import keras
    import tensorflow as tf
    from keras import layers

    class TinyTTS(keras.Model):
        def __init__(self) -> None:
            super().__init__(name="tiny_tts")
            self.dim = dim
            self.embed = layers.Embedding(vocab_size, dim)
            self.encoder = [layers.Conv1D(dim, 5, padding="same", activation="relu") for _ in range(2)]
            self.enc_norm = layers.LayerNormalization()
            self.query = layers.Dense(dim)
            self.attention = layers.MultiHeadAttention(num_heads=heads, key_dim=dim // heads)
            self.decoder = [layers.Conv1D(dim, 5, padding="same", activation="relu") for _ in range(2)]
            self.out = layers.Dense(n_mels)

        def call(self, tokens: Any, token_lengths: Any, mel_lengths: Any, frames: Any) -> Any:
            text_len = tf.shape(tokens)[1]
            token_mask = tf.sequence_mask(token_lengths, text_len)  # [B, L]
            pos = tf.cast(tf.range(text_len), tf.float32)[None, :, None]
            x = self.embed(tokens) + _positional(tf, pos, self.dim)
            for conv in self.encoder:
                x = x + conv(x) * tf.cast(token_mask, x.dtype)[..., None]
            x = self.enc_norm(x)
            t = tf.cast(tf.range(frames), tf.float32)[None, :, None]  # [1, T, 1]
            ratio = (tf.cast(token_lengths, tf.float32) / tf.maximum(tf.cast(mel_lengths, tf.float32), 1.0))
            expected = t * ratio[:, None, None]  # [B, T, 1]: where in the text frame t should be
            q = self.query(_positional(tf, expected, self.dim))
            mask = tf.logical_and(token_mask[:, None, :], tf.ones([1, frames, 1], tf.bool))  # [B, T, L]
            h = q + self.attention(q, x, attention_mask=mask)
            for conv in self.decoder:
                h = h + conv(h)
            return self.out(h)

    return TinyTTS()


class TinyTrainer:
    """The ``tiny`` text-to-mel model with a masked L1 loss."""

    uses_tensorflow = True

    def __init__(self, cfg: Config, device: str) -> None:
        import keras
        import tensorflow as tf

        from shared.text import VOCAB_SIZE

        self.tf = tf
        self.name = "tiny"
        self.device = device
        tf.random.set_seed(cfg.trainer.seed)
        keras.utils.set_random_seed(cfg.trainer.seed)
        with tf.device(device):
            self.model = build_tiny_model(VOCAB_SIZE, cfg.features.n_mels)
            self.optimizer = keras.optimizers.Adam(learning_rate=cfg.trainer.learning_rate)
        spec = [tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None], tf.int32),
                tf.TensorSpec([None, None, None], tf.float32), tf.TensorSpec([None], tf.int32)]
        self._train_step = tf.function(self._step_fn, input_signature=spec)

    def _step_fn(self, tokens: Any, token_lengths: Any, mel: Any, mel_lengths: Any) -> Any:
        tf = self.tf
        frames = tf.shape(mel)[1]
        with tf.GradientTape() as tape:
            pred = self.model(tokens, token_lengths, mel_lengths, frames, training=True)
            mask = tf.cast(tf.sequence_mask(mel_lengths, frames), tf.float32)[..., None]  # [B, T, 1]
            denom = tf.maximum(tf.reduce_sum(mask) * tf.cast(tf.shape(mel)[2], tf.float32), 1.0)
            loss = tf.reduce_sum(tf.abs(pred - mel) * mask) / denom
        grads = tape.gradient(loss, self.model.trainable_variables)
        grads, _ = tf.clip_by_global_norm(grads, 1.0)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return loss

    def stage(self, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        tf = self.tf
        with tf.device(self.device):
            # identity() forces a copy onto the device now, in the stager thread.
            return {k: tf.identity(tf.convert_to_tensor(v)) for k, v in arrays.items()}

    def step(self, staged: dict[str, Any]) -> float:
        with self.tf.device(self.device):
            loss = self._train_step(staged["tokens"], staged["token_lengths"], staged["mel"], staged["mel_lengths"])
        return float(loss)


def check_model(spec: str) -> float | None:
    """Validate --model without importing TensorFlow; return MS for synthetic:MS, else None."""
    if spec.startswith("synthetic:"):
        try:
            ms = float(spec.split(":", 1)[1])
        except ValueError:
            ms = -1.0
        if not ms >= 0:
            raise ModelError(f"--model {spec}: expected synthetic:MS with MS >= 0 milliseconds")
        return ms
    if spec != "tiny":
        raise ModelError(f"--model {spec}: not available in this version (use tiny or synthetic:MS)")
    return None


def uses_tensorflow(spec: str) -> bool:
    return check_model(spec) is None


def make_trainer(cfg: Config, device: str) -> Trainer:
    ms = check_model(cfg.trainer.model)
    if ms is not None:
        return SyntheticTrainer(ms)
    return TinyTrainer(cfg, device)
