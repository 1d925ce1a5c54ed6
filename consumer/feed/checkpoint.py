"""Checkpoints and resume: model, optimizer, step and the input position, in ``RUN_DIR/ckpt/``.

A checkpoint is a directory ``ckpt-NNNNNN`` (position.json, the input position's bit arrays in
position.msgpack, the TensorFlow state of the trainer's trackables, MANIFEST.json), made whole in a temporary directory and renamed into
place; a resume checks it against its manifest and its plan identity before anything changes
(:class:`CheckpointError`). The files, the trainer interface and the resume rules:
docs/design/checkpoints.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import msgpack
import numpy as np
import xxhash

from ..plan import EpochPlanner, id_digest
from ..position import InputPosition, PositionError
from ...shared import runfiles
from ...shared.runfiles import CKPT_DIR, VOCAB
from ...shared.config import Config
from ...shared.errors import UserError
from ...shared.vocab import Vocabulary

log = logging.getLogger(__name__)

FORMAT = 2  # of position.json and MANIFEST.json; a newer one is refused, not guessed at
# Format 1 held the whole input position in position.json (its clips by id); still read.
FORMATS_READ = (1, FORMAT)
MANIFEST = "MANIFEST.json"
POSITION = "position.json"
# The input position (InputPosition.state_dict: bit arrays as raw bytes), msgpack; position.json's
# ``position`` sums it up (the epochs complete, those open) for readers of the JSON alone.
POSITION_STATE = "position.msgpack"
STATE_PREFIX = "state"  # tf.train.Checkpoint files: state.index, state.data-*
_NAME = re.compile(r"^ckpt-(\d+)$")
_TMP_PREFIX = ".tmp-"
# Files are hashed in chunks of this size (model files can be large).
HASH_CHUNK = 1 << 20
# The run files a resume cuts back to the checkpoint's step, so they describe what the
# model trained (rows after the checkpoint were trained by a model state now lost).
STEP_LOGS = (runfiles.METRICS, runfiles.SAMPLES, runfiles.TRAINED)
# Trainers whose checkpoints hold no model state, so one may resume another.
STATELESS_MODEL = "synthetic:"
# A refused resume names this many of the clips that changed in each way (and counts them all).
CHANGED_CLIPS_SHOWN = 5


class CheckpointError(UserError):
    """A checkpoint cannot be used (missing, corrupt, or for another plan or model); one line."""


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:06d}"


# A plan of more clips than this is identified by its digest alone, its clip lists left out of
# the checkpoints (a resume it refuses then names no changed clip): at millions of clips the
# lists would make every checkpoint a write of hundreds of MB.
PLAN_CLIPS_LISTED = 200_000


# The plan's digest of the form before (:func:`legacy_fingerprint`) reads the ids of this many
# clips at a time (a few tens of MB of bytes).
DIGEST_CLIPS = 1 << 20


# What starts a plan fingerprint of :func:`plan_identity`'s form: one without it is of the form
# before (the buckets' ids joined), still matched (:func:`same_plan`).
FINGERPRINT_PREFIX = "p2:"


def plan_identity(planner: EpochPlanner, dataset_fingerprint: str) -> dict[str, Any]:
    """What makes two runs' epoch plans equal: batching config and the buckets' shapes and clips.
    The clips as rows of the index, with the digest of the index's id column made when the index
    was built (:func:`~.plan.id_digest`): no id is read here, so at 10^8 clips it costs the rows'
    hashing (xxh3), not a join of every id."""
    digest = xxhash.xxh3_128()
    cfg = planner.cfg
    listed = planner.samples_per_epoch <= PLAN_CLIPS_LISTED
    workers = [planner.workers, planner.worker] if planner.workers > 1 else []  # a worker's share is its own plan
    digest.update(json.dumps([cfg.batch_size, cfg.seed, *workers], separators=(",", ":")).encode())
    digest.update(id_digest(planner.table))
    for bucket in planner.buckets:
        digest.update(json.dumps([bucket.index, bucket.rows, bucket.max_tokens, bucket.max_frames,
                                  len(bucket.members)]).encode())
        digest.update(np.ascontiguousarray(planner.table.stored_rows(bucket.members), np.int64))
    return {"fingerprint": FINGERPRINT_PREFIX + digest.hexdigest(), "dataset_fingerprint": dataset_fingerprint,
            "batching": dataclasses.asdict(cfg), "batches_per_epoch": planner.batches_per_epoch,
            "samples_per_epoch": planner.samples_per_epoch,
            # each bucket's shape and clips: what a refused resume names the changed clips from
            # (the clips only up to PLAN_CLIPS_LISTED: each checkpoint stores them)
            "buckets": [[*bucket.shape, list(bucket.sample_ids) if listed else None] for bucket in planner.buckets]}


def legacy_fingerprint(planner: EpochPlanner) -> str:
    """The plan fingerprint of the form before :data:`FINGERPRINT_PREFIX` (SHA-256 over the buckets'
    ids joined), as checkpoints and feed states written before it hold it: made only to match one."""
    digest = hashlib.sha256()
    cfg = planner.cfg
    workers = [planner.workers, planner.worker] if planner.workers > 1 else []
    digest.update(json.dumps([cfg.batch_size, cfg.seed, *workers], separators=(",", ":")).encode())
    for bucket in planner.buckets:
        digest.update(f"\n{bucket.index}\t{bucket.rows}\t{bucket.max_tokens}\t{bucket.max_frames}\t".encode())
        for first in range(0, len(bucket.members), DIGEST_CLIPS):  # "\t".join of its ids, in pieces
            if first:
                digest.update(b"\t")
            digest.update(planner.table.joined("id", bucket.members[first:first + DIGEST_CLIPS], b"\t"))
    return digest.hexdigest()


def same_plan(saved: Any, identity: dict[str, Any], planner: EpochPlanner) -> bool:
    """Whether a saved plan fingerprint is this plan's: of this form, or of the form before."""
    if not isinstance(saved, str):
        return False
    if saved.startswith(FINGERPRINT_PREFIX):
        return saved == identity["fingerprint"]
    return saved == legacy_fingerprint(planner)


