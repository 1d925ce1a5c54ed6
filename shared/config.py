"""Configuration schema: frozen dataclasses loaded from YAML.

Every key of ``configs/default.yaml`` is a field of one of the sections below, and
nothing else is accepted: an unknown key or a value of the wrong type is a
:class:`ConfigError`, not a silent default (as nanoGPT's configurator refuses them).
Units are part of the names (``_ms``, ``_s``, ``_hz``, ``_mb``).

Each default is written once, in ``configs/default.yaml`` beside what it means; the
dataclasses take their defaults from it (:func:`section`). Precedence, lowest first: those
defaults, the YAML file given, command-line flags, ``--set section.key=value`` overrides. The resolved config is written to the run
directory as ``config.yaml`` and is what every child process loads.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from .batch import BatchSchema, parse_declared_fields, schema_for
from .conventions import convention_settings
from .endpoints import EndpointError, check_endpoint
from .errors import UserError
from .dataset.layouts import LayoutError, parse_columns
from .dataset.parquet_layout import is_column_map, parse_column_map
from .runfiles import write_atomic
from .text import DIGITS_KEEP, DIGITS_SPELL, FRONTEND_CHARACTERS, FRONTEND_PHONEMES, LANGUAGES

# Every key with its default and meaning; shipped inside the installed package (pyproject.toml
# maps configs/ there), beside stoker/'s layers in a checkout: two levels above this file either way.
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


class ConfigError(UserError, ValueError):
    """A configuration the user wrote cannot be used (unknown key, wrong type, bad value)."""


def _yaml_defaults() -> dict[str, Any]:
    """The defaults file, parsed by libyaml where PyYAML has it: every stoker process parses it
    when it starts, and the pure-Python parser takes a good part of that start."""
    with open(DEFAULT_CONFIG, encoding="utf-8") as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}


# Every default is written once, in configs/default.yaml beside its explanation; the
# sections below take theirs from it (section()).
YAML_DEFAULTS = _yaml_defaults()


def section(name: str, defaults: Mapping[str, Any] | None = None) -> Callable[[type], type]:
    """A frozen dataclass for config section ``name`` whose field defaults are the section's
    values in configs/default.yaml (``defaults``: another mapping of sections, for tests).
    A field the file lacks, or a key of the file no field has, is an error here, at import."""
    table = YAML_DEFAULTS if defaults is None else defaults

    def make(cls: type) -> type:
        values = table.get(name) or {}
        fields = list(cls.__dict__.get("__annotations__", {}))
        missing, unknown = [f for f in fields if f not in values], [k for k in values if k not in fields]
        if missing or unknown:
            raise RuntimeError(f"{DEFAULT_CONFIG.name}, section {name}: no default for {missing}; keys no setting "
                               f"has: {unknown}")
        for key in fields:
            setattr(cls, key, values[key])
        return dataclass(frozen=True)(cls)

    return make


@section("data")
class DataConfig:
    """Where the dataset is and which clips are usable."""

    path: str  # LJSpeech-layout directory; empty means the embedded demo set
    metadata_file: str  # LJSpeech lines (see data.columns), or a *.jsonl manifest
    columns: str  # metadata fields, e.g. "id|speaker|text"; "" = by field count (shared/dataset/layouts.py)
    eval_file: str  # held-out clips in the same layout (metadata_eval.csv); "" = trainer.val_clips by hash
    min_audio_s: float  # shorter clips are rejected at index time
    max_audio_s: float  # longer clips are rejected at index time
    max_tokens: int  # texts that tokenize to more are rejected at index time
    index_cache: str  # "" = DATASET/.stoker (or the user cache dir if read-only); "off"; or a directory
    index_workers: int  # processes reading headers or manifest pieces on a cold index build; 0 = one per core
    feature_cache: str  # "" = off; "auto" = DATASET/.stoker/features (or the user cache dir); or a directory


@section("text")
class TextConfig:
    """What a clip's text becomes (shared/text.py): the front-end and its language rules."""

    frontend: str  # characters | phonemes | package.module:function (--text-frontend)
    language: str  # language of clips whose metadata names none (--language)
    digits: str  # spell: numbers spelled out in the clip's language (num2words) | keep: digit symbols
    max_lost_frac: float  # reject a clip whose text loses more than this share of its characters


