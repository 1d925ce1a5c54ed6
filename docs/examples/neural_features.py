"""Neural features computed by the producers: the example of docs/MODELS.md, Producer models.

    PYTHONPATH=docs/examples python run.py --model neural_features:build --steps 100 \\
        --producer-models neural_features:codec,neural_features:speaker \\
        --set transforms.model_fields="codes:int32:T/4:-1,speaker_embedding:float32:64:0" \\
        --set batching.fields=ref_mel --set data.feature_cache=runs/features

    python docs/examples/neural_features.py --steps 100 --feature-cache runs/features   # the same through stoker.Feed

Two producer models (``transforms.models``), each a function returning a Keras model whose
weights are made by this file, deterministically (seeded initialisers), and saved to a file
(:func:`weights_file`; ``NEURAL_FEATURES_WEIGHTS`` names the directory, else the temporary
directory), so every process of a run, and every later run, loads the same weights:

- :func:`codec`: a convolutional encoder with a vector-quantised codebook, mel [B, T, F] ->
  ``codes`` int32 [B, T/4]: frames are grouped by 4 (a convolution of kernel and stride 4),
  mixed by a convolution over neighbouring groups, projected and replaced by the index of the
  nearest of :data:`CODEBOOK` codebook vectors (what an XTTS-like GPT predicts);
- :func:`speaker`: a speaker encoder, reference mel [B, R, F] -> ``speaker_embedding``
  float32 [B, 64]: per-frame features averaged over the valid frames, projected, unit length.

Both mask their input by its lengths, so a clip's outputs do not depend on the padding after
it (the producers cache them per clip). :func:`build` is the model trained on them
(``--model``): from the text and the speaker embedding it predicts the codes (cross-entropy
over each row's valid codes, its ``losses``) and a coarse mel (stoker's mel loss).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf
from keras import layers

N_MELS = 80
CODEBOOK = 64  # codebook vectors (the codes' vocabulary)
CODE_DIM = 16  # dimensions of a codebook vector
GROUP = 4  # mel frames per code
EMBEDDING = 64  # speaker embedding size
MODEL_FIELDS = f"codes:int32:T/{GROUP}:-1,speaker_embedding:float32:{EMBEDDING}:0"
SEED = 20240611


def weights_file(name: str) -> Path:
    root = Path(os.environ.get("NEURAL_FEATURES_WEIGHTS") or Path(tempfile.gettempdir()) / "stoker-neural-features")
    return root / f"{name}.weights.h5"


def _seeded(n: int) -> keras.initializers.Initializer:
    return keras.initializers.GlorotUniform(seed=SEED + n)


class Quantise(layers.Layer):
    """The index of the nearest codebook vector of each input vector."""

    def build(self, input_shape: Any) -> None:
        self.codebook = self.add_weight(shape=(CODEBOOK, CODE_DIM), initializer=_seeded(9), name="codebook")

    def call(self, x: Any) -> Any:
        distances = (tf.reduce_sum(x * x, -1, keepdims=True) - 2.0 * tf.einsum("btd,kd->btk", x, self.codebook)
                     + tf.reduce_sum(self.codebook * self.codebook, -1))
        return tf.argmin(distances, axis=-1, output_type=tf.int32)


def _masked(x: Any, lengths: Any) -> Any:
    return x * tf.sequence_mask(lengths, tf.shape(x)[1], dtype=x.dtype)[..., None]


def make_codec() -> keras.Model:
    mel = keras.Input((None, N_MELS), name="mel")
    lengths = keras.Input((), dtype="int32", name="mel_lengths")
    x = layers.Lambda(lambda a: _masked(a[0], a[1]))([mel, lengths])
    x = layers.Lambda(lambda a: tf.pad(a, [[0, 0], [0, -tf.shape(a)[1] % GROUP], [0, 0]]))(x)
    x = layers.Conv1D(64, GROUP, strides=GROUP, activation="relu", kernel_initializer=_seeded(1))(x)
    codes_valid = layers.Lambda(lambda n: (n + GROUP - 1) // GROUP)(lengths)
    x = layers.Lambda(lambda a: _masked(a[0], a[1]))([x, codes_valid])
    x = layers.Conv1D(64, 3, padding="same", activation="relu", kernel_initializer=_seeded(2))(x)
    x = layers.Dense(CODE_DIM, kernel_initializer=_seeded(3))(x)
    return keras.Model({"mel": mel, "mel_lengths": lengths}, {"codes": Quantise()(x)}, name="codec")


def make_speaker() -> keras.Model:
    mel = keras.Input((None, N_MELS), name="ref_mel")
    lengths = keras.Input((), dtype="int32", name="ref_mel_lengths")
    x = layers.Dense(96, activation="relu", kernel_initializer=_seeded(4))(mel)
    pooled = layers.Lambda(lambda a: tf.reduce_sum(_masked(a[0], a[1]), 1)
                           / tf.maximum(tf.cast(a[1], tf.float32), 1.0)[:, None])([x, lengths])
    y = layers.Dense(EMBEDDING, kernel_initializer=_seeded(5))(pooled)
    y = layers.Lambda(lambda v: tf.math.l2_normalize(v, axis=-1))(y)
    return keras.Model({"ref_mel": mel, "ref_mel_lengths": lengths}, {"speaker_embedding": y}, name="speaker")


def _with_weights(model: keras.Model, name: str) -> keras.Model:
    """``model`` with its weights from :func:`weights_file`, written there first (atomically:
    several processes may ask at once) when it does not exist yet."""
    path = weights_file(name)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(dir=path.parent, suffix=".weights.h5")
        os.close(fd)
        model.save_weights(scratch, overwrite=True)
        os.replace(scratch, path)
    model.load_weights(path)
    return model


def codec() -> keras.Model:
    """Producer model: mel, mel_lengths -> codes [B, T/4]."""
    return _with_weights(make_codec(), "codec")


def speaker() -> keras.Model:
    """Producer model: ref_mel, ref_mel_lengths -> speaker_embedding [B, 64]."""
    return _with_weights(make_speaker(), "speaker")


class CodesTTS(keras.Model):
    """Text + speaker embedding -> codes (cross-entropy) and a coarse mel, at the code rate."""

    def __init__(self, vocab_size: int, n_mels: int, dim: int = 96) -> None:
        super().__init__(name="codes_tts")
        self.embed = layers.Embedding(vocab_size, dim)
        self.encoder = [layers.Conv1D(dim, 5, padding="same", activation="relu") for _ in range(2)]
        self.speaker = layers.Dense(dim)
        self.query = layers.Dense(dim)
        self.attention = layers.MultiHeadAttention(num_heads=2, key_dim=dim // 2)
        self.logits = layers.Dense(CODEBOOK, dtype="float32")
        self.mel = layers.Dense(n_mels * GROUP, dtype="float32")

    def call(self, inputs: dict[str, Any], training: bool = False) -> dict[str, Any]:
        tokens, codes = inputs["tokens"], inputs["codes"]
        steps = tf.shape(codes)[1]
        x = self.embed(tokens)
        for conv in self.encoder:
            x = x + conv(x)
        valid = (inputs["mel_lengths"] + GROUP - 1) // GROUP
        progress = tf.cast(tf.range(steps), tf.float32)[None, :] / tf.maximum(tf.cast(valid, tf.float32), 1.0)[:, None]
        angles = progress[..., None] * tf.range(1.0, 17.0)[None, None, :] * 3.14159
        q = self.query(tf.concat([tf.sin(angles), tf.cos(angles)], -1)) \
            + self.speaker(inputs["speaker_embedding"])[:, None, :]
        mask = tf.sequence_mask(inputs["token_lengths"], tf.shape(tokens)[1])[:, None, :]
        h = q + self.attention(q, x, attention_mask=tf.logical_and(mask, tf.ones([1, steps, 1], tf.bool)))
        logits = self.logits(h)
        code_mask = tf.sequence_mask(valid, steps, dtype=tf.float32)
        ce = keras.losses.sparse_categorical_crossentropy(tf.maximum(codes, 0), logits, from_logits=True)
        code_loss = tf.reduce_sum(ce * code_mask) / tf.maximum(tf.reduce_sum(code_mask), 1.0)
        frames = tf.shape(inputs["mel"])[1]
        mel = tf.reshape(self.mel(h), [tf.shape(h)[0], steps * GROUP, -1])[:, :frames]
        return {"mel": mel, "losses": {"codes_ce": code_loss}}


def build(vocab_size: int, n_mels: int) -> keras.Model:
    """The --model: trains on the producers' codes and speaker embeddings."""
    return CodesTTS(vocab_size, n_mels)


