"""The wire protocol between producers and the consumer: the framing and the typed messages.

A message is a msgpack header frame and one raw frame per array; a receiver checks the framing
(:func:`decode`) and the fields (:func:`parse`) and raises :class:`ProtocolError` on anything
off. The kinds (``[field]``: optional; an Entry is ``{id: str, [reason: str]}``; a test
checks the table against the classes, whose docstrings say what each field means):

    HELLO      P->C  producer: str, host: str, pid: int, config: ConfigSchema, [launcher: int],
                     [session: str], [dataset: any]
    WELCOME    C->P  producer_index: int, producer_name: str, config: ProducerConfig, fields: str,
                     fixed_rows: bool, ref_frames: int, transform_versions: {str: str}, metadata_file: str,
                     feature_cache: str, heartbeat_interval_s: float, heartbeat_timeout_s: float,
                     [mel_norm: any], [token_pad: int]
    REFUSE     C->P  reason: str, [metadata_file: str], [columns: str], [rejoin: bool]
    LEASE      C->P  lease: int, epoch: int, index: int, ids: [str], shape: [int, int], rows: int,
                     tokens: [[int]], [speakers: [int]], [languages: [int]], [refs: [str]],
                     [texts: {str: str}], [files: {str: str}], [durations: [float]], [sizes: {str: int}],
                     [stamps: {str: [int, int]}], [positions: [int]]
    READY      P->C  lease: int
    CREDIT     C->P  lease: int
    REVOKE     C->P  lease: int
    BATCH      P->C  lease: int, epoch: int, index: int, ids: [str], [rejected: [Entry]], [missed: [Entry]],
                     [prep_ms: float], [mel_stats: any], [cache: {str: int}], [read_retries: int]
    HEARTBEAT  both  [ready: int], [working: int], [ping: float], [rtt_ms: float], [pong: float]
    ERROR      P->C  type: str, message: str, where: str, [traceback: str], [fatal: bool]
    BYE        P->C  [leases: [int]]
    STOP       C->P  reason: str

The framing, the checks, the joining and the versions: docs/design/protocol.md, "Protocol".
"""

from __future__ import annotations

import dataclasses
import math
import traceback
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence, TypeVar

import msgpack
import numpy as np

from .config import ConfigError, FaultsConfig, FeaturesConfig, TransformsConfig, section_from
from .wireparts import FieldError, Part

# 2: a LEASE carries the token ids of its clips (the trainer tokenizes; producers of version 1
# tokenized themselves, with a fixed a-z vocabulary, and must not join).
# 3: a LEASE carries its batch's rows (B): under a frame budget each bucket has its own.
# 4: typed messages: WELCOME carries the producer's config as one versioned map (``config``,
# ProducerConfig) and HELLO the producer's config schema (``config``, ConfigSchema), so that a
# producer of another version is refused at joining with a line, rather than failing on a key
# it does not know; BATCH's rejected and missed are [{id, reason}] (never pairs).
# 5: a producer on another host describes its dataset in HELLO by its metadata's SHA-256
# (shared/dataset/agreement.describe_copy: no scan, no list of missing files), and a LEASE to it
# carries each clip's expected audio byte size (``sizes``), checked when the file is read;
# WELCOME no longer carries the metadata's SHA-256 (the producer compares nothing).
# 6: a LEASE carries each clip's position in the run's clip list (``positions``), which the optional
# ``clip`` batch field holds: a producer of version 5 would not fill it.
# 7: WELCOME carries the id token rows are padded with (``token_pad``: a user tokenizer's own pad id),
# which a producer of version 6 would ignore, padding with 0.
PROTOCOL_VERSION = 7

# The config a producer takes from WELCOME (ProducerConfig: sections of shared/config.py, each
# a map of its keys). 1: features, transforms and faults. Raised when a key keeps its name but
# changes its meaning (a key added or removed shows in the schema's keys without it).
CONFIG_VERSION = 1

# A header carries ids of one batch and some counters: 1 MiB is far above any real
# header (a batch of 64 ids is ~2 KiB) and small enough that a hostile one costs nothing.
MAX_HEADER_BYTES = 1 << 20

