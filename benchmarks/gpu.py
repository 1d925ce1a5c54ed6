"""A PyTorch text-to-mel model fed three ways (``python -m stoker.benchmarks.gpu``, and the ``gpu``
section of ``python run.py bench``).

The same model, the same clips and the same batches (the consumer's epoch plan: length-grouped
batches of the plan's bucket shapes, epoch after epoch), each way in its own process:

    feed        ``stoker.Feed(framework="torch")`` with P producer processes: the coordinator (which
                receives the producers' batches) in a process of its own, the loop's thread taking
                the batches' descriptors and (from slots page-locked for CUDA) queueing their copies
                between steps; the trainer process's threads are reported.
    dataloader  ``torch.utils.data.DataLoader`` with P workers (spawned), ``batch_size=None`` over
                the planned batches: each item is made by the producers' own code, in the worker
                (``producer.batches.BatchMaker.make`` on the lease the coordinator sends for that
                batch: read, the batch's log-mels at once by ``MelComputer`` with the feed's resolved
                ``features``, the lease's tokens, collation into the bucket's shape); ``pin_memory``
                on CUDA and ``non_blocking`` copies. Before any way is timed, a check child takes one
                epoch from a feed and requires these items' arrays to equal the feed's, batch by
                batch (the same ids), exactly: the two ways do the same work.
    dataloader-reference  (an extra way, labelled as such) the same DataLoader with each clip's
                log-mel computed alone by the per-clip reference ``log_mel_spectrogram_numpy``
                (float32): what a user porting the definition clip by clip writes; about twice the
                producers' CPU per batch. Its mels differ from the feed's within float32 rounding
                (the check reports the largest difference). ``--no-reference`` leaves it out.
    replay      one batch of each bucket shape made once and held on the device, replayed in the
                plan's order of shapes for the same number of steps, after one warm-up step per
                shape: the step's own time, with no input pipeline in the process.

Each way trains the same number of samples (``epochs`` whole epochs). Figures per way: samples/s
after the first ``warmup_steps`` steps; the step time per bucket shape (median over its steps,
each shape's first step left out): on CUDA the device time between two
``torch.cuda.Event(enable_timing=True)`` around the step, read after one synchronize at the
end; on the CPU the step's wall time; the trainer's wait share (time in ``next()`` over the
loop's time after warm-up); the time to the first batch (from before the index is built to
the first batch in hand); GPU utilisation (mean of NVML samples, shared/gpumon.py, when NVML
is present). Ratios: feed / replay step per shape, feed / dataloader samples/s (the target's) and
feed / dataloader-reference samples/s (informational), each with its two numbers.

The step. On CUDA: a transformer text encoder, frames that attend to the text from their
place in the clip, a residual MLP mel decoder, masked L1 loss, AdamW, bf16 autocast. Two sizes
(``--size``, ``SIZES``): ``small``, a launch-bound step of ~15 ms, ``large``, ~50 ms (``AIMS``).
How long a size's step takes differs from GPU to GPU, so each is first calibrated on the device
(benchmarks/calibrate.py: the small one's decoder depth, the large one's width, searched with its
step timed as replay times it); ``--dim`` / ``--layers`` fix the model instead. On the CPU the model is
cut to ``CPU_DIM`` and the step adds a fixed count of tiny torch ops (``CPU_HOLD_OPS`` per
size): like a step that launches kernels, it spends its time in the interpreter, so the
feed's threads in the same process contend with it for the GIL as they do on a GPU host.

Targets (reported, not enforced; the largest P): feed step within 3 % of replay for every
shape; feed samples/s >= 1.5 x the dataloader's (the same work); feed wait share <= 1 %.

    python -m stoker.benchmarks.gpu [--quick] [--size small --size large] [--producers 1 --producers 2]
        [--clips N] [--epochs E] [--batch-size B] [--[no-]calibrate] [--no-reference] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

import stoker
from .calibrate import Aim, search
from .corpus import leases_of, make_clips
from ..consumer.coordinator.lease_tables import TokenTable
from ..consumer.plan import EpochPlanner
from ..feed import feed_config
from ..launcher import PRODUCER_ENV
from ..producer.audio import load_audio
from ..producer.batches import BatchMaker
from ..producer.features import log_mel_spectrogram_numpy, resolve_backend
from ..shared import wire
from ..shared.batch import SCHEMA, batch_dims, collate
from ..consumer.index.index import build_index
from ..shared.gpumon import GpuSampler
from ..shared.mel import pad_values
from ..shared.proc import steady_heap
from ..shared.runfiles import SAMPLES

from .common import (CHILD_TIMEOUT_S, QUIET_ENV, BenchError, machine_info, ratio, report, spread, table, targets_table,
                     write_json)

RESULT_PREFIX = "GPU-BENCH-RESULT "


@dataclass(frozen=True)
class ModelSize:
    dim: int
    layers: int  # transformer encoder layers
    heads: int
    decoder_layers: int  # residual MLP blocks of the mel decoder


SIZES = {"small": ModelSize(dim=256, layers=2, heads=4, decoder_layers=2),
         "large": ModelSize(dim=512, layers=6, heads=8, decoder_layers=6)}
# The step each size aims at on a GPU, and what moves it there (benchmarks/calibrate.py): the small
# size is launch-bound, so its depth; the large one is bound by its matrix products, so its width.
AIMS = {"small": Aim(step_ms=15.0, field="decoder_layers", lo=1, hi=64),
        "large": Aim(step_ms=50.0, field="dim", lo=256, hi=4096, grain=64)}
# Calibration: steps before the timed ones, and the steps timed (their median), per value tried.
CALIBRATION_WARMUP_STEPS = 2
CALIBRATION_STEPS = 6
# On the CPU: the model at this width, plus a fixed count of tiny torch ops per step.
CPU_DIM = 32
CPU_HOLD_OPS = {"small": 1500, "large": 5000}
# Targets (ratios against numbers measured in the same run).
TARGET_STEP_RATIO = 1.03
TARGET_VS_DATALOADER = 1.5
TARGET_WAIT_SHARE = 0.01


def producer_sweep(cores: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the cores (the cores themselves last when not a power of two)."""
    out = [p for p in (2 ** k for k in range(8)) if p <= cores]
    return tuple(out + ([cores] if cores not in out else []))


