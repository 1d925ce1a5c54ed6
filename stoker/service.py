"""The run service: what the command line (stoker/cli.py), ``stoker.Feed`` (stoker/feed.py)
and Slurm's tasks (stoker/slurm.py) do alike to run stoker.

An options' mapping (the command line's long flag names) and ``--set`` keys become a
config (:func:`resolve_options`); :func:`prepare_run` checks what the config asks for
before anything starts (the dataset, the model, the keys, the endpoint, the GPUs);
:func:`make_run_dir` makes a new run directory; :func:`launch` runs the launcher's
training and :func:`produce` its producers for a trainer elsewhere. Each mistake a user
can make is one UserError line. It imports no command line: the callers above it do the
parsing and the printing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import logging
import os
from pathlib import Path
from typing import Any, Callable

from .consumer.pipeline.checkpoint import Checkpointer
from .consumer.training.trainer import check_model, uses_tensorflow
from .devices import list_gpus, plan_devices, requested_replicas
from .launcher import run_producers, run_training
from .producer.features import resolve_backend
from .shared import config as config_mod
from .shared.cluster import from_env
from .shared.config import TENSORFLOW, DevicesConfig
from .shared.dataset import describe_copy, feature_cache_dir, locate
from .shared.dataset.storage import is_url
from .shared.endpoints import EndpointError, check_endpoint
from .shared.errors import UserError
from .shared.keys import KeysError, load_client_keys, load_server_keys
from .shared.layouts import is_cuts, is_manifest, is_shards
from .shared.mixes import is_mix
from .shared.proc import setup_logging
from .shared.runfiles import CKPT_DIR, CONFIG, RESUME_CONFIG, RUN_LOCK
from .shared.runlock import RunLock
from .shared.tfsetup import require_tensorflow

log = logging.getLogger("stoker")

DEFAULT_CONFIG = config_mod.DEFAULT_CONFIG
LOOPBACK_HOSTS = ("localhost", "::1", "[::1]")
# `run.py produce` restarts a crashed producer at most this many times (as pipeline.producer_restarts).
PRODUCE_RESTARTS = 3
# precompute is one epoch of a run whose trainer takes each batch and drops it at once:
# the real producers (all of them) fill the feature cache, and nothing waits on a model.
PRECOMPUTE_MODEL = "synthetic:0"

FLAG_KEYS = {
    "data": "data.path", "data_gpu": "devices.data_gpu", "model_gpu": "devices.model_gpu",
    "data_gpu_memory": "devices.data_gpu_memory_mb", "model_gpu_memory": "devices.model_gpu_memory_mb",
    "replicas": "devices.replicas",
    "producers": "pipeline.producers", "bind": "pipeline.bind", "batch_size": "batching.batch_size",
    "max_frames": "batching.max_frames",
    "steps": "trainer.steps", "epochs": "trainer.epochs", "buffer_size": "pipeline.buffer_size",
    "model_start_delay": "pipeline.model_start_delay_s", "model": "trainer.model", "run_dir": "run.run_dir",
    "record_samples": "trainer.record_samples", "keys": "pipeline.keys", "insecure": "pipeline.insecure",
    "log_level": "run.log_level", "metrics_port": "run.metrics_port", "max_producers": "pipeline.max_producers",
    "text_frontend": "text.frontend", "language": "text.language", "producer_models": "transforms.models",
}


def resolve_config(args: argparse.Namespace) -> config_mod.Config:
    """The config of a parsed command line: the options FLAG_KEYS names, ``config`` and ``set``."""
    options = {attr: getattr(args, attr, None) for attr in FLAG_KEYS}
    sets = dict(config_mod.parse_override(item) for item in args.set)
    return resolve_options(args.config, options, sets)


def resolve_options(config: str | None, options: dict[str, Any], sets: dict[str, Any]) -> config_mod.Config:
    """The run's config: the YAML file (default configs/default.yaml), the options by their
    long names (FLAG_KEYS; None: not given), then ``sets`` (dotted config keys)."""
    overrides: dict[str, Any] = {}
    for attr, key in FLAG_KEYS.items():
        value = options.get(attr)
        if value is not None:
            overrides[key] = value
    if overrides.get("pipeline.producers") == "auto":
        overrides["pipeline.producers"] = 1
        overrides["pipeline.producers_auto"] = True
    steps, epochs = options.get("steps"), options.get("epochs")
    if steps is not None and epochs is None:
        overrides["trainer.epochs"] = None
    if epochs is not None and steps is None:
        overrides["trainer.steps"] = None
    overrides.update(sets)
    if "data.path" in overrides and overrides["data.path"] and not is_url(overrides["data.path"]):
        overrides["data.path"] = str(Path(overrides["data.path"]).expanduser().resolve())
    cfg = config_mod.load(config or DEFAULT_CONFIG, overrides)
    if "pipeline.producers" not in overrides:
        # A step takes one batch per model replica: the default producers are per replica.
        producers = cfg.pipeline.producers * requested_replicas(cfg.devices)
        cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, producers=producers))
    return cfg


def is_loopback(endpoint: str) -> bool:
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0]
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def make_run_dir(requested: str) -> Path:
    if requested:
        path = Path(requested).expanduser().resolve()
    else:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path("runs").resolve() / stamp
        n = 1
        while path.exists():
            path = Path("runs").resolve() / f"{stamp}-{n}"
            n += 1
    if path.exists() and any(p.name != RUN_LOCK for p in path.iterdir()):  # its lock: taken by this run first
        raise UserError(f"run directory {path} is not empty; choose another --run-dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create run directory {path}: {exc.strerror}") from None
    return path


def resume_config(args: argparse.Namespace) -> tuple[config_mod.Config, Path]:
    """``--resume RUN_DIR``: that run's config.yaml with the flags given now; checks that
    there is something to resume (the consumer checks the checkpoint itself)."""
    run_dir = Path(args.resume).expanduser().resolve()
    if not run_dir.is_dir():
        raise UserError(f"--resume {run_dir}: no such run directory")
    if not (run_dir / CONFIG).is_file():
        raise UserError(f"--resume {run_dir}: it has no config.yaml, so it is not a stoker run directory")
    if args.config is not None:
        raise UserError("--resume continues with RUN_DIR/config.yaml; change keys with flags or --set, not --config")
    if args.run_dir is not None and Path(args.run_dir).expanduser().resolve() != run_dir:
        raise UserError("--resume continues in RUN_DIR itself; --run-dir cannot name another directory")
    if Checkpointer(run_dir / CKPT_DIR, keep=1).latest() is None:
        raise UserError(f"--resume {run_dir}: no checkpoint in {run_dir / CKPT_DIR} (the run stopped before its "
                        "first one); nothing to resume")
    args.config = str(run_dir / CONFIG)
    return resolve_config(args), run_dir


def prepare_run(cfg: config_mod.Config, *, trains_model: bool = True) -> tuple[config_mod.Config, Any]:
    """Check what the user asked for before anything starts (the dataset, the model, the
    keys, the endpoint, the GPUs); the config with the dataset's paths, the replicas and
    fixed rows (config.with_fixed_rows) resolved, and the device plan; for a run whose batches
    go to another framework than TensorFlow (trainer.framework), features.backend auto is numpy
    (no producer imports TensorFlow). UserError (one line) for each mistake."""

    root, metadata_file = locate(cfg.data.path, cfg.data.metadata_file)
    if trains_model:
        check_model(cfg.trainer.model)
        if uses_tensorflow(cfg.trainer.model):
            if cfg.trainer.framework != TENSORFLOW:
                raise UserError(f"trainer.framework is {cfg.trainer.framework}: stoker's trainer (--model "
                                f"{cfg.trainer.model}) trains with TensorFlow; the other frameworks are for your own "
                                f"loop on stoker.Feed (docs/FEED.md)")
            require_tensorflow(f"stoker's trainer (--model {cfg.trainer.model})")
    if cfg.trainer.framework != TENSORFLOW:
        cfg = dataclasses.replace(cfg, features=resolve_backend(cfg.features, framework=cfg.trainer.framework))
    if cfg.pipeline.keys:
        cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(
            cfg.pipeline, keys=str(Path(cfg.pipeline.keys).expanduser().resolve())))
        check_keys(Path(cfg.pipeline.keys), server=True, client=cfg.pipeline.producers > 0)
    elif not is_loopback(cfg.pipeline.bind) and not cfg.pipeline.insecure:
        raise UserError(f"--bind {cfg.pipeline.bind} is reachable from other hosts; producers there would be "
                        "unauthenticated: use --keys DIR (python run.py keys DIR), or add --insecure to accept that")
    plan = plan_devices(cfg.devices, list_gpus(), cfg.pipeline.producers)
    data = dataclasses.replace(cfg.data, path=data_path(root, metadata_file, cfg.data.metadata_file),
                               feature_cache=feature_cache_dir(cfg.data.feature_cache, root))
    devices = dataclasses.replace(cfg.devices, replicas=plan.replicas)  # resolved: the plan's batches depend on it
    cluster = from_env(os.environ)
    resolved = dataclasses.replace(cfg, data=data, devices=devices)
    return config_mod.with_fixed_rows(resolved, cluster.size if cluster is not None else 1), plan


def data_path(root: Path, metadata_file: str, configured: str = "") -> str:
    """What ``--data`` names, resolved, as producers are given it: the dataset directory, a mix
    file, a lhotse cut manifest, tar shards (their pattern: at a URL as given, else below their directory), or a
    manifest at a URL (as given). An LJSpeech metadata file at a URL named ``configured``
    (data.metadata_file): its directory's URL. data.eval_file is found beside either
    (consumer/pipeline/validation.py, shared/dataset/files.py ``beside``)."""
    if is_url(metadata_file):
        directory, _, name = metadata_file.rpartition("/")
        if name == configured and not is_manifest(name) and not is_shards(name) and not is_mix(name):
            return f"{directory}/"
        return metadata_file
    if is_shards(metadata_file):
        return str(root / metadata_file)
    return str(root / metadata_file if is_mix(metadata_file) or is_cuts(metadata_file) else root)


def launch(cfg: config_mod.Config, resume_dir: Path | None = None, *, run_dir: Path | None = None,
           on_ready: Callable[[str], None] | None = None,
           fresh_plan: bool = False) -> tuple[int, Path, config_mod.Config]:
    """Check what the user asked for, make the run directory (or take the resumed one's, or
    ``run_dir`` made by the caller), run; (status, run dir, config). ``on_ready``: called
    with the trainer's endpoint once it is bound; ``fresh_plan``: a resumed run keeps the
    checkpoint's weights and starts a new epoch plan (the dataset changed)."""

    setup_logging("launcher", cfg.run.log_level)
    cfg, plan = prepare_run(cfg)
    run_dir = resume_dir or run_dir or make_run_dir(cfg.run.run_dir)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_dir=str(run_dir)))
    with RunLock.acquire(run_dir):  # before anything in the run directory is written
        if resume_dir is None:
            config_mod.save(cfg, run_dir / CONFIG)
            log.info("%s", plan.describe(cfg.pipeline.producers))
            log.info("run directory %s", run_dir)
            return run_training(cfg, run_dir, plan, on_ready=on_ready), run_dir, cfg

        # The consumer moves it over config.yaml once the checkpoint has been checked: a
        # resume that fails leaves the run directory as it was.
        pending = run_dir / RESUME_CONFIG
        config_mod.save(cfg, pending)
        log.info("%s", plan.describe(cfg.pipeline.producers))
        log.info("resuming run directory %s", run_dir)
        try:
            return (run_training(cfg, run_dir, plan, resume=True, on_ready=on_ready, fresh_plan=fresh_plan),
                    run_dir, cfg)
        finally:
            pending.unlink(missing_ok=True)


