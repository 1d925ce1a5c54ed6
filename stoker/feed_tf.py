"""The TensorFlow side of a ``stoker.Feed``: the Keras callback that confirms ``fit``'s
steps, the feed's state as a ``tf.train.Checkpoint`` object, and the batches' element
spec. docs/FEED.md, Keras, is the user's side.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable

from .shared.config import Config, batch_schema


def keras_callback(return_prefetched: Callable[[], int], confirm_steps: Callable[[int], None]) -> Any:
    """A Keras callback that confirms each training step of ``fit`` (``confirm_steps``) and,
    at the start of every ``fit``, returns what an earlier iterator took ahead (``return_prefetched``)."""
    import keras

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
            return_prefetched()

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._seen = 0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            # ``batch`` is the index of the last step run (several under steps_per_execution); run
            # in Keras' threads, a later batch's hook can come first and count the steps before it.
            with self._lock:
                steps, self._seen = max(0, batch + 1 - self._seen), max(self._seen, batch + 1)
            if steps:
                confirm_steps(steps)

    return FeedCallback()


def checkpoint_state(state_dict: Callable[[], dict[str, Any]],
                     load_state_dict: Callable[[dict[str, Any]], None]) -> Any:
    """The feed's state (``state_dict`` saved, ``load_state_dict`` restored) as a
    ``tf.train.Checkpoint``-trackable object."""
    import tensorflow as tf

    class FeedState(tf.train.experimental.PythonState):
        def serialize(self) -> str:
            return json.dumps(state_dict())

        def deserialize(self, string_value: Any) -> None:
            text = string_value.decode() if isinstance(string_value, bytes) else str(string_value)
            load_state_dict(json.loads(text))

    return FeedState()


def element_spec(cfg: Config) -> dict[str, Any]:
    """Each batch field's ``tf.TensorSpec``, per the batch schema of ``cfg`` (fixed rows
    resolved): the dimensions that vary by bucket (B, L, T, S) None, F and R fixed."""
    import tensorflow as tf

    fixed = {"F": cfg.features.n_mels, "R": cfg.batching.ref_frames}  # the same in every bucket
    return {f.name: tf.TensorSpec([fixed.get(dim) for dim in f.dims], tf.as_dtype(f.dtype), name=f.name)
            for f in batch_schema(cfg).fields}
