"""The run service: what the command line (stoker/cli.py), ``stoker.Feed`` (stoker/feed.py)
and Slurm's tasks (stoker/slurm.py) do alike to run stoker, as typed functions keyed by
config keys: a config from a YAML file and overrides (:func:`resolve`), the checks before
anything starts (:func:`prepare_run`), a run directory, a run (:func:`launch`), producers for
a trainer elsewhere (:func:`produce`) or beside the user's loop (:func:`start_producers`).
Each mistake is one UserError line naming the config key; docs/design/service.md, "The run service".
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml

from .consumer.feed.checkpoint import Checkpointer
from .consumer.training.trainer import check_model, uses_tensorflow
from .devices import DevicePlan, list_gpus, plan_devices, requested_replicas
from .hostpool import HostPool
from .launcher import BackgroundProducers, run_producers, run_training
from .producer.features import resolve_backend
from .shared import config as config_mod
from .shared.cluster import TF_CONFIG, from_env, worker_dir_name
from .shared.config import TENSORFLOW, Config, DevicesConfig
from .shared.dataset.agreement import describe_copy
from .shared.dataset.cache import feature_cache_dir
from .shared.dataset.corpus.registry import locate
from .shared.dataset.storage import is_url
from .shared.endpoints import EndpointError, check_endpoint
from .shared.errors import UserError
from .shared.keys import KeysError, load_client_keys, load_server_keys
from .shared.dataset.corpus.registry import format_of
from .shared.proc import setup_logging
from .shared.runfiles import CKPT_DIR, CONFIG, RESUME_CONFIG, RUN_LOCK
from .shared.runlock import RunLock
from .shared.tfsetup import require_tensorflow

log = logging.getLogger("stoker")

DEFAULT_CONFIG = config_mod.DEFAULT_CONFIG
# The config keys a run sets by name, and that name: the command line's flag is --NAME (its
# underscores as dashes), stoker.Feed's keyword is NAME; any other key goes through --set / set=.
KEY_NAMES = {
    "data.path": "data", "devices.data_gpu": "data_gpu", "devices.model_gpu": "model_gpu",
    "devices.replicas": "replicas", "devices.data_gpu_memory_mb": "data_gpu_memory",
    "devices.model_gpu_memory_mb": "model_gpu_memory", "pipeline.producers": "producers",
    "pipeline.producers_per": "producers_per", "pipeline.max_producers": "max_producers", "pipeline.bind": "bind",
    "batching.batch_size": "batch_size",
    "batching.max_frames": "max_frames", "trainer.steps": "steps", "trainer.epochs": "epochs",
    "pipeline.buffer_size": "buffer_size", "pipeline.model_start_delay_s": "model_start_delay",
    "trainer.model": "model", "text.frontend": "text_frontend", "transforms.models": "producer_models",
    "text.language": "language", "run.run_dir": "run_dir", "trainer.record_samples": "record_samples",
    "pipeline.keys": "keys", "pipeline.insecure": "insecure", "run.log_level": "log_level",
    "run.metrics_port": "metrics_port",
}
LOOPBACK_HOSTS = ("localhost", "::1", "[::1]")
# `run.py produce` restarts a crashed producer at most this many times (as pipeline.producer_restarts).
PRODUCE_RESTARTS = 3
# precompute is one epoch of a run whose trainer takes each batch and drops it at once:
# the real producers (all of them) fill the feature cache, and nothing waits on a model.
PRECOMPUTE_MODEL = "synthetic:0"
# pipeline.producers "auto": start with this many, add while the trainer starves.
AUTO_START = 1


class SettingError(UserError):
    """A setting that cannot work, one line starting with its config key (``key: message``),
    with the keys the message suggests setting instead: an adapter may name their flags."""

    def __init__(self, key: str, message: str, suggests: tuple[str, ...] = ()) -> None:
        super().__init__(f"{key}: {message}")
        self.key, self.suggests = key, suggests


def resolve(config: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    """The run's config: the YAML file ``config`` (default configs/default.yaml), then
    ``overrides`` by config key (``{"pipeline.producers": 4}``; pipeline.producers ``"auto"``
    starts AUTO_START and adds by evidence). A value the user gave is kept; where stoker
    changes one (its default producers per replica, a steps or epochs of the user's file that
    an override replaces), one logged line names the key and both values (docs/design/service.md,
    "The run service")."""
    given = dict(overrides or {})
    if given.get("pipeline.producers") == "auto":
        given["pipeline.producers"] = AUTO_START
        given["pipeline.producers_auto"] = True
    path = given.get("data.path")
    if isinstance(path, str) and path and not is_url(path):
        given["data.path"] = str(Path(path).expanduser().resolve())
    user_file = config is not None and Path(config).resolve() != Path(DEFAULT_CONFIG).resolve()
    cfg = config_mod.load(config if user_file else DEFAULT_CONFIG, given)
    cfg = _steps_or_epochs(cfg, given, user_file)
    if "pipeline.producers" not in given and not (user_file and _names(config, "pipeline", "producers")):
        cfg = _producers_per_replica(cfg)
    return cfg


def _steps_or_epochs(cfg: Config, given: Mapping[str, Any], user_file: bool) -> Config:
    """trainer.steps and trainer.epochs are alternatives: the one given in the overrides ends the
    run, and the other, from the config file, is dropped (said when the user's file set it)."""
    trainer = cfg.trainer
    if trainer.steps is None or trainer.epochs is None:
        return cfg
    for kept, dropped in (("steps", "epochs"), ("epochs", "steps")):
        if f"trainer.{kept}" in given and f"trainer.{dropped}" not in given:
            if user_file:
                log.info("trainer.%s: %s -> null, since trainer.%s %s is given (the run stops at the one given)",
                         dropped, getattr(trainer, dropped), kept, getattr(trainer, kept))
            return dataclasses.replace(cfg, trainer=dataclasses.replace(trainer, **{dropped: None}))
    return cfg


def _producers_per_replica(cfg: Config) -> Config:
    """stoker's default pipeline.producers is per model replica (a step takes one batch per
    replica): multiplied by the replicas asked for, and said in one line. A count the user
    gives (an override, or their config file) is kept as given."""
    replicas = requested_replicas(cfg.devices)
    if replicas <= 1 or cfg.pipeline.producers_auto:
        return cfg
    producers = cfg.pipeline.producers * replicas
    log.info("pipeline.producers: %d -> %d, the default per model replica times %d replicas (give "
             "pipeline.producers to choose the count)", cfg.pipeline.producers, producers, replicas)
    return dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, producers=producers))