def main(argv: list[str] | None = None) -> None:
    """The same training through stoker.Feed, with a loop of its own."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--run-dir", default="")
    parser.add_argument("--data", default=None)
    parser.add_argument("--feature-cache", default="",
                        help="cache the mels and the models' outputs in this directory (or auto: beside the dataset)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the producers import this file by its name
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                             os.environ.get("PYTHONPATH")]))
    import stoker

    feed = stoker.Feed(data=args.data, steps=args.steps, run_dir=args.run_dir or None, producers=2,
                       producer_models="neural_features:codec,neural_features:speaker",
                       set={"transforms.model_fields": MODEL_FIELDS, "batching.fields": "ref_mel",
                            "data.feature_cache": args.feature_cache})
    with feed:
        model = build(feed.vocabulary.size, feed.n_mels)
        optimizer = keras.optimizers.Adam(2e-3)
        for step, batch in enumerate(feed, start=1):
            with tf.GradientTape() as tape:
                out = model(batch, training=True)
                mask = tf.sequence_mask(batch["mel_lengths"], tf.shape(batch["mel"])[1], dtype=tf.float32)[..., None]
                mel_l1 = tf.reduce_sum(tf.abs(out["mel"] - batch["mel"]) * mask) / (tf.reduce_sum(mask) * N_MELS)
                loss = out["losses"]["codes_ce"] + mel_l1
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            feed.step_done(loss=float(loss))
            if step % 20 == 0:
                print(f"step {step}: codes cross-entropy {float(out['losses']['codes_ce']):.3f}, mel L1 "
                      f"{float(mel_l1):.3f}", flush=True)


if __name__ == "__main__":
    main()
