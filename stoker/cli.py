"""The command line of ``python run.py``; README.md states it as a contract.

Every mistake a user can make (bad flag, unknown config key, missing dataset, GPU
that is not there, endpoint in use, unknown model) ends with one line on stderr,
``stoker: error: ...``, and a non-zero exit; never a traceback.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from stoker.shared import config as config_mod
from stoker.shared.errors import UserError
from stoker.shared.proc import EXIT_INTERRUPTED, EXIT_USER
from stoker.shared.runfiles import CONFIG, RUN_LOCK, SUMMARY

log = logging.getLogger("stoker")

DEFAULT_CONFIG = config_mod.DEFAULT_CONFIG
COMMANDS = ("train", "produce", "precompute", "bench", "diagnose", "watch", "keys", "synth", "export", "slurm")
LOOPBACK_HOSTS = ("localhost", "::1", "[::1]")
# `run.py produce` restarts a crashed producer at most this many times (as pipeline.producer_restarts).
PRODUCE_RESTARTS = 3



def out(text: str = "") -> None:
    """The CLI's output layer: results for the user on stdout (logs go to stderr)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _program() -> str:
    """How the user called stoker: the installed ``stoker`` command, or ``python run.py``."""
    return "stoker" if Path(sys.argv[0]).name == "stoker" else "python run.py"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        command = f"{self.prog.split()[-1]} " if " " in self.prog else ""
        raise UserError(f"{message} (see {_program()} {command}--help)")


def _producers_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None


def _gpus_arg(text: str) -> int | str:
    """--model-gpu: one index (an int), or a list "1,2,3" or "all" (checked by stoker/devices.py)."""
    return int(text) if text.strip().isdigit() else text


