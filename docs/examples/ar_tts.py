"""An autoregressive text-to-mel model for stoker, with its own generation loop: the
second runnable example of docs/MODELS.md.

    PYTHONPATH=docs/examples python run.py --model ar_tts:build --steps 300 \\
        --set batching.fields=stop --set trainer.loss=model
    python run.py synth RUN_DIR --text "Hello there."

stoker calls ``build(vocab_size=..., n_mels=...)`` once, in the trainer process. The model
gets one dict per batch (shapes: B batch, L tokens, T frames, F mel channels): ``tokens``
[B, L], ``token_lengths`` [B], ``mel`` [B, T, F], ``mel_lengths`` [B], and whichever of the
optional fields the run switches on with ``batching.fields``: ``speaker_id`` [B],
``language_id`` [B], ``stop`` [B, T], ``ref_mel`` [B, R, F] with ``ref_mel_lengths`` [B]
(another clip of the same speaker). It trains with any subset of them.

The design, a small transformer TTS:

- text encoder: token embedding with sinusoidal positions, convolutions; plus the
  speaker and language embeddings and a reference encoding (a masked mean of the
  reference clip's frames, projected) when the batch has them;
- decoder: a prenet on the previous frame (teacher forcing: the real frame t-1 during
  training and validation, a zero "go" frame at t=0), frame positions, then causal
  transformer blocks (self-attention over the frames so far, attention to the text), then
  a linear mel frame and a stop logit;
- a convolutional postnet that refines the whole mel (a residual).

``call`` teacher-forces all frames in one parallel pass and returns "mel" (after the
postnet), "stop_logits" [B, T] and "losses": ``mel_l1`` (before the postnet), ``postnet_l1``
(after it) and ``stop`` (a binary cross-entropy, the rare 1 weighted up), each a mean over
the valid frames. Train it with ``trainer.loss: model`` (the sum of these terms).

``generate(inputs, max_frames)`` is what ``run.py synth`` calls: it feeds its own frames
back one at a time, and a row ends at the first frame whose stop probability is above 0.5
(that frame is its last) or at ``max_frames``.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import layers

# Speaker and language ids are embedded modulo these table sizes (build() is given only the
# vocabulary size and the mel channels): raise them for a dataset with more.
SPEAKER_TABLE = 256
LANGUAGE_TABLE = 64
# The stop target is 1 on one frame of each clip and 0 on the hundreds before it: its
# positive term is weighted up so that the stop logit learns to rise at all.
STOP_POS_WEIGHT = 8.0
# A frame is the last when its stop probability passes this.
STOP_THRESHOLD = 0.5
# The output layers start at a typical log-mel level (log of a quiet energy) so that the
# first steps fit the shape of the mel, not its offset.
MEL_INIT_BIAS = -6.0
# The prenet sees the log-mel scaled into about [-3, 1].
MEL_INPUT_SCALE = 0.25
# Sinusoidal positions: the transformer's wavelength scale.
POSITION_SCALE = 10000.0


def positions(length: Any, dim: int) -> Any:
    """Sinusoidal encodings of positions 0..length-1: [1, length, dim] float32."""
    half = dim // 2
    freqs = tf.exp(-math.log(POSITION_SCALE) * tf.range(half, dtype=tf.float32) / half)
    angles = tf.cast(tf.range(length), tf.float32)[:, None] * freqs[None, :]
    return tf.concat([tf.sin(angles), tf.cos(angles)], axis=-1)[None]


class DecoderBlock(layers.Layer):
    """Pre-norm causal self-attention, attention to the text, pointwise feed-forward.

    Every part is causal along the frames (attention masked, the feed-forward per frame),
    so frame t depends only on frames <= t: teacher forcing runs all frames at once and
    generation can run the same blocks on the frames so far.
    """

    def __init__(self, dim: int, heads: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.norm_self = layers.LayerNormalization()
        self.self_attention = layers.MultiHeadAttention(num_heads=heads, key_dim=dim // heads)
        self.norm_cross = layers.LayerNormalization()
        self.cross_attention = layers.MultiHeadAttention(num_heads=heads, key_dim=dim // heads)
        self.norm_ffn = layers.LayerNormalization()
        self.ffn_inner = layers.Dense(2 * dim, activation="relu")
        self.ffn_outer = layers.Dense(dim)

    def call(self, h: Any, memory: Any, memory_mask: Any) -> Any:
        q = self.norm_self(h)
        h = h + self.self_attention(q, q, use_causal_mask=True)
        frames = tf.shape(h)[1]
        cross_mask = tf.logical_and(memory_mask[:, None, :], tf.ones([1, frames, 1], tf.bool))  # [B, T, L]
        h = h + self.cross_attention(self.norm_cross(h), memory, attention_mask=cross_mask)
        return h + self.ffn_outer(self.ffn_inner(self.norm_ffn(h)))


class AutoregressiveTTS(keras.Model):
    def __init__(self, vocab_size: int, n_mels: int, dim: int = 96, heads: int = 2, encoder_layers: int = 3,
                 decoder_layers: int = 2, prenet_dropout: float = 0.2) -> None:
        super().__init__(name="autoregressive_tts")
        self.n_mels = n_mels
        self.dim = dim
        self.embed = layers.Embedding(vocab_size, dim)
        self.encoder = [layers.Conv1D(dim, 5, padding="same", activation="relu") for _ in range(encoder_layers)]
        self.encoder_norm = layers.LayerNormalization()
        self.speaker = layers.Embedding(SPEAKER_TABLE, dim)
        self.language = layers.Embedding(LANGUAGE_TABLE, dim)
        self.reference_frames = layers.Dense(dim, activation="relu")
        self.reference_out = layers.Dense(dim)
        self.prenet = [layers.Dense(dim, activation="relu"), layers.Dense(dim, activation="relu")]
        self.prenet_dropout = layers.Dropout(prenet_dropout)
        self.blocks = [DecoderBlock(dim, heads) for _ in range(decoder_layers)]
        self.decoder_norm = layers.LayerNormalization()
        self.frame_out = layers.Dense(n_mels, dtype="float32",
                                      bias_initializer=keras.initializers.Constant(MEL_INIT_BIAS))
        self.stop = layers.Dense(1, dtype="float32")
        self.postnet = [layers.Conv1D(dim, 5, padding="same", activation="tanh"),
                        layers.Conv1D(n_mels, 5, padding="same", dtype="float32", kernel_initializer="zeros")]

    # -- the parts -------------------------------------------------------------------------

    def encode(self, inputs: dict[str, Any], training: bool = False) -> tuple[Any, Any]:
        """(memory [B, L, D], token mask [B, L] bool): the text and its conditioning."""
        tokens = inputs["tokens"]
        mask = tf.sequence_mask(inputs["token_lengths"], tf.shape(tokens)[1])
        x = self.embed(tokens)
        x = x * math.sqrt(self.dim) + tf.cast(positions(tf.shape(tokens)[1], self.dim), x.dtype)
        fmask = tf.cast(mask, x.dtype)[..., None]
        for conv in self.encoder:
            x = (x + conv(x)) * fmask
        condition = tf.zeros_like(x[:, :1])  # [B, 1, D]
        if "speaker_id" in inputs:
            condition += self.speaker(tf.math.floormod(inputs["speaker_id"], SPEAKER_TABLE))[:, None]
        if "language_id" in inputs:
            condition += self.language(tf.math.floormod(inputs["language_id"], LANGUAGE_TABLE))[:, None]
        if "ref_mel" in inputs:
            condition += self.reference(inputs["ref_mel"], inputs["ref_mel_lengths"])[:, None]
        return self.encoder_norm(x + condition) * fmask, mask

    def reference(self, ref_mel: Any, ref_lengths: Any) -> Any:
        """[B, D]: the masked mean of the reference frames, projected; zero for a row without one."""
        h = self.reference_frames(tf.cast(ref_mel, self.compute_dtype) * MEL_INPUT_SCALE)
        mask = tf.cast(tf.sequence_mask(ref_lengths, tf.shape(ref_mel)[1]), h.dtype)[..., None]
        count = tf.maximum(tf.reduce_sum(mask, axis=1), 1.0)
        present = tf.cast(ref_lengths > 0, h.dtype)[:, None]
        return self.reference_out(tf.reduce_sum(h * mask, axis=1) / count) * present

    def decode(self, previous: Any, memory: Any, memory_mask: Any, training: bool = False) -> tuple[Any, Any]:
        """Frames [B, T, F] and stop logits [B, T] from the frames before each ([B, T, F], go first)."""
        h = tf.cast(previous, self.compute_dtype) * MEL_INPUT_SCALE
        for dense in self.prenet:
            h = self.prenet_dropout(dense(h), training=training)
        h = h + tf.cast(positions(tf.shape(previous)[1], self.dim), h.dtype)
        for block in self.blocks:
            h = block(h, memory, memory_mask)
        h = self.decoder_norm(h)
        return self.frame_out(h), self.stop(h)[..., 0]

    def refine(self, frames: Any) -> Any:
        """The postnet: the mel after a residual correction over the whole sequence."""
        h = frames
        for conv in self.postnet:
            h = conv(h)
        return frames + tf.cast(h, tf.float32)

    # -- training ----------------------------------------------------------------------------

    def call(self, inputs: dict[str, Any], training: bool = False) -> dict[str, Any]:
        mel = tf.cast(inputs["mel"], tf.float32)
        mel_lengths = inputs["mel_lengths"]
        frames = tf.shape(mel)[1]
        memory, memory_mask = self.encode(inputs, training=training)
        previous = tf.concat([tf.zeros_like(mel[:, :1]), mel[:, :-1]], axis=1)  # teacher forcing
        coarse, stop_logits = self.decode(previous, memory, memory_mask, training=training)
        refined = self.refine(coarse)

        valid = tf.sequence_mask(mel_lengths, frames)
        mask = tf.cast(valid, tf.float32)  # [B, T]
        count = tf.maximum(tf.reduce_sum(mask), 1.0)
        n_mels = tf.cast(tf.shape(mel)[2], tf.float32)

        def masked_l1(pred: Any) -> Any:
            return tf.reduce_sum(tf.abs(pred - mel) * mask[..., None]) / (count * n_mels)

        if "stop" in inputs:
            stop_target = tf.cast(inputs["stop"], tf.float32)
        else:  # the same target, from the lengths: 1 from each row's last valid frame on
            stop_target = tf.cast(tf.range(frames)[None, :] >= mel_lengths[:, None] - 1, tf.float32)
        stop_bce = tf.nn.weighted_cross_entropy_with_logits(stop_target, stop_logits, STOP_POS_WEIGHT)
        losses = {"mel_l1": masked_l1(coarse), "postnet_l1": masked_l1(refined),
                  "stop": tf.reduce_sum(stop_bce * mask) / count}
        return {"mel": refined, "stop_logits": stop_logits, "losses": losses}

    # -- synthesis ---------------------------------------------------------------------------

    def generate(self, inputs: dict[str, Any], max_frames: int) -> dict[str, Any]:
        """{"mel": [B, T', F], "mel_lengths": [B]}: frames fed back one at a time.

        ``inputs`` holds ``tokens``, ``token_lengths`` and any conditioning fields (no mel).
        A row ends at its first frame whose stop probability passes STOP_THRESHOLD (that
        frame included) or at ``max_frames``; an empty row (no tokens) has length 0. The
        frames of a row past its length are what the loop went on making for the others:
        read only the first ``mel_lengths``.

        Each step runs the decoder on all the frames so far (no key/value cache): plain and
        exactly the computation of teacher forcing, at a cost that grows with T^2.
        """
        memory, memory_mask = self.encode(inputs, training=False)
        batch = int(memory.shape[0])
        lengths = np.zeros(batch, np.int32)
        done = np.asarray(inputs["token_lengths"]) <= 0
        previous = tf.zeros([batch, 1, self.n_mels], tf.float32)  # the go frame
        made = []
        for t in range(max_frames):
            if done.all():
                break
            coarse, stop_logits = self._step(previous, memory, memory_mask)
            frame = coarse[:, -1:]
            made.append(frame)
            stopping = (tf.sigmoid(stop_logits[:, -1]).numpy() > STOP_THRESHOLD) & ~done
            lengths[stopping] = t + 1
            done |= stopping
            previous = tf.concat([previous, frame], axis=1)
        lengths[~done] = len(made)
        if not made:
            return {"mel": tf.zeros([batch, 0, self.n_mels]), "mel_lengths": tf.constant(lengths)}
        return {"mel": self.refine(tf.concat(made, axis=1)), "mel_lengths": tf.constant(lengths)}

    @tf.function(reduce_retracing=True)
    def _step(self, previous: Any, memory: Any, memory_mask: Any) -> tuple[Any, Any]:
        """The decoder on the frames so far (traced once for a growing T)."""
        return self.decode(previous, memory, memory_mask, training=False)


def build(vocab_size: int, n_mels: int) -> keras.Model:
    return AutoregressiveTTS(vocab_size, n_mels)
