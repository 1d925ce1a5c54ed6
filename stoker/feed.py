"""``stoker.Feed``: stoker's batches in the user's own training loop.

::

    import stoker
    with stoker.Feed(data="~/LJSpeech-1.1", producers=4, batch_size=16, epochs=10,
                     run_dir="runs/mine") as feed:
        for batch in feed:                      # dict of tensors on the model device (framework=)
            loss = train_step(batch)            # the user's own step
            feed.step_done(loss=loss)           # optional: the step's loss for metrics.jsonl

The feed runs the trainer side of the pipeline (consumer/feed/feed.py) in the user's
process; the run service starts and supervises its producers. ``Feed`` is the user's face,
each job in a module of its own: the options (stoker/feed_options.py), the run from start to
stop and its state (stoker/feed_run.py), handing out batches and counting steps
(stoker/feed_handout.py), staging per framework (stoker/feed_staging.py) and TensorFlow's and
torch.distributed's checkpoint objects (stoker/feed_tf.py, stoker/feed_dcp.py). docs/FEED.md is
the user's guide, docs/design/feed.md the long story.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

from .consumer.feed.clips import ClipList
from .consumer.feed.feed import FeedCore
from .feed_dcp import DistributedState, state_key
from .feed_handout import HandOut
from .feed_options import OPTION_KEYS, feed_config
from .feed_run import FeedRun
from .feed_staging import FeedError, check_framework
from .feed_tf import checkpoint_state, element_spec, keras_callback
from .shared import config as config_mod
from .shared.cluster import from_env
from .shared.config import TENSORFLOW


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
        cfg = feed_config(config, set or {}, options, framework, strategy)
        self._run = FeedRun(cfg, check_framework(cfg.trainer.framework, strategy, sharding), strategy, sharding,
                            resume, self.close)
        self._handout = HandOut(self._run)  # the batches, from the first one asked for
        self._clips: ClipList | None = None  # feed.clips, made when first asked

    @property
    def cfg(self) -> config_mod.Config:
        """The feed's resolved config (its run directory set from prepare() on)."""
        return self._run.cfg

    @property
    def framework(self) -> str:
        return self._run.framework

    @property
    def device(self) -> str:
        """Where batches are staged, from start() on ("host" until then)."""
        return self._run.device

    @property
    def run_dir(self) -> Path | None:
        return self._run.run_dir

    @property
    def endpoint(self) -> str:
        return self._run.endpoint

    @property
    def _core(self) -> FeedCore | None:
        """The open run (consumer/feed/feed.py), from start() on."""
        return self._run.core

    @property
    def _closed(self) -> bool:
        """Whether close() ran (a wrapper of close, as the tests' user scripts are, asks)."""
        return self._run.closed

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
        self._run.prepare()
        return self

    def start(self) -> "Feed":
        """Prepare, then start the producers and beside them bind, then stage (the ``with`` statement calls it)."""
        self._run.start()
        return self

    # ------------------------------------------------------------ batches
    def __iter__(self) -> "Feed":
        return self

    def __next__(self) -> dict[str, Any]:
        """The next batch; asking for it confirms the last one's step (it was trained).
        StopIteration at the end of the plan, and again at every later call."""
        return self._handout.next()

    def epochs(self) -> Iterator[tuple[int, Iterator[dict[str, Any]]]]:
        """The plan epoch by epoch: ``for epoch, batches in feed.epochs(): for batch in batches:``.
        ``batches`` ends when every clip of that epoch was handed out (or rejected); batches
        of the next epoch that arrive first are held back for it. Asking for a batch confirms
        the last one's step, as in plain iteration."""
        return self._handout.epochs()

    def step_done(self, loss: Any = None, **terms: Any) -> None:
        """A training step ended: the oldest batch handed out and not yet confirmed was trained
        (when iterating, the last batch; through ``as_dataset()``, batches are handed out ahead
        of training, and each call confirms the oldest). ``loss`` (a number or a scalar tensor)
        and named ``terms`` go to metrics.jsonl, fetched from the device once per logging
        interval."""
        self._handout.step_done(loss, **terms)

    def callback(self) -> Any:
        """A Keras callback that confirms each training step of ``fit`` on :meth:`as_dataset`,
        so the feed's state (and metrics.jsonl) counts only what the model trained, whatever
        ``map``/``prefetch`` the dataset has: ``model.fit(feed.as_dataset(), epochs=E,
        callbacks=[feed.callback(), ...])``. Put it before callbacks that save
        ``feed.state_dict()``, so that their state counts the step that just ended."""
        self._tensorflow_only("callback()", "a Keras callback")
        return keras_callback(self.return_prefetched, self._handout.confirm_steps)

    def return_prefetched(self) -> int:
        """Batches handed out through ``as_dataset()`` and never confirmed go back to the feed,
        to be handed out again first: call it when the iterator that took them ahead is
        dropped before they were trained (a loop that stops iterating a dataset early and
        makes a new iterator). :meth:`callback` does it at the start of every ``fit``. The
        number of batches returned."""
        return self._handout.return_prefetched()

    @property
    def epoch(self) -> int | None:
        """The plan epoch of the batch being trained: the last one handed out when iterating;
        through ``as_dataset()`` the oldest not yet confirmed (None before the first batch)."""
        return self._handout.epoch()

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

        if self._run.strategy is not None:
            raise FeedError("as_dataset() of a feed made with strategy=: its batches are per-replica already; iterate "
                            "the feed, or make it without strategy= and give strategy.experimental_distribute_dataset"
                            "(feed.as_dataset())")
        return tf.data.Dataset.from_generator(self._handout.dataset_epoch, output_signature=self.element_spec)

    # ------------------------------------------------------------ validation
    def validation(self) -> Iterator[dict[str, Any]]:
        """One validation pass: the held-out clips (``trainer.val_clips`` of them, or the clips
        of ``data.eval_file``), each exactly once, in batches made by the producers as
        training batches are (same fields, bucket shapes, staging onto the model device).
        Call it as often as you like, between steps or after the loop; it is no training
        step (the step count, the input position and metrics.jsonl stay as they are). With
        no clip held out the pass is empty (logged). Leaving a pass before its end is fine."""
        return self._handout.validation()

    def validation_dataset(self) -> Any:
        """The validation passes as a ``tf.data.Dataset`` (element spec as :meth:`as_dataset`'s):
        each iteration over it is a new pass, so ``model.fit(..., validation_data=
        feed.validation_dataset())`` validates on every held-out clip at each epoch end."""
        self._tensorflow_only("validation_dataset()", "a tf.data.Dataset")
        import tensorflow as tf

        if self._run.strategy is not None:
            raise FeedError("validation_dataset() of a feed made with strategy=: its batches are per-replica "
                            "already; iterate feed.validation()")
        return tf.data.Dataset.from_generator(lambda: self.validation(), output_signature=self.element_spec)

    @property
    def validation_clips(self) -> list[str]:
        """The ids of the held-out clips (also in RUN_DIR/validation.json)."""
        return [s.id for s in self._run.prepare().val_samples]

    # ------------------------------------------------------------ progress and resume
    @property
    def step(self) -> int:
        core = self._run.core
        return core.step if core is not None else 0

    @property
    def batches_per_epoch(self) -> int:
        return self._run.prepare().planner.batches_per_epoch

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """The batch shapes (B, L, T) of the plan, the buckets' and the epoch's one short batch's
        (only its real rows, unless rows are fixed): every planned batch has one of them."""
        return self._run.prepare().planner.shapes

    @property
    def vocabulary(self) -> Any:
        """The text front-end's vocabulary (shared/vocab.Vocabulary): ``.size`` token ids,
        ``.symbols`` (symbol ``i`` has id ``i``; empty for a user tokenizer), ``.pad_id``,
        ``.eos_id``, ``.decode(ids)`` and ``.encode(units)``, ``.speakers`` and ``.languages``."""
        return self._run.prepare().vocabulary

    @property
    def clips(self) -> ClipList:
        """Every clip of the run by position, the ``clip`` batch field's value for its row
        (consumer/feed/clips.py): ``feed.clips[p]`` (id, text, units, tokens, audio, speaker,
        language, duration_s, held_out), ``.position(id)``, ``.epoch(n)`` (the positions epoch n
        trains) and ``.validation``."""
        if self._clips is None:
            self._clips = ClipList(self._run.prepare())
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
        return element_spec(self._run.prepare().cfg)  # fixed rows resolved (replicas, workers)

    def state_dict(self) -> dict[str, Any]:
        """Where the feed is in its plan (JSON-serialisable): which planned batches of which
        epochs were handed out, the step count, and the identity of the plan and dataset.
        Save it with the model; ``stoker.Feed(..., resume=state)`` goes on from there."""
        return self._run.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (before the feed starts)."""
        self._run.load_state_dict(state)

    def stateful(self) -> DistributedState:
        """The state for ``torch.distributed.checkpoint`` (stoker/feed_dcp.py): ``dcp.save`` writes
        it, ``dcp.load`` restores it into a feed not yet started."""
        return DistributedState(self.state_dict, self.load_state_dict, lambda: self._run.started_once,
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
        self._run.close(exc, self._handout.ended, self._handout.taken_by)

    def __repr__(self) -> str:
        run = self._run
        state = "closed" if run.closed else "running" if run.started_once else "not started"
        return f"<stoker.Feed {state} run_dir={run.run_dir} step={self.step}>"


__all__ = ["Feed", "FeedError", "OPTION_KEYS", "feed_config"]