def _train_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config (default: configs/default.yaml)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint, with its "
                        "config.yaml (flags and --set given now override it, e.g. --steps N to go further)")
    parser.add_argument("--data", help="dataset directory, LJSpeech layout (default: embedded demo set)")
    parser.add_argument("--data-gpu", type=int, help="GPU index for the producers")
    parser.add_argument("--model-gpu", type=_gpus_arg, metavar="N|N,M,...|all",
                        help="GPU index for the trainer; a list or all: a model replica on each (MirroredStrategy)")
    parser.add_argument("--replicas", type=int, metavar="N", help="model replicas: one per --model-gpu GPU, or "
                        "N logical devices of the CPU on a host without GPUs")
    parser.add_argument("--data-gpu-memory", type=int, metavar="MB", help="memory limit per producer process")
    parser.add_argument("--model-gpu-memory", type=int, metavar="MB", help="memory limit of the trainer")
    parser.add_argument("--producers", type=_producers_arg, help="local producer processes (0: remote ones only), "
                        "or auto: start with one, add while the trainer starves")
    parser.add_argument("--max-producers", type=int, metavar="N", help="ceiling for --producers auto")
    parser.add_argument("--bind", metavar="ENDPOINT", help="consumer endpoint, e.g. tcp://0.0.0.0:5555")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--max-frames", type=int, metavar="N",
                        help="frame-budget batches: rows per bucket so that a batch holds about N frames")
    parser.add_argument("--steps", type=int, help="train this many steps")
    parser.add_argument("--epochs", type=int, help="train this many epochs (instead of --steps)")
    parser.add_argument("--buffer-size", type=int, help="queue capacity in batches (default 3)")
    parser.add_argument("--model-start-delay", type=float, metavar="S", help="warm-up before the first step")
    parser.add_argument("--model", help="tiny | small | base | synthetic:MS | package.module:function")
    parser.add_argument("--text-frontend", metavar="NAME",
                        help="characters (any script) | phonemes (espeak-ng) | package.module:function")
    parser.add_argument("--language", metavar="CODE", help="language of clips whose metadata names none (en, fa, ...)")
    parser.add_argument("--run-dir", help="where the run's files go (default runs/<timestamp>)")
    parser.add_argument("--record-samples", action="store_true", default=None, help="write samples.jsonl")
    parser.add_argument("--keys", metavar="DIR", help="CURVE keys directory")
    parser.add_argument("--insecure", action="store_true", default=None,
                        help="allow a non-loopback bind without keys")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument("--metrics-port", type=int, metavar="N", help="serve Prometheus metrics on port N")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set trainer.learning_rate=1e-3")


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
    "text_frontend": "text.frontend", "language": "text.language",
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=_program().split()[-1], description="stoker: keep a training GPU fed")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    _train_parser(sub.add_parser("train", help="train (the default command)"))
    produce = sub.add_parser("produce", help="start producers on this host for a trainer elsewhere")
    produce.add_argument("--connect", required=True, metavar="ENDPOINT", help="the trainer's endpoint")
    produce.add_argument("--data", default="", help="dataset directory (same dataset as the trainer's)")
    produce.add_argument("--producers", type=int, default=1)
    produce.add_argument("--data-gpu", type=int)
    produce.add_argument("--data-gpu-memory", type=int, metavar="MB")
    produce.add_argument("--keys", metavar="DIR", help="CURVE keys: server.key and one client key pair")
    produce.add_argument("--log-level", default="INFO")
    slurm = sub.add_parser("slurm", help="a task of a Slurm job step (srun python run.py slurm ...): task 0 "
                           "trains, every other task starts producers on its node (docs/SLURM.md)")
    _train_parser(slurm)
    slurm.add_argument("--producer-nodes", default="other", metavar="WHERE",
                       help="other (default): producer tasks must run on nodes other than the trainer's; "
                            "any: they may share it")
    slurm.add_argument("--task-producers", type=int, metavar="N",
                       help="producer processes per producer task (default: the task's CPUs, "
                            "SLURM_CPUS_PER_TASK, or 1)")
    diagnose = sub.add_parser("diagnose", help="explain where a run's time went")
    diagnose.add_argument("run_dir", metavar="RUN_DIR")
    diagnose.add_argument("--json", action="store_true", help="the report as JSON")
    synth = sub.add_parser("synth", help="run a trained model on a text: a mel (.npy) and its image (.png)")
    synth.add_argument("run_dir", metavar="RUN_DIR")
    synth.add_argument("--text", required=True, help="what to say")
    synth.add_argument("--out", default="mel.npy", help="the mel [T, F] as .npy; the .png goes beside it")
    synth.add_argument("--frames", type=int, help="mel frames to produce (default: the model's length "
                       "prediction); for a model with its own generate(): the most it may make")
    synth.add_argument("--gpu", type=int, help="GPU index to run on (default: the CPU)")
    synth.add_argument("--language", metavar="CODE", help="the text's language (default: the run's text.language)")
    synth.add_argument("--speaker", help="a speaker of the run's vocabulary, for a model trained with "
                       "batching.fields=speaker_id (default: its first)")
    synth.add_argument("--reference", metavar="WAV", help="a recording of the voice, for a model trained with "
                       "batching.fields=ref_mel (default: none, the reference all padding)")
    export = sub.add_parser("export", help="write the trained model in standard formats (a SavedModel plain "
                            "TensorFlow loads, the .keras file) with its vocabulary and settings")
    export.add_argument("run_dir", metavar="RUN_DIR")
    export.add_argument("out", metavar="OUT", help="a new directory")
    watch = sub.add_parser("watch", help="show a running trainer's queue depth, wait and throughput")
    watch.add_argument("run_dir", metavar="RUN_DIR")
    precompute = sub.add_parser("precompute", help="fill the feature cache ahead of training, with all producers")
    precompute.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: configs/default.yaml)")
    precompute.add_argument("--data", help="dataset directory, LJSpeech layout (default: embedded demo set)")
    precompute.add_argument("--producers", type=int, help="local producer processes (default: pipeline.producers)")
    precompute.add_argument("--data-gpu", type=int, help="GPU index for the producers")
    precompute.add_argument("--data-gpu-memory", type=int, metavar="MB", help="memory limit per producer process")
    precompute.add_argument("--batch-size", type=int)
    precompute.add_argument("--run-dir", help="where the run's files go (default runs/<timestamp>)")
    precompute.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    precompute.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                            help="override any config key; data.feature_cache=DIR picks the cache "
                                 "(default: auto, DATASET/.stoker/features)")
    keys = sub.add_parser("keys", help="make CURVE key pairs for authenticated remote producers")
    keys.add_argument("dir", metavar="DIR", help="directory for the keys (created; existing keys are kept)")
    keys.add_argument("--client", action="append", metavar="NAME",
                      help="a producer key pair to make and allow (repeatable; default: client)")
    bench = sub.add_parser("bench", help="run the benchmarks; prints a table, writes bench.json")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions and batches")
    bench.add_argument("--out", default="bench.json")
    return parser


