"""The Keras trainer's optimisation: ``trainer.optimizer`` (Adam, AdamW or the user's) with
global-norm clipping, its learning-rate schedule
(``lr_at``: a warm-up, then ``trainer.lr_decay``), and the update graph that applies or
accumulates a batch's gradients and skips a non-finite loss (:class:`Update`)."""

from __future__ import annotations

import math
from typing import Any

from .tts import ModelError, explain
from ...shared.config import TrainerConfig
from ...shared.userfn import import_function


class _FloatOps:
    """math-like functions on floats, for ``lr_at`` outside the graph."""

    minimum, maximum, cos, sqrt = staticmethod(min), staticmethod(max), staticmethod(math.cos), staticmethod(math.sqrt)
    mod = staticmethod(math.fmod)


def lr_at(step: Any, peak: float, warmup: int, total: int | None, decay: str, min_frac: float,
          ops: Any = _FloatOps, restart: int = 1) -> Any:
    """Learning rate at optimizer update ``step`` (0-based), with s = step + 1:

    - the warm-up: linear up to ``peak`` over ``warmup`` updates (none when 0), then
    - ``constant``: ``peak``;
    - ``cosine``: a half cosine from ``peak`` down to ``min_frac x peak`` at update ``total``
      (the run's budget; without one it stays at the peak);
    - ``cosine_restarts``: the same half cosine over cycles of ``restart`` updates, each
      starting again at the peak (SGDR);
    - ``noam``: ``peak x min(s / warmup, sqrt(warmup / s))``: the transformer's schedule
      (Vaswani et al.), scaled so that it peaks at ``peak`` at the end of the warm-up.

    ``ops``: minimum, maximum, cos, sqrt and mod for floats (default), or for tensors
    (``_TensorOps``).
    """
    s = step + 1.0
    if decay == "noam":
        w = float(max(warmup, 1))
        return peak * ops.minimum(s / w, ops.sqrt(w / s))
    warm = ops.minimum(1.0, s / max(warmup, 1)) if warmup else 1.0
    if decay == "cosine_restarts":
        progress = ops.mod(ops.maximum(0.0, s - warmup), float(restart)) / restart
    elif decay == "cosine" and total and total > warmup:
        progress = ops.minimum(1.0, ops.maximum(0.0, (s - warmup) / (total - warmup)))
    else:
        return peak * warm
    cosine = 0.5 * (1.0 + ops.cos(math.pi * progress))
    return peak * warm * (min_frac + (1.0 - min_frac) * cosine)


class _TensorOps:
    """math-like functions on tensors, for ``lr_at`` inside the graph."""

    def __init__(self, tf: Any) -> None:
        self.minimum, self.maximum, self.cos, self.sqrt = tf.minimum, tf.maximum, tf.cos, tf.sqrt
        self.mod = tf.math.floormod


def make_optimizer(keras: Any, tf: Any, t: TrainerConfig, updates: int | None) -> Any:
    """``trainer.optimizer`` on the warm-up-and-decay schedule over ``updates`` optimizer updates
    (None: unknown, the rate then stays at its peak); ModelError (one line) for a user's
    optimizer that fails or is none."""
    ops = _TensorOps(tf)

    class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step: Any) -> Any:
            return lr_at(tf.cast(step, tf.float32), t.learning_rate, t.warmup_steps, updates,
                         t.lr_decay, t.min_lr_frac, ops, t.restart_steps)

        def get_config(self) -> dict[str, Any]:
            return {}

    return _optimizer(keras, t, WarmupDecay())


