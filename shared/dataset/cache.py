"""The index cache: where it lives, its key, and its file format (a checksummed msgpack
payload); the feature cache's directory.
"""

from __future__ import annotations

import array
import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import msgpack

from ..config import DataConfig, FeaturesConfig, TextConfig
from ..dataset.types import AudioFile, Sample
from ..layouts import Rejection
from ..runfiles import write_atomic
from ..text import Frontend
from ..vocab import Vocabulary

log = logging.getLogger(__name__)


# Bump when the cache layout or any rule that derives the index from its inputs changes.
INDEX_FORMAT = 6


# Cache files start with this magic, then the SHA-256 of the msgpack payload that follows.
INDEX_CACHE_MAGIC = b"STKIDX02"


# "" in data.index_cache: the dataset's own hidden directory, else the user cache dir.
DATASET_CACHE_DIR = ".stoker"


INDEX_CACHE_OFF = "off"


FEATURE_CACHE_AUTO = "auto"


def index_config(data: DataConfig, features: FeaturesConfig, text: TextConfig, frontend: Frontend,
                 vocabulary: Vocabulary | None = None) -> dict[str, Any]:
    """Everything the index depends on besides the files: part of the cache key."""
    return {
        "format": INDEX_FORMAT, "frontend": frontend.name, "engine": frontend.cache_key(),
        "language": text.language,
        "max_lost_frac": text.max_lost_frac, "vocabulary": vocabulary.fingerprint if vocabulary else "",
        "columns": data.columns, "metadata_file": data.metadata_file, "min_audio_s": data.min_audio_s,
        "max_audio_s": data.max_audio_s,
        "max_tokens": data.max_tokens, "sample_rate_hz": features.sample_rate_hz, "n_fft": features.n_fft,
        "hop_length": features.hop_length, "padding": features.padding,
    }


def index_key(metadata: bytes, audio: dict[str, AudioFile], config: dict[str, Any]) -> str:
    """SHA-256 over the metadata bytes, every audio file's name, size and mtime, and the config."""
    digest = hashlib.sha256()
    digest.update(repr(sorted(config.items())).encode())
    digest.update(hashlib.sha256(metadata).digest())
    files = [audio[stem] for stem in sorted(audio)]
    digest.update("\0".join([f.name for f in files]).encode("utf-8", "surrogateescape"))
    digest.update(array.array("q", [f.size for f in files]).tobytes())
    digest.update(array.array("q", [f.mtime_ns for f in files]).tobytes())
    return digest.hexdigest()


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/stoker`` or ``~/.cache/stoker``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "stoker"


def _name_hash(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogateescape")).hexdigest()[:16]


def index_cache_file(root: Path, data: DataConfig) -> list[Path]:
    """Where the index cache may live, in order of preference (empty: caching is off).

    ``data.index_cache``: "" tries ``DATASET/.stoker/`` first and falls back to the user
    cache dir (a read-only dataset); "off" disables the cache; a directory is used as
    given. Outside the dataset, the file name includes a hash of the dataset path.
    """
    setting = data.index_cache.strip()
    if setting.lower() == INDEX_CACHE_OFF:
        return []
    meta_tag = _name_hash(data.metadata_file)
    outside = f"index-{_name_hash(str(root), data.metadata_file)}.msgpack"
    if setting:
        return [Path(setting).expanduser() / outside]
    return [root / DATASET_CACHE_DIR / f"index-{meta_tag}.msgpack", user_cache_dir() / "index" / outside]


def mel_stats_file(root: Path, data: DataConfig, key: str) -> Path | None:
    """Where the mel statistics of a dataset under the settings ``key`` (a hash) are kept,
    beside the index cache (None: caching is off)."""
    candidates = index_cache_file(root, data)
    return candidates[0].with_name(f"mel-stats-{key}.json") if candidates else None


def feature_cache_dir(setting: str, root: Path) -> str:
    """The directory ``data.feature_cache`` names, absolute: "" (off), "auto", or a path.

    "auto" is ``DATASET/.stoker/features`` when the dataset directory is writable, else
    ``~/.cache/stoker/features`` (logged).
    """
    setting = setting.strip()
    if not setting:
        return ""
    if setting.lower() != FEATURE_CACHE_AUTO:
        return str(Path(setting).expanduser().resolve())
    inside = root / DATASET_CACHE_DIR / "features"
    try:
        inside.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=inside)
        os.close(fd)
        os.unlink(probe)
        return str(inside)
    except OSError as exc:
        fallback = user_cache_dir() / "features"
        log.info("cannot write the feature cache in %s (%s); using %s", inside, exc.strerror or exc, fallback)
        return str(fallback)


