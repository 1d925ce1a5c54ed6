"""Scale: a run over a manifest of millions of clips (the scale targets).

For each size N (default 1,000,000 and 10,000,000 clips), in a fresh directory:

- a JSON-lines manifest of N clips as a real corpus has them: each with its duration (1 to 20 s),
  id, speaker (one of SPEAKERS) and a text of its own of some 100 characters (WORDS_PER_TEXT
  words of a Zipf vocabulary), whose audio is one of AUDIO_FILES WAV files, one of each
  duration, reused (the disk holds the manifest and some 18 MB of audio);
- index build, cold: ``build_index`` in a child process of its own with no index cache
  (wall time, peak RSS); then the same warm (the cache it wrote is loaded);
- a run, warm: ``python -m stoker --data DIR --set data.metadata_file=manifest.jsonl --model
  synthetic:MS --producers P --steps S``: launch to first batch (from just before the
  command to the start of step 1, as benchmarks/alternatives.py measures it), steady
  samples/s (the steps after the first SETTLING_FRAC of them), and the peak RSS of the
  consumer (trainer and coordinator), of each producer and of the launcher, sampled every
  MEMORY_SAMPLE_S with psutil.

Parquet: the same N clips as Parquet files of PARQUET_FILE_ROWS rows in row groups
of PARQUET_GROUP_ROWS, laid out as the Hugging Face ``datasets`` library writes them (an
``audio`` struct of bytes and path, beside id, text, speaker and a duration column), each row's
audio one of AUDIO_FILES FLAC files of silence of its duration (~200 bytes), dictionary-encoded,
so that 10 M rows stay a few hundred MB; the same cold and warm index builds and run (``--data
DIR``: the directory of Parquet files), the cold build's CPU seconds (user and system, its helper
processes' included) and the load average beside its time, as a loaded machine stretches the
time, not the CPU. Targets at 10 M rows: cold index <= 60 s, warm launch to first batch <= 10 s,
consumer (whose coordinator holds the index) <= 1.5 GB.

The mix (``--mix-sizes``, default 1 M and 10 M clips): N clips in all as a mix of three
corpora, a JSON-lines manifest, Parquet files as ``datasets`` writes them and a lhotse cut
manifest (benchmarks/mix_corpus.py), generated a chunk at a time (its seconds and CPU seconds);
a cold build of each dataset alone and of the mix, each watched (:class:`BuildWatch`: the summed
RSS of its processes, stopped past BUILD_LIMIT_MB; the disk of its run files, which tell a build
that streamed from one in one process, and of its cache directory), the mix's warm load and its
run. Targets at 10^8 clips (MIX_TARGETS) and per-clip growth within MIX_GROWTH_LIMIT.

Per-clip growth: each figure at the largest size over the smallest, divided by the ratio of
the sizes (1.0: linear). Targets (10 M clips): consumer <= 1.5 GB, a producer
<= 400 MB, warm launch to first batch <= 10 s, cold build <= 60 s; at 1 M warm launch to
first batch <= 3 s; per-clip cost from the smallest to the largest within 1.2 x.

``python -m stoker.benchmarks.scale [--sizes 1000000,10000000] [--parquet-sizes 10000000] [--mix-sizes
1000000,10000000] [--corpora DIR [--generate-only]] [--no-parts-alone] [--json FILE]``, and the
``scale`` section of ``python run.py bench`` (full run only, at the sizes of ScalePlan).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import psutil
import soundfile

from . import mix_corpus
from .common import QUIET_ENV, STOKER, BenchError, fmt, run_alone, table
from ..shared.config import DataConfig, FeaturesConfig

# Distinct audio files the clips share, and their durations (s): every half second from 1 to 20 s,
# at the feature rate, so that a clip's duration is a real corpus's (its file has exactly that length).
AUDIO_SECONDS = tuple(1.0 + 0.5 * n for n in range(39))
AUDIO_FILES = len(AUDIO_SECONDS)
SAMPLE_RATE_HZ = FeaturesConfig.sample_rate_hz
# Speakers, as a multi-speaker corpus has them.
SPEAKERS = 2000
# Manifest lines are written this many at a time.
WRITE_CHUNK = 100_000
# Letters that make each clip's text its own without digits (which the text front-end would
# spell out, a cost of its own).
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# A text's words: WORDS_PER_TEXT (inclusive bounds) drawn from a vocabulary of VOCABULARY words by
# Zipf's law (ZIPF_EXPONENT), their letters by English letter frequency and their lengths as
# English words have them, with one word of the clip's own: some 100 characters a text, as
# LJSpeech's (~100) and the large read-speech corpora's.
WORDS_PER_TEXT = (14, 26)
VOCABULARY = 20_000
ZIPF_EXPONENT = 1.05
LETTER_FREQUENCY = {"e": 12.7, "t": 9.1, "a": 8.2, "o": 7.5, "i": 7.0, "n": 6.7, "s": 6.3, "h": 6.1, "r": 6.0,
                    "d": 4.3, "l": 4.0, "c": 2.8, "u": 2.8, "m": 2.4, "w": 2.4, "f": 2.2, "g": 2.0, "y": 2.0,
                    "p": 1.9, "b": 1.5, "v": 1.0, "k": 0.8, "j": 0.15, "x": 0.15, "q": 0.1, "z": 0.07}
# The short texts of the loose files' and the Parquet runs (the Parquet rows take AUDIO_SECONDS' durations).
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "voices", "read",
         "aloud", "from", "an", "old", "book")
# The generator's seed: the same corpus at every run.
SEED = 0
# Peak RSS is sampled this often.
MEMORY_SAMPLE_S = 0.2
# Steady samples/s is taken over the steps after this share of them.
SETTLING_FRAC = 0.2
# A child (index build or run) that takes longer has hung.
CHILD_TIMEOUT_S = 1800.0
# A watched cold build still going after this long is stopped, its figures kept (three times the
# 10^8 target's 20 minutes).
BUILD_TIMEOUT_S = 3600.0
# Roles of the processes of a run, by a part of their command line.
ROLES = (("producer", "stoker.producer.worker"), ("consumer", "stoker.consumer.training.main"))
# The scale targets: (figure, size it applies to, limit).
TARGETS = (("consumer_peak_rss_mb", 10_000_000, 1500.0), ("producer_peak_rss_mb", 10_000_000, 400.0),
           ("launch_to_first_batch_s", 10_000_000, 10.0), ("cold_build_s", 10_000_000, 60.0),
           ("launch_to_first_batch_s", 1_000_000, 3.0))
# The target of the loose files' runs: (figure, size, limit).
LOOSE_TARGETS = (("launch_to_first_batch_s", 1_000_000, 3.0),)
# The targets of the Parquet runs: (figure, size, limit).
PARQUET_TARGETS = (("cold_build_s", 10_000_000, 60.0), ("launch_to_first_batch_s", 10_000_000, 10.0),
                   ("consumer_peak_rss_mb", 10_000_000, 1500.0))
# Rows of a Parquet file and of its row groups (a row group of some 3 MB here; of datasets' own
# audio row groups, 100 rows of real audio, some 20 MB).
PARQUET_FILE_ROWS = 1_000_000
PARQUET_GROUP_ROWS = 10_000
# The Parquet dataset's metadata file: the pattern of its files (shared/dataset/shards.py).
PARQUET_PATTERN = "*.parquet"
# The loose files' metadata file (the LJSpeech layout's).
LOOSE_METADATA = "metadata.csv"
# Hard links to one loose file at most (ext4 allows 65,000).
LINKS_PER_FILE = 50_000
GROWTH_LIMIT = 1.2
MB = 1e6
# A cold build whose processes together pass this much RSS is stopped (:class:`BuildWatch`): it
# does not stream, and would take the memory of a host that others share.
BUILD_LIMIT_MB = 6000.0  # the target's peak for a build of 10^8 clips
# The targets at 10^8 clips, of the mix (benchmarks/mix_corpus.py): (figure, size, limit).
MIX_TARGETS = (("mix.cold_build_s", 100_000_000, 1200.0), ("mix.all_peak_rss_mb", 100_000_000, 6000.0),
               ("mix.launch_to_first_batch_s", 100_000_000, 15.0), ("mix.consumer_peak_rss_mb", 100_000_000, 2500.0),
               ("mix.producer_peak_rss_mb", 100_000_000, 150.0))
MIX_GROWTH_LIMIT = 1.1
# What the mix's tables show of each build (a part's alone, the mix's), and of the mix's run.
BUILD_FIGURES = ("wall_s", "cpu_s", "all_peak_rss_mb", "peak_rss_mb", "helper_peak_rss_mb", "spill_peak_mb",
                 "cache_dir_peak_mb", "cache_mb", "streamed", "killed", "timed_out")
MIX_FIGURES = ("warm_load_s", "launch_to_first_batch_s", "samples_per_s", "consumer_peak_rss_mb",
               "producer_peak_rss_mb", "launcher_peak_rss_mb")


@dataclass
class ScalePlan:
    sizes: tuple[int, ...] = (1_000_000, 10_000_000)
    loose_sizes: tuple[int, ...] = (1_000_000,)
    parquet_sizes: tuple[int, ...] = (10_000_000,)
    mix_sizes: tuple[int, ...] = (1_000_000, 10_000_000)
    loose_steps: int = 20  # the loose files' run: its launch to first batch, not its steady rate
    steps: int = 400
    step_ms: float = 5.0
    producers: int = 2
    batch_size: int = 16
    corpora_dir: str | None = None  # keep each generated mix there, and reuse one already there
    parts_alone: bool = True  # build each dataset of a mix alone before the mix
    generate_only: bool = False  # generate each mix, build nothing


def _word(n: int) -> str:
    """``n`` spelled in letters (base 26): a word of its own for every clip."""
    out = ""
    while True:
        out += LETTERS[n % 26]
        n //= 26
        if not n:
            return out


def _vocabulary(rng: np.random.Generator) -> list[str]:
    """VOCABULARY words of English-like letters and lengths (a gamma of mean ~4.6 letters)."""
    letters = np.array(list(LETTER_FREQUENCY))
    weights = np.array(list(LETTER_FREQUENCY.values()))
    lengths = np.maximum(1, rng.gamma(2.2, 2.1, VOCABULARY).astype(np.int64))
    drawn = rng.choice(letters, size=int(lengths.sum()), p=weights / weights.sum())
    ends = np.cumsum(lengths)
    return ["".join(drawn[end - n:end]) for n, end in zip(lengths.tolist(), ends.tolist())]


def _zipf(words: int) -> np.ndarray:
    """The probability of each of ``words`` words, by rank (Zipf's law, ZIPF_EXPONENT)."""
    weights = 1.0 / np.arange(1, words + 1) ** ZIPF_EXPONENT
    return weights / weights.sum()


def _texts(rng: np.random.Generator, vocabulary: list[str], zipf: np.ndarray, first: int, count: int) -> list[str]:
    """The texts of clips ``first`` to ``first + count``: a sentence each (module docstring), its
    words drawn with probabilities ``zipf``, its clip's own word (:func:`_word`) among them, so no
    two clips share a text."""
    counts = rng.integers(WORDS_PER_TEXT[0], WORDS_PER_TEXT[1] + 1, count)
    drawn = rng.choice(len(vocabulary), size=int(counts.sum()), p=zipf).tolist()
    texts, at = [], 0
    for n, words in enumerate(counts.tolist()):
        chosen = [vocabulary[w] for w in drawn[at:at + words - 1]]
        at += words - 1
        chosen.insert(len(chosen) // 2, _word(first + n))
        sentence = " ".join(chosen)
        texts.append(sentence[0].upper() + sentence[1:] + ".")
    return texts


def make_dataset(root: Path, size: int) -> Path:
    """The manifest of ``size`` clips and the audio files they share (module docstring): texts,
    speakers and durations as a real corpus has them, the same at every run (SEED)."""
    audio = root / "audio"
    audio.mkdir(parents=True, exist_ok=True)
    for n, seconds in enumerate(AUDIO_SECONDS):
        frames = np.arange(int(seconds * SAMPLE_RATE_HZ))
        soundfile.write(str(audio / f"a{n}.wav"), 0.1 * ((frames * (n + 3)) % 200 - 100) / 100, SAMPLE_RATE_HZ,
                        subtype="PCM_16")
    rng = np.random.default_rng(SEED)
    vocabulary = _vocabulary(rng)
    zipf = _zipf(len(vocabulary))
    manifest = root / "manifest.jsonl"
    with open(manifest, "w", encoding="utf-8") as f:
        for start in range(0, size, WRITE_CHUNK):
            count = min(size, start + WRITE_CHUNK) - start
            texts = _texts(rng, vocabulary, zipf, start, count)
            kinds = rng.integers(0, AUDIO_FILES, count).tolist()
            speakers = rng.integers(0, SPEAKERS, count).tolist()
            lines = [json.dumps({"audio_filepath": f"audio/a{k}.wav", "id": f"c{start + n:09d}", "text": text,
                                 "duration": AUDIO_SECONDS[k], "speaker": f"s{speaker}"})
                     for n, (text, k, speaker) in enumerate(zip(texts, kinds, speakers))]
            f.write("\n".join(lines) + "\n")
    return manifest


def make_loose(root: Path, size: int) -> Path:
    """An LJSpeech layout of ``size`` loose files (module docstring): metadata.csv, a text of its
    own per clip, and ``wavs/ID.wav`` each a hard link to one clip (kept beside ``wavs/``, not in
    it; a copy of it every LINKS_PER_FILE links, the file system's limit of links to a file)."""
    wavs = root / "wavs"
    wavs.mkdir(parents=True, exist_ok=True)
    frames = int(AUDIO_SECONDS[0] * SAMPLE_RATE_HZ)
    tone = [0.1 * ((i * 3) % 200 - 100) / 100 for i in range(frames)]
    metadata = root / LOOSE_METADATA
    link = os.link
    clip = root / "clip.wav"
    with open(metadata, "w", encoding="utf-8") as f:
        for start in range(0, size, WRITE_CHUNK):
            lines = []
            for i in range(start, min(size, start + WRITE_CHUNK)):
                if i % LINKS_PER_FILE == 0:
                    clip = root / f"clip{i // LINKS_PER_FILE}.wav"
                    soundfile.write(str(clip), tone, SAMPLE_RATE_HZ, subtype="PCM_16")
                sample_id = f"c{i:09d}"
                text = " ".join((WORDS[i % len(WORDS)], _word(i), WORDS[(i // 7) % len(WORDS)])) + "."
                lines.append(f"{sample_id}|{text}|{text}")
                link(clip, wavs / f"{sample_id}.wav")
            f.write("\n".join(lines) + "\n")
    return metadata


def make_parquet(root: Path, size: int) -> Path:
    """The Parquet files of ``size`` rows (module docstring); returns their directory."""
    import pyarrow as pa  # the parquet extra's, for this layout only
    import pyarrow.parquet as pq  # (as above)

    root.mkdir(parents=True, exist_ok=True)
    flacs = []
    for seconds in AUDIO_SECONDS:
        with tempfile.SpooledTemporaryFile() as f:
            soundfile.write(f, np.zeros(int(seconds * SAMPLE_RATE_HZ), np.int16), SAMPLE_RATE_HZ, format="FLAC",
                            subtype="PCM_16")
            f.seek(0)
            flacs.append(f.read())
    schema = pa.schema([("audio", pa.struct([("bytes", pa.binary()), ("path", pa.string())])), ("id", pa.string()),
                        ("text", pa.string()), ("speaker", pa.string()), ("duration", pa.float64())])
    for first in range(0, size, PARQUET_FILE_ROWS):
        path = root / f"train-{first // PARQUET_FILE_ROWS:05d}.parquet"
        with pq.ParquetWriter(path, schema, compression="snappy") as writer:
            for start in range(first, min(size, first + PARQUET_FILE_ROWS), PARQUET_GROUP_ROWS):
                rows = range(start, min(size, first + PARQUET_FILE_ROWS, start + PARQUET_GROUP_ROWS))
                kinds = [i % AUDIO_FILES for i in rows]
                audio = pa.StructArray.from_arrays([pa.array([flacs[k] for k in kinds], pa.binary()),
                                                    pa.array([f"a{k}.flac" for k in kinds])], ["bytes", "path"])
                texts = [" ".join((WORDS[i % len(WORDS)], _word(i), WORDS[(i // 7) % len(WORDS)],
                                   WORDS[(i // 3) % len(WORDS)])) + "." for i in rows]
                writer.write_table(pa.table({"audio": audio, "id": [f"c{i:09d}" for i in rows], "text": texts,
                                             "speaker": [f"s{i % SPEAKERS}" for i in rows],
                                             "duration": [AUDIO_SECONDS[k] for k in kinds]}, schema=schema),
                                   row_group_size=PARQUET_GROUP_ROWS)
    return root


def index_child(root: str, metadata_file: str = "manifest.jsonl") -> None:
    """In a child process: build (or load) the index of ``root``'s metadata; its figures as JSON."""
    from ..consumer.index.index import build_index  # the child's own import: its cost is the child's
    started = time.perf_counter()
    index = build_index(DataConfig(path=root, metadata_file=metadata_file), FeaturesConfig())
    seconds = time.perf_counter() - started
    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    peak_mb, helper_mb = (u.ru_maxrss * 1024 / MB for u in used)  # Linux: KiB; the largest helper's (reaped)
    peak_mb = _high_water_mb() or peak_mb  # ru_maxrss keeps the parent's peak across fork and exec
    cpu_s = sum(u.ru_utime + u.ru_stime for u in used)  # the helper processes' too (reaped: RUSAGE_CHILDREN)
    print(json.dumps({"seconds": seconds, "cpu_s": cpu_s, "peak_rss_mb": peak_mb, "helper_peak_rss_mb": helper_mb,
                      "clips": len(index.samples),
                      "rejected": len(index.rejected), "cache": index.stats.cache}))


class BuildWatch:
    """What a cold build holds while it runs, sampled every MEMORY_SAMPLE_S: the summed RSS of the
    process and its helpers, and the bytes on disk of its run files (``.spill-*``) and of the
    cache directory ``cache_dir`` (runs and the cache file written); the build is killed when its
    processes pass ``limit_mb`` (a build that does not stream would take the host's memory)."""

    def __init__(self, proc: subprocess.Popen, cache_dir: Path, limit_mb: float) -> None:
        self.proc, self.cache_dir, self.limit_mb = proc, cache_dir, limit_mb
        self.rss_mb = self.spill_mb = self.disk_mb = 0.0
        self.killed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.proc.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                procs = []
            rss = 0
            for p in procs:
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    continue
            self.rss_mb = max(self.rss_mb, rss / MB)
            if self.rss_mb > self.limit_mb and not self.killed:
                self.killed = True
                for p in reversed(procs):
                    try:
                        p.kill()
                    except psutil.Error:
                        continue
            spill = sum(mix_corpus.disk_bytes(d) for d in self.cache_dir.glob(".spill-*"))
            self.spill_mb = max(self.spill_mb, spill / MB)
            self.disk_mb = max(self.disk_mb, mix_corpus.disk_bytes(self.cache_dir) / MB)
            self._stop.wait(MEMORY_SAMPLE_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _watched_index(root: Path, metadata_file: str, limit_mb: float) -> dict[str, Any]:
    """:func:`_index`, cold, watched (:class:`BuildWatch`): its figures, and ``streamed`` (it
    spilled run files: the chunked build), or ``killed`` with the memory it had reached, or
    ``timed_out`` past BUILD_TIMEOUT_S with the figures it had reached."""
    argv = [sys.executable, "-m", "stoker.benchmarks.scale", "index-child", str(root), metadata_file]
    load = os.getloadavg()[0]
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                env={**os.environ, **QUIET_ENV})
        watch = BuildWatch(proc, root / ".stoker", limit_mb)
        timed_out = False
        try:
            code = proc.wait(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code, timed_out = proc.wait(), True
        finally:
            watch.stop()
        wall = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        text, problem = out.read(), err.read()
    figures = {"wall_s": wall, "all_peak_rss_mb": watch.rss_mb, "spill_peak_mb": watch.spill_mb,
               "cache_dir_peak_mb": watch.disk_mb, "streamed": watch.spill_mb > 0, "killed": watch.killed,
               "timed_out": timed_out, "load_before": load, "load_after": os.getloadavg()[0]}
    if watch.killed or timed_out:
        return figures
    if code != 0:
        raise BenchError(f"index build failed: {problem.strip()[-2000:]}")
    return {**json.loads(text.strip().splitlines()[-1]), **figures}


def _high_water_mb() -> float | None:
    """This process's peak RSS since its exec (Linux's VmHWM), None where not known."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 / MB for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None


def _index(root: Path, metadata_file: str = "manifest.jsonl") -> dict[str, Any]:
    argv = [sys.executable, "-m", "stoker.benchmarks.scale", "index-child", str(root), metadata_file]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                          env={**os.environ, **QUIET_ENV}, check=False)
    if done.returncode != 0:
        raise BenchError(f"index build failed: {done.stderr.strip()[-2000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - started}


class RoleSampler:
    """Peak RSS of each process under ``root``, by role (ROLES; the rest is the launcher)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.peak: dict[int, tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _role(self, proc: psutil.Process) -> str:
        line = " ".join(proc.cmdline())
        return next((role for role, mark in ROLES if mark in line), "launcher")

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.root)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                procs = []
            for p in procs:
                try:  # the role of every sample: a child forked and not yet exec'ed shows its parent's command
                    role = self._role(p)
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                self.peak[p.pid] = (role, max(self.peak.get(p.pid, (role, 0))[1], rss))
            self._stop.wait(MEMORY_SAMPLE_S)

    def peaks_mb(self) -> dict[str, float]:
        """The largest peak of a process of each role."""
        self._stop.set()
        self._thread.join(5)
        out: dict[str, float] = {}
        for role, rss in self.peak.values():
            out[role] = max(out.get(role, 0.0), rss / MB)
        return out


def _run(root: Path, plan: ScalePlan, work: Path, metadata_file: str = "manifest.jsonl",
         steps: int | None = None) -> dict[str, Any]:
    run_dir = work / "run"
    argv = [*STOKER, "--data", str(root), "--set", f"data.metadata_file={metadata_file}",
            "--model", f"synthetic:{plan.step_ms:g}", "--producers", str(plan.producers),
            "--steps", str(steps or plan.steps),
            "--batch-size", str(plan.batch_size), "--model-start-delay", "0", "--run-dir", str(run_dir),
            "--log-level", "WARNING"]
    log_path = work / "run.log"
    started = time.time()
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **QUIET_ENV})
    sampler = RoleSampler(proc.pid)
    try:
        code = proc.wait(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise BenchError(f"the run timed out: {' '.join(argv)}") from None
    finally:
        peaks = sampler.peaks_mb()
    if code != 0:
        raise BenchError(f"the run exited with status {code}: {log_path.read_text()[-2000:]}")
    rows = sorted((json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()),
                  key=lambda r: r["step"])
    live = json.loads((run_dir / "live.json").read_text())
    consumer_start_unix = live["wall_time"] - live["t"]
    first_unix = consumer_start_unix + rows[0]["t"] - rows[0]["step_ms"] / 1000
    steady = rows[int(len(rows) * SETTLING_FRAC):]
    seconds = steady[-1]["t"] - steady[0]["t"]
    samples = sum(r["samples"] for r in steady[1:])
    return {"launch_to_first_batch_s": first_unix - started, "samples_per_s": samples / seconds if seconds else 0.0,
            "consumer_peak_rss_mb": peaks.get("consumer", 0.0), "producer_peak_rss_mb": peaks.get("producer", 0.0),
            "launcher_peak_rss_mb": peaks.get("launcher", 0.0), "steps": len(rows),
            "command": "python -m stoker " + " ".join(argv[3:])}


def run_size(size: int, plan: ScalePlan, work: Path, log: Callable[[str], None]) -> dict[str, Any]:
    root = work / f"n{size}"
    started = time.perf_counter()
    manifest = make_dataset(root, size)
    log(f"scale {size}: manifest of {manifest.stat().st_size / MB:.0f} MB written in "
        f"{time.perf_counter() - started:.0f} s")
    cold = _index(root)
    log(f"scale {size}: cold index build {cold['seconds']:.1f} s ({cold['cpu_s']:.1f} s of CPU), peak RSS "
        f"{cold['peak_rss_mb']:.0f} MB (largest helper {cold['helper_peak_rss_mb']:.0f} MB)")
    warm = _index(root)
    log(f"scale {size}: warm index load {warm['seconds']:.2f} s ({warm['cache']}), peak RSS "
        f"{warm['peak_rss_mb']:.0f} MB")
    run = _run(root, plan, root)
    log(f"scale {size}: launch to first batch {run['launch_to_first_batch_s']:.2f} s, "
        f"{run['samples_per_s']:.0f} samples/s, consumer {run['consumer_peak_rss_mb']:.0f} MB, producer "
        f"{run['producer_peak_rss_mb']:.0f} MB")
    index_mb = sum(p.stat().st_size for p in (root / ".stoker").glob("index-*")) / MB
    shutil.rmtree(root, ignore_errors=True)
    return {"clips": size, "cold_build_s": cold["seconds"], "cold_build_peak_rss_mb": cold["peak_rss_mb"],
            "cold_build_helper_peak_rss_mb": cold["helper_peak_rss_mb"], "warm_load_s": warm["seconds"],
            "warm_load_peak_rss_mb": warm["peak_rss_mb"],
            "index_cache_mb": index_mb, "usable": cold["clips"], "rejected": cold["rejected"], **run}


def run_parquet(size: int, plan: ScalePlan, work: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """The Parquet case at ``size`` rows (module docstring)."""
    root = work / f"parquet{size}"
    started = time.perf_counter()
    make_parquet(root, size)
    on_disk = sum(p.stat().st_size for p in root.glob(PARQUET_PATTERN)) / MB
    log(f"parquet {size}: {on_disk:.0f} MB of Parquet files written in {time.perf_counter() - started:.0f} s")
    load = os.getloadavg()[0]
    cold = _index(root, PARQUET_PATTERN)
    log(f"parquet {size}: cold index build {cold['seconds']:.1f} s ({cold['cpu_s']:.1f} s of CPU, the helper "
        f"processes' included; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after), peak RSS "
        f"{cold['peak_rss_mb']:.0f} MB")
    warm = _index(root, PARQUET_PATTERN)
    log(f"parquet {size}: warm index load {warm['seconds']:.2f} s ({warm['cache']}), peak RSS "
        f"{warm['peak_rss_mb']:.0f} MB")
    run = _run(root, plan, root, PARQUET_PATTERN, plan.loose_steps)
    log(f"parquet {size}: launch to first batch {run['launch_to_first_batch_s']:.2f} s, consumer "
        f"{run['consumer_peak_rss_mb']:.0f} MB, producer {run['producer_peak_rss_mb']:.0f} MB")
    index_mb = sum(p.stat().st_size for p in (root / ".stoker").glob("*")) / MB
    shutil.rmtree(root, ignore_errors=True)
    return {"clips": size, "parquet_mb": on_disk, "cold_build_s": cold["seconds"], "cold_build_cpu_s": cold["cpu_s"],
            "cold_build_peak_rss_mb": cold["peak_rss_mb"], "warm_load_s": warm["seconds"],
            "warm_load_peak_rss_mb": warm["peak_rss_mb"], "warm_cache": warm["cache"], "index_cache_mb": index_mb,
            "usable": cold["clips"], "rejected": cold["rejected"], **run}


def run_loose(size: int, plan: ScalePlan, work: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """The loose files' case at ``size`` clips (module docstring)."""
    root = work / f"loose{size}"
    started = time.perf_counter()
    make_loose(root, size)
    log(f"loose {size}: metadata.csv and {size:,} links written in {time.perf_counter() - started:.0f} s")
    cold = _index(root, LOOSE_METADATA)
    log(f"loose {size}: cold index build {cold['seconds']:.1f} s, peak RSS {cold['peak_rss_mb']:.0f} MB")
    warm = _index(root, LOOSE_METADATA)
    log(f"loose {size}: warm index load {warm['seconds']:.2f} s ({warm['cache']}), peak RSS "
        f"{warm['peak_rss_mb']:.0f} MB")
    run = _run(root, plan, root, LOOSE_METADATA, plan.loose_steps)
    log(f"loose {size}: launch to first batch {run['launch_to_first_batch_s']:.2f} s, "
        f"{run['samples_per_s']:.0f} samples/s")
    shutil.rmtree(root, ignore_errors=True)
    return {"clips": size, "cold_build_s": cold["seconds"], "cold_build_peak_rss_mb": cold["peak_rss_mb"],
            "cold_build_helper_peak_rss_mb": cold["helper_peak_rss_mb"], "warm_load_s": warm["seconds"],
            "warm_load_peak_rss_mb": warm["peak_rss_mb"], "warm_cache": warm["cache"],
            "usable": cold["clips"], "rejected": cold["rejected"], **run}


def run_mix(size: int, plan: ScalePlan, work: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """The mix of three corpora at ``size`` clips (benchmarks/mix_corpus.py): its generation, a
    cold build of each dataset alone and of the mix (watched: memory, run files, the cache), then
    the mix's warm load and run. Figures are named ``SCOPE.FIGURE`` (SCOPE: a dataset, or mix)."""
    kept = plan.corpora_dir is not None
    root = (Path(plan.corpora_dir) if kept else work) / f"mix{size}"
    row = _generated(root, size, log)
    if plan.generate_only:
        return row
    try:
        for where in [root, *(root / part.directory for part in mix_corpus.PARTS)]:
            shutil.rmtree(where / ".stoker", ignore_errors=True)  # a kept corpus's cache of a run before
        for part in mix_corpus.PARTS if plan.parts_alone else ():
            where = root / part.directory
            _cold(row, part.name, where, part.metadata_file, log)
            shutil.rmtree(where / ".stoker", ignore_errors=True)
        _cold(row, "mix", root, mix_corpus.MIX_FILE, log)
        if not (row["mix.killed"] or row["mix.timed_out"]):
            warm = _index(root, mix_corpus.MIX_FILE)
            row["mix.warm_load_s"] = warm["seconds"]
            run = _run(root, plan, root, mix_corpus.MIX_FILE)
            row.update({f"mix.{k}": v for k, v in run.items()})
            log(f"mix {size}: warm load {warm['seconds']:.2f} s, launch to first batch "
                f"{run['launch_to_first_batch_s']:.2f} s, consumer {run['consumer_peak_rss_mb']:.0f} MB, producer "
                f"{run['producer_peak_rss_mb']:.0f} MB")
    finally:
        if kept:  # the corpus stays; its cache and run go
            shutil.rmtree(root / ".stoker", ignore_errors=True)
            shutil.rmtree(root / "run", ignore_errors=True)
            (root / "run.log").unlink(missing_ok=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
    return row


# A kept mix's record of its generation, written once the corpus is whole.
GENERATED_FILE = "generated.json"


def _generated(root: Path, size: int, log: Callable[[str], None]) -> dict[str, Any]:
    """The mix of ``size`` clips at ``root``, generated unless a whole one of that size is there
    (its :data:`GENERATED_FILE`): the row's clips, generation figures and corpus sizes."""
    record = root / GENERATED_FILE
    if record.exists():
        row = json.loads(record.read_text())
        if row.get("clips") == size:
            log(f"mix {size}: reusing the corpus at {root} (generated in {row['generation_s']:.0f} s, "
                f"{row['generation_cpu_s']:.0f} s of CPU)")
            return row
    started, cpu = time.perf_counter(), time.process_time()
    mix_corpus.write_mix(root, size, log)
    row = {"clips": size, "generation_s": time.perf_counter() - started, "generation_cpu_s": time.process_time() - cpu}
    for part in mix_corpus.PARTS:
        row[f"{part.name}.corpus_mb"] = mix_corpus.disk_bytes(root / part.directory) / MB
    record.write_text(json.dumps(row))
    log(f"mix {size}: generated in {row['generation_s']:.0f} s ({row['generation_cpu_s']:.0f} s of CPU)")
    return row


def _cold(row: dict[str, Any], scope: str, root: Path, metadata_file: str, log: Callable[[str], None]) -> None:
    """A watched cold build of ``root``'s ``metadata_file`` (:func:`_watched_index`) into ``row``."""
    cold = _watched_index(root, metadata_file, BUILD_LIMIT_MB)
    cold["cache_mb"] = mix_corpus.disk_bytes(root / ".stoker") / MB
    cold.setdefault("cpu_s", None)
    row.update({f"{scope}.{k}": cold.get(k) for k in BUILD_FIGURES})
    row[f"{scope}.cold_build_s"] = cold["wall_s"]
    if cold["killed"]:
        log(f"mix {row['clips']}: {scope} cold build stopped at {cold['all_peak_rss_mb']:.0f} MB of its processes "
            f"(limit {BUILD_LIMIT_MB:.0f} MB), after {cold['wall_s']:.0f} s")
        return
    if cold["timed_out"]:
        log(f"mix {row['clips']}: {scope} cold build stopped after {cold['wall_s']:.0f} s (limit {BUILD_TIMEOUT_S:.0f} s"
            f"), processes' peak {cold['all_peak_rss_mb']:.0f} MB, run files' peak {cold['spill_peak_mb']:.0f} MB")
        return
    log(f"mix {row['clips']}: {scope} cold build {cold['wall_s']:.1f} s ({cold['cpu_s']:.1f} s of CPU, load "
        f"{cold['load_before']:.1f} to {cold['load_after']:.1f}), {'streamed' if cold['streamed'] else 'one process'}"
        f", processes' peak {cold['all_peak_rss_mb']:.0f} MB (main {cold['peak_rss_mb']:.0f}, largest helper "
        f"{cold['helper_peak_rss_mb']:.0f}), run files' peak {cold['spill_peak_mb']:.0f} MB, cache "
        f"{cold['cache_mb']:.0f} MB")


GROWN = ("cold_build_s", "warm_load_s", "consumer_peak_rss_mb", "producer_peak_rss_mb", "launch_to_first_batch_s",
         "index_cache_mb")


def run(plan: ScalePlan | None = None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    plan = plan or ScalePlan()
    log = log or (lambda text: None)
    work = Path(tempfile.mkdtemp(prefix="stoker-bench-scale-"))
    try:
        rows = [run_size(size, plan, work, log) for size in plan.sizes]
        loose = [run_loose(size, plan, work, log) for size in plan.loose_sizes]
        parquet = [run_parquet(size, plan, work, log) for size in plan.parquet_sizes]
        mixes = [run_mix(size, plan, work, log) for size in plan.mix_sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    growth: dict[str, float | None] = {}
    if rows:
        small, large = rows[0], rows[-1]
        factor = large["clips"] / small["clips"]
        growth = {k: (large[k] / small[k]) / factor if small[k] and factor > 1 else None for k in GROWN}
    targets = (_met(TARGETS, rows, "clips") + _met(LOOSE_TARGETS, loose, "loose files")
               + _met(PARQUET_TARGETS, parquet, "Parquet rows"))
    targets += [{"what": f"per-clip growth of {k}", "value": g, "limit": GROWTH_LIMIT, "met": g <= GROWTH_LIMIT}
                for k, g in growth.items() if g is not None and k != "launch_to_first_batch_s"]
    mix_growth = _growth(mixes)
    targets += _met(MIX_TARGETS, mixes, "clips in a mix")
    targets += [{"what": f"per-clip growth of {k} in the mix", "value": g, "limit": MIX_GROWTH_LIMIT,
                 "met": g <= MIX_GROWTH_LIMIT}
                for k, g in mix_growth.items() if g is not None and k.startswith("mix.") and k[4:] in MIX_GROWN]
    return {"plan": plan.__dict__, "sizes": rows, "loose": loose, "parquet": parquet, "mix": mixes,
            "growth_per_clip": growth, "mix_growth_per_clip": mix_growth, "targets": targets}


# The mix's figures whose per-clip growth has a target (from 10^7 to 10^8: within MIX_GROWTH_LIMIT).
MIX_GROWN = ("cold_build_s", "all_peak_rss_mb", "launch_to_first_batch_s", "consumer_peak_rss_mb",
             "producer_peak_rss_mb")


def _growth(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each numeric figure at the largest size over the smallest, per clip (1.0: linear)."""
    if len(rows) < 2:
        return {}
    small, large = rows[0], rows[-1]
    factor = large["clips"] / small["clips"]
    return {k: (large[k] / small[k]) / factor if isinstance(small[k], float) and small[k] and
            isinstance(large.get(k), float) else None for k in small if k != "clips"}


def _met(limits: tuple[tuple[str, int, float], ...], rows: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
    """Each of ``limits`` (figure, size, limit) that ``rows`` measured, met or not."""
    out = []
    for figure, size, limit in limits:
        row = next((r for r in rows if r["clips"] == size), None)
        if row is not None and row.get(figure) is not None:
            out.append({"what": f"{figure} at {size:,} {what}", "value": row[figure], "limit": limit,
                        "met": row[figure] <= limit})
    return out


def render(result: dict[str, Any]) -> str:
    rows, loose, parquet = result["sizes"], result.get("loose", []), result.get("parquet", [])
    figures = ("cold_build_s", "cold_build_peak_rss_mb", "warm_load_s", "index_cache_mb", "launch_to_first_batch_s",
               "samples_per_s", "consumer_peak_rss_mb", "producer_peak_rss_mb", "launcher_peak_rss_mb")
    parts = []
    if rows:
        body = [[name, *(fmt(r[name]) for r in rows), fmt(result["growth_per_clip"].get(name))] for name in figures]
        parts.append(table(["figure", *(f"{r['clips']:,} clips" for r in rows), "per-clip growth"], body))
    if loose:
        body = [[name, *(fmt(r[name]) for r in loose)] for name in figures if name != "index_cache_mb"]
        parts.append(table(["figure", *(f"{r['clips']:,} loose files" for r in loose)], body))
    if parquet:
        body = [[name, *(fmt(r[name]) for r in parquet)] for name in ("parquet_mb", "cold_build_cpu_s", *figures)]
        parts.append(table(["figure", *(f"{r['clips']:,} Parquet rows" for r in parquet)], body))
    mixes = result.get("mix", [])
    if mixes:
        growth = result.get("mix_growth_per_clip", {})
        names = ["generation_s", "generation_cpu_s", *(f"{p.name}.corpus_mb" for p in mix_corpus.PARTS)]
        for scope in [p.name for p in mix_corpus.PARTS] + ["mix"]:
            names += [f"{scope}.{k}" for k in BUILD_FIGURES + (MIX_FIGURES if scope == "mix" else ())]
        body = [[name, *(fmt(r.get(name)) for r in mixes), fmt(growth.get(name))] for name in names]
        parts.append(table(["figure", *(f"{r['clips']:,} clips in a mix" for r in mixes), "per-clip growth"], body))
    marks = [f"{'met' if t['met'] else 'NOT met'}: {t['what']} = {fmt(t['value'])} (limit {t['limit']:g})"
             for t in result["targets"]]
    commands = [r[-1].get("command", r[-1].get("mix.command")) for r in (rows, loose, parquet, mixes) if r]
    return "\n".join([*parts, *marks, *(f"command: {c}" for c in commands if c)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.scale")
    parser.add_argument("--sizes", help="clips per run, comma-separated (default 1000000,10000000)")
    parser.add_argument("--loose-sizes", help="loose files per run of an LJSpeech layout (default 1000000)")
    parser.add_argument("--parquet-sizes", help="rows per run of Parquet files (default 10000000)")
    parser.add_argument("--mix-sizes", help="clips per run of a mix of three corpora (default 1000000,10000000)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--corpora", help="keep each generated mix in this directory, and reuse one already there")
    parser.add_argument("--no-parts-alone", action="store_true", help="build only the mix, not each dataset alone first")
    parser.add_argument("--generate-only", action="store_true", help="generate each mix (into --corpora), build nothing")
    parser.add_argument("--json", help="also write the figures to this file")
    args, rest = parser.parse_known_args(argv)
    if rest[:1] == ["index-child"]:
        index_child(*rest[1:3])
        return 0
    plan = ScalePlan()
    if args.sizes is not None:
        plan.sizes = tuple(int(n) for n in args.sizes.split(",") if n)
    if args.loose_sizes is not None:
        plan.loose_sizes = tuple(int(n) for n in args.loose_sizes.split(",") if n)
    if args.parquet_sizes is not None:
        plan.parquet_sizes = tuple(int(n) for n in args.parquet_sizes.split(",") if n)
    if args.mix_sizes is not None:
        plan.mix_sizes = tuple(int(n) for n in args.mix_sizes.split(",") if n)
    if args.steps:
        plan.steps = args.steps
    if args.generate_only and not args.corpora:
        parser.error("--generate-only keeps nothing without --corpora DIR")
    plan.corpora_dir, plan.parts_alone, plan.generate_only = args.corpora, not args.no_parts_alone, args.generate_only
    return run_alone("scale", lambda log: run(plan, log=log), render, args.json)


if __name__ == "__main__":
    sys.exit(main())
