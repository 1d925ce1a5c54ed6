"""A producer's batches: a lease (shared/wire.py's Lease: planned sample ids and the bucket's
shape) in, the bucket's arrays and the BATCH message out. It reads each clip
(producer/audio.py), runs the transforms (producer/transforms.py), computes the log-mels
for the batch at once (producer/features.py, or the feature cache), and collates by the
batch schema (shared/batch.py). It never sees a socket: producer/worker.py is its
transport, and the trainer's validation (consumer/feed/validation.py) makes its held-out
batches with it too.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket as pysocket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .audio import AudioError, AudioMissing, load_audio, load_member, load_url
from .feature_cache import CacheCounts, FeatureCache, ModelCache
from .features import MelComputer, UserMelError
from .transforms import Chain, TransformError
from ..shared import wire
from ..shared.batch import SCHEMA, BatchSchema, batch_dims, collate, example, parse_model_fields
from ..shared.config import BatchingConfig, FaultsConfig, FeaturesConfig, TransformsConfig
from ..shared.dataset.agreement import size_problem, stamp_problem
from ..shared.dataset.files import audio_path, relative_audio
from ..shared.dataset.corpus.address import IN_SHARDS, Member, Row, Url, address_of
from ..shared.dataset.parquet import row_reader
from ..shared.dataset.storage import COUNTS, Reader, object_version, object_versions, shown
from ..shared.mel import num_frames, pad_values
from ..shared.melstats import MelStats, minmax, normalize
from ..shared.text import PAD_ID

log = logging.getLogger("producer")

# How far a clip's audio may be from the duration the index holds: a manifest rounds its
# durations (NeMo writes two decimals) and a resampler may add or drop a few samples; another
# file or a truncated copy is off by far more. A clip further off is rejected when read.
DURATION_TOLERANCE_S = 0.1


@dataclass(frozen=True)
class Prepared:
    """A prepared batch: the BATCH message and its arrays (shared/batch.py)."""

    batch: wire.Batch
    arrays: dict[str, np.ndarray]


class _Version(NamedTuple):
    """An object's byte size and version stamp at a URL (storage.object_version), in the fields
    of a stat that the feature cache keys its entries by."""

    st_size: int
    st_mtime_ns: int


@dataclass
class _Clip:
    """One clip of a batch as the producer reads it: its mel (from the feature cache, or
    computed), its audio (when the mel is computed or the batch carries the waveform), and
    where a computed mel is stored in the cache."""

    id: str
    audio: np.ndarray | None = None
    mel: np.ndarray | None = None
    slot: tuple[str, os.stat_result | _Version] | None = None  # (file name, its stat) when the cache lacks the mel
    fields: dict[str, np.ndarray] | None = None  # the declared fields its user transforms made
    uncut: bool = False  # its audio and fields still await the transforms' trim and gain (Chain.finish)
    rejection: str = ""  # why its mel could not be made (features.user's function failed on it)
    # (file name, its stat) when the cache is on: model outputs' key
    source: tuple[str, os.stat_result | _Version] | None = None


class BatchMaker:
    """Turns one lease into the frames of a BATCH message.

    Per clip: the token ids the lease carries (the trainer tokenizes: see
    consumer/coordinator/lease_tables.TokenTable); the log-mel from the feature cache when
    one is configured and holds a valid entry, else from the audio (read, downmixed,
    resampled, then transformed with the other clips of the batch at once, and stored
    in the cache). With the optional fields on: the waveform (``audio``), and the log-mel of
    the reference clip the lease names for each clip (``ref_mel``: at most ``ref_frames``
    frames, from its middle). Clips whose file is not on this host are reported as missed
    (the consumer re-plans them onto another producer); clips that cannot be used are
    reported as rejected, with the reason. The batch has a row per clip delivered, or with
    ``fixed_rows`` the lease's rows, those past the clips delivered empty.
    """

    def __init__(self, root: Path, texts: dict[str, str], features: FeaturesConfig,
                 device: str | None, name: str, host: str | None = None,
                 files: dict[str, str] | None = None, feature_cache: str = "",
                 faults: FaultsConfig | None = None, schema: BatchSchema = SCHEMA,
                 ref_frames: int = BatchingConfig.ref_frames, transforms: TransformsConfig | None = None,
                 mel_norm: tuple[np.ndarray, np.ndarray] | None = None, fixed_rows: bool = False,
                 model_device: str | None = None, model_memory_mb: int | None = None,
                 token_pad: int = PAD_ID) -> None:
        self.root = root
        self.texts = texts  # of this host's metadata ({} for a producer that reads none: leases carry them)
        self.files = files if files is not None else {}
        self._lease_texts: dict[str, str] = {}  # the current lease's
        self._lease_files: dict[str, str] = {}
        self._lease_sizes: dict[str, int] = {}  # the byte size of each file on the trainer (a remote producer's)
        self._lease_stamps: dict[str, tuple[int, int]] = {}  # each file as indexed (a producer on the trainer's host)
        self._versions: dict[str, tuple[int, int] | None] = {}  # the lease's files at URLs: (size, version stamp)
        self.features = features
        self.name = name
        self.host = host or pysocket.gethostname()
        self.schema = schema
        self.ref_frames = ref_frames
        self.mel_norm = mel_norm  # (mean, std) [F] of transforms.mel_norm: dataset (shared/melstats.py)
        self.fixed_rows = fixed_rows  # batches keep the lease's rows (empty ones padded); else only real rows
        transforms = transforms or TransformsConfig()
        self.clip_minmax = transforms.mel_norm == "clip_minmax"  # each clip's mel scaled to [0, 1]
        # token rows padded with the vocabulary's pad id (a user tokenizer's own), not always PAD_ID
        self._pads = {**pad_values(schema, features, transforms.mel_norm), "tokens": token_pad}
        chain = Chain(transforms, features)
        self.chain = chain if chain.active else None  # producer/transforms.py: None when every step is off
        self._mels = MelComputer(features, device=device, weights=chain.weights)
        self.cache = FeatureCache(feature_cache, features, root, chain.key if self.chain else None) \
            if feature_cache else None
        self.reader = Reader(root)  # tar shards' members, a few shards kept open
        self.faults = faults or FaultsConfig()
        self.models = None
        self._model_caches: dict[str, ModelCache] = {}
        if transforms.models:
            from .models import ModelRunner  # imports the models' frameworks: only where a model is configured

            fields = parse_model_fields(transforms.model_fields, list(chain.declared))
            self.models = ModelRunner(transforms.models, fields, model_device, model_memory_mb)
            if self.cache is not None:
                self._model_caches = {m.spec: ModelCache(self.cache, m.spec, m.version, transforms.model_fields)
                                      for m in self.models.models}
        self._next_stall = time.monotonic() + self.faults.producer_stall_every_s

    def _inject_faults(self) -> None:
        """Configured fault injection: sleeping is the simulated slow storage or stall."""
        f = self.faults
        if f.producer_delay_ms > 0:
            time.sleep(f.producer_delay_ms / 1000)
        if f.producer_stall_s > 0 and time.monotonic() >= self._next_stall:
            log.info("%s: injected stall of %.2f s", self.name, f.producer_stall_s)
            time.sleep(f.producer_stall_s)
            self._next_stall += f.producer_stall_every_s

    def _load(self, sample_id: str, need_audio: bool, speaker: int = 0, language: int = 0,
              duration_s: float | None = None) -> _Clip:
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
        clip = _Clip(sample_id)
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
                done = self.chain(clip.audio, self._text(sample_id), sample_id, speaker, language,
                                  {"file": name})
                clip.audio, clip.fields, clip.uncut = done.audio, done.fields, self.chain.measures
        return clip

    def _check_file(self, clip: _Clip, name: str, path: Path) -> None:
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

    def _look_up_at_url(self, clip: _Clip, name: str, file: str) -> None:
        """A loose file at a URL (``file``, a window of it ``name``): its mel from the feature cache,
        keyed by the file's version (one request, none of the audio; None: read, not cached),
        looked up with the lease's others."""
        version = self._versions[file] if file in self._versions else object_version(file)
        if version is not None:
            clip.mel = self.cache.get(clip.id, name, *version)
            clip.slot = None if clip.mel is not None else (name, _Version(*version))
            clip.source = (name, _Version(*version))

    def _text(self, sample_id: str) -> str:
        return self._lease_texts.get(sample_id, self.texts.get(sample_id, ""))

    def _reference(self, mel: np.ndarray) -> np.ndarray:
        """A reference clip's log-mel as ref_mel holds it: at most R frames, from its middle."""
        start = max(0, (len(mel) - self.ref_frames) // 2)
        return mel[start:start + self.ref_frames]

    def make(self, lease: wire.Lease) -> Prepared:
        """The batch of one lease: its arrays (shared/batch.py) and the BATCH message (the clips
        delivered, rejected and missed, and cache counts). The transport encodes it.

        A clip whose file (or whose reference clip's file) is not on this host is *missed*;
        one that cannot be used is *rejected*, with the reason."""
        started = time.perf_counter()
        # The lease names its clips' texts and files (kept for this lease only: a producer holds no
        # more of the dataset than its leases').
        self._lease_texts, self._lease_files = lease.texts or {}, lease.files or {}
        self._lease_sizes = lease.sizes or {}
        self._lease_stamps = lease.stamps or {}
        before = dataclasses.replace(self.cache.counts) if self.cache is not None else None
        retries = COUNTS.retries
        rows: list[tuple[np.ndarray, _Clip, _Clip | None]] = []  # (tokens, clip, its reference clip)
        rejected: list[wire.Entry] = []
        missed: list[wire.Entry] = []
        extra = {i: (s, g) for i, s, g in zip(lease.ids, lease.speakers, lease.languages)}
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
        for n, sample_id in enumerate(lease.ids):
            row = self._row(lease, n, sample_id, extra, rejected, missed)
            if row is not None:
                rows.append(row)
        computed = self._compute([c for _, clip, ref in rows for c in (clip, ref) if c is not None])
        rows = [row for row in rows if self._made(row, rejected) and self._fits(lease, row, rejected)]
        arrays, stats = self._arrays(lease, rows, extra)
        model_counts: dict[str, int] = {}
        if self.models is not None:
            arrays, stats, rows, model_counts = self._run_models(lease, rows, extra, arrays, stats, rejected)
        prep_ms = (time.perf_counter() - started) * 1e3
        cache = None
        if self.cache is not None and before is not None:
            delta = CacheCounts(**{k: v - getattr(before, k) for k, v in self.cache.counts.to_json().items()})
            cache = {**delta.to_json(), "computed": computed}
        if model_counts:
            cache = {**(cache or {}), **model_counts}
        batch = wire.Batch(lease=lease.lease, epoch=lease.epoch, index=lease.index,
                           ids=tuple(clip.id for _, clip, _ in rows), rejected=tuple(rejected), missed=tuple(missed),
                           prep_ms=round(prep_ms, 3), mel_stats=stats.to_fields(), cache=cache,
                           read_retries=COUNTS.retries - retries or None)
        return Prepared(batch, arrays)

    def _row(self, lease: wire.Lease, n: int, sample_id: str, extra: dict[str, tuple[int, int]],
             rejected: list[wire.Entry], missed: list[wire.Entry]) -> tuple[np.ndarray, _Clip, _Clip | None] | None:
        """Clip ``n`` of the lease, read and transformed (its log-mel comes later, for the whole
        batch at once); None when it is missed or rejected (noted in those lists, with why)."""
        names = self.schema.names
        token_rows, refs = lease.tokens, lease.refs or ()
        if sample_id not in self._lease_texts and sample_id not in self.texts:
            missed.append(wire.Entry(sample_id, f"id not in the metadata on host {self.host}"))
            return None
        if n >= len(token_rows) or not token_rows[n]:
            rejected.append(wire.Entry(sample_id, "the lease carries no token ids for this clip"))
            return None
        if "ref_mel" in names and n >= len(refs):
            rejected.append(wire.Entry(sample_id, "the lease names no reference clip for this clip"))
            return None
        if "clip" in names and n >= len(lease.positions):
            rejected.append(wire.Entry(sample_id, "the lease carries no clip position for this clip"))
            return None
        what = ""
        speaker, language = extra.get(sample_id, (0, 0))
        tok = np.asarray(token_rows[n], dtype=np.int32)
        try:
            duration = lease.durations[n] if lease.durations is not None else None
            clip = self._load(sample_id, "audio" in names, speaker, language, duration)
            if self.chain is not None and self.chain.declared:  # made for the waveform they returned
                self.chain.check_fields(clip.fields or {}, len(tok), num_frames(len(clip.audio), self.features))
            what = f"reference clip {refs[n]}: " if "ref_mel" in names else what
            ref = self._load(refs[n], False, speaker, language) if "ref_mel" in names else None
        except AudioMissing as exc:
            missed.append(wire.Entry(sample_id, f"{what}{exc} on host {self.host}"))
            return None
        except (AudioError, TransformError) as exc:
            rejected.append(wire.Entry(sample_id, f"{what}{exc}"))
            return None
        return tok, clip, ref

    @staticmethod
    def _made(row: tuple[np.ndarray, _Clip, _Clip | None], rejected: list[wire.Entry]) -> bool:
        """Whether the mels of a row's clip and reference were made; else it is rejected, with why."""
        _, clip, ref = row
        reason = clip.rejection or (f"reference clip {ref.id}: {ref.rejection}" if ref and ref.rejection else "")
        if reason:
            log.debug("clip %s rejected: %s", clip.id, reason)
            rejected.append(wire.Entry(clip.id, reason))
        return not reason

    @staticmethod
    def _fits(lease: wire.Lease, row: tuple[np.ndarray, _Clip, _Clip | None], rejected: list[wire.Entry]) -> bool:
        """Whether a row's tokens and (transformed) mel fit the lease's bucket; else it is
        rejected: the clip changed since the index measured it."""
        max_tokens, max_frames = lease.shape
        tok, clip, _ = row
        frames = clip.mel.shape[0]
        if len(tok) <= max_tokens and frames <= max_frames:
            return True
        rejected.append(wire.Entry(clip.id, f"clip changed since indexing ({len(tok)} tokens, "
                                            f"{frames} frames > bucket {max_tokens}x{max_frames})"))
        return False

    def _arrays(self, lease: wire.Lease, rows: list[tuple[np.ndarray, _Clip, _Clip | None]],
                extra: dict[str, tuple[int, int]]) -> tuple[dict[str, np.ndarray], MelStats]:
        """The lease's rows collated into its bucket's arrays (mel normalised when the run does),
        and the channel statistics of the mel as defined (before normalising)."""
        names = self.schema.names
        positions = dict(zip(lease.ids, lease.positions))  # the clip field's (empty when it is off)
        examples = []
        for tok, clip, ref in rows:
            speaker, language = extra.get(clip.id, (0, 0))
            examples.append(example(tok, clip.mel, self.schema, speaker, language,
                                    audio=clip.audio if "audio" in names else None,
                                    ref_mel=self._reference(ref.mel) if ref is not None else None,
                                    declared=clip.fields, clip=positions.get(clip.id, -1)))
        self._inject_faults()
        dims = batch_dims(lease.rows if self.fixed_rows else len(examples), lease.shape,
                          self.features.n_mels, self.features.hop_length, self.ref_frames)
        arrays = collate(examples, dims, self._pads, self.schema)
        stats = MelStats.of_batch(arrays["mel"], arrays["mel_lengths"])  # of the mel as defined, for mel_norm
        if self.mel_norm is not None:
            normalize(arrays["mel"], arrays["mel_lengths"], *self.mel_norm)
            if "ref_mel" in names:
                normalize(arrays["ref_mel"], arrays["ref_mel_lengths"], *self.mel_norm)
        if self.clip_minmax:
            minmax(arrays["mel"], arrays["mel_lengths"])
            if "ref_mel" in names:
                minmax(arrays["ref_mel"], arrays["ref_mel_lengths"])
        return arrays, stats

    def _run_models(self, lease: wire.Lease, rows: list[tuple[np.ndarray, _Clip, _Clip | None]],
                    extra: dict[str, tuple[int, int]], arrays: dict[str, np.ndarray], stats: MelStats,
                    rejected: list[wire.Entry]) -> tuple[dict[str, np.ndarray], MelStats, list, dict[str, int]]:
        """The producer models' fields of a batch (producer/models.py): each model's outputs read
        from the model cache when it holds every row's clip, else the model run on the batch and
        its outputs stored per clip. A model failing on the batch rejects its clips (the batch
        goes on empty); returns (arrays, stats, rows, counts: model_runs, model_hits)."""
        from .models import ModelBatchError, clip_slice  # loaded with the runner, above

        assert self.models is not None
        if not rows:  # every clip missed or rejected: the model fields are all padding
            return arrays, stats, rows, {"model_runs": 0, "model_hits": 0}
        dims = batch_dims(arrays["mel"].shape[0], lease.shape, self.features.n_mels, self.features.hop_length,
                          self.ref_frames)
        runs = hits = 0
        filled: set[str] = set()
        try:
            for m in self.models.models:
                cache = self._model_caches.get(m.spec)
                sources = [ref if m.reference else clip for _, clip, ref in rows]
                cached = [cache.get(c.id, c.source[0], c.source[1].st_size, c.source[1].st_mtime_ns)
                          if cache is not None and c is not None and c.source is not None else None for c in sources]
                if all(c is not None for c in cached):
                    for row, outputs in enumerate(cached):
                        for name, value in outputs.items():
                            arrays[name][(row, *(slice(0, n) for n in value.shape))] = value
                            filled.add(name)
                    hits += len(rows)
                    continue
                outputs = self.models.run(m, arrays, dims, len(rows))
                runs += 1
                arrays.update(outputs)
                filled.update(outputs)
                for row, c in enumerate(sources):
                    if cache is not None and c is not None and c.source is not None:
                        name, st = c.source
                        cache.put(c.id, name, st.st_size, st.st_mtime_ns,
                                  {k: clip_slice(v, self.models.fields[k], row, arrays) for k, v in outputs.items()})
            missing = sorted(set(self.models.fields) - filled)
            if missing:
                raise ModelBatchError(f"no producer model returned the declared field(s) {missing}")
        except ModelBatchError as exc:
            log.warning("%s: batch %d of epoch %d: %s; its %d clips are rejected", self.name, lease.index,
                        lease.epoch, exc, len(rows))
            rejected.extend(wire.Entry(clip.id, str(exc)) for _, clip, _ in rows)
            arrays, stats = self._arrays(lease, [], extra)
            rows = []
        return arrays, stats, rows, {"model_runs": runs, "model_hits": hits}

    def _user_mel(self, clip: _Clip) -> np.ndarray | None:
        """features.user's mel of one clip, or None with the clip's rejection reason noted."""
        try:
            return self._mels([clip.audio])[0]
        except UserMelError as exc:
            clip.rejection = str(exc)
            return None

    def _compute(self, clips: list[_Clip]) -> int:
        """The log-mels the feature cache did not hold, all at once (each clip once, also one
        that is a reference too), stored in the cache, and the transforms' trim and gain of
        every clip read (producer/transforms.py's Chain.finish); returns how many mels were
        computed."""
        todo = list({id(c): c for c in clips if c.mel is None or c.uncut}.values())
        if not todo:
            return 0
        if self.chain is not None and self.chain.measures:
            finished = self.chain.finish([c.audio for c in todo], self._mels, keep_audio="audio" in self.schema.names)
            mels = [done.mel for done in finished]
            for clip, done in zip(todo, finished):
                clip.audio, clip.uncut = done.audio, False
                clip.fields = self.chain.cut_fields(clip.fields, done.cut) if clip.fields else clip.fields
        elif self.features.user:  # one clip at a time: the user's function may reject one
            mels = [self._user_mel(c) for c in todo]
        else:
            mels = self._mels([c.audio for c in todo])
        computed = 0
        for clip, mel in zip(todo, mels):
            if clip.mel is not None or mel is None:  # the cache's (only its audio and fields needed the cut),
                continue  # or rejected
            clip.mel, computed = mel, computed + 1
            if self.cache is not None and clip.slot is not None:
                name, st = clip.slot
                self.cache.put(clip.id, name, st.st_size, st.st_mtime_ns, mel)
        return computed
