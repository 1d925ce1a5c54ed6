"""``stoker.Feed``: stoker's batches in the user's own training loop.

::

    import stoker
    with stoker.Feed(data="~/LJSpeech-1.1", producers=4, batch_size=16, epochs=10,
                     run_dir="runs/mine") as feed:
        for batch in feed:                      # dict of tensors on the model device (framework=)
            loss = train_step(batch)            # the user's own step
            feed.step_done(loss=loss)           # optional: the step's loss for metrics.jsonl

The feed runs the trainer side of the pipeline (consumer/pipeline/feed.py) in the user's
process; the run service starts and supervises its producers. docs/FEED.md is the user's
guide, docs/DESIGN.md (One path to a training step) the long story.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from . import service
from .consumer.pipeline.clips import ClipList
from .consumer.pipeline.feed import FeedCore, PreparedRun
from .consumer.pipeline.frameworks import Staging
from .feed_dcp import DistributedState, state_key
from .feed_staging import FeedError, check_framework, make_staging
from .feed_tf import checkpoint_state, element_spec, keras_callback
from .shared import config as config_mod
from .shared.cluster import from_env
from .shared.config import TENSORFLOW
from .shared.proc import EXIT_FAILED, EXIT_INTERRUPTED
from .shared.runfiles import CONFIG, TRAINED_BY_FEED, clear_untrained, trained_nothing
from .shared.runlock import RunLock

log = logging.getLogger("stoker.feed")

# Options of python run.py that are not the feed's, and why.
NOT_FEED_OPTIONS = {"model": "it sets trainer.model, stoker's trainer's; the feed trains no model: your loop does"}
# The feed's keyword options and the config key each one sets: python run.py's long option
# names (service.KEY_NAMES), as docs/FEED.md lists them. Any other config key goes through set=.
OPTION_KEYS = {name: key for key, name in service.KEY_NAMES.items() if name not in NOT_FEED_OPTIONS}


def feed_overrides(options: Mapping[str, Any], sets: Mapping[str, Any]) -> dict[str, Any]:
    """The config keys a feed's keyword ``options`` (OPTION_KEYS; None: not given) and its
    ``set=`` give, ``set=`` last; FeedError (one line) for an option that is not the feed's."""
    given: dict[str, Any] = {}
    for name, value in options.items():
        if name in NOT_FEED_OPTIONS:
            raise FeedError(f"stoker.Feed: option {name!r} is not the feed's ({NOT_FEED_OPTIONS[name]})")
        if name not in OPTION_KEYS:
            raise FeedError(f"stoker.Feed: unknown option {name!r}; the options are {', '.join(sorted(OPTION_KEYS))} "
                            f"(and config=, set= for any config key, resume=, framework=, strategy=, sharding=)")
        if value is not None:
            given[OPTION_KEYS[name]] = value
    producers = given.get("pipeline.producers")
    if producers is not None and (isinstance(producers, bool) or not isinstance(producers, (int, str))):
        raise FeedError(f"stoker.Feed: producers (pipeline.producers) must be a number or 'auto', got {producers!r}")
    given.update({str(key): value for key, value in sets.items()})
    return given


def feed_config(config: str | os.PathLike[str] | None, sets: Mapping[str, Any], options: Mapping[str, Any],
                framework: str | None, strategy: Any) -> config_mod.Config:
    """A feed's config: the YAML file ``config``, then its keyword ``options`` and ``set=``
    (:func:`feed_overrides`), ``framework=`` and the replicas of ``strategy``; FeedError (one
    line) for each mistake."""
    given = feed_overrides(options, sets)
    if strategy is not None:
        replicas = len(strategy.extended.worker_devices)  # this worker's (all of them but on several workers)
        if given.get("devices.replicas") not in (None, replicas):
            raise FeedError(f"stoker.Feed: devices.replicas is {given['devices.replicas']}, but the strategy has "
                            f"{replicas}")
        given["devices.replicas"] = replicas
    if framework is not None:
        if given.get("trainer.framework", framework) != framework:
            raise FeedError(f"stoker.Feed: framework={framework!r}, but set= has trainer.framework="
                            f"{given['trainer.framework']!r}")
        given["trainer.framework"] = framework
    try:
        return service.resolve(config, given)
    except config_mod.ConfigError as exc:
        raise FeedError(f"stoker.Feed: {exc}") from None