def resolve_config(args: argparse.Namespace) -> config_mod.Config:
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
    if "data.path" in overrides and overrides["data.path"]:
        overrides["data.path"] = str(Path(overrides["data.path"]).expanduser().resolve())
    cfg = config_mod.load(config or DEFAULT_CONFIG, overrides)
    if "pipeline.producers" not in overrides:
        # A step takes one batch per model replica: the default producers are per replica.
        import dataclasses

        from stoker.devices import requested_replicas

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
    from stoker.consumer.checkpoint import CKPT_DIR, Checkpointer

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
    fixed rows (config.with_fixed_rows) resolved, and the device plan. UserError (one line) for each mistake."""
    import dataclasses

    from stoker.consumer.trainer import check_model
    from stoker.shared.cluster import from_env
    from stoker.shared.dataset import feature_cache_dir, locate
    from stoker.shared.mixes import is_mix
    from stoker.devices import list_gpus, plan_devices

    root, metadata_file = locate(cfg.data.path, cfg.data.metadata_file)
    if trains_model:
        check_model(cfg.trainer.model)
    if cfg.pipeline.keys:
        cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(
            cfg.pipeline, keys=str(Path(cfg.pipeline.keys).expanduser().resolve())))
        check_keys(Path(cfg.pipeline.keys), server=True, client=cfg.pipeline.producers > 0)
    elif not is_loopback(cfg.pipeline.bind) and not cfg.pipeline.insecure:
        raise UserError(f"--bind {cfg.pipeline.bind} is reachable from other hosts; producers there would be "
                        "unauthenticated: use --keys DIR (python run.py keys DIR), or add --insecure to accept that")
    plan = plan_devices(cfg.devices, list_gpus(), cfg.pipeline.producers)
    data = dataclasses.replace(cfg.data, path=str(root / metadata_file if is_mix(metadata_file) else root),
                               feature_cache=feature_cache_dir(cfg.data.feature_cache, root))
    devices = dataclasses.replace(cfg.devices, replicas=plan.replicas)  # resolved: the plan's batches depend on it
    cluster = from_env(os.environ)
    resolved = dataclasses.replace(cfg, data=data, devices=devices)
    return config_mod.with_fixed_rows(resolved, cluster.size if cluster is not None else 1), plan


def _launch(cfg: config_mod.Config, resume_dir: Path | None = None, *, run_dir: Path | None = None,
            on_ready: Callable[[str], None] | None = None) -> tuple[int, Path, config_mod.Config]:
    """Check what the user asked for, make the run directory (or take the resumed one's, or
    ``run_dir`` made by the caller), run; (status, run dir, config). ``on_ready``: called
    with the trainer's endpoint once it is bound."""
    import dataclasses

    from stoker.launcher import run_training
    from stoker.shared.proc import setup_logging
    from stoker.shared.runlock import RunLock

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
        from stoker.consumer.checkpoint import RESUME_CONFIG

        # The consumer moves it over config.yaml once the checkpoint has been checked: a
        # resume that fails leaves the run directory as it was.
        pending = run_dir / RESUME_CONFIG
        config_mod.save(cfg, pending)
        log.info("%s", plan.describe(cfg.pipeline.producers))
        log.info("resuming run directory %s", run_dir)
        try:
            return run_training(cfg, run_dir, plan, resume=True, on_ready=on_ready), run_dir, cfg
        finally:
            pending.unlink(missing_ok=True)


def _worker_paths(args: argparse.Namespace) -> None:
    """With TF_CONFIG naming several trainer workers, --run-dir and --resume name the job's
    directory, the same for every worker, and each worker's run is its worker-N inside."""
    import os

    from stoker.shared.cluster import from_env, worker_dir_name

    cluster = from_env(os.environ)
    if cluster is None or cluster.size == 1:
        return
    job = args.resume or args.run_dir
    if not job:
        raise UserError(f"TF_CONFIG names {cluster.size} trainer workers: give every worker the same --run-dir "
                        f"DIR (on a filesystem they share); worker N writes DIR/{worker_dir_name(0)[:-1]}N")
    mine = str(Path(job).expanduser().resolve() / worker_dir_name(cluster.index))
    if args.resume:
        args.resume = mine
        args.run_dir = None
    else:
        args.run_dir = mine


def cmd_train(args: argparse.Namespace) -> int:
    _worker_paths(args)
    if args.resume:
        cfg, resume_dir = resume_config(args)
        code, run_dir, _ = _launch(cfg, resume_dir)
    else:
        code, run_dir, _ = _launch(resolve_config(args))
    print_summary(run_dir)
    return code


# precompute is one epoch of a run whose trainer takes each batch and drops it at once:
# the real producers (all of them) fill the feature cache, and nothing waits on a model.
PRECOMPUTE_MODEL = "synthetic:0"


