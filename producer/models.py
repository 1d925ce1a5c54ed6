"""Producer models: the user's neural networks (an audio codec's encoder, a speaker encoder),
run by the producers on each batch after its log-mel, on their data device.

Loads the ``transforms.models`` functions' models, whichever framework's (TensorFlow, PyTorch,
JAX: producer/models_tf.py, models_torch.py, models_jax.py, picked by what the function
returns), takes their versions, and runs each on a batch (:class:`ModelRunner`), its outputs
checked, cast and padded as ``transforms.model_fields`` declares. The user's contract:
docs/MODELS.md, Producer models; the design and the faults: docs/design/features.md, "Producer models".
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Any, Mapping, Sequence

import numpy as np

from . import models_jax, models_tf, models_torch
from .models_common import CLIP_INPUTS, REFERENCE_INPUTS, ModelBatchError, ModelSetupError, ProducerModel, one_line
from ..shared.batch import Field
from ..shared.mel import source_version
from ..shared.proc import EXIT_USER, with_stoker_path
from ..shared.userfn import import_function

log = logging.getLogger("producer")

# The length field that gives a row's valid extent along each bucketed dimension.
LENGTH_OF = {"T": "mel_lengths", "R": "ref_mel_lengths", "S": "audio_lengths", "L": "token_lengths"}
# Hex digits of a weights digest kept in a model's version.
DIGEST_HEX = 16
# Loading the models to take their versions (model_versions) imports their frameworks and builds
# or loads each model: a child that takes longer than this has hung.
VERSIONS_TIMEOUT_S = 600.0
KINDS = ("a PyTorch module (eager, TorchScript or torch.export'ed), a JAX (apply_fn, params) pair, a Keras model, "
         "a TensorFlow callable or a SavedModel path")


def specs_of(models: str) -> list[str]:
    return [s.strip() for s in models.split(",") if s.strip()]


def weights_digest(made: Any) -> str:
    """``sha256:`` and the first hex digits of the SHA-256 of a model's weights (what its model
    function returned: a PyTorch module's state_dict, a JAX pair's params, a SavedModel's files,
    a Keras model's or TensorFlow callable's variables), "none" without any."""
    if models_torch.owns(made):
        full = models_torch.digest(made)
    elif models_jax.owns(made):
        full = models_jax.digest(made[1])
    else:
        full = models_tf.digest(made)
    return "sha256:" + full[:DIGEST_HEX] if full else "none"


def framework_of(version: str) -> str:
    """The framework a model version names (its first part: :func:`load_model`)."""
    return version.split(":", 1)[0]


def frameworks_of(versions: Mapping[str, str]) -> set[str]:
    """The frameworks of the models among a WELCOME's versions (``model:SPEC`` keys): a
    producer configures TensorFlow for its models only where one is TensorFlow's."""
    return {framework_of(v) for k, v in versions.items() if k.startswith("model:")}


def _adopt(spec: str, made: Any) -> ProducerModel:
    """A loaded model of what ``spec``'s function returned, its framework told by its type."""
    if models_torch.owns(made):
        fn, names = models_torch.adopt(made)
        return ProducerModel(spec, fn, names, "", models_torch.FRAMEWORK, made=made)
    if models_jax.owns(made):
        fn, names, params = models_jax.adopt(made)
        return ProducerModel(spec, fn, names, "", models_jax.FRAMEWORK, made=made, params=params)
    if not callable(made) and not isinstance(made, (str, os.PathLike)):
        raise ModelSetupError(f"transforms.models {spec} returned {type(made).__name__}, not {KINDS}")
    fn, names, keras = models_tf.adopt(made)
    return ProducerModel(spec, fn, names, "", models_tf.FRAMEWORK, keras=keras, made=made)


def load_model(spec: str) -> ProducerModel:
    """Import, build or load one model (``spec``: package.module:function); ModelSetupError (one
    line naming it) when it cannot, or when its inputs are not of one clip (docs/MODELS.md,
    Producer models). Its version: FRAMEWORK:SOURCE+WEIGHTS, its module's source's and its
    weights' SHA-256. Only the model's own framework is imported."""
    fn, module = import_function(spec, "transforms.models", ModelSetupError)
    try:
        made = fn()
        model = _adopt(spec, made)
        model.version = f"{model.framework}:{source_version(module.__name__)}+{weights_digest(made)}"
    except ModelSetupError:
        raise
    except Exception as exc:  # the user's model: what its building or loading raised, in one line
        raise ModelSetupError(f"transforms.models {spec}: cannot build or load the model: {one_line(exc)}") from None
    names = model.inputs
    unknown = [n for n in names if n not in CLIP_INPUTS + REFERENCE_INPUTS]
    both = any(n in CLIP_INPUTS for n in names) and any(n in REFERENCE_INPUTS for n in names)
    if unknown or both or not names:
        raise ModelSetupError(f"transforms.models {spec}: inputs {list(names)}; a model reads the fields of one "
                              f"clip ({', '.join(CLIP_INPUTS)}) or of its reference ({', '.join(REFERENCE_INPUTS)})")
    return model


def load_models(models: str) -> list[ProducerModel]:
    return [load_model(spec) for spec in specs_of(models)]


def model_versions(models: str) -> dict[str, str]:
    """Each model's version, keyed ``model:SPEC`` (the trainer's WELCOME carries them beside the
    transforms' versions; a producer whose versions differ refuses to join). The models are
    loaded in a child process, on its CPU: the trainer's own framework is configured later (its
    devices, their memory) and must not be started here. ModelSetupError (one line) when one
    cannot be loaded."""
    env = with_stoker_path({**os.environ, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "3",
                            "JAX_PLATFORMS": "cpu"})
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
    """The run's producer models on the producer's data device: :meth:`run` calls one on a
    batch's arrays. ``device``: TensorFlow's, where the producer configured TensorFlow for its
    models (None: the CPU, or no TensorFlow model); PyTorch and JAX find the device themselves
    (the GPU CUDA_VISIBLE_DEVICES names, within ``memory_mb``, else the CPU)."""

    def __init__(self, models: str, fields: Sequence[Field], device: str | None = None,
                 memory_mb: int | None = None) -> None:
        self.fields = {f.name: f for f in fields}
        self.tf_device, self.memory_mb = device, memory_mb
        self._backends: dict[str, Any] = {}
        models_jax.prepare_environment(memory_mb)  # JAX reads it when a model's module imports it
        with models_tf.loading_scope(device):
            self.models = load_models(models)
        for m in self.models:
            self.backend(m.framework).prepare(m)
        log.info("producer models %s", ", ".join(f"{m.spec} ({m.version}) on {self.backend(m.framework).device}"
                                                  for m in self.models))

    def backend(self, framework: str) -> Any:
        """The framework's models' device and calls, made at its first model."""
        if framework not in self._backends:
            self._backends[framework] = (models_torch.Backend(self.memory_mb) if framework == models_torch.FRAMEWORK
                                         else models_jax.Backend() if framework == models_jax.FRAMEWORK
                                         else models_tf.Backend(self.tf_device))
        return self._backends[framework]

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
            result = self.backend(m.framework).call(m, arrays)
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


__all__ = ["ModelBatchError", "ModelRunner", "ModelSetupError", "ProducerModel", "clip_slice", "frameworks_of",
           "load_model", "model_versions", "one_line", "specs_of", "weights_digest"]


if __name__ == "__main__":
    sys.exit(_print_versions(sys.argv[1]))