@section("features")
class FeaturesConfig:
    """The log-mel spectrogram; see producer/features.py for the exact definition."""

    sample_rate_hz: int
    n_fft: int
    hop_length: int
    win_length: int
    n_mels: int
    fmin_hz: float
    fmax_hz: float
    mel_scale: str  # slaney | htk (triangles linear in Hz) | tf (HTK, triangles linear in mel)
    filter_norm: str  # slaney (unit-area filters) | none (peak 1)
    padding: str  # reflect | constant (centred frames) | end | none (frames from sample 0) | reflect_overlap
    window: str  # hann (periodic) | hann_symmetric
    power: float  # 1: magnitude | 2: power
    bin_power_offset: float  # each bin's |X|^2 as max(|X|^2 + offset, floor) before the power
    bin_power_floor: float
    log: str  # ln | log10 | db
    log_floor: float  # log(max(mel + log_offset, log_floor))
    log_offset: float
    top_db: float  # log: db only: each clip clamped to its maximum - top_db (0: off)
    db_norm: str  # off | symmetric: a fixed dB range [ref + min, ref] mapped to [-max_abs, max_abs], clipped
    db_ref_level: float
    db_min_level: float
    db_max_abs: float
    convention: str  # "" | a codebase's definition by name (shared/conventions.py), filling in the defaults
    user: str  # "" | package.module:function, the user's mel: (audio, sample_rate_hz) -> float32 [T, n_mels]
    backend: str  # "tf": TensorFlow ops on the data device; "numpy": numpy/scipy; "auto": tf on a GPU


# The built-in transforms' definition, part of the feature cache's and the mel statistics' keys
# when trim or normalize is on: raised when those steps compute differently, so that no mel
# made the old way is served (2: the levels are read from the mel's own frames).
TRANSFORMS_REVISION = 2


@section("transforms")
class TransformsConfig:
    """What a producer does to a clip's waveform before its log-mel (producer/transforms.py); all off."""

    user: str  # the user's transforms, first: package.module:function, comma-separated
    fields: str  # batch fields they return: name:dtype:DIMS:pad, comma-separated (e.g. pitch:float32:T:0)
    models: str  # producer models (producer/models.py): package.module:function, comma-separated
    model_fields: str  # batch fields they return: name:dtype:DIMS:pad (DIMS may hold T/4 and numbers)
    trim_margin_s: float  # cut this much off each end first
    trim_samples_db: float  # then cut leading/trailing samples by their RMS frames' dB (librosa.effects.trim; 0: off)
    trim_db: float  # cut leading and trailing frames this many dB below the loudest (0: off)
    normalize: str  # off | peak (to peak_dbfs) | loudness (to loudness_lufs, ITU-R BS.1770)
    peak_dbfs: float
    loudness_lufs: float
    preemphasis: float  # y[n] = x[n] - a x[n-1] (0: off; 0.97 is common)
    mel_norm: str  # off | dataset: (mel - mean) / std per channel (precompute) | clip_minmax: each clip to [0, 1]


@section("batching")
class BatchingConfig:
    """How the epoch plan groups samples into batches of a few fixed shapes."""

    batch_size: int  # rows of every batch (fixed rows; ignored under a frame budget)
    fixed_rows: bool  # every batch keeps its bucket's rows, empty ones marked by row_mask (else only real rows)
    max_frames: int  # frame budget (--max-frames): rows per bucket so a batch holds about this many frames; 0 = off
    num_buckets: int  # distinct padded shapes, so the trainer traces at most this many (+1: the short batch)
    frames_multiple: int  # bucket frame bounds are rounded up to a multiple of this
    tokens_multiple: int  # bucket token bounds are rounded up to a multiple of this
    seed: int  # seeds the per-epoch shuffle of batches
    shard_window: int  # tar shards: batches made from this many shards at a time (0: shuffled across all)
    fields: str  # optional batch fields, comma-separated: speaker_id, language_id, stop, audio, ref_mel, row_mask
    ref_frames: int  # R of ref_mel: frames of the reference clip (cropped around its middle, or padded)


