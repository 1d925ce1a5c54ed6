"""A producer's clips of one lease, read: each clip's file found (this host's listing, the
lease's, a tar shard's member, a Parquet row, a URL), checked against what the trainer indexed,
its log-mel looked up in the feature cache, and otherwise its audio read and transformed
(producer/transforms.py). producer/batches.py's BatchMaker makes the batch of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .audio import AudioError, AudioMissing, load_audio, load_member, load_url
from .feature_cache import FeatureCache
from .transforms import Chain
from ..shared import wire
from ..shared.config import FeaturesConfig
from ..shared.dataset.agreement import size_problem, stamp_problem
from ..shared.dataset.files import audio_path, relative_audio
from ..shared.dataset.corpus.address import IN_SHARDS, Member, Row, Url, address_of
from ..shared.dataset.parquet import row_reader
from ..shared.dataset.storage import Reader, object_version, object_versions, shown

# How far a clip's audio may be from the duration the index holds: a manifest rounds its
# durations (NeMo writes two decimals) and a resampler may add or drop a few samples; another
# file or a truncated copy is off by far more. A clip further off is rejected when read.
DURATION_TOLERANCE_S = 0.1


class Version(NamedTuple):
    """An object's byte size and version stamp at a URL (storage.object_version), in the fields
    of a stat that the feature cache keys its entries by."""

    st_size: int
    st_mtime_ns: int


@dataclass
class Clip:
    """One clip of a batch as the producer reads it: its mel (from the feature cache, or
    computed), its audio (when the mel is computed or the batch carries the waveform), and
    where a computed mel is stored in the cache."""

    id: str
    audio: np.ndarray | None = None
    mel: np.ndarray | None = None
    slot: tuple[str, os.stat_result | Version] | None = None  # (file name, its stat) when the cache lacks the mel
    fields: dict[str, np.ndarray] | None = None  # the declared fields its user transforms made
    uncut: bool = False  # its audio and fields still await the transforms' trim and gain (Chain.finish)
    rejection: str = ""  # why its mel could not be made (features.user's function failed on it)
    # (file name, its stat) when the cache is on: model outputs' key
    source: tuple[str, os.stat_result | Version] | None = None


class ClipReader:
    """Reads the clips of one lease at a time (:meth:`begin`, then :meth:`load` per clip).
    ``texts`` and ``files``: this host's metadata and listing ({} for a producer that reads
    none: leases carry them); ``chain``: the transforms applied as a clip is read (None: none);
    ``cache``: the feature cache (None: off)."""

    def __init__(self, root: Path, texts: dict[str, str], files: dict[str, str], features: FeaturesConfig,
                 chain: Chain | None, cache: FeatureCache | None) -> None:
        self.root = root
        self.texts = texts
        self.files = files
        self.features = features
        self.chain = chain
        self.cache = cache
        self.reader = Reader(root)  # tar shards' members, a few shards kept open
        self._lease_texts: dict[str, str] = {}  # the current lease's
        self._lease_files: dict[str, str] = {}
        self._lease_sizes: dict[str, int] = {}  # the byte size of each file on the trainer (a remote producer's)
        self._lease_stamps: dict[str, tuple[int, int]] = {}  # each file as indexed (a producer on the trainer's host)
        self._versions: dict[str, tuple[int, int] | None] = {}  # the lease's files at URLs: (size, version stamp)

    def begin(self, lease: wire.Lease) -> None:
        """The lease's clips and reference clips come next: its texts, files and stamps kept for
        this lease only (a producer holds no more of the dataset than its leases'), and what is
        read together read ahead."""
        self._lease_texts, self._lease_files = lease.texts or {}, lease.files or {}
        self._lease_sizes = lease.sizes or {}
        self._lease_stamps = lease.stamps or {}
        # tar shards: the lease's members read in shard and offset order, then its rows made in its order
        # (Parquet files: its rows' row groups, each read once)
        members = [address_of(self.files.get(i, "")) for i in (*lease.ids, *(lease.refs or ()))]
        self.reader.prefetch((m.shard, m.offset, m.size) for m in members if isinstance(m, Member))
        named = [address_of(self.files.get(i) or self._lease_files.get(i, ""))
                 for i in (*lease.ids, *(lease.refs or ()))]
        parquet_rows = [a.name for a in named if isinstance(a, Row)]
        if parquet_rows:
            row_reader(self.reader.root).prefetch(parquet_rows)
        if self.cache is not None:  # loose files at URLs: their versions, the cache's key, looked up together
            self._versions = object_versions(a.path for a in named if isinstance(a, Url))

    def knows(self, sample_id: str) -> bool:
        """Whether the lease or this host's metadata has the clip's text."""
        return sample_id in self._lease_texts or sample_id in self.texts

    def load(self, sample_id: str, need_audio: bool, speaker: int = 0, language: int = 0,
              duration_s: float | None = None) -> Clip:
        """One clip: its log-mel from the feature cache when it holds a valid entry, its audio
        (transformed: producer/transforms.py) when the mel must be computed or the batch
        carries the waveform or the user's transforms make fields. Raises AudioMissing (not on
        this host, or not the trainer's file: another byte size than the lease names), AudioError or
        TransformError (unusable), whose text is the reason; AudioError too when the file is not the
        one the index measured (another size or mtime than the lease's stamp, or gone:
        agreement.stamp_problem), or the audio read is not ``duration_s`` long (the index's, within
        DURATION_TOLERANCE_S)."""
        # this host's own listing first (a remote copy may keep a file elsewhere), else the lease's
        name = self.files.get(sample_id) or self._lease_files.get(sample_id) or relative_audio(sample_id)
        address = address_of(name)  # a tar shard's member or a Parquet row (not cached), a file here or at a URL
        member = isinstance(address, IN_SHARDS)
        remote = isinstance(address, Url)
        path = audio_path(self.root, sample_id, name if member else address.path)  # type: ignore[union-attr]
        clip = Clip(sample_id)
        checked = self._lease_sizes.get(sample_id) is not None or self._lease_stamps.get(sample_id) is not None
        if (self.cache is not None or checked) and not member and not remote:
            self._check_file(clip, name, path)
        elif self.cache is not None and remote:  # a loose file at a URL: keyed by its version
            self._look_up_at_url(clip, name, address.path)  # type: ignore[union-attr]
        if clip.mel is None or need_audio or (self.chain is not None and self.chain.user):
            clip.audio = (load_member(self.reader, address, self.features.sample_rate_hz) if member else
                          load_url(address.path, self.features.sample_rate_hz, address.span) if remote else
                          load_audio(path, self.features.sample_rate_hz, relative_audio(sample_id, name),
                                     address.span))  # type: ignore[union-attr]
            seconds = len(clip.audio) / self.features.sample_rate_hz
            if duration_s is not None and abs(seconds - duration_s) > DURATION_TOLERANCE_S:
                raise AudioError(f"audio of {seconds:.3f} s where the index says {duration_s:.3f} s: "
                                 f"{shown(relative_audio(sample_id, name))} (a wrong duration in the manifest, or the "
                                 "file changed since indexing)")
            if self.chain is not None:
                done = self.chain(clip.audio, self.text(sample_id), sample_id, speaker, language,
                                  {"file": name})
                clip.audio, clip.fields, clip.uncut = done.audio, done.fields, self.chain.measures
        return clip

    def _check_file(self, clip: Clip, name: str, path: Path) -> None:
        """A local file's byte size against the lease's (AudioMissing), its stamp against the
        index's (AudioError), then its mel from the feature cache, keyed by size and mtime."""
        sample_id = clip.id
        indexed = self._lease_stamps.get(sample_id)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            changed = stamp_problem(relative_audio(sample_id, name), None, indexed)
            if changed:
                raise AudioError(changed) from None
            return
        except OSError:
            return  # load_audio says why
        problem = size_problem(relative_audio(sample_id, name), st.st_size, self._lease_sizes.get(sample_id))
        if problem:
            raise AudioMissing(problem)
        changed = stamp_problem(relative_audio(sample_id, name), st, indexed)
        if changed:
            raise AudioError(changed)
        if self.cache is not None:
            clip.mel = self.cache.get(sample_id, name, st.st_size, st.st_mtime_ns)
            clip.slot = None if clip.mel is not None else (name, st)
            clip.source = (name, st)

    def _look_up_at_url(self, clip: Clip, name: str, file: str) -> None:
        """A loose file at a URL (``file``, a window of it ``name``): its mel from the feature cache,
        keyed by the file's version (one request, none of the audio; None: read, not cached),
        looked up with the lease's others."""
        version = self._versions[file] if file in self._versions else object_version(file)
        if version is not None:
            clip.mel = self.cache.get(clip.id, name, *version)
            clip.slot = None if clip.mel is not None else (name, Version(*version))
            clip.source = (name, Version(*version))

    def text(self, sample_id: str) -> str:
        """The clip's text: the lease's, else this host's metadata's."""
        return self._lease_texts.get(sample_id, self.texts.get(sample_id, ""))