@dataclass
class GpuPlan:
    clips: int = 256
    batch_size: int = 16
    epochs: int = 3
    producers: tuple[int, ...] = field(default_factory=lambda: producer_sweep(os.cpu_count() or 1))
    sizes: tuple[str, ...] = ("small", "large")
    warmup_steps: int = 4
    dim: int = 0  # 0: the size's (SIZES); else every size's width
    layers: int = 0  # 0: the size's
    cpu_hold_ops: int = -1  # -1: CPU_HOLD_OPS of the size
    device: str = "auto"  # "auto": cuda:0 when CUDA is available, else cpu
    calibrate: bool | None = None  # each size to its AIMS on the device; None: on CUDA, unless dim or layers are given
    reference: bool = True  # also the extra way, dataloader-reference (the per-clip reference mel)

    @classmethod
    def quick(cls) -> "GpuPlan":
        cores = os.cpu_count() or 1
        return cls(clips=96, epochs=2, producers=tuple(sorted({1, cores})))


# ---------------------------------------------------------------- the model and the step
def build_model(torch: Any, vocab_size: int, n_mels: int, size: ModelSize) -> Any:
    """The text-to-mel model (a module of ``torch.nn``)."""
    nn = torch.nn

    class TextToMel(nn.Module):
        """Tokens -> encoder; each frame queries the text from its place in the clip; MLP decoder -> mel."""

        def __init__(self) -> None:
            super().__init__()
            d = size.dim
            self.embed = nn.Embedding(vocab_size, d)
            layer = nn.TransformerEncoderLayer(d, size.heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, size.layers, enable_nested_tensor=False)
            self.query = nn.Linear(32, d)
            self.attend = nn.MultiheadAttention(d, size.heads, batch_first=True)
            self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(),
                                                      nn.Linear(2 * d, d)) for _ in range(size.decoder_layers))
            self.out = nn.Linear(d, n_mels)

        @staticmethod
        def places(n: int, lengths: Any) -> Any:
            """[B, n, 32]: sines and cosines of each position's place (0..1) in its row."""
            place = torch.arange(n, device=lengths.device)[None, :] / lengths.clamp(min=1)[:, None]
            angles = place[..., None] * torch.arange(1, 17, device=lengths.device) * math.pi
            return torch.cat([angles.sin(), angles.cos()], dim=-1)

        def forward(self, tokens: Any, token_lengths: Any, frames: int, mel_lengths: Any) -> Any:
            positions = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
            padding = positions >= token_lengths.clamp(min=1)[:, None]
            x = self.embed(tokens.long()) + self.query(self.places(tokens.shape[1], token_lengths))
            x = self.encoder(x, src_key_padding_mask=padding)
            h, _ = self.attend(self.query(self.places(frames, mel_lengths)), x, x, key_padding_mask=padding,
                               need_weights=False)
            for block in self.blocks:
                h = h + block(h)
            return self.out(h)

    return TextToMel()


class Step:
    """One optimizer step on a batch of torch tensors on ``device``; the loss stays on the device."""

    def __init__(self, torch: Any, vocab_size: int, n_mels: int, size: ModelSize, device: str,
                 hold_ops: int) -> None:
        torch.manual_seed(0)
        self.torch = torch
        self.cuda = device.startswith("cuda")
        with torch.device(device):  # made where it trains: a wide model is not initialised on the CPU first
            self.model = build_model(torch, vocab_size, n_mels, size)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.hold_ops = hold_ops
        self._held = torch.zeros(8)

    def __call__(self, batch: dict[str, Any]) -> Any:
        torch = self.torch
        mel, mel_lengths = batch["mel"], batch["mel_lengths"]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cuda):
            predicted = self.model(batch["tokens"], batch["token_lengths"], mel.shape[1], mel_lengths)
        mask = (torch.arange(mel.shape[1], device=mel.device)[None, :] < mel_lengths[:, None]).unsqueeze(-1)
        loss = ((predicted.float() - mel).abs() * mask).sum() / (mask.sum() * mel.shape[2]).clamp(min=1)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        held = self._held
        for _ in range(self.hold_ops):  # the interpreter-bound part of a step on the CPU (see the docstring)
            held.add_(1.0)
        return loss.detach()


class StepClock:
    """Each step's time: CUDA events read after one synchronize at the end, or the wall clock on the CPU."""

    def __init__(self, torch: Any, cuda: bool) -> None:
        self.torch = torch
        self.cuda = cuda
        self.marks: list[Any] = []

    def begin(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def end(self, begun: Any) -> None:
        if not self.cuda:
            self.marks.append(time.perf_counter() - begun)
            return
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        self.marks.append((begun, event))

    def seconds(self) -> list[float]:
        """Every step's seconds (synchronizes once on CUDA)."""
        if not self.cuda:
            return list(self.marks)
        self.torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in self.marks]


