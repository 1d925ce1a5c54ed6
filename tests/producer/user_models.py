"""Producer models for tests/producer/test_models.py, named as a user names them
(``tests.producer.user_models:NAME``): each returns a TensorFlow callable of the mel."""

from __future__ import annotations

from typing import Any


def raising() -> Any:
    def model(mel: Any, mel_lengths: Any) -> Any:
        raise ValueError("the model cannot take this batch")

    return model


def not_finite() -> Any:
    import tensorflow as tf

    return lambda mel, mel_lengths: {"score": tf.fill(tf.shape(mel_lengths), float("nan"))}


def wrong_shape() -> Any:
    import tensorflow as tf

    return lambda mel, mel_lengths: {"score": tf.zeros([tf.shape(mel)[0], 2])}


def mean_level() -> Any:
    import tensorflow as tf

    class Level(tf.Module):
        def __init__(self) -> None:
            self.scale = tf.Variable(2.0)

        def __call__(self, mel: Any, mel_lengths: Any) -> Any:
            return {"score": self.scale * tf.reduce_mean(mel, axis=[1, 2])}

    return Level()


def broken() -> Any:
    raise OSError("weights file missing")


def reads_tokens() -> Any:
    return lambda tokens, mel: {"score": tokens}


def host_op() -> Any:
    """A model with an op XLA cannot compile (a call back into Python)."""
    import numpy as np
    import tensorflow as tf

    def score(mel: Any, mel_lengths: Any) -> Any:
        lengths = tf.numpy_function(lambda n: (n * 2).astype(np.float32), [mel_lengths], tf.float32)
        return {"score": tf.reshape(lengths, tf.shape(mel_lengths))}

    return score
