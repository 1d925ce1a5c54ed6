"""A Hugging Face tokenizer as stoker's text front-end, in a PyTorch loop on stoker.Feed.

    pip install tokenizers
    python docs/examples/hf_tokenizer.py --epochs 3 --run-dir runs/hf-tokenizer

A model with a tokenizer of its own keeps it: ``text.frontend`` names a factory of this file,
:func:`tokenizer`, which returns a ``tokenizers.Tokenizer`` loaded from its JSON file (a
codebase's ``tokenizer.json``; here a byte-pair tokenizer :func:`build` trains once on the
dataset's texts, with ``<pad>`` and ``</s>`` of its own, ``</s>`` appended to every text). The
batch's ``tokens`` are its own ``encode(text).ids``, nothing re-mapped; rows are padded with its
``<pad>`` id; ``feed.vocabulary.size`` is its vocabulary size, the model's embedding size.

The index tokenizes in this process and in helper processes of its own, which import this file
by its name (the feed passes the script's directory to them) and find the tokenizer's file in
the environment they inherit (``HF_TOKENIZER_FILE``). The tokenizer's serialised config is part
of the index cache key: another tokenizer tokenizes the index again.

The model, its loss and its step are docs/examples/torch_loop.py's; the ``clip`` batch field
names each row's clip, whose text ``feed.clips`` holds: the loop shows the last row's tokens.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import stoker
from torch_loop import TinyTTS, train_step

TOKENIZER_FILE_ENV = "HF_TOKENIZER_FILE"
FRONTEND = "hf_tokenizer:tokenizer"  # this file's factory, as text.frontend names it
PAD, EOS, UNK = "<pad>", "</s>", "<unk>"


def tokenizer() -> Any:
    """The factory ``text.frontend`` names: the tokenizer of the file ``HF_TOKENIZER_FILE`` names."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.environ[TOKENIZER_FILE_ENV])


def build(texts: Sequence[str], path: Path, vocab_size: int = 256) -> Any:
    """A byte-pair tokenizer trained on ``texts`` (<pad> id 0, </s> id 1, <unk> id 2; </s>
    appended to every text), saved at ``path``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    made = Tokenizer(models.BPE(unk_token=UNK))
    made.normalizer = normalizers.Lowercase()
    made.pre_tokenizer = pre_tokenizers.Whitespace()
    made.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, EOS, UNK],
                                                        show_progress=False))
    made.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, 1)])
    path.parent.mkdir(parents=True, exist_ok=True)
    made.save(str(path))
    return made


def metadata_texts(data: Path) -> list[str]:
    """The texts of an LJSpeech-style ``metadata.csv`` (``id|text|normalized_text``), as the index reads them."""
    with open(data / "metadata.csv", encoding="utf-8", newline="") as f:
        return [row[2] if len(row) > 2 and row[2] else row[1] for row in csv.reader(f, delimiter="|", quoting=csv.QUOTE_NONE)]


def train(data: Path, run_dir: Path, epochs: int, batch_size: int = 16, producers: int = 2,
          on_step: Callable[[stoker.Feed, dict[str, torch.Tensor], int], None] | None = None) -> list[float]:
    """Train on the feed with the tokenizer built from ``data``'s texts; the loss of every step
    (``on_step(feed, batch, epoch)`` is called inside each step, before the model's)."""
    path = run_dir.parent / f"{run_dir.name}-tokenizer.json"
    build(metadata_texts(data), path)
    os.environ[TOKENIZER_FILE_ENV] = str(path)  # the index's helper processes inherit it
    torch.manual_seed(0)
    feed = stoker.Feed(framework="torch", data=str(data), epochs=epochs, batch_size=batch_size, producers=producers,
                       run_dir=str(run_dir), set={"text.frontend": FRONTEND, "batching.fields": "clip"})
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    vocabulary = feed.vocabulary
    model = TinyTTS(vocabulary.size, feed.n_mels).to(device)  # the tokenizer's size, not stoker's
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses, last = [], -1
    with feed:
        for epoch, batches in feed.epochs():
            for batch in batches:
                if on_step is not None:
                    on_step(feed, batch, epoch)
                loss = train_step(model, optimizer, batch)
                feed.step_done(loss=loss)
                losses.append(float(loss))
                last = int(batch["clip"][0])
    if last >= 0:
        clip = feed.clips[last]
        print(f"clip {clip.id}: {clip.text!r} -> {tokenizer().encode(clip.text).tokens}", flush=True)
    return losses


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="dataset directory (default: stoker's demo data)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--run-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.data is None:
        from stoker.shared.dataset.files import DEMO_DATA_DIR

        args.data = Path(DEMO_DATA_DIR)
    losses = train(args.data, args.run_dir, args.epochs, args.batch_size, args.producers)
    if losses:
        print(f"{len(losses)} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
