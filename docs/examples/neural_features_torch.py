"""Neural features computed by the producers, in PyTorch: docs/examples/neural_features.py's
example with PyTorch encoders and a PyTorch training loop on stoker.Feed.

    python docs/examples/neural_features_torch.py --steps 100 --feature-cache runs/features

Two producer models (``transforms.models``), each a function returning an ``nn.Module`` whose
weights are made by this file, deterministically (a seeded generator), and saved to a file
(:func:`weights_file`; ``NEURAL_FEATURES_WEIGHTS`` names the directory, else the temporary
directory), so every process of a run, and every later run, loads the same weights:

- :func:`codec`: a convolutional encoder with a vector-quantised codebook, mel [B, T, F] ->
  ``codes`` [B, T/4]: frames are grouped by 4 (a convolution of kernel and stride 4), mixed
  by a convolution over neighbouring groups, projected and replaced by the index of the
  nearest of :data:`CODEBOOK` codebook vectors (what an XTTS-like GPT predicts);
- :func:`speaker`: a speaker encoder, reference mel [B, R, F] -> ``speaker_embedding``
  [B, 64]: per-frame features averaged over the valid frames, projected, unit length.

Each module's ``forward`` names its inputs (the batch fields it reads, by name) and returns a
dict of the fields ``transforms.model_fields`` declares. Both mask their input by its
lengths, so a clip's outputs do not depend on the padding after it (the producers cache them
per clip). A TorchScript module (``torch.jit.script(codec())``) or an exported program
(``torch.export.export``, its time dimension a ``Dim``) is taken as well. No process of the
run imports TensorFlow: the producers run the encoders with PyTorch on their data device,
and the loop below trains :class:`CodesTTS` on their codes and embeddings.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

N_MELS = 80
CODEBOOK = 64  # codebook vectors (the codes' vocabulary)
CODE_DIM = 16  # dimensions of a codebook vector
GROUP = 4  # mel frames per code
EMBEDDING = 64  # speaker embedding size
MODEL_FIELDS = f"codes:int32:T/{GROUP}:-1,speaker_embedding:float32:{EMBEDDING}:0"
MODELS = "neural_features_torch:codec,neural_features_torch:speaker"
SEED = 20240611


def weights_file(name: str) -> Path:
    root = Path(os.environ.get("NEURAL_FEATURES_WEIGHTS") or Path(tempfile.gettempdir()) / "stoker-neural-features")
    return root / f"{name}.torch.pt"


def _masked(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``x`` [B, T, ...] with its frames from each row's length on set to zero."""
    valid = torch.arange(x.shape[1], device=x.device)[None, :] < lengths[:, None]
    return x * valid[..., None].to(x.dtype)


class Codec(nn.Module):
    """mel, mel_lengths -> codes [B, T/4]: the index of each group's nearest codebook vector."""

    def __init__(self) -> None:
        super().__init__()
        self.frames_per_code = GROUP  # an attribute, not the global: TorchScript compiles it too
        self.group = nn.Conv1d(N_MELS, 64, GROUP, stride=GROUP)
        self.mix = nn.Conv1d(64, 64, 3, padding=1)
        self.project = nn.Linear(64, CODE_DIM)
        self.codebook = nn.Parameter(torch.empty(CODEBOOK, CODE_DIM))

    def forward(self, mel: torch.Tensor, mel_lengths: torch.Tensor) -> dict[str, torch.Tensor]:
        x = _masked(mel, mel_lengths)
        k = self.frames_per_code
        x = nn.functional.pad(x, (0, 0, 0, -x.shape[1] % k))  # whole groups: T/4 rounded up
        x = torch.relu(self.group(x.transpose(1, 2))).transpose(1, 2)
        x = _masked(x, (mel_lengths + k - 1) // k)
        x = torch.relu(self.mix(x.transpose(1, 2))).transpose(1, 2)
        z = self.project(x)
        distances = (z * z).sum(-1, keepdim=True) - 2.0 * z @ self.codebook.T + (self.codebook ** 2).sum(-1)
        return {"codes": distances.argmin(-1).to(torch.int32)}


class Speaker(nn.Module):
    """ref_mel, ref_mel_lengths -> speaker_embedding [B, 64], unit length."""

    def __init__(self) -> None:
        super().__init__()
        self.frame = nn.Linear(N_MELS, 96)
        self.project = nn.Linear(96, EMBEDDING)

    def forward(self, ref_mel: torch.Tensor, ref_mel_lengths: torch.Tensor) -> dict[str, torch.Tensor]:
        x = _masked(torch.relu(self.frame(ref_mel)), ref_mel_lengths)
        pooled = x.sum(1) / ref_mel_lengths.clamp(min=1)[:, None].to(x.dtype)
        return {"speaker_embedding": nn.functional.normalize(self.project(pooled), dim=-1)}


def _with_weights(model: nn.Module, name: str) -> nn.Module:
    """``model`` with its weights from :func:`weights_file`, written there first (seeded, and
    atomically: several processes may ask at once) when it does not exist yet."""
    path = weights_file(name)
    if not path.exists():
        generator = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.empty_like(p).uniform_(-0.2, 0.2, generator=generator))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(dir=path.parent, suffix=".torch.pt")
        os.close(fd)
        torch.save(model.state_dict(), scratch)
        os.replace(scratch, path)
    model.load_state_dict(torch.load(path, weights_only=True))
    return model.eval()


