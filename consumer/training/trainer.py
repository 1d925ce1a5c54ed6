"""Trainers the consumer can run: ``synthetic:MS`` and the Keras text-to-mel models.

The ``Trainer`` protocol is what the training loop (consumer/training/main.py) calls and
``ModelTrainer`` what a trainer with a model adds; ``synthetic:MS`` holds each step for MS ms
without the CPU or TensorFlow, and ``KerasTrainer`` trains a preset (consumer/training/tts.py)
or a user's model. The protocols and how the Keras step runs (graphs, replicas, precision,
accumulation, the non-finite guard): docs/design/training.md, "The trainer".
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from . import tts
from .optim import Update, make_optimizer
from .tts import ModelError
from ..feed.checkpoint import Checkpointed
from ..feed.frameworks import FunctionStaging, Staging
from ...shared.batch import IDENTIFYING, OPTIONAL, row_identities
from ...shared.config import Config, batch_schema
from ...shared.tfsetup import device_stager, replica_stager
from ...shared.userfn import find_module, import_function

log = logging.getLogger(__name__)

__all__ = ["ModelError", "Health", "Trainer", "ModelTrainer", "SyntheticTrainer", "KerasTrainer", "check_model",
           "uses_tensorflow", "make_trainer", "choose_precision", "choose_jit_compile"]


@dataclass(frozen=True)
class Health:
    bad_in_row: int  # consecutive steps with a non-finite loss, up to the last step
    bad_total: int  # steps skipped for a non-finite loss in the whole run


class Trainer(Checkpointed, Protocol):
    """What the training loop asks of every trainer (docs/design/training.md, "The trainer"), its checkpoints too."""

    name: str
    uses_tensorflow: bool
    received: list[list[dict[str, Any]]]

    def staging(self) -> Staging: ...

    def step(self, staged: Any) -> Any: ...

    def resolve(self, handles: Sequence[Any]) -> list[float | None]: ...

    def health(self) -> Health: ...

    def stats(self) -> dict[str, Any]: ...


@runtime_checkable
class ModelTrainer(Trainer, Protocol):
    """A trainer with a model, which the loop traces ahead, validates and draws in TensorBoard
    (docs/design/training.md, "The trainer"); ``isinstance(trainer, ModelTrainer)`` tells it from one without."""

    resolved_terms: list[dict[str, float]]
    evaluated_terms: dict[str, float]

    def prepare(self, shapes: Sequence[tuple[int, int, int]]) -> None: ...

    def stage_one(self, arrays: dict[str, np.ndarray]) -> Any: ...

    def evaluate(self, batches: Sequence[Any]) -> float | None: ...

    def predict(self, arrays: dict[str, Any]) -> dict[str, np.ndarray]: ...

    def learning_rate(self) -> float: ...

    def trackables(self) -> dict[str, Any]: ...


class SyntheticTrainer:
    """Holds every step for a fixed time without CPU use; with ``record``, notes the rows each
    step received (``received``)."""

    uses_tensorflow = False

    def __init__(self, step_ms: float, record: bool = False) -> None:
        self.step_ms = step_ms
        self.name = f"synthetic:{step_ms:g}"
        self.record = record
        self.received: list[list[dict[str, Any]]] = []

    def staging(self) -> Staging:
        """Host arrays: nothing to stage."""
        return Staging()

    def step(self, staged: dict[str, np.ndarray]) -> None:
        if self.record:
            self.received.append(row_identities(staged))
        # Sleeping is the point here: it is the stand-in for device time, not a synchronisation.
        time.sleep(self.step_ms / 1000.0)
        return None

    def resolve(self, handles: Sequence[Any]) -> list[float | None]:
        return [None] * len(handles)

    def health(self) -> Health:
        return Health(0, 0)

    def stats(self) -> dict[str, Any]:
        return {}

    def trackables(self) -> None:
        """Nothing: a checkpoint holds the step and the input position only."""
        return None


def choose_precision(setting: str, on_gpu: bool) -> str:
    """The Keras dtype policy: ``auto`` is mixed_float16 on a GPU, float32 on the CPU."""
    if setting == "auto":
        return "mixed_float16" if on_gpu else "float32"
    return setting


def choose_jit_compile(setting: bool | None, on_gpu: bool) -> bool:
    """XLA for the step: None (auto) compiles on a GPU only (on the CPU it rarely pays)."""
    return on_gpu if setting is None else setting


class KerasTrainer:
    """A Keras text-to-mel model and its training step (docs/design/training.md, "The trainer"); its optimizer, schedule
    and update graph are consumer/training/optim.py's."""

    uses_tensorflow = True

    def __init__(self, cfg: Config, device: str | Sequence[str], shapes: Sequence[tuple[int, int, int]] = (),
                 total_batches: int | None = None, optimizer: Any = None, *, vocab_size: int,
                 multi_worker: bool = False) -> None:
        """``device``: the model's device, or one per replica (a MirroredStrategy over them);
        ``multi_worker``: one of several trainer workers (TF_CONFIG): a
        MultiWorkerMirroredStrategy over every worker's replicas, this worker's on ``device``;
        ``shapes``: the plan's batch shapes (B, L, T); ``total_batches``: the run's budget
        in batches (None: unknown; the learning rate then stays at its peak after warm-up);
        ``optimizer``: a Keras optimizer to use instead of Adam, or a function making one
        (tests; with replicas it must be made in the strategy's scope); ``vocab_size``: token
        ids of the run's vocabulary (shared/vocab.Vocabulary.size)."""
        import keras
        import tensorflow as tf

        t = cfg.trainer
        self.tf = tf
        self.cfg = cfg
        self.name = t.model
        self.vocab_size = vocab_size
        self.schema = batch_schema(cfg)
        self.record = t.record_samples
        self.received: list[list[dict[str, Any]]] = []
        self._place(tf, device, multi_worker)
        on_gpu = "GPU" in self.device.upper()
        self.precision = choose_precision(t.precision, on_gpu)
        self.jit_compile = choose_jit_compile(t.jit_compile, on_gpu)
        if self.precision != "float32" and not on_gpu:
            log.warning("trainer.precision=%s on the CPU: mixed precision is slow there", self.precision)
        keras.mixed_precision.set_global_policy(self.precision)
        tf.random.set_seed(t.seed)
        keras.utils.set_random_seed(t.seed)
        self.accum = t.grad_accum
        self.bucket_shapes = len(shapes)
        self.loss_mode = t.loss
        self.loss_scaling = self.precision == "mixed_float16"
        self.total_updates = -(-total_batches // self.accum) if total_batches else None
        with self._placed():
            self._build(shapes[0] if shapes else (cfg.batching.batch_size, cfg.batching.tokens_multiple,
                                                  cfg.batching.frames_multiple))
            if optimizer is None:
                optimizer = make_optimizer(keras, tf, t, self.total_updates)
            elif not isinstance(optimizer, keras.optimizers.Optimizer):
                optimizer = optimizer()  # made here, in the strategy's scope where there are replicas
            self.optimizer = keras.optimizers.LossScaleOptimizer(optimizer) if self.loss_scaling else optimizer
            self._updater = Update(tf, self.optimizer, self.model.trainable_variables, self.accum)
        self._compile()
        log.info("model %s: %s trainable parameters; precision %s%s; XLA %s; gradient accumulation %d; "
                 "%d replica(s) on %s", t.model, f"{self.param_count:,}", self.precision,
                 " with loss scaling" if self.loss_scaling else "", "on" if self.jit_compile else "off", self.accum,
                 len(self.devices), ", ".join(self.devices))

    def _place(self, tf: Any, device: str | Sequence[str], multi_worker: bool) -> None:
        """The devices of the replicas and their strategy (None for one device)."""
        # Made first: TensorFlow requires the multi-worker strategy before any other op.
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy() if multi_worker else None
        self.devices = [device] if isinstance(device, str) else list(device)
        if self.strategy is not None:
            local = list(self.strategy.extended.worker_devices)
            if len(local) != len(self.devices):
                raise ModelError(f"this trainer worker has {len(local)} device(s) for the job's strategy "
                                 f"({', '.join(local)}), but {len(self.devices)} replicas were planned: on a host "
                                 f"without GPUs a worker of several trains one replica (leave --replicas out)")
            self.devices = local
        elif len(self.devices) > 1:
            self.strategy = tf.distribute.MirroredStrategy(self.devices)
        self.device = self.devices[0]  # validation and prediction run here

    def _build(self, shape: tuple[int, int, int]) -> None:
        """The model built and called once on a batch of ``shape`` (B, L, T) split over the
        replicas (which makes its variables), its outputs and its loss checked against the contract."""
        cfg, t = self.cfg, self.cfg.trainer
        n_mels = cfg.features.n_mels
        batch, tokens, frames = shape
        batch //= len(self.devices)  # a replica's batch
        self.model = tts.build(t.model, self.vocab_size, n_mels)
        dummy = tts.dummy_inputs(batch, tokens, frames, n_mels, -1.0, self.vocab_size, self.schema,
                                 cfg.features.hop_length, cfg.batching.ref_frames)
        result = self._first_call(dummy, (batch, tokens, frames, n_mels))
        tts.check_outputs(t.model, result, batch, frames, n_mels)
        self.user_loss = import_function(t.loss, "trainer.loss", ModelError)[0] if t.loss not in ("mel", "model") \
            else None
        self.term_names = self._check_loss(tts.outputs_of(result), dummy)
        self.validation_training = bool(getattr(self.model, "validation_training", False))
        self.param_count = tts.count_params(self.model)

    def _compile(self) -> None:
        """The stagers and the step's graphs: forward/backward (traced per bucket shape, on first
        use), the update (traced once, here) and validation's loss."""
        tf = self.tf
        self._stage_one = device_stager(tf, self.device)
        self._function = tf.function(self._grad_fn, jit_compile=self.jit_compile, reduce_retracing=False)
        if self.strategy is not None:
            self._stage = replica_stager(tf, self.strategy, self.devices)
            self._replica_grads = self._function  # per replica, inside strategy.run
            self._function = tf.function(self._replicated_fn, reduce_retracing=False)
        else:
            self._stage = self._stage_one
        with tf.device(self.device):
            self._update = tf.function(self._updater, jit_compile=self.jit_compile).get_concrete_function(
                tf.TensorSpec([], tf.float32), tf.TensorSpec([], tf.float32),
                tf.TensorSpec([len(self.term_names)], tf.float32),
                [tf.TensorSpec(v.shape, v.dtype) for v in self.model.trainable_variables])
        self._eval_function = tf.function(self._eval_fn, jit_compile=self.jit_compile, reduce_retracing=False)
        self._concrete: dict[tuple[Any, ...], Any] = {}
        self.resolved_terms: list[dict[str, float]] = []  # each resolved step's loss terms (resolve)
        self.evaluated_terms: dict[str, float] = {}  # the last validation's loss terms (evaluate)
        self.traces = 0  # incremented by the Python body of the step, i.e. once per trace
        self.retraces = 0  # traces of shapes beyond the plan's bucket shapes

    def _placed(self) -> Any:
        """Where variables are made: the strategy's scope (mirrored on every replica's device)
        or the one device. (The step runs outside the scope, under the first device: Keras'
        optimizer applies mirrored updates from there, by merge_call.)"""
        return self.strategy.scope() if self.strategy is not None else self.tf.device(self.device)

    def _first_call(self, dummy: dict[str, Any], dims: tuple[int, int, int, int]) -> Any:
        """The model called on a batch of the first bucket's shape (which builds its variables);
        ModelError (the user's one line) for a model that fails or reads a field the run lacks."""
        t = self.cfg.trainer
        batch, tokens, frames, n_mels = dims
        try:
            result = self.model(dummy, training=False)
        except ModelError:
            raise
        except KeyError as exc:  # Keras wraps the key in its own message: find the field's name in it
            said = re.sub(r"\x1b\[[0-9;]*m", "", str(exc.args[0]) if exc.args else "")  # no terminal colours
            wanted = [n for n in OPTIONAL if n not in self.schema.names and re.search(rf"\b{n}\b", said)]
            if wanted:
                switch = OPTIONAL[wanted[0]].length_of or wanted[0]  # a length field comes with its field
                switchable = [n for n, f in OPTIONAL.items() if not f.length_of]
                raise ModelError(f"--model {t.model} reads the batch field {wanted[0]!r}, which this run does "
                                 f"not switch on: --set batching.fields={switch} (optional fields: "
                                 f"{', '.join(switchable)})") from None
            raise ModelError(f"--model {t.model}: calling the model failed: KeyError: "
                             f"{str(exc).splitlines()[0]}; {tts.CONTRACT}") from exc
        except Exception as exc:  # the user's model code: its error, named with the contract
            raise ModelError(f"--model {t.model}: calling the model on a batch of B={batch}, "
                             f"L={tokens}, T={frames}, F={n_mels} failed: "
                             f"{tts.explain(exc, t.model, self.precision)}; {tts.CONTRACT}") from exc
        return result

    def _check_loss(self, out: dict[str, Any], batch: dict[str, Any]) -> list[str]:
        """The names of the loss terms, from the loss of the first batch; ModelError (one line)
        when trainer.loss cannot be computed from this model's outputs."""
        t = self.cfg.trainer
        tf = self.tf
        inputs = {k: tf.convert_to_tensor(v) for k, v in batch.items()}
        try:
            numerator, _, terms = tts.objective(tf, out, inputs, t.l2_weight, t.length_loss_weight, self.loss_mode,
                                                self.user_loss)
        except ModelError as exc:
            raise ModelError(f"--model {t.model}: {exc}") from None
        except Exception as exc:  # the user's loss function: its error, in one line
            raise ModelError(f"trainer.loss {t.loss}: computing the loss failed: "
                             f"{tts.explain(exc, t.loss, self.precision)}; the function is called as fn(batch, "
                             f"outputs) and returns a scalar or a dict of named scalars") from exc
        if not terms:
            raise ModelError(f"--model {t.model} returns no loss terms ('loss' or 'losses'), so trainer.loss=model "
                             f"has nothing to train on; {tts.CONTRACT}")
        if not bool(tf.math.is_finite(numerator)):
            log.warning("the loss of the first (dummy) batch is not finite: %s", float(numerator))
        return list(terms)

    # -- the step -------------------------------------------------------------------------

    def _objective(self, batch: dict[str, Any], training: bool) -> tuple[Any, Any, Any]:
        """(numerator, valid frames, each term's mean [len(term_names)]) of the model on ``batch``."""
        tf = self.tf
        t = self.cfg.trainer
        out = tts.outputs_of(self.model(batch, training=training))
        numerator, valid, terms = tts.objective(tf, out, batch, t.l2_weight, t.length_loss_weight, self.loss_mode,
                                                self.user_loss)
        means = tf.stack([terms[name] for name in self.term_names]) / tf.maximum(valid, 1.0)
        return numerator, valid, means

    def _loss_and_grads(self, batch: dict[str, Any]) -> tuple[Any, Any, list[Any], Any]:
        """(numerator, valid frames, gradients of the (scaled) numerator, the terms' means)."""
        tf = self.tf
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            numerator, valid, means = self._objective(batch, training=True)
            scaled = self.optimizer.scale_loss(numerator) if self.loss_scaling else numerator
        grads = tape.gradient(scaled, variables)
        grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, variables)]
        return numerator, valid, grads, means

    def _grad_fn(self, *arrays: Any) -> Any:
        """Forward and backward of one batch (its arrays in the schema's order): (loss
        numerator, valid frames, gradient numerators, each term's numerator). Traced once per
        bucket shape."""
        tf = self.tf
        self.traces += 1  # Python side effect: runs once per trace, never per step
        batch = dict(zip(self.schema.names, arrays))
        numerator, valid, grads, means = self._loss_and_grads(batch)
        return numerator, valid, grads, means * tf.maximum(valid, 1.0)

    def _replicated_fn(self, *arrays: Any) -> Any:
        """``_grad_fn`` on every replica's batch (per-replica values), summed over the replicas:
        the same four results for the global batch."""
        tf = self.tf
        numerator, valid, grads, sums = self.strategy.run(self._replica_grads, args=arrays)

        def total(value: Any) -> Any:
            return self.strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)

        return total(numerator), total(valid), [total(g) for g in grads], total(sums)

    def _eval_fn(self, *arrays: Any) -> Any:
        """The loss as training computes it, on the teacher-forced batch (the mel given as
        input): [numerator, valid frames, each term's numerator]. The model runs with
        training=False unless it sets ``validation_training = True``."""
        batch = dict(zip(self.schema.names, arrays))
        numerator, valid, means = self._objective(batch, training=self.validation_training)
        return self.tf.concat([self.tf.stack([numerator, valid]), means * self.tf.maximum(valid, 1.0)], axis=0)

    def _args(self, staged: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(staged[name] for name in self.schema.names)

    def _concrete_for(self, args: tuple[Any, ...]) -> Any:
        """The step's concrete function for this bucket shape, traced on first use (with
        replicas: the function, traced on its first call with per-replica values of a shape)."""
        key = tuple(tuple(a.values[0].shape if self.strategy is not None else a.shape) for a in args)
        fn = self._concrete.get(key)
        if fn is None:
            tf = self.tf
            started = time.monotonic()
            if self.strategy is not None:
                fn = self._function
            else:
                fn = self._function.get_concrete_function(*(tf.TensorSpec(a.shape, a.dtype) for a in args))
            self._concrete[key] = fn
            shape = (key[0][0], key[0][1], key[self.schema.names.index("mel")][1])
            if len(self._concrete) > max(self.bucket_shapes, 1):
                self.retraces += 1
                log.warning("traced the training step for shape B=%d L=%d T=%d, which is not one of the "
                            "plan's %d bucket shapes (%d traces so far)", *shape, self.bucket_shapes,
                            len(self._concrete))
            else:
                log.debug("traced the training step for bucket shape B=%d L=%d T=%d in %.1f s",
                          *shape, time.monotonic() - started)
        return fn

    def prepare(self, shapes: Sequence[tuple[int, int, int]]) -> None:
        """Trace and run the step's forward/backward once for each bucket shape (B, L, T), on a
        dummy batch and without updating anything, so no step after warm-up traces or
        waits for graph optimisation. Run while the producers fill the queue."""
        started = time.monotonic()
        cfg = self.cfg
        for rows, tokens, frames in shapes:
            dummy = tts.dummy_inputs(rows, tokens, frames, cfg.features.n_mels, -1.0, self.vocab_size, self.schema,
                                     cfg.features.hop_length, cfg.batching.ref_frames)
            args = self._args(self.stage(dummy))
            try:
                with self.tf.device(self.device):
                    self._concrete_for(args)(*args)[0].numpy()
            except Exception as exc:
                if tts.check_spec(self.name) != "user":
                    raise  # a preset failing is stoker's own fault: keep the traceback
                # The user's model, traced into the training step (gradients, XLA, precision).
                raise ModelError(f"--model {self.name}: the training step failed on a batch of B={rows}, "
                                 f"L={tokens}, T={frames}: "
                                 f"{tts.explain(exc, self.name, self.precision, self.jit_compile)}") from exc
        log.info("training step traced for %d bucket shape(s) in %.1f s", len(shapes), time.monotonic() - started)

    def stage(self, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        """A planned batch onto the device (with replicas: split, one part per replica)."""
        return self._stage(arrays)

    def staging(self) -> Staging:
        """How the feed stages this trainer's batches (as a ``stoker.Feed``'s TensorFlow ones):
        :meth:`stage` in the queue's stager thread, so every batch reaches :meth:`step` staged."""
        return FunctionStaging(self._stage, ", ".join(self.devices))

    def stage_one(self, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        """A batch, whole, onto the first device: for validation and prediction."""
        return self._stage_one(arrays)

    def step(self, staged: dict[str, Any]) -> Any:
        """One step on a staged batch (:meth:`staging`); its handle is [loss, each term's mean]
        on the device, not yet fetched."""
        if self.record:
            self.received.append(row_identities(self._on_host(staged)))
        args = self._args(staged)
        with self.tf.device(self.device):
            numerator, valid, grads, term_sums = self._concrete_for(args)(*args)
            return self._update(numerator, valid, term_sums, grads)

    def _on_host(self, staged: dict[str, Any]) -> dict[str, np.ndarray]:
        """The staged batch's identifying fields back on the host, the replicas' parts joined."""
        if self.strategy is None:
            return {name: np.asarray(staged[name]) for name in IDENTIFYING}
        return {name: np.concatenate([np.asarray(part) for part in staged[name].values]) for name in IDENTIFYING}

    def resolve(self, handles: Sequence[Any]) -> list[float | None]:
        """The steps' losses (one fetch for all); their terms go to ``resolved_terms``."""
        if not handles:
            self.resolved_terms = []
            return []
        values = self.tf.stack(list(handles)).numpy()
        self.resolved_terms = [dict(zip(self.term_names, (float(v) for v in row[1:]))) for row in values]
        return [float(row[0]) for row in values]

    def health(self) -> Health:
        return Health(*self._updater.bad_steps())

    def learning_rate(self) -> float:
        lr = self.optimizer.learning_rate
        return float(lr.numpy() if hasattr(lr, "numpy") else lr)

    @property
    def updates(self) -> int:
        return int(self.optimizer.iterations.numpy())

    def evaluate(self, batches: Sequence[dict[str, Any]]) -> float | None:
        """The loss over ``batches`` (all valid frames together), computed as training computes
        it; its terms go to ``evaluated_terms``. None without batches."""
        if not batches:
            return None
        tf = self.tf
        with tf.device(self.device):
            totals = tf.add_n([self._eval_function(*self._args(b)) for b in batches]).numpy()
        frames = max(float(totals[1]), 1.0)
        self.evaluated_terms = {name: float(v) / frames for name, v in zip(self.term_names, totals[2:])}
        return float(totals[0] / frames)

    def predict(self, arrays: dict[str, Any]) -> dict[str, np.ndarray]:
        """The model's array outputs on one batch, as float32 numpy (for images and synthesis;
        its loss terms are left out)."""
        with self.tf.device(self.device):
            out = tts.outputs_of(self.model(arrays, training=self.validation_training))
        return {k: np.asarray(self.tf.cast(v, self.tf.float32)) for k, v in out.items()
                if k not in ("loss", "losses") and hasattr(v, "shape")}

    def trackables(self) -> dict[str, Any]:
        """What a checkpoint must hold to continue training exactly."""
        return {**tts.restorable(self.model), "optimizer": self.optimizer}

    def stats(self) -> dict[str, Any]:
        return {"params": self.param_count, "precision": self.precision, "jit_compile": self.jit_compile,
                "replicas": len(self.devices), "devices": self.devices,
                "grad_accum": self.accum, "traces": len(self._concrete), "bucket_shapes": self.bucket_shapes,
                "retraces": self.retraces, "optimizer_updates": self.updates}


def check_model(spec: str) -> float | None:
    """Validate --model without importing TensorFlow; return MS for synthetic:MS, else None."""
    kind = tts.check_spec(spec)
    if kind == "synthetic":
        try:
            ms = float(spec.split(":", 1)[1])
        except ValueError:
            ms = -1.0
        if not ms >= 0:
            raise ModelError(f"--model {spec}: expected synthetic:MS with MS >= 0 milliseconds")
        return ms
    if kind == "user":
        module = spec.partition(":")[0]
        try:  # where the children will find it: on PYTHONPATH, then in the current directory
            found = find_module(module)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise ModelError(f"--model {spec}: no module named {module} (is its directory on PYTHONPATH?)")
    return None


def uses_tensorflow(spec: str) -> bool:
    return check_model(spec) is None


def make_trainer(cfg: Config, device: str | Sequence[str], shapes: Sequence[tuple[int, int, int]],
                 total_batches: int | None, vocab_size: int, multi_worker: bool = False) -> Trainer:
    ms = check_model(cfg.trainer.model)
    if ms is not None:
        return SyntheticTrainer(ms, record=cfg.trainer.record_samples)
    return KerasTrainer(cfg, device, shapes, total_batches, vocab_size=vocab_size, multi_worker=multi_worker)
