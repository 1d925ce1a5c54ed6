"""Coqui TTS's Glow-TTS on stoker.Feed against Coqui's own data loader (``python -m stoker.benchmarks.coqui``).

The model, loss, optimizer and training step are Coqui's (docs/examples/coqui_glow_tts.py's
small Glow-TTS, without its data-dependent initialisation, so that every step is alike); the
clips are the demo data's, every one of them (none held out) each epoch, in batches of 16. Two
ways, in this process, their runs alternating over the repetitions:

    feed   stoker.Feed(framework="torch", producers=W), ``features.convention: coqui`` (the
           mel Coqui's AudioProcessor makes: its STFT, dB, normalisation and trim)
    coqui  the model's own ``get_data_loader`` (TTSDataset, its AudioProcessor and tokenizer,
           a torch DataLoader with ``num_loader_workers`` W), each batch through ``format_batch``

Per way: samples/s after the first batch, the share of that time spent waiting for a batch,
the time to the first batch, and the share of the mel frames of the batches that are a clip's
(the rest is padding, which the step computes too). Each step counts its clips; each epoch must
train every clip once (the feed's by the ``clip`` field, Coqui's by its batch's ``item_idxs``).

Needs coqui-tts and a torchaudio that loads beside this torch (docs/examples/coqui_glow_tts.py,
Installing); without them the command says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import stoker

from .common import report, spread, table
from ..shared.dataset.files import DEMO_DATA_DIR

BATCH_SIZE = 16
INSTALL = "needs coqui-tts and a torchaudio that loads beside this torch (docs/examples/coqui_glow_tts.py, Installing)"


@dataclass
class CoquiPlan:
    repetitions: int = 3
    epochs: int = 2
    workers: int = 2  # producers, and the DataLoader's workers

    @classmethod
    def quick(cls) -> "CoquiPlan":
        return cls(repetitions=1)


def _config(num_chars: int, workers: int) -> Any:
    from TTS.config.shared_configs import BaseDatasetConfig  # coqui-tts: optional (module docstring)
    from TTS.tts.configs.glow_tts_config import GlowTTSConfig  # coqui-tts: optional

    dataset = BaseDatasetConfig(formatter="ljspeech", path=str(DEMO_DATA_DIR), meta_file_train="metadata.csv")
    return GlowTTSConfig(num_chars=num_chars, out_channels=80, hidden_channels_enc=64, hidden_channels_dec=64,
                         hidden_channels_dp=64, num_flow_blocks_dec=4, num_block_layers=2,
                         encoder_params={"kernel_size": 3, "dropout_p": 0.1, "num_layers": 2, "num_heads": 2,
                                         "hidden_channels_ffn": 128}, data_dep_init_steps=0, batch_size=BATCH_SIZE,
                         num_loader_workers=workers, datasets=[dataset], use_phonemes=False)


class _Trainer:
    """Coqui's model, criterion and optimizer, seeded alike for each way."""

    def __init__(self, config: Any) -> None:
        import torch  # with coqui-tts only: the command without it imports no torch
        from TTS.tts.models.glow_tts import GlowTTS  # coqui-tts: optional (module docstring)
        from trainer.trainer_utils import get_optimizer  # coqui-tts's trainer: optional

        torch.manual_seed(0)
        self.config = config
        self.model = GlowTTS(config)
        self.criterion = self.model.get_criterion()
        self.optimizer = get_optimizer(config.optimizer, config.optimizer_params, config.lr, self.model)

    def step(self, batch: dict[str, Any]) -> None:
        import torch  # with coqui-tts only (as above)

        self.model.train()
        _, loss_dict = self.model.train_step(batch, self.criterion)
        self.optimizer.zero_grad(set_to_none=True)
        loss_dict["loss"].backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()


def _timed(epochs: Iterable[tuple[int, Iterable[dict[str, Any]]]], trainer: _Trainer, rows_of: Any,
           started: float) -> dict[str, Any]:
    """Train every batch of ``epochs``; the way's figures (module docstring)."""
    waited = useful = frames = samples = 0.0
    first_at, first_rows = None, 0
    per_epoch: dict[int, list[int]] = {}
    for epoch, batches in epochs:
        batches = iter(batches)
        while True:
            t0 = time.perf_counter()
            batch = next(batches, None)
            now = time.perf_counter()
            if batch is None:
                break
            if first_at is None:
                first_at = now
            else:
                waited += now - t0
            rows, mel_lengths, shape = rows_of(batch)
            first_rows = first_rows or len(rows)
            per_epoch.setdefault(epoch, []).extend(rows)
            useful, frames, samples = useful + sum(mel_lengths), frames + shape[0] * shape[1], samples + len(rows)
            trainer.step(batch["coqui"] if "coqui" in batch else batch)
            if "done" in batch:
                batch["done"]()
    assert first_at is not None, "no batch"
    wall = time.perf_counter() - first_at
    return {"samples_per_s": (samples - first_rows) / wall, "wait_frac": waited / wall, "first_batch_s": first_at - started,
            "frames_useful_frac": useful / frames, "per_epoch": {e: sorted(r) for e, r in per_epoch.items()}}


