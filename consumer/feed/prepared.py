"""A run directory's dataset indexed and its epochs planned, before any socket opens.

:class:`PreparedRun` indexes the dataset, saves its vocabulary, holds out the validation
clips, plans the epochs and finds the checkpoints: the model is built from it (its vocabulary
size is known), and :class:`~.feed.FeedCore` opens it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from . import validation
from .checkpoint import RunCheckpoints
from ..message_size import check_message_size
from ..plan import EpochPlanner, PlannedBatch, validation_batches
from ..planfiles import PLANS_DIR, PlanFiles
from ...shared import config as config_mod
from ...shared.cluster import Cluster, from_env, worker_dir_name
from ...shared.dataset.cache import feature_cache_dir
from ..index.index import build_index
from ..index.indexed import DatasetIndex
from ...shared.dataset.types import Sample
from ...shared.runfiles import VOCAB
from ...shared.vocab import Vocabulary, load_vocabulary, save_vocabulary

log = logging.getLogger("consumer")


class PreparedRun:
    """A run directory's dataset indexed and its epochs planned: what exists before any socket
    opens, from which the model can be built (its vocabulary size is known). Its constructor
    makes it whole; UserError (one line) for a dataset to fix. :class:`FeedCore` opens it.

    ``resume``: continue from the run directory's checkpoint (stoker's trainer), keeping its
    vocabulary; ``fresh_plan``: with ``resume``, its model and step count on a new epoch plan;
    ``hold_out``: keep validation clips out of the plan (a trainer with a loss to validate)."""

    def __init__(self, cfg: config_mod.Config, run_dir: Path, *, resume: bool = False, hold_out: bool = False,
                 fresh_plan: bool = False) -> None:
        self.run_dir = run_dir
        self.resume = resume
        self.fresh_plan = fresh_plan
        # Trainer workers of a multi-host job (TF_CONFIG, torchrun): this one trains its share of every step's batch.
        cluster: Cluster | None = from_env(os.environ)
        # Replicas and workers split every batch into equal parts: its rows are fixed (row_mask on).
        cfg = config_mod.with_fixed_rows(cfg, cluster.size if cluster is not None else 1)
        index, self.vocabulary, feature_cache = self._index(cfg)
        self.index, self.feature_cache = index, feature_cache
        if feature_cache != cfg.data.feature_cache:
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, feature_cache=feature_cache))
        self.cfg = cfg
        self.val_samples: list[Sample] = []
        if hold_out:
            train, self.val_samples, self.eval_rejected = validation.hold_out(index, cfg, run_dir, resume)
        else:
            train, self.eval_rejected = index.samples, []
        self.train_samples = train
        # Each held-out clip's position in the run's clip list (ClipList): its index row, else (a clip of
        # data.eval_file the index lacks) one past the index's clips, in the held-out order.
        found = index.samples.find_rows([s.id for s in self.val_samples]) if self.val_samples else []
        extra = iter(range(len(index.samples), len(index.samples) + found.count(-1)))
        self.val_positions: list[int] = [row if row >= 0 else next(extra) for row in found]
        workers, worker = (cluster.size, cluster.index) if cluster is not None else (1, 0)
        # The buckets and epoch plans in files beside the index cache: one of each for the host's processes.
        files = PlanFiles(Path(index.stats.cache_file).resolve().parent / PLANS_DIR) if index.stats.cache_file else None
        self.planner = planner = EpochPlanner(train, cfg.batching, cfg.devices.replicas or 1, workers, worker,
                                              files=files)
        # the held-out clips' batches (consumer/plan.validation_batches)
        self.val_batches: list[PlannedBatch] = validation_batches(self.val_samples, planner)
        check_message_size(cfg, [*planner.shapes, *((b.rows, *b.shape) for b in self.val_batches)])
        log.info("dataset %s: %d clips usable, %d rejected; %d batches per epoch in %d shapes (B, L, T) %s%s",
                 index.root, len(index.samples), len(index.rejected), planner.batches_per_epoch,
                 len(planner.shapes), planner.shapes,
                 f" (frame budget {cfg.batching.max_frames})" if cfg.batching.max_frames else "")
        agreed = index.agreement
        log.info("dataset fingerprint %s (metadata %s, audio index %s; %d audio files missing here)",
                 index.dataset_fingerprint, agreed["metadata"], agreed["audio"], agreed["missing"])
        peers = [run_dir.parent / worker_dir_name(i) for i in range(workers) if i != worker]  # none alone
        self.checkpoints = RunCheckpoints(run_dir, cfg, planner, index.dataset_fingerprint, self.vocabulary, peers)

    def _index(self, cfg: config_mod.Config) -> tuple[DatasetIndex, Vocabulary, str]:
        """The dataset's index, its vocabulary (saved in the run) and the feature cache directory."""
        # A resumed run keeps its vocabulary: texts it cannot encode are rejected, not re-numbered.
        fixed = load_vocabulary(self.run_dir / VOCAB) if self.resume else None
        index = build_index(cfg.data, cfg.features, cfg.text, fixed)
        vocab = index.vocabulary
        assert vocab is not None
        save_vocabulary(vocab, self.run_dir / VOCAB)
        log.info("text front-end %s: %d token ids, languages %s, %d speaker(s); vocabulary %s in %s",
                 vocab.frontend, vocab.size, ", ".join(vocab.languages), len(vocab.speakers), vocab.fingerprint,
                 self.run_dir / VOCAB)
        feature_cache = feature_cache_dir(cfg.data.feature_cache, index.root)
        if feature_cache:
            log.info("feature cache %s", feature_cache)
        return index, vocab, feature_cache


__all__ = ["PreparedRun"]