class Feed:
    """stoker's batches for the user's loop. Options: ``config`` (a YAML file), ``set``
    ({"section.key": value}), ``resume`` (a :meth:`state_dict`), the keyword options of
    OPTION_KEYS (``data``, ``producers``, ``batch_size``, ``epochs``, ...), and ``framework``
    (trainer.framework): TensorFlow tensors (the default), PyTorch tensors, JAX arrays or numpy."""

    def __init__(self, config: str | os.PathLike[str] | None = None, set: dict[str, Any] | None = None,
                 resume: dict[str, Any] | None = None, strategy: Any = None, framework: str | None = None,
                 sharding: Any = None, **options: Any) -> None:
        """``framework``: "tensorflow", "torch", "jax" or "numpy" (default: trainer.framework of the
        config, tensorflow). ``strategy`` (TensorFlow): a ``tf.distribute`` strategy whose replicas
        take the batches: each batch is then per-replica values (one part of the global batch on
        each replica's device), ready for ``strategy.run``; ``replicas`` follows from it.
        ``sharding`` (JAX): a ``jax.sharding.Sharding`` every field of a batch is put with
        (default: the device ``jax.devices()[model_gpu or 0]``)."""
        self.cfg = feed_config(config, set or {}, options, framework, strategy)
        self._strategy, self._sharding = strategy, sharding
        self._replicas = self.cfg.devices.replicas  # None: the loop's business (summary.json says null)
        self.framework = check_framework(self.cfg.trainer.framework, strategy, sharding)
        self._staging: Staging = Staging()  # from start() on: the framework's (host arrays until then)
        self.device = "host"  # where batches are staged, from start() on
        self._resume = resume
        self._prepared: PreparedRun | None = None  # from prepare() on: the dataset indexed, the epochs planned
        self._clips: ClipList | None = None  # feed.clips, made when first asked
        self._core: FeedCore | None = None  # from start() on: the run opened (coordinator, queues, step logs)
        self._producers: service.BackgroundProducers | None = None  # from start() on: the run service's
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
        cfg, plan = service.prepare_run(self.cfg, trains_model=False)  # another framework's producers: backend numpy
        run_dir = self._run_dir(cfg)
        self._run_lock = RunLock.acquire(run_dir)  # before anything in the run directory is written; close() frees it
        try:
            if self._reused_dir and self._resume is None and trained_nothing(run_dir):
                # A start that failed (or a loop stopped before its first step) trained nothing: no rerun is refused.
                log.info("run directory %s held a run that trained no step; its files are replaced (%s)", run_dir,
                         ", ".join(clear_untrained(run_dir)))
                self._reused_dir = False
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
        """Prepare, then start the producers and beside them bind, then stage (the ``with`` statement calls it)."""
        if self._closed:
            raise FeedError("this feed is closed; make a new stoker.Feed to train again")
        prepared = self._prepared_run()
        if self._started_once:
            return self
        self._started_once = True
        if self._reused_dir and self._resume is None:
            self._started_once = False
            self.close()
            raise FeedError(f"run.run_dir: {self.run_dir} holds a run; choose another run directory, or continue it "
                            f"with resume=feed.state_dict() (or a restored feed.trackable())")
        try:
            assert self.run_dir is not None
            self._producers = service.producers_before_bind(self.cfg, self._plan, self.run_dir)
            self._core = core = FeedCore(prepared, self._stop, state=self._resume)
            self.endpoint = core.endpoint
            if self._producers is not None:
                self._producers.connect([self.endpoint])
            self._staging = staging = make_staging(self.framework, self.cfg.devices, self._strategy, self._sharding)
            self.device = staging.device
            core.use_staging(staging)
            if self._producers is None:
                self._producers = service.start_producers(self.cfg, self._plan, self.endpoint, self.run_dir)
        except BaseException:
            self.close()
            raise
        return self

    def _run_dir(self, cfg: config_mod.Config) -> Path:
        """The run directory: a new one, or a stoker run directory to continue (its step logs
        go on; :meth:`start` refuses it unless the feed resumes, or its run trained no step)."""
        requested = service.job_run_dir(cfg.run.run_dir)  # each trainer worker's feed writes RUN_DIR/worker-N
        if requested:
            path = Path(requested).expanduser().resolve()
            if (path / CONFIG).is_file():
                self._reused_dir = True
                return path
        return service.make_run_dir(requested)

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
        if core.unconfirmed:  # else step_done() confirmed it
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
        return keras_callback(self.return_prefetched, self._confirm_steps)

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
        """The text front-end's vocabulary (shared/vocab.Vocabulary): ``.size`` token ids,
        ``.symbols`` (symbol ``i`` has id ``i``; empty for a user tokenizer), ``.pad_id``,
        ``.eos_id``, ``.decode(ids)`` and ``.encode(units)``, ``.speakers`` and ``.languages``."""
        return self._prepared_run().vocabulary

    @property
    def clips(self) -> ClipList:
        """Every clip of the run by position, the ``clip`` batch field's value for its row
        (consumer/pipeline/clips.py): ``feed.clips[p]`` (id, text, units, tokens, audio, speaker,
        language, duration_s, held_out), ``.position(id)``, ``.epoch(n)`` (the positions epoch n
        trains) and ``.validation``."""
        if self._clips is None:
            self._clips = ClipList(self._prepared_run())
        return self._clips

    @property
    def n_mels(self) -> int:
        return self.cfg.features.n_mels

    @property
    def element_spec(self) -> dict[str, Any]:
        """Each batch field's ``tf.TensorSpec``, per the batch schema: the dimensions that vary
        by bucket (B, L, T, S) None, F and R fixed. A ``tf.function`` with this
        ``input_signature`` traces once for every bucket."""
        self._tensorflow_only("element_spec", "tf.TensorSpec's")
        return element_spec(self._prepared_run().cfg)  # fixed rows resolved (replicas, workers)

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

    def stateful(self) -> DistributedState:
        """The state for ``torch.distributed.checkpoint`` (stoker/feed_dcp.py): ``dcp.save`` writes
        it, ``dcp.load`` restores it into a feed not yet started."""
        return DistributedState(self.state_dict, self.load_state_dict, lambda: self._started_once,
                                state_key(from_env(os.environ)))

    def trackable(self) -> Any:
        """The state for ``tf.train.Checkpoint(model=model, feed=feed.trackable())``; restored
        before the feed starts, the feed continues from its position."""
        self._tensorflow_only("trackable()", "a tf.train.Checkpoint object")
        return checkpoint_state(self.state_dict, self.load_state_dict)

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
            if self._core is not None and self._core.opened:
                close_core(self._core, exc, self._ended, self._taken_by, self._replicas)
        finally:
            if self._producers is not None:
                self._producers.close()  # they were told STOP
                self._producers = None
            atexit.unregister(self._at_exit)
            if self._run_lock is not None:
                self._run_lock.release()
                self._run_lock = None

    def _at_exit(self) -> None:
        if not self._closed:
            log.warning("a stoker.Feed was never closed; closing it at exit (use `with stoker.Feed(...) as feed:` "
                        "or call feed.close())")
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._started_once else "not started"
        return f"<stoker.Feed {state} run_dir={self.run_dir} step={self.step}>"