# Room a BATCH message keeps beside its arrays, under pipeline.max_message_mb, for its header:
# its fixed fields and figures (lease, timings, cache counts), plus per row an id and, for a
# clip rejected, its reason (the coordinator keeps 300 characters), plus the mel statistics (two
# float64 per channel, 9 bytes each in msgpack). A real header is below this.
HEADER_FIXED_BYTES = 4 << 10
HEADER_ROW_BYTES = 384
HEADER_CHANNEL_BYTES = 18


def header_bytes(rows: int, n_mels: int) -> int:
    """The most a BATCH header of ``rows`` rows and ``n_mels`` mel channels takes."""
    return HEADER_FIXED_BYTES + HEADER_ROW_BYTES * rows + HEADER_CHANNEL_BYTES * n_mels


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


class OtherVersion(ProtocolError):
    """A message of another protocol version (reason ``bad_version``): its version, its kind
    when it names a known one (else None) and its other header fields, unchecked, so that a
    HELLO can be refused in its own version and a REFUSE of any version read."""

    def __init__(self, version: int, kind: str | None, fields: dict[str, Any]) -> None:
        super().__init__("bad_version", f"version {version}")
        self.version, self.kind, self.fields = version, kind, fields

    def reason_refused(self) -> str | None:
        """A REFUSE's reason (its layout is every version's), else None."""
        reason = self.fields.get("reason")
        return reason[:1000] if self.kind == REFUSE and type(reason) is str else None


@dataclass
class Message:
    """One decoded message before its fields are typed (:func:`parse`): kind, header fields, arrays."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def encode(kind: str, fields: Mapping[str, Any] | None = None,
           arrays: Mapping[str, np.ndarray] | None = None, version: int = PROTOCOL_VERSION) -> list[Any]:
    """Return the frames of one message (send them with ``send_multipart(copy=False)``); the
    typed messages' ``encode`` calls this. ``version``: only for a REFUSE to another version."""
    if kind not in KINDS:
        raise ValueError(f"unknown message kind {kind!r}")
    header: dict[str, Any] = {"v": version, "k": kind}
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
    """Parse and check one message's framing; raise :class:`ProtocolError` if anything is off
    (:class:`OtherVersion` for a well-formed header of another protocol version). Its fields
    are typed by :func:`parse`.

    Arrays are zero-copy, read-only views on the frames; copy them to keep them past
    the frames' lifetime if the frames are reused.

    This runs once per message in the coordinator process's loop, so it is written for
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
    kind = header.pop("k", None)
    if type(kind) is not str or kind not in KINDS:  # a list or map is unhashable
        kind = None
    if type(version) is int and version != PROTOCOL_VERSION:  # True == 1, but is a bool
        raise OtherVersion(version, kind, header)
    if type(version) is not int:
        raise ProtocolError("bad_version", f"version {version!r}"[:200])
    if kind is None:
        raise ProtocolError("bad_kind", "not a known kind")
    specs = header.pop("a", [])
    if type(specs) is not list or len(specs) > MAX_ARRAYS:
        raise ProtocolError("bad_header", "array list")
    if len(frames) != 1 + len(specs):
        raise ProtocolError("frame_count", f"{len(frames) - 1} frames for {len(specs)} arrays")
    return Message(kind=kind, fields=header, arrays=_arrays(frames, specs, total, max_bytes))


def _arrays(frames: Sequence[Any], specs: list[Any], total: int, max_bytes: int | None) -> dict[str, np.ndarray]:
    """The arrays the header's specs declare, as read-only views on frames 1..n, each checked
    against its frame's length; ``total``: the bytes counted so far against ``max_bytes``."""
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
    return arrays


_BodyT = TypeVar("_BodyT", bound="Body")


class Body(Part):
    """A message of one kind (``KIND``), sent by ``SENDER``."""

    KIND: ClassVar[str]
    SENDER: ClassVar[str]

    @classmethod
    def from_header(cls: type[_BodyT], fields: Any, where: str = "") -> _BodyT:
        """The message from its received header fields; ProtocolError ``bad_field`` (naming the
        field) or ``bad_config`` when they are not this kind's."""
        try:
            return super().from_header(fields, where)
        except FieldError as exc:
            raise ProtocolError("bad_field", exc.detail) from None

    def encode(self, arrays: Mapping[str, np.ndarray] | None = None, version: int = PROTOCOL_VERSION) -> list[Any]:
        """The message's frames (``version``: only a REFUSE is sent in another, see Refuse)."""
        if version != PROTOCOL_VERSION:
            raise ValueError(f"a {self.KIND} is sent in protocol version {PROTOCOL_VERSION} only")
        return encode(self.KIND, self.to_header(), arrays)