def _names(config: str | os.PathLike[str], section: str, key: str) -> bool:
    """Whether the YAML file ``config`` (read by config.load already) sets ``section.key``."""
    raw = yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}
    return key in (raw.get(section) or {})


def job_run_dir(requested: str) -> str:
    """``requested`` as this trainer worker's run directory: with TF_CONFIG (or torchrun)
    naming several workers, every worker is given the job's directory (the same one) and
    writes its worker-N inside; a single trainer's is ``requested`` itself."""
    cluster = from_env(os.environ)
    if cluster is None or cluster.size == 1:
        return requested
    if not requested:
        raise UserError(f"run.run_dir: {cluster.source} names {cluster.size} trainer workers: give every worker the "
                        f"same run directory (on a filesystem they share); worker N writes "
                        f"RUN_DIR/{worker_dir_name(0)[:-1]}N")
    return str(Path(requested).expanduser().resolve() / worker_dir_name(cluster.index))


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
        raise UserError(f"run.run_dir: {path} is not empty; choose another run directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"run.run_dir: cannot create {path}: {exc.strerror}") from None
    return path


def resume_config(run_dir: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None
                  ) -> tuple[Config, Path]:
    """The config of a run to continue: ``run_dir``'s config.yaml with ``overrides`` (by
    config key; e.g. trainer.steps to go further), and the run directory (this worker's in a
    job of several: :func:`job_run_dir`); checks that there is something to resume (the
    consumer checks the checkpoint itself)."""
    run_dir = Path(job_run_dir(str(run_dir))).expanduser().resolve()
    if not run_dir.is_dir():
        raise UserError(f"cannot resume {run_dir}: no such run directory")
    if not (run_dir / CONFIG).is_file():
        raise UserError(f"cannot resume {run_dir}: it has no config.yaml, so it is not a stoker run directory")
    other = (overrides or {}).get("run.run_dir")
    if other and Path(job_run_dir(other)).expanduser().resolve() != run_dir:
        raise UserError(f"run.run_dir: a resumed run continues in its own directory {run_dir}, not in {other}")
    if Checkpointer(run_dir / CKPT_DIR, keep=1).latest() is None:
        raise UserError(f"cannot resume {run_dir}: no checkpoint in {run_dir / CKPT_DIR} (the run stopped before its "
                        "first one); nothing to resume")
    return resolve(run_dir / CONFIG, overrides), run_dir


def prepare_run(cfg: Config, *, trains_model: bool = True) -> tuple[Config, DevicePlan]:
    """Check what the user asked for before anything starts (the dataset, the model, the
    keys, the endpoint, the GPUs); the config with the dataset's paths, the replicas and
    fixed rows (config.with_fixed_rows) resolved, and the device plan; for a run whose batches
    go to another framework than TensorFlow (trainer.framework), features.backend auto is numpy
    (no producer imports TensorFlow). UserError (one line) for each mistake."""

    root, metadata_file = locate(cfg.data.path, cfg.data.metadata_file).where
    cluster = from_env(os.environ)
    if trains_model:
        if cluster is not None and cluster.source != TF_CONFIG:
            raise UserError(f"{cluster.source} started this trainer: stoker's own trainer's workers are TensorFlow's "
                            f"(TF_CONFIG); under torchrun train in your own loop on stoker.Feed(framework='torch') "
                            f"(docs/examples/ddp_trainer.py)")
        check_model(cfg.trainer.model)
        if uses_tensorflow(cfg.trainer.model):
            if cfg.trainer.framework != TENSORFLOW:
                raise UserError(f"trainer.framework is {cfg.trainer.framework}: stoker's trainer (trainer.model "
                                f"{cfg.trainer.model}) trains with TensorFlow; the other frameworks are for your own "
                                f"loop on stoker.Feed (docs/FEED.md)")
            require_tensorflow(f"stoker's trainer (trainer.model {cfg.trainer.model})")
    if cfg.trainer.framework != TENSORFLOW:
        cfg = dataclasses.replace(cfg, features=resolve_backend(cfg.features, framework=cfg.trainer.framework))
    if cfg.pipeline.keys:
        cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(
            cfg.pipeline, keys=str(Path(cfg.pipeline.keys).expanduser().resolve())))
        check_keys(Path(cfg.pipeline.keys), server=True, client=cfg.pipeline.producers > 0)
    elif not is_loopback(cfg.pipeline.bind) and not cfg.pipeline.insecure:
        raise SettingError("pipeline.bind", f"{cfg.pipeline.bind} is reachable from other hosts; producers there "
                           "would be unauthenticated: set pipeline.keys to a keys directory (python run.py keys DIR), "
                           "or pipeline.insecure to accept that", suggests=("pipeline.keys", "pipeline.insecure"))
    plan = plan_devices(cfg.devices, list_gpus(), cfg.pipeline.producers)
    data = dataclasses.replace(cfg.data, path=data_path(root, metadata_file, cfg.data.metadata_file),
                               feature_cache=feature_cache_dir(cfg.data.feature_cache, root))
    devices = dataclasses.replace(cfg.devices, replicas=plan.replicas)  # resolved: the plan's batches depend on it
    resolved = dataclasses.replace(cfg, data=data, devices=devices)
    workers = cluster.size if cluster is not None else 1
    fixed = config_mod.with_fixed_rows(resolved, workers)
    if fixed.batching.fixed_rows != resolved.batching.fixed_rows:
        log.info("batching.fixed_rows: false -> true, since %d model replica(s) and %d trainer worker(s) split "
                 "every batch into equal parts", plan.replicas, workers)
    return fixed, plan


