"""Held-out validation clips: which ones, recorded where a resume finds them again.

:func:`hold_out` takes ``data.eval_file``'s clips, or ``trainer.val_clips`` clips in a hash
order of the ids and the seed, out of the training set, and records them in
``RUN_DIR/validation.json``; the producers make their batches at each validation pass. Who
holds clips out, and the passes: docs/design/scheduling.md, "Validation passes".
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ...shared.config import Config
from ..index.index import build_index
from ..index.indexed import DatasetIndex
from ...shared.dataset.table import SampleTable
from ...shared.dataset.types import Sample
from ...shared.dataset.corpus.registry import beside
from ...shared.dataset.layouts import Rejection
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
