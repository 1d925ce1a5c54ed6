"""The command line of ``python run.py``; README.md states it as a contract.

It parses the arguments and dispatches each command; running stoker is the run service's
(stoker/service.py), which ``stoker.Feed`` and Slurm's tasks call alike.

Every mistake a user can make (bad flag, unknown config key, missing dataset, GPU
that is not there, endpoint in use, unknown model) ends with one line on stderr,
``stoker: error: ...``, and a non-zero exit; never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, NoReturn, Sequence

from . import service
from .console import out, print_precompute_summary, print_summary
from .consumer.training.export import describe, export
from .consumer.training.synth import SynthError, synthesize
from .consumer.training.tts import ModelError
from .diagnose import analyse, render
from .shared.config import parse_override
from .shared.errors import UserError
from .shared.keys import DEFAULT_CLIENT, make_keys
from .shared.metrics import HOST_CPU_LIMIT
from .shared.proc import EXIT_INTERRUPTED, EXIT_USER, setup_logging, with_stoker_path
from .shared.tfsetup import require_tensorflow
from .slurm import LAUNCHERS, TORCHRUN, Task, TorchrunJob, run_task, torchrun_task
from .watch import watch

# The flags that set a config key, by key: each is parsed into its key (the run service takes
# config keys), and an error that starts with the key gets the flag beside it (with_flags).
KEY_FLAGS = {key: "--" + name.replace("_", "-") for key, name in service.KEY_NAMES.items()}
# The run service's parameters that are no config key, with their flags: an error names them alone.
PARAMETER_FLAGS = {"connect": "--connect"}
COMMANDS = ("train", "produce", "precompute", "bench", "diagnose", "watch", "keys", "synth", "export", "slurm")


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


def _key(parser: argparse.ArgumentParser, key: str, **kwargs: Any) -> None:
    """The flag of config key ``key`` (KEY_FLAGS), parsed into ``key`` itself."""
    parser.add_argument(KEY_FLAGS[key], dest=key, **kwargs)


def _train_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config (default: configs/default.yaml)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint, with its "
                        "config.yaml (flags and --set given now override it, e.g. --steps N to go further)")
    parser.add_argument("--fresh-plan", action="store_true", help="with --resume, when the dataset changed: keep "
                        "the checkpoint's weights, optimizer and step count, and start a new epoch plan over the data")
    _key(parser, "data.path", help="dataset directory, LJSpeech layout (default: embedded demo set)")
    _key(parser, "devices.data_gpu", type=int, help="GPU index for the producers")
    _key(parser, "devices.model_gpu", type=_gpus_arg, metavar="N|N,M,...|all",
         help="GPU index for the trainer; a list or all: a model replica on each (MirroredStrategy)")
    _key(parser, "devices.replicas", type=int, metavar="N", help="model replicas: one per --model-gpu GPU, or "
         "N logical devices of the CPU on a host without GPUs")
    _key(parser, "devices.data_gpu_memory_mb", type=int, metavar="MB", help="memory limit per producer process")
    _key(parser, "devices.model_gpu_memory_mb", type=int, metavar="MB", help="memory limit of the trainer")
    _key(parser, "pipeline.producers", type=_producers_arg, help="local producer processes (0: remote ones only), "
         "or auto: start with one, add while the trainer starves")
    _key(parser, "pipeline.max_producers", type=int, metavar="N", help="ceiling for --producers auto")
    _key(parser, "pipeline.bind", metavar="ENDPOINT", help="consumer endpoint, e.g. tcp://0.0.0.0:5555")
    _key(parser, "batching.batch_size", type=int)
    _key(parser, "batching.max_frames", type=int, metavar="N",
         help="frame-budget batches: rows per bucket so that a batch holds about N frames")
    _key(parser, "trainer.steps", type=int, help="train this many steps")
    _key(parser, "trainer.epochs", type=int, help="train this many epochs (instead of --steps)")
    _key(parser, "pipeline.buffer_size", type=int, help="queue capacity in batches (default 3)")
    _key(parser, "pipeline.model_start_delay_s", type=float, metavar="S", help="warm-up before the first step")
    _key(parser, "trainer.model", help="tiny | small | base | synthetic:MS | package.module:function")
    _key(parser, "text.frontend", metavar="NAME",
         help="characters (any script) | phonemes (espeak-ng) | package.module:function")
    _key(parser, "transforms.models", metavar="SPECS", help="package.module:function, comma-separated: neural "
         "features the producers compute (transforms.models; declare their fields in transforms.model_fields)")
    _key(parser, "text.language", metavar="CODE", help="language of clips whose metadata names none (en, fa, ...)")
    _key(parser, "run.run_dir", help="where the run's files go (default runs/<timestamp>)")
    _key(parser, "trainer.record_samples", action="store_true", default=None, help="write samples.jsonl")
    _key(parser, "pipeline.keys", metavar="DIR", help="CURVE keys directory")
    _key(parser, "pipeline.insecure", action="store_true", default=None, help="allow a non-loopback bind without keys")
    _key(parser, "run.log_level", help="DEBUG, INFO, WARNING or ERROR")
    _key(parser, "run.metrics_port", type=int, metavar="N", help="serve Prometheus metrics on port N")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set trainer.learning_rate=1e-3")


def _precompute_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config (default: configs/default.yaml)")
    _key(parser, "data.path", help="dataset directory, LJSpeech layout (default: embedded demo set)")
    _key(parser, "pipeline.producers", type=int, help="local producer processes (default: pipeline.producers)")
    _key(parser, "devices.data_gpu", type=int, help="GPU index for the producers")
    _key(parser, "devices.data_gpu_memory_mb", type=int, metavar="MB", help="memory limit per producer process")
    _key(parser, "batching.batch_size", type=int)
    _key(parser, "transforms.models", metavar="SPECS", help="package.module:function, comma-separated: the "
         "producer models whose outputs to cache too (transforms.models)")
    _key(parser, "run.run_dir", help="where the run's files go (default runs/<timestamp>)")
    _key(parser, "run.log_level", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any config key; "
                        "data.feature_cache=DIR picks the cache (default: auto, DATASET/.stoker/features)")


def _slurm_parser(parser: argparse.ArgumentParser) -> None:
    """``slurm``'s flags: train's, where producer tasks run, and a torchrun job's."""
    _train_parser(parser)
    parser.add_argument("--producer-nodes", default="other", metavar="WHERE",
                        help="other (default): producer tasks must run on nodes other than the trainer's; "
                             "any: they may share it")
    parser.add_argument("--task-producers", type=int, metavar="N",
                        help="producer processes per producer task (default: the task's CPUs, "
                             "SLURM_CPUS_PER_TASK, or 1)")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="stoker",
                        help="stoker (default): the trainer and producer tasks above; torchrun: each task (one per "
                             "node) runs that node's torchrun of SCRIPT, a loop on stoker.Feed (docs/SLURM.md)")
    parser.add_argument("--nproc-per-node", type=int, default=1, metavar="N", help="torchrun: ranks on each node")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="torchrun: restarts of the whole job after a rank fails")
    parser.add_argument("--rdzv-port", type=int, metavar="PORT",
                        help="torchrun: the rendezvous port on the first node (default: from the job id)")
    parser.add_argument("script", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS]",
                        help="torchrun: the training script and its arguments")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=_program().split()[-1], description="stoker: keep a training GPU fed")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    _train_parser(sub.add_parser("train", help="train (the default command)"))
    produce = sub.add_parser("produce", help="start producers on this host for a trainer elsewhere")
    produce.add_argument("--connect", required=True, action="append", metavar="ENDPOINT",
                         help="the trainer's endpoint; once per rank for the torchrun ranks of a job (every producer "
                              "serves them all)")
    _key(produce, "data.path", default="", help="dataset directory (same dataset as the trainer's)")
    _key(produce, "pipeline.producers", type=int, default=1)
    _key(produce, "devices.data_gpu", type=int)
    _key(produce, "devices.data_gpu_memory_mb", type=int, metavar="MB")
    _key(produce, "pipeline.keys", metavar="DIR", help="CURVE keys: server.key and one client key pair")
    _key(produce, "run.log_level", default="INFO")
    slurm = sub.add_parser("slurm", help="a task of a Slurm job step (srun python run.py slurm ...): task 0 "
                           "trains, every other task starts producers on its node (docs/SLURM.md)")
    _slurm_parser(slurm)
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
    _precompute_parser(sub.add_parser("precompute", help="fill the feature cache ahead of training, with all "
                                      "producers"))
    keys = sub.add_parser("keys", help="make CURVE key pairs for authenticated remote producers")
    keys.add_argument("dir", metavar="DIR", help="directory for the keys (created; existing keys are kept)")
    keys.add_argument("--client", action="append", metavar="NAME",
                      help="a producer key pair to make and allow (repeatable; default: client)")
    bench = sub.add_parser("bench", help="run the benchmarks; prints a table, writes bench.json")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions and batches")
    bench.add_argument("--out", default="bench.json")
    return parser


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys a command line gives: its flags' (parsed into their keys), then ``--set``'s."""
    given = {key: value for key, value in vars(args).items() if key in KEY_FLAGS and value is not None}
    given.update(parse_override(item) for item in getattr(args, "set", []))
    return given


def with_flags(message: str, flags: Mapping[str, str], suggests: Sequence[str] = ()) -> str:
    """A run service's error as the command line says it: the config key it starts with gets
    its flag beside it (``pipeline.bind (--bind): ...``), and so does each key it suggests
    (``suggests``: a SettingError's); a parameter that is no config key becomes its flag
    (``--connect: ...``). ``flags``: this command's."""
    head, sep, rest = message.partition(": ")
    if not sep:
        return message
    if head in flags:
        head = f"{head} ({flags[head]})" if head in KEY_FLAGS else flags[head]
    for key in suggests:
        if key in flags:
            rest = re.sub(rf"(?<![\w./]){re.escape(key)}(?![\w.])", f"{key} ({flags[key]})", rest)
    return f"{head}: {rest}"


def cmd_train(args: argparse.Namespace) -> int:
    setup_logging("launcher", vars(args)["run.log_level"] or "INFO")  # the config's notes (service.resolve)
    if args.resume:
        if args.config is not None:
            raise UserError("--resume continues with RUN_DIR/config.yaml; change keys with flags or --set, "
                            "not --config")
        cfg, resume_dir = service.resume_config(args.resume, overrides(args))
        code, run_dir, _ = service.launch(cfg, resume_dir, fresh_plan=args.fresh_plan)
    else:
        if args.fresh_plan:
            raise UserError("--fresh-plan starts a new epoch plan for a resumed run: give it with --resume RUN_DIR")
        code, run_dir, _ = service.launch(service.resolve(args.config, overrides(args)))
    print_summary(run_dir)
    return code


def cmd_precompute(args: argparse.Namespace) -> int:
    setup_logging("launcher", vars(args)["run.log_level"] or "INFO")  # the config's notes (service.resolve)
    code, run_dir, cfg = service.launch(service.precompute_config(service.resolve(args.config, overrides(args))))
    print_precompute_summary(run_dir, cfg.data.feature_cache)
    return code


def cmd_produce(args: argparse.Namespace) -> int:
    given = vars(args)
    return service.produce(args.connect, given["data.path"], given["pipeline.producers"],
                           data_gpu=given["devices.data_gpu"], data_gpu_memory_mb=given["devices.data_gpu_memory_mb"],
                           keys=given["pipeline.keys"] or "", log_level=given["run.log_level"])


def cmd_keys(args: argparse.Namespace) -> int:
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


def cmd_slurm(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> int:
    if args.launcher == TORCHRUN:
        given = [KEY_FLAGS.get(key, f"--set {key}") for key in overrides(args)]
        given += [flag for flag, value in (("--config", args.config), ("--resume", args.resume),
                                           ("--fresh-plan", args.fresh_plan), ("--task-producers", args.task_producers))
                  if value]
        job = TorchrunJob(tuple(args.script), args.nproc_per_node, args.max_restarts, args.rdzv_port)
        torchrun_task(env, job, given)
    if args.script:
        raise UserError(f"{args.script[0]}: stoker slurm takes a script with --launcher torchrun only")
    task = Task(config=args.config, resume=args.resume, fresh_plan=args.fresh_plan,
                producer_nodes=args.producer_nodes, task_producers=args.task_producers)
    return run_task(env, overrides(args), task)


def cmd_diagnose(args: argparse.Namespace) -> int:
    report = analyse(Path(args.run_dir))
    out(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory")
    summary = watch(run_dir)
    if summary is not None:
        limit = "; the host's CPU is the limit" if summary.get("limit") == HOST_CPU_LIMIT else ""
        out(f"run over ({summary.get('exit_reason')}): verdict {summary.get('verdict')}, "
            f"recommended producers {summary.get('recommended_producers')}{limit}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    require_tensorflow("python run.py export (stoker's trainer's models are TensorFlow's)")
    out(describe(export(Path(args.run_dir), Path(args.out))))
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    require_tensorflow("python run.py synth (stoker's trainer's models are TensorFlow's)")
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
    if importlib.util.find_spec("librosa") is None:  # benchmarks/data.py measures the producer against it
        raise UserError("bench compares stoker's producer with librosa, which the test extra installs: "
                        "pip install 'stoker[test]'")
    require_tensorflow("python run.py bench (it compares with tf.data and trains TensorFlow models)")
    command = [sys.executable, "-m", "stoker.benchmarks.suite", "--out", str(Path(args.out).resolve())]
    if args.quick:
        command.append("--quick")
    return subprocess.call(command, env=with_stoker_path(os.environ))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["train", *argv]
    flags: dict[str, str] = {}
    try:
        args = build_parser().parse_args(argv)
        if args.command not in COMMANDS:
            build_parser().print_help()
            return EXIT_USER
        flags = {name: flag for name, flag in {**KEY_FLAGS, **PARAMETER_FLAGS}.items() if name in vars(args)}
        return globals()[f"cmd_{args.command}"](args)  # each command's function: cmd_train, cmd_produce, ...
    except UserError as exc:  # every error the user can fix (shared/errors.py): one line
        suggests = exc.suggests if isinstance(exc, service.SettingError) else ()
        sys.stderr.write(f"stoker: error: {with_flags(str(exc), flags, suggests)}\n")
        return EXIT_USER
    except KeyboardInterrupt:
        sys.stderr.write("stoker: interrupted\n")
        return EXIT_INTERRUPTED
