"""Producer models in TensorFlow (producer/models.py picks this module by the model's type): a
Keras model, a TensorFlow callable or a SavedModel path, run as one tf.function per model.

TensorFlow is imported here only, and only for a TensorFlow model (or a producer whose trainer
said one is configured). docs/design/features.md, "Producer models".
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import os
from pathlib import Path
from typing import Any, ContextManager, Mapping

import numpy as np

from .models_common import one_line

log = logging.getLogger("producer")

FRAMEWORK = "tensorflow"


def digest(obj: Any) -> str:
    """The SHA-256 of a model's weights (hex): a SavedModel's files (path and bytes, in order),
    else the values of its variables (a Keras model's ``weights``, a ``tf.Module``'s
    ``variables``, a bound method's owner's); "" without any."""
    h = hashlib.sha256()
    if isinstance(obj, (str, os.PathLike)):
        root = Path(obj)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        return h.hexdigest()
    owner = getattr(obj, "__self__", obj)
    variables = getattr(owner, "weights", None) or getattr(owner, "variables", None) or ()
    if not variables:
        return ""
    for v in variables:
        value = np.asarray(v.numpy() if hasattr(v, "numpy") else v)
        h.update(str((value.dtype.name, value.shape)).encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def adopt(made: Any) -> tuple[Any, tuple[str, ...], bool]:
    """(what to call, its input names, whether it is a Keras model) of what a model function
    returned: a SavedModel path (its ``serving_default`` signature), a Keras model or a callable."""
    import tensorflow as tf  # a TensorFlow model: the producer's heavy dependency, only here

    if isinstance(made, (str, os.PathLike)):
        signature = tf.saved_model.load(os.fspath(made)).signatures["serving_default"]
        return signature, tuple(signature.structured_input_signature[1]), False
    inputs = getattr(made, "inputs", None)
    if inputs and all(hasattr(t, "name") for t in inputs):  # a built Keras model
        names = tuple(str(t.name).split(":")[0] for t in inputs)
    else:
        signature = inspect.signature(made)
        names = tuple(name for name, p in signature.parameters.items()
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return made, names, isinstance(made, tf.keras.Model)


def loading_scope(device: str | None) -> ContextManager[Any]:
    """Where the models are built: on ``device`` when the producer configured TensorFlow for its
    models (its threads set first: one on the CPU, producers being one per core), else nowhere
    in particular (no TensorFlow imported)."""
    if device is None:
        return contextlib.nullcontext()
    import tensorflow as tf  # configured by the producer already: its models are TensorFlow's

    if "GPU" not in device.upper():
        _one_thread(tf)
    return tf.device(device)


def _one_thread(tf: Any) -> None:
    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:  # TensorFlow already ran ops in this process: its threads are set
        log.debug("producer models: TensorFlow's threads were set before the models were loaded")


class Backend:
    """TensorFlow models on one device: one tf.function per model, with XLA on a GPU."""

    def __init__(self, device: str | None) -> None:
        import tensorflow as tf  # a TensorFlow model is configured

        self.tf = tf
        self.device = device or "/CPU:0"
        if "GPU" not in self.device.upper():
            _one_thread(tf)

    def prepare(self, m: Any) -> None:
        m.jit = "GPU" in self.device.upper()  # XLA where the device allows it (a GPU); the CPU runs the plain function

    def _traced(self, m: Any, inputs: Mapping[str, np.ndarray]) -> Any:
        """The model's tf.function, traced once with its inputs' dimensions left open: the graph
        serves every bucket, and with XLA each bucket shape is compiled once, when first seen."""
        if m.traced is None:
            tf, fn = self.tf, m.fn
            spec = [{n: tf.TensorSpec([None] * inputs[n].ndim, tf.as_dtype(inputs[n].dtype), name=n)
                     for n in m.inputs}]
            if m.keras:
                m.traced = tf.function(lambda kw: fn(kw, training=False), input_signature=spec, jit_compile=m.jit)
            else:
                m.traced = tf.function(lambda kw: fn(**kw), input_signature=spec, jit_compile=m.jit)
        return m.traced

    def call(self, m: Any, inputs: Mapping[str, np.ndarray]) -> Any:
        """The model's outputs on the batch's ``inputs`` (a dict of tensors, or what it returned)."""
        tf = self.tf
        with tf.device(self.device):
            tensors = {n: tf.constant(inputs[n]) for n in m.inputs}
            try:
                return self._traced(m, inputs)(tensors)
            except Exception as exc:  # XLA may not compile the user's ops: the plain function, once
                if not m.jit:
                    raise
                log.warning("producer model %s: XLA cannot compile it (%s); running it without XLA", m.spec,
                            one_line(exc))
                m.jit, m.traced = False, None
                return self._traced(m, inputs)(tensors)
