"""The wire protocol between producers and the consumer.

One message is a list of ZeroMQ frames, as in pyzmq's ``examples/serialization``:

    frame 0      msgpack map, the header: {"v": PROTOCOL_VERSION, "k": kind, "a": arrays, ...fields}
    frame 1..n   one raw buffer per array, C order, in the order of "a"

``"a"`` is a list of ``[name, dtype, shape]`` triples. A receiver trusts nothing: the
header must be a msgpack map within :data:`MAX_HEADER_BYTES`, name this protocol
version and a known kind, list only allowed dtypes, and every array's declared size
must equal its frame's length. Anything else raises :class:`ProtocolError` with a
short reason that the consumer counts (``rejected_messages`` in summary.json) before
dropping the message. Nothing is ever unpickled.

Message kinds and their fields (P = producer, C = consumer):

    HELLO      P->C  producer, host, pid, launcher (parent pid), session (one per connection; a repeated
                     HELLO of a session only gets its WELCOME again), dataset (DatasetScan.describe())
    WELCOME    C->P  producer_index, producer_name, features (dict), fields (the optional
                     batch fields, shared/batch.py), ref_frames, transforms (dict) and transform_versions
                     (the user transforms' versions: a producer running another refuses itself),
                     metadata_file, heartbeat_interval_s, heartbeat_timeout_s
    REFUSE     C->P  reason [, metadata_file, columns] [, rejoin]
                     hello refused: the producer exits with status 2, unless metadata_file names
                     the file (and columns the data.columns) to scan instead (it scans and says
                     HELLO again) or rejoin is true
                     (the consumer does not know this producer, e.g. after a restart: HELLO again)
    LEASE      C->P  lease, epoch, index, ids, shape (L, T), rows (B), tokens, speakers, languages[, refs]
                     [, texts, files]
                     (a planned batch to prepare; per clip: its token ids, speaker id, language id and,
                     with ref_mel, its reference clip; a validation pass's (epoch -N): each clip's text
                     and audio file, {id: ...}, for clips of data.eval_file, which no producer indexes)
    READY      P->C  lease                            (that batch is prepared, waiting for a credit)
    CREDIT     C->P  lease                            (a free queue slot: send that batch now)
    REVOKE     C->P  lease                            (forget that lease: it was re-planned elsewhere)
    BATCH      P->C  lease, ids, rejected, missed, prep_ms + arrays (see shared/batch.py)
                     rejected: [{id, reason}] clips that cannot be used anywhere (unreadable);
                     missed:   [{id, reason}] clips this host does not have (re-planned elsewhere)
    HEARTBEAT  both  P->C: ready, working, ping (sender's clock), rtt_ms (last round trip)
                     C->P: pong (the ping it answers) or nothing (the consumer's own beat)
    ERROR      P->C  type, message, where [, fatal]   (an exception, as data)
    BYE        P->C  leases                           (leaving; these leases go back to the plan)
    STOP       C->P  reason                           (the run is over; producers answer BYE)
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import msgpack
import numpy as np

# 2: a LEASE carries the token ids of its clips (the trainer tokenizes; producers of version 1
# tokenized themselves, with a fixed a-z vocabulary, and must not join).
# 3: a LEASE carries its batch's rows (B): under a frame budget each bucket has its own.
PROTOCOL_VERSION = 3

# A header carries ids of one batch and some counters: 1 MiB is far above any real
# header (a batch of 64 ids is ~2 KiB) and small enough that a hostile one costs nothing.
MAX_HEADER_BYTES = 1 << 20

# At most this many arrays per message: a batch has four; the bound stops a header
# from making the receiver build thousands of views.
MAX_ARRAYS = 16

# pyzmq copies frames smaller than this even with copy=False (zmq.COPY_THRESHOLD), so
# sending everything with copy=False gives "zero-copy above ~64 KiB" for free.
ZERO_COPY_BYTES = 65536

# A heartbeat's round trip longer than this is a pong from an earlier connection, not a
# round trip: both sides drop it (the producer measures, the trainer keeps its report).
MAX_RTT_S = 60.0

HELLO = "hello"
WELCOME = "welcome"
REFUSE = "refuse"
LEASE = "lease"
READY = "ready"
CREDIT = "credit"
REVOKE = "revoke"
BATCH = "batch"
HEARTBEAT = "heartbeat"
ERROR = "error"
BYE = "bye"
STOP = "stop"
KINDS = frozenset({HELLO, WELCOME, REFUSE, LEASE, READY, CREDIT, REVOKE, BATCH, HEARTBEAT, ERROR, BYE, STOP})

# Only plain numeric dtypes cross the wire: object or structured dtypes could smuggle
# pointers or pickles, and these cover every tensor a batch holds.
ALLOWED_DTYPES = frozenset({
    "bool", "uint8", "int8", "int16", "uint16", "int32", "int64",
    "float16", "float32", "float64",
})

_RESERVED = ("v", "k", "a")

# dtype -> name and name -> dtype, looked up per array: ``np.dtype(name)`` and
# ``dtype.name`` cost about 5 us each, a fifth of encoding a small batch.
_DTYPE_BY_NAME = {name: np.dtype(name) for name in ALLOWED_DTYPES}
_NAME_BY_DTYPE = {dtype: name for name, dtype in _DTYPE_BY_NAME.items()}

# Frames below this size are copied into ZeroMQ's buffer rather than sent zero-copy, even
# with ``copy=False`` (set as the socket's ``copy_threshold`` by senders of batches).
# Zero-copy hands the buffer's lifetime to pyzmq's garbage-collector thread, which costs
# ~40 us per frame whatever its size; a memcpy costs ~0.1 ms per MiB. Measured on a
# loopback PAIR (2 cores): 64 KiB 51 us zero-copy vs 20 us copied, 256 KiB 43 vs 31,
# 1 MiB 45 vs 116. pyzmq's own default (zmq.COPY_THRESHOLD) is 64 KiB.
COPY_THRESHOLD_BYTES = 512 << 10


class ProtocolError(ValueError):
    """A message that does not follow the protocol. ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class Message:
    kind: str
    fields: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


