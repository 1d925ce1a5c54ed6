"""PyTorch and JAX producer models for tests/producer/test_models_torch.py and
tests/stoker/test_feed_models_torch.py, named as a user names them
(``tests.producer.user_models_torch:NAME``).

``codec`` and ``speaker`` are docs/examples/neural_features_torch.py's, each counting its own
calls: every forward pass adds one to :data:`CALLS` and, where ``STOKER_TEST_MODEL_CALLS``
names a file, appends a line there (its process, the model, its rows, and whether TensorFlow
was imported in that process), so a test sees the calls made in producer processes too.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import neural_features_torch as nft  # noqa: E402  (found on docs/examples, as a user's module is on PYTHONPATH)

CALLS: collections.Counter[str] = collections.Counter()
TRACES: collections.Counter[str] = collections.Counter()  # a JAX model's Python body runs once per trace
CALLS_FILE = "STOKER_TEST_MODEL_CALLS"


def _counted(name: str, model: nn.Module) -> nn.Module:
    def note(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        CALLS[name] += 1
        path = os.environ.get(CALLS_FILE)
        if path:
            rows = int(next(iter(kwargs.values())).shape[0])
            with open(path, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "model": name, "rows": rows,
                                    "tensorflow": "tensorflow" in sys.modules}) + "\n")

    model.register_forward_pre_hook(note, with_kwargs=True)
    return model


def codec() -> nn.Module:
    return _counted("codec", nft.codec())


def speaker() -> nn.Module:
    return _counted("speaker", nft.speaker())


def scripted() -> Any:
    """The example's codec as TorchScript."""
    return torch.jit.script(nft.codec())


def exported() -> Any:
    """The example's codec as a torch.export program, its batch and time dimensions open (frames
    in whole groups of 4: buckets' frame counts are multiples of 4 here)."""
    frames = nft.GROUP * torch.export.Dim("groups", min=1, max=1024)
    rows = torch.export.Dim("rows", min=1, max=256)
    example = {"mel": torch.zeros(2, 16, nft.N_MELS), "mel_lengths": torch.tensor([16, 9], dtype=torch.int32)}
    return torch.export.export(nft.codec(), (), example,
                               dynamic_shapes={"mel": {0: rows, 1: frames}, "mel_lengths": {0: rows}})


class _Raising(nn.Module):
    def forward(self, mel: torch.Tensor, mel_lengths: torch.Tensor) -> Any:
        raise RuntimeError("the model cannot take this batch")


def raising() -> nn.Module:
    return _Raising()


class _ReadsTokens(nn.Module):
    def forward(self, tokens: torch.Tensor) -> Any:
        return {"score": tokens.float().mean(1)}


def reads_tokens() -> nn.Module:
    return _ReadsTokens()


def not_a_model() -> int:
    return 3


class Level(nn.Module):
    """score = scale x the batch's mean mel level, per row."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, mel: torch.Tensor, mel_lengths: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"score": self.scale * mel.mean(dim=(1, 2))}


def level() -> nn.Module:
    return Level()


# JAX: the model function returns (apply_fn, params).
def jax_level() -> Any:
    import jax.numpy as jnp

    def apply(params: Any, mel: Any, mel_lengths: Any) -> dict[str, Any]:
        TRACES["jax_level"] += 1
        valid = jnp.arange(mel.shape[1])[None, :] < mel_lengths[:, None]
        total = (mel * valid[..., None]).sum(axis=(1, 2)) / jnp.maximum(mel_lengths, 1) / mel.shape[2]
        return {"score": params["scale"] * total + params["shift"][0]}

    return apply, {"scale": jnp.asarray(2.0), "shift": [jnp.zeros(())]}


def jax_python_branch() -> Any:
    """A JAX model jax.jit cannot trace (a Python branch on a value)."""
    import jax.numpy as jnp

    def apply(params: Any, mel: Any, mel_lengths: Any) -> dict[str, Any]:
        if float(mel_lengths.max()) > 0:
            return {"score": params * jnp.asarray(mel_lengths, jnp.float32)}
        return {"score": jnp.zeros(mel_lengths.shape)}

    return apply, jnp.asarray(3.0)


def numpy_level_of(mel: np.ndarray, mel_lengths: np.ndarray) -> np.ndarray:
    """What :func:`jax_level` computes, in numpy."""
    valid = np.arange(mel.shape[1])[None, :] < mel_lengths[:, None]
    return 2.0 * (mel * valid[..., None]).sum(axis=(1, 2)) / np.maximum(mel_lengths, 1) / mel.shape[2]