def cmd_precompute(args: argparse.Namespace) -> int:
    import dataclasses

    cfg = resolve_config(args)
    if cfg.pipeline.producers < 1:
        raise UserError("precompute needs at least one local producer (--producers N)")
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, feature_cache=cfg.data.feature_cache or "auto"),
        trainer=dataclasses.replace(cfg.trainer, model=PRECOMPUTE_MODEL, steps=None, epochs=1, record_samples=False),
        pipeline=dataclasses.replace(cfg.pipeline, model_start_delay_s=0.0))
    code, run_dir, cfg = _launch(cfg)
    print_precompute_summary(run_dir, cfg.data.feature_cache)
    return code


def print_precompute_summary(run_dir: Path, cache_dir: str) -> None:
    import json

    try:
        s = json.loads((run_dir / SUMMARY).read_text())
    except (OSError, ValueError):
        out(f"no summary in {run_dir}")
        return
    cache = s.get("feature_cache") or {}
    clips = s.get("samples", 0)
    wall = s.get("wall_s") or 0.0
    rate = clips / wall if wall > 0 else 0.0
    complete = s.get("epochs_completed", 0) >= 1
    out(f"precompute {'done' if complete else 'INCOMPLETE (' + str(s.get('exit_reason')) + ')'}: {clips} clips in "
        f"{wall:.1f} s ({rate:.1f} clips/s, {len(s.get('producers') or [])} producers): "
        f"{cache.get('computed', 0)} computed, {cache.get('hits', 0)} already cached, "
        f"{cache.get('corrupt', 0)} corrupt entries recomputed, {s.get('rejected', 0)} clips rejected "
        f"(see {run_dir / 'rejected.jsonl'})")
    out(f"  feature cache {cache_dir}; train with --set data.feature_cache={cache_dir}")


def print_summary(run_dir: Path) -> None:
    import json

    try:
        s = json.loads((run_dir / SUMMARY).read_text())
    except (OSError, ValueError):
        out(f"no summary in {run_dir}")
        return
    loss = ""
    if s.get("loss_first") is not None:
        loss = f"  loss {s['loss_first']:.4f} -> {s['loss_last']:.4f}"
    wait = s.get("data_wait_frac")
    out(f"stoker run {run_dir}: {s['exit_reason']}")
    out(f"  {s['steps']} steps, {s['samples']} samples, {s.get('epochs_completed', 0)} epochs in "
        f"{s['wall_s']:.1f} s; {s['steps_per_s']:.2f} steps/s, {s['samples_per_s']:.1f} samples/s{loss}")
    out(f"  trainer waited for data {100 * (wait or 0):.1f}% of its time; queue depth mean "
        f"{s.get('queue_depth_mean') or 0:.2f} of {s.get('capacity')}; {s['starved_steps']} starved steps; "
        f"{s['rejected']} samples rejected")
    out(f"  verdict: {s['verdict']}; recommended producers: {s['recommended_producers']}")


def check_keys(directory: Path, server: bool, client: bool) -> None:
    """Load the keys a role needs now, so a bad key directory is one line before anything starts."""
    from stoker.shared.keys import KeysError, load_client_keys, load_server_keys

    try:
        if server:
            load_server_keys(directory)
        if client:
            load_client_keys(directory)
    except KeysError as exc:
        raise UserError(f"--keys: {exc}") from None


def cmd_produce(args: argparse.Namespace) -> int:
    return produce(args.connect, args.data, args.producers, data_gpu=args.data_gpu,
                   data_gpu_memory=args.data_gpu_memory, keys=args.keys or "", log_level=args.log_level)