@section("pipeline")
class PipelineConfig:
    """Processes, sockets and flow control."""

    producers: int  # local producer processes; 0 means remote ones only
    producers_per: str  # rank | host: under torchrun, each rank's own, or one pool for the ranks of a host
    producers_auto: bool  # --producers auto: start with one, add/remove by evidence
    max_producers: int  # ceiling for producers_auto (0: the host's core count)
    bind: str  # consumer's ROUTER endpoint; '*' picks a free port
    buffer_size: int  # queue capacity in batches (receiving, staged, training)
    model_start_delay_s: float  # warm-up: after the first batch, wait for a full queue or this
    lease_ahead: int  # planned batches a producer may hold (prepared or in preparation)
    heartbeat_interval_s: float  # how often each side says it is alive
    heartbeat_timeout_s: float  # silence after which a peer is presumed dead
    lease_timeout_s: float  # a lease not prepared in this long is re-planned elsewhere
    max_message_mb: int  # larger frames are refused by the socket (ZMQ_MAXMSGSIZE)
    producer_restarts: int  # restarts of one crashed local producer before giving up
    keys: str  # directory of CURVE keys (empty: no authentication)
    insecure: bool  # allow binding a non-loopback address without keys

    @property
    def max_message_bytes(self) -> int:
        """``max_message_mb`` in bytes: the largest frame a socket takes (ZMQ_MAXMSGSIZE)."""
        return self.max_message_mb << 20


@section("devices")
class DevicesConfig:
    """GPU pinning. None means: no GPU for that role (CPU), unless auto-selected."""

    data_gpu: int | None
    model_gpu: int | str | None  # one index, a list "1,2,3" (a model replica on each) or "all"
    data_gpu_memory_mb: int | None  # per producer process
    model_gpu_memory_mb: int | None  # per model GPU
    replicas: int | None  # model replicas: None follows model_gpu (one per GPU; 1 on the CPU)


@section("trainer")
class TrainerConfig:
    """The training loop and the model's optimisation (consumer/training/trainer.py, consumer/training/tts.py)."""

    model: str  # tiny | small | base | synthetic:MS | package.module:function
    steps: int | None  # stop after this many steps (None: run --epochs)
    epochs: int | None  # stop after this many full epochs (overrides steps)
    loss: str  # mel: stoker's masked L1 (+ the model's own terms) | model: the model's terms only | mod:fn
    optimizer: str  # adam | adamw | package.module:function (called with learning_rate=the schedule)
    weight_decay: float  # AdamW's decoupled weight decay (optimizer: adamw)
    learning_rate: float  # peak learning rate, reached after the warm-up
    warmup_steps: int  # optimizer updates of linear learning-rate warm-up
    lr_decay: str  # after the warm-up: cosine | cosine_restarts | noam | constant (consumer/training/optim.lr_at)
    min_lr_frac: float
    restart_steps: int  # cosine_restarts: optimizer updates per cycle
    grad_accum: int  # batches whose gradients are summed into one update
    clip_norm: float  # clip the update's global gradient norm to this (0: no clipping)
    l2_weight: float  # weight of the masked L2 mel loss added to the L1
    length_loss_weight: float  # weight of the length head's loss (what synth uses to choose T)
    precision: str  # auto (mixed_float16 on GPU, float32 on CPU) | float32 | mixed_float16 | mixed_bfloat16
    jit_compile: bool | None  # XLA for the step; None: on for a GPU, off on the CPU
    max_bad_steps: int  # stop after this many non-finite losses in a row (each is skipped)
    val_clips: int  # clips held out of training for the validation loss (at most a tenth)
    val_every_steps: int  # validation loss (and a mel image in tb/) this often, and at the end
    log_every_steps: int  # progress line interval; the only point the step syncs with the host
    framework: str  # what a stoker.Feed hands out: tensorflow | torch | jax | numpy (FRAMEWORKS)
    record_samples: bool  # write samples.jsonl (ids of every batch)
    steady_heap: bool  # glibc's malloc keeps the heap's freed top in the trainer process (shared/proc.steady_heap)
    seed: int
    checkpoint_every_steps: int  # checkpoint (ckpt/) every this many steps; 0 = only at the end and on stop
    keep_checkpoints: int  # the newest this many checkpoints are kept


