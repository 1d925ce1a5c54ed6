"""The text-to-mel acoustic model (presets ``tiny``, ``small``, ``base``), the loss
(:func:`objective`), and the contract a user's own model (``--model package.module:function``)
must keep.

The model, the loss's terms and the contract: docs/MODELS.md (The built-in model, The loss,
Your own model: the contract); the batch a model reads: docs/design/batches.md.
"""

from __future__ import annotations

import logging
import math
import re
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ...shared.batch import SCHEMA, BatchSchema, batch_dims, collate, example
from ...shared.config import BatchingConfig, FeaturesConfig
from ...shared.errors import UserError
from ...shared.text import FIRST_SYMBOL_ID
from ...shared.userfn import find_module, import_function
from ...shared.mel import pad_values

log = logging.getLogger(__name__)

# Sinusoidal position encodings: the wavelength scale of the original transformer.
POSITION_SCALE = 10000.0
# The length head predicts log(frames / tokens) around this prior (LJSpeech: ~5-7 frames
# of 256 samples at 22.05 kHz per character).
LOG_FRAMES_PER_TOKEN_INIT = math.log(6.0)

CONTRACT = (
    "a user model is built by `function(vocab_size=..., n_mels=...)` and must return a Keras model; "
    "it is called as model({'tokens': int32 [B, L], 'token_lengths': int32 [B], 'mel': float32 [B, T, F], "
    "'mel_lengths': int32 [B]}, training=bool) and must return the mel [B, T, F] or a dict with 'mel' "
    "(and optionally 'log_frames' [B], 'loss' scalar, 'losses' {name: scalar}, any other outputs); "
    "see docs/MODELS.md")


class ModelError(UserError):
    """The --model value cannot be used (one line for the user)."""


@dataclass(frozen=True)
class Preset:
    dim: int  # model width
    heads: int  # attention heads
    encoder_layers: int
    decoder_layers: int
    ffn_dim: int  # width of the convolutional feed-forward
    kernel: int  # its kernel size (over tokens in the encoder, frames in the decoder)
    dropout: float


PRESETS: dict[str, Preset] = {
    # For CPUs and the demo: about 0.7 M parameters, a few ms per step on a GPU.
    "tiny": Preset(dim=128, heads=2, encoder_layers=2, decoder_layers=2, ffn_dim=128, kernel=5, dropout=0.0),
    # A single-GPU research baseline: about 15 M parameters.
    "small": Preset(dim=256, heads=4, encoder_layers=4, decoder_layers=4, ffn_dim=1024, kernel=5, dropout=0.1),
    # Tens of millions of parameters (about 38 M): for a model GPU that the pipeline must keep busy.
    "base": Preset(dim=512, heads=8, encoder_layers=6, decoder_layers=6, ffn_dim=1024, kernel=3, dropout=0.1),
}


def positional(tf: Any, positions: Any, dim: int) -> Any:
    """Sinusoidal encoding of (possibly fractional) positions [..., 1] -> [..., dim], float32."""
    half = dim // 2
    freqs = tf.exp(-math.log(POSITION_SCALE) * tf.range(half, dtype=tf.float32) / half)
    angles = tf.cast(positions, tf.float32) * freqs
    return tf.concat([tf.sin(angles), tf.cos(angles)], axis=-1)


def _blocks(p: Preset) -> tuple[type, type]:
    """The model's two blocks for preset ``p``: a conv feed-forward and an attention (Keras layers)."""
    from keras import layers

    class ConvFeedForward(layers.Layer):
        """Pre-norm conv feed-forward along the sequence, residual, padding kept at zero."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.norm = layers.LayerNormalization()
            self.inner = layers.Conv1D(p.ffn_dim, p.kernel, padding="same", activation="relu")
            self.outer = layers.Conv1D(p.dim, 1)
            self.drop = layers.Dropout(p.dropout)

        def call(self, x: Any, mask: Any, training: bool = False) -> Any:
            h = self.inner(self.norm(x) * mask)
            return x + self.drop(self.outer(h), training=training) * mask

    class Attend(layers.Layer):
        """Pre-norm multi-head attention from ``x`` to ``memory`` (itself when None), residual."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.norm = layers.LayerNormalization()
            self.attention = layers.MultiHeadAttention(num_heads=p.heads, key_dim=p.dim // p.heads,
                                                       dropout=p.dropout)

        def call(self, x: Any, memory: Any, attention_mask: Any, training: bool = False) -> Any:
            q = self.norm(x)
            kv = q if memory is None else memory
            return x + self.attention(q, kv, attention_mask=attention_mask, training=training)

    return ConvFeedForward, Attend