def _plan_difference(saved: dict[str, Any], now: dict[str, Any]) -> str:
    changed = [f"batching.{k} {saved['batching'].get(k)!r} then, {v!r} now"
               for k, v in now["batching"].items() if saved.get("batching", {}).get(k) != v]
    if saved.get("dataset_fingerprint") != now["dataset_fingerprint"]:
        changed.append(f"dataset fingerprint {saved.get('dataset_fingerprint')} then, "
                       f"{now['dataset_fingerprint']} now")
    clips = _changed_clips(saved.get("buckets"), now["buckets"])
    if clips:
        changed.append(clips)
    if not changed:
        changed.append("the usable clips or their lengths changed (data.* or features.* settings, or the files)")
    return "; ".join(changed)


def _changed_clips(saved: Any, now: list[list[Any]]) -> str:
    """Which clips of the plan changed: added, removed, or in another bucket (their length
    changed), a few of each by name with the counts; or the buckets' shapes. "" when the
    checkpoint or this plan does not list its clips (one written before it did, or a plan of more
    than PLAN_CLIPS_LISTED) or none changed."""
    try:
        then = {str(i): b for b, (*_, ids) in enumerate(saved) for i in ids}
        then_shapes = [tuple(bucket[:3]) for bucket in saved]
        current = {i: b for b, (*_, ids) in enumerate(now) for i in ids}
    except (TypeError, ValueError):
        return ""
    parts = []
    moved = sorted(i for i in then.keys() & current.keys() if then[i] != current[i])
    for what, ids in (("added", sorted(current.keys() - then.keys())), ("removed", sorted(then.keys() - current.keys())),
                      ("in another bucket", moved)):
        if ids:
            shown = ", ".join(ids[:CHANGED_CLIPS_SHOWN]) + (", ..." if len(ids) > CHANGED_CLIPS_SHOWN else "")
            parts.append(f"{len(ids)} {what} ({shown})")
    if parts:
        return f"the dataset's clips changed: {'; '.join(parts)}"
    shapes = [tuple(bucket[:3]) for bucket in now]
    if shapes != then_shapes:
        return f"the buckets' shapes (B, L, T) changed: {then_shapes} then, {shapes} now"
    return ""