def encode(kind: str, fields: Mapping[str, Any] | None = None,
           arrays: Mapping[str, np.ndarray] | None = None) -> list[Any]:
    """Return the frames of one message (send them with ``send_multipart(copy=False)``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown message kind {kind!r}")
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "k": kind}
    for key, value in (fields or {}).items():
        if key in _RESERVED:
            raise ValueError(f"field name {key!r} is reserved")
        header[key] = value
    frames: list[Any] = []
    specs = []
    for name, array in (arrays or {}).items():
        if type(array) is not np.ndarray or not array.flags.c_contiguous:  # the usual case skips this
            array = np.asarray(array)
            array = np.ascontiguousarray(array).reshape(array.shape)  # ascontiguousarray makes 0-d 1-d
        if not array.dtype.isnative:  # the header names no byte order: send native order
            array = array.astype(array.dtype.newbyteorder("="))
        dtype_name = _NAME_BY_DTYPE.get(array.dtype)
        if dtype_name is None:
            raise ValueError(f"array {name!r} has dtype {array.dtype}, not allowed on the wire")
        specs.append([name, dtype_name, list(array.shape)])
        frames.append(array)
    header["a"] = specs
    return [msgpack.packb(header, use_bin_type=True), *frames]


def _buffer(frame: Any) -> memoryview:
    """A read-only view on a frame's bytes, whether zmq.Frame, bytes or memoryview."""
    return memoryview(getattr(frame, "buffer", frame)).toreadonly()


def _shape_ok(shape: Any) -> bool:
    """A list of non-negative ints (``type is int``: msgpack booleans are not dimensions)."""
    if type(shape) is not list:
        return False
    for d in shape:
        if type(d) is not int or d < 0:
            return False
    return True


