"""``stoker.Feed``: stoker's batches in the user's own training loop.

::

    import stoker
    with stoker.Feed(data="~/LJSpeech-1.1", producers=4, batch_size=16, epochs=10,
                     run_dir="runs/mine") as feed:
        for batch in feed:                      # dict of tensors on the model device (framework=)
            loss = train_step(batch)            # the user's own step
            feed.step_done(loss=loss)           # optional: the step's loss for metrics.jsonl
        val = [eval_step(b) for b in feed.validation()]   # the held-out clips, once each

The feed runs in the user's process: the trainer side of the pipeline (consumer/pipeline/feed.py:
index, plan, coordinator, bounded queue, step rows, input position, summary.json), the
staging of each batch onto the model device while the previous step runs (as TensorFlow
tensors, PyTorch tensors, JAX arrays or numpy arrays: ``framework``, trainer.framework;
consumer/pipeline/frameworks.py), and the local producer processes, started and
supervised here as the launcher does for ``python run.py`` (restarted when they crash,
at most ``pipeline.producer_restarts`` times each). It writes the run files of a stoker
run, so ``diagnose`` and ``watch`` read it. docs/FEED.md is the user's guide.

Lifecycle: constructing a feed checks its options and starts nothing; ``with`` (or the
first batch taken) starts it; leaving the ``with`` block, normally, by an exception or
by Ctrl-C, closes it with the shutdown protocol: the coordinator tells every producer
STOP, the producers are joined with a timeout and then terminated, summary.json is
written. A feed that is never closed is closed at interpreter exit, with a warning.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from .consumer.pipeline.feed import FeedCore, PreparedRun
from .consumer.pipeline.frameworks import FunctionStaging, JaxStaging, Staging, TorchStaging
from .launcher import KILL_AFTER_S, PRODUCER_STOP_S, TICK_S, AutoControl, Supervisor, start_producers
from .service import FLAG_KEYS, make_run_dir, prepare_run, resolve_options
from .shared import config as config_mod
from .shared.cluster import from_env, worker_dir_name
from .shared.config import FRAMEWORKS, TENSORFLOW, batch_schema
from .shared.errors import UserError
from .shared.proc import EXIT_FAILED, EXIT_INTERRUPTED
from .shared.runfiles import CONFIG, TRAINED_BY_FEED
from .shared.runlock import RunLock
from .shared.tfsetup import TF_EXTRA, device_stager, replica_stager

log = logging.getLogger("stoker.feed")

# The feed's options: every option of `python run.py` by its long name, except the ones
# that name stoker's own trainer (the user's loop trains) or another command.
NOT_FEED_OPTIONS = {"model": "the feed trains no model: your loop does"}
# What each framework needs installed: its module, its name, and how to install it.
FRAMEWORK_MODULES = {
    TENSORFLOW: ("tensorflow", "TensorFlow", f"{TF_EXTRA}, or choose framework='torch', 'jax' or 'numpy'"),
    "torch": ("torch", "PyTorch", "pip install torch (the build for your CUDA: pytorch.org)"),
    "jax": ("jax", "JAX", "pip install 'jax[cpu]' (or 'jax[cuda12]')"),
}


class FeedError(UserError):
    """A feed used wrongly (an unknown option, a feed used after it closed, a state that
    does not fit); the message is one line for the user."""


def _option_names() -> list[str]:
    return sorted(set(FLAG_KEYS) - set(NOT_FEED_OPTIONS))


class Feed:
    """stoker's batches for the user's loop. Options: ``config`` (a YAML file), ``set``
    ({"section.key": value}), ``resume`` (a :meth:`state_dict`), and every option of
    ``python run.py`` by its long name (``data``, ``producers``, ``batch_size``, ``steps``,
    ``epochs``, ``buffer_size``, ``model_start_delay``, ``bind``, ``keys``, ``max_frames``,
    ``record_samples``, ``text_frontend``, ``data_gpu``, ``model_gpu``, ...); ``framework``
    (trainer.framework): what it hands out, TensorFlow tensors (the default), PyTorch
    tensors, JAX arrays or numpy arrays."""

    def __init__(self, config: str | os.PathLike[str] | None = None, set: dict[str, Any] | None = None,
                 resume: dict[str, Any] | None = None, strategy: Any = None, framework: str | None = None,
                 sharding: Any = None, **options: Any) -> None:
        """``framework``: "tensorflow", "torch", "jax" or "numpy" (default: trainer.framework of the
        config, tensorflow). ``strategy`` (TensorFlow): a ``tf.distribute`` strategy whose replicas
        take the batches: each batch is then per-replica values (one part of the global batch on
        each replica's device), ready for ``strategy.run``; ``replicas`` follows from it.
        ``sharding`` (JAX): a ``jax.sharding.Sharding`` every field of a batch is put with
        (default: the device ``jax.devices()[model_gpu or 0]``)."""
        for name in options:
            if name in NOT_FEED_OPTIONS:
                raise FeedError(f"stoker.Feed: option {name!r} is not the feed's ({NOT_FEED_OPTIONS[name]})")
            if name not in _option_names():
                raise FeedError(f"stoker.Feed: unknown option {name!r}; the options are the long names of python "
                                f"run.py's: {', '.join(_option_names())} (and config=, set=, resume=)")
        if options.get("producers") is not None and not isinstance(options["producers"], (int, str)):
            raise FeedError(f"stoker.Feed: producers must be a number or 'auto', got {options['producers']!r}")
        if strategy is not None:
            replicas = len(strategy.extended.worker_devices)  # this worker's (all of them but on several workers)
            if options.get("replicas") not in (None, replicas):
                raise FeedError(f"stoker.Feed: replicas={options['replicas']}, but the strategy has {replicas}")
            options["replicas"] = replicas
        self._strategy = strategy
        self._replicas = options.get("replicas")  # None: the loop's business (summary.json says null)
        sets = {str(key): value for key, value in (set or {}).items()}
        if framework is not None:
            if sets.get("trainer.framework", framework) != framework:
                raise FeedError(f"stoker.Feed: framework={framework!r}, but set= has trainer.framework="
                                f"{sets['trainer.framework']!r}")
            sets["trainer.framework"] = framework
        try:
            self.cfg = resolve_options(str(config) if config is not None else None, options, sets)
        except config_mod.ConfigError as exc:
            raise FeedError(f"stoker.Feed: {exc}") from None
        self.framework = self._check_framework(self.cfg.trainer.framework, strategy, sharding)
        self._sharding = sharding
        self._staging: Staging = Staging()  # from start() on: the framework's (host arrays until then)
        self.device = "host"  # where batches are staged, from start() on
        self._resume = resume
        self._prepared: PreparedRun | None = None  # from prepare() on: the dataset indexed, the epochs planned
        self._core: FeedCore | None = None  # from start() on: the run opened (coordinator, queues, step logs)
        self._producers: list[Any] = []
        self._supervisor: Any = None
        self._auto: Any = None
        self._watch: threading.Thread | None = None
        self._closing = threading.Event()
        self._stop = threading.Event()
        self._batches: Iterator[Any] | None = None
        self._taken_by: str | None = None  # "iteration" or "as_dataset()"
        self._ended = False
        self._closed = False
        self._started_once = False
        self._reused_dir = False
        self._run_lock: RunLock | None = None  # the run directory's, from prepare() to close()
        self.run_dir: Path | None = None
        self.endpoint = ""

    @staticmethod
    def _check_framework(framework: str, strategy: Any, sharding: Any) -> str:
        """``framework`` if it is installed and the options fit it; else one FeedError line."""
        assert framework in FRAMEWORKS  # the config checked it
        if strategy is not None and framework != TENSORFLOW:
            raise FeedError(f"stoker.Feed: strategy= is a tf.distribute strategy, for framework='tensorflow'; "
                            f"this feed's framework is {framework!r}")
        if sharding is not None and framework != "jax":
            raise FeedError(f"stoker.Feed: sharding= is a jax.sharding.Sharding, for framework='jax'; this feed's "
                            f"framework is {framework!r}")
        module, name, install = FRAMEWORK_MODULES.get(framework, (None, "", ""))
        if module is not None and importlib.util.find_spec(module) is None:
            raise FeedError(f"stoker.Feed(framework={framework!r}) needs {name}: {install}")
        if sharding is not None:
            import jax  # the user's sharding is JAX's: JAX is loaded already

            if not isinstance(sharding, jax.sharding.Sharding):
                raise FeedError(f"stoker.Feed: sharding= takes a jax.sharding.Sharding, got {type(sharding).__name__}")
        return framework

    # ------------------------------------------------------------ starting
    def __enter__(self) -> "Feed":
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)

    def prepare(self) -> "Feed":
        """Check the options, make the run directory, index the dataset and plan the epochs,
        starting no process: the vocabulary, shapes and element spec are known from here on,
        and a checkpoint holding :meth:`trackable` can still be restored."""
        if self._prepared is not None:
            return self
        if self._closed:
            raise FeedError("this feed is closed; make a new stoker.Feed to train again")
        cfg, plan = prepare_run(self.cfg, trains_model=False)  # another framework's producers: backend numpy
        run_dir = self._run_dir(cfg)
        self._run_lock = RunLock.acquire(run_dir)  # before anything in the run directory is written; close() frees it
        try:
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_dir=str(run_dir)))
            self.cfg, self.run_dir, self._plan = cfg, run_dir, plan
            config_mod.save(cfg, run_dir / CONFIG)
            log.info("%s", plan.describe(cfg.pipeline.producers))
            log.info("run directory %s", run_dir)
            self._prepared = PreparedRun(cfg, run_dir, hold_out=True)  # trainer.val_clips / data.eval_file (FEED.md)
        except BaseException:
            self._run_lock.release()
            self._run_lock = None
            raise
        atexit.register(self._at_exit)
        return self

    def _prepared_run(self) -> PreparedRun:
        """The prepared run (prepare() first)."""
        prepared = self.prepare()._prepared
        assert prepared is not None
        return prepared

    def _open_core(self) -> FeedCore:
        """The open run (start() first)."""
        core = self.start()._core
        assert core is not None  # start() raised otherwise, or the feed is closed
        return core

    def _running(self) -> FeedCore:
        """The open run, where a batch was taken already (so start() made it)."""
        assert self._core is not None
        return self._core

    def start(self) -> "Feed":
        """Prepare, then bind, stage and start the producers (the ``with`` statement calls it)."""
        if self._closed:
            raise FeedError("this feed is closed; make a new stoker.Feed to train again")
        prepared = self._prepared_run()
        if self._started_once:
            return self
        self._started_once = True
        if self._reused_dir and self._resume is None:
            self._started_once = False
            self.close()
            raise FeedError(f"run directory {self.run_dir} holds a run; choose another run_dir, or continue it with "
                            f"resume=feed.state_dict() (or a restored feed.trackable())")
        try:
            self._core = core = FeedCore(prepared, self._stop, state=self._resume)
            self.endpoint = core.endpoint
            self._staging = staging = self._make_staging()
            self.device = staging.device
            if staging.stage is not None:
                core.queue.enable_staging(staging.stage)
                core.val_queue.enable_staging(staging.stage)
            self._start_producers()
        except BaseException:
            self.close()
            raise
        return self

    def _run_dir(self, cfg: config_mod.Config) -> Path:
        """The run directory: a new one, or a stoker run directory to continue (its step logs
        go on; :meth:`start` refuses it unless the feed resumes)."""
        requested = cfg.run.run_dir
        cluster = from_env(os.environ)
        if cluster is not None and cluster.size > 1:  # each trainer worker's feed writes DIR/worker-N
            if not requested:
                raise FeedError(f"TF_CONFIG names {cluster.size} trainer workers: give every worker's feed the same "
                                f"run_dir (on a filesystem they share); worker N writes run_dir/worker-N")
            requested = str(Path(requested).expanduser().resolve() / worker_dir_name(cluster.index))
        if requested:
            path = Path(requested).expanduser().resolve()
            if (path / CONFIG).is_file():
                self._reused_dir = True
                return path
        return make_run_dir(requested)

    def _make_staging(self) -> Staging:
        """How batches reach the loop for the feed's framework (consumer/pipeline/frameworks.py):
        staged onto the model device in the queue's stager thread, or host arrays (numpy)."""
        if self.framework == TENSORFLOW:
            return self._tf_staging()
        if self.framework == "torch":
            return self._torch_staging()
        if self.framework == "jax":
            return self._jax_staging()
        log.info("batches handed out as numpy arrays (host memory)")
        return Staging()

    def _one_model_gpu(self, several: str) -> int | None:
        """``devices.model_gpu`` as one index (None: not given); FeedError for several, saying ``several``."""
        wanted = self.cfg.devices.model_gpu
        if isinstance(wanted, str):
            raise FeedError(f"model_gpu={wanted!r}: {several}")
        return wanted

    def _tf_staging(self) -> Staging:
        """Host arrays -> tensors on the model device, in the queue's stager thread: the
        GPU ``devices.model_gpu`` names among this process's GPUs (default its first, with
        ``devices.model_gpu_memory_mb`` as its limit), else the CPU; with a strategy, each
        replica's part onto that replica's device."""
        import tensorflow as tf

        if self._strategy is not None:
            devices = list(self._strategy.extended.worker_devices)
            log.info("batches split over %d replicas and staged onto %s", len(devices), ", ".join(devices))
            return FunctionStaging(replica_stager(tf, self._strategy, devices), ", ".join(devices))

        wanted = self._one_model_gpu("without strategy= the feed stages each batch onto one GPU; for a replica on "
                                     "each of several, give strategy=tf.distribute.MirroredStrategy(...)")
        limit_mb = self.cfg.devices.model_gpu_memory_mb
        physical = tf.config.list_physical_devices("GPU")
        if wanted is not None and wanted >= len(physical):
            raise FeedError(f"model_gpu {wanted}: TensorFlow in this process sees {len(physical)} GPU(s) (numbered "
                            f"from 0 among CUDA_VISIBLE_DEVICES)")
        if limit_mb and physical:
            try:
                tf.config.set_logical_device_configuration(
                    physical[wanted or 0], [tf.config.LogicalDeviceConfiguration(memory_limit=int(limit_mb))])
            except RuntimeError:
                raise FeedError("model_gpu_memory: TensorFlow in this process has set up its GPUs already (a tensor "
                                "or model was made before the feed started); start the feed first, or leave the "
                                "limit to tf.config.set_logical_device_configuration in your code") from None
        elif limit_mb:
            log.warning("model_gpu_memory=%d: this process has no GPU; nothing to limit", limit_mb)
        gpus = tf.config.list_logical_devices("GPU")
        device = gpus[wanted or 0].name if gpus else "/CPU:0"
        log.info("batches staged onto %s", device)
        return FunctionStaging(device_stager(tf, device), device)

    def _torch_staging(self) -> Staging:
        """Batches as torch tensors on ``cuda:N`` (N: ``devices.model_gpu``, default 0) when
        CUDA is available, with ``devices.model_gpu_memory_mb`` as the process's share of
        that GPU; else on the CPU."""
        import torch  # the user's framework: loaded with the feed of a torch loop only

        wanted = self._one_model_gpu("the feed stages each batch onto one GPU, cuda:N; several GPUs are a process "
                                     "each (torch.distributed), each with its model_gpu")
        limit_mb = self.cfg.devices.model_gpu_memory_mb
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            if wanted is not None and wanted >= count:
                raise FeedError(f"model_gpu {wanted}: PyTorch in this process sees {count} GPU(s) (numbered from 0 "
                                f"among CUDA_VISIBLE_DEVICES)")
            index = wanted or 0
            if limit_mb:
                total_mb = torch.cuda.get_device_properties(index).total_memory / 2**20
                torch.cuda.set_per_process_memory_fraction(min(1.0, limit_mb / total_mb), index)
            device = f"cuda:{index}"
        elif wanted is not None:
            raise FeedError(f"model_gpu {wanted}: PyTorch in this process sees no GPU (torch.cuda.is_available() is "
                            f"False: a CPU build of torch, or no driver)")
        else:
            if limit_mb:
                log.warning("model_gpu_memory=%d: this process has no GPU; nothing to limit", limit_mb)
            device = "cpu"
        log.info("batches staged onto %s as torch tensors", device)
        return TorchStaging(torch, device)

    def _jax_staging(self) -> Staging:
        """Batches as jax arrays put with ``sharding=``, else onto ``jax.devices()[model_gpu or 0]``."""
        import jax  # the user's framework: loaded with the feed of a JAX loop only

        if self.cfg.devices.model_gpu_memory_mb:
            log.warning("model_gpu_memory=%d: JAX takes its memory limit from XLA_PYTHON_CLIENT_MEM_FRACTION, set "
                        "before JAX starts; not applied", self.cfg.devices.model_gpu_memory_mb)
        if self._sharding is not None:
            log.info("batches put with %s as jax arrays", self._sharding)
            return JaxStaging(jax, self._sharding)
        wanted = self._one_model_gpu("without sharding= the feed puts each batch on one device; for several, give "
                                     "sharding=jax.sharding.NamedSharding(mesh, PartitionSpec('batch'))")
        devices = jax.devices()
        if wanted is not None and wanted >= len(devices):
            raise FeedError(f"model_gpu {wanted}: JAX in this process has {len(devices)} device(s): {devices}")
        device = devices[wanted or 0]
        log.info("batches staged onto %s as jax arrays", device)
        return JaxStaging(jax, device)

    def _start_producers(self) -> None:
        cfg, plan = self.cfg, self._plan
        self._supervisor = sup = Supervisor(plan, cfg.run.log_level)
        self._producers.extend(start_producers(sup, cfg, plan, self.endpoint))
        if cfg.pipeline.producers_auto:
            assert self.run_dir is not None
            self._auto = AutoControl(cfg, self.run_dir, sup, self._producers, self.endpoint, plan)
        self._watch = threading.Thread(target=self._supervise, name="stoker-producers", daemon=True)
        self._watch.start()

    def _supervise(self) -> None:
        """The producers' supervision, beside the user's loop: status lines, crashes restarted."""
        sup = self._supervisor
        while not self._closing.is_set():
            sup.poll_status(TICK_S)
            sup.supervise_producers(self._producers, self.cfg.pipeline.producer_restarts,
                                    keep_going=lambda: not self._closing.is_set())
            if self._auto is not None:
                self._auto.step()

    # ------------------------------------------------------------ batches
    def __iter__(self) -> "Feed":
        return self

    def __next__(self) -> dict[str, Any]:
        """The next batch; asking for it confirms the last one's step (it was trained).
        StopIteration at the end of the plan, and again at every later call."""
        if self._closed:
            raise FeedError("this feed is closed; no batch is left")
        if self._ended:
            raise StopIteration
        self._take_by("iteration")
        if self._batches is None:
            self._batches = self._open_core().batches(confirm_on_request=False)
        try:
            return self._next_of(self._batches)
        except StopIteration:
            self._ended = True
            raise

    def epochs(self) -> Iterator[tuple[int, Iterator[dict[str, Any]]]]:
        """The plan epoch by epoch: ``for epoch, batches in feed.epochs(): for batch in batches:``.
        ``batches`` ends when every clip of that epoch was handed out (or rejected); batches
        of the next epoch that arrive first are held back for it. Asking for a batch confirms
        the last one's step, as in plain iteration."""
        self._take_by("iteration")
        core = self._open_core()
        while not self._closed and not core.handed_all():
            epoch = core.handed.first_open()
            yield epoch, self._epoch_batches(epoch)

    def _epoch_batches(self, epoch: int) -> Iterator[dict[str, Any]]:
        batches = self._running().batches(confirm_on_request=False, epoch=epoch)
        while True:
            try:
                yield self._next_of(batches)
            except StopIteration:
                return

    def _next_of(self, batches: Iterator[Any]) -> dict[str, Any]:
        """The next batch of ``batches`` for a loop that asks when it needs one: the step of the
        batch before ended when the loop asked (unless step_done said so earlier)."""
        core = self._running()
        core.confirm(time.monotonic())
        core.flush_if_due()
        try:
            item = next(batches)
        except StopIteration:
            core.flush()
            raise
        return self._staging.take(item.arrays)

    def _take_by(self, way: str) -> None:
        """Batches go either to a loop that iterates the feed or to tf.data (``as_dataset``), which
        takes them ahead of training: which batch a step trained is known only in one of them."""
        if self._taken_by not in (None, way):
            raise FeedError(f"this feed's batches are taken by {self._taken_by} already; a feed is either iterated "
                            f"(for batch in feed, feed.epochs()) or read through as_dataset(), not both")
        self._taken_by = way

    def step_done(self, loss: Any = None, **terms: Any) -> None:
        """A training step ended: the oldest batch handed out and not yet confirmed was trained
        (when iterating, the last batch; through ``as_dataset()``, batches are handed out ahead
        of training, and each call confirms the oldest). ``loss`` (a number or a scalar tensor)
        and named ``terms`` go to metrics.jsonl, fetched from the device once per logging
        interval."""
        core = self._core
        if self._taken_by is None or core is None:
            raise FeedError("step_done() before the first batch")
        confirmed = core.step_done({"loss": loss, **terms} if terms else loss)
        if self._taken_by == "iteration":
            return  # a second call for one batch changes nothing
        if not confirmed:
            raise FeedError("step_done() without a batch to confirm: every batch handed out through as_dataset() "
                            "is confirmed already (call it once per training step, and not beside feed.callback())")
        core.flush_if_due()

    def callback(self) -> Any:
        """A Keras callback that confirms each training step of ``fit`` on :meth:`as_dataset`,
        so the feed's state (and metrics.jsonl) counts only what the model trained, whatever
        ``map``/``prefetch`` the dataset has: ``model.fit(feed.as_dataset(), epochs=E,
        callbacks=[feed.callback(), ...])``. Put it before callbacks that save
        ``feed.state_dict()``, so that their state counts the step that just ended."""
        self._tensorflow_only("callback()", "a Keras callback")
        import keras

        feed = self

        class FeedCallback(keras.callbacks.Callback):
            # Keras may run the batch hooks in a thread of its own, after the step's logs are on the
            # host: the step is then confirmed when it is done, and the training thread never waits.
            async_safe = True

            def __init__(self) -> None:
                super().__init__()
                self._seen = 0  # steps of this Keras epoch confirmed
                self._lock = threading.Lock()

            def on_train_begin(self, logs: Any = None) -> None:
                # Every fit makes its own iterator: what an earlier one took ahead was never trained.
                feed.return_prefetched()

            def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
                self._seen = 0

            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                # ``batch`` is the index of the last step run (several under steps_per_execution); run
                # in Keras' threads, a later batch's hook can come first and count the steps before it.
                with self._lock:
                    steps, self._seen = max(0, batch + 1 - self._seen), max(self._seen, batch + 1)
                if steps:
                    feed._confirm_steps(steps)

        return FeedCallback()

    def return_prefetched(self) -> int:
        """Batches handed out through ``as_dataset()`` and never confirmed go back to the feed,
        to be handed out again first: call it when the iterator that took them ahead is
        dropped before they were trained (a loop that stops iterating a dataset early and
        makes a new iterator). :meth:`callback` does it at the start of every ``fit``. The
        number of batches returned."""
        if self._core is None or self._taken_by != "as_dataset()":
            return 0
        return self._core.hand_out_again()

    def _confirm_steps(self, steps: int) -> None:
        core = self._core
        if core is None:
            return
        for _ in range(steps):
            if not core.step_done():
                break  # the last execution of an epoch ran short of its steps_per_execution
        core.flush_if_due()

    @property
    def epoch(self) -> int | None:
        """The plan epoch of the batch being trained: the last one handed out when iterating;
        through ``as_dataset()`` the oldest not yet confirmed (None before the first batch)."""
        core = self._core
        if core is None:
            return None
        return core.training_epoch()

    def as_dataset(self) -> Any:
        """The batches as a ``tf.data.Dataset`` (for ``model.fit`` and
        ``strategy.distribute_datasets_from_function``): element spec per the batch schema,
        bucketed dimensions None. Each iteration of it is one epoch of the plan (the next one
        not yet handed out in full), so ``fit(ds, epochs=E)`` trains E epochs and sees where
        each ends; ``.repeat()`` makes it one stream of every epoch left (for ``steps_per_epoch``).
        Batches may be taken ahead of training (``map``, ``prefetch``): the steps trained are
        confirmed by :meth:`callback` under ``fit``, or by :meth:`step_done` in a custom loop.
        With replicas, ``strategy.experimental_distribute_dataset`` splits each global batch."""
        self._tensorflow_only("as_dataset()", "a tf.data.Dataset")
        import tensorflow as tf

        if self._strategy is not None:
            raise FeedError("as_dataset() of a feed made with strategy=: its batches are per-replica already; iterate "
                            "the feed, or make it without strategy= and give strategy.experimental_distribute_dataset"
                            "(feed.as_dataset())")

        spec = self.element_spec

        def one_epoch() -> Iterator[dict[str, Any]]:
            self._take_by("as_dataset()")
            core = self._open_core()
            if core.handed_all():
                return
            for item in core.batches(confirm_on_request=False, epoch=core.handed.first_open()):
                yield item.arrays

        return tf.data.Dataset.from_generator(one_epoch, output_signature=spec)

    # ------------------------------------------------------------ validation
    def validation(self) -> Iterator[dict[str, Any]]:
        """One validation pass: the held-out clips (``trainer.val_clips`` of them, or the clips
        of ``data.eval_file``), each exactly once, in batches made by the producers as
        training batches are (same fields, bucket shapes, staging onto the model device).
        Call it as often as you like, between steps or after the loop; it is no training
        step (the step count, the input position and metrics.jsonl stay as they are). With
        no clip held out the pass is empty (logged). Leaving a pass before its end is fine."""
        if self._closed:
            raise FeedError("this feed is closed; validate before leaving the `with` block")
        core = self._open_core()

        def batches() -> Iterator[dict[str, Any]]:
            for item in core.validation_pass():
                yield self._staging.take(item.arrays)

        return batches()

    def validation_dataset(self) -> Any:
        """The validation passes as a ``tf.data.Dataset`` (element spec as :meth:`as_dataset`'s):
        each iteration over it is a new pass, so ``model.fit(..., validation_data=
        feed.validation_dataset())`` validates on every held-out clip at each epoch end."""
        self._tensorflow_only("validation_dataset()", "a tf.data.Dataset")
        import tensorflow as tf

        if self._strategy is not None:
            raise FeedError("validation_dataset() of a feed made with strategy=: its batches are per-replica "
                            "already; iterate feed.validation()")
        return tf.data.Dataset.from_generator(lambda: self.validation(), output_signature=self.element_spec)

    @property
    def validation_clips(self) -> list[str]:
        """The ids of the held-out clips (also in RUN_DIR/validation.json)."""
        return [s.id for s in self._prepared_run().val_samples]

    # ------------------------------------------------------------ progress and resume
    @property
    def step(self) -> int:
        return self._core.step if self._core is not None else 0

    @property
    def batches_per_epoch(self) -> int:
        return self._prepared_run().planner.batches_per_epoch

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """The batch shapes (B, L, T) of the plan, the buckets' and the epoch's one short batch's
        (only its real rows, unless rows are fixed): every planned batch has one of them."""
        return self._prepared_run().planner.shapes

    @property
    def vocabulary(self) -> Any:
        """The text front-end's vocabulary (shared/vocab.Vocabulary): ``.size`` token ids."""
        return self._prepared_run().vocabulary

    @property
    def n_mels(self) -> int:
        return self.cfg.features.n_mels

    @property
    def element_spec(self) -> dict[str, Any]:
        """Each batch field's ``tf.TensorSpec``, per the batch schema: the dimensions that vary
        by bucket (B, L, T, S) None, F and R fixed. A ``tf.function`` with this
        ``input_signature`` traces once for every bucket."""
        self._tensorflow_only("element_spec", "tf.TensorSpec's")
        import tensorflow as tf

        cfg = self._prepared_run().cfg  # fixed rows resolved (replicas, workers): row_mask among the fields
        fixed = {"F": cfg.features.n_mels, "R": cfg.batching.ref_frames}  # the same in every bucket
        return {f.name: tf.TensorSpec([fixed.get(dim) for dim in f.dims], tf.as_dtype(f.dtype), name=f.name)
                for f in batch_schema(cfg).fields}

    def state_dict(self) -> dict[str, Any]:
        """Where the feed is in its plan (JSON-serialisable): which planned batches of which
        epochs were handed out, the step count, and the identity of the plan and dataset.
        Save it with the model; ``stoker.Feed(..., resume=state)`` goes on from there."""
        if self._core is None or not self._started_once:
            if self._resume is not None:
                return self._resume
            raise FeedError("state_dict() before the feed started: nothing to save yet")
        return self._core.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (before the feed starts)."""
        if self._started_once:
            raise FeedError("load_state_dict() after the feed started: give resume=state to stoker.Feed, or "
                            "restore the checkpoint before the `with` block")
        self._resume = state

    def trackable(self) -> Any:
        """The feed's state as a ``tf.train.Checkpoint``-trackable object:
        ``tf.train.Checkpoint(model=model, feed=feed.trackable())``; restoring the
        checkpoint before the feed starts makes the feed continue from its position."""
        self._tensorflow_only("trackable()", "a tf.train.Checkpoint object")
        import tensorflow as tf

        feed = self

        class FeedState(tf.train.experimental.PythonState):
            def serialize(self) -> str:
                return json.dumps(feed.state_dict())

            def deserialize(self, string_value: Any) -> None:
                text = string_value.decode() if isinstance(string_value, bytes) else str(string_value)
                feed.load_state_dict(json.loads(text))

        return FeedState()

    def _tensorflow_only(self, what: str, is_: str) -> None:
        """FeedError (one line) for a TensorFlow thing asked of a feed of another framework."""
        if self.framework != TENSORFLOW:
            raise FeedError(f"feed.{what} is {is_}, for framework='tensorflow'; this feed hands out "
                            f"{self.framework} batches: iterate it (for batch in feed), and save feed.state_dict()")

    # ------------------------------------------------------------ closing
    def close(self, exc: BaseException | None = None) -> None:
        """The shutdown protocol: STOP to every producer (through the coordinator), the step
        logs and summary.json written, producers joined with a timeout, then terminated.
        ``exc``: the exception that ended the user's loop (recorded in summary.json)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._close_core(exc)
        finally:
            self._stop_producers()
            atexit.unregister(self._at_exit)
            if self._run_lock is not None:
                self._run_lock.release()
                self._run_lock = None

    def _close_core(self, exc: BaseException | None) -> None:
        core = self._core
        if core is not None and core.opened:
            if isinstance(exc, KeyboardInterrupt):
                core.exit_reason, core.code = "interrupted", EXIT_INTERRUPTED
            elif exc is not None:
                core.exit_reason, core.code = f"failed: {type(exc).__name__}: {exc}"[:500], EXIT_FAILED
            elif not self._ended and not core.finished():
                core.exit_reason = f"stopped by the training loop at step {core.step}"
            if self._taken_by == "as_dataset()" and not core.step and core.handed_steps:
                log.warning("%d batches went out through as_dataset() and no step was confirmed: pass "
                            "callbacks=[feed.callback()] to fit, or call feed.step_done() after each step of your "
                            "loop; the feed's state counts confirmed steps only", core.handed_steps)
            # The user's loop trains: its model, and its replicas (a tf.distribute strategy), are not the
            # feed's to know.
            core.close({"trained_by": TRAINED_BY_FEED, "model": None, "replicas": self._replicas})
            failure = core.file_failure()  # a file of the run it could not write while closing (a full disk)
            if failure is not None and exc is None:
                raise failure

    def _stop_producers(self) -> None:
        self._closing.set()
        if self._watch is not None:
            self._watch.join(timeout=5.0)
        sup = self._supervisor
        if sup is None:
            return
        try:
            sup.wait(self._producers, PRODUCER_STOP_S)  # they were told STOP
            sup.terminate(self._producers, KILL_AFTER_S)
        finally:
            sup.cleanup()

    def _at_exit(self) -> None:
        if not self._closed:
            log.warning("a stoker.Feed was never closed; closing it at exit (use `with stoker.Feed(...) as feed:` "
                        "or call feed.close())")
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._started_once else "not started"
        return f"<stoker.Feed {state} run_dir={self.run_dir} step={self.step}>"


__all__ = ["Feed", "FeedError"]