# --------------------------------------------------------------------------- the config a producer takes

def _section_keys(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True)
class ConfigSchema(Part):
    """A producer's config schema, in its HELLO: :data:`CONFIG_VERSION` and the keys of each
    section of :data:`CONFIG_SECTIONS` it takes (:meth:`local`: this install's)."""

    version: int
    sections: dict[str, tuple[str, ...]]

    @classmethod
    def local(cls) -> ConfigSchema:
        sections = typing.get_type_hints(ProducerConfig)
        return cls(CONFIG_VERSION, {name: _section_keys(sections[name]) for name in CONFIG_SECTIONS})

    def differs(self, theirs: ConfigSchema) -> str:
        """Why a producer of this schema cannot take the config of ``theirs`` (the trainer's):
        another version, or keys it lacks; "" when it can."""
        if self.version != theirs.version:
            return f"config version {self.version} here and {theirs.version} on the trainer"
        lacks = [f"{name}.{key}" for name, keys in theirs.sections.items() for key in keys
                 if key not in self.sections.get(name, ())]
        return f"it lacks the config keys {', '.join(lacks)}" if lacks else ""


@dataclass(frozen=True)
class ProducerConfig:
    """The config sections a producer runs with, as the trainer has them (WELCOME's
    ``config``): ``{"version": CONFIG_VERSION, section: {key: value}}``. A key this install
    lacks, or a value of the wrong type, is a ProtocolError (``bad_config``); a key the trainer
    does not send keeps this install's default."""

    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    transforms: TransformsConfig = field(default_factory=TransformsConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)

    def to_header(self) -> dict[str, Any]:
        sections = {name: dataclasses.asdict(getattr(self, name)) for name in CONFIG_SECTIONS}
        return {"version": CONFIG_VERSION, **sections}

    @classmethod
    def from_header(cls, value: Any, where: str = "config") -> ProducerConfig:
        if type(value) is not dict or type(value.get("version")) is not int:
            raise FieldError.of(where, value)
        if value["version"] != CONFIG_VERSION:
            raise ProtocolError("bad_config", f"config version {value['version']}, this producer's {CONFIG_VERSION}")
        sections = {}
        for name in CONFIG_SECTIONS:
            given = value.get(name, {})
            if type(given) is not dict:
                raise FieldError.of(f"{where}.{name}", given)
            try:
                sections[name] = section_from(name, given)
            except ConfigError as exc:
                raise ProtocolError("bad_config", str(exc)[:200]) from None
        return cls(**sections)


# Its sections, by name (those of shared/config.py's Config).
CONFIG_SECTIONS = tuple(f.name for f in dataclasses.fields(ProducerConfig))


# --------------------------------------------------------------------------- the messages

@dataclass(frozen=True)
class Entry(Part):
    """A clip of a BATCH that is not in it, and why."""

    id: str
    reason: str = ""


@dataclass(frozen=True)
class Hello(Body):
    """A producer joins. ``launcher``: its parent's pid; ``session``: one per connection (a
    repeated HELLO of a session only gets its WELCOME again); ``dataset``: agreement.describe_copy()
    or agreement.deferred(), checked by shared/dataset/agreement.check_agreement."""

    KIND: ClassVar[str] = HELLO
    SENDER: ClassVar[str] = "P->C"
    producer: str
    host: str
    pid: int
    config: ConfigSchema
    launcher: int | None = None
    session: str | None = None
    dataset: Any = None


@dataclass(frozen=True)
class Welcome(Body):
    """A producer is admitted: its index and (unique) name, the config it runs with, the
    optional batch fields (shared/batch.py) and whether batches keep the lease's rows, the
    user transforms' versions and the producer models' (keyed ``model:SPEC``: their source and
    weights; a producer running another refuses itself), the mel
    statistics it normalises with (transforms.mel_norm: dataset), the trainer's metadata file,
    the feature cache, the heartbeat settings and the id token rows are padded with (the
    vocabulary's pad id; absent: 0)."""

    KIND: ClassVar[str] = WELCOME
    SENDER: ClassVar[str] = "C->P"
    producer_index: int
    producer_name: str
    config: ProducerConfig
    fields: str
    fixed_rows: bool
    ref_frames: int
    transform_versions: dict[str, str]
    metadata_file: str
    feature_cache: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    mel_norm: Any = None
    token_pad: int = 0

    def problem(self) -> str:
        if self.token_pad < 0:
            return "token_pad must not be negative"
        if not (0 < self.heartbeat_interval_s and 0 < self.heartbeat_timeout_s):
            return "heartbeat settings must be positive"
        return "" if self.ref_frames > 0 else "ref_frames must be positive"