def codec() -> nn.Module:
    """Producer model: mel, mel_lengths -> codes [B, T/4]."""
    return _with_weights(Codec(), "codec")


def speaker() -> nn.Module:
    """Producer model: ref_mel, ref_mel_lengths -> speaker_embedding [B, 64]."""
    return _with_weights(Speaker(), "speaker")


class CodesTTS(nn.Module):
    """Text + speaker embedding -> codes (cross-entropy over each row's valid codes) and a coarse
    mel, at the code rate: the model trained on the producers' fields."""

    def __init__(self, vocab_size: int, n_mels: int, dim: int = 96) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.encoder = nn.ModuleList(nn.Conv1d(dim, dim, 5, padding=2) for _ in range(2))
        self.speaker = nn.Linear(EMBEDDING, dim)
        self.query = nn.Linear(32, dim)
        self.attention = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.logits = nn.Linear(dim, CODEBOOK)
        self.mel = nn.Linear(dim, n_mels * GROUP)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the codes' cross-entropy, the mel's masked L1)."""
        tokens, codes, mel = batch["tokens"].long(), batch["codes"].long(), batch["mel"]
        x = self.embed(tokens)
        for conv in self.encoder:
            x = x + torch.relu(conv(x.transpose(1, 2))).transpose(1, 2)
        steps = codes.shape[1]
        valid = (batch["mel_lengths"] + GROUP - 1) // GROUP
        place = torch.arange(steps, device=mel.device)[None, :] / valid.clamp(min=1)[:, None]
        angles = place[..., None] * torch.arange(1, 17, device=mel.device) * torch.pi
        q = self.query(torch.cat([angles.sin(), angles.cos()], -1)) + self.speaker(batch["speaker_embedding"])[:, None]
        padding = torch.arange(tokens.shape[1], device=mel.device)[None, :] >= batch["token_lengths"][:, None]
        h = q + self.attention(q, x, x, key_padding_mask=padding, need_weights=False)[0]
        code_mask = (torch.arange(steps, device=mel.device)[None, :] < valid[:, None]).float()
        ce = nn.functional.cross_entropy(self.logits(h).transpose(1, 2), codes.clamp(min=0), reduction="none")
        code_loss = (ce * code_mask).sum() / code_mask.sum().clamp(min=1)
        frames = mel.shape[1]
        predicted = self.mel(h).reshape(h.shape[0], steps * GROUP, -1)[:, :frames]
        mask = (torch.arange(frames, device=mel.device)[None, :] < batch["mel_lengths"][:, None])[..., None].float()
        mel_l1 = ((predicted - mel).abs() * mask).sum() / (mask.sum() * mel.shape[2]).clamp(min=1)
        return code_loss, mel_l1


def main(argv: list[str] | None = None) -> None:
    """Training on the producers' codes and speaker embeddings through stoker.Feed (PyTorch tensors)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--run-dir", default="")
    parser.add_argument("--data", default=None)
    parser.add_argument("--feature-cache", default="",
                        help="cache the mels and the models' outputs in this directory (or auto: beside the dataset)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the producers import this file by its name
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                             os.environ.get("PYTHONPATH")]))
    import stoker

    feed = stoker.Feed(data=args.data, steps=args.steps, run_dir=args.run_dir or None, producers=2, framework="torch",
                       producer_models=MODELS,
                       set={"transforms.model_fields": MODEL_FIELDS, "batching.fields": "ref_mel",
                            "data.feature_cache": args.feature_cache})
    device = "cuda:0" if torch.cuda.is_available() else "cpu"  # where the feed puts the batches (model_gpu 0)
    with feed:
        model = CodesTTS(feed.vocabulary.size, feed.n_mels).to(device)
        optimizer = torch.optim.Adam(model.parameters(), 2e-3)
        for step, batch in enumerate(feed, start=1):
            optimizer.zero_grad(set_to_none=True)
            code_loss, mel_l1 = model(batch)
            loss = code_loss + mel_l1
            loss.backward()
            optimizer.step()
            feed.step_done(loss=loss.detach())
            if step % 20 == 0:
                print(f"step {step}: codes cross-entropy {float(code_loss.detach()):.3f}, mel L1 "
                      f"{float(mel_l1.detach()):.3f}", flush=True)


if __name__ == "__main__":
    main()
