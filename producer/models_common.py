"""What every framework's producer models share (producer/models.py and its models_tf,
models_torch, models_jax): the loaded model, the two errors, and a failure in one line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..shared.errors import UserError

# The inputs a model may name: a clip's own fields, or its reference clip's.
CLIP_INPUTS = ("mel", "mel_lengths", "audio", "audio_lengths")
REFERENCE_INPUTS = ("ref_mel", "ref_mel_lengths")


class ModelSetupError(UserError):
    """A producer model cannot be imported, built or loaded; one line naming it."""


class ModelBatchError(Exception):
    """A model failed on one batch; ``str(exc)`` is the reason its clips are rejected with."""


@dataclass
class ProducerModel:
    """One loaded model: its framework, how it is called, what it reads, its version, and the
    framework's compiled function where it compiles."""

    spec: str
    fn: Callable[..., Any]  # called with the inputs by name (JAX's: with its parameters first)
    inputs: tuple[str, ...]
    version: str  # FRAMEWORK:SOURCE+WEIGHTS (producer/models.py load_model)
    framework: str = "tensorflow"
    keras: bool = False  # a Keras model: called with a dict of its inputs
    traced: Any = None  # its tf.function (shapes left open) or jax.jit: compiled once per bucket shape
    jit: bool = False
    made: Any = None  # what the model function returned (a torch.export program is moved to the device whole)
    params: Any = None  # a JAX model's parameters (a pytree), on the device once prepared

    @property
    def reference(self) -> bool:
        """Whether its inputs are the reference clip's (its outputs are cached under that clip)."""
        return any(name in REFERENCE_INPUTS for name in self.inputs)


def one_line(exc: BaseException) -> str:
    """What a model raised, in one line: TensorFlow's errors from a traced function say "in user
    code:" and the frames first, the error itself last."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if lines and lines[0] == "in user code:":
        return lines[-1][:300]
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"