def produce(connect: str, data: str, producers: int, *, data_gpu: int | None = None,
            data_gpu_memory: int | None = None, keys: str = "", log_level: str = "INFO", host: str = "") -> int:
    """``run.py produce``: ``producers`` producer processes on this host for the trainer at
    ``connect``; ``host`` names them (default: this host's name)."""
    from stoker.shared.dataset import locate, scan_dataset
    from stoker.shared.mixes import is_mix
    from stoker.devices import DevicesConfig, list_gpus, plan_devices
    from stoker.launcher import run_producers
    from stoker.shared.proc import setup_logging

    setup_logging("launcher", log_level)
    if producers < 1:
        raise UserError("--producers must be at least 1")
    if "://" not in connect:
        raise UserError(f"--connect {connect}: expected an endpoint such as tcp://HOST:PORT")
    if keys:
        keys = str(Path(keys).expanduser().resolve())
        check_keys(Path(keys), server=False, client=True)
    elif not is_loopback(connect):
        log.warning("connecting to %s without --keys: batches travel unencrypted and the trainer cannot tell "
                    "who sends them", connect)
    root, metadata_file = locate(data, "metadata.csv")
    scan = scan_dataset(root, metadata_file)
    devices = DevicesConfig(data_gpu=data_gpu, model_gpu=None, data_gpu_memory_mb=data_gpu_memory)
    plan = plan_devices(devices, list_gpus() if data_gpu is not None else [], producers)
    log.info("dataset %s: %d entries, %d audio files missing here, fingerprint %s", root, len(scan.entries),
             len(scan.missing), scan.fingerprint)
    data_path = root / metadata_file if is_mix(metadata_file) else root
    return run_producers(connect, str(data_path), producers, plan, PRODUCE_RESTARTS, log_level, keys=keys, host=host)


def cmd_keys(args: argparse.Namespace) -> int:
    from stoker.shared.keys import DEFAULT_CLIENT, make_keys

    directory = Path(args.dir).expanduser().resolve()
    clients = args.client or [DEFAULT_CLIENT]
    report = make_keys(directory, clients)
    for line in report:
        out(line)
    out("")
    out(f"trainer host:   python run.py --bind tcp://0.0.0.0:PORT --keys {directory} ...")
    out(f"producer hosts: copy {directory / 'server.key'} and one client pair (NAME.key, NAME.key_secret) into")
    out("                a directory DIR there, then: python run.py produce --connect tcp://TRAINER:PORT --keys DIR")
    out(f"secret keys (*.key_secret) stay private; revoke a producer by removing its file from "
        f"{directory / 'authorized'}")
    return 0


def cmd_slurm(args: argparse.Namespace) -> int:
    from stoker.slurm import run_task

    return run_task(args, os.environ)


def cmd_diagnose(args: argparse.Namespace) -> int:
    import json

    from stoker.diagnose import analyse, render

    report = analyse(Path(args.run_dir))
    out(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    from stoker.watch import watch

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory")
    summary = watch(run_dir)
    if summary is not None:
        out(f"run over ({summary.get('exit_reason')}): verdict {summary.get('verdict')}, "
            f"recommended producers {summary.get('recommended_producers')}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from stoker.consumer.export import describe, export

    out(describe(export(Path(args.run_dir), Path(args.out))))
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from stoker.consumer.synth import SynthError, synthesize
    from stoker.consumer.tts import ModelError
    from stoker.shared.proc import setup_logging

    setup_logging("synth", "WARNING")
    run_dir = Path(args.run_dir).expanduser()
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory")
    try:
        result = synthesize(run_dir, args.text, Path(args.out), frames=args.frames, gpu=args.gpu,
                            language=args.language, speaker=args.speaker,
                            reference=Path(args.reference) if args.reference else None)
    except (SynthError, ModelError) as exc:
        raise UserError(str(exc)) from None
    out(f"{result.mel_path}: mel of {result.frames} frames ({result.seconds:.2f} s) for {result.tokens} tokens, "
        f"from {result.checkpoint}")
    out(f"{result.png_path}: its image")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """The benchmark suite runs as its own program (``python -m stoker.benchmarks.suite``): the
    benchmarks drive the application, so the application does not import them."""
    import subprocess

    import importlib.util

    if importlib.util.find_spec("librosa") is None:  # benchmarks/data.py measures the producer against it
        raise UserError("bench compares stoker's producer with librosa, which the test extra installs: "
                        "pip install 'stoker[test]'")
    command = [sys.executable, "-m", "stoker.benchmarks.suite", "--out", str(Path(args.out).resolve())]
    if args.quick:
        command.append("--quick")
    from stoker.launcher import with_stoker_path

    return subprocess.call(command, env=with_stoker_path(os.environ))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["train", *argv]
    try:
        args = build_parser().parse_args(argv)
        if args.command not in COMMANDS:
            build_parser().print_help()
            return EXIT_USER
        return globals()[f"cmd_{args.command}"](args)  # each command's function: cmd_train, cmd_produce, ...
    except UserError as exc:  # every error the user can fix (shared/errors.py): one line
        sys.stderr.write(f"stoker: error: {exc}\n")
        return EXIT_USER
    except KeyboardInterrupt:
        sys.stderr.write("stoker: interrupted\n")
        return EXIT_INTERRUPTED