def _optimizer(keras: Any, t: TrainerConfig, schedule: Any) -> Any:
    """trainer.optimizer: Adam, AdamW (decoupled weight decay) or the user's own."""
    clip = t.clip_norm or None
    if t.optimizer == "adam":
        return keras.optimizers.Adam(learning_rate=schedule, global_clipnorm=clip)
    if t.optimizer == "adamw":
        return keras.optimizers.AdamW(learning_rate=schedule, weight_decay=t.weight_decay, global_clipnorm=clip)
    builder = import_function(t.optimizer, "trainer.optimizer", ModelError)[0]
    try:
        optimizer = builder(learning_rate=schedule)
    except Exception as exc:  # the user's code: named with the contract, in one line
        raise ModelError(f"trainer.optimizer {t.optimizer}: {explain(exc, t.optimizer)}; it is called as "
                         f"fn(learning_rate=schedule) and returns a keras optimizer") from exc
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ModelError(f"trainer.optimizer {t.optimizer} returned {type(optimizer).__name__}, not a keras "
                         f"optimizer; it is called as fn(learning_rate=schedule)")
    if clip and getattr(optimizer, "global_clipnorm", None) is None:
        optimizer.global_clipnorm = clip  # trainer.clip_norm holds for the user's optimizer too
    return optimizer


class Update:
    """The update graph's body and state: apply (or, over ``accum`` batches, accumulate) one
    batch's gradients, skipping a batch whose loss is not finite, and count such batches.

    Its inputs have the variables' shapes whatever the bucket, so it is traced once: the
    optimizer's many small ops are traced and optimised one time, not per bucket. Made where
    the variables are (the strategy's scope with replicas)."""

    def __init__(self, tf: Any, optimizer: Any, variables: list[Any], accum: int) -> None:
        self.tf = tf
        self.optimizer = optimizer
        self.variables = variables
        self.accum = accum
        optimizer.build(variables)
        self._grad_sums = ([tf.Variable(tf.zeros_like(v), trainable=False, name="grad_sum") for v in variables]
                           if accum > 1 else [])
        self._frames_sum = tf.Variable(0.0, trainable=False, name="frames_sum")
        self._micro = tf.Variable(0, trainable=False, dtype=tf.int64, name="micro_step")
        self._bad_in_row = tf.Variable(0, trainable=False, dtype=tf.int64, name="bad_in_row")
        self._bad_total = tf.Variable(0, trainable=False, dtype=tf.int64, name="bad_total")

    def bad_steps(self) -> tuple[int, int]:
        """(non-finite batches in a row up to the last, non-finite batches in all)."""
        return int(self._bad_in_row.numpy()), int(self._bad_total.numpy())

    def __call__(self, numerator: Any, valid: Any, term_sums: Any, grads: list[Any]) -> Any:
        """Apply or accumulate ``grads`` (numerators over ``valid`` frames) unless the loss is not
        finite; [loss, each term's mean] of the batch."""
        tf = self.tf
        loss = numerator / tf.maximum(valid, 1.0)
        finite = tf.math.is_finite(loss)
        if self.accum == 1:
            tf.cond(finite, lambda: self._apply(grads, valid), self._skip)
        else:
            tf.cond(finite, lambda: self._accumulate(grads, valid), self._skip)
            self._micro.assign_add(1)
            tf.cond(self._micro >= self.accum, self._apply_accumulated, self._skip)
        bad = tf.cast(tf.logical_not(finite), tf.int64)
        self._bad_in_row.assign((self._bad_in_row + bad) * bad)
        self._bad_total.assign_add(bad)
        return tf.concat([loss[None], term_sums / tf.maximum(valid, 1.0)], axis=0)

    def _skip(self) -> Any:
        return self.tf.constant(False)

    def _apply(self, grads: list[Any], frames: Any) -> Any:
        denom = self.tf.maximum(frames, 1.0)
        self.optimizer.apply([g / denom for g in grads], self.variables)
        return self.tf.constant(True)

    def _accumulate(self, grads: list[Any], valid: Any) -> Any:
        for total, g in zip(self._grad_sums, grads):
            total.assign_add(g)
        self._frames_sum.assign_add(valid)
        return self.tf.constant(True)

    def _apply_accumulated(self) -> Any:
        self._apply([s.read_value() for s in self._grad_sums], self._frames_sum.read_value())
        for total in self._grad_sums:
            total.assign(self.tf.zeros_like(total))
        self._frames_sum.assign(0.0)
        self._micro.assign(0)
        return self.tf.constant(True)


__all__ = ["Update", "lr_at", "make_optimizer"]
