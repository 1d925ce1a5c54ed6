"""Producer models: the user's neural networks (an audio codec's encoder, a speaker encoder),
run by the producers on each batch after its log-mel, on their data device.

Loads the ``transforms.models`` functions' models, takes their versions, and runs each on a
batch (:class:`ModelRunner`), its outputs checked, cast and padded as ``transforms.model_fields``
declares. The user's contract: docs/MODELS.md, Producer models; the design and the faults:
docs/DESIGN.md, Producer models. TensorFlow is imported here only.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..shared.batch import Field
from ..shared.errors import UserError
from ..shared.mel import source_version
from ..shared.proc import EXIT_USER, with_stoker_path
from ..shared.userfn import import_function

log = logging.getLogger("producer")

# The inputs a model may name: a clip's own fields, or its reference clip's.
CLIP_INPUTS = ("mel", "mel_lengths", "audio", "audio_lengths")
REFERENCE_INPUTS = ("ref_mel", "ref_mel_lengths")
# The length field that gives a row's valid extent along each bucketed dimension.
LENGTH_OF = {"T": "mel_lengths", "R": "ref_mel_lengths", "S": "audio_lengths", "L": "token_lengths"}
# Hex digits of a weights digest kept in a model's version.
DIGEST_HEX = 16
# Loading the models to take their versions (model_versions) imports TensorFlow and builds or
# loads each model: a child that takes longer than this has hung.
VERSIONS_TIMEOUT_S = 600.0


class ModelSetupError(UserError):
    """A producer model cannot be imported, built or loaded; one line naming it."""


class ModelBatchError(Exception):
    """A model failed on one batch; ``str(exc)`` is the reason its clips are rejected with."""


def specs_of(models: str) -> list[str]:
    return [s.strip() for s in models.split(",") if s.strip()]


def weights_digest(obj: Any) -> str:
    """``sha256:`` and the first hex digits of the SHA-256 of a model's weights: a SavedModel's
    files (path and bytes, in order), else the values of its variables (a Keras model's
    ``weights``, a ``tf.Module``'s ``variables``, a bound method's owner's), "none" without any."""
    h = hashlib.sha256()
    if isinstance(obj, (str, os.PathLike)):
        root = Path(obj)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        return "sha256:" + h.hexdigest()[:DIGEST_HEX]
    owner = getattr(obj, "__self__", obj)
    variables = getattr(owner, "weights", None) or getattr(owner, "variables", None) or ()
    if not variables:
        return "none"
    for v in variables:
        value = np.asarray(v.numpy() if hasattr(v, "numpy") else v)
        h.update(str((value.dtype.name, value.shape)).encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return "sha256:" + h.hexdigest()[:DIGEST_HEX]


def _input_names(obj: Any) -> tuple[str, ...]:
    """The batch fields a model is called with (docs/MODELS.md, Producer models)."""
    inputs = getattr(obj, "inputs", None)
    if inputs and all(hasattr(t, "name") for t in inputs):  # a built Keras model
        return tuple(str(t.name).split(":")[0] for t in inputs)
    signature = inspect.signature(obj)
    return tuple(name for name, p in signature.parameters.items()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


@dataclass
class ProducerModel:
    """One loaded model: how it is called, what it reads, its version, its traced functions."""

    spec: str
    fn: Callable[..., Any]  # called with the inputs by name
    inputs: tuple[str, ...]
    version: str
    keras: bool  # a Keras model: called with a dict of its inputs
    traced: Any = None  # its tf.function (shapes left open: XLA compiles it once per bucket shape)
    jit: bool = False

    @property
    def reference(self) -> bool:
        """Whether its inputs are the reference clip's (its outputs are cached under that clip)."""
        return any(name in REFERENCE_INPUTS for name in self.inputs)


def load_model(spec: str) -> ProducerModel:
    """Import, build or load one model (``spec``: package.module:function); ModelSetupError (one
    line naming it) when it cannot, or when its inputs are not of one clip (docs/MODELS.md, Producer models)."""
    import tensorflow as tf  # the producer's heavy dependency, only where a model is configured

    fn, module = import_function(spec, "transforms.models", ModelSetupError)
    try:
        made = fn()
        if isinstance(made, (str, os.PathLike)):
            signature = tf.saved_model.load(os.fspath(made)).signatures["serving_default"]
            call, names = signature, tuple(signature.structured_input_signature[1])
        else:
            call, names = made, _input_names(made)
        version = f"{source_version(module.__name__)}+{weights_digest(made)}"
    except Exception as exc:  # the user's model: what its building or loading raised, in one line
        raise ModelSetupError(f"transforms.models {spec}: cannot build or load the model: {one_line(exc)}") from None
    if not callable(call):
        raise ModelSetupError(f"transforms.models {spec} returned {type(made).__name__}, not a Keras model, a "
                              f"TensorFlow callable or a SavedModel path")
    unknown = [n for n in names if n not in CLIP_INPUTS + REFERENCE_INPUTS]
    both = any(n in CLIP_INPUTS for n in names) and any(n in REFERENCE_INPUTS for n in names)
    if unknown or both or not names:
        raise ModelSetupError(f"transforms.models {spec}: inputs {list(names)}; a model reads the fields of one "
                              f"clip ({', '.join(CLIP_INPUTS)}) or of its reference ({', '.join(REFERENCE_INPUTS)})")
    return ProducerModel(spec, call, names, version, keras=isinstance(made, tf.keras.Model))


def load_models(models: str) -> list[ProducerModel]:
    return [load_model(spec) for spec in specs_of(models)]


def model_versions(models: str) -> dict[str, str]:
    """Each model's version, keyed ``model:SPEC`` (the trainer's WELCOME carries them beside the
    transforms' versions; a producer whose versions differ refuses to join). The models are
    loaded in a child process, on its CPU: the trainer's own TensorFlow is configured later (its
    devices, their memory) and must not be started here. ModelSetupError (one line) when one
    cannot be loaded."""
    env = with_stoker_path({**os.environ, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "3"})
    done = subprocess.run([sys.executable, "-m", "stoker.producer.models", models], capture_output=True, text=True,
                          env=env, timeout=VERSIONS_TIMEOUT_S)
    if done.returncode == EXIT_USER:
        raise ModelSetupError(done.stderr.strip().splitlines()[-1])
    if done.returncode != 0:
        raise ModelSetupError(f"transforms.models {models}: loading the models to take their versions failed "
                              f"(status {done.returncode}): {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _print_versions(models: str) -> int:
    """The child of :func:`model_versions`: the versions as one JSON line, or the one line of
    what failed (exit status EXIT_USER)."""
    try:
        versions = {f"model:{m.spec}": m.version for m in load_models(models)}
    except ModelSetupError as exc:
        sys.stderr.write(f"{exc}\n")
        return EXIT_USER
    sys.stdout.write(json.dumps(versions) + "\n")
    return 0


def one_line(exc: BaseException) -> str:
    """What a model raised, in one line: TensorFlow's errors from a traced function say "in user
    code:" and the frames first, the error itself last."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if lines and lines[0] == "in user code:":
        return lines[-1][:300]
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def valid_extent(dim: str, row: int, arrays: Mapping[str, np.ndarray]) -> int | None:
    """A row's valid size along a field's dimension (None: all of it)."""
    base, _, k = dim.partition("/")
    if base not in LENGTH_OF or LENGTH_OF[base] not in arrays:
        return None
    n = int(arrays[LENGTH_OF[base]][row])
    return -(-n // int(k)) if k else n


def pad_outside(value: np.ndarray, f: Field, arrays: Mapping[str, np.ndarray]) -> None:
    """Set a model field's entries past each row's valid extent to its padding, in place."""
    for row in range(value.shape[0]):
        for axis, dim in enumerate(f.dims[1:], start=1):
            n = valid_extent(dim, row, arrays)
            if n is not None:
                index = (row,) + (slice(None),) * (axis - 1) + (slice(n, None),)
                value[index] = f.pad


def clip_slice(value: np.ndarray, f: Field, row: int, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """One row's valid part of a model field (what the cache keeps of a clip)."""
    index = tuple(slice(0, valid_extent(d, row, arrays)) for d in f.dims[1:])
    return np.array(value[row][index])


class ModelRunner:
    """The run's producer models on one device: :meth:`run` calls one on a batch's arrays."""

    def __init__(self, models: str, fields: Sequence[Field], device: str | None) -> None:
        import tensorflow as tf  # only where a model is configured

        self.tf = tf
        self.device = device or "/CPU:0"
        if "GPU" not in self.device.upper():  # producers are one per core: each runs its models on one thread
            try:
                tf.config.threading.set_intra_op_parallelism_threads(1)
                tf.config.threading.set_inter_op_parallelism_threads(1)
            except RuntimeError:  # TensorFlow already ran ops in this process: its threads are set
                log.debug("producer models: TensorFlow's threads were set before the models were loaded")
        self.fields = {f.name: f for f in fields}
        with tf.device(self.device):
            self.models = load_models(models)
        gpu = "GPU" in self.device.upper()
        for m in self.models:
            m.jit = gpu  # XLA where the device allows it (a GPU); the CPU runs the plain function
        log.info("producer models %s on %s", ", ".join(f"{m.spec} ({m.version})" for m in self.models), self.device)

    def _traced(self, m: ProducerModel, inputs: Mapping[str, np.ndarray]) -> Any:
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

    def _call(self, m: ProducerModel, inputs: Mapping[str, np.ndarray]) -> Any:
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

    def run(self, m: ProducerModel, arrays: Mapping[str, np.ndarray], dims: Mapping[str, int],
            filled: int) -> dict[str, np.ndarray]:
        """The outputs of model ``m`` on a batch (``arrays`` at ``dims``, its first ``filled`` rows
        real, the others empty: all padding), checked, cast and padded (docs/MODELS.md);
        ModelBatchError (the clips' rejection reason) when it fails."""
        missing = [n for n in m.inputs if n not in arrays]
        if missing:
            raise ModelBatchError(f"producer model {m.spec}: its inputs {missing} are not batch fields of this run "
                                  f"(switch them on in batching.fields)")
        try:
            result = self._call(m, arrays)
        except Exception as exc:  # the user's model: what it raised is the clips' rejection reason
            raise ModelBatchError(f"producer model {m.spec}: {one_line(exc)}") from None
        if not isinstance(result, Mapping):
            raise ModelBatchError(f"producer model {m.spec} returned {type(result).__name__}, not a dict of the "
                                  f"fields transforms.model_fields declares")
        unknown = sorted(set(result) - set(self.fields))
        if unknown:
            raise ModelBatchError(f"producer model {m.spec} returned {unknown}, which transforms.model_fields does "
                                  f"not declare ({', '.join(self.fields)})")
        out = {}
        for name, tensor in result.items():
            f = self.fields[name]
            value = np.asarray(tensor)
            want = f.shape(dims)
            kind = np.dtype(f.dtype).kind
            if value.shape != want or (value.dtype.kind in "iu") != (kind == "i") or value.dtype.kind not in "iuf":
                raise ModelBatchError(f"producer model {m.spec}: {name} is {value.dtype.name} {list(value.shape)}; "
                                      f"declared {f.dtype} [{', '.join(f.dims)}] = {list(want)} for this batch")
            value = value.astype(f.dtype)
            value[filled:] = f.pad
            if kind == "f" and not np.all(np.isfinite(value)):
                raise ModelBatchError(f"producer model {m.spec}: {name} holds NaN or inf")
            pad_outside(value, f, arrays)
            out[name] = value
        return out


__all__ = ["ModelBatchError", "ModelRunner", "ModelSetupError", "ProducerModel",
           "clip_slice", "load_model", "model_versions", "specs_of", "weights_digest"]


if __name__ == "__main__":
    sys.exit(_print_versions(sys.argv[1]))
