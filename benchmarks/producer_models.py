"""Where a neural feature extractor runs (``python -m stoker.benchmarks.producer_models``).

One encoder (a convolutional encoder with a vector-quantised codebook: mel -> codes at a quarter
of the frame rate, as docs/examples/neural_features.py's, wider, so that it costs about as much
as the training step) and one trainer (text -> codes, cross-entropy, and a coarse mel), on the
demo data, in real runs (``python -m stoker``, 2 producers, numpy log-mels), four ways:

    none        the trainer alone: no encoder anywhere (its codes input is zeros)
    in step     (a) the encoder inside the training step, as common trainers run it: every
                step encodes its batch's mels before the model's forward pass
    producers   (b) the encoder as a producer model (transforms.models): the producers encode
                each batch, the trainer reads the codes
    cache       (c) as (b), from a feature cache that ``python run.py precompute`` filled first:
                no encoder runs at all (the log-mels come from the cache too, as for ``none``)

From each run's summary.json: samples/s after warm-up and the trainer's wait share
(``data_wait_frac``), medians over ``repetitions`` rounds of the four (alternated). Ratios:
(b) / (a) (target >= 1.3 where the encoder costs about a step) and (c) / none (target >=
0.95). ``none`` also reads its log-mels from the cache, so that (c) is compared with a run
doing the same work but the codes.

Each way runs in two layouts of the processes on the host's cores, in the same run:

    shared      every process may use every core (as a run is started): on a CPU-only host the
                encoder moved into the producers still takes the trainer's cores
    pinned      one core per device, the CPU analogue of a data GPU and a model GPU: the trainer
                on one core (the model device), the producers on another (the data device), so
                the producers' encoder runs beside the step instead of taking its core. The run's
                launcher starts with the data core's affinity, which its producers inherit before
                anything is imported; the trainer's threads are moved to the model core as soon
                as its process appears (TensorFlow sizes its thread pools from one core either
                way). Skipped, with the reason, on a host with fewer than 2 cores.

The PyTorch encoder (``torch_encoder``: the same layers in PyTorch) is measured the same four
ways, in both layouts, in a PyTorch loop on ``stoker.Feed(framework="torch")`` (a child
process each: ``python -m stoker.benchmarks.producer_models --child WAY``; no process imports
TensorFlow): none, (a) the encoder in the PyTorch step, (b) in the producers
(``transforms.models`` naming the module), (c) from a cache ``precompute`` filled with it. In
the pinned layout the loop's process starts on the data core, so that the producers it starts
inherit it, then moves its own threads to the trainer's core. PyTorch runs on one thread in
both layouts (its producers too), and its encoder has fewer layers (``TORCH_DEPTH``), so that
it costs about one PyTorch step.

The TensorFlow runs use no GPU: the pinned layout shows what separate devices change, not a GPU's
speed. The PyTorch runs, where CUDA is available, put the batches and the step on GPU 0 and the
producers' encoder on the same GPU (``data_gpu`` 0, as on a one-GPU host: producers and trainer
share it), the cache filled by ``precompute`` on it too; the result names the device.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil

from .common import QUIET_ENV, STOKER, BenchError, ratio, run_alone, spread, table

# The encoder's width: at B = 16 on the demo's buckets its forward pass costs about as much as
# the trainer's step (measured on the 2-core reference host; see docs/BENCHMARKS.md).
WIDTH = 256
GROUP = 4  # mel frames per code
CODEBOOK = 256
CODE_DIM = 32
SEED = 7
N_MELS = 80
BATCH_SIZE = 16
PRODUCERS = 2
MODEL_FIELDS = f"codes:int32:T/{GROUP}:-1"
ENCODER = "stoker.benchmarks.producer_models:encoder"
TRAINERS = {"none": "plain", "in step": "in_step", "producers": "on_codes", "cache": "on_codes"}
TARGET_PRODUCERS_VS_STEP = 1.3
TARGET_CACHE_VS_NONE = 0.95
RUN_TIMEOUT_S = 600.0
# The trainer's process, told from the producers' by its command line (stoker/launcher.py's consumer_argv).
TRAINER_MODULE = "stoker.consumer.training.main"
# How often the pinned layout looks for the trainer's process and threads before it has pinned
# it (its module's imports take far longer), and after (threads started later inherit the core).
PIN_POLL_S = 0.02
PIN_RECHECK_S = 0.5


@dataclass(frozen=True)
class Cores:
    """The pinned layout: the trainer's core (the model device) and the producers' (the data device)."""
    trainer: frozenset[int]
    producers: frozenset[int]


def split_cores(usable: set[int]) -> Cores | str:
    """One core for the trainer and another for the producers (and the launcher), or why not."""
    if len(usable) < 2:
        return f"the pinned layout needs 2 cores, this host lets this process use {len(usable)}"
    first, second = sorted(usable)[:2]
    return Cores(trainer=frozenset({first}), producers=frozenset({second}))


class _Pinner:
    """Moves every thread of a run's trainer to the trainer's core while the run lives, and
    checks that its producers kept the data core they inherited from the launcher."""

    def __init__(self, launcher: subprocess.Popen, cores: Cores) -> None:
        self.launcher, self.cores = launcher, cores
        self.trainer_threads_moved = 0
        self.seen: dict[int, str] = {}  # pid -> "trainer" or "producer"
        self.stray: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="pinner", daemon=True)

    def _watch(self) -> None:
        root = psutil.Process(self.launcher.pid)
        while not self.stop.is_set():
            try:
                children = root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for child in children:
                self._pin(child)
            self.stop.wait(PIN_RECHECK_S if "trainer" in self.seen.values() else PIN_POLL_S)

    def _pin(self, child: psutil.Process) -> None:
        """The trainer and the processes it starts (its models' versions are taken in a child)
        go to the trainer's core; every other process of the run must have kept the data core."""
        try:
            run = [child, *itertools.takewhile(lambda p: p.pid != self.launcher.pid, child.parents())]
            trainer = any(TRAINER_MODULE in p.cmdline() for p in run)
            tids = [t.id for t in child.threads()]
        except psutil.NoSuchProcess:
            return
        self.seen[child.pid] = "trainer" if trainer else "producer"
        for tid in tids:
            try:
                if trainer and os.sched_getaffinity(tid) != self.cores.trainer:
                    os.sched_setaffinity(tid, self.cores.trainer)
                    self.trainer_threads_moved += 1
                elif not trainer and os.sched_getaffinity(tid) != self.cores.producers:
                    self.stray.append(f"{' '.join(child.cmdline()[1:3])} (pid {child.pid}) thread {tid}")
            except (ProcessLookupError, psutil.NoSuchProcess):
                continue  # the thread or its process ended between listing and pinning

    def check(self) -> dict[str, Any]:
        trainers = sum(role == "trainer" for role in self.seen.values())
        if not trainers or self.stray:
            raise BenchError(f"the pinned layout did not hold: {trainers} trainer processes seen, threads off the "
                             f"data core: {sorted(set(self.stray))[:5]}")
        return {"trainer_core": sorted(self.cores.trainer), "producer_core": sorted(self.cores.producers),
                "trainer_processes": trainers, "producer_processes": len(self.seen) - trainers,
                "trainer_threads_moved": self.trainer_threads_moved}


@dataclass
class ProducerModelsPlan:
    steps: int = 120
    repetitions: int = 2  # of each way, alternated (the order reversed every other round): medians
    frameworks: tuple[str, ...] = ("tensorflow", "torch")  # whose encoder and step are measured

    @classmethod
    def quick(cls) -> "ProducerModelsPlan":
        return cls(steps=60, repetitions=1)


def encoder() -> Any:
    """The producer model: mel, mel_lengths -> codes [B, T/4] (seeded weights, the same in
    every process)."""
    import keras
    import tensorflow as tf
    from keras import layers

    def init(n: int) -> Any:
        return keras.initializers.GlorotUniform(seed=SEED + n)

    mel = keras.Input((None, N_MELS), name="mel")
    lengths = keras.Input((), dtype="int32", name="mel_lengths")

    def masked(a: Any) -> Any:
        x, n = a
        return x * tf.sequence_mask(n, tf.shape(x)[1], dtype=x.dtype)[..., None]

    x = layers.Lambda(masked)([mel, lengths])
    x = layers.Lambda(lambda a: tf.pad(a, [[0, 0], [0, -tf.shape(a)[1] % GROUP], [0, 0]]))(x)
    x = layers.Conv1D(WIDTH, GROUP, strides=GROUP, activation="relu", kernel_initializer=init(1))(x)
    for n in range(2, 7):
        x = x + layers.Conv1D(WIDTH, 5, padding="same", activation="relu", kernel_initializer=init(n))(x)
    z = layers.Dense(CODE_DIM, kernel_initializer=init(7))(x)
    book = tf.constant(keras.initializers.GlorotUniform(seed=SEED)((CODEBOOK, CODE_DIM)))
    codes = layers.Lambda(lambda v: tf.argmin(tf.reduce_sum(v * v, -1, keepdims=True) - 2.0 * tf.einsum(
        "btd,kd->btk", v, book) + tf.reduce_sum(book * book, -1), axis=-1, output_type=tf.int32))(z)
    return keras.Model({"mel": mel, "mel_lengths": lengths}, {"codes": codes}, name="bench_encoder")


def _trainer(vocab_size: int, codes_from: str) -> Any:
    """Text -> codes (and a coarse mel): the same model whichever way it gets its codes."""
    import keras
    import tensorflow as tf
    from keras import layers

    frozen = encoder() if codes_from == "step" else None

    class CodesModel(keras.Model):
        def __init__(self) -> None:
            super().__init__(name="bench_codes")
            self.embed = layers.Embedding(vocab_size, 128)
            self.text = [layers.Conv1D(128, 5, padding="same", activation="relu") for _ in range(2)]
            self.query = layers.Dense(128)
            self.attention = layers.MultiHeadAttention(num_heads=2, key_dim=64)
            self.logits = layers.Dense(CODEBOOK, dtype="float32")
            self.mel = layers.Dense(N_MELS * GROUP, dtype="float32")

        def call(self, inputs: dict[str, Any], training: bool = False) -> dict[str, Any]:
            frames = tf.shape(inputs["mel"])[1]
            steps = (frames + GROUP - 1) // GROUP
            if codes_from == "step":
                codes = tf.stop_gradient(frozen({"mel": inputs["mel"], "mel_lengths": inputs["mel_lengths"]})["codes"])
            elif codes_from == "batch":
                codes = inputs["codes"]
            else:
                codes = tf.zeros([tf.shape(inputs["mel"])[0], steps], tf.int32)
            x = self.embed(inputs["tokens"])
            for conv in self.text:
                x = x + conv(x)
            position = tf.cast(tf.range(steps), tf.float32)[None, :, None] / tf.cast(steps, tf.float32)
            q = self.query(tf.concat([tf.sin(position * tf.range(1.0, 33.0)), tf.cos(position * tf.range(1.0, 33.0))],
                                     -1))
            q = tf.tile(q, [tf.shape(x)[0], 1, 1])
            h = q + self.attention(q, x)
            valid = (inputs["mel_lengths"] + GROUP - 1) // GROUP
            mask = tf.sequence_mask(valid, steps, dtype=tf.float32)
            ce = keras.losses.sparse_categorical_crossentropy(tf.maximum(codes, 0), self.logits(h), from_logits=True)
            loss = tf.reduce_sum(ce * mask) / tf.maximum(tf.reduce_sum(mask), 1.0)
            mel = tf.reshape(self.mel(h), [tf.shape(h)[0], steps * GROUP, N_MELS])[:, :frames]
            return {"mel": mel, "losses": {"codes_ce": loss}}

    return CodesModel()


def plain(vocab_size: int, n_mels: int) -> Any:
    return _trainer(vocab_size, "zeros")


def in_step(vocab_size: int, n_mels: int) -> Any:
    return _trainer(vocab_size, "step")


def on_codes(vocab_size: int, n_mels: int) -> Any:
    return _trainer(vocab_size, "batch")


def _stoker(args: list[str], run_dir: Path, cores: Cores | None = None) -> dict[str, Any]:
    """One run of stoker; with ``cores``, laid out one core per device (its summary gets ``pinned``)."""
    argv = [*STOKER, *args, "--run-dir", str(run_dir), "--log-level", "WARNING"]
    mine = os.sched_getaffinity(0)
    if cores is not None:
        os.sched_setaffinity(0, cores.producers)  # this thread's only: the launcher starts on the data core
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **QUIET_ENV})
    finally:
        os.sched_setaffinity(0, mine)
    with proc:
        pinner = None if cores is None else _Pinner(proc, cores)
        if pinner:
            pinner.thread.start()
        try:
            _, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise BenchError(f"{' '.join(argv[2:])} ran past {RUN_TIMEOUT_S:.0f} s") from None
        finally:
            if pinner:
                pinner.stop.set()
                pinner.thread.join()
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(argv[2:])} exited with {proc.returncode}: {stderr[-800:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary if pinner is None else {**summary, "pinned": pinner.check()}


def _figures(summaries: list[dict[str, Any]], command: str) -> dict[str, Any]:
    """One way's figures: the median over its repetitions (all of them kept in ``spread``)."""
    def median(key: str) -> float:
        return statistics.median(s[key] for s in summaries)

    return {"samples_per_s": median("samples_per_s"), "data_wait_frac": median("data_wait_frac"),
            "step_ms_mean": median("step_ms_mean"),
            "spread": {"samples_per_s": spread([s["samples_per_s"] for s in summaries])},
            "model_runs": sum(p.get("model_runs", 0) for p in summaries[0]["producers"]),
            "model_hits": sum(p.get("model_hits", 0) for p in summaries[0]["producers"]), "command": command}


def _layout(measured: dict[str, list[dict[str, Any]]], commands: dict[str, str]) -> dict[str, Any]:
    """One layout's figures for each way and its two ratios."""
    runs = {way: _figures(summaries, commands[way]) for way, summaries in measured.items()}
    sps = {way: r["samples_per_s"] for way, r in runs.items()}
    return {"runs": runs, "pinned": measured["none"][0].get("pinned"),
            "producers_vs_in_step": ratio(sps["producers"], sps["in step"], target=TARGET_PRODUCERS_VS_STEP),
            "cache_vs_none": ratio(sps["cache"], sps["none"], target=TARGET_CACHE_VS_NONE)}


def _targets(layouts: dict[str, Any], label: str = "") -> list[dict[str, Any]]:
    out = []
    for name, layout in layouts.items():
        if "skipped" in layout:
            continue
        for key, what, limit in (("producers_vs_in_step", "encoder in the producers / in the step",
                                  TARGET_PRODUCERS_VS_STEP),
                                 ("cache_vs_none", "codes from the cache / no encoder", TARGET_CACHE_VS_NONE)):
            r = layout[key]
            out.append({"what": f"{label}{name} cores: {what}, samples/s", "value": r["value"], "limit": limit,
                        "ratio": r, "met": r["value"] >= limit})
    return out


def _measure(plan: ProducerModelsPlan, layouts_run: dict[str, Cores | None], ways: Sequence[str],
             run_one: Callable[[str, str, int], dict[str, Any]], say: Callable[[str], None],
             label: str) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every way in every layout, ``plan.repetitions`` rounds alternated: their summaries."""
    order = [(layout, way) for layout in layouts_run for way in ways]
    measured: dict[str, dict[str, list[dict[str, Any]]]] = {layout: {way: [] for way in ways} for layout in layouts_run}
    for round_ in range(plan.repetitions):
        for layout, way in (order if round_ % 2 == 0 else order[::-1]):
            summary = run_one(layout, way, round_)
            measured[layout][way].append(summary)
            say(f"producer models{label}: {layout} cores, {way}: {summary['samples_per_s']:.1f} samples/s, wait "
                f"{summary['data_wait_frac']:.3f}, step {summary['step_ms_mean']:.1f} ms")
    return measured


def _run_tensorflow(plan: ProducerModelsPlan, layouts_run: dict[str, Cores | None], work: Path,
                    say: Callable[[str], None]) -> dict[str, Any]:
    """The Keras encoder and trainer in stoker's runs (``python -m stoker``): layouts and targets."""
    common = ["--producers", str(PRODUCERS), "--batch-size", str(BATCH_SIZE), "--model-start-delay", "1",
              "--set", "features.backend=numpy", "--set", "trainer.val_clips=0",
              "--set", "trainer.checkpoint_every_steps=0", "--set", "trainer.log_every_steps=20"]
    models = ["--producer-models", ENCODER, "--set", f"transforms.model_fields={MODEL_FIELDS}"]
    cache = ["--set", f"data.feature_cache={work / 'cache'}"]
    ways = {"none": cache, "in step": [], "producers": models, "cache": models + cache}
    commands = {way: " ".join(["python run.py", "--model", f"stoker.benchmarks.producer_models:{TRAINERS[way]}",
                               "--steps", str(plan.steps), *common, *ways[way]]) for way in ways}
    started = time.monotonic()
    _stoker(["precompute", "--producers", str(PRODUCERS), "--batch-size", str(BATCH_SIZE),
             "--set", "trainer.val_clips=0", *models, *cache], work / "precompute")
    say(f"producer models: cache filled by precompute in {time.monotonic() - started:.1f} s")

    def one(layout: str, way: str, round_: int) -> dict[str, Any]:
        model = f"stoker.benchmarks.producer_models:{TRAINERS[way]}"
        return _stoker(["--model", model, "--steps", str(plan.steps), *common, *ways[way]],
                       work / f"run-{layout}-{way.replace(' ', '-')}-{round_}", layouts_run[layout])

    measured = _measure(plan, layouts_run, list(ways), one, say, "")
    layouts = {layout: _layout(measured[layout], commands) for layout in layouts_run}
    return {"layouts": layouts, "targets": _targets(layouts)}


# ---------------------------------------------------------------- the PyTorch encoder
TORCH_ENCODER = "stoker.benchmarks.producer_models:torch_encoder"
# The PyTorch step is cheaper than the Keras one (about 29 ms a batch against 41 ms on the
# demo's buckets, one core): 3 residual convolutions instead of the Keras encoder's 5 make the
# PyTorch encoder cost about one step, as the targets assume (5 cost about 1.5 steps).
TORCH_DEPTH = 3
TORCH_LABEL = "PyTorch encoder, "
# The loop's ways: whether its feed names the encoder as a producer model, whether it reads a cache.
TORCH_MODELS = {"none": False, "in step": False, "producers": True, "cache": True}
TORCH_CACHED = {"none": True, "in step": False, "producers": False, "cache": True}


def torch_encoder() -> Any:
    """The producer model in PyTorch: :func:`encoder`'s layers (:data:`TORCH_DEPTH` residual
    convolutions), mel, mel_lengths -> codes [B, T/4], its weights drawn from a seeded
    generator (the same in every process)."""
    import torch
    from torch import nn

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.group = nn.Conv1d(N_MELS, WIDTH, GROUP, stride=GROUP)
            self.convs = nn.ModuleList(nn.Conv1d(WIDTH, WIDTH, 5, padding=2) for _ in range(TORCH_DEPTH))
            self.project = nn.Linear(WIDTH, CODE_DIM)
            self.register_buffer("book", torch.empty(CODEBOOK, CODE_DIM))

        def forward(self, mel: Any, mel_lengths: Any) -> dict[str, Any]:
            valid = torch.arange(mel.shape[1], device=mel.device)[None, :] < mel_lengths[:, None]
            x = nn.functional.pad((mel * valid[..., None]).transpose(1, 2), (0, -mel.shape[1] % GROUP))
            x = torch.relu(self.group(x))
            for conv in self.convs:
                x = x + torch.relu(conv(x))
            z = self.project(x.transpose(1, 2))
            distances = (z * z).sum(-1, keepdim=True) - 2.0 * z @ self.book.T + (self.book * self.book).sum(-1)
            return {"codes": distances.argmin(-1).to(torch.int32)}

    model = Encoder()
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            bound = (6.0 / (t.shape[0] + (t[0].numel() if t.dim() > 1 else 1))) ** 0.5  # Glorot's
            t.copy_((torch.rand(t.shape, generator=generator) * 2.0 - 1.0) * bound)
    return model.eval()


def _torch_trainer(vocab_size: int, way: str) -> Any:
    """Text -> codes (and a coarse mel) in PyTorch: the same model whichever way it gets its codes."""
    import torch
    from torch import nn

    class CodesModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab_size, 128)
            self.text = nn.ModuleList(nn.Conv1d(128, 128, 5, padding=2) for _ in range(2))
            self.query = nn.Linear(64, 128)
            self.attention = nn.MultiheadAttention(128, 2, batch_first=True)
            self.logits = nn.Linear(128, CODEBOOK)
            self.mel = nn.Linear(128, N_MELS * GROUP)

        def forward(self, batch: dict[str, Any]) -> Any:
            mel, lengths = batch["mel"], batch["mel_lengths"]
            frames, device = mel.shape[1], mel.device
            steps = -(-frames // GROUP)
            if encoder is not None:  # (a): every step encodes its batch first
                with torch.no_grad():
                    codes = encoder(mel=mel, mel_lengths=lengths)["codes"]
            else:
                codes = batch.get("codes", torch.zeros(mel.shape[0], steps, dtype=torch.int32, device=device))
            x = self.embed(batch["tokens"].long())
            for conv in self.text:
                x = x + torch.relu(conv(x.transpose(1, 2))).transpose(1, 2)
            position = (torch.arange(steps, device=device) / steps)[:, None] * torch.arange(1, 33, device=device)
            q = self.query(torch.cat([position.sin(), position.cos()], -1)).expand(x.shape[0], -1, -1)
            h = q + self.attention(q, x, x, need_weights=False)[0]
            mask = (torch.arange(steps, device=device)[None, :] < ((lengths + GROUP - 1) // GROUP)[:, None]).float()
            ce = nn.functional.cross_entropy(self.logits(h).transpose(1, 2), codes.long().clamp(min=0),
                                             reduction="none")
            predicted = self.mel(h).reshape(h.shape[0], steps * GROUP, N_MELS)[:, :frames]
            return (ce * mask).sum() / mask.sum().clamp(min=1) + (predicted - mel).abs().mean()

    model = CodesModel()  # first: the same initial weights whichever way (the encoder's layers draw too)
    encoder = torch_encoder() if way == "in step" else None
    return model, encoder


def _pin_self(cores: Cores) -> dict[str, Any]:
    """After the feed started its producers (they inherited the data core from this thread):
    every thread of this process to the trainer's core; the producers must have kept theirs."""
    moved = 0
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, cores.trainer)
            moved += 1
        except ProcessLookupError:  # a thread that ended since the listing
            continue
    children = psutil.Process().children(recursive=True)
    stray = [c.pid for c in children if set(c.cpu_affinity()) != set(cores.producers)]
    return {"trainer_core": sorted(cores.trainer), "producer_core": sorted(cores.producers),
            "trainer_processes": 1, "producer_processes": len(children), "trainer_threads_moved": moved,
            "stray": stray}


def torch_child(way: str, steps: int, run_dir: Path, cache: Path, cores: Cores | None) -> dict[str, Any]:
    """One PyTorch run (``--child WAY``): a training loop on stoker.Feed(framework="torch")."""
    import torch

    import stoker  # the user's API, imported as a user's loop imports it

    if cores is not None:
        os.sched_setaffinity(0, cores.producers)  # this thread's: the producers the feed starts inherit it
    sets: dict[str, Any] = {"features.backend": "numpy", "trainer.val_clips": 0, "trainer.checkpoint_every_steps": 0,
                            "trainer.log_every_steps": 20}
    if TORCH_MODELS[way]:
        sets["transforms.model_fields"] = MODEL_FIELDS
    if TORCH_CACHED[way]:
        sets["data.feature_cache"] = str(cache)
    on_gpu = {"data_gpu": 0} if torch.cuda.is_available() else {}  # the producers' encoder on the step's GPU
    feed = stoker.Feed(steps=steps, run_dir=str(run_dir), producers=PRODUCERS, batch_size=BATCH_SIZE,
                       framework="torch", model_start_delay=1.0, log_level="WARNING",
                       producer_models=TORCH_ENCODER if TORCH_MODELS[way] else "", set=sets, **on_gpu)
    torch.manual_seed(SEED)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"  # where the feed puts the batches
    model, encoder = _torch_trainer(feed.vocabulary.size, way)
    model.to(device)
    if encoder is not None:
        encoder.to(device)
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    # One thread in both layouts: PyTorch's default (one per core) spins its OpenMP threads
    # against the producers on a 2-core host (steps of 460 to 620 ms instead of 30 to 70, measured).
    torch.set_num_threads(1)
    pinned: dict[str, Any] = {}
    with feed:
        if cores is not None:
            pinned = _pin_self(cores)
        for batch in feed:
            optimizer.zero_grad(set_to_none=True)
            loss = model(batch)
            loss.backward()
            optimizer.step()
            feed.step_done(loss=loss.detach())
    return pinned


CHILD_RESULT = "PRODUCER-MODELS-CHILD "


def _torch_run(way: str, steps: int, run_dir: Path, cache: Path, cores: Cores | None) -> dict[str, Any]:
    """One PyTorch run in a child process: its summary.json (with ``pinned``: the layout held)."""
    argv = [sys.executable, "-m", "stoker.benchmarks.producer_models", "--child", way, "--steps", str(steps),
            "--run-dir", str(run_dir), "--cache", str(cache)]
    if cores is not None:
        argv += ["--cores", f"{min(cores.trainer)}:{min(cores.producers)}"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                              env={**os.environ, **QUIET_ENV})
    except subprocess.TimeoutExpired:
        raise BenchError(f"the PyTorch run {way!r} ran past {RUN_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise BenchError(f"the PyTorch run {way!r} exited with {done.returncode}: {done.stderr[-800:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    if cores is None:
        return summary
    pinned = json.loads([line for line in done.stdout.splitlines() if line.startswith(CHILD_RESULT)][-1]
                        [len(CHILD_RESULT):])
    if pinned["stray"] or not pinned["producer_processes"]:
        raise BenchError(f"the pinned layout did not hold in the PyTorch run {way!r}: {pinned}")
    return {**summary, "pinned": pinned}


def _run_torch(plan: ProducerModelsPlan, layouts_run: dict[str, Cores | None], work: Path,
               say: Callable[[str], None]) -> dict[str, Any]:
    """The PyTorch encoder and trainer on stoker.Feed(framework="torch"): layouts and targets."""
    import torch

    cache = work / "torch-cache"
    started = time.monotonic()
    gpu = ["--data-gpu", "0"] if torch.cuda.is_available() else []  # where the PyTorch runs' producers encode
    _stoker(["precompute", *gpu, "--producers", str(PRODUCERS), "--batch-size", str(BATCH_SIZE), "--set",
             "trainer.val_clips=0", "--set", "features.backend=numpy", "--producer-models", TORCH_ENCODER,
             "--set", f"transforms.model_fields={MODEL_FIELDS}", "--set", f"data.feature_cache={cache}"],
            work / "torch-precompute")
    say(f"producer models (PyTorch): cache filled by precompute in {time.monotonic() - started:.1f} s")
    commands = {way: f"python -m stoker.benchmarks.producer_models --child '{way}' --steps {plan.steps} --run-dir RUN "
                     f"--cache CACHE" for way in TORCH_MODELS}

    def one(layout: str, way: str, round_: int) -> dict[str, Any]:
        return _torch_run(way, plan.steps, work / f"torch-{layout}-{way.replace(' ', '-')}-{round_}", cache,
                          layouts_run[layout])

    measured = _measure(plan, layouts_run, list(TORCH_MODELS), one, say, " (PyTorch)")
    layouts = {layout: _layout(measured[layout], commands) for layout in layouts_run}
    device = torch.cuda.get_device_name(0) if gpu else "cpu"
    return {"device": device, "layouts": layouts, "targets": _targets(layouts, TORCH_LABEL)}


def run(plan: ProducerModelsPlan, log_fn: Any = None, usable_cores: set[int] | None = None) -> dict[str, Any]:
    say = log_fn or (lambda text: None)
    cores = split_cores(os.sched_getaffinity(0) if usable_cores is None else usable_cores)
    layouts_run = {"shared": None, **({"pinned": cores} if isinstance(cores, Cores) else {})}
    if not isinstance(cores, Cores):
        say(f"producer models: pinned layout skipped: {cores}")
    work = Path(tempfile.mkdtemp(prefix="stoker-bench-models-"))
    result: dict[str, Any] = {"steps": plan.steps, "batch_size": BATCH_SIZE, "producers": PRODUCERS, "width": WIDTH,
                              "targets": []}
    try:
        if "tensorflow" in plan.frameworks:
            result.update(_run_tensorflow(plan, layouts_run, work, say))
        if "torch" in plan.frameworks:
            result["torch"] = _run_torch(plan, layouts_run, work, say)
            result["targets"] = result["targets"] + result["torch"]["targets"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not isinstance(cores, Cores):
        for part in (result, result.get("torch")):
            if part is not None and "layouts" in part:
                part["layouts"]["pinned"] = {"skipped": cores}
    return result


LAYOUT_TITLES = {"shared": "shared cores (every process on every core)",
                 "pinned": "one core per device (trainer on one core, producers on another)"}


def _render_layouts(layouts: dict[str, Any]) -> list[str]:
    out = []
    for name, layout in layouts.items():
        if "skipped" in layout:
            out.append(f"{LAYOUT_TITLES[name]}: skipped ({layout['skipped']})")
            continue
        rows = [[way, f"{r['samples_per_s']:.1f}", f"{r['data_wait_frac']:.3f}", f"{r['step_ms_mean']:.1f}",
                 r["model_runs"], r["model_hits"]] for way, r in layout["runs"].items()]
        out += [f"{LAYOUT_TITLES[name]}:",
                table(["encoder", "samples/s", "wait share", "step ms", "model runs", "cached clips"], rows),
                f"(b) producers / (a) in step: {layout['producers_vs_in_step']['value']:.2f} (target >= "
                f"{TARGET_PRODUCERS_VS_STEP}); (c) cache / none: {layout['cache_vs_none']['value']:.2f} "
                f"(target >= {TARGET_CACHE_VS_NONE})"]
    return out


def render(result: dict[str, Any]) -> str:
    out = _render_layouts(result["layouts"]) if "layouts" in result else []
    if "torch" in result:
        out += [f"PyTorch encoder and step (stoker.Feed(framework=\"torch\"), no TensorFlow) on "
                f"{result['torch'].get('device', 'cpu')}:",
                *_render_layouts(result["torch"]["layouts"])]
    if result.get("torch", {}).get("device", "cpu") == "cpu":
        out.append("No GPU was measured: the pinned layout is the CPU analogue of a data GPU beside a model GPU.")
    else:
        out.append("TensorFlow's runs (where asked) on the CPU; PyTorch's on the GPU named above, the producers' "
                   "encoder on it too.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--framework", choices=("tensorflow", "torch", "both"), default="both",
                        help="whose encoder and training step to measure")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one PyTorch run: its way
    parser.add_argument("--steps", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cores", default=None, help=argparse.SUPPRESS)  # TRAINER:PRODUCERS
    args = parser.parse_args(argv)
    if args.child:
        cores = None
        if args.cores:
            trainer, producers = (int(c) for c in args.cores.split(":"))
            cores = Cores(trainer=frozenset({trainer}), producers=frozenset({producers}))
        pinned = torch_child(args.child, args.steps, Path(args.run_dir), Path(args.cache), cores)
        print(CHILD_RESULT + json.dumps(pinned), flush=True)
        return 0
    plan = ProducerModelsPlan.quick() if args.quick else ProducerModelsPlan()
    if args.framework != "both":
        plan.frameworks = (args.framework,)
    return run_alone("producer_models", lambda log: run(plan, log), render, args.out)


if __name__ == "__main__":
    sys.exit(main())
