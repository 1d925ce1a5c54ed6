"""The protocol between the trainer process (consumer/feed/handoff.py) and the coordinator process
(consumer/coordinator/coordproc.py): the one module both import, so neither imports the other.

The trainer process writes DIR/start and spawns ``python -m`` :data:`COORDINATOR_MODULE` ``DIR PID``.
Messages to the trainer process are msgpack maps on a PUSH/PULL pair over ipc, each with its
``kind``: ``ready`` (endpoint), ``error`` (:func:`error_message`), ``batch`` (queue, slot, layout and
:data:`BATCH_FIELDS`), ``rejected`` (rows, epochs), ``state`` (alive, validation_finished, epochs and
at times snapshot), ``bye`` (snapshot, mel_stats). The trainer's messages in are bytes on the
coordinator's wake-up socket: ``take:SLOT``, ``release:SLOT``, ``validate:N``, ``cancel:N``, ``hello``,
``stop``. Batches travel in the slots of a shared file (consumer/slots.py); docs/DESIGN.md, "The
coordinator process", has the rules (slots, credits, shutdown).
"""

from __future__ import annotations

from typing import Any

from ..shared.errors import UserError

# The module the coordinator process runs (a process is started by module name, not imported).
COORDINATOR_MODULE = f"{__package__}.coordinator.coordproc"
# Files and sockets of DIR: the start file, the slots, the trainer's messages in, the coordinator's out.
START, SLOTS, DOWN, UP = "start", "slots", "down.ipc", "up.ipc"
# The start file's section of the trainer process's buckets' members, one bucket after another.
BUCKET_MEMBERS = "plan.members"
# Messages to the trainer process (their "kind").
READY, ERROR, BATCH, REJECTED, STATE, BYE = "ready", "error", "batch", "rejected", "state", "bye"
# A batch message's fields beside queue, slot and layout: a QueuedBatch's, the same names.
BATCH_FIELDS = ("lease", "epoch", "index", "ids", "clips", "whole", "producer", "frames", "frames_computed")
# The trainer process's messages in (a slot or a validation pass's number follows the colon).
TAKE, RELEASE, STOP, HELLO = b"take:", b"release:", b"stop", b"hello"
WAKE_VALIDATE, WAKE_CANCEL = b"validate:", b"cancel:"


class BindError(UserError):
    """The ROUTER socket cannot bind (address in use, bad endpoint)."""


def error_message(exc: BaseException, where: str) -> dict[str, Any]:
    """An error of the coordinator process as it crosses to the trainer process, which raises it as
    the same one line (a BindError as itself)."""
    return {"kind": ERROR, "type": type(exc).__name__, "message": str(exc), "where": where,
            "user_error": isinstance(exc, UserError)}
