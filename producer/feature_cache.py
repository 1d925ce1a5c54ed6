"""The feature cache: computed log-mels stored on disk and read back instead of recomputed.

With ``data.feature_cache=DIR`` (or ``auto``: ``DATASET/.stoker/features``, else
``~/.cache/stoker/features``) each producer looks a clip up before decoding it and stores what it
computes, in ``DIR/<key>/<id>.mel``. Epoch two of a run, and every later run with the same
preprocessing, then reads instead of computes.

The key is 16 hex digits of a SHA-256 over the features config (``shared/mel.py``
``features_key``: every key but ``backend``, both backends computing the same definition; the
mel convention's settings where they differ from their defaults, so caches made before them stay
valid; with ``features.user`` a hash of the function's module source, so an edited function is
not served stale mels), the resolved dataset directory and ``FORMAT_VERSION``;
``DIR/<key>/config.json`` says in words what the key stands for. A different config or dataset
gets a directory of its own, so nothing stale is ever read across configs. The mel statistics of
``transforms.mel_norm: dataset`` are keyed the same way. One entry (little-endian)::

    header   magic "STKMEL01" | frames u32 | n_mels u32 | name_crc u32 | lo f64 | step f64 |
             audio_size u64 | audio_mtime_ns i64 | crc32 u32              (56 bytes)
    payload  uint16 [frames, n_mels], C order

Each clip's log-mel is quantised affinely to 16 bits, ``code = round((x - lo) / step)`` with
``lo`` the clip's minimum and ``step = (max - lo) / 65535``, and read back as
``lo + code * step`` in float32. The error is at most ``step / 2`` (plus float32 rounding): for
a typical clip spanning the log floor (-11.5) to +4 that is 1.2e-4 in natural-log units, 0.012%
in linear magnitude, and the clip's minimum (digital silence: exactly ln(log_floor) by default)
comes back exactly. Half the size of float32, and far more precise than float16 (whose step at
abs(x) = 8 is 7.8e-3).

Every read checks the magic, the shape against the file size and the config, the audio file's
size, mtime and name against the entry (an edited clip is *stale*, not read; a loose file at a
URL is checked by its URL, the object's size and, in the mtime field, a stamp of its version or
ETag: docs/design/data.md, "Tar shards and object stores"), and a CRC-32 over the header fields
and the payload (a flipped bit is *corrupt*); stale and corrupt entries are recomputed,
rewritten and counted. A tar shard's members and Parquet rows are not cached. Writes go to a
temporary file in the same directory and are renamed into place, so concurrent producers and
interrupted runs never leave a half-written entry under a real name. Batches carry their cache
counts; summary.json has ``feature_cache`` (hits, computed, stale, corrupt) and per producer
``cache_*`` (and, with producer models, ``model_runs``: model calls, and ``model_hits``: clips
whose outputs the cache held). ``python run.py precompute --data DIR [--producers N] [--set
...]`` is one epoch with all local producers and a trainer that drops each batch
(``synthetic:0``), so the real producers fill the cache; it prints progress and a summary line.

Producer models' outputs (``transforms.models``) are cached beside the mels, per clip:
``DIR/<key>/models/<model key>/<id>.out``, the model key a hash of the model's spec, its version
(its framework, its module source's and its weights' SHA-256) and ``transforms.model_fields``;
an entry (:class:`ModelCache`) is a 32-byte header (magic, the audio file's name CRC, size and
mtime, CRC-32) and the clip's valid part of each field as an uncompressed ``.npz``, checked as
the mels are. The mels' key leaves the models out: adding a model keeps the cached mels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..shared.config import FeaturesConfig
from ..shared.mel import features_key
from ..shared.runfiles import write_atomic

log = logging.getLogger(__name__)

# Bump when the entry layout, the quantisation or the audio preprocessing changes.
FORMAT_VERSION = 1
MAGIC = b"STKMEL01"
ENTRY_SUFFIX = ".mel"
_HEADER = struct.Struct("<8sIIIddQqI")
# 16-bit codes: 65536 levels between the clip's minimum and maximum.
_LEVELS = 65535
_CODE_DTYPE = np.dtype("<u2")


@dataclass
class CacheCounts:
    """What the cache did for one producer (or one batch)."""

    hits: int = 0  # entries read and verified
    misses: int = 0  # no entry yet: computed and stored
    stale: int = 0  # the audio file changed since the entry was written: recomputed
    corrupt: int = 0  # entry failed its checks (checksum, size, magic): recomputed
    written: int = 0
    write_errors: int = 0

    def add(self, other: "CacheCounts") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def cache_key(features: FeaturesConfig, root: Path, transforms: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a cache directory's entries depend on (its name is a hash of this): the features,
    the dataset, and the producer transforms when any is on (producer/transforms.chain_key)."""
    key = {"format": FORMAT_VERSION, "features": features_key(features), "dataset": str(root)}
    return {**key, "transforms": transforms} if transforms else key


