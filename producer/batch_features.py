"""A producer's feature work on one batch's clips: the log-mels the feature cache did not hold,
computed at once and stored (producer/features.py), with the transforms' trim and gain
(producer/transforms.py); and the producer models' fields (producer/models.py), from the model
cache or run on the batch. producer/batches.py's BatchMaker plans the batch and collates it.
"""

from __future__ import annotations

import logging

import numpy as np

from .clips import Clip
from .feature_cache import FeatureCache, ModelCache
from .features import MelComputer, UserMelError
from .transforms import Chain
from ..shared import wire
from ..shared.batch import BatchSchema, batch_dims, parse_model_fields
from ..shared.config import FeaturesConfig, TransformsConfig

log = logging.getLogger("producer")


class FeatureWork:
    """The mels and model fields of a producer's batches. ``chain``: the run's transforms (None:
    every step off); ``cache``: the feature cache (None: off); ``model_device`` and
    ``model_memory_mb``: where the producer models run (transforms.models)."""

    def __init__(self, features: FeaturesConfig, schema: BatchSchema, transforms: TransformsConfig,
                 chain: Chain, cache: FeatureCache | None, device: str | None, name: str, ref_frames: int,
                 model_device: str | None = None, model_memory_mb: int | None = None) -> None:
        self.features = features
        self.schema = schema
        self.chain = chain if chain.active else None
        self.cache = cache
        self.name = name
        self.ref_frames = ref_frames
        self._mels = MelComputer(features, device=device, weights=chain.weights)
        self.models = None
        self._model_caches: dict[str, ModelCache] = {}
        if transforms.models:
            from .models import ModelRunner  # imports the models' frameworks: only where a model is configured

            fields = parse_model_fields(transforms.model_fields, list(chain.declared))
            self.models = ModelRunner(transforms.models, fields, model_device, model_memory_mb)
            if self.cache is not None:
                self._model_caches = {m.spec: ModelCache(self.cache, m.spec, m.version, transforms.model_fields)
                                      for m in self.models.models}

    def run_models(self, lease: wire.Lease, rows: list[tuple[np.ndarray, Clip, Clip | None]],
                   arrays: dict[str, np.ndarray], rejected: list[wire.Entry]) -> tuple[list, dict[str, int]]:
        """The producer models' fields of a batch (producer/models.py): each model's outputs read
        from the model cache when it holds every row's clip, else the model run on the batch and
        its outputs stored per clip, into ``arrays``. A model failing on the batch rejects its
        clips (the batch goes on empty: no row is left); returns (the rows left, counts:
        model_runs, model_hits)."""
        from .models import ModelBatchError, clip_slice  # loaded with the runner, above

        assert self.models is not None
        if not rows:  # every clip missed or rejected: the model fields are all padding
            return rows, {"model_runs": 0, "model_hits": 0}
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
            rows = []
        return rows, {"model_runs": runs, "model_hits": hits}

    def _user_mel(self, clip: Clip) -> np.ndarray | None:
        """features.user's mel of one clip, or None with the clip's rejection reason noted."""
        try:
            return self._mels([clip.audio])[0]
        except UserMelError as exc:
            clip.rejection = str(exc)
            return None

    def compute(self, clips: list[Clip]) -> int:
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