@dataclass(frozen=True)
class Refuse(Body):
    """A HELLO refused: the producer exits with status 2, unless ``metadata_file`` names the
    file (and ``columns`` the data.columns) to scan instead (it scans and says HELLO again) or
    ``rejoin`` is true (the trainer does not know this producer, e.g. after a restart: HELLO
    again). A producer of another protocol version is refused in its own (:meth:`encode`)."""

    KIND: ClassVar[str] = REFUSE
    SENDER: ClassVar[str] = "C->P"
    reason: str
    metadata_file: str | None = None
    columns: str | None = None
    rejoin: bool = False

    def encode(self, arrays: Mapping[str, np.ndarray] | None = None, version: int = PROTOCOL_VERSION) -> list[Any]:
        """``version``: another protocol version's producer is refused in its own, with only the
        ``reason``: the one layout every version reads."""
        if version != PROTOCOL_VERSION:
            return encode(self.KIND, {"reason": self.reason}, version=version)
        return super().encode(arrays)


@dataclass(frozen=True)
class Lease(Body):
    """A planned batch to prepare (BatchMaker.make's request): its clips, the bucket's shape
    (L tokens, T frames) and rows (B); per clip its token ids, speaker id and language id,
    with ref_mel its reference clip; the texts and audio locators of its clips and their
    references, {id: ...} (a producer reads no metadata of its own for them); per clip the
    duration the index holds, which the producer checks the audio against; and to a producer on
    another host the byte size of each clip's (and reference's) audio file on the trainer, {id:
    bytes} (agreement.file_sizes): a file of another size there is not the trainer's; to a producer
    on the trainer's host, each clip's audio file as the index listed it, {id: (bytes, mtime in
    ns)} (table.FILE_COLUMNS): a file changed or gone since is rejected when read
    (agreement.stamp_problem), never trained with the index's stale length; with the ``clip``
    batch field, per clip its position in the run's clip list (lease_tables.TokenTable)."""

    KIND: ClassVar[str] = LEASE
    SENDER: ClassVar[str] = "C->P"
    lease: int
    epoch: int
    index: int
    ids: tuple[str, ...]
    shape: tuple[int, int]
    rows: int
    tokens: tuple[tuple[int, ...], ...]
    speakers: tuple[int, ...] = ()
    languages: tuple[int, ...] = ()
    refs: tuple[str, ...] | None = None
    texts: dict[str, str] | None = None
    files: dict[str, str] | None = None
    durations: tuple[float, ...] | None = None
    sizes: dict[str, int] | None = None
    stamps: dict[str, tuple[int, int]] | None = None
    positions: tuple[int, ...] = ()

    def problem(self) -> str:
        if self.durations is not None and len(self.durations) != len(self.ids):
            return "durations not one per clip"
        if len(self.positions) > len(self.ids) or any(p < 0 for p in self.positions):
            return "positions not one per clip, or negative"
        if min(self.shape) < 0 or self.rows < 0:
            return f"shape {self.shape}, rows {self.rows}"
        if len(self.tokens) > len(self.ids) or (self.refs is not None and len(self.refs) > len(self.ids)):
            return "more token rows or references than clips"
        return ""


@dataclass(frozen=True)
class Ready(Body):
    """That lease's batch is prepared, waiting for a credit."""

    KIND: ClassVar[str] = READY
    SENDER: ClassVar[str] = "P->C"
    lease: int


@dataclass(frozen=True)
class Credit(Body):
    """A free queue slot: send that lease's batch now."""

    KIND: ClassVar[str] = CREDIT
    SENDER: ClassVar[str] = "C->P"
    lease: int