def cache_dir_name(features: FeaturesConfig, root: Path, transforms: dict[str, Any] | None = None) -> str:
    text = json.dumps(cache_key(features, root, transforms), sort_keys=True)
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def quantize(mel: np.ndarray) -> tuple[float, float, np.ndarray]:
    """float [T, M] -> (lo, step, uint16 codes [T, M]); the module's docstring."""
    values = np.asarray(mel, dtype=np.float64)
    lo = float(values.min()) if values.size else 0.0
    hi = float(values.max()) if values.size else 0.0
    step = (hi - lo) / _LEVELS if hi > lo else 1.0
    codes = np.rint((values - lo) / step)
    return lo, step, np.clip(codes, 0, _LEVELS).astype(_CODE_DTYPE)


def dequantize(lo: float, step: float, codes: np.ndarray) -> np.ndarray:
    """uint16 codes [T, M] -> float32 [T, M]."""
    out = codes.astype(np.float32)
    out *= np.float32(step)
    out += np.float32(lo)
    return out


def _name_crc(name: str) -> int:
    return zlib.crc32(name.encode("utf-8", "surrogateescape"))


class _Entries:
    """What the log-mel and the model caches share: a directory of entries, made with its
    config.json (``about``: what the entries were made with) at the first write, and writes that
    stop, logged once, when the disk refuses them (the run goes on computing)."""

    what = "cache"  # named in the log line

    def __init__(self, directory: Path, about: dict[str, Any]) -> None:
        self.dir = directory
        self._about = about
        self._ready = False
        self._writable = True
        self.counts = CacheCounts()

    def _store(self, path: Path, data: bytes) -> bool:
        """Write one entry; False when the disk refuses (or refused before)."""
        if not self._writable:
            return False
        try:
            if not self._ready:
                self.dir.mkdir(parents=True, exist_ok=True)
                about = self.dir / "config.json"
                if not about.exists():
                    write_atomic(about, json.dumps(self._about, indent=1, sort_keys=True))
                self._ready = True
            write_atomic(path, data)
        except OSError as exc:
            self.counts.write_errors += 1
            self._writable = False
            log.warning("cannot write the %s in %s (%s); computing without storing from now on", self.what,
                        self.dir, exc.strerror or exc)
            return False
        self.counts.written += 1
        return True


class FeatureCache(_Entries):
    """Entries of one (features config, dataset) pair under ``directory/<key>/``."""

    what = "feature cache"

    def __init__(self, directory: str | Path, features: FeaturesConfig, root: Path,
                 transforms: dict[str, Any] | None = None) -> None:
        super().__init__(Path(directory) / cache_dir_name(features, root, transforms),
                         {**cache_key(features, root, transforms),
                          "entries": f"<id>{ENTRY_SUFFIX}, see producer/feature_cache.py"})
        self.features = features

    def __repr__(self) -> str:
        return f"FeatureCache({str(self.dir)!r})"

    def path(self, sample_id: str) -> Path:
        return self.dir / f"{sample_id}{ENTRY_SUFFIX}"

    # ------------------------------------------------------------------ reading
    def get(self, sample_id: str, audio_name: str, audio_size: int, audio_mtime_ns: int) -> np.ndarray | None:
        """The cached log-mel float32 [T, n_mels], or None (miss, stale or corrupt: counted)."""
        try:
            blob = self.path(sample_id).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            self.counts.misses += 1
            return None
        except OSError as exc:
            log.warning("cannot read feature cache entry %s (%s); recomputing", self.path(sample_id), exc.strerror)
            self.counts.corrupt += 1
            return None
        problem, stale, mel = self._decode(blob, audio_name, audio_size, audio_mtime_ns)
        if mel is not None:
            self.counts.hits += 1
            return mel
        if stale:
            self.counts.stale += 1
            log.debug("feature cache entry %s is stale (%s); recomputing", sample_id, problem)
        else:
            self.counts.corrupt += 1
            log.warning("feature cache entry %s is corrupt (%s); recomputing it", self.path(sample_id), problem)
        return None

    def _decode(self, blob: bytes, audio_name: str, audio_size: int,
                audio_mtime_ns: int) -> tuple[str, bool, np.ndarray | None]:
        """(problem, stale, mel): mel is None when there is a problem."""
        if len(blob) < _HEADER.size:
            return f"{len(blob)} bytes, shorter than the header", False, None
        magic, frames, n_mels, name_crc, lo, step, size, mtime_ns, crc = _HEADER.unpack_from(blob)
        if magic != MAGIC:
            return "not a feature cache entry of this version", False, None
        expected = _HEADER.size + frames * n_mels * _CODE_DTYPE.itemsize
        if len(blob) != expected or n_mels != self.features.n_mels:
            return f"{len(blob)} bytes for {frames}x{n_mels} (expected {expected}, n_mels {self.features.n_mels})", \
                False, None
        if zlib.crc32(blob[_HEADER.size:], zlib.crc32(blob[:_HEADER.size - 4])) != crc:
            return "checksum mismatch", False, None
        if (size, mtime_ns, name_crc) != (audio_size, audio_mtime_ns, _name_crc(audio_name)):
            return "the audio file changed since it was cached", True, None
        codes = np.frombuffer(blob, dtype=_CODE_DTYPE, offset=_HEADER.size).reshape(frames, n_mels)
        return "", False, dequantize(lo, step, codes)

    # ------------------------------------------------------------------ writing
    def put(self, sample_id: str, audio_name: str, audio_size: int, audio_mtime_ns: int, mel: np.ndarray) -> bool:
        """Store one clip's log-mel [T, n_mels]; False (logged once) if the disk refuses."""
        if not self._writable:
            return False
        lo, step, codes = quantize(mel)
        frames, n_mels = codes.shape
        header = _HEADER.pack(MAGIC, frames, n_mels, _name_crc(audio_name), lo, step, audio_size, audio_mtime_ns, 0)
        payload = codes.tobytes()
        crc = zlib.crc32(payload, zlib.crc32(header[:-4]))
        return self._store(self.path(sample_id), header[:-4] + struct.pack("<I", crc) + payload)