def _frame_queries(tf: Any, token_lengths: Any, mel_lengths: Any, frames: Any, dim: int) -> Any:
    """Each output frame's query [B, T, 2 dim] (float32): where in the text it is expected to be
    (frame / T_valid x L_valid, a monotonic prior) and where in the clip it is."""
    t = tf.cast(tf.range(frames), tf.float32)[None, :, None]  # [1, T, 1]
    valid_frames = tf.maximum(tf.cast(mel_lengths, tf.float32), 1.0)[:, None, None]
    expected = t * tf.cast(token_lengths, tf.float32)[:, None, None] / valid_frames  # [B, T, 1]
    progress = 100.0 * t / valid_frames
    return tf.concat([positional(tf, expected, dim), positional(tf, progress, dim)], axis=-1)


def build_model(preset: str, vocab_size: int, n_mels: int) -> Any:
    """The built-in ``TextToMel`` Keras model of a preset (docs/MODELS.md, The built-in model)."""
    import keras
    import tensorflow as tf
    from keras import layers

    p = PRESETS[preset]
    ConvFeedForward, Attend = _blocks(p)

    class TextToMel(keras.Model):
        def __init__(self) -> None:
            super().__init__(name="text_to_mel")
            self.embed = layers.Embedding(vocab_size, p.dim)
            self.enc_attention = [Attend(name=f"enc_attention_{i}") for i in range(p.encoder_layers)]
            self.enc_ffn = [ConvFeedForward(name=f"enc_ffn_{i}") for i in range(p.encoder_layers)]
            self.enc_norm = layers.LayerNormalization()
            self.query = layers.Dense(p.dim)
            self.dec_attention = [Attend(name=f"dec_attention_{i}") for i in range(p.decoder_layers)]
            self.dec_ffn = [ConvFeedForward(name=f"dec_ffn_{i}") for i in range(p.decoder_layers)]
            self.dec_norm = layers.LayerNormalization()
            self.out = layers.Dense(n_mels, dtype="float32")
            self.length_hidden = layers.Dense(p.dim, activation="relu")
            self.length_out = layers.Dense(1, dtype="float32", kernel_initializer="zeros")

        def call(self, inputs: dict[str, Any], training: bool = False) -> dict[str, Any]:
            tokens, token_lengths = inputs["tokens"], inputs["token_lengths"]
            mel_lengths = inputs["mel_lengths"]
            text_len, frames = tf.shape(tokens)[1], tf.shape(inputs["mel"])[1]
            token_mask = tf.sequence_mask(token_lengths, text_len)  # [B, L]
            x = self.embed(tokens)
            dtype = x.dtype
            x = x * math.sqrt(p.dim) + tf.cast(positional(tf, tf.range(text_len)[None, :, None], p.dim), dtype)
            tmask = tf.cast(token_mask, dtype)[..., None]
            self_mask = token_mask[:, None, :] & token_mask[:, :, None]  # [B, L, L]
            for attend, ffn in zip(self.enc_attention, self.enc_ffn):
                x = attend(x, None, self_mask, training=training)
                x = ffn(x, tmask, training=training)
            x = self.enc_norm(x) * tmask

            # Length head: masked mean of the text encoding (gradient stopped) -> log frames.
            n_tok = tf.maximum(tf.cast(token_lengths, tf.float32), 1.0)
            pooled = tf.reduce_sum(tf.cast(tf.stop_gradient(x), tf.float32), axis=1) / n_tok[:, None]
            log_frames = (tf.math.log(n_tok) + LOG_FRAMES_PER_TOKEN_INIT
                          + self.length_out(self.length_hidden(pooled))[:, 0])

            h = self.query(tf.cast(_frame_queries(tf, token_lengths, mel_lengths, frames, p.dim), dtype))
            fmask = tf.cast(tf.sequence_mask(mel_lengths, frames), dtype)[..., None]  # [B, T, 1]
            cross_mask = tf.logical_and(token_mask[:, None, :], tf.ones([1, frames, 1], tf.bool))  # [B, T, L]
            for attend, ffn in zip(self.dec_attention, self.dec_ffn):
                h = attend(h, x, cross_mask, training=training)
                h = ffn(h, fmask, training=training)
            mel = self.out(self.dec_norm(h))
            return {"mel": mel, "log_frames": log_frames}

    return TextToMel()