@dataclass(frozen=True)
class Revoke(Body):
    """Forget that lease: it was re-planned elsewhere."""

    KIND: ClassVar[str] = REVOKE
    SENDER: ClassVar[str] = "C->P"
    lease: int


@dataclass(frozen=True)
class Batch(Body):
    """A prepared batch, with its arrays (shared/batch.py): the clips delivered, those that
    cannot be used anywhere (``rejected``: unreadable) and those this host does not have
    (``missed``: re-planned elsewhere); the time it took, the mel statistics of its clips
    (shared/melstats.py), the feature cache's counts and the reads retried."""

    KIND: ClassVar[str] = BATCH
    SENDER: ClassVar[str] = "P->C"
    lease: int
    epoch: int
    index: int
    ids: tuple[str, ...]
    rejected: tuple[Entry, ...] = ()
    missed: tuple[Entry, ...] = ()
    prep_ms: float | None = None
    mel_stats: Any = None
    cache: dict[str, int] | None = None
    read_retries: int | None = None  # reads of tar shards retried while preparing it (shared/dataset/storage.py)

    def problem(self) -> str:
        if self.cache is not None and min(self.cache.values(), default=0) < 0:
            return "negative cache count"
        if self.read_retries is not None and self.read_retries < 0:
            return "negative read_retries"
        return ""


@dataclass(frozen=True)
class Heartbeat(Body):
    """P->C: its leases ready and in work, a ping (the sender's clock) and the last round trip
    it measured. C->P: the pong (the ping it answers), or nothing (the consumer's own beat)."""

    KIND: ClassVar[str] = HEARTBEAT
    SENDER: ClassVar[str] = "both"
    ready: int | None = None
    working: int | None = None
    ping: float | None = None
    rtt_ms: float | None = None
    pong: float | None = None


@dataclass(frozen=True)
class Error(Body):
    """An exception, as data (as PyTorch's ExceptionWrapper): ``fatal``, the producer ends."""

    KIND: ClassVar[str] = ERROR
    SENDER: ClassVar[str] = "P->C"
    type: str
    message: str
    where: str
    traceback: str | None = None
    fatal: bool = False

    @classmethod
    def of(cls, exc: BaseException, where: str, fatal: bool = False) -> Error:
        """An exception as plain data, to cross a process boundary."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(type(exc).__name__, str(exc), where, tb[-4000:], fatal)


@dataclass(frozen=True)
class Bye(Body):
    """Leaving; these leases go back to the plan."""

    KIND: ClassVar[str] = BYE
    SENDER: ClassVar[str] = "P->C"
    leases: tuple[int, ...] = ()


@dataclass(frozen=True)
class Stop(Body):
    """The run is over; producers answer BYE."""

    KIND: ClassVar[str] = STOP
    SENDER: ClassVar[str] = "C->P"
    reason: str


# The docstring's table wraps its lines at this width (the project's line length).
TABLE_WIDTH = 110

# Every kind's message class, in the order of the module docstring's table.
MESSAGES: dict[str, type[Body]] = {cls.KIND: cls for cls in (
    Hello, Welcome, Refuse, Lease, Ready, Credit, Revoke, Batch, Heartbeat, Error, Bye, Stop)}


def parse(msg: Message) -> Body:
    """The typed message of a decoded one; ProtocolError ``bad_field`` (or ``bad_config``) for
    a field missing, of the wrong type or out of range."""
    return MESSAGES[msg.kind].from_header(msg.fields)


def read(frames: Sequence[Any], max_bytes: int | None = None) -> tuple[Body, dict[str, np.ndarray]]:
    """:func:`decode` then :func:`parse`: the typed message and its arrays."""
    msg = decode(frames, max_bytes)
    return parse(msg), msg.arrays


def message_table() -> str:
    """The module docstring's table of kinds and fields, from the classes (wrapped as it is)."""
    lines = []
    for kind, cls in MESSAGES.items():
        pieces = cls.field_table().split(", ")
        line = f"    {kind.upper():<10} {cls.SENDER:<5} "
        for n, piece in enumerate(pieces):
            piece += "," if n < len(pieces) - 1 else ""
            if len(line) + len(piece) > TABLE_WIDTH and not line.endswith("  "):
                lines.append(line.rstrip())
                line = " " * 21
            line += piece + " "
        lines.append(line.rstrip())
    return "\n".join(lines)
