"""Data benchmarks: the dataset index, the producer against a librosa one, the feature cache.

``python -m stoker.benchmarks.data [--quick] [--out FILE] [--workdir DIR]`` prints a table and
writes JSON; :func:`run` returns the same dict. Every figure is measured in this run, on
this machine, as the median over repetitions (min and max kept); every ratio is stored
with the two numbers it comes from.

index
    Generated LJSpeech-layout datasets of 13,100 (LJSpeech's size) and 100,000 items:
    metadata.csv with ``id|text|text`` lines of 12-24 random words (LJSpeech's texts
    average ~100 characters) and one real WAV file per id (8 kHz 16-bit mono, 0.25 s,
    so that 100,000 files fit in ~400 MB; the index reads headers only, so the clip
    length does not change its work). Cold: ``build_index`` with no cache file (every
    header read, every text tokenized, ``data.index_workers`` = 0, i.e. one process per
    usable core), including the writing of the cache. Warm: ``build_index`` with the cache
    written by the cold build (metadata hashed, audio directory listed, cache verified
    and loaded). The files were just written, so they are in the page cache: a first
    read from a cold disk adds the device's latency to the cold build. Targets at
    13,100: cold <= 3 s, warm <= 0.3 s; linear: the time per item at 100,000 is at most
    1.3 x the time per item at 13,100 (cold and warm).

    The 13,100-item dataset is indexed with the ``phonemes`` front-end too (espeak-ng
    through phonemizer): cold with ``data.index_workers: 1`` (one core), cold with one
    process per core, and warm (units cached with the index). Reported: sentences/s per
    core and the speed-up over one core of the phonemizing stage (``IndexStats.read_s``:
    headers and texts, the work spread over the cores), and the whole builds' times.
    Targets: that speed-up >= 0.8 x the core count; warm <= 0.3 s.

producer
    The same clips (LJSpeech-like: 22,050 Hz 16-bit mono, durations drawn from a normal
    of mean 6.6 s, sd 2.2 s, clipped to 1.1..10.1 s, as LJSpeech's are), in the same
    planned batches (consumer/plan.py: batch 16, 4 buckets), through each variant in its
    own spawned process, one at a time, variants interleaved repetition by repetition:

    - ``stoker``: producer.batches.BatchMaker with the default config (``features.backend:
      auto``, resolved as a producer resolves it: TF when the process has a GPU, else the
      numpy backend), no cache: read, downmix, resample if needed, log-mel, tokens,
      collate, encode the BATCH message.
    - ``stoker-tf``: the same with the TF backend forced (on a CPU: informational).
    - ``librosa``: the same work written with librosa as one would: ``librosa.load(path,
      sr=22050, mono=True)`` (librosa's default resampler, soxr_hq),
      ``librosa.feature.melspectrogram`` with the definition's parameters, the same log
      floor, the same tokenizer, collate and message encoding.
    - ``stoker-warm``: as ``stoker``, with ``data.feature_cache`` filled beforehand (the
      rate of a pass that fills an empty cache, compute and store, is reported beside it).
    - ``stoker-shards``: as ``stoker``, the same clips' bytes read from WebDataset-style tar
      shards of :data:`CLIPS_PER_SHARD` clips (shared/dataset/shards.py; ``KEY.wav`` and
      ``KEY.txt`` members) on the same disk, through the producer's shard reader, in the
      same batches (planned from the loose files: clips of every shard in every batch, the
      reader's worst case; a run from shards leases batches grouped by shard).
    - ``stoker-parquet``: as ``stoker-shards``, the same clips' bytes in Parquet files as the
      Hugging Face ``datasets`` library writes them (an ``audio`` struct of bytes and path,
      uncompressed and PLAIN-encoded, beside ``id`` and ``text``, snappy and dictionary-encoded;
      row groups of :data:`CLIPS_PER_SHARD` clips, files
      of :data:`CLIPS_PER_PARQUET_FILE`: shared/dataset/parquet.py), read a row group at a time by
      the producer's row reader (its kept row groups dropped before each pass), in the batches
      a run plans from the Parquet files (the same clips and buckets, batches grouped by row
      group, ``batching.shard_window`` 4: consumer/shard_order.py), as a Parquet run's
      producer reads them; the same variant in the loose files' batches (every row group in
      every batch: the reader's worst case, each lease reading whole row groups for a clip or
      two of each) is ``stoker-parquet-mixed``.
    - ``stoker-shar``: as ``stoker-parquet``, the same clips' bytes in a lhotse Shar directory
      laid out as ``CutSet.to_shar`` writes one (``cuts.NNNNNN.jsonl.gz`` beside
      ``recording.NNNNNN.tar`` of ``ID.wav`` and ``ID.json`` members; shards of
      :data:`CLIPS_PER_SHARD` cuts: shared/dataset/shar.py), in the batches a run plans from it
      (grouped by shard, ``batching.shard_window`` 4).

    Beside the clips/s, each layout's cold index time over the same clips (``build_index``, one
    process, no cache file before it), against the loose files'.

    Judged with one thread per process (``OMP/OPENBLAS/MKL/NUMBA_NUM_THREADS=1``, TF
    intra- and inter-op threads 1): producers run one per core, so one core is what each
    has. The same variants with the libraries' default threading are reported too
    (informational; on 2 cores a library that starts a thread per core in each of two
    producers oversubscribes the machine). Targets: stoker >= 1.5 x librosa clips/s;
    warm cache >= 5 x stoker (cold) clips/s; from shards, from Parquet and from Shar, >= 0.9 x
    from loose files.

Quick mode: smaller index sizes (13,100 and 30,000), fewer clips and repetitions, no
default-threads rows.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .common import DEMO_DATA, BenchError, machine_info, ratio, spawn_context, spread, stop_children, table
from .corpus import (BATCH_SIZE, CLIPS_PER_SHARD, PARQUET_DIR, SHAR_DIR, SHARDS_DIR, make_clip_parquet, make_clip_shar,
                     make_clip_shards, make_clips, make_index_dataset, plan_leases)
from ..producer.audio import load_audio
from ..producer.batches import BatchMaker, Prepared
from ..producer.features import log_mel_spectrogram_numpy, resolve_backend
from ..shared import wire
from ..shared.batch import SCHEMA, batch_dims, collate
from ..shared.config import DataConfig, FeaturesConfig, TextConfig
from ..shared.dataset.agreement import scan_dataset
from ..shared.dataset.corpus.registry import locate, read_metadata
from ..shared.dataset.files import scan_audio
from ..consumer.index.index import build_index
from ..consumer.index.parallel import index_workers
from ..shared.dataset.parquet import row_reader
from ..shared.mel import pad_values

LJSPEECH_ITEMS = 13_100
LARGE_ITEMS = 100_000
# Index targets (at LJSpeech's size) and the linearity bound between the two sizes.
TARGET_COLD_S = 3.0
TARGET_WARM_S = 0.3
# The phonemes front-end's cold index must use every core: speed-up over one core >= this x cores.
TARGET_PHONEMES_SPEEDUP = 0.8
TARGET_LINEAR = 1.3
# Producer targets.
TARGET_VS_LIBROSA = 1.5
TARGET_WARM_VS_COLD = 5.0
TARGET_SHARDS_VS_FILES = 0.9
# The variants that read the clips packed beside the loose files, and where.
PACKED_VARIANTS = {"stoker-shards": SHARDS_DIR, "stoker-parquet": PARQUET_DIR, "stoker-parquet-mixed": PARQUET_DIR,
                   "stoker-shar": SHAR_DIR}
# The variants whose batches are planned from their own layout (grouped by shard or row group).
OWN_PLAN_VARIANTS = ("stoker-parquet", "stoker-shar")
# The preprocessing section: stoker's producer as configured by default (numpy
# log-mels on a CPU), with TensorFlow's ops, the same work with librosa, the numpy reference.
PREPROCESSING_VARIANTS = ("stoker", "stoker-tf", "librosa", "numpy-reference")
# Environment of a process with one thread per library (set before the child starts).
ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                  "NUMBA_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
QUIET_TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}
# A child that has not answered a pass in this long is presumed stuck.
PASS_TIMEOUT_S = 600.0
# Starting a child includes importing TensorFlow or librosa.
CHILD_START_TIMEOUT_S = 180.0


@dataclass
class DataPlan:
    index_sizes: list[int] = field(default_factory=lambda: [LJSPEECH_ITEMS, LARGE_ITEMS])
    index_repetitions: int = 3
    phoneme_repetitions: int = 2
    clips: int = 64
    repetitions: int = 5
    variants: list[str] = field(default_factory=lambda: ["stoker", "librosa", "stoker-warm", "stoker-tf",
                                                         "stoker-shards", "stoker-parquet", "stoker-shar"])
    default_threads: bool = True  # also measure with the libraries' default threading

    @classmethod
    def quick(cls) -> "DataPlan":
        return cls(index_sizes=[LJSPEECH_ITEMS, 30_000], index_repetitions=2, phoneme_repetitions=1, clips=32,
                   repetitions=3,
                   default_threads=False)


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for children started inside the block."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def layout_index_seconds(root: Path, variants: Sequence[str], workdir: Path) -> dict[str, float]:
    """The cold index time (one process, the cache file written) of the loose clips at ``root``
    and of each packed layout of ``variants`` beside them (PACKED_VARIANTS)."""
    places = {"loose": root, **{v: root.parent / PACKED_VARIANTS[v] for v in variants if v in PACKED_VARIANTS}}
    out = {}
    for name, place in places.items():
        cache = workdir / f"layout-index-{name}"
        shutil.rmtree(cache, ignore_errors=True)
        out[name], _ = _timed_index(place, cache, workers=1)
        shutil.rmtree(cache, ignore_errors=True)
    return out


# ------------------------------------------------------------------------ index


def _timed_index(root: Path, cache_dir: Path, workers: int, frontend: str = "characters") -> tuple[float,
                                                                                                   dict[str, Any]]:
    data = DataConfig(path=str(root), index_cache=str(cache_dir), index_workers=workers)
    started = time.perf_counter()
    index = build_index(data, FeaturesConfig(), TextConfig(frontend=frontend))
    seconds = time.perf_counter() - started
    return seconds, {**index.stats.to_json(), "samples": len(index.samples), "rejected": len(index.rejected)}


def run_index(plan: DataPlan, workdir: Path, log: Callable[[str], None] = _log,
              with_dataset: Callable[[Path], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Index build times at each size; ``with_dataset(root)``, if given, runs on each
    generated dataset (index cache cold) and its result is kept in the row. The index build's info
    lines (one per build, noise here) are quieted while it runs, their loggers' levels restored after."""
    loggers = [logging.getLogger(name) for name in ("stoker.shared.dataset", "stoker.consumer.index")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        return _run_index(plan, workdir, log, with_dataset)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _run_index(plan: DataPlan, workdir: Path, log: Callable[[str], None],
               with_dataset: Callable[[Path], dict[str, Any]] | None) -> dict[str, Any]:
    rows = []
    # the phonemes front-end is measured on the LJSpeech-sized dataset (or the first size)
    phoneme_items = LJSPEECH_ITEMS if LJSPEECH_ITEMS in plan.index_sizes else plan.index_sizes[0]
    for items in plan.index_sizes:
        root = workdir / f"index-{items}"
        made = make_index_dataset(root, items)
        log(f"index: generated {items} items in {made:.1f} s")
        cache = workdir / f"index-cache-{items}"
        extra = with_dataset(root) if with_dataset is not None else None
        if items == phoneme_items:
            phonemes = _phonemes_index(root, workdir / "phonemes-cache", plan.phoneme_repetitions, log)
        cold, warm, cold_stats, warm_stats = [], [], {}, {}
        for _ in range(plan.index_repetitions):
            shutil.rmtree(cache, ignore_errors=True)
            seconds, cold_stats = _timed_index(root, cache, workers=0)
            if cold_stats["cache"] != "miss" or cold_stats["headers_read"] != items:
                raise BenchError(f"cold build was not cold: {cold_stats}")
            cold.append(seconds)
            seconds, warm_stats = _timed_index(root, cache, workers=0)
            if warm_stats["cache"] != "hit":
                raise BenchError(f"warm build missed the cache: {warm_stats}")
            warm.append(seconds)
        log(f"index {items}: cold {min(cold):.2f}..{max(cold):.2f} s, warm {min(warm):.3f}..{max(warm):.3f} s")
        rows.append({"items": items, "cold_s": spread(cold), "warm_s": spread(warm),
                     "cold_us_per_item": 1e6 * spread(cold)["median"] / items,
                     "warm_us_per_item": 1e6 * spread(warm)["median"] / items,
                     "workers": cold_stats["workers"], "cache_bytes": Path(warm_stats["cache_file"]).stat().st_size,
                     "generate_s": made, **({"with_dataset": extra} if extra is not None else {})})
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    return {"rows": rows, "phonemes": phonemes, "targets": _index_targets(rows, phonemes)}


def _index_targets(rows: list[dict[str, Any]], phonemes: dict[str, Any]) -> dict[str, Any]:
    """The index targets: cold and warm at LJSpeech's size, phonemizing on every core, linear growth."""
    base = next((r for r in rows if r["items"] == LJSPEECH_ITEMS), rows[0])
    large = rows[-1]
    cores = phonemes["cores"]
    speedup = ratio(phonemes["one_core_stage_s"]["median"], phonemes["cold_stage_s"]["median"],
                    note=f"phonemizing a cold index on 1 core / on {cores} cores")
    targets = {
        "cold": {"what": f"cold index of {base['items']} items <= {TARGET_COLD_S} s",
                 "value": base["cold_s"]["median"], "limit": TARGET_COLD_S,
                 "met": base["cold_s"]["median"] <= TARGET_COLD_S},
        "warm": {"what": f"warm index of {base['items']} items <= {TARGET_WARM_S} s",
                 "value": base["warm_s"]["median"], "limit": TARGET_WARM_S,
                 "met": base["warm_s"]["median"] <= TARGET_WARM_S},
    }
    targets["phonemes_speedup"] = {
        "what": f"phonemizing a cold index: speed-up over one core >= {TARGET_PHONEMES_SPEEDUP} x {cores} cores",
        "ratio": speedup, "value": speedup["value"], "limit": TARGET_PHONEMES_SPEEDUP * cores,
        "met": speedup["value"] >= TARGET_PHONEMES_SPEEDUP * cores}
    targets["phonemes_warm"] = {"what": f"warm phonemes index of {base['items']} items <= {TARGET_WARM_S} s",
                                "value": phonemes["warm_s"]["median"], "limit": TARGET_WARM_S,
                                "met": phonemes["warm_s"]["median"] <= TARGET_WARM_S}
    if large is not base:
        for kind in ("cold", "warm"):
            r = ratio(large[f"{kind}_us_per_item"], base[f"{kind}_us_per_item"],
                      note=f"us per item at {large['items']} / at {base['items']}")
            targets[f"linear_{kind}"] = {"what": f"{kind} build linear: per-item time at {large['items']} <= "
                                                 f"{TARGET_LINEAR} x at {base['items']}",
                                         "ratio": r, "value": r["value"], "limit": TARGET_LINEAR,
                                         "met": r["value"] <= TARGET_LINEAR}
    return targets


def _phonemes_index(root: Path, cache: Path, repetitions: int, log: Callable[[str], None]) -> dict[str, Any]:
    """The index with the phonemes front-end: cold on one core, cold on every core, warm.

    The speed-up is the phonemizing stage's (``IndexStats.read_s``: headers and texts, the
    work spread over the cores); the whole builds' times are reported beside it.
    """
    cores = index_workers(DataConfig())
    one, cold, one_stage, cold_stage, warm = [], [], [], [], []
    stats: dict[str, Any] = {}
    for _ in range(repetitions):
        for workers, times, stage in ((1, one, one_stage), (0, cold, cold_stage)):
            shutil.rmtree(cache, ignore_errors=True)
            seconds, stats = _timed_index(root, cache, workers, "phonemes")
            if stats["cache"] != "miss" or stats["texts_tokenized"] == 0:
                raise BenchError(f"cold phonemes build was not cold: {stats}")
            times.append(seconds)
            stage.append(stats["read_s"])
        seconds, warm_stats = _timed_index(root, cache, 0, "phonemes")
        if warm_stats["cache"] != "hit":
            raise BenchError(f"warm phonemes build missed the cache: {warm_stats}")
        warm.append(seconds)
    shutil.rmtree(cache, ignore_errors=True)
    sentences = stats["texts_tokenized"]
    per_core = sentences / spread(one_stage)["median"]
    log(f"index phonemes {sentences} sentences: phonemizing on 1 core {spread(one_stage)['median']:.2f} s "
        f"({per_core:.0f} sentences/s), on {cores} cores {spread(cold_stage)['median']:.2f} s; whole cold build "
        f"{spread(one)['median']:.2f} s / {spread(cold)['median']:.2f} s; warm {spread(warm)['median']:.3f} s")
    return {"sentences": sentences, "cores": cores, "workers": stats["workers"], "one_core_s": spread(one),
            "cold_s": spread(cold), "one_core_stage_s": spread(one_stage), "cold_stage_s": spread(cold_stage),
            "warm_s": spread(warm), "sentences_per_s_per_core": round(per_core, 1),
            "sentences_per_s": round(sentences / spread(cold_stage)["median"], 1)}


# ------------------------------------------------------------------------ producers


class _PerClipBatchMaker:
    """A producer's work done one clip at a time: read, log-mel (``clip_mel``), tokens,
    collation, message; the variants differ only in how a clip becomes a log-mel."""

    def __init__(self, root: Path, texts: dict[str, str], files: dict[str, str], features: Any,
                 batch_size: int) -> None:
        self.root, self.texts, self.files, self.f, self.batch_size = root, texts, files, features, batch_size
        self.collate = collate
        self.pads = pad_values(SCHEMA, features, "off")

    def clip_mel(self, path: Path) -> Any:
        raise NotImplementedError

    def make(self, lease: Any) -> Any:
        """As BatchMaker.make: a shared/wire.py Lease in, a Prepared out."""
        tokens, mels = [], []
        for sample_id, row in zip(lease.ids, lease.tokens):
            mels.append(np.asarray(self.clip_mel(self.root / self.files[sample_id]), np.float32))
            tokens.append(np.asarray(row, np.int32))
        arrays = self.collate([{"tokens": t, "mel": m} for t, m in zip(tokens, mels)],
                              batch_dims(self.batch_size, lease.shape, self.f.n_mels), self.pads)
        return Prepared(wire.Batch(lease.lease, lease.epoch, lease.index, lease.ids), arrays)


class LibrosaBatchMaker(_PerClipBatchMaker):
    """The producer's work written with librosa, as a user of librosa would write it."""

    def __init__(self, root: Path, texts: dict[str, str], files: dict[str, str], features: Any,
                 batch_size: int) -> None:
        import librosa  # imported here, outside the timed passes

        super().__init__(root, texts, files, features, batch_size)
        self.librosa = librosa

    def clip_mel(self, path: Path) -> Any:
        f = self.f
        y, _ = self.librosa.load(str(path), sr=f.sample_rate_hz, mono=True)
        mel = self.librosa.feature.melspectrogram(
            y=y, sr=f.sample_rate_hz, n_fft=f.n_fft, hop_length=f.hop_length, win_length=f.win_length,
            window="hann", center=True, pad_mode="reflect", power=1.0, n_mels=f.n_mels, fmin=f.fmin_hz,
            fmax=f.fmax_hz, htk=False, norm="slaney")
        return np.log(np.maximum(mel.T, f.log_floor))


class ReferenceBatchMaker(_PerClipBatchMaker):
    """The producer's work with the plain numpy reference log-mel (float64, one clip at a time)."""

    def clip_mel(self, path: Path) -> Any:
        return log_mel_spectrogram_numpy(load_audio(path, self.f.sample_rate_hz), self.f)


def _variant_maker(variant: str, base: Path, texts: dict[str, str], files: dict[str, str], cache_dir: str,
                   one_thread: bool) -> tuple[Any, FeaturesConfig]:
    """The batch maker of ``variant`` over the clips at ``base``, and its features config."""
    if variant in ("librosa", "numpy-reference"):
        features = FeaturesConfig(backend="numpy")  # only its parameters are used
    else:
        features = resolve_backend(FeaturesConfig(backend="tf" if variant == "stoker-tf" else "auto"))
    if features.backend == "tf":
        import tensorflow as tf

        if one_thread:
            tf.config.threading.set_intra_op_parallelism_threads(1)
            tf.config.threading.set_inter_op_parallelism_threads(1)
    if variant == "librosa":
        return LibrosaBatchMaker(base, texts, files, features, BATCH_SIZE), features
    if variant == "numpy-reference":
        return ReferenceBatchMaker(base, texts, files, features, BATCH_SIZE), features
    return BatchMaker(base, texts, features, None, variant, files=files,
                      feature_cache=cache_dir if variant == "stoker-warm" else ""), features


def _producer_child(conn: Any, variant: str, root: str, leases: list[dict[str, Any]], cache_dir: str,
                    one_thread: bool) -> None:
    """One variant in its own process: answer each "run" with the seconds one pass took."""
    try:
        base = Path(root)
        if variant in PACKED_VARIANTS:  # the same clips beside them (make_clip_shards, make_clip_parquet)
            base, pattern = locate(str(base.parent / PACKED_VARIANTS[variant]), "metadata.csv").where
            scan = scan_dataset(base, pattern)
            texts, files = {e.id: e.text for e in scan.entries}, dict(scan.files)
        else:
            entries, _ = read_metadata(base)
            texts = {e.id: e.text for e in entries}
            files = {k: v.name for k, v in scan_audio(base).items()}
        maker, features = _variant_maker(variant, base, texts, files, cache_dir, one_thread)
        if variant in OWN_PLAN_VARIANTS:  # the batches a run plans from the layout itself (module docstring)
            leases = plan_leases(base / pattern)
        clips = sum(len(lease.ids) for lease in leases)
        backend = variant if variant in ("librosa", "numpy-reference") else features.backend
        conn.send({"ok": True, "ready": True, "backend": backend})
        while True:
            command = conn.recv()
            if command not in ("run", "refill"):
                break
            if command == "refill" and getattr(maker, "cache", None) is not None:
                for entry in maker.cache.dir.glob("*.mel"):
                    entry.unlink()
            if variant.startswith("stoker-parquet"):
                row_reader(base).close()  # each row group read once a pass (module docstring)
            started, cpu0 = time.perf_counter(), time.process_time()
            for lease in leases:
                prepared = maker.make(lease)
                prepared.batch.encode(prepared.arrays)  # the frames, as a producer sends them
            seconds = time.perf_counter() - started
            cpu_s = time.process_time() - cpu0  # every thread of this process
            cache = maker.cache.counts.to_json() if getattr(maker, "cache", None) is not None else None
            peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
            conn.send({"ok": True, "seconds": seconds, "clips": clips, "cache": cache, "cpu_s": cpu_s,
                       "peak_rss_mb": peak_mb})
    except BaseException as exc:  # reported to the parent as data
        try:
            conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        except (OSError, ValueError):
            pass
    finally:
        conn.close()


def _answer(conn: Any, proc: Any, what: str, timeout_s: float) -> dict[str, Any]:
    if not conn.poll(timeout_s):
        raise BenchError(f"{what}: no answer within {timeout_s:.0f} s (alive: {proc.is_alive()})")
    try:
        reply = conn.recv()
    except EOFError:
        raise BenchError(f"{what}: the child exited (status {proc.exitcode})") from None
    if not reply.get("ok"):
        raise BenchError(f"{what} failed: {reply.get('error')}")
    return reply


def _measure(variants: list[str], root: Path, leases: list[dict[str, Any]], cache_dir: Path, one_thread: bool,
             repetitions: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Start one child per variant, warm each up, then interleave timed passes."""
    context = spawn_context()
    children: dict[str, tuple[Any, Any]] = {}
    env = {**QUIET_TF_ENV, **(ONE_THREAD_ENV if one_thread else {})}
    try:
        with _environment(env):
            for variant in variants:
                parent, child = context.Pipe()
                proc = context.Process(target=_producer_child, name=f"bench-{variant}", daemon=True,
                                       args=(child, variant, str(root), leases, str(cache_dir), one_thread))
                proc.start()
                child.close()
                children[variant] = (parent, proc)
        backends = {}
        for variant, (conn, proc) in children.items():
            backends[variant] = _answer(conn, proc, f"{variant} start", CHILD_START_TIMEOUT_S)["backend"]
        fill: dict[str, Any] = {}
        for variant, (conn, proc) in children.items():  # warm-up: tracing, JIT, file cache; fills the cache
            conn.send("run")
            _answer(conn, proc, f"{variant} warm-up", PASS_TIMEOUT_S)
            if variant == "stoker-warm":  # one pass into an emptied cache, warm otherwise: the fill rate
                conn.send("refill")
                fill = _answer(conn, proc, f"{variant} fill", PASS_TIMEOUT_S)
        times: dict[str, list[float]] = {v: [] for v in variants}
        cpu: dict[str, list[float]] = {v: [] for v in variants}
        last: dict[str, Any] = {}
        for rep in range(repetitions):
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for variant in order:
                conn, proc = children[variant]
                conn.send("run")
                reply = _answer(conn, proc, variant, PASS_TIMEOUT_S)
                times[variant].append(reply["clips"] / reply["seconds"])
                cpu[variant].append(reply["cpu_s"] / reply["clips"] * 1e3)
                last[variant] = reply
        for conn, _ in children.values():
            conn.send("stop")
    finally:
        for conn, _ in children.values():
            conn.close()
        stop_children([proc for _, proc in children.values()])
    out: dict[str, Any] = {v: {"clips_per_s": spread(times[v]), "clips": last[v]["clips"], "backend": backends[v],
                               "cpu_ms_per_clip": spread(cpu[v]), "peak_rss_mb": last[v]["peak_rss_mb"]}
                           for v in variants}
    if "stoker-warm" in out:
        cache = last["stoker-warm"]["cache"] or {}
        out["stoker-warm"]["cache"] = cache
        if cache.get("hits", 0) == 0:
            raise BenchError(f"the warm-cache variant read nothing from its cache: {cache}")
        out["stoker-warm"]["fill_clips_per_s"] = fill["clips"] / fill["seconds"] if fill else None
    log("producer (" + ("1 thread" if one_thread else "default threads") + "): " +
        ", ".join(f"{v} {out[v]['clips_per_s']['median']:.1f}" for v in variants) + " clips/s")
    return out


def run_preprocessing(repetitions: int, variants: Sequence[str] = PREPROCESSING_VARIANTS,
                      root: Path = DEMO_DATA, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Clips/s of one producer process on the demo data (one thread each), against librosa
    (when installed) and the plain numpy reference; its CPU per clip and peak RSS."""
    chosen = [v for v in variants if v != "librosa" or importlib.util.find_spec("librosa") is not None]
    leases = plan_leases(root)
    with tempfile.TemporaryDirectory(prefix="stoker-bench-pre-") as cache_dir:
        measured = _measure(chosen, root, leases, Path(cache_dir), True, repetitions, log)
    out: dict[str, Any] = {"data": str(root), "clips": measured[chosen[0]]["clips"], "batches": len(leases),
                           "variants": measured, "ratios": {}}
    base = measured["stoker"]["clips_per_s"]["median"]
    for v in chosen:
        if v != "stoker":
            out["ratios"][v] = ratio(base, measured[v]["clips_per_s"]["median"],
                                     note=f"median clips/s: stoker ({measured['stoker']['backend']}) / {v}")
    return out


def render_preprocessing(section: dict[str, Any]) -> str:
    rows = []
    for name, v in section["variants"].items():
        s = v["clips_per_s"]
        r = section["ratios"].get(name)
        rows.append([name, v["backend"], f"{s['median']:.1f} [{s['min']:.1f},{s['max']:.1f}]",
                     f"{r['value']:.2f}" if r else "-", f"{v['cpu_ms_per_clip']['median']:.1f}",
                     f"{v['peak_rss_mb']:.0f}"])
    return table(["variant", "backend", "clips/s med [min,max]", "stoker / this", "CPU ms/clip", "peak RSS MB"],
                 rows)


def run_producer(plan: DataPlan, workdir: Path, log: Callable[[str], None] = _log) -> dict[str, Any]:
    root = workdir / "clips"
    make_clips(root, plan.clips)
    if "stoker-shards" in plan.variants:
        make_clip_shards(root)
    if any(v.startswith("stoker-parquet") for v in plan.variants):
        make_clip_parquet(root)
    if "stoker-shar" in plan.variants:
        make_clip_shar(root)
    leases = plan_leases(root)
    result: dict[str, Any] = {"clips": plan.clips, "batches": len(leases), "threads": {},
                              "index_s": layout_index_seconds(root, plan.variants, workdir)}
    log("cold index over the same clips: " + ", ".join(f"{k} {v:.2f} s" for k, v in result["index_s"].items()))
    modes = [True, False] if plan.default_threads else [True]
    for one_thread in modes:
        cache_dir = workdir / f"feature-cache-{'one' if one_thread else 'default'}"
        shutil.rmtree(cache_dir, ignore_errors=True)
        result["threads"]["1" if one_thread else "default"] = _measure(
            plan.variants, root, leases, cache_dir, one_thread, plan.repetitions, log)
    judged = result["threads"]["1"]
    targets: dict[str, Any] = {}
    if "stoker" in judged and "librosa" in judged:
        r = ratio(judged["stoker"]["clips_per_s"]["median"], judged["librosa"]["clips_per_s"]["median"],
                  note=f"median clips/s, one thread per process, same clips and batches, same run; stoker's "
                       f"backend: {judged['stoker']['backend']}")
        targets["vs_librosa"] = {"what": f"producer clips/s per process >= {TARGET_VS_LIBROSA} x librosa",
                                 "ratio": r, "value": r["value"], "limit": TARGET_VS_LIBROSA,
                                 "met": r["value"] >= TARGET_VS_LIBROSA}
    if "stoker" in judged and "stoker-warm" in judged:
        r = ratio(judged["stoker-warm"]["clips_per_s"]["median"], judged["stoker"]["clips_per_s"]["median"],
                  note="median clips/s, warm feature cache / computing (no cache)")
        targets["warm_vs_cold"] = {"what": f"warm feature cache clips/s >= {TARGET_WARM_VS_COLD} x cold",
                                   "ratio": r, "value": r["value"], "limit": TARGET_WARM_VS_COLD,
                                   "met": r["value"] >= TARGET_WARM_VS_COLD}
    same = "median clips/s, one thread per process, same clips"
    for variant, key, layout, note in (
            ("stoker-shards", "shards_vs_files", "tar shards",
             f"{same} and batches, same run: from tar shards of {CLIPS_PER_SHARD} clips / from loose files"),
            ("stoker-parquet", "parquet_vs_files", "Parquet",
             f"{same} and batches, same run: from Parquet files (row groups of {CLIPS_PER_SHARD} clips) / from "
             f"loose files"),
            ("stoker-shar", "shar_vs_files", "Shar",
             f"{same}, same run: from a Shar directory (shards of {CLIPS_PER_SHARD} cuts) / from loose files")):
        if "stoker" in judged and variant in judged:
            r = ratio(judged[variant]["clips_per_s"]["median"], judged["stoker"]["clips_per_s"]["median"], note=note)
            targets[key] = {"what": f"producer clips/s from {layout} >= {TARGET_SHARDS_VS_FILES} x from loose files",
                            "ratio": r, "value": r["value"], "limit": TARGET_SHARDS_VS_FILES,
                            "met": r["value"] >= TARGET_SHARDS_VS_FILES}
    result["targets"] = targets
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(root.parent / SHAR_DIR, ignore_errors=True)
    shutil.rmtree(root.parent / SHARDS_DIR, ignore_errors=True)
    shutil.rmtree(root.parent / PARQUET_DIR, ignore_errors=True)
    return result


# ------------------------------------------------------------------------ report


def run(plan: DataPlan | None = None, workdir: Path | None = None,
        log: Callable[[str], None] = _log, sections: Sequence[str] = ("index", "producer")) -> dict[str, Any]:
    """The sections (both by default); returns the report (machine facts, rows, targets)."""
    plan = plan or DataPlan()
    own = workdir is None
    base = Path(tempfile.mkdtemp(prefix="stoker-bench-data-")) if own else Path(workdir)
    base.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        report: dict[str, Any] = {"machine": machine_info(), "plan": plan.__dict__}
        if "index" in sections:
            report["index"] = run_index(plan, base, log)
        if "producer" in sections:
            report["producer"] = run_producer(plan, base, log)
    finally:
        if own:
            shutil.rmtree(base, ignore_errors=True)
    report["duration_s"] = round(time.monotonic() - started, 1)
    report["targets"] = [{"section": section, **t} for section in ("index", "producer") if section in report
                         for t in report[section]["targets"].values()]
    return report


def render_index(section: dict[str, Any]) -> str:
    """The index rows: build times cold and warm at each size."""
    idx = section["rows"]
    return "\n".join(["index (page cache warm; workers = processes reading headers)",
             table(["items", "cold s (median [min,max])", "warm s (median [min,max])", "cold us/item", "warm us/item",
                    "workers", "cache MB", "first batch s (cold)"],
                   [[r["items"], f"{r['cold_s']['median']:.3f} [{r['cold_s']['min']:.3f},{r['cold_s']['max']:.3f}]",
                     f"{r['warm_s']['median']:.3f} [{r['warm_s']['min']:.3f},{r['warm_s']['max']:.3f}]",
                     f"{r['cold_us_per_item']:.1f}", f"{r['warm_us_per_item']:.1f}", r["workers"],
                     f"{r['cache_bytes'] / 1e6:.1f}",
                     f"{r['with_dataset']['time_to_first_batch_s']:.2f}" if r.get("with_dataset") else "-"]
                    for r in idx])]
                     + ([_render_phonemes(section["phonemes"])] if "phonemes" in section else []))


def _render_phonemes(p: dict[str, Any]) -> str:
    return (f"phonemes front-end, {p['sentences']} sentences: phonemizing on one core "
            f"{p['one_core_stage_s']['median']:.2f} s ({p['sentences_per_s_per_core']:.0f} sentences/s per core), on "
            f"{p['cores']} cores {p['cold_stage_s']['median']:.2f} s; whole cold build {p['one_core_s']['median']:.2f} s "
            f"on one core, {p['cold_s']['median']:.2f} s on {p['cores']}; warm {p['warm_s']['median']:.3f} s")


def render(report: dict[str, Any]) -> str:
    lines = [render_index(report["index"])] if "index" in report else []
    prod = report.get("producer", {"threads": {}})
    if prod.get("index_s"):
        lines += ["", "cold index over the same clips: " + ", ".join(f"{k} {v:.2f} s" for k, v in prod["index_s"].items())]
    for threads, variants in prod["threads"].items():
        rows = []
        for name, v in variants.items():
            s = v["clips_per_s"]
            extra = ""
            if name == "stoker-warm" and v.get("fill_clips_per_s"):
                extra = f"first pass (compute + store): {v['fill_clips_per_s']:.1f} clips/s"
            rows.append([name, v.get("backend", ""), f"{s['median']:.1f}", f"{s['min']:.1f}", f"{s['max']:.1f}", s["n"],
                         extra])
        lines += ["", f"producer, {prod['clips']} clips in {prod['batches']} batches of {BATCH_SIZE}, "
                      f"{'one thread per process (judged)' if threads == '1' else 'default threading (informational)'}",
                  table(["variant", "backend", "clips/s", "min", "max", "passes", "note"], rows)]
    rows = []
    for t in report["targets"]:
        r = t.get("ratio")
        source = f"{r['numerator']:.4g} / {r['denominator']:.4g}" if r else ""
        rows.append([t["section"], t["what"], f"{t['value']:.4g}", source, f"{t['limit']:g}",
                     "met" if t["met"] else "NOT met"])
    lines += ["", "targets", table(["section", "target", "value", "from", "limit", "result"], rows)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.data")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    parser.add_argument("--out", default="bench-data.json", help="JSON report (default bench-data.json)")
    parser.add_argument("--workdir", help="where the generated datasets go (default: a temporary directory)")
    parser.add_argument("--only", choices=("index", "producer"), help="one section")
    parser.add_argument("--variants", help="the producer section's variants, comma-separated (default: all)")
    parser.add_argument("--clips", type=int, help="the producer section's clips (default 64; quick 32)")
    args = parser.parse_args(argv)
    plan = DataPlan.quick() if args.quick else DataPlan()
    if args.variants:
        plan.variants = args.variants.split(",")
    if args.clips:
        plan.clips = args.clips
    report = run(plan, Path(args.workdir) if args.workdir else None,
                 sections=(args.only,) if args.only else ("index", "producer"))
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(render(report))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
