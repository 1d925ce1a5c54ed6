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
choice is a pure function of the sample ids and ``batching.seed`` (a hash order), so a
resumed run, or another host, holds out the same clips. The held-out ids are written to
``RUN_DIR/validation.json`` (:data:`VALIDATION`).

Their batches are made through the producers, as training batches are, at each
validation pass (consumer/pipeline/feed.py ``FeedCore.validation_pass``: ``feed.validation()`` of
``stoker.Feed``, and stoker's own trainer every ``trainer.val_every_steps``). They are
planned once (consumer/pipeline/plan.validation_batches: each clip in the smallest training bucket
shape that holds it, so a model traced for the training shapes traces nothing new) and,
at each pass, leased by the coordinator (consumer/pipeline/scheduler.py, "Validation passes") with
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
import hashlib
import heapq
import logging
from pathlib import Path
from typing import Sequence

from stoker.shared.config import Config
from stoker.shared.dataset import DatasetIndex, Sample, SampleTable, build_index
from stoker.shared.layouts import Rejection
from stoker.shared.runfiles import VALIDATION, write_json

log = logging.getLogger(__name__)

# Hold out at most this share of the clips, so that a tiny dataset keeps its training data.
MAX_VAL_SHARE = 0.1
# The feed's validation queue: one batch staged on the model device while the one before is
# evaluated; apart from the training queue, which stays full while the trainer validates.
VALIDATION_QUEUE_CAPACITY = 2
# The held-out clips of a run: {"source": "eval_file" | "hash", "file": ..., "ids": [...]}.


def hold_out(index: DatasetIndex, cfg: Config, run_dir: Path) -> tuple[Sequence[Sample], list[Sample],
                                                                     list[Rejection]]:
    """(training samples, validation samples, rejections of the eval file), recorded in the run directory."""
    rejected: list[Rejection] = []
    if cfg.data.eval_file:
        evaluation = build_index(dataclasses.replace(cfg.data, metadata_file=cfg.data.eval_file), cfg.features,
                                 cfg.text, index.vocabulary)
        held = list(evaluation.samples)  # a held-out file is small
        rejected = evaluation.rejected
        ids = {s.id for s in held}
        table = index.samples
        train = table.take([n for n, i in enumerate(table.ids()) if i not in ids])
        if len(train) != len(index.samples):
            log.warning("%d clips of %s are in %s too: they are validation clips only",
                        len(index.samples) - len(train), cfg.data.metadata_file, cfg.data.eval_file)
        source = {"source": "eval_file", "file": cfg.data.eval_file}
    else:
        train, held = split(index.samples, cfg.trainer.val_clips, cfg.batching.seed)
        source = {"source": "hash", "val_clips": cfg.trainer.val_clips, "seed": cfg.batching.seed}
    write_json(run_dir / VALIDATION, {**source, "ids": [s.id for s in held]})
    return train, held, rejected


def split(samples: Sequence[Sample], count: int, seed: int) -> tuple[Sequence[Sample], list[Sample]]:
    """(training samples, held-out samples): ``count`` clips, at most a tenth, by hash order.
    Of a SampleTable, the training samples are a view of it (no Sample made per clip)."""
    n = min(count, int(len(samples) * MAX_VAL_SHARE))
    if n <= 0:
        return samples if isinstance(samples, SampleTable) else list(samples), []
    ids = samples.ids() if isinstance(samples, SampleTable) else [s.id for s in samples]

    prefix, blake2b = f"{seed}|".encode(), hashlib.blake2b

    def rank(position: int) -> bytes:  # of "SEED|ID" in UTF-8
        return blake2b(prefix + ids[position].encode(), digest_size=8).digest()

    held = set(heapq.nsmallest(n, range(len(ids)), key=rank))
    if isinstance(samples, SampleTable):
        return (samples.take([p for p in range(len(ids)) if p not in held]),
                [samples[p] for p in sorted(held)])
    return [s for p, s in enumerate(samples) if p not in held], [s for p, s in enumerate(samples) if p in held]