# ---------------------------------------------------------------- the data
# The config keys every way's feed (and the DataLoader's plan) sets beside data, batch size and epochs.
FEED_SET = {"trainer.val_clips": 0, "data.index_cache": "off", "trainer.checkpoint_every_steps": 0}
# How the DataLoader's items make their log-mels: by the producers' code, or per clip (the extra way).
DATALOADER_MELS = {"dataloader": "producer", "dataloader-reference": "reference"}


def _config(root: str, batch_size: int) -> Any:
    """The feed's own config for these options (stoker.feed.feed_config, framework torch): its
    ``features`` resolved as the run service resolves them for the producers."""
    cfg = feed_config(None, FEED_SET, {"data": root, "batch_size": batch_size}, "torch", None)
    return dataclasses.replace(cfg, features=resolve_backend(cfg.features, framework=cfg.trainer.framework))


def planned_batches(root: str, batch_size: int, epochs: int) -> tuple[Any, Any, list[Any], Any]:
    """(config, index, the plan's batches of ``epochs`` epochs, token table): what the feed plans."""

    cfg = _config(root, batch_size)
    index = build_index(cfg.data, cfg.features, cfg.text)
    planner = EpochPlanner(index.samples, cfg.batching)
    batches = [b for epoch in range(epochs) for b in planner.plan(epoch)]
    return cfg, index, batches, TokenTable(index.samples, index.vocabulary)


class PlannedDataset:
    """The DataLoader's dataset: item ``i`` is planned batch ``i`` (its lease), as torch tensors.

    ``mel="producer"``: made as a producer makes it, by its own BatchMaker (one per worker
    process, made there on first use) with the feed's features: the same reading, batched
    MelComputer log-mels and collation. ``mel="reference"`` (the extra way): each clip's log-mel
    by the per-clip reference ``log_mel_spectrogram_numpy`` (float32), the same reading, tokens
    and collation."""

    def __init__(self, root: str, features: Any, leases: list[wire.Lease], mel: str = "producer") -> None:
        if mel not in DATALOADER_MELS.values():
            raise ValueError(f"unknown mel way {mel!r}")
        self.root = root
        self.features = features
        self.leases = leases
        self.mel = mel
        self._maker: BatchMaker | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maker": None}  # each worker makes its own

    def __len__(self) -> int:
        return len(self.leases)

    @staticmethod
    def shape(lease: wire.Lease) -> tuple[int, ...]:
        """A planned batch's bucket shape: (B, L, T)."""
        return (len(lease.ids), *lease.shape)

    def first_of_each_shape(self) -> dict[tuple[int, ...], int]:
        """Each bucket shape's first planned batch, by its index, in the plan's order."""
        first: dict[tuple[int, ...], int] = {}
        for i, lease in enumerate(self.leases):
            first.setdefault(self.shape(lease), i)
        return first

    def arrays(self, i: int) -> dict[str, np.ndarray]:
        """Planned batch ``i``'s arrays; BenchError where a clip was rejected or missed (the ways
        would no longer train the same samples)."""
        lease = self.leases[i]
        if self.mel == "reference":
            cfg = self.features
            clips = [load_audio(Path(self.root) / lease.files[sample], cfg.sample_rate_hz) for sample in lease.ids]
            examples = [{"tokens": np.asarray(tokens, np.int32),
                         "mel": log_mel_spectrogram_numpy(clip, cfg, np.float32)}
                        for clip, tokens in zip(clips, lease.tokens)]
            return collate(examples, batch_dims(len(examples), lease.shape, cfg.n_mels),
                           pad_values(SCHEMA, cfg, "off"))
        if self._maker is None:
            self._maker = BatchMaker(Path(self.root), {}, self.features, None, "dataloader")
        prepared = self._maker.make(lease)
        dropped = prepared.batch.rejected + prepared.batch.missed
        if dropped:
            raise BenchError(f"batch {i}: the producer's code dropped {dropped[0].id}: {dropped[0].reason}")
        return prepared.arrays

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        return {name: torch.from_numpy(array) for name, array in self.arrays(i).items()}


def check_same_work(feed_batches: Sequence[tuple[tuple[str, ...], dict[str, np.ndarray]]],
                    leases: Sequence[wire.Lease], items: Sequence[dict[str, np.ndarray]],
                    reference: Sequence[dict[str, np.ndarray]] | None) -> dict[str, Any]:
    """The DataLoader's items (one per lease, in the plan's order) against the feed's batches of
    the same ids: every array equal in name, dtype, shape and value (BenchError naming the first
    that is not); the reference way's mels' largest difference from the feed's over the valid
    frames (informational)."""
    by_ids = {tuple(lease.ids): i for i, lease in enumerate(leases)}
    worst = 0.0
    for ids, got in feed_batches:
        if ids not in by_ids:
            raise BenchError(f"the feed handed out a batch the plan does not have (first clip {ids[0]})")
        i = by_ids[ids]
        ours = items[i]
        if set(ours) != set(got):
            raise BenchError(f"batch {i}: the DataLoader's arrays {sorted(ours)}, the feed's {sorted(got)}")
        for name, array in ours.items():
            if array.dtype != got[name].dtype or not np.array_equal(array, got[name]):
                raise BenchError(f"batch {i}: the DataLoader's {name} ({array.dtype}{list(array.shape)}) is not the "
                                 f"feed's ({got[name].dtype}{list(got[name].shape)}): not the producers' work")
        if reference is not None:
            mel = reference[i]["mel"]
            for row, frames in enumerate(got["mel_lengths"]):
                worst = max(worst, float(np.abs(mel[row, :frames] - got["mel"][row, :frames]).max(initial=0.0)))
    if not feed_batches:
        raise BenchError("the feed handed out no batch to check")
    return {"batches": len(feed_batches), "equal": True, "reference_mel_max_abs_diff": worst if reference else None}