def dummy_inputs(batch: int, tokens: int, frames: int, n_mels: int, pad_value: float, vocab_size: int,
                 schema: BatchSchema = SCHEMA, hop_length: int = FeaturesConfig.hop_length,
                 ref_frames: int = BatchingConfig.ref_frames) -> dict[str, np.ndarray]:
    """A batch of the model's input shapes and dtypes (to build and check a model, and to
    trace the step): every row full, the waveform and the reference as long as the bucket
    allows; token ids are drawn below ``vocab_size``, after <pad> and <eos> where the
    vocabulary has more."""
    rng = np.random.default_rng(0)
    examples = [example(rng.integers(min(FIRST_SYMBOL_ID, vocab_size - 1), vocab_size, size=tokens),
                        np.full((frames, n_mels), pad_value, np.float32), schema,
                        audio=np.zeros(max(frames * hop_length - 1, 1), np.float32),
                        ref_mel=np.full((max(ref_frames, 1), n_mels), pad_value, np.float32)) for _ in range(batch)]
    return collate(examples, batch_dims(batch, (tokens, frames), n_mels, hop_length, ref_frames),
                   {**pad_values(schema, FeaturesConfig(), "off"), "mel": pad_value, "ref_mel": pad_value}, schema)


def check_spec(spec: str) -> str:
    """Validate a model name without importing TensorFlow or the user's module:
    returns "preset", "synthetic" or "user"."""
    if spec in PRESETS:
        return "preset"
    if spec.startswith("synthetic:"):
        return "synthetic"
    module, sep, function = spec.partition(":")
    if not sep or not module or not function.isidentifier() or not all(
            part.isidentifier() for part in module.split(".")):
        raise ModelError(f"--model {spec}: expected one of {', '.join(PRESETS)}, synthetic:MS, "
                         f"or package.module:function")
    return "user"


# Keras wraps a layer's error in "Exception encountered when calling X.call()." and styles
# the original message with terminal escapes; both are taken off to find what was said.
_KERAS_WRAPPER = "Exception encountered when calling"
_TERMINAL_STYLE = re.compile(r"\x1b\[[0-9;]*m")
# Causes named in an error line, at most (a chain is rarely longer).
MAX_CAUSES = 3


def _said(exc: BaseException) -> str:
    """The first informative line of an exception's message."""
    for line in _TERMINAL_STYLE.sub("", str(exc)).splitlines():
        line = line.strip()
        if line and not line.startswith(_KERAS_WRAPPER):
            return line
    return ""


def _user_frame(exc: BaseException, spec: str) -> str:
    """Where in the user's own module the error came from ("" when not from there)."""
    module = spec.partition(":")[0]
    try:
        found = find_module(module)
    except (ImportError, ValueError):
        found = None
    origin = getattr(found, "origin", None)
    if not origin:
        return ""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == origin]
    if not frames:
        return ""
    last = frames[-1]
    return f" (at {Path(last.filename).name}:{last.lineno} in {last.name}: {(last.line or '').strip()})"


def explain(exc: BaseException, spec: str, precision: str = "float32", jit_compile: bool = False) -> str:
    """A user model's failure as one line: what it raised, the line of the user's code it came
    from, what caused it, and the setting to try when mixed precision or XLA was on."""
    text = f"{type(exc).__name__}: {_said(exc)}{_user_frame(exc, spec)}"
    seen, cause = 0, exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    while cause is not None and seen < MAX_CAUSES:
        text += f"; caused by {type(cause).__name__}: {_said(cause)}"
        seen += 1
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    hints = []
    if precision != "float32":
        hints.append(f"it ran under trainer.precision={precision}: try --set trainer.precision=float32")
    if jit_compile:
        hints.append("it ran under XLA: try --set trainer.jit_compile=false")
    return text + ("; " + "; ".join(hints) if hints else "")