def data_path(root: Path, metadata_file: str, configured: str = "") -> str:
    """What ``--data`` names, resolved, as producers are given it: the dataset directory, a mix
    file, a lhotse cut manifest, tar shards (their pattern: at a URL as given, else below their directory), or a
    manifest at a URL (as given). An LJSpeech metadata file at a URL named ``configured``
    (data.metadata_file): its directory's URL. data.eval_file is found beside either
    (consumer/feed/validation.py, shared/dataset/corpus/registry.py ``beside``)."""
    return format_of(metadata_file).named(root, metadata_file, configured)


def launch(cfg: Config, resume_dir: Path | None = None, *, run_dir: Path | None = None,
           on_ready: Callable[[str], None] | None = None,
           fresh_plan: bool = False) -> tuple[int, Path, Config]:
    """Check what the user asked for, make the run directory (or take the resumed one's, or
    ``run_dir`` made by the caller), run; (status, run dir, config). ``on_ready``: called
    with the trainer's endpoint once it is bound; ``fresh_plan``: a resumed run keeps the
    checkpoint's weights and starts a new epoch plan (the dataset changed)."""

    setup_logging("launcher", cfg.run.log_level)
    cfg, plan = prepare_run(cfg)
    run_dir = resume_dir or run_dir or make_run_dir(job_run_dir(cfg.run.run_dir))
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