def producers_env() -> None:
    """This process's environment as the launcher gives a producer's (launcher.PRODUCER_ENV,
    where not set already), for the DataLoader workers it spawns: one OpenBLAS thread, as a
    producer computes its mels (and, with more threads, the mels' last bits can differ)."""
    for key, value in PRODUCER_ENV.items():
        os.environ.setdefault(key, value)


# Each way run per producer count as the report names it, and its key there.
WAY_KEYS = {"feed": "feed", "dataloader": "dataloader", "dataloader-reference": "dataloader_reference"}


# ---------------------------------------------------------------- the loops (child processes)
def timed_loop(torch: Any, batches: Iterator[dict[str, Any]], step: Step, clock: StepClock, device: str,
                on_step: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Train every batch; per step: its shape, rows, wait (time in next()) and end time."""
    rows: list[dict[str, Any]] = []
    first_batch = None
    while True:
        asked = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            break
        got = time.perf_counter()
        if first_batch is None:
            first_batch = got
        if batch["mel"].device.type != torch.device(device).type:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        begun = clock.begin()
        loss = step(batch)
        clock.end(begun)
        if on_step is not None:
            on_step(loss)
        mel = batch["mel"]
        rows.append({"shape": f"{mel.shape[0]}x{batch['tokens'].shape[1]}x{mel.shape[1]}", "rows": int(mel.shape[0]),
                     "wait_s": got - asked, "end": time.perf_counter()})
    if clock.cuda:
        torch.cuda.synchronize()
        if rows:
            rows[-1]["end"] = time.perf_counter()
    return {"rows": rows, "first_batch": first_batch}


class Utilisation:
    """Mean GPU utilisation over a block, from shared/gpumon's NVML samples (None without NVML)."""

    def __init__(self, torch: Any, cuda: bool, work: Path) -> None:
        self.path = work / "gpu.jsonl"
        self.sampler = GpuSampler({"model": torch.cuda.current_device()}, work) if cuda else None
        self.on = False

    def __enter__(self) -> "Utilisation":
        self.on = self.sampler is not None and self.sampler.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.sampler is not None:
            self.sampler.stop()

    def mean(self) -> float | None:
        if not self.on or not self.path.exists():
            return None
        utils = [json.loads(line)["util"] for line in self.path.read_text(encoding="utf-8").splitlines() if line]
        return statistics.fmean(utils) if utils else None


def child_main(spec: dict[str, Any]) -> dict[str, Any]:
    """One way (spec["kind"]) of one size with P producers; its raw figures."""
    import torch

    cuda = spec["device"].startswith("cuda")
    if not cuda:
        torch.set_num_threads(1)  # the step is one interpreter's work; the producers have the other cores
    # Every way's step on the same malloc settings (the feed's, docs/design/processes.md, "The trainer's heap"):
    # with glibc's own, whether a step's freed heap is faulted in again depends on the process's history.
    steady_heap()
    device = spec["device"]
    work = Path(spec["work"])
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cfg, index, planned, tokens = planned_batches(spec["data"], spec["batch_size"], spec["epochs"])
    leases = leases_of(planned, tokens)
    dataset = PlannedDataset(spec["data"], cfg.features, leases, DATALOADER_MELS.get(spec["kind"], "producer"))
    if spec["kind"] == "calibrate":
        return _calibrate(torch, spec, dataset, index.vocabulary.size, cfg.features.n_mels)
    if spec["kind"] == "check":
        return _check(torch, spec, dataset)
    step = Step(torch, index.vocabulary.size, cfg.features.n_mels, ModelSize(**spec["size"]), device,
                spec["hold_ops"])
    clock = StepClock(torch, cuda)
    kind = spec["kind"]
    with Utilisation(torch, cuda, work) as util:
        if kind == "replay":
            out = replay_loop(torch, dataset, step, clock, device)
        elif kind == "feed":
            out = _feed(torch, spec, step, clock, device, planned)
        elif kind in DATALOADER_MELS:
            producers_env()
            loader = torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=False,
                                                 num_workers=spec["producers"], pin_memory=cuda,
                                                 multiprocessing_context="spawn")
            out = timed_loop(torch, iter(loader), step, clock, device)
        else:
            raise ValueError(f"unknown kind {kind!r}")
    first = out.pop("first_batch")
    return {**out, "step_s": clock.seconds(), "gpu_util": util.mean(),
            "parameters": sum(p.numel() for p in step.model.parameters()),
            "first_batch_s": None if first is None or kind == "replay" else first - started}


