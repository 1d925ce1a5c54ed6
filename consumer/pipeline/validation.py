"""Held-out validation clips: which ones, and their batches.

Who holds clips out: stoker's trainer when it has a loss to validate, and ``stoker.Feed``
always, so that with the defaults (``trainer.val_clips: 4``) a feed holds 4 clips out;
``trainer.val_clips: 0`` and no ``data.eval_file`` hold none out.

Where ``data.eval_file`` names a second metadata file (``metadata_eval.csv`` beside
``metadata_train.csv``, the layout of the first users' own trainer), its clips are the
validation clips, indexed with the training set's vocabulary (a character the training
text never had rejects its clip, counted like any other). Otherwise
``trainer.val_clips`` clips (at most a tenth of the dataset, so a small dataset is not
emptied) are held out of every epoch plan when the trainer has a loss to validate. The
choice is a pure function of the sample ids and ``batching.seed`` (a hash order, computed
over the index's columns in C), so another host holds out the same clips. The held-out ids
are written to ``RUN_DIR/validation.json`` (:data:`VALIDATION`), and a resumed run holds out
the ones recorded there (with the same settings), whichever stoker version chose them.

Their batches are made through the producers, as training batches are, at each
validation pass (consumer/pipeline/feed.py ``FeedCore.validation_pass``: ``feed.validation()`` of
``stoker.Feed``, and stoker's own trainer every ``trainer.val_every_steps``). They are
planned once (consumer/pipeline/plan.validation_batches: each clip in the smallest training bucket
shape that holds it, so a model traced for the training shapes traces nothing new) and,
at each pass, leased by the coordinator (docs/DESIGN.md, "Validation passes") with
lease slots and credits of their own, into a queue of their own of
:data:`VALIDATION_QUEUE_CAPACITY` batches (a feed stages them onto the model device like
training batches). Every held-out clip is in exactly one batch per pass, also when a
producer dies mid-pass; a pass is no training step: the step count, the input position,
metrics.jsonl and samples.jsonl stay as they are (with ``--record-samples`` each
validation batch's ids go to ``validation.jsonl``).

So the validation loss is measured on exactly what training batches look like: the same
reader, transforms, features, mel normalisation and collation, on the data device, with
the clips of ``data.eval_file`` named in their leases (no producer indexes that file).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ...shared.config import Config
from ...shared.dataset import DatasetIndex, Sample, SampleTable, build_index
from ...shared.dataset.files import beside
from ...shared.layouts import Rejection
from ...shared.runfiles import VALIDATION, write_json

log = logging.getLogger(__name__)

# Hold out at most this share of the clips, so that a tiny dataset keeps its training data.
MAX_VAL_SHARE = 0.1
# The feed's validation queue: one batch staged on the model device while the one before is
# evaluated; apart from the training queue, which stays full while the trainer validates.
VALIDATION_QUEUE_CAPACITY = 2
# The held-out clips of a run: {"source": "eval_file" | "hash", "file": ..., "ids": [...]}.


def hold_out(index: DatasetIndex, cfg: Config, run_dir: Path, resume: bool = False) -> tuple[
        Sequence[Sample], list[Sample], list[Rejection]]:
    """(training samples, validation samples, rejections of the eval file), recorded in the run
    directory; ``resume``: the clips it recorded are held out again (:func:`recorded`)."""
    rejected: list[Rejection] = []
    table = index.samples
    if cfg.data.eval_file:
        # beside the training metadata, also where data.path is a manifest's or a metadata file's URL
        evaluation = build_index(dataclasses.replace(cfg.data, path=beside(cfg.data.path, cfg.data.eval_file),
                                                     metadata_file=cfg.data.eval_file),
                                 cfg.features, cfg.text, index.vocabulary)
        held = list(evaluation.samples)  # a held-out file is small
        rejected = evaluation.rejected
        rows = [row for row in table.find_rows([s.id for s in held]) if row >= 0] if held else []
        train = _without(table, rows)
        if rows:
            log.warning("%d clips of %s are in %s too: they are validation clips only",
                        len(rows), cfg.data.metadata_file, cfg.data.eval_file)
        source = {"source": "eval_file", "file": cfg.data.eval_file}
    else:
        source = {"source": "hash", "val_clips": cfg.trainer.val_clips, "seed": cfg.batching.seed}
        rows = recorded(table, run_dir, source) if resume else None
        if rows is None:
            train, held = split(table, cfg.trainer.val_clips, cfg.batching.seed)
        else:
            train, held = _without(table, rows), [table[r] for r in rows]
    write_json(run_dir / VALIDATION, {**source, "ids": [s.id for s in held]})
    return train, held, rejected


def recorded(table: SampleTable, run_dir: Path, source: dict[str, Any]) -> list[int] | None:
    """The rows of the clips a run recorded as held out by hash with the same settings (so that a
    run resumed by another version of stoker holds out the same ones); None when it recorded
    none, or other settings, or a clip the dataset lacks now."""
    try:
        saved = json.loads((run_dir / VALIDATION).read_text(encoding="utf-8"))
        ids = [str(i) for i in saved["ids"]] if all(saved.get(k) == v for k, v in source.items()) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    rows = table.find_rows(ids) if ids else []
    return None if ids is None or min(rows, default=0) < 0 else sorted(rows)


def _without(table: SampleTable, rows: Sequence[int]) -> SampleTable:
    """A view of the table without clips ``rows`` (the table itself when there are none)."""
    if not len(rows):
        return table
    keep = np.ones(len(table), bool)
    keep[np.asarray(rows, np.int64)] = False
    return table.take(np.flatnonzero(keep))


# MurmurHash3's 64-bit finalizer: FNV-1a's last multiply leaves ids that differ in their last
# character with nearly the same high bits, so the smallest hashes would be neighbours
# (c0001, c0002, ...); mixed, they are spread over the dataset.
MIX_SHIFT = 33
MIX_MULTIPLIERS = (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)


def _mixed(hashes: np.ndarray) -> np.ndarray:
    out = hashes ^ (hashes >> np.uint64(MIX_SHIFT))
    for multiplier in MIX_MULTIPLIERS:
        out = out * np.uint64(multiplier)
        out ^= out >> np.uint64(MIX_SHIFT)
    return out


def split(samples: Sequence[Sample], count: int, seed: int) -> tuple[Sequence[Sample], list[Sample]]:
    """(training samples, held-out samples): ``count`` clips, at most a tenth, the ones of the
    smallest 64-bit FNV-1a of ``"SEED|ID"``, mixed (ties by id). Of a SampleTable, the training samples
    are a view of it (no Sample made per clip)."""
    n = min(count, int(len(samples) * MAX_VAL_SHARE))
    if n <= 0:
        return samples if isinstance(samples, SampleTable) else list(samples), []
    table = samples if isinstance(samples, SampleTable) else SampleTable.from_samples(samples)
    rank = _mixed(table.hashes("id", f"{seed}|".encode()))
    bound = np.partition(rank, n - 1)[n - 1]
    near = np.flatnonzero(rank <= bound)  # the n smallest, and any tied with the n-th
    held = sorted(row for *_, row in sorted(zip(rank[near].tolist(), table.strings("id", near.tolist()),
                                                near.tolist()))[:n])
    if isinstance(samples, SampleTable):
        return _without(samples, held), [samples[p] for p in held]
    chosen = set(held)
    return [s for p, s in enumerate(samples) if p not in chosen], [samples[p] for p in held]
