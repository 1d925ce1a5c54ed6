"""Held-out validation clips: which ones, and their batches.

Where ``data.eval_file`` names a second metadata file (``metadata_eval.csv`` beside
``metadata_train.csv``, the layout of the first users' own trainer), its clips are the
validation clips, indexed with the training set's vocabulary (a character the training
text never had rejects its clip, counted like any other). Otherwise
``trainer.val_clips`` clips (at most a tenth of the dataset, so a small dataset is not
emptied) are held out of every epoch plan when the trainer has a loss to validate. The
choice is a pure function of the sample ids and ``batching.seed`` (a hash order), so a
resumed run, or another host, holds out the same clips. The held-out ids are written to
``RUN_DIR/validation.json`` (:data:`VALIDATION`).

The consumer prepares their batches itself, once, at start, with the producers' own
code (``producer/batches.py``, ``BatchMaker``: same reader, features and collation) on the CPU,
so the validation loss is measured on exactly what training batches look like. Shapes
(dimension legend in shared/batch.py): B = up to ``batching.batch_size`` rows, L and
T the longest held-out clip rounded up to ``tokens_multiple`` / ``frames_multiple``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from stoker.consumer.plan import ReferenceTable, TokenTable, round_up
from stoker.producer.batches import BatchMaker
from stoker.shared.batch import FRAMES
from stoker.shared.config import Config, batch_schema
from stoker.shared.dataset import DatasetIndex, Sample, build_index
from stoker.shared.layouts import Rejection
from stoker.shared.runfiles import VALIDATION, write_json
from stoker.shared.vocab import Vocabulary

log = logging.getLogger(__name__)

# Hold out at most this share of the clips, so that a tiny dataset keeps its training data.
MAX_VAL_SHARE = 0.1
# The held-out clips of a run: {"source": "eval_file" | "hash", "file": ..., "ids": [...]}.


def hold_out(index: DatasetIndex, cfg: Config, run_dir: Path) -> tuple[list[Sample], list[Sample], list[Rejection]]:
    """(training samples, validation samples, rejections of the eval file), recorded in the run directory."""
    rejected: list[Rejection] = []
    if cfg.data.eval_file:
        evaluation = build_index(dataclasses.replace(cfg.data, metadata_file=cfg.data.eval_file), cfg.features,
                                 cfg.text, index.vocabulary)
        held = evaluation.samples
        rejected = evaluation.rejected
        ids = {s.id for s in held}
        train = [s for s in index.samples if s.id not in ids]
        if len(train) != len(index.samples):
            log.warning("%d clips of %s are in %s too: they are validation clips only",
                        len(index.samples) - len(train), cfg.data.metadata_file, cfg.data.eval_file)
        source = {"source": "eval_file", "file": cfg.data.eval_file}
    else:
        train, held = split(index.samples, cfg.trainer.val_clips, cfg.batching.seed)
        source = {"source": "hash", "val_clips": cfg.trainer.val_clips, "seed": cfg.batching.seed}
    write_json(run_dir / VALIDATION, {**source, "ids": [s.id for s in held]})
    return train, held, rejected


def split(samples: Sequence[Sample], count: int, seed: int) -> tuple[list[Sample], list[Sample]]:
    """(training samples, held-out samples): ``count`` clips, at most a tenth, by hash order."""
    n = min(count, int(len(samples) * MAX_VAL_SHARE))
    if n <= 0:
        return list(samples), []

    def rank(s: Sample) -> bytes:
        return hashlib.blake2b(f"{seed}|{s.id}".encode(), digest_size=8).digest()

    held = {s.id for s in sorted(samples, key=rank)[:n]}
    return [s for s in samples if s.id not in held], [s for s in samples if s.id in held]


def make_batches(samples: Sequence[Sample], root: Path, cfg: Config, vocabulary: Vocabulary,
                 mel_norm: tuple[np.ndarray, np.ndarray] | None = None) -> list[dict[str, np.ndarray]]:
    """The held-out clips as padded batches, made as the producers make them (transforms and
    mel normalisation included); clips that cannot be read here are left out (logged)."""
    if not samples:
        return []

    # The numpy backend (same definition as the TF one, within 1e-4): on the CPU, leaving the
    # model GPU to the trainer.
    features = dataclasses.replace(cfg.features, backend="numpy")
    b = cfg.batching
    schema = batch_schema(cfg)
    maker = BatchMaker(root, {s.id: s.text for s in samples}, features, None, "validation",
                       files={s.id: s.audio for s in samples if s.audio}, schema=schema, ref_frames=b.ref_frames,
                       transforms=cfg.transforms, mel_norm=mel_norm)
    tokens = TokenTable(samples, vocabulary)
    # References among the held-out clips themselves (the same ones at every validation).
    references = ReferenceTable(samples, b.seed) if "ref_mel" in schema.names else None
    batches = []
    for start in range(0, len(samples), b.batch_size):
        chunk = samples[start:start + b.batch_size]
        shape = (round_up(max(s.num_tokens for s in chunk), b.tokens_multiple),
                 round_up(max(s.num_frames for s in chunk), b.frames_multiple))
        ids = [s.id for s in chunk]
        lease = {"lease": 0, "epoch": -1, "index": start // b.batch_size, "ids": ids, "shape": shape, "rows": len(ids),
                 **tokens.lease_fields(ids), **({"refs": references(-1, ids)} if references is not None else {})}
        prepared = maker.make(lease)
        for problem in prepared.fields["rejected"] + prepared.fields["missed"]:
            log.warning("validation clip %s left out: %s", problem["id"], problem["reason"])
        if prepared.fields["ids"]:
            rows = len(prepared.fields["ids"])
            # Keep only the filled rows: B is the number of clips, the shape stays fixed per batch.
            batches.append({k: v[:rows].copy() for k, v in prepared.arrays.items()})
    return batches


def describe(batches: Sequence[dict[str, np.ndarray]]) -> str:
    clips = sum(len(b[FRAMES]) for b in batches)
    frames = sum(int(b[FRAMES].sum()) for b in batches)
    return f"{clips} held-out clips ({frames} frames) in {len(batches)} batch(es)"