def _calibrate(torch: Any, spec: dict[str, Any], dataset: PlannedDataset, vocab_size: int,
               n_mels: int) -> dict[str, Any]:
    """The size's aim searched on the device (benchmarks/calibrate.py), each value's step timed as
    replay times it, on a batch of the plan's middle bucket shape: the size chosen, and the trail."""
    device, cuda, aim = spec["device"], spec["device"].startswith("cuda"), Aim(**spec["aim"])
    first = dataset.first_of_each_shape()
    shape, i = sorted(first.items())[len(first) // 2]
    batch = {k: v.to(device) for k, v in dataset[i].items()}
    size = ModelSize(**spec["size"])

    def measure(value: int) -> float:
        step = Step(torch, vocab_size, n_mels, dataclasses.replace(size, **{aim.field: value}), device,
                    spec["hold_ops"])
        for _ in range(CALIBRATION_WARMUP_STEPS):
            step(batch)
        clock = StepClock(torch, cuda)
        for _ in range(CALIBRATION_STEPS):
            begun = clock.begin()
            step(batch)
            clock.end(begun)
        ms = statistics.median(clock.seconds()) * 1e3
        del step
        if cuda:
            gc.collect()  # the model and its optimizer state, whatever holds them, before the next value's
            torch.cuda.empty_cache()
        return ms

    value, trail = search(measure, getattr(size, aim.field), aim)
    return {"size": dataclasses.asdict(dataclasses.replace(size, **{aim.field: value})),
            "shape": "x".join(map(str, shape)), "aim": dataclasses.asdict(aim), "trail": trail}


def replay_loop(torch: Any, dataset: PlannedDataset, step: Step, clock: StepClock, device: str) -> dict[str, Any]:
    """One batch per shape made once and put on the device; a warm-up step each (not timed); then
    the plan's batches in order, each replaced by the held batch of its shape."""
    held = {key: {k: v.to(device) for k, v in dataset[i].items()} for key, i in dataset.first_of_each_shape().items()}
    for batch in held.values():
        step(batch)
    if clock.cuda:
        torch.cuda.synchronize()
    return timed_loop(torch, iter([held[PlannedDataset.shape(lease)] for lease in dataset.leases]), step, clock, device)


def open_feed(spec: dict[str, Any], epochs: int, producers: int, run_dir: Path, **sets: Any) -> Any:
    """The feed of the benchmark's runs: these clips, batch size and epochs, framework torch."""
    return stoker.Feed(framework="torch", data=spec["data"], producers=producers, batch_size=spec["batch_size"],
                       epochs=epochs, run_dir=str(run_dir), model_start_delay=0.0, log_level="WARNING",
                       set={**FEED_SET, **sets})


def _feed(torch: Any, spec: dict[str, Any], step: Step, clock: StepClock, device: str,
          planned: list[Any]) -> dict[str, Any]:
    feed = open_feed(spec, spec["epochs"], spec["producers"], Path(spec["work"]) / "run")
    with feed:
        if feed.batches_per_epoch * spec["epochs"] != len(planned) or \
                sorted(feed.shapes) != sorted({(len(b.ids), *b.shape) for b in planned}):
            raise BenchError(f"the feed plans other batches ({feed.batches_per_epoch} per epoch in {feed.shapes}) "
                             "than the dataloader's")
        out = timed_loop(torch, iter(feed), step, clock, device, on_step=lambda loss: feed.step_done(loss=loss))
        return {**out, "threads": sorted({thread.name for thread in threading.enumerate()})}  # a stager's among them?


def _check(torch: Any, spec: dict[str, Any], dataset: PlannedDataset) -> dict[str, Any]:
    """One epoch from a feed (one producer, its batches' ids from samples.jsonl) against the
    items of a DataLoader over ``dataset`` (one worker, as the timed ones are made), and the
    reference way's made here (check_same_work), before any way is timed; with each way's CPU
    per batch, made here in turns (this process in the producers' environment, _run_child)."""
    run_dir = Path(spec["work"]) / "run"
    got = []
    with open_feed(spec, 1, 1, run_dir, **{"trainer.record_samples": True}) as feed:
        for batch in feed:
            got.append({name: tensor.numpy().copy() for name, tensor in batch.items()})  # before its slot is reused
            feed.step_done()
    rows = [json.loads(line) for line in (run_dir / SAMPLES).read_text(encoding="utf-8").splitlines() if line]
    ids = [tuple(row["ids"]) for row in sorted(rows, key=lambda row: row["step"])]
    if len(ids) != len(got):
        raise BenchError(f"the feed handed out {len(got)} batches, its samples.jsonl names {len(ids)}")
    producers_env()
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=False, num_workers=1,
                                         multiprocessing_context="spawn")
    items = [{name: tensor.numpy() for name, tensor in item.items()} for item in loader]
    reference = None
    cpu_ms: dict[str, list[float]] = {"dataloader": [], "dataloader-reference": []}
    way = PlannedDataset(dataset.root, dataset.features, dataset.leases, "reference")
    for i in range(len(dataset)):  # each way's CPU per batch here, batch by batch in turns
        for name, made in (("dataloader", dataset), ("dataloader-reference", way if spec["reference"] else None)):
            if made is not None:
                began = time.process_time()
                made.arrays(i)
                cpu_ms[name].append((time.process_time() - began) * 1e3)
    if spec["reference"]:
        reference = [way.arrays(i) for i in range(len(way))]
    same = check_same_work(list(zip(ids, got)), dataset.leases, items, reference)
    return {**same, "cpu_ms_per_batch": {name: spread(v) for name, v in cpu_ms.items() if v}}