# --------------------------------------------------------------------------- files
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def trim_step_log(path: Path, max_step: int) -> dict[str, Any] | None:
    """Keep the rows of a per-step jsonl file up to ``max_step`` (atomically: temporary file,
    rename); a torn last line goes too. Return the last row kept (None: none, or no file)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return None
    kept, last = [], None
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= max_step:
            kept.append(line)
            last = row
    if len(kept) != len(lines):
        runfiles.write_atomic(path, "".join(line + "\n" for line in kept), durable=True)
        log.info("%s: dropped %d rows after the checkpoint's step %d", path.name, len(lines) - len(kept), max_step)
    return last


class Checkpointer:
    """Checkpoint directories under one ``ckpt/``: atomic save, keep the last K, verified load."""

    def __init__(self, directory: Path, keep: int) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.directory = directory
        self.keep = keep

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first."""
        found = []
        try:
            entries = list(self.directory.iterdir())
        except FileNotFoundError:
            return []
        for path in entries:
            match = _NAME.match(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1][1] if found else None

    def save(self, step: int, position: dict[str, Any], tf_checkpoint: Any = None,
             state: dict[str, Any] | None = None) -> Path:
        """Write checkpoint ``step`` (``position`` -> position.json; ``state``, the input position's
        state_dict, -> position.msgpack, summed up in position.json's ``position``;
        ``tf_checkpoint``, a tf.train.Checkpoint, -> state.*), atomically; then keep only the
        newest ``keep``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in self.directory.glob(_TMP_PREFIX + "*"):  # from a save a crash cut short
            shutil.rmtree(leftover, ignore_errors=True)
        name = checkpoint_name(step)
        tmp = self.directory / f"{_TMP_PREFIX}{name}-{os.getpid()}"
        try:
            tmp.mkdir()
            if state is not None:
                (tmp / POSITION_STATE).write_bytes(msgpack.packb(state, use_bin_type=True))  # fsynced below
                position = {**position, "position": {"complete_below": state["complete_below"],
                                                     "complete": state["complete"],
                                                     "open": [entry["epoch"] for entry in state["open"]],
                                                     "file": POSITION_STATE}}
            runfiles.write_json(tmp / POSITION, {"format": FORMAT, "step": step, **position}, indent=None, durable=True)
            if tf_checkpoint is not None:
                tf_checkpoint.write(str(tmp / STATE_PREFIX))
            files = {}
            for path in sorted(tmp.iterdir()):
                _fsync_file(path)
                files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
            runfiles.write_json(tmp / MANIFEST, {"format": FORMAT, "step": step, "files": files}, indent=None,
                                durable=True)
            final = self.directory / name
            if final.exists():  # a resumed run passing a step saved by a run it superseded
                shutil.rmtree(final)
            tmp.rename(final)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            error = runfiles.file_error(exc, self.directory / name)
            if error is not None:  # a full disk: one line naming the checkpoint (not its parts), the last one kept
                raise runfiles.RunFileError(self.directory / name, error.errno or 0, error.detail) from None
            raise
        _fsync_file(self.directory)
        for _, old in self.checkpoints()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    @staticmethod
    def verify(path: Path) -> dict[str, Any]:
        """Check every file against the manifest; return position.json's content."""
        def corrupt(reason: str) -> CheckpointError:
            return CheckpointError(f"checkpoint {path} is corrupt ({reason}); nothing was changed. Move it away to "
                                   "resume from the one before, if any")

        try:
            manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
            files = manifest["files"]
            version = manifest["format"]
        except FileNotFoundError:
            raise corrupt(f"{MANIFEST} is missing") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise corrupt(f"{MANIFEST} unreadable: {exc}") from None
        if version not in FORMATS_READ:
            raise CheckpointError(f"checkpoint {path} has format {version!r}; this stoker reads formats "
                                  f"{FORMATS_READ[0]} to {FORMAT}")
        if not isinstance(files, dict) or POSITION not in files:
            raise corrupt(f"{MANIFEST} lists no {POSITION}")
        for name, expected in sorted(files.items()):
            file = path / name
            try:
                size = file.stat().st_size
            except FileNotFoundError:
                raise corrupt(f"{name} is missing") from None
            if not isinstance(expected, dict) or size != expected.get("bytes"):
                raise corrupt(f"{name} has {size} bytes, the manifest says {expected.get('bytes')}")
            if _sha256(file) != expected.get("sha256"):
                raise corrupt(f"{name}: checksum mismatch")
        try:
            position = json.loads((path / POSITION).read_text(encoding="utf-8"))
        except ValueError as exc:
            raise corrupt(f"{POSITION}: {exc}") from None
        if not isinstance(position, dict) or not isinstance(position.get("step"), int):
            raise corrupt(f"{POSITION} has no step")
        if POSITION_STATE in files:
            try:
                position["position"] = msgpack.unpackb((path / POSITION_STATE).read_bytes(), raw=False)
            except ValueError as exc:
                raise corrupt(f"{POSITION_STATE}: {exc}") from None
        return position


