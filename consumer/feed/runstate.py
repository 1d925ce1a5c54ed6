"""What an open run reads and keeps beside its steps: a feed's state (``state_dict``, ``resume=``),
the dataset's mel statistics (``transforms.mel_norm: dataset``, and those measured over an
epoch) and summary.json.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Mapping

import msgpack

from .checkpoint import same_plan
from ..plan import EpochPlanner
from ..position import InputPosition, PositionError
from ...shared.config import Config
from ...shared.dataset.cache import mel_stats_file
from ...shared.errors import UserError
from ...shared.melstats import MelStats, load
from ...shared.metrics import read_jsonl, summarize
from ...shared.runfiles import MEL_STATS, METRICS, RunFileError, write_json

log = logging.getLogger("consumer")

# The format of a feed's state_dict(); a newer one is refused, not guessed at. Format 1 held the
# input position as JSON values (its clips by id); still read.
FEED_STATE_FORMAT = 2
FEED_STATE_FORMATS_READ = (1, FEED_STATE_FORMAT)


class FileFailures:
    """The run's files that could not be written (a full disk, ...): the first ends the run, later
    ones only go to the log, and closing goes on; ``summary``: summary.json's, if it failed too."""

    def __init__(self) -> None:
        self.first: RunFileError | None = None
        self.summary: RunFileError | None = None

    def note(self, exc: RunFileError) -> bool:
        """Keep ``exc`` if it is the first (True); a later one (the same full disk) is logged."""
        if self.first is None:
            self.first = exc
            return True
        log.warning("%s", exc)
        return False

    def failure(self) -> UserError | None:
        """The one line of a run ended by a file it could not write (None if none): the file and
        the error, and whether summary.json could not be written either."""
        if self.first is None:
            return None
        either = f"; summary.json not written either ({self.summary.strerror})" if self.summary is not None else ""
        return UserError(f"{self.first}{either}")


class MelStatsMissing(UserError):
    """transforms.mel_norm=dataset without the dataset's statistics; one line for the user."""


class FeedStateError(UserError):
    """A feed state (``resume=``) that does not belong to this dataset and plan; one line."""


def feed_state(step: int, position: InputPosition, identity: Mapping[str, Any]) -> dict[str, Any]:
    """A feed's state_dict(): the input position with the plan's and dataset's identity, all plain
    JSON values (docs/FEED.md): the position's msgpack (raw bit arrays) as one base64 string."""
    packed = msgpack.packb(position.state_dict(), use_bin_type=True)
    return {"format": FEED_STATE_FORMAT, "step": step, "plan": identity["fingerprint"],
            "dataset_fingerprint": identity["dataset_fingerprint"],
            "batches_per_epoch": identity["batches_per_epoch"], "position": base64.b64encode(packed).decode("ascii")}


def position_of(state: Any, identity: Mapping[str, Any], planner: EpochPlanner) -> tuple[InputPosition, int]:
    """The input position and step of a feed's state_dict(); FeedStateError when it is not one,
    or belongs to another dataset or plan."""
    if not isinstance(state, dict) or "position" not in state or "plan" not in state:
        raise FeedStateError("resume= takes what feed.state_dict() returned (a dict with the input position); "
                             f"got {type(state).__name__}")
    if state.get("format") not in FEED_STATE_FORMATS_READ:
        raise FeedStateError(f"resume= state has format {state.get('format')!r}; this stoker reads "
                             f"formats {FEED_STATE_FORMATS_READ[0]} to {FEED_STATE_FORMAT}")
    if state.get("dataset_fingerprint") != identity["dataset_fingerprint"]:
        raise FeedStateError(f"resume= state belongs to another dataset (fingerprint "
                             f"{state.get('dataset_fingerprint')}, this one {identity['dataset_fingerprint']})")
    if not same_plan(state.get("plan"), identity, planner):
        raise FeedStateError("resume= state belongs to another epoch plan of this dataset (batch_size, "
                             "max_frames, num_buckets, seed or the features differ from the run that saved it)")
    saved = state["position"]
    try:
        if state["format"] == FEED_STATE_FORMAT:
            saved = msgpack.unpackb(base64.b64decode(saved, validate=True), raw=False)
    except (TypeError, ValueError) as exc:  # binascii.Error is a ValueError
        raise FeedStateError(f"resume= state: its position is not the base64 of a saved position ({exc})") from None
    try:
        position = InputPosition.from_state_dict(saved, planner)
    except PositionError as exc:
        raise FeedStateError(f"resume= state: {exc}") from None
    return position, int(state.get("step") or 0)