def precompute_config(cfg: config_mod.Config) -> config_mod.Config:
    """``run.py precompute``: ``cfg`` as one epoch that fills the feature cache (PRECOMPUTE_MODEL)."""
    if cfg.pipeline.producers < 1:
        raise UserError("precompute needs at least one local producer (--producers N)")
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, feature_cache=cfg.data.feature_cache or "auto"),
        trainer=dataclasses.replace(cfg.trainer, model=PRECOMPUTE_MODEL, steps=None, epochs=1, record_samples=False),
        pipeline=dataclasses.replace(cfg.pipeline, model_start_delay_s=0.0))


def check_keys(directory: Path, server: bool, client: bool) -> None:
    """Load the keys a role needs now, so a bad key directory is one line before anything starts."""
    try:
        if server:
            load_server_keys(directory)
        if client:
            load_client_keys(directory)
    except KeysError as exc:
        raise UserError(f"--keys: {exc}") from None


def produce(connect: str, data: str, producers: int, *, data_gpu: int | None = None,
            data_gpu_memory: int | None = None, keys: str = "", log_level: str = "INFO", host: str = "") -> int:
    """``run.py produce``: ``producers`` producer processes on this host for the trainer at
    ``connect``; ``host`` names them (default: this host's name)."""
    setup_logging("launcher", log_level)
    if producers < 1:
        raise UserError("--producers must be at least 1")
    try:
        check_endpoint(connect, bind=False)
    except EndpointError as exc:
        raise UserError(f"--connect: {exc}") from None
    if keys:
        keys = str(Path(keys).expanduser().resolve())
        check_keys(Path(keys), server=False, client=True)
    elif not is_loopback(connect):
        log.warning("connecting to %s without --keys: batches travel unencrypted and the trainer cannot tell "
                    "who sends them", connect)
    root, metadata_file = locate(data, "metadata.csv")
    described = describe_copy(root, metadata_file)  # its metadata readable here: else one line, before any producer
    devices = DevicesConfig(data_gpu=data_gpu, model_gpu=None, data_gpu_memory_mb=data_gpu_memory)
    plan = plan_devices(devices, list_gpus() if data_gpu is not None else [], producers)
    log.info("dataset %s (%s), SHA-256 %s", root, metadata_file, described["sha256"][:16])
    return run_producers(connect, data_path(root, metadata_file), producers, plan, PRODUCE_RESTARTS, log_level, keys=keys, host=host)
