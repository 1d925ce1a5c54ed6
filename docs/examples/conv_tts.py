"""A user's own text-to-mel model for stoker: the runnable example of docs/MODELS.md.

    PYTHONPATH=docs/examples python run.py --model conv_tts:build --steps 100

stoker calls ``build(vocab_size=..., n_mels=...)`` once, in the trainer process, after
TensorFlow is configured for the model GPU, and trains what it returns. The model gets
one dict per batch (shapes: B batch, L tokens, T frames, F mel channels):

    tokens         int32    [B, L]     character ids, padding 0
    token_lengths  int32    [B]        valid tokens per row (0: an empty row)
    mel            float32  [B, T, F]  the target log-mel (padding log(1e-5)); use only
                                       its shape unless you want teacher forcing: at
                                       synthesis it holds padding only
    mel_lengths    int32    [B]        valid frames per row (0: an empty row)

and returns the predicted mel [B, T, F], or a dict with "mel" and optionally
"log_frames" [B] (the predicted log of the number of frames, which `run.py synth` uses
to choose T) and "loss" (a scalar added to stoker's masked L1 mel loss).

This one is deliberately plain: a convolutional text encoder, and one attention from
frame queries (the frame's relative position in the clip) to the text.
"""

import keras
import tensorflow as tf
from keras import layers


class ConvAttentionTTS(keras.Model):
    def __init__(self, vocab_size: int, n_mels: int, dim: int = 96) -> None:
        super().__init__(name="conv_attention_tts")
        self.embed = layers.Embedding(vocab_size, dim)
        self.encoder = [layers.Conv1D(dim, 5, padding="same", activation="relu") for _ in range(3)]
        self.query = layers.Dense(dim)
        self.attention = layers.MultiHeadAttention(num_heads=2, key_dim=dim // 2)
        self.decoder = layers.Conv1D(dim, 5, padding="same", activation="relu")
        self.out = layers.Dense(n_mels, dtype="float32")
        self.length = layers.Dense(1, dtype="float32")

    def call(self, inputs, training=False):
        tokens, token_lengths = inputs["tokens"], inputs["token_lengths"]
        frames = tf.shape(inputs["mel"])[1]
        token_mask = tf.sequence_mask(token_lengths, tf.shape(tokens)[1])
        x = self.embed(tokens)
        for conv in self.encoder:
            x = x + conv(x)
        # Frame queries: where in the clip each frame is (0 at the start, 1 at the last valid frame).
        valid = tf.maximum(tf.cast(inputs["mel_lengths"], tf.float32), 1.0)
        progress = tf.cast(tf.range(frames), tf.float32)[None, :] / valid[:, None]  # [B, T]
        angles = progress[..., None] * tf.range(1.0, 17.0)[None, None, :] * 3.14159
        q = self.query(tf.concat([tf.sin(angles), tf.cos(angles)], axis=-1))
        mask = tf.logical_and(token_mask[:, None, :], tf.ones([1, frames, 1], tf.bool))  # [B, T, L]
        h = q + self.attention(q, x, attention_mask=mask)
        mel = self.out(h + self.decoder(h))
        pooled = tf.reduce_sum(x * tf.cast(token_mask, x.dtype)[..., None], axis=1)
        pooled /= tf.maximum(tf.cast(token_lengths, x.dtype), 1.0)[:, None]
        log_frames = tf.math.log(tf.maximum(tf.cast(token_lengths, tf.float32), 1.0)) + 1.8 + self.length(pooled)[:, 0]
        return {"mel": mel, "log_frames": log_frames}


def build(vocab_size: int, n_mels: int) -> keras.Model:
    return ConvAttentionTTS(vocab_size, n_mels)
