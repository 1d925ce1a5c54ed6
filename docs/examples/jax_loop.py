"""Your own JAX training loop on stoker's batches: the JAX example of docs/FEED.md.

    python docs/examples/jax_loop.py --epochs 5 --run-dir runs/jax-loop --checkpoint ckpts/jax-loop.npz

``stoker.Feed(framework="jax")`` hands out each batch as a dict of jax arrays, put on the
device ``jax.devices()[model_gpu or 0]`` (or with the ``sharding=`` you give) while the
previous step runs. No process of the run imports TensorFlow.

The model is a small text-to-mel model (a convolutional text encoder, frames reading the
text where their place in the clip says, a masked L1 mel loss) in plain ``jax.numpy``,
with Adam written out; ``jax.jit`` compiles the step once per bucket shape of the plan
(``feed.shapes``). The checkpoint is one ``.npz`` file, read without pickle: the
parameters, Adam's moments and ``feed.state_dict()`` as a JSON string. Run the same command
again after a crash: the feed goes on where the checkpoint was taken.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import stoker

Params = dict[str, jax.Array]


def init_params(vocab_size: int, n_mels: int, dim: int = 64, seed: int = 0) -> Params:
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)

    def dense(key: jax.Array, *shape: int) -> jax.Array:
        return jax.random.normal(key, shape) / math.sqrt(math.prod(shape[:-1]))

    return {"embed": jax.random.normal(keys[0], (vocab_size, dim)), "conv": dense(keys[1], 5, dim, dim),
            "sharpness": jnp.asarray(3.0), "hidden": dense(keys[2], dim + 16, dim), "hidden_bias": jnp.zeros(dim),
            "out": dense(keys[3], dim, n_mels), "out_bias": jnp.zeros(n_mels)}


def predict(params: Params, tokens: jax.Array, token_lengths: jax.Array, frames: int,
            mel_lengths: jax.Array) -> jax.Array:
    """Tokens -> log-mel frames [B, T, F]: frame t of T reads the text near token l of L where
    t/T is near l/L, then a small decoder."""
    x = params["embed"][tokens]  # [B, L, D]
    x = x + jax.lax.conv_general_dilated(x, params["conv"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
    length = tokens.shape[1]
    token_place = jnp.arange(length)[None, :] / jnp.maximum(token_lengths, 1)[:, None]
    frame_place = jnp.arange(frames)[None, :] / jnp.maximum(mel_lengths, 1)[:, None]
    scores = -jnp.square(frame_place[:, :, None] - token_place[:, None, :]) * jnp.exp(params["sharpness"]) * length
    valid = jnp.arange(length)[None, :] < token_lengths[:, None]
    weights = jax.nn.softmax(jnp.where(valid[:, None, :], scores, -1e9), axis=-1)  # [B, T, L]
    angles = frame_place[..., None] * jnp.arange(1, 9) * jnp.pi
    h = jnp.concatenate([weights @ x, jnp.sin(angles), jnp.cos(angles)], axis=-1)
    h = jax.nn.relu(h @ params["hidden"] + params["hidden_bias"])
    return h @ params["out"] + params["out_bias"]


def loss_of(params: Params, batch: dict[str, jax.Array]) -> jax.Array:
    """The mean absolute mel error over the valid frames (padding left out)."""
    mel, mel_lengths = batch["mel"], batch["mel_lengths"]
    predicted = predict(params, batch["tokens"], batch["token_lengths"], mel.shape[1], mel_lengths)
    mask = (jnp.arange(mel.shape[1])[None, :] < mel_lengths[:, None])[..., None]
    return jnp.sum(jnp.abs(predicted - mel) * mask) / jnp.maximum(jnp.sum(mask) * mel.shape[2], 1)


def adam_init(params: Params) -> dict[str, Any]:
    zeros = {k: jnp.zeros_like(v) for k, v in params.items()}
    return {"m": zeros, "v": dict(zeros), "count": jnp.asarray(0)}


@jax.jit
def train_step(params: Params, opt: dict[str, Any], batch: dict[str, jax.Array],
               learning_rate: float = 3e-3) -> tuple[Params, dict[str, Any], jax.Array]:
    """One Adam step on ``batch``: the new parameters and moments, and the loss (compiled once
    per bucket shape)."""
    loss, grads = jax.value_and_grad(loss_of)(params, batch)
    count = opt["count"] + 1
    m = {k: 0.9 * opt["m"][k] + 0.1 * g for k, g in grads.items()}
    v = {k: 0.999 * opt["v"][k] + 0.001 * jnp.square(g) for k, g in grads.items()}
    scale = learning_rate * jnp.sqrt(1 - 0.999 ** count) / (1 - 0.9 ** count)
    params = {k: p - scale * m[k] / (jnp.sqrt(v[k]) + 1e-8) for k, p in params.items()}
    return params, {"m": m, "v": v, "count": count}, loss


eval_loss = jax.jit(loss_of)


def save_checkpoint(path: Path, params: Params, opt: dict[str, Any], feed: stoker.Feed) -> None:
    """Parameters, Adam's moments and the feed's position in one .npz, replaced whole."""
    arrays = {f"params/{k}": np.asarray(v) for k, v in params.items()}
    arrays.update({f"m/{k}": np.asarray(v) for k, v in opt["m"].items()})
    arrays.update({f"v/{k}": np.asarray(v) for k, v in opt["v"].items()})
    partial = path.with_name(path.name + ".partial.npz")
    np.savez(partial, **arrays, count=np.asarray(opt["count"]), feed=np.asarray(json.dumps(feed.state_dict())))
    os.replace(partial, path)


def load_checkpoint(path: Path) -> tuple[Params, dict[str, Any], dict[str, Any]]:
    with np.load(path, allow_pickle=False) as saved:
        part = {kind: {k.split("/", 1)[1]: jnp.asarray(saved[k]) for k in saved.files if k.startswith(kind + "/")}
                for kind in ("params", "m", "v")}
        opt = {"m": part["m"], "v": part["v"], "count": jnp.asarray(saved["count"])}
        return part["params"], opt, json.loads(str(saved["feed"]))


def train(options: dict[str, Any], checkpoint: Path | None, checkpoint_every: int) -> list[float]:
    """Train on the feed; the loss of every step."""
    feed = stoker.Feed(framework="jax", **options)
    params = init_params(feed.vocabulary.size, feed.n_mels)
    opt = adam_init(params)
    if checkpoint is not None and checkpoint.exists():
        params, opt, state = load_checkpoint(checkpoint)
        feed.load_state_dict(state)  # before the feed starts
        print(f"restored {checkpoint}: the feed goes on from step {state['step']}", flush=True)

    losses = []
    with feed:
        for batch in feed:
            params, opt, loss = train_step(params, opt, batch)
            feed.step_done(loss=loss)
            losses.append(float(loss))
            if feed.step % feed.batches_per_epoch == 0:  # an epoch's end: one pass over the held-out clips
                val = [float(eval_loss(params, b)) for b in feed.validation()]
                if val:
                    print(f"step {feed.step}: validation loss {sum(val) / len(val):.4f}", flush=True)
            if checkpoint is not None and feed.step % checkpoint_every == 0:
                save_checkpoint(checkpoint, params, opt, feed)
    return losses


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="dataset directory (default: stoker's demo data)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--checkpoint", type=Path, metavar="FILE", help="save (and restore) parameters, Adam and feed")
    parser.add_argument("--checkpoint-every", type=int, default=4, metavar="STEPS")
    parser.add_argument("--record-samples", action="store_true")
    args = parser.parse_args(argv)
    options = {"data": args.data, "epochs": args.epochs, "producers": args.producers, "batch_size": args.batch_size,
               "run_dir": args.run_dir, "record_samples": args.record_samples or None}
    losses = train(options, args.checkpoint, args.checkpoint_every)
    if losses:
        print(f"{len(losses)} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