def decode(frames: Sequence[Any], max_bytes: int | None = None) -> Message:
    """Parse and check one message; raise :class:`ProtocolError` if anything is off.

    Arrays are zero-copy, read-only views on the frames; copy them to keep them past
    the frames' lifetime if the frames are reused.

    This runs once per message on the consumer's receive thread, so it is written for
    speed (about 12 us in-process for a 64 KiB batch with 16 ids): exact ``type() is`` checks
    (msgpack only builds plain types), one pass over the array specs, and read-only
    views made by ``np.frombuffer`` on a read-only memoryview rather than by setting
    flags afterwards.
    """
    if not frames:
        raise ProtocolError("empty", "no frames")
    head = _buffer(frames[0])
    total = head.nbytes
    if total > MAX_HEADER_BYTES:
        raise ProtocolError("oversized", f"header of {total} bytes")
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types for garbage; all mean the same
        raise ProtocolError("not_msgpack", type(exc).__name__) from None
    if type(header) is not dict:
        raise ProtocolError("bad_header", "header is not a map")
    version = header.pop("v", None)
    if type(version) is not int or version != PROTOCOL_VERSION:  # True == 1, but is a bool
        raise ProtocolError("bad_version", f"version {version!r}")
    kind = header.pop("k", None)
    if type(kind) is not str or kind not in KINDS:  # a list or map is unhashable
        raise ProtocolError("bad_kind", f"kind {kind!r}")
    specs = header.pop("a", [])
    if type(specs) is not list or len(specs) > MAX_ARRAYS:
        raise ProtocolError("bad_header", "array list")
    if len(frames) != 1 + len(specs):
        raise ProtocolError("frame_count", f"{len(frames) - 1} frames for {len(specs)} arrays")
    arrays: dict[str, np.ndarray] = {}
    for i, spec in enumerate(specs, 1):
        if type(spec) is not list or len(spec) != 3:
            raise ProtocolError("bad_array", f"spec {spec!r}"[:200])
        name, dtype_name, shape = spec
        dtype = _DTYPE_BY_NAME.get(dtype_name) if type(dtype_name) is str else None
        if type(name) is not str or dtype is None or not _shape_ok(shape):
            raise ProtocolError("bad_array", f"spec {spec!r}"[:200])
        if name in arrays:
            raise ProtocolError("bad_array", f"duplicate array {name!r}")
        expected = math.prod(shape) * dtype.itemsize
        buf = _buffer(frames[i])
        if buf.nbytes != expected:
            raise ProtocolError("size_mismatch", f"{name}: {buf.nbytes} bytes, declared {expected}")
        total += expected
        if max_bytes is not None and total > max_bytes:
            raise ProtocolError("oversized", f"{total} bytes")
        try:
            arrays[name] = np.frombuffer(buf, dtype=dtype).reshape(shape)
        except ValueError:  # too many dimensions, or a dimension numpy cannot index (0-size)
            raise ProtocolError("bad_array", f"{name}: shape {shape}"[:200]) from None
    return Message(kind=kind, fields=header, arrays=arrays)


def require(msg: Message, **types_: type | tuple[type, ...]) -> None:
    """Check that ``msg`` has each named field with the given type(s)."""
    for key, expected in types_.items():
        value = msg.fields.get(key)
        allowed = expected if isinstance(expected, tuple) else (expected,)
        if not isinstance(value, expected) or isinstance(value, bool) and bool not in allowed:
            raise ProtocolError("bad_field", f"{msg.kind}.{key} = {value!r}"[:200])


def error_fields(exc: BaseException, where: str) -> dict[str, str]:
    """An exception as plain data, to cross a process boundary (as PyTorch's ExceptionWrapper)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"type": type(exc).__name__, "message": str(exc), "where": where, "traceback": tb[-4000:]}