def dataset_mel_norm(cfg: Config, root: Path, key: str, run_dir: Path) -> dict[str, Any] | None:
    """transforms.mel_norm: dataset: the dataset's mel statistics for these settings (kept in
    the run directory for synth and export); MelStatsMissing (one line) when none were measured."""
    if cfg.transforms.mel_norm != "dataset":
        return None
    path = mel_stats_file(root, cfg.data, key)
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path is not None else None
        load(data or {}, cfg.features.n_mels)
    except (OSError, ValueError) as exc:
        raise MelStatsMissing(f"transforms.mel_norm=dataset needs the dataset's mel statistics for these "
                              f"features and transforms, and there are none ({path or 'data.index_cache is off'}: "
                              f"{getattr(exc, 'strerror', None) or exc}): run `python run.py precompute` with "
                              f"the same data, features and transforms first") from None
    write_json(run_dir / MEL_STATS, data)
    log.info("mel normalised with the dataset's statistics over %s frames (%s)", data.get("frames"), path)
    return data


def keep_mel_stats(stats: MelStats, cfg: Config, root: Path, key: str, run_dir: Path) -> None:
    """After a whole epoch: the mel statistics measured, in the run and beside the dataset's
    index cache, where transforms.mel_norm=dataset finds them."""
    data = stats.to_json(key)
    write_json(run_dir / MEL_STATS, data)
    path = mel_stats_file(root, cfg.data, key)
    if path is None:
        return
    try:
        write_json(path, data)
    except OSError as exc:
        log.warning("mel statistics not kept beside the dataset (%s: %s); they are in %s", path,
                    exc.strerror or exc, run_dir / MEL_STATS)
        return
    log.info("mel statistics over %d frames kept in %s", stats.frames, path)


def feature_cache_totals(directory: str, producers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """summary.json's ``feature_cache``: what the producers' caches did, summed (None: off)."""
    if not directory:
        return None
    totals: dict[str, Any] = {"dir": directory}
    for key in ("hits", "computed", "stale", "corrupt"):
        totals[key] = sum(int(p.get(f"cache_{key}", 0) or 0) for p in producers)
    return totals


def run_summary(core: Any, figures: Mapping[str, Any]) -> dict[str, Any]:
    """summary.json of an open run (consumer/feed/feed.FeedCore): the figures of metrics.jsonl and the
    coordinator, with the dataset, text, checkpoint and the training loop's ``figures`` beside them."""
    cfg, index, vocab, queue = core.cfg, core.index, core.vocabulary, core.queue
    snap = core.coordinator.snapshot()
    resumed = core.checkpoints.resumed
    return summarize(
        read_jsonl(core.run_dir / METRICS), capacity=cfg.pipeline.buffer_size,
        batches_per_epoch=core.planner.batches_per_epoch, producers=snap["producers"],
        rejected=core.rejections.count, exit_reason=core.exit_reason,
        wall_s=time.monotonic() - core.started, warmup_s=core.warmup_s, batch_size=cfg.batching.batch_size,
        host_cpu=core.host_cpu.figures(snap["producers"], socket.gethostname()),
        extra={"epochs_completed": core.epochs_completed, "model": cfg.trainer.model,
               "rejected_messages": snap["rejected_messages"], "reissued_leases": snap["reissued_leases"],
               "queue_high_water": queue.high_water, "stage_errors": queue.stage_errors,
               "host_cores": os.cpu_count(), "clips": len(index.samples), "val_clips": len(core.val_samples),
               "validation_passes": core.passes.count,
               "text": {"frontend": vocab.frontend, "vocab_size": vocab.size, "vocabulary": vocab.fingerprint,
                        "languages": list(vocab.languages), "speakers": len(vocab.speakers), "lost": index.lost},
               "index": index.stats.to_json(),
               "feature_cache": feature_cache_totals(core.prepared.feature_cache, snap["producers"]),
               "missed_samples": snap["missed_samples"], "refused_producers": snap["refused_producers"],
               "failovers": snap["failovers"], "dataset_fingerprint": index.dataset_fingerprint,
               "checkpoint": core.checkpoints.summary(),
               "resumed_from_step": resumed.step if resumed is not None else None,
               "replicas": core.planner.replicas * core.planner.workers,
               "workers": core.planner.workers, "worker": core.planner.worker,
               **figures})




__all__ = ["FEED_STATE_FORMAT", "FeedStateError", "MelStatsMissing", "dataset_mel_norm", "feature_cache_totals",
           "feed_state", "keep_mel_stats", "position_of", "run_summary"]