def close_core(core: FeedCore, exc: BaseException | None, ended: bool, taken_by: str | None,
               replicas: int | None) -> None:
    """Close a feed's open run: its exit reason (``exc``: what ended the user's loop; ``ended``:
    the loop took every batch), the step logs and summary.json; a file it could not write
    is raised unless the loop's own exception is on its way."""
    if isinstance(exc, KeyboardInterrupt):
        core.exit_reason, core.code = "interrupted", EXIT_INTERRUPTED
    elif exc is not None:
        core.exit_reason, core.code = f"failed: {type(exc).__name__}: {exc}"[:500], EXIT_FAILED
    elif not ended and not core.finished():
        core.exit_reason = f"stopped by the training loop at step {core.step}"
    if taken_by == "as_dataset()" and not core.step and core.handed_steps:
        log.warning("%d batches went out through as_dataset() and no step was confirmed: pass "
                    "callbacks=[feed.callback()] to fit, or call feed.step_done() after each step of your "
                    "loop; the feed's state counts confirmed steps only", core.handed_steps)
    # The user's loop trains: its model, and its replicas (a tf.distribute strategy), are not the
    # feed's to know.
    core.close({"trained_by": TRAINED_BY_FEED, "model": None, "replicas": replicas})
    failure = core.files.failure()  # a file of the run it could not write while closing (a full disk)
    if failure is not None and exc is None:
        raise failure


__all__ = ["Feed", "FeedError"]