def pack_payload(payload: dict[str, Any]) -> bytes:
    body = msgpack.packb(payload, use_bin_type=True)
    return INDEX_CACHE_MAGIC + hashlib.sha256(body).digest() + body


def unpack_payload(blob: bytes) -> dict[str, Any]:
    """The payload of a cache file; ValueError if it is not one or fails its checksum."""
    head = len(INDEX_CACHE_MAGIC)
    if len(blob) < head + 32 or blob[:head] != INDEX_CACHE_MAGIC:
        raise ValueError("not an index cache file of this version")
    body = blob[head + 32:]
    if hashlib.sha256(body).digest() != blob[head:head + 32]:
        raise ValueError("checksum mismatch")
    try:
        payload = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types for bad data
        raise ValueError(f"bad payload ({type(exc).__name__})") from None
    if not isinstance(payload, dict) or payload.get("format") != INDEX_FORMAT:
        raise ValueError("unknown payload format")
    return payload


def read_cache(candidates: list[Path], key: str) -> tuple[Path | None, dict[str, Any] | None, str]:
    """The cache file for ``key`` if one exists: (path, payload, state).

    state: "hit" (a candidate holds this key), "stale" (the payload returned is an older
    index, reusable in part), "corrupt" (a candidate failed its checksum and nothing
    else was usable) or "miss" (no cache file at all).
    """
    reusable: tuple[Path, dict[str, Any]] | None = None
    corrupt = False
    for path in candidates:
        try:
            blob = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            log.warning("cannot read index cache %s (%s); ignoring it", path, exc.strerror)
            continue
        try:
            payload = unpack_payload(blob)
        except ValueError as exc:
            log.warning("index cache %s is corrupt (%s); rebuilding the index", path, exc)
            corrupt = True
            continue
        if payload.get("key") == key:
            return path, payload, "hit"
        if reusable is None:
            reusable = (path, payload)
    if reusable is not None:
        return reusable[0], reusable[1], "stale"
    return None, None, "corrupt" if corrupt else "miss"


def write_cache(candidates: list[Path], blob: bytes) -> Path | None:
    """Write to the first candidate that accepts it; log a fall-back; never raise."""
    for n, path in enumerate(candidates):
        try:
            write_atomic(path, blob)
        except OSError as exc:
            nxt = candidates[n + 1] if n + 1 < len(candidates) else None
            if nxt is not None:
                log.info("cannot write the index cache in %s (%s); using %s", path.parent,
                         exc.strerror or exc, nxt.parent)
            else:
                log.warning("cannot write the index cache %s (%s); the next run indexes again", path,
                            exc.strerror or exc)
            continue
        return path
    return None


def columns_of(rows: Iterable[Any], names: Sequence[str]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {n: [] for n in names}
    for row in rows:
        for n in names:
            out[n].append(getattr(row, n))
    return out


SAMPLE_FIELDS = ("id", "text", "num_tokens", "num_frames", "duration_s", "audio", "line", "language", "speaker",
                  "units")


REJECTION_FIELDS = ("id", "reason", "line", "file", "kind")


PROBE_FIELDS = ("name", "size", "mtime_ns", "frames", "rate", "channels", "error", "detail")


UNITS_FIELDS = ("language", "text", "units", "lost")


def from_payload(payload: dict[str, Any]) -> tuple[list[Sample], list[Rejection]]:
    s = payload["samples"]
    samples = list(map(Sample, *(s[f] for f in SAMPLE_FIELDS)))
    r = payload["rejected"]
    rejected = [Rejection(i, reason, "index", line, file, kind)
                for i, reason, line, file, kind in zip(*(r[f] for f in REJECTION_FIELDS))]
    return samples, rejected
