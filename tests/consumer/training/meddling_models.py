"""A user's module that changes global settings when imported, as some real ones do."""

from __future__ import annotations

import keras
import tensorflow as tf

from tests.consumer.training.user_models import FramesModel

keras.mixed_precision.set_global_policy("mixed_float16")
tf.config.optimizer.set_jit(True)


def good(vocab_size: int, n_mels: int) -> keras.Model:
    return FramesModel(vocab_size, n_mels)