def load_user_builder(spec: str) -> Callable[..., Any]:
    """The function of ``--model package.module:function``; ModelError (one line) when not there."""
    return import_function(spec, "--model", ModelError)[0]


def _keep_settings(spec: str, what: str, policy: str, jit: Any) -> None:
    """Undo (with a warning) a user module's change of the global Keras dtype policy or of
    TensorFlow's global XLA setting: stoker sets them from trainer.precision and
    trainer.jit_compile, and a silent override would train in another precision than asked."""
    import keras
    import tensorflow as tf

    now = keras.mixed_precision.global_policy().name
    if now != policy:
        log.warning("--model %s: %s the model set the global Keras dtype policy to %s; stoker runs with %s "
                    "(trainer.precision), so that change is undone%s", spec, what, now, policy,
                    " (layers it built meanwhile keep theirs)" if what == "building" else "")
        keras.mixed_precision.set_global_policy(policy)
    if tf.config.optimizer.get_jit() != jit:
        log.warning("--model %s: %s the model changed TensorFlow's global XLA setting "
                    "(tf.config.optimizer.set_jit); stoker compiles its step as trainer.jit_compile says, so that "
                    "change is undone", spec, what)
        tf.config.optimizer.set_jit(jit)


def build(spec: str, vocab_size: int, n_mels: int) -> Any:
    """The Keras model named by ``spec`` (a preset or a user's ``module:function``)."""
    if check_spec(spec) == "preset":
        return build_model(spec, vocab_size, n_mels)
    import keras
    import tensorflow as tf

    policy, jit = keras.mixed_precision.global_policy().name, tf.config.optimizer.get_jit()
    builder = load_user_builder(spec)
    _keep_settings(spec, "importing", policy, jit)
    try:
        model = builder(vocab_size=vocab_size, n_mels=n_mels)
    except Exception as exc:  # the user's code: report what it raised, with the contract
        raise ModelError(f"--model {spec}: building the model failed: {explain(exc, spec, policy)}; "
                         f"{CONTRACT}") from exc
    _keep_settings(spec, "building", policy, jit)
    if not isinstance(model, keras.Model):
        raise ModelError(f"--model {spec}: the function returned {type(model).__name__}, not a keras.Model; "
                         f"{CONTRACT}")
    return model


def outputs_of(result: Any) -> dict[str, Any]:
    """A model's return value as a dict with "mel" (and maybe "log_frames", "loss", "losses",
    and extra outputs, which are kept and not used)."""
    if isinstance(result, dict):
        if "mel" not in result:
            raise ModelError(f"the model returned a dict without 'mel' (keys {sorted(result)}); {CONTRACT}")
        if "losses" in result and not isinstance(result["losses"], dict):
            raise ModelError(f"the model's 'losses' output is a {type(result['losses']).__name__}, not a dict of "
                             f"named scalars; {CONTRACT}")
        return result
    return {"mel": result}


def check_outputs(spec: str, result: Any, batch: int, frames: int, n_mels: int) -> None:
    """Check a model's outputs on a dummy batch against the contract; ModelError if not kept."""
    try:
        out = outputs_of(result)
    except ModelError as exc:
        raise ModelError(f"--model {spec}: {exc}") from None
    expected = {"mel": (batch, frames, n_mels), "log_frames": (batch,), "loss": ()}
    for name, want in expected.items():
        if name not in out:
            continue
        shape = tuple(getattr(out[name], "shape", ()))
        if shape != want:
            raise ModelError(f"--model {spec}: output {name!r} has shape {list(shape)} for a batch of "
                             f"B={batch}, T={frames}, F={n_mels}; expected {list(want)}; {CONTRACT}")
    for name, value in (out.get("losses") or {}).items():
        if tuple(getattr(value, "shape", ())) != ():
            raise ModelError(f"--model {spec}: its loss term {name!r} has shape {list(value.shape)}, not a scalar; "
                             f"{CONTRACT}")