def _feed_way(plan: CoquiPlan, run_dir: Path) -> dict[str, Any]:
    started = time.perf_counter()
    feed = stoker.Feed(framework="torch", data=str(DEMO_DATA_DIR), producers=plan.workers, batch_size=BATCH_SIZE,
                       epochs=plan.epochs, run_dir=str(run_dir), log_level="WARNING",
                       set={"features.convention": "coqui", "trainer.val_clips": 0, "batching.fields": "clip"})
    trainer = _Trainer(_config(feed.vocabulary.size, plan.workers))

    def batches() -> Iterable[tuple[int, Iterable[dict[str, Any]]]]:
        for epoch, epoch_batches in feed.epochs():
            yield epoch, ({"coqui": _coqui_batch(b), "clip": b["clip"], "mel": b["mel"],
                           "mel_lengths": b["mel_lengths"], "done": feed.step_done} for b in epoch_batches)

    def rows_of(batch: dict[str, Any]) -> tuple[list[int], list[int], tuple[int, int]]:
        return batch["clip"].tolist(), batch["mel_lengths"].tolist(), tuple(batch["mel"].shape[:2])

    with feed:
        return _timed(batches(), trainer, rows_of, started)


def _coqui_batch(batch: dict[str, Any]) -> dict[str, Any]:
    return {"text_input": batch["tokens"].long(), "text_lengths": batch["token_lengths"].long(),
            "mel_input": batch["mel"], "mel_lengths": batch["mel_lengths"].long(), "d_vectors": None,
            "speaker_ids": None}


def _coqui_way(plan: CoquiPlan) -> dict[str, Any]:
    from TTS.tts.datasets import load_tts_samples  # coqui-tts: optional (module docstring)

    started = time.perf_counter()
    config = _config(0, plan.workers)
    samples, _ = load_tts_samples(config, eval_split=False)
    trainer = _Trainer(config)  # its tokenizer sets num_chars
    loader = trainer.model.get_data_loader(config, samples=samples, verbose=False)

    def batches() -> Iterable[tuple[int, Iterable[dict[str, Any]]]]:
        for epoch in range(plan.epochs):
            yield epoch, (trainer.model.format_batch(b) for b in loader)

    def rows_of(batch: dict[str, Any]) -> tuple[list[int], list[int], tuple[int, int]]:
        return list(batch["item_idx"]), batch["mel_lengths"].tolist(), tuple(batch["mel_input"].shape[:2])

    return _timed(batches(), trainer, rows_of, started)


def run(plan: CoquiPlan, log_fn: Any = None) -> dict[str, Any]:
    say = log_fn or (lambda text: None)
    figures: dict[str, list[dict[str, Any]]] = {"feed": [], "coqui": []}
    with tempfile.TemporaryDirectory(prefix="stoker-bench-coqui-") as scratch:
        for rep in range(plan.repetitions):
            for way in (("feed", "coqui") if rep % 2 == 0 else ("coqui", "feed")):
                got = _feed_way(plan, Path(scratch) / f"run-{rep}") if way == "feed" else _coqui_way(plan)
                clips = {e: len(r) for e, r in got.pop("per_epoch").items()}
                assert sorted(clips) == list(range(plan.epochs)) and set(clips.values()) == {64}, clips
                figures[way].append(got)
                say(f"{way}: {got['samples_per_s']:.1f} samples/s, wait {got['wait_frac']:.3f}, first batch "
                    f"{got['first_batch_s']:.2f} s, frames useful {got['frames_useful_frac']:.3f}")
    out: dict[str, Any] = {"workers": plan.workers, "epochs": plan.epochs, "batch_size": BATCH_SIZE, "ways": {}}
    for way, runs in figures.items():
        out["ways"][way] = {k: spread([r[k] for r in runs]) for k in runs[0]}
    feed, coqui = (statistics.median(r["samples_per_s"] for r in figures[w]) for w in ("feed", "coqui"))
    out["feed_over_coqui"] = feed / coqui
    return out


def render(result: dict[str, Any]) -> str:
    keys = ("samples_per_s", "wait_frac", "first_batch_s", "frames_useful_frac")
    rows = [[way, *(f"{w[k]['median']:.3f} [{w[k]['min']:.3f},{w[k]['max']:.3f}]" for k in keys)]
            for way, w in result["ways"].items()]
    return "\n".join([table(["way", *keys], rows),
                      f"  feed / Coqui's loader, samples/s: {result['feed_over_coqui']:.3f} "
                      f"(W = {result['workers']}, batch {result['batch_size']}, {result['epochs']} epochs a run)"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.coqui")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, default=CoquiPlan.workers)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    try:
        from TTS.tts.models.glow_tts import GlowTTS  # noqa: F401  # coqui-tts: optional, its absence one line
    except (ImportError, OSError) as exc:  # absent, or a torchaudio built for another torch
        print(f"{INSTALL}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", file=sys.stderr)
        return 2
    plan = CoquiPlan.quick() if args.quick else CoquiPlan()
    plan.workers = args.workers
    result = run(plan, log_fn=print)
    return report(render(result), result, args.out)


if __name__ == "__main__":
    sys.exit(main())