# ---------------------------------------------------------------- the parent: runs and figures
def _run_child(spec: dict[str, Any], log_path: Path) -> dict[str, Any]:
    env = {**os.environ, **QUIET_ENV}
    if spec["kind"] == "check":  # its own batches made as a producer makes them (producers_env)
        env = {**PRODUCER_ENV, **env}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "stoker.benchmarks.gpu", "child", json.dumps(spec)],
                                stdout=subprocess.PIPE, stderr=log_file, env=env)
        try:
            stdout, _ = proc.communicate(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise BenchError(f"{spec['kind']} ({spec['name']}) timed out after {CHILD_TIMEOUT_S:.0f} s") from None
    lines = [line for line in stdout.decode("utf-8", "replace").splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise BenchError(f"{spec['kind']} ({spec['name']}) exited with status {proc.returncode}:\n{tail}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def summarize_run(raw: dict[str, Any], warmup_steps: int) -> dict[str, Any]:
    """samples/s and wait share after the warm-up steps; the median step per shape (each shape's first left out)."""
    rows, steps = raw["rows"], raw["step_s"]
    if len(rows) <= warmup_steps + 1 or len(steps) != len(rows):
        raise BenchError(f"{len(rows)} steps ({len(steps)} timed): too few for {warmup_steps} warm-up steps")
    after = rows[warmup_steps:]
    span = after[-1]["end"] - rows[warmup_steps - 1]["end"] if warmup_steps else after[-1]["end"] - rows[0]["end"]
    samples_after = sum(r["rows"] for r in (after if warmup_steps else after[1:]))
    waits = sum(r["wait_s"] for r in (after if warmup_steps else after[1:]))
    per_shape: dict[str, list[float]] = {}
    seen: set[str] = set()
    for r, s in zip(rows, steps):
        if r["shape"] in seen:
            per_shape.setdefault(r["shape"], []).append(s)
        seen.add(r["shape"])
    return {"samples": sum(r["rows"] for r in rows), "steps": len(rows),
            "samples_per_s": samples_after / span, "wait_share": waits / span,
            "first_batch_s": raw["first_batch_s"], "gpu_util": raw["gpu_util"],
            "parameters": raw.get("parameters"),  # None from a checkout before the count (benchmarks/contention.py)
            "threads": raw.get("threads"),  # the feed's trainer process's
            "step_ms": {shape: {"median": statistics.median(v) * 1e3, "n": len(v)}
                        for shape, v in sorted(per_shape.items())}}


def compare(replay: dict[str, Any], feed: dict[str, Any], dataloader: dict[str, Any] | None,
            reference: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per shape: feed / replay and dataloader / replay step; feed / dataloader samples/s and
    feed / dataloader-reference samples/s (None while that way has not run: a partial section,
    or the extra way left out)."""
    shapes = {}
    for shape, r in replay["step_ms"].items():
        f, d = feed["step_ms"].get(shape), dataloader and dataloader["step_ms"].get(shape)
        shapes[shape] = {"replay_ms": r["median"], "feed_ms": f and f["median"], "dataloader_ms": d and d["median"],
                         "feed_vs_replay": f and ratio(f["median"], r["median"]),
                         "dataloader_vs_replay": d and ratio(d["median"], r["median"])}
    return {"shapes": shapes,
            "feed_vs_dataloader": dataloader and ratio(feed["samples_per_s"], dataloader["samples_per_s"],
                                                       note="feed / dataloader samples/s (the same work)"),
            "feed_vs_dataloader_reference": reference and ratio(
                feed["samples_per_s"], reference["samples_per_s"],
                note="feed / dataloader-reference samples/s (per-clip reference mel: the extra way)"),
            "feed_vs_replay": ratio(feed["samples_per_s"], replay["samples_per_s"], note="feed / replay samples/s")}


def _device(plan: GpuPlan) -> tuple[str, str]:
    """(device, its name) for the children, decided here without keeping CUDA open."""
    if plan.device != "auto":
        return plan.device, plan.device
    code = ("import torch; ok = torch.cuda.is_available(); "
            "print(torch.cuda.get_device_name(0) if ok else '')")
    name = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.strip()
    return ("cuda:0", name) if name else ("cpu", "cpu")


def run(plan: GpuPlan | None = None, log: Callable[[str], None] | None = None,
        partial: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every size and producer count of ``plan``, each way (the extra one where ``plan.reference``),
    after the check that the DataLoader's arrays are the feed's (``same_work``, BenchError if
    not): the report (bench.json's section). ``partial`` is given the section as it stands after each way (``complete`` false,
    no targets yet), so that a run stopped at a deadline still leaves what it measured."""
    plan = plan or GpuPlan()
    log = log or (lambda text: None)
    device, device_name = _device(plan)
    cuda = device.startswith("cuda")
    head = {"config": {**dataclasses.asdict(plan), "producers": list(plan.producers), "sizes": list(plan.sizes)},
            "device": device, "device_name": device_name, "machine": machine_info(),
            "step": ("model, bf16 autocast, CUDA events" if cuda else
                     f"model at width {CPU_DIM} + tiny torch ops (interpreter-bound), wall clock, 1 torch thread")}
    sizes: dict[str, Any] = {}

    def keep() -> None:
        if partial is not None:
            partial(copy.deepcopy({**head, "sizes": sizes, "complete": False}))

    work = Path(tempfile.mkdtemp(prefix="stoker-bench-gpu-"))
    try:
        data = work / "clips"
        make_clips(data, plan.clips)
        head["same_work"] = _run_child({"kind": "check", "name": "same work", "data": str(data),
                                        "batch_size": plan.batch_size, "epochs": 1, "device": "cpu",
                                        "reference": plan.reference, "work": str(work / "check")},
                                       work / "check.log")
        log(f"gpu check: the DataLoader's arrays equal the feed's in {head['same_work']['batches']} batches")
        for name in plan.sizes:
            _one_size(plan, name, device, work, sizes, log, keep)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {**head, "sizes": sizes, "targets": targets(sizes), "complete": True}


def _one_size(plan: GpuPlan, name: str, device: str, work: Path, sizes: dict[str, Any],
              log: Callable[[str], None], keep: Callable[[], None]) -> None:
    """Size ``name``: calibrated where asked, then replay and, for each P, the feed and the
    DataLoader, each into ``sizes[name]`` as it is measured (``keep`` after each)."""
    cuda = device.startswith("cuda")
    size = SIZES[name]
    size = dataclasses.replace(size, dim=plan.dim or size.dim, layers=plan.layers or size.layers)
    if not cuda:
        size = dataclasses.replace(size, dim=plan.dim or CPU_DIM, heads=min(size.heads, 4))
    hold = 0 if cuda else (plan.cpu_hold_ops if plan.cpu_hold_ops >= 0 else CPU_HOLD_OPS[name])
    base = {"data": str(work / "clips"), "batch_size": plan.batch_size, "epochs": plan.epochs, "device": device,
            "size": dataclasses.asdict(size), "hold_ops": hold, "name": name}
    calibration = None
    if plan.calibrate if plan.calibrate is not None else cuda and not (plan.dim or plan.layers):
        aim = AIMS[name]
        calibration = _run_child({**base, "kind": "calibrate", "producers": 0, "aim": dataclasses.asdict(aim),
                                  "work": str(work / f"{name}-calibrate")}, work / f"{name}-calibrate.log")
        base["size"] = calibration["size"]
        log(f"gpu {name}: {aim.field} {calibration['size'][aim.field]}, its {calibrated(calibration)}")

    def one(kind: str, producers: int) -> dict[str, Any]:
        spec = {**base, "kind": kind, "producers": producers, "work": str(work / f"{name}-{kind}-{producers}")}
        s = summarize_run(_run_child(spec, work / f"{name}-{kind}-{producers}.log"), plan.warmup_steps)
        log(f"gpu {name} {kind} P={producers}: {s['samples_per_s']:.1f} samples/s, wait {s['wait_share']:.3f}, "
            f"steps {s['steps']}, samples {s['samples']}")
        return s

    runs: dict[str, Any] = {}
    sizes[name] = {"model": base["size"], "hold_ops": hold, "calibration": calibration, "replay": one("replay", 0),
                   "producers": runs}
    keep()
    for p in plan.producers:
        run_ = runs[str(p)] = {"feed": one("feed", p), "dataloader": None, "dataloader_reference": None}
        run_["compare"] = compare(sizes[name]["replay"], run_["feed"], None)
        keep()  # the feed's figures, before the dataloader runs
        run_["dataloader"] = one("dataloader", p)
        run_["compare"] = compare(sizes[name]["replay"], run_["feed"], run_["dataloader"])
        keep()
        if plan.reference:
            run_["dataloader_reference"] = one("dataloader-reference", p)
            run_["compare"] = compare(sizes[name]["replay"], run_["feed"], run_["dataloader"],
                                      run_["dataloader_reference"])
            keep()


def targets(sizes: dict[str, Any]) -> list[dict[str, Any]]:
    """The GPU targets at the largest producer count of each size."""
    out = []
    for name, s in sizes.items():
        p = max(s["producers"], key=int)
        run_ = s["producers"][p]
        c = run_["compare"]
        compared = [v["feed_vs_replay"] for v in c["shapes"].values() if v["feed_vs_replay"]]
        if not compared:
            raise BenchError(f"{name} P={p}: no bucket shape was timed by both the feed and the replay "
                             "(past their warm-up): give more clips or epochs")
        worst = max(compared, key=lambda r: r["value"])
        out.append({"what": f"{name} P={p}: feed step / replay step, worst shape", "value": worst["value"],
                    "ratio": worst, "limit": TARGET_STEP_RATIO, "met": worst["value"] <= TARGET_STEP_RATIO})
        r = c["feed_vs_dataloader"]
        out.append({"what": f"{name} P={p}: feed / DataLoader samples/s", "value": r["value"], "ratio": r,
                    "limit": TARGET_VS_DATALOADER, "met": r["value"] >= TARGET_VS_DATALOADER})
        wait = run_["feed"]["wait_share"]
        out.append({"what": f"{name} P={p}: feed wait share", "value": wait, "limit": TARGET_WAIT_SHARE,
                    "met": wait <= TARGET_WAIT_SHARE})
    return out


def calibrated(calibration: dict[str, Any]) -> str:
    """What a size's calibration aimed at, and every value it tried with its step."""
    field, aim = calibration["aim"]["field"], calibration["aim"]["step_ms"]
    tried = ", ".join(f"{value}: {ms:.1f} ms" for value, ms in calibration["trail"])
    return f"{field} calibrated for a step of ~{aim:g} ms at {calibration['shape']} ({tried})"


def render(section: dict[str, Any]) -> str:
    def num(v: Any, digits: int = 1) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    parts = [f"device {section['device']} ({section['device_name']}); step: {section['step']}"]
    same = section.get("same_work")
    if same:
        parts.append(f"dataloader: the producers' BatchMaker in its workers; its arrays equal the feed's in "
                     f"{same['batches']} batches (checked before timing)")
        cpu = same.get("cpu_ms_per_batch") or {}
        if cpu:
            parts.append("CPU per batch, made in the check's process in turns (ms, median [min, max] over "
                         f"{same['batches']} batches): " + "; ".join(
                             f"{name} {v['median']:.1f} [{v['min']:.1f}, {v['max']:.1f}]" for name, v in cpu.items()))
        if same["reference_mel_max_abs_diff"] is not None:
            parts.append(f"dataloader-reference (extra way): the per-clip reference log-mel instead; its mels within "
                         f"{same['reference_mel_max_abs_diff']:.1e} of the feed's")
    for name, s in section["sizes"].items():
        model = ", ".join(f"{k} {v}" for k, v in s["model"].items())
        parts += ["", f"{name}: {model}; {s['replay']['parameters'] / 1e6:.2f} M parameters"]
        if s.get("calibration"):
            parts[-1] += f"; its {calibrated(s['calibration'])}"
        rows = [[name, "replay", "-", num(s["replay"]["samples_per_s"]), "-", "-",
                 num(s["replay"]["gpu_util"], 0), s["replay"]["samples"]]]
        for p, r in s["producers"].items():
            for kind, key in WAY_KEYS.items():
                v = r.get(key)
                if v is not None:
                    rows.append([name, kind, p, num(v["samples_per_s"]), num(v["wait_share"], 4),
                                 num(v["first_batch_s"], 2), num(v["gpu_util"], 0), v["samples"]])
        parts += ["", table(["size", "way", "P", "samples/s", "wait share", "first batch s", "GPU util %", "samples"],
                            rows)]
        extra = [f"P={p} {r['compare']['feed_vs_dataloader_reference']['value']:.3f}" for p, r in s["producers"].items()
                 if r["compare"].get("feed_vs_dataloader_reference")]
        if extra:
            parts.append("feed / dataloader-reference samples/s (the extra way, not a target): " + ", ".join(extra))
        threads = {p: ", ".join(r["feed"]["threads"]) for p, r in s["producers"].items() if r["feed"].get("threads")}
        parts += [f"the feed's trainer process's threads (P={p}): {names}" for p, names in threads.items()]
        shape_rows = []
        for p, r in s["producers"].items():
            for shape, v in r["compare"]["shapes"].items():
                shape_rows.append([name, p, shape, num(v["replay_ms"], 2), num(v["feed_ms"], 2),
                                   num(v["dataloader_ms"], 2),
                                   num(v["feed_vs_replay"] and v["feed_vs_replay"]["value"], 3),
                                   num(v["dataloader_vs_replay"] and v["dataloader_vs_replay"]["value"], 3)])
        parts += ["", "median step per bucket shape (B x L x T), ms; ratios against replay",
                  table(["size", "P", "shape", "replay", "feed", "dataloader", "feed/replay", "dataloader/replay"],
                        shape_rows)]
    parts += ["", targets_table(section["targets"])]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["child"]:
        print(RESULT_PREFIX + json.dumps(child_main(json.loads(args[1]))), flush=True)
        return 0
    parser = argparse.ArgumentParser(prog="python -m stoker.benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer clips and epochs, P = 1 and the cores")
    parser.add_argument("--size", action="append", choices=sorted(SIZES), help="model sizes (default: both)")
    parser.add_argument("--producers", type=int, action="append", help="P of the sweep (default 1, 2, 4 ... cores)")
    parser.add_argument("--clips", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--warmup-steps", type=int)
    parser.add_argument("--dim", type=int, help="model width of every size (default: the size's)")
    parser.add_argument("--layers", type=int, help="encoder layers of every size (default: the size's)")
    parser.add_argument("--cpu-hold-ops", type=int, help="tiny torch ops per step on the CPU (default: the size's)")
    parser.add_argument("--device", help="cuda:N or cpu (default: cuda:0 when available)")
    parser.add_argument("--calibrate", action=argparse.BooleanOptionalAction,
                        help="size each model to its step on the device first (default: on CUDA, unless --dim or "
                             "--layers are given)")
    parser.add_argument("--no-reference", dest="reference", action="store_false", default=None,
                        help="leave out the extra way, dataloader-reference (the per-clip reference log-mel)")
    parser.add_argument("--out", help="also write the section to this JSON file (after each way, with "
                                      "complete: false, until the end)")
    ns = parser.parse_args(args)
    plan = GpuPlan.quick() if ns.quick else GpuPlan()
    changes = {"sizes": tuple(ns.size) if ns.size else None, "producers": tuple(ns.producers) if ns.producers else None,
               "clips": ns.clips, "epochs": ns.epochs, "batch_size": ns.batch_size, "warmup_steps": ns.warmup_steps,
               "dim": ns.dim, "layers": ns.layers, "cpu_hold_ops": ns.cpu_hold_ops, "device": ns.device,
               "calibrate": ns.calibrate, "reference": ns.reference}
    plan = dataclasses.replace(plan, **{k: v for k, v in changes.items() if v is not None})
    try:
        section = run(plan, log=lambda text: print(text, file=sys.stderr, flush=True),
                      partial=(lambda kept: write_json(Path(ns.out), kept)) if ns.out else None)
    except BenchError as exc:
        print(f"gpu benchmark failed: {exc}", file=sys.stderr)
        return 1
    return report(render(section), section, ns.out)


if __name__ == "__main__":
    sys.exit(main())