# A producer model's outputs for one clip (producer/models.py): a header, then the clip's valid
# part of each field the model returned, as an uncompressed .npz.
MODEL_MAGIC = b"STKOUT01"
MODEL_SUFFIX = ".out"
_MODEL_HEADER = struct.Struct("<8sIQqI")


class ModelCache(_Entries):
    """A producer model's outputs per clip, beside the log-mels: ``directory/<mel key>/models/<key>/<id>.out``,
    ``key`` a hash of the model's spec and version (its source and weights: producer/models.py)
    and the fields it may return. One entry: magic "STKOUT01" | name_crc u32 | audio_size u64 |
    audio_mtime_ns i64 | crc32 u32 (over the header fields and payload), then the payload. Checked
    as the log-mels are: another audio file is stale, a failed check corrupt, both recomputed."""

    what = "model cache"

    def __init__(self, cache: FeatureCache, spec: str, version: str, fields: str) -> None:
        key = {"model": spec, "version": version, "fields": fields}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        super().__init__(cache.dir / "models" / digest, key)

    def path(self, sample_id: str) -> Path:
        return self.dir / f"{sample_id}{MODEL_SUFFIX}"

    def get(self, sample_id: str, audio_name: str, audio_size: int,
            audio_mtime_ns: int) -> dict[str, np.ndarray] | None:
        """The clip's cached outputs, or None (miss, stale or corrupt: counted)."""
        try:
            blob = self.path(sample_id).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            self.counts.misses += 1
            return None
        except OSError:
            self.counts.corrupt += 1
            return None
        problem = ""
        if len(blob) < _MODEL_HEADER.size:
            problem = "shorter than the header"
        else:
            magic, name_crc, size, mtime_ns, crc = _MODEL_HEADER.unpack_from(blob)
            if magic != MODEL_MAGIC or zlib.crc32(blob[_MODEL_HEADER.size:],
                                                  zlib.crc32(blob[:_MODEL_HEADER.size - 4])) != crc:
                problem = "checksum mismatch"
            elif (size, mtime_ns, name_crc) != (audio_size, audio_mtime_ns, _name_crc(audio_name)):
                self.counts.stale += 1
                return None
        if problem:
            self.counts.corrupt += 1
            log.warning("model cache entry %s is corrupt (%s); recomputing it", self.path(sample_id), problem)
            return None
        with np.load(io.BytesIO(blob[_MODEL_HEADER.size:]), allow_pickle=False) as npz:
            out = {name: npz[name] for name in npz.files}
        self.counts.hits += 1
        return out

    def put(self, sample_id: str, audio_name: str, audio_size: int, audio_mtime_ns: int,
            outputs: dict[str, np.ndarray]) -> bool:
        """Store one clip's outputs; False (logged once) if the disk refuses."""
        if not self._writable:
            return False
        buffer = io.BytesIO()
        np.savez(buffer, **outputs)
        payload = buffer.getvalue()
        header = _MODEL_HEADER.pack(MODEL_MAGIC, _name_crc(audio_name), audio_size, audio_mtime_ns, 0)
        crc = zlib.crc32(payload, zlib.crc32(header[:-4]))
        return self._store(self.path(sample_id), header[:-4] + struct.pack("<I", crc) + payload)
