"""Your own PyTorch training loop on stoker's batches: the PyTorch example of docs/FEED.md.

    python docs/examples/torch_loop.py --epochs 5 --run-dir runs/torch-loop --checkpoint ckpts/torch-loop.pt

``stoker.Feed(framework="torch")`` hands out each batch as a dict of torch tensors on the
model device: ``cuda:N`` (``model_gpu``, default 0) when CUDA is available, copied there
from page-locked shared memory on a side stream while the previous step runs, else the CPU. No
process of the run imports TensorFlow, so this runs where only PyTorch is installed.

The model is a small text-to-mel model of this file's own (a convolutional text encoder,
frames reading the text where their place in the clip says, a masked L1 mel loss); the
step, the optimizer and the checkpoints are this script's, as in a user's trainer.

The checkpoint is one ``torch.save`` file holding the model, the optimizer and
``feed.state_dict()`` (plain JSON values), read back with ``torch.load(weights_only=True)``.
Run the same command again after a crash, even a ``kill -9``: the feed goes on where the
checkpoint was taken, so every clip is still trained once per epoch.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

import stoker


class TinyTTS(nn.Module):
    """Tokens -> log-mel frames: each frame attends to the text around its relative place in
    the clip (frame t of T reads near token l of L where t/T is near l/L), then a small decoder."""

    def __init__(self, vocab_size: int, n_mels: int, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.encoder = nn.Sequential(nn.Conv1d(dim, dim, 5, padding=2), nn.ReLU(), nn.Conv1d(dim, dim, 5, padding=2))
        self.sharpness = nn.Parameter(torch.tensor(3.0))  # log of how narrowly a frame reads the text
        self.decoder = nn.Sequential(nn.Linear(dim + 16, dim), nn.ReLU(), nn.Linear(dim, n_mels))

    def forward(self, tokens: torch.Tensor, token_lengths: torch.Tensor, frames: int,
                mel_lengths: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens.long())  # [B, L, D]
        x = x + self.encoder(x.transpose(1, 2)).transpose(1, 2)
        token_place = torch.arange(tokens.shape[1], device=tokens.device)[None, :] / token_lengths.clamp(min=1)[:, None]
        frame_place = torch.arange(frames, device=tokens.device)[None, :] / mel_lengths.clamp(min=1)[:, None]
        distance = frame_place[:, :, None] - token_place[:, None, :]  # [B, T, L]
        scores = -distance.square() * self.sharpness.exp() * tokens.shape[1]
        valid = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < token_lengths[:, None]
        weights = scores.masked_fill(~valid[:, None, :], -1e9).softmax(dim=-1)
        angles = frame_place[..., None] * torch.arange(1, 9, device=tokens.device) * math.pi
        h = torch.cat([weights @ x, angles.sin(), angles.cos()], dim=-1)  # the text read, and where the frame is
        return self.decoder(h)  # [B, T, F]


def loss_of(model: TinyTTS, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean absolute mel error over the valid frames (padding left out)."""
    mel, mel_lengths = batch["mel"], batch["mel_lengths"]
    predicted = model(batch["tokens"], batch["token_lengths"], mel.shape[1], mel_lengths)
    mask = (torch.arange(mel.shape[1], device=mel.device)[None, :] < mel_lengths[:, None]).unsqueeze(-1)
    return ((predicted - mel).abs() * mask).sum() / (mask.sum() * mel.shape[2]).clamp(min=1)


def train_step(model: TinyTTS, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One optimizer step on ``batch``; the loss, on the device (fetched by the feed once per log interval)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = loss_of(model, batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


@torch.no_grad()
def validate(model: TinyTTS, feed: stoker.Feed) -> float | None:
    """The mean loss over one pass of the held-out clips (None: none held out)."""
    model.eval()
    losses = [float(loss_of(model, batch)) for batch in feed.validation()]
    return sum(losses) / len(losses) if losses else None


def save_checkpoint(path: Path, model: TinyTTS, optimizer: torch.optim.Optimizer, feed: stoker.Feed) -> None:
    """Model, optimizer and the feed's position in one file, replaced whole (a crash mid-write keeps the last)."""
    partial = path.with_name(path.name + ".partial")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "feed": feed.state_dict()}, partial)
    os.replace(partial, path)


def train(options: dict[str, Any], checkpoint: Path | None, checkpoint_every: int,
          learning_rate: float = 3e-3) -> list[float]:
    """Train on the feed; the loss of every step."""
    torch.manual_seed(0)
    feed = stoker.Feed(framework="torch", **options)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"  # where the feed puts the batches (model_gpu 0)
    model = TinyTTS(feed.vocabulary.size, feed.n_mels).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    if checkpoint is not None and checkpoint.exists():
        saved = torch.load(checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        feed.load_state_dict(saved["feed"])  # before the feed starts
        print(f"restored {checkpoint}: the feed goes on from step {saved['feed']['step']}", flush=True)

    losses = []
    with feed:
        for batch in feed:
            loss = train_step(model, optimizer, batch)
            feed.step_done(loss=loss)
            losses.append(float(loss))
            if feed.step % feed.batches_per_epoch == 0:  # an epoch's end: one pass over the held-out clips
                val = validate(model, feed)
                if val is not None:
                    print(f"step {feed.step}: validation loss {val:.4f}", flush=True)
            if checkpoint is not None and feed.step % checkpoint_every == 0:
                save_checkpoint(checkpoint, model, optimizer, feed)
    return losses


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="dataset directory (default: stoker's demo data)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--checkpoint", type=Path, metavar="FILE", help="save (and restore) model, optimizer and feed")
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
