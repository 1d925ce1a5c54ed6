"""A producer's batches: a lease (shared/wire.py's Lease: planned sample ids and the bucket's
shape) in, the bucket's arrays and the BATCH message out. It reads each clip with its
transforms (producer/clips.py), has the log-mels computed for the batch at once and the
producer models run (producer/batch_features.py), and collates by the batch schema
(shared/batch.py). It never sees a socket: producer/worker.py is its
transport, and the trainer's validation (consumer/feed/validation.py) makes its held-out
batches with it too.
"""

from __future__ import annotations

import dataclasses
import logging
import socket as pysocket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .audio import AudioError, AudioMissing
from .batch_features import FeatureWork
from .clips import DURATION_TOLERANCE_S, Clip, ClipReader
from .feature_cache import CacheCounts, FeatureCache
from .transforms import Chain, TransformError
from ..shared import wire
from ..shared.batch import SCHEMA, BatchSchema, batch_dims, collate, example
from ..shared.config import BatchingConfig, FaultsConfig, FeaturesConfig, TransformsConfig
from ..shared.dataset.storage import COUNTS
from ..shared.mel import num_frames, pad_values
from ..shared.melstats import MelStats, minmax, normalize
from ..shared.text import PAD_ID

log = logging.getLogger("producer")


@dataclass(frozen=True)
class Prepared:
    """A prepared batch: the BATCH message and its arrays (shared/batch.py)."""

    batch: wire.Batch
    arrays: dict[str, np.ndarray]


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
        self.host = host or pysocket.gethostname()
        self.features = features
        self.name = name
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
        self.cache = FeatureCache(feature_cache, features, root, chain.key if self.chain else None) \
            if feature_cache else None
        self.clips = ClipReader(root, texts, files if files is not None else {}, features, self.chain, self.cache)
        self.work = FeatureWork(features, schema, transforms, chain, self.cache, device, name, ref_frames,
                                model_device, model_memory_mb)
        self.models = self.work.models  # producer/models.py's runner (None: no producer model)
        self.faults = faults or FaultsConfig()
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
        retries = COUNTS.retries  # before the lease's reads ahead, whose retries are its own
        before = dataclasses.replace(self.cache.counts) if self.cache is not None else None
        self.clips.begin(lease)  # the lease names its clips' texts and files
        rows: list[tuple[np.ndarray, Clip, Clip | None]] = []  # (tokens, clip, its reference clip)
        rejected: list[wire.Entry] = []
        missed: list[wire.Entry] = []
        extra = {i: (s, g) for i, s, g in zip(lease.ids, lease.speakers, lease.languages)}
        for n, sample_id in enumerate(lease.ids):
            row = self._row(lease, n, sample_id, extra, rejected, missed)
            if row is not None:
                rows.append(row)
        computed = self.work.compute([c for _, clip, ref in rows for c in (clip, ref) if c is not None])
        rows = [row for row in rows if self._made(row, rejected) and self._fits(lease, row, rejected)]
        arrays, stats = self._arrays(lease, rows, extra)
        model_counts: dict[str, int] = {}
        if self.models is not None:
            kept, model_counts = self.work.run_models(lease, rows, arrays, rejected)
            if rows and not kept:  # a model failed on the batch: its clips rejected, the batch goes on empty
                arrays, stats = self._arrays(lease, [], extra)
            rows = kept
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
             rejected: list[wire.Entry], missed: list[wire.Entry]) -> tuple[np.ndarray, Clip, Clip | None] | None:
        """Clip ``n`` of the lease, read and transformed (its log-mel comes later, for the whole
        batch at once); None when it is missed or rejected (noted in those lists, with why)."""
        names = self.schema.names
        token_rows, refs = lease.tokens, lease.refs or ()
        if not self.clips.knows(sample_id):
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
            clip = self.clips.load(sample_id, "audio" in names, speaker, language, duration)
            if self.chain is not None and self.chain.declared:  # made for the waveform they returned
                self.chain.check_fields(clip.fields or {}, len(tok), num_frames(len(clip.audio), self.features))
            what = f"reference clip {refs[n]}: " if "ref_mel" in names else what
            ref = self.clips.load(refs[n], False, speaker, language) if "ref_mel" in names else None
        except AudioMissing as exc:
            missed.append(wire.Entry(sample_id, f"{what}{exc} on host {self.host}"))
            return None
        except (AudioError, TransformError) as exc:
            rejected.append(wire.Entry(sample_id, f"{what}{exc}"))
            return None
        return tok, clip, ref

    @staticmethod
    def _made(row: tuple[np.ndarray, Clip, Clip | None], rejected: list[wire.Entry]) -> bool:
        """Whether the mels of a row's clip and reference were made; else it is rejected, with why."""
        _, clip, ref = row
        reason = clip.rejection or (f"reference clip {ref.id}: {ref.rejection}" if ref and ref.rejection else "")
        if reason:
            log.debug("clip %s rejected: %s", clip.id, reason)
            rejected.append(wire.Entry(clip.id, reason))
        return not reason

    @staticmethod
    def _fits(lease: wire.Lease, row: tuple[np.ndarray, Clip, Clip | None], rejected: list[wire.Entry]) -> bool:
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

    def _arrays(self, lease: wire.Lease, rows: list[tuple[np.ndarray, Clip, Clip | None]],
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


__all__ = ["DURATION_TOLERANCE_S", "BatchMaker", "Prepared"]
