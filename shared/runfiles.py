"""The files of a run directory, each named once, and the one way a file is written whole.

Every name in ``RUN_DIR`` is a constant here (the README states them as a contract);
:func:`write_atomic` and :func:`replacing` write beside the target and rename over it, and
:class:`RunFileError` is a run file that cannot be written. What each file holds:
docs/design/service.md, "The run directory".
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from .errors import UserError

CONFIG = "config.yaml"
RESUME_CONFIG = "config.resume.yaml"
SUMMARY = "summary.json"
# summary.json "trained_by" of a run whose steps were the user's own loop on stoker.Feed
# (absent for stoker's trainer): diagnose then gives the cure as the feed's option.
TRAINED_BY_FEED = "stoker.Feed"
METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"
# With --record-samples: {"step", "epoch", "rows"}, each row what identifies the clip the step trained.
TRAINED = "trained.jsonl"
REJECTED = "rejected.jsonl"
LIVE = "live.json"
GPU = "gpu.jsonl"
VALIDATION = "validation.json"
# With --record-samples: {"pass", "step", "ids"} of every validation batch (stoker.Feed's passes).
VALIDATION_SAMPLES = "validation.jsonl"
VOCAB = "vocab.json"
MEL_STATS = "mel_stats.json"
TB_DIR = "tb"
CKPT_DIR = "ckpt"
HANDOVER_DIR = "slurm"
HANDOVER_FILE = "endpoint.json"  # in HANDOVER_DIR
HANDOVER_KEYS = "keys"  # in HANDOVER_DIR
RUN_LOCK = "run.lock"
# A torchrun rank's, with pipeline.producers_per host: where its trainer listens (stoker/hostpool.py).
LISTENING = "listening.json"


# The files a run writes in RUN_DIR itself; those of a run that trained no step are removed before
# another starts there (:func:`clear_untrained`).
RUN_FILES = (CONFIG, RESUME_CONFIG, SUMMARY, METRICS, SAMPLES, TRAINED, REJECTED, LIVE, GPU, VALIDATION,
             VALIDATION_SAMPLES, VOCAB, MEL_STATS, LISTENING)


def trained_nothing(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` trained no step: metrics.jsonl holds no row (a state or checkpoint
    taken at a step writes the rows up to it first), summary.json counts none and ckpt/ holds nothing
    (a start that failed, or a run stopped before its first step)."""
    try:
        with open(run_dir / METRICS, encoding="utf-8") as f:
            if f.readline().strip():
                return False
    except FileNotFoundError:
        pass
    try:
        if json.loads((run_dir / SUMMARY).read_text(encoding="utf-8")).get("steps"):
            return False
    except FileNotFoundError:
        pass
    except (ValueError, AttributeError):
        return False  # not a summary stoker wrote whole: the directory is not taken as empty
    checkpoints = run_dir / CKPT_DIR
    return not (checkpoints.is_dir() and any(checkpoints.iterdir()))


def clear_untrained(run_dir: Path) -> list[str]:
    """Remove the files of a run that trained nothing (:func:`trained_nothing`) from ``run_dir``:
    :data:`RUN_FILES`, tb/ and the empty ckpt/; files of other names stay. The names removed."""
    removed = []
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_file():
            path.unlink()
            removed.append(name)
    for name in (TB_DIR, CKPT_DIR):
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
            removed.append(name)
    return removed


# The errors of a run's own file that its owner must fix (free space, a quota, permissions, a
# failing disk): the run ends with one line naming the file (RunFileError), not a traceback.
FILE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO, errno.EFBIG)


class RunFileError(UserError, OSError):
    """A run's own file could not be written: disk full, a quota, permissions, an I/O error.
    ``str()`` is the one line naming the file and the error; also an OSError (``errno``,
    ``filename``), so handlers of OSError keep working."""

    def __init__(self, path: str | os.PathLike[str], code: int, detail: str = "") -> None:
        super().__init__(code, os.strerror(code) if code else detail, str(path))
        self.detail = detail

    def __str__(self) -> str:
        name = errno.errorcode.get(self.errno or 0, "")
        return f"cannot write {self.filename}: {self.strerror}" + (f" ({name})" if name else "")


def file_error(exc: BaseException, path: str | os.PathLike[str]) -> RunFileError | None:
    """``exc`` as the RunFileError of ``path`` when it is one of FILE_ERRNOS: an OSError, or an
    error of a library that reports one in words (TensorFlow's checkpoint writer); else None."""
    if isinstance(exc, RunFileError):
        return exc
    if isinstance(exc, OSError):
        return RunFileError(exc.filename or path, exc.errno) if exc.errno in FILE_ERRNOS else None
    text = str(exc)
    for code in FILE_ERRNOS:
        if os.strerror(code) in text:
            return RunFileError(path, code, text)
    return None


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str], *, durable: bool = False) -> Iterator[Path]:
    """A temporary path in ``path``'s directory for the caller to write, renamed over ``path``
    when the block ends (removed instead when it raises). ``durable``: fsync the file before
    the rename (what a crash must not lose: checkpoints and the logs they cut back). A full
    disk, a quota or permissions: RunFileError naming ``path`` (the old file, if any, is left)."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise file_error(exc, target) or exc from None
    os.close(fd)
    try:
        yield Path(tmp)
        if durable:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        error = file_error(exc, target)
        if error is not None and error is not exc:
            raise error from None
        raise


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, durable: bool = False) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` whole (:func:`replacing`)."""
    with replacing(path, durable=durable) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def write_json(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 2, durable: bool = False) -> None:
    """``obj`` as JSON (UTF-8, non-ASCII kept), written whole (:func:`write_atomic`)."""
    separators = None if indent is not None else (",", ":")
    write_atomic(path, json.dumps(obj, indent=indent, ensure_ascii=False, separators=separators) + "\n",
                 durable=durable)
