"""Coqui TTS's Glow-TTS, from its own package, trained on stoker.Feed with its own loss and optimizer.

    pip install coqui-tts        # then, beside a CPU build of torch, see "Installing" below
    python docs/examples/coqui_glow_tts.py --epochs 2 --run-dir runs/glow-tts

The model (``TTS.tts.models.glow_tts.GlowTTS``), its criterion (``model.get_criterion()``,
``GlowTTSLoss``), its optimizer (RAdam with the config's parameters, built by the Coqui
trainer's ``get_optimizer``) and its training step (``model.train_step``, which also runs the
model's data-dependent initialisation over its first ``data_dep_init_steps`` batches) are
Coqui's; only the batches are stoker's. ``features.convention: coqui`` makes the producers'
log-mel the one Coqui's AudioProcessor computes (its STFT, dB scale, symmetric [-4, 4]
normalisation and silence trim), so the model sees the features it is built for; the batch's
fields are renamed to the names ``train_step`` reads (:func:`coqui_batch`). The model is a small
Glow-TTS (:func:`small_config`): enough to see the loss fall on the demo data on a CPU.

Installing: coqui-tts names no torch of its own (its ``cpu`` and ``cuda`` extras do), so it
installs beside the torch you have; but ``import TTS`` refuses to run unless the ``torchaudio``
and ``torchcodec`` distributions are present (for torch >= 2.9), and Glow-TTS's import chain
imports torchaudio (its speaker encoder). With a torchaudio built for your torch, that is all.
A CPU torch newer than the registry's torchaudio cannot load that torchaudio's compiled
extension; ``pip install --no-deps torchaudio torchcodec`` and removing the ``.so`` files of
torchaudio's ``lib`` folder leaves its pure-Python parts, which is all this model needs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import stoker


def small_config(num_chars: int) -> Any:
    """A Glow-TTS config of Coqui's own, made small (64 channels, 4 flow blocks) for a CPU."""
    from TTS.tts.configs.glow_tts_config import GlowTTSConfig

    return GlowTTSConfig(num_chars=num_chars, out_channels=80, hidden_channels_enc=64, hidden_channels_dec=64,
                         hidden_channels_dp=64, num_flow_blocks_dec=4, num_block_layers=2,
                         encoder_params={"kernel_size": 3, "dropout_p": 0.1, "num_layers": 2, "num_heads": 2,
                                         "hidden_channels_ffn": 128}, data_dep_init_steps=2)


def coqui_batch(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """stoker's batch under the names GlowTTS.train_step reads (one speaker: no speaker inputs)."""
    return {"text_input": batch["tokens"].long(), "text_lengths": batch["token_lengths"].long(),
            "mel_input": batch["mel"], "mel_lengths": batch["mel_lengths"].long(), "d_vectors": None,
            "speaker_ids": None}


def train(options: dict[str, Any], on_step: Callable[[dict[str, torch.Tensor], int], None] | None = None
          ) -> list[float]:
    """Train Glow-TTS on the feed; the loss of every step after the data-dependent initialisation
    (``on_step(batch, epoch)`` is called inside each step, before the model's)."""
    from TTS.tts.models.glow_tts import GlowTTS
    from trainer.trainer_utils import get_optimizer

    torch.manual_seed(0)
    sets = {"features.convention": "coqui", **options.pop("set", {})}
    feed = stoker.Feed(framework="torch", set=sets, **options)
    config = small_config(feed.vocabulary.size)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    model = GlowTTS(config).to(device)
    criterion = model.get_criterion()
    optimizer = get_optimizer(config.optimizer, config.optimizer_params, config.lr, model)
    losses: list[float] = []
    with feed:
        for epoch, batches in feed.epochs():
            for batch in batches:
                if on_step is not None:
                    on_step(batch, epoch)
                model.train()
                model.run_data_dep_init = feed.step < config.data_dep_init_steps  # as on_train_step_start sets it
                _, loss_dict = model.train_step(coqui_batch(batch), criterion)
                if loss_dict is None:  # a data-dependent initialisation step: nothing to optimise
                    feed.step_done()
                    continue
                optimizer.zero_grad(set_to_none=True)
                loss_dict["loss"].backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
                optimizer.step()
                loss = loss_dict["loss"].detach()
                feed.step_done(loss=loss)
                losses.append(float(loss))
    return losses


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="dataset directory (default: stoker's demo data)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--run-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    losses = train({"data": args.data, "epochs": args.epochs, "producers": args.producers,
                    "batch_size": args.batch_size, "run_dir": str(args.run_dir)})
    if losses:
        print(f"{len(losses)} optimizer steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