def precompute_config(cfg: Config) -> Config:
    """``run.py precompute``: ``cfg`` as one epoch that fills the feature cache (PRECOMPUTE_MODEL)."""
    if cfg.pipeline.producers < 1:
        raise UserError("pipeline.producers: precompute needs at least one local producer, got 0")
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
        raise UserError(f"pipeline.keys: {exc}") from None


def produce(connect: str | Sequence[str], data: str, producers: int, *, data_gpu: int | None = None,
            data_gpu_memory_mb: int | None = None, keys: str = "", log_level: str = "INFO", host: str = "") -> int:
    """``run.py produce``: ``producers`` producer processes on this host for the trainer at
    ``connect`` (or the trainers: the ranks of a torchrun job, each producer serving them all),
    reading the dataset ``data`` (data.path); the keywords are the config keys' (devices.data_gpu,
    pipeline.keys, ...); ``host`` names them (default: this host's name)."""
    setup_logging("launcher", log_level)
    endpoints = [connect] if isinstance(connect, str) else list(connect)
    if producers < 1:
        raise UserError(f"pipeline.producers: producers for a trainer elsewhere are at least 1, got {producers}")
    for endpoint in endpoints:
        try:
            check_endpoint(endpoint, bind=False)
        except EndpointError as exc:
            raise UserError(f"connect: {exc}") from None
    if keys:
        keys = str(Path(keys).expanduser().resolve())
        check_keys(Path(keys), server=False, client=True)
    else:
        for endpoint in endpoints:
            if not is_loopback(endpoint):
                log.warning("connecting to %s without pipeline.keys: batches travel unencrypted and the trainer "
                            "cannot tell who sends them", endpoint)
    root, metadata_file = locate(data, "metadata.csv").where
    described = describe_copy(root, metadata_file)  # its metadata readable here: else one line, before any producer
    devices = DevicesConfig(data_gpu=data_gpu, model_gpu=None, data_gpu_memory_mb=data_gpu_memory_mb)
    plan = plan_devices(devices, list_gpus() if data_gpu is not None else [], producers)
    log.info("dataset %s (%s), SHA-256 %s", root, metadata_file, described["sha256"][:16])
    return run_producers(endpoints, data_path(root, metadata_file), producers, plan, PRODUCE_RESTARTS, log_level,
                         keys=keys, host=host)


def producers_before_bind(cfg: Config, plan: DevicePlan, run_dir: Path) -> BackgroundProducers | None:
    """The local producers of a ``stoker.Feed``, started before its trainer binds (their
    interpreters start beside the coordinator's), to be given its endpoint
    (``BackgroundProducers.connect``); None under a host's pool, which needs every rank bound
    first (:func:`start_producers`)."""
    if HostPool.of(from_env(os.environ), cfg.pipeline.producers_per, run_dir) is not None:
        return None
    return BackgroundProducers(cfg, plan, [], run_dir)


def start_producers(cfg: Config, plan: DevicePlan, endpoint: str, run_dir: Path) -> BackgroundProducers | None:
    """The local producers (pipeline.producers, or auto) of a trainer in this process (a
    ``stoker.Feed``) bound at ``endpoint``, supervised in a thread beside the user's loop as the
    launcher supervises a run's; ``close()`` stops them. Under torchrun with
    pipeline.producers_per host, one pool serves every rank of the host: local rank 0 starts it
    once every rank has bound (stoker/hostpool.py), the other ranks start none (None)."""
    pool = HostPool.of(from_env(os.environ), cfg.pipeline.producers_per, run_dir)
    if pool is None:
        return BackgroundProducers(cfg, plan, [endpoint], run_dir)
    pool.publish(endpoint)
    if not pool.starts:
        log.info("pipeline.producers_per host: the producers of local rank 0 serve this rank too")
        return None
    return BackgroundProducers(cfg, plan, pool.endpoints(), run_dir)