def loss_terms(tf: Any, out: dict[str, Any], batch: dict[str, Any], mode: str,
               user_loss: Callable[..., Any] | None = None) -> dict[str, Any]:
    """The model's own terms (``loss``, ``losses``) and the user function's, each a scalar mean."""
    terms: dict[str, Any] = {}
    if user_loss is not None:
        given = user_loss(batch, out)
        named = given if isinstance(given, dict) else {"loss_fn": given}
        for name, value in named.items():
            value = tf.convert_to_tensor(value)
            if value.shape.rank != 0:
                raise ModelError(f"trainer.loss {mode}: term {name!r} has shape {value.shape.as_list()}, not a "
                                 f"scalar; the function returns a scalar or a dict of named scalars")
            terms[str(name)] = tf.cast(value, tf.float32)
    if "loss" in out:
        terms["extra"] = tf.cast(out["loss"], tf.float32)
    for name, value in (out.get("losses") or {}).items():
        terms[str(name)] = tf.cast(value, tf.float32)
    return terms


def objective(tf: Any, out: dict[str, Any], batch: dict[str, Any], l2_weight: float,
              length_weight: float, mode: str = "mel",
              user_loss: Callable[..., Any] | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """(numerator, V, terms): loss = numerator / V with V the batch's valid frames (float32).

    ``mode``: trainer.loss ("mel", "model" or a function's spec, then ``user_loss`` is it).
    ``terms`` holds each term's numerator (mel_l1, mel_l2, length, and the model's or the
    function's named terms, each a mean times V), for logging; the numerator is their sum,
    the weighted mel_l2 and length included.
    """
    mel = batch["mel"]
    mel_lengths = batch["mel_lengths"]
    frames, n_mels = tf.shape(mel)[1], tf.shape(mel)[2]
    valid = tf.cast(tf.reduce_sum(mel_lengths), tf.float32)
    terms: dict[str, Any] = {}
    numerator = tf.constant(0.0, tf.float32)
    if mode == "mel":
        pred = tf.cast(out["mel"], tf.float32)
        mask = tf.cast(tf.sequence_mask(mel_lengths, frames), tf.float32)[..., None]  # [B, T, 1]
        err = (pred - mel) * mask
        terms["mel_l1"] = tf.reduce_sum(tf.abs(err)) / tf.cast(n_mels, tf.float32)
        numerator += terms["mel_l1"]
        if l2_weight:
            terms["mel_l2"] = tf.reduce_sum(tf.square(err)) / tf.cast(n_mels, tf.float32)
            numerator += l2_weight * terms["mel_l2"]
        if length_weight and "log_frames" in out:
            lengths = tf.cast(mel_lengths, tf.float32)
            target = tf.math.log(tf.maximum(lengths, 1.0))
            terms["length"] = tf.reduce_sum(lengths * tf.square(tf.cast(out["log_frames"], tf.float32) - target))
            numerator += length_weight * terms["length"]
    for name, value in loss_terms(tf, out, batch, mode, user_loss).items():
        key = name if name not in terms else f"model_{name}"
        terms[key] = value * valid
        numerator += terms[key]
    return numerator, valid, terms


def restorable(model: Any) -> dict[str, Any]:
    """What a checkpoint holds to restore every weight of ``model``: the model and the list of
    all its variables, in the order the model's code creates them.

    ``tf.train.Checkpoint(model=model)`` reaches a Keras 3 model's variables only through
    the attributes TensorFlow's tracking follows: sublayers kept in Python lists or dicts,
    and the inner layers of some built-in ones (MultiHeadAttention's projections), are
    missed, so 24 of the tiny preset's 77 variables would keep their random initial values
    in a model restored for synthesis or export. The flat list reaches them all: the same
    code builds the same variables in the same order, and a reader checks every shape.
    """
    return {"model": model, "weights": list(model.variables)}


def count_params(model: Any) -> int:
    """Trainable parameters of a built model."""
    return int(sum(int(np.prod(v.shape)) for v in model.trainable_weights))