@section("faults")
class FaultsConfig:
    """Injected faults, to test the diagnosis on controlled scenarios (all off by default).

    They act inside every producer and use no CPU: a delay stands in for slow storage,
    a stall for a periodic hiccup (garbage collection, a storage pause).
    """

    producer_delay_ms: float  # added to the preparation of every batch
    producer_stall_every_s: float  # a producer stalls once per this period (0: never)
    producer_stall_s: float  # for this long


@section("run")
class RunConfig:
    """Where the run's files go."""

    run_dir: str  # empty: runs/<timestamp>/
    log_level: str
    metrics_port: int  # serve Prometheus metrics on this port (0: off)


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    text: TextConfig = field(default_factory=TextConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    transforms: TransformsConfig = field(default_factory=TransformsConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    run: RunConfig = field(default_factory=RunConfig)


PRECISIONS = ("auto", "float32", "mixed_float16", "mixed_bfloat16")
# What a stoker.Feed hands out (trainer.framework): TensorFlow tensors, PyTorch tensors, JAX arrays, numpy arrays.
TENSORFLOW = "tensorflow"
FRAMEWORKS = (TENSORFLOW, "torch", "jax", "numpy")
LR_DECAYS = ("cosine", "cosine_restarts", "noam", "constant")
LOSSES = ("mel", "model")
OPTIMIZERS = ("adam", "adamw")


def _is_function_spec(value: str) -> bool:
    """``package.module:function``, by its shape (the module is imported by the trainer only)."""
    module, sep, function = value.partition(":")
    return bool(sep) and function.isidentifier() and all(p.isidentifier() for p in module.split("."))

SECTIONS: dict[str, type] = typing.get_type_hints(Config)


def _section_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _check_value(where: str, value: Any, annotation: Any) -> Any:
    """Return ``value`` if it fits ``annotation`` (int accepted for float), else raise."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_value(where, value, option)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {annotation!r}")  # schema bug


def section_from(name: str, given: Mapping[str, Any]) -> Any:
    """Config section ``name`` from some of its keys (the others: defaults), each checked for its
    type; ConfigError for a key the section lacks or a value of the wrong type. No cross-field
    rules: for a section another process checked (a producer's, from the trainer's WELCOME)."""
    hints = _section_types(SECTIONS[name])
    unknown = sorted(set(given) - set(hints))
    if unknown:
        raise ConfigError(f"unknown config key '{name}.{unknown[0]}'")
    return SECTIONS[name](**{k: _check_value(f"{name}.{k}", v, hints[k]) for k, v in given.items()})


def _validate(cfg: Config) -> None:
    """Cross-field rules that types alone cannot express; ConfigError names the first broken one."""
    f, b, p, t = cfg.features, cfg.batching, cfg.pipeline, cfg.trainer
    positive = {
        "features.sample_rate_hz": f.sample_rate_hz, "features.n_fft": f.n_fft,
        "features.hop_length": f.hop_length, "features.win_length": f.win_length,
        "features.n_mels": f.n_mels, "batching.batch_size": b.batch_size,
        "batching.num_buckets": b.num_buckets, "batching.frames_multiple": b.frames_multiple,
        "batching.ref_frames": b.ref_frames,
        "batching.tokens_multiple": b.tokens_multiple, "pipeline.buffer_size": p.buffer_size,
        "pipeline.lease_ahead": p.lease_ahead, "pipeline.heartbeat_interval_s": p.heartbeat_interval_s,
        "pipeline.max_message_mb": p.max_message_mb, "trainer.log_every_steps": t.log_every_steps,
        "pipeline.lease_timeout_s": p.lease_timeout_s, "trainer.keep_checkpoints": t.keep_checkpoints,
        "data.max_tokens": cfg.data.max_tokens,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    _validate_features_and_pipeline(cfg)
    _validate_trainer(t)
    _validate_text(cfg)
    _validate_transforms(cfg)
    _validate_data_devices_run(cfg)


def _validate_features_and_pipeline(cfg: Config) -> None:
    f, b, p = cfg.features, cfg.batching, cfg.pipeline
    if b.shard_window < 0:
        raise ConfigError(f"batching.shard_window must be 0 (off) or positive, got {b.shard_window}")
    if f.win_length > f.n_fft:
        raise ConfigError(f"features.win_length ({f.win_length}) must not exceed features.n_fft ({f.n_fft})")
    if not 0 <= f.fmin_hz < f.fmax_hz <= f.sample_rate_hz / 2:
        raise ConfigError(
            f"need 0 <= features.fmin_hz < features.fmax_hz <= sample_rate_hz/2, got "
            f"{f.fmin_hz}, {f.fmax_hz}, {f.sample_rate_hz / 2}")
    if f.backend not in ("auto", "tf", "numpy"):
        raise ConfigError(f"features.backend must be 'auto', 'tf' or 'numpy', got {f.backend!r}")
    if f.backend == "tf" and cfg.trainer.framework != TENSORFLOW:
        raise ConfigError(f"features.backend tf runs TensorFlow in the producers, for TensorFlow runs only; "
                          f"trainer.framework is {cfg.trainer.framework}: use auto or numpy")
    _validate_mel_convention(cfg)
    if b.max_frames < 0:
        raise ConfigError(f"batching.max_frames must be >= 0 (0: fixed batch_size rows), got {b.max_frames}")
    if p.heartbeat_timeout_s <= p.heartbeat_interval_s:
        raise ConfigError("pipeline.heartbeat_timeout_s must exceed pipeline.heartbeat_interval_s")
    if p.producers_per not in PRODUCERS_PER:
        raise ConfigError(f"pipeline.producers_per must be one of {', '.join(PRODUCERS_PER)}, got {p.producers_per!r}")
    if p.producers < 0 or p.producer_restarts < 0 or p.model_start_delay_s < 0 or p.max_producers < 0:
        raise ConfigError("pipeline.producers, producer_restarts and model_start_delay_s must be >= 0")
    try:
        check_endpoint(p.bind, bind=True)
    except EndpointError as exc:
        raise ConfigError(f"pipeline.bind: {exc}") from None
    try:
        schema_for(b.fields)
    except ValueError as exc:
        raise ConfigError(f"batching.fields: {exc}") from None


PRODUCERS_PER = ("rank", "host")
MEL_SCALES = ("slaney", "htk", "tf")
FILTER_NORMS = ("slaney", "none")
PADDINGS = ("reflect", "constant", "end", "none", "reflect_overlap")
WINDOWS = ("hann", "hann_symmetric")
DB_NORMS = ("off", "symmetric")
POWERS = (1.0, 2.0)
LOGS = ("ln", "log10", "db")
MEL_NORMS = ("off", "dataset", "clip_minmax")


def _validate_mel_convention(cfg: Config) -> None:
    """The mel convention's settings (producer/features.py), one line for the first wrong one."""
    f = cfg.features
    for key, value, allowed in (("mel_scale", f.mel_scale, MEL_SCALES), ("filter_norm", f.filter_norm, FILTER_NORMS),
                                ("padding", f.padding, PADDINGS), ("log", f.log, LOGS),
                                ("window", f.window, WINDOWS), ("db_norm", f.db_norm, DB_NORMS)):
        if value not in allowed:
            raise ConfigError(f"features.{key} must be one of {', '.join(allowed)}, got {value!r}")
    if f.power not in POWERS:
        raise ConfigError(f"features.power must be 1 (magnitude) or 2 (power), got {f.power}")
    if min(f.log_floor, f.log_offset, f.top_db) < 0 or max(f.log_floor, f.log_offset) <= 0:
        raise ConfigError(f"need features.log_floor >= 0, log_offset >= 0 (one of them positive: the log of "
                          f"silence) and top_db >= 0; got {f.log_floor}, {f.log_offset}, {f.top_db}")
    if f.top_db > 0 and f.log != "db":
        raise ConfigError(f"features.top_db clamps decibels: it needs features.log: db (got {f.log!r})")
    if min(f.bin_power_offset, f.bin_power_floor) < 0:
        raise ConfigError(f"need features.bin_power_offset >= 0 and bin_power_floor >= 0, got {f.bin_power_offset}, "
                          f"{f.bin_power_floor}")
    if f.db_norm != "off" and (f.log != "db" or f.db_min_level >= 0 or f.db_max_abs <= 0):
        raise ConfigError(f"features.db_norm {f.db_norm} maps decibels: it needs features.log: db, db_min_level < 0 "
                          f"and db_max_abs > 0 (got {f.log!r}, {f.db_min_level}, {f.db_max_abs})")
    if f.user and f.convention:
        raise ConfigError(f"features.user replaces the mel that features.convention {f.convention} defines: "
                          f"set one of them")
    if f.user and not _is_function_spec(f.user):
        raise ConfigError(f"features.user must be package.module:function, got {f.user!r}")
    if f.user and (cfg.transforms.trim_db > 0 or cfg.transforms.normalize != "off"):
        raise ConfigError("features.user cannot be combined with transforms.trim_db or transforms.normalize, which "
                          "measure the built-in mel's frames")
    if f.padding in ("none", "reflect_overlap") and "audio" in schema_for(cfg.batching.fields).names:
        raise ConfigError(f"batching.fields audio needs features.padding reflect, constant or end: with padding "
                          f"{f.padding} a clip's samples do not fit in T x hop_length")


def _validate_trainer(t: TrainerConfig) -> None:
    if t.lr_decay not in LR_DECAYS:
        raise ConfigError(f"trainer.lr_decay must be one of {', '.join(LR_DECAYS)}, got {t.lr_decay!r}")
    for key, value, builtin in (("loss", t.loss, LOSSES), ("optimizer", t.optimizer, OPTIMIZERS)):
        if value not in builtin and not _is_function_spec(value):
            raise ConfigError(f"trainer.{key} must be one of {', '.join(builtin)} or package.module:function, "
                              f"got {value!r}")
    if t.weight_decay < 0 or t.restart_steps < 1:
        raise ConfigError("need trainer.weight_decay >= 0 and trainer.restart_steps >= 1")
    if t.framework not in FRAMEWORKS:
        raise ConfigError(f"trainer.framework must be one of {', '.join(FRAMEWORKS)}, got {t.framework!r}")
    if t.precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision must be one of {', '.join(PRECISIONS)}, got {t.precision!r}")
    if t.grad_accum < 1 or t.max_bad_steps < 1 or t.val_every_steps < 1:
        raise ConfigError("trainer.grad_accum, max_bad_steps and val_every_steps must be >= 1")
    if t.learning_rate <= 0 or not 0 <= t.min_lr_frac <= 1:
        raise ConfigError("need trainer.learning_rate > 0 and 0 <= trainer.min_lr_frac <= 1")
    if min(t.warmup_steps, t.val_clips) < 0 or min(t.clip_norm, t.l2_weight, t.length_loss_weight) < 0:
        raise ConfigError("trainer.warmup_steps, val_clips, clip_norm, l2_weight and length_loss_weight "
                          "must be >= 0")
    if t.steps is None and t.epochs is None:
        raise ConfigError("set trainer.steps or trainer.epochs")
    for key, value in (("trainer.steps", t.steps), ("trainer.epochs", t.epochs)):
        if value is not None and value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    if t.checkpoint_every_steps < 0:
        raise ConfigError(f"trainer.checkpoint_every_steps must be >= 0, got {t.checkpoint_every_steps}")


def _validate_text(cfg: Config) -> None:
    tx = cfg.text
    if tx.digits not in (DIGITS_SPELL, DIGITS_KEEP):
        raise ConfigError(f"text.digits must be {DIGITS_SPELL!r} or {DIGITS_KEEP!r}, got {tx.digits!r}")
    if not 0 <= tx.max_lost_frac <= 1:
        raise ConfigError(f"text.max_lost_frac must be between 0 and 1, got {tx.max_lost_frac}")
    if tx.frontend not in (FRONTEND_CHARACTERS, FRONTEND_PHONEMES) and not re.fullmatch(r"[\w.]+:\w+", tx.frontend):
        raise ConfigError(f"text.frontend must be characters, phonemes or package.module:function, got "
                          f"{tx.frontend!r}")
    if tx.language not in LANGUAGES:
        raise ConfigError(f"unknown language code {tx.language!r} for text.language (known: "
                          f"{', '.join(sorted(LANGUAGES))})")


def _validate_transforms(cfg: Config) -> None:
    tr = cfg.transforms
    try:
        parse_declared_fields(tr.fields)
    except ValueError as exc:
        raise ConfigError(f"transforms.fields: {exc}") from None
    if tr.fields and not tr.user:
        raise ConfigError("transforms.fields declares fields that only user transforms (transforms.user) make")
    for spec in (s.strip() for s in tr.user.split(",") if s.strip()):
        if not _is_function_spec(spec):
            raise ConfigError(f"transforms.user: {spec!r} is not package.module:function")
    try:
        schema_for(batch_fields(cfg), tr.fields, tr.model_fields)
    except ValueError as exc:
        raise ConfigError(f"transforms.model_fields: {exc}") from None
    if bool(tr.models.strip()) != bool(tr.model_fields.strip()):
        raise ConfigError("transforms.models and transforms.model_fields go together: the models return the "
                          "fields model_fields declares")
    for spec in (s.strip() for s in tr.models.split(",") if s.strip()):
        if not _is_function_spec(spec):
            raise ConfigError(f"transforms.models: {spec!r} is not package.module:function")
    if tr.mel_norm not in MEL_NORMS:
        raise ConfigError(f"transforms.mel_norm must be one of {', '.join(MEL_NORMS)}, got {tr.mel_norm!r}")
    if tr.normalize not in ("off", "peak", "loudness"):
        raise ConfigError(f"transforms.normalize must be off, peak or loudness, got {tr.normalize!r}")
    if tr.trim_margin_s < 0 or tr.trim_samples_db < 0:
        raise ConfigError(f"need transforms.trim_margin_s >= 0 and trim_samples_db >= 0, got {tr.trim_margin_s}, "
                          f"{tr.trim_samples_db}")
    if tr.trim_db < 0 or not 0 <= tr.preemphasis < 1 or tr.peak_dbfs > 0:
        raise ConfigError("need transforms.trim_db >= 0, 0 <= transforms.preemphasis < 1 and transforms.peak_dbfs <= 0")


def _validate_data_devices_run(cfg: Config) -> None:
    try:
        if cfg.data.columns:
            (parse_column_map if is_column_map(cfg.data.columns) else parse_columns)(cfg.data.columns)
    except LayoutError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.data.index_workers < 0:
        raise ConfigError(f"data.index_workers must be >= 0, got {cfg.data.index_workers}")
    if not 0 < cfg.data.min_audio_s < cfg.data.max_audio_s:
        raise ConfigError("need 0 < data.min_audio_s < data.max_audio_s")
    if cfg.devices.replicas is not None and cfg.devices.replicas < 1:
        raise ConfigError(f"devices.replicas must be >= 1, got {cfg.devices.replicas}")
    model_gpu = cfg.devices.model_gpu
    for key, value in (("devices.data_gpu", cfg.devices.data_gpu),
                       ("devices.model_gpu", model_gpu if isinstance(model_gpu, int) else None),
                       ("devices.data_gpu_memory_mb", cfg.devices.data_gpu_memory_mb),
                       ("devices.model_gpu_memory_mb", cfg.devices.model_gpu_memory_mb)):
        if value is not None and value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    fl = cfg.faults
    if fl.producer_delay_ms < 0 or fl.producer_stall_every_s < 0 or fl.producer_stall_s < 0:
        raise ConfigError("faults.* must be >= 0")
    if fl.producer_stall_s > 0 and fl.producer_stall_every_s <= fl.producer_stall_s:
        raise ConfigError("faults.producer_stall_every_s must exceed faults.producer_stall_s")
    if not 0 <= cfg.run.metrics_port <= 65535:
        raise ConfigError(f"run.metrics_port must be 0..65535, got {cfg.run.metrics_port}")
    if cfg.run.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError(f"run.log_level must be DEBUG, INFO, WARNING or ERROR, got {cfg.run.log_level!r}")


def batch_fields(cfg: Config) -> str:
    """The optional batch fields a run switches on: ``batching.fields``, and ``row_mask`` when
    rows are fixed (``batching.fixed_rows``)."""
    names = [n.strip() for n in cfg.batching.fields.split(",") if n.strip()]
    return ",".join(names + (["row_mask"] if cfg.batching.fixed_rows and "row_mask" not in names else []))


def batch_schema(cfg: Config) -> BatchSchema:
    """The batch of a run (shared/batch.py): SCHEMA, the optional fields it switches on
    (:func:`batch_fields`) and the fields its user transforms declare."""
    return schema_for(batch_fields(cfg), cfg.transforms.fields, cfg.transforms.model_fields)


def with_fixed_rows(cfg: Config, workers: int = 1) -> Config:
    """``cfg`` with ``batching.fixed_rows`` on where the run needs it: model replicas
    (``devices.replicas`` > 1) or trainer ``workers`` > 1 split every batch into equal parts."""
    if cfg.batching.fixed_rows or ((cfg.devices.replicas or 1) <= 1 and workers <= 1):
        return cfg
    return dataclasses.replace(cfg, batching=dataclasses.replace(cfg.batching, fixed_rows=True))


def with_convention(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """``raw`` with the settings of its ``features.convention`` (shared/conventions.py) under the
    keys it gives: a convention fills in the defaults, every key written beside it wins."""
    given = raw.get("features")
    name = given.get("convention", "") if isinstance(given, Mapping) else ""
    if not name:
        return raw
    if not isinstance(name, str):
        raise ConfigError(f"features.convention must be a name, got {name!r}")
    try:
        preset = convention_settings(name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    out = dict(raw)
    for section_name, values in preset.items():
        mine = raw.get(section_name)
        out[section_name] = {**values, **(mine if isinstance(mine, Mapping) else {})}
    return out


def from_dict(raw: Mapping[str, Any] | None, base: Config | None = None) -> Config:
    """Build a Config from nested mappings, on top of ``base`` (defaults if None)."""
    base = base or Config()
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}")
    raw = with_convention(raw)
    sections = {}
    for name, section_cls in SECTIONS.items():
        current = getattr(base, name)
        given = raw.get(name, {})
        if given is None:
            given = {}
        if not isinstance(given, Mapping):
            raise ConfigError(f"section '{name}' must be a mapping, got {given!r}")
        hints = _section_types(section_cls)
        unknown = sorted(set(given) - set(hints))
        if unknown:
            raise ConfigError(f"unknown config key '{name}.{unknown[0]}' (known in '{name}': "
                              f"{', '.join(sorted(hints))})")
        values = {k: _check_value(f"{name}.{k}", v, hints[k]) for k, v in given.items()}
        sections[name] = dataclasses.replace(current, **values)
    unknown_sections = sorted(set(raw) - set(SECTIONS))
    if unknown_sections:
        raise ConfigError(f"unknown config section '{unknown_sections[0]}' (known: {', '.join(SECTIONS)})")
    cfg = Config(**sections)
    _validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def load(path: str | Path | None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Load YAML at ``path`` (None: defaults only), then apply dotted ``overrides``."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config {p}: {exc.strerror}") from None
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config {p} is not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config {p} must be a mapping of sections")
    raw = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if not key or "." in key:
            raise ConfigError(f"override '{dotted}' must look like section.key")
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section '{section}' in '{dotted}' (known: {', '.join(SECTIONS)})")
        target = raw.get(section)
        if target is None:  # absent, or an empty section in the YAML (``devices:``)
            target = raw[section] = {}
        if not isinstance(target, dict):
            raise ConfigError(f"section '{section}' must be a mapping")
        target[key] = value
    return from_dict(raw)


_EXPONENT_FLOAT = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+")


def parse_override(text: str) -> tuple[str, Any]:
    """Parse one ``--set section.key=value``; the value is read as a YAML scalar."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects section.key=value, got {text!r}")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    if isinstance(parsed, str) and _EXPONENT_FLOAT.fullmatch(parsed.strip()):
        parsed = float(parsed)  # YAML 1.1 reads 1e-5 and 1.0e5 as strings
    return key.strip(), parsed


def save(cfg: Config, path: str | Path) -> None:
    """Write ``cfg`` as YAML, whole (RunFileError naming the file when it cannot be written)."""
    write_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