# --------------------------------------------------------------------------- the run's hooks
class Checkpointed(Protocol):
    """A trainer as its checkpoints see it (the trainers of consumer/training/trainer.py are
    ones): its name, whether it runs TensorFlow, and what a checkpoint must hold to continue it
    exactly, name -> trackable (None: nothing beyond the step and input position)."""

    name: str
    uses_tensorflow: bool

    def trackables(self) -> dict[str, Any] | None: ...


def _trackables_of(trainer: Checkpointed) -> dict[str, Any] | None:
    trackables = trainer.trackables()
    if trackables is not None and "step" in trackables:
        raise ValueError("a trainer's trackables must not be named 'step' (the checkpoint's own step)")
    return dict(trackables) if trackables else None


@dataclass
class Resumed:
    """What a resumed run continues from."""

    path: Path
    step: int
    position: InputPosition
    state: list[str]  # names of the trackables saved with it
    last_t: float = 0.0  # "t" of the last metrics row kept


class RunCheckpoints:
    """The consumer's checkpointing: the loop calls :meth:`record_step` after each step and
    :meth:`save` (through TrainLoop.save_checkpoint); :meth:`resume` runs before training."""

    def __init__(self, run_dir: Path, cfg: Config, planner: EpochPlanner, dataset_fingerprint: str,
                 vocabulary: Vocabulary | None = None, peers: Sequence[Path] = ()) -> None:
        """``peers``: the run directories of the other trainer workers of a multi-host job; a
        resume takes the newest checkpoint step that every worker has."""
        self.run_dir = run_dir
        self.peers = list(peers)
        self.vocabulary = vocabulary  # saved in every checkpoint; a resume must bring the same one
        self.cfg = cfg
        self.checkpointer = Checkpointer(run_dir / CKPT_DIR, cfg.trainer.keep_checkpoints)
        self.every = cfg.trainer.checkpoint_every_steps
        self.identity = plan_identity(planner, dataset_fingerprint)
        self.planner = planner
        self.position = InputPosition(planner)
        self.resumed: Resumed | None = None
        self.saved = 0
        self.last_step: int | None = None
        self.save_ms_max = 0.0
        self._attached = False
        self._trackables: dict[str, Any] | None = None
        self._tf_checkpoint: Any = None
        self._step_var: Any = None

    # ------------------------------------------------------------ resume (before training)
    def resume(self, fresh_plan: bool = False) -> Resumed:
        """Load and check the latest checkpoint; cut the step logs back to it.

        Raises CheckpointError (before changing anything) when there is none, it is
        corrupt, or it belongs to another epoch plan or model. ``fresh_plan``
        (``--resume RUN_DIR --fresh-plan``): an epoch plan of another dataset is taken, not
        refused; the model, optimizer and step count go on and the epochs start anew.
        """
        path = self._common_latest() if self.peers else self.checkpointer.latest()
        if path is None:
            raise CheckpointError(f"no checkpoint in {self.checkpointer.directory}: nothing to resume")
        saved = Checkpointer.verify(path)
        if saved.get("format") not in FORMATS_READ:
            raise CheckpointError(f"checkpoint {path} has format {saved.get('format')!r}; this stoker reads "
                                  f"formats {FORMATS_READ[0]} to {FORMAT}")
        plan = saved.get("plan") or {}
        same = same_plan(plan.get("fingerprint"), self.identity, self.planner)
        if not same and not fresh_plan:
            run_dir = self.run_dir.parent if self.peers else self.run_dir  # a job's workers: its directory
            raise CheckpointError(f"cannot resume from {path}: this run's epoch plan differs from the "
                                  f"checkpoint's ({_plan_difference(plan, self.identity)}). To go on training its "
                                  f"model on the data as it is now: --resume {run_dir} "
                                  f"--fresh-plan (keeps the weights, the optimizer and the step count; the epochs "
                                  f"start anew); or start a new run")
        model, now = saved.get("model"), self.cfg.trainer.model
        if model != now and not (str(model).startswith(STATELESS_MODEL) and now.startswith(STATELESS_MODEL)):
            raise CheckpointError(f"cannot resume from {path}: it holds the state of --model {model}, not {now}")
        if self.vocabulary is not None and "vocabulary" in saved:
            try:
                theirs = Vocabulary.from_state_dict(saved["vocabulary"])
            except ValueError as exc:
                raise CheckpointError(f"checkpoint {path}: {exc}") from None
            if theirs.fingerprint != self.vocabulary.fingerprint:
                raise CheckpointError(f"cannot resume from {path}: its vocabulary ({theirs.frontend}, {theirs.size} "
                                      f"ids, {theirs.fingerprint}) is not the run's {VOCAB} "
                                      f"({self.vocabulary.frontend}, {self.vocabulary.size} ids, "
                                      f"{self.vocabulary.fingerprint})")
        if fresh_plan:
            position = InputPosition(self.planner)  # nothing of the new plan is trained yet
            log.info("--fresh-plan: keeping %s and the step count (%d) of %s; a new epoch plan over the dataset as "
                     "it is now (%d clips, %d batches per epoch) starts at epoch 0%s", ", ".join(
                         saved.get("state") or ["no model state (the trainer has none)"]), saved["step"], path,
                     self.planner.samples_per_epoch, self.planner.batches_per_epoch,
                     "" if not same else " (the plan had not changed: its epochs are trained again from the start)")
        else:
            try:
                position = InputPosition.from_state_dict(saved.get("position"), self.planner)
            except PositionError as exc:
                raise CheckpointError(f"checkpoint {path}: {exc}") from None
        resumed = Resumed(path, saved["step"], position, list(saved.get("state") or []))
        for name in STEP_LOGS:
            last = trim_step_log(self.run_dir / name, resumed.step)
            if name == STEP_LOGS[0] and last is not None:
                resumed.last_t = float(last.get("t", 0.0))
        self.position = position
        self.resumed = resumed
        self.last_step = resumed.step
        log.info("resuming from %s: step %d, epochs complete below %d, %d open epochs", path, resumed.step,
                 position.first_open(), len(position.trained_counts()))
        return resumed

    def _common_latest(self) -> Path | None:
        """The newest checkpoint whose step every worker has: workers step together, so a
        worker killed while saving leaves the others one checkpoint ahead of it, and all
        must go on from the same step. A peer whose directory this host cannot see (no
        shared filesystem) is left out, with a warning."""
        mine = dict(self.checkpointer.checkpoints())
        steps = set(mine)
        for peer in self.peers:
            directory = peer / CKPT_DIR
            if not directory.is_dir():
                log.warning("cannot see %s from this host; resuming from this worker's checkpoints alone (put the "
                            "run directory on a filesystem every worker shares)", directory)
                continue
            steps &= {step for step, _ in Checkpointer(directory, self.checkpointer.keep).checkpoints()}
        if mine and not steps:
            raise CheckpointError(f"no checkpoint step is common to every worker's ckpt/ (this worker has "
                                  f"{sorted(mine)}): the workers cannot go on from the same step")
        return mine[max(steps)] if steps else None

    # ------------------------------------------------------------ training
    def attach(self, trainer: Checkpointed) -> None:
        """Take the trainer's trackables; restore them when resuming."""
        self._trackables = _trackables_of(trainer)
        self._attached = True
        saved_state = self.resumed.state if self.resumed is not None else None
        if self._trackables is None:
            if trainer.uses_tensorflow:
                log.warning("trainer %s exposes no trackables: checkpoints hold the step and input position, "
                            "not the model", trainer.name)
            if saved_state:
                raise CheckpointError(f"checkpoint {self.resumed.path} holds {saved_state} but trainer "
                                      f"{trainer.name} exposes no trackables to restore")
            return
        import tensorflow as tf

        self._step_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self._tf_checkpoint = tf.train.Checkpoint(**self._trackables, step=self._step_var)
        if self.resumed is None:
            return
        if sorted(saved_state or []) != sorted(self._trackables):
            raise CheckpointError(f"checkpoint {self.resumed.path} holds {saved_state}, the trainer exposes "
                                  f"{sorted(self._trackables)}")
        self._tf_checkpoint.read(str(self.resumed.path / STATE_PREFIX))
        if int(self._step_var.numpy()) != self.resumed.step:
            raise CheckpointError(f"checkpoint {self.resumed.path}: its model state is of step "
                                  f"{int(self._step_var.numpy())}, its position of step {self.resumed.step}")
        log.info("restored %s from %s", ", ".join(sorted(self._trackables)), self.resumed.path)

    def due(self, step: int) -> bool:
        """Whether a periodic checkpoint is due after ``step`` (trainer.checkpoint_every_steps)."""
        return self.every > 0 and step % self.every == 0

    def save(self, step: int) -> Path | None:
        """Checkpoint ``step`` now (skipped at step 0, when already saved, or before the
        trainer is attached: a model state that is not there cannot be saved)."""
        if step == 0 or step == self.last_step or not self._attached:
            return None
        began = time.monotonic()
        if self._step_var is not None:
            self._step_var.assign(step)
        path = self.checkpointer.save(step, {
            "saved_unix": round(time.time(), 3), "model": self.cfg.trainer.model, "plan": self.identity,
            "state": sorted(self._trackables or {}),
            **({"vocabulary": self.vocabulary.state_dict()} if self.vocabulary is not None else {})},
            self._tf_checkpoint, state=self.position.state_dict())
        elapsed_ms = (time.monotonic() - began) * 1e3
        self.saved += 1
        self.last_step = step
        self.save_ms_max = max(self.save_ms_max, elapsed_ms)
        log.info("checkpoint at step %d saved in %.0f ms: %s", step, elapsed_ms, path)
        return path

    def summary(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "saved": self.saved, "save_ms_max": round(self.save_ms_max, 3),
                "dir": str(self.checkpointer.directory), "every_steps": self.every}
