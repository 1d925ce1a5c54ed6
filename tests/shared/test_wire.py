"""Tests for shared/wire.py: framing, checks on untrusted input, zero-copy decode."""

from __future__ import annotations

import dataclasses
import random

import msgpack
import numpy as np
import pytest
import zmq

from stoker.shared import wire
from stoker.shared.config import FaultsConfig, FeaturesConfig, TransformsConfig
from stoker.shared.wire import ALLOWED_DTYPES, KINDS, MAX_ARRAYS, MAX_HEADER_BYTES, PROTOCOL_VERSION, ProtocolError
from tests.factories import make_batch

pytestmark = pytest.mark.timeout(60)

RECV_TIMEOUT_MS = 5000
FUZZ_SEED = 20240611
FUZZ_RANDOM = 2000
FUZZ_MUTATIONS = 3000


def _header(**header) -> bytes:
    base = {"v": PROTOCOL_VERSION, "k": wire.BATCH, "a": []}
    base.update(header)
    return msgpack.packb(base, use_bin_type=True)


def _reason(frames) -> str:
    with pytest.raises(ProtocolError) as info:
        wire.decode(frames)
    return info.value.reason


# --------------------------------------------------------------------------- round trips

# Every kind with every field set (no default), nested parts and sequences included.
EXAMPLES: dict[str, wire.Body] = {m.KIND: m for m in (
    wire.Hello("p0", "h", 123, wire.ConfigSchema.local(), launcher=7, session="s1",
               dataset={"metadata_file": "metadata.csv", "metadata": "ab", "audio": "cd", "entries": 2,
                        "missing": ["x"], "missing_count": 1}),
    wire.Welcome(1, "p0#2", wire.ProducerConfig(FeaturesConfig(n_mels=8, backend="numpy"),
                                                TransformsConfig(trim_db=30.0), FaultsConfig(producer_delay_ms=5.0)),
                 "speaker_id,row_mask", True, 64, {"pkg.mod:fn": "sha256:ab"}, "metadata.csv",
                 "/cache", 1.0, 5.0, mel_norm={"mean": [0.5], "std": [2.0]}),
    wire.Refuse("reads train.csv", metadata_file="train.csv", columns="id|text", rejoin=True),
    wire.Lease(7, -1, 3, ("a", "b"), (16, 64), 4, ((5, 6, 1), (7, 1)), (3, 1), (0, 2), refs=("b", "a"),
               texts={"a": "one", "b": "two"}, files={"a": "wavs/a.wav", "b": "wavs/b.wav"}, positions=(12, 0)),
    wire.Ready(7),
    wire.Credit(7),
    wire.Revoke(7),
    wire.Batch(7, 0, 3, ("a", "b"), (wire.Entry("c", "unreadable"),), (wire.Entry("d", "not on host h"),), 12.5,
               {"count": 2, "sum": [1.0], "sq": [2.0]}, {"hits": 1, "computed": 1}),
    wire.Heartbeat(ready=2, working=1, ping=12.25, rtt_ms=0.5, pong=3.0),
    wire.Error("ValueError", "boom", "worker", "Traceback ...", fatal=True),
    wire.Bye((1, 2, 3)),
    wire.Stop("done"),
)}


def test_every_kind_is_covered() -> None:
    assert set(EXAMPLES) == set(wire.MESSAGES) == KINDS
    for kind, cls in wire.MESSAGES.items():
        assert cls.KIND == kind and type(EXAMPLES[kind]) is cls


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_round_trip_every_kind(kind: str) -> None:
    msg = EXAMPLES[kind]
    arrays = make_batch(batch_size=3, valid=2, seed=5) if kind == wire.BATCH else {}
    frames = msg.encode(arrays)
    assert len(frames) == 1 + len(arrays)
    got, got_arrays = wire.read(frames)
    assert got == msg and type(got) is type(msg)
    assert set(got_arrays) == set(arrays)
    for name, array in arrays.items():
        assert got_arrays[name].dtype == array.dtype
        np.testing.assert_array_equal(got_arrays[name], array)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_message_of_only_its_required_fields_round_trips_and_leaves_the_rest_out(kind: str) -> None:
    cls = wire.MESSAGES[kind]
    full = EXAMPLES[kind]
    required = {f.name: getattr(full, f.name) for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    msg = cls(**required)
    header = msgpack.unpackb(msg.encode()[0], raw=False)
    assert set(header) - {"v", "k", "a"} <= {f.name for f in dataclasses.fields(cls)}
    assert all(value is not None for value in header.values())
    assert wire.read(msg.encode())[0] == msg


def test_the_header_is_the_fields_by_name() -> None:
    """The layout a producer of this version reads: plain msgpack values, [{id, reason}] entries."""
    header = msgpack.unpackb(EXAMPLES[wire.BATCH].encode()[0], raw=False)
    assert header == {"v": PROTOCOL_VERSION, "k": "batch", "a": [], "lease": 7, "epoch": 0, "index": 3,
                      "ids": ["a", "b"], "rejected": [{"id": "c", "reason": "unreadable"}],
                      "missed": [{"id": "d", "reason": "not on host h"}], "prep_ms": 12.5,
                      "mel_stats": {"count": 2, "sum": [1.0], "sq": [2.0]}, "cache": {"hits": 1, "computed": 1}}
    config = msgpack.unpackb(EXAMPLES[wire.WELCOME].encode()[0], raw=False)["config"]
    assert config["version"] == wire.CONFIG_VERSION and set(config) == {"version", *wire.CONFIG_SECTIONS}
    assert config["features"] == dataclasses.asdict(FeaturesConfig(n_mels=8, backend="numpy"))


def test_the_module_docstring_lists_every_kind_as_its_class_has_it() -> None:
    assert wire.message_table() in wire.__doc__
    for kind in KINDS:
        assert f"    {kind.upper():<10} {wire.MESSAGES[kind].SENDER:<5} " in wire.message_table()


def test_round_trip_of_the_framing_alone() -> None:
    msg = wire.decode(wire.encode(wire.HEARTBEAT))
    assert msg.kind == wire.HEARTBEAT and msg.fields == {} and msg.arrays == {}
    assert wire.parse(msg) == wire.Heartbeat()


def test_an_exception_crosses_as_data() -> None:
    try:
        raise KeyError("missing")
    except KeyError as exc:
        error = wire.Error.of(exc, "worker.prepare", fatal=True)
    assert (error.type, error.where, error.fatal) == ("KeyError", "worker.prepare", True)
    assert "missing" in error.message and "Traceback" in error.traceback
    assert wire.read(error.encode())[0] == error


SHAPES = [(), (0,), (5,), (3, 0), (2, 3, 4), (0, 3, 4), (1, 1, 1, 1)]


@pytest.mark.parametrize("dtype", sorted(ALLOWED_DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_dtype_and_shape(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(abs(hash((dtype, shape))) % 2**32)
    array = (rng.standard_normal(shape) * 50).astype(dtype)
    msg = wire.decode(wire.encode(wire.BATCH, {"lease": 1}, {"x": array}))
    out = msg.arrays["x"]
    assert out.dtype == np.dtype(dtype)
    assert out.shape == shape
    np.testing.assert_array_equal(out, array)


def test_array_order_and_non_contiguous_input() -> None:
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    arrays = {"z": base.T, "a": base[:, ::2], "m": np.asfortranarray(base)}
    frames = wire.encode(wire.BATCH, {}, arrays)
    spec = msgpack.unpackb(frames[0], raw=False)["a"]
    assert [s[0] for s in spec] == ["z", "a", "m"]
    msg = wire.decode(frames)
    assert list(msg.arrays) == ["z", "a", "m"]
    for name, array in arrays.items():
        np.testing.assert_array_equal(msg.arrays[name], array)


def test_non_native_byte_order_round_trips_by_value() -> None:
    swapped = np.arange(5, dtype=">i4") if np.little_endian else np.arange(5, dtype="<i4")
    out = wire.decode(wire.encode(wire.BATCH, {}, {"x": swapped})).arrays["x"]
    np.testing.assert_array_equal(out, np.arange(5))


def test_decoded_arrays_are_read_only_views() -> None:
    frames = wire.encode(wire.BATCH, {}, {"x": np.arange(10, dtype=np.int64)})
    frames[1] = frames[1].tobytes()
    out = wire.decode(frames).arrays["x"]
    assert not out.flags.writeable


def test_zero_copy_decode_with_real_zmq_frames() -> None:
    ctx = zmq.Context()
    a = ctx.socket(zmq.PAIR)
    b = ctx.socket(zmq.PAIR)
    try:
        for s in (a, b):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
            s.setsockopt(zmq.SNDTIMEO, RECV_TIMEOUT_MS)
        a.bind("inproc://test-wire")
        b.connect("inproc://test-wire")
        batch = make_batch(batch_size=8, max_tokens=32, max_frames=128, n_mels=80, seed=3)
        assert batch["mel"].nbytes > wire.ZERO_COPY_BYTES
        a.send_multipart(wire.Batch(9, 0, 0, ("x",)).encode(batch), copy=False)
        frames = b.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in frames)
        msg = wire.decode(frames)
        assert wire.parse(msg).lease == 9
        for name, array in batch.items():
            np.testing.assert_array_equal(msg.arrays[name], array)
        # The mel array is a view on the received frame's memory, not a copy.
        mel_frame = frames[1 + list(batch).index("mel")]
        frame_view = np.frombuffer(mel_frame.buffer, dtype=np.uint8)
        assert np.shares_memory(msg.arrays["mel"], frame_view)
        assert not msg.arrays["mel"].flags.writeable
        # Small, scalar and empty arrays too (pyzmq copies frames below its threshold).
        small = {"s": np.array(7, np.int64), "b": np.array([True, False]), "e": np.zeros((0, 3), np.float16)}
        a.send_multipart(wire.encode(wire.BATCH, {}, small), copy=False)
        got = wire.decode(b.recv_multipart(copy=False)).arrays
        for name, array in small.items():
            assert got[name].shape == array.shape and got[name].dtype == array.dtype
            np.testing.assert_array_equal(got[name], array)
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


# --------------------------------------------------------------------------- rejections

def test_empty_frame_list() -> None:
    assert _reason([]) == "empty"


@pytest.mark.parametrize("junk", [b"", b"\xc1", b"\x92\x01", b"\xff\xff\xff\xff", b"hello world"])
def test_not_msgpack(junk: bytes) -> None:
    # b"\x92\x01" is a truncated array; b"hello world" is a valid int followed by extra data
    assert _reason([junk]) == "not_msgpack"


@pytest.mark.parametrize("value", [[1, 2], 7, "text", None, b"raw", 1.5])
def test_header_not_a_map(value) -> None:
    assert _reason([msgpack.packb(value, use_bin_type=True)]) == "bad_header"


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, -1, "1", None, True, 1.0, [1]])
def test_wrong_version(version) -> None:
    assert _reason([_header(v=version)]) == "bad_version"


def test_missing_version() -> None:
    assert _reason([msgpack.packb({"k": wire.HELLO, "a": []})]) == "bad_version"


@pytest.mark.parametrize("kind", ["nope", "", "HELLO", None, 3, [1], {"x": 1}])
def test_unknown_kind(kind) -> None:
    assert _reason([_header(k=kind)]) == "bad_kind"


def test_bad_array_list() -> None:
    assert _reason([_header(a="x")]) == "bad_header"
    specs = [[f"a{i}", "uint8", [1]] for i in range(MAX_ARRAYS + 1)]
    assert _reason([_header(a=specs)] + [b"\0"] * (MAX_ARRAYS + 1)) == "bad_header"


def test_frame_count_mismatch() -> None:
    frames = wire.encode(wire.BATCH, {}, {"x": np.zeros(3, np.int32), "y": np.zeros(2, np.int32)})
    assert _reason(frames[:-1]) == "frame_count"
    assert _reason(frames + [b"extra"]) == "frame_count"
    assert _reason([_header(a=[])] + [b"x"]) == "frame_count"


def test_declared_size_does_not_match_frame() -> None:
    frames = wire.encode(wire.BATCH, {}, {"x": np.zeros((2, 3), np.float32)})
    assert _reason([frames[0], b"\0" * 23]) == "size_mismatch"
    assert _reason([frames[0], b"\0" * 25]) == "size_mismatch"
    assert _reason([frames[0], b""]) == "size_mismatch"
    assert wire.decode([frames[0], b"\0" * 24]).arrays["x"].shape == (2, 3)


@pytest.mark.parametrize("dtype", ["object", "<U4", "|S4", "V8", "complex64", "float128", "datetime64[s]",
                                   "O", ">i4", "int", None, 5, ["float32"]])
def test_disallowed_dtype(dtype) -> None:
    assert _reason([_header(a=[["x", dtype, [1]]]), b"\0" * 8]) == "bad_array"


@pytest.mark.parametrize("shape", [[-1], [2, -3], [1.0], ["2"], [None], [True], 4, None, [[2]]])
def test_bad_shape(shape) -> None:
    assert _reason([_header(a=[["x", "uint8", shape]]), b"\0\0"]) == "bad_array"


@pytest.mark.parametrize("spec", [["x", "uint8"], ["x", "uint8", [1], 0], [1, "uint8", [1]], "x", None,
                                  [b"x", "uint8", [1]]])
def test_malformed_spec(spec) -> None:
    assert _reason([_header(a=[spec]), b"\0"]) == "bad_array"


def test_numpy_cannot_hold_the_shape() -> None:
    # Zero-size arrays pass the size check whatever the other dimensions are.
    assert _reason([_header(a=[["x", "uint8", [0, 2**63 - 1, 2**63 - 1]]]), b""]) == "bad_array"
    assert _reason([_header(a=[["x", "uint8", [0, 2**64 - 1]]]), b""]) == "bad_array"
    assert _reason([_header(a=[["x", "uint8", [1] * 100]]), b"\0"]) == "bad_array"


def test_duplicate_array_names() -> None:
    spec = [["x", "uint8", [1]], ["x", "uint8", [1]]]
    err = pytest.raises(ProtocolError, wire.decode, [_header(a=spec), b"\0", b"\0"]).value
    assert err.reason == "bad_array" and "duplicate" in err.detail


def test_oversized_header() -> None:
    big = _header(pad="x" * MAX_HEADER_BYTES)
    assert len(big) > MAX_HEADER_BYTES
    assert _reason([big]) == "oversized"
    # Exactly at the limit is accepted.
    filler = MAX_HEADER_BYTES - len(_header(pad=""))
    for extra in range(filler - 8, filler + 1):
        frame = _header(pad="x" * extra)
        if len(frame) == MAX_HEADER_BYTES:
            assert wire.decode([frame]).fields["pad"] == "x" * extra
            break
    else:
        pytest.fail("could not build a header of exactly MAX_HEADER_BYTES")


def test_max_bytes() -> None:
    frames = wire.encode(wire.BATCH, {}, {"a": np.zeros(1000, np.uint8), "b": np.zeros(1000, np.uint8)})
    header = len(frames[0])
    assert wire.decode(frames, max_bytes=header + 2000).arrays["b"].size == 1000
    with pytest.raises(ProtocolError) as info:
        wire.decode(frames, max_bytes=header + 1999)
    assert info.value.reason == "oversized"
    assert _reason_with_max(frames, header + 999) == "oversized"


def _reason_with_max(frames, max_bytes: int) -> str:
    with pytest.raises(ProtocolError) as info:
        wire.decode(frames, max_bytes=max_bytes)
    return info.value.reason


def test_protocol_error_is_a_value_error_with_reason_and_detail() -> None:
    err = ProtocolError("bad_kind", "kind 'x'")
    assert isinstance(err, ValueError)
    assert err.reason == "bad_kind" and err.detail == "kind 'x'"
    assert str(err) == "bad_kind: kind 'x'"
    assert str(ProtocolError("empty")) == "empty"


# --------------------------------------------------------------------------- encode refusals

@pytest.mark.parametrize("array", [np.array([object(), 1], dtype=object), np.array(["ab", "c"]),
                                   np.zeros(2, np.complex64), np.array([b"x"]),
                                   np.zeros(2, dtype=[("a", "i4"), ("b", "f4")])],
                         ids=["object", "unicode", "complex", "bytes", "structured"])
def test_encode_refuses_disallowed_arrays(array) -> None:
    with pytest.raises(ValueError, match="not allowed"):
        wire.encode(wire.BATCH, {}, {"x": array})


@pytest.mark.parametrize("name", ["v", "k", "a"])
def test_encode_refuses_reserved_field_names(name: str) -> None:
    with pytest.raises(ValueError, match="reserved"):
        wire.encode(wire.HELLO, {name: 1})


def test_encode_refuses_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown message kind"):
        wire.encode("gossip")


# --------------------------------------------------------------------------- typed fields

def _with(kind: str, **changes) -> list:
    """The frames of EXAMPLES[kind] with header fields changed (None: removed)."""
    header = msgpack.unpackb(EXAMPLES[kind].encode()[0], raw=False)
    for key, value in changes.items():
        if value is None:
            del header[key]
        else:
            header[key] = value
    return [msgpack.packb(header, use_bin_type=True)]


def _typed_reason(frames) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        wire.read(frames)
    return info.value


@pytest.mark.parametrize(("kind", "changes", "names"), [
    (wire.LEASE, {"lease": "7"}, "lease.lease"),
    (wire.LEASE, {"lease": True}, "lease.lease"),  # a bool is no int
    (wire.LEASE, {"lease": 7.0}, "lease.lease"),
    (wire.LEASE, {"ids": None}, "lease.ids"),  # a required field missing
    (wire.LEASE, {"ids": ["a", 2]}, "lease.ids"),
    (wire.LEASE, {"ids": "ab"}, "lease.ids"),
    (wire.LEASE, {"shape": [16]}, "lease.shape"),
    (wire.LEASE, {"shape": [16, 64, 1]}, "lease.shape"),
    (wire.LEASE, {"shape": [16, -64]}, "lease"),
    (wire.LEASE, {"rows": -1}, "lease"),
    (wire.LEASE, {"tokens": [[1], [2], [3]]}, "lease"),  # more token rows than clips
    (wire.LEASE, {"tokens": [[1, "x"]]}, "lease.tokens"),
    (wire.LEASE, {"texts": {"a": 1}}, "lease.texts"),
    (wire.BATCH, {"rejected": [["c", "bad"]]}, "batch.rejected"),  # pairs: entries are maps
    (wire.BATCH, {"missed": [{"reason": "gone"}]}, "batch.missed.id"),
    (wire.BATCH, {"ids": [[1]]}, "batch.ids"),
    (wire.BATCH, {"prep_ms": "fast"}, "batch.prep_ms"),
    (wire.BATCH, {"cache": {"hits": -1}}, "batch"),
    (wire.BATCH, {"cache": {"hits": 1.5}}, "batch.cache"),
    (wire.HELLO, {"pid": "1"}, "hello.pid"),
    (wire.HELLO, {"config": None}, "hello.config"),
    (wire.HELLO, {"config": {"version": 1, "sections": {"features": "n_mels"}}}, "hello.config.sections"),
    (wire.WELCOME, {"heartbeat_timeout_s": 0}, "welcome"),
    (wire.WELCOME, {"config": [1]}, "welcome.config"),
    (wire.HEARTBEAT, {"ping": "now"}, "heartbeat.ping"),
    (wire.REFUSE, {"rejoin": 1}, "refuse.rejoin"),
    (wire.BYE, {"leases": [1, None]}, "bye.leases"),
    (wire.ERROR, {"fatal": "yes"}, "error.fatal"),
    (wire.STOP, {"reason": None}, "stop.reason"),
])
def test_a_field_missing_or_of_the_wrong_type_or_range_is_refused(kind: str, changes: dict, names: str) -> None:
    err = _typed_reason(_with(kind, **changes))
    assert err.reason == "bad_field" and err.detail.startswith(names), err.detail


def test_a_message_typed_from_its_fields_alone_refuses_a_wrong_one_as_bad_field() -> None:
    """The consumer types a BATCH's fields itself (``wire.Batch.from_header``), counting reasons."""
    with pytest.raises(ProtocolError) as info:
        wire.Batch.from_header({"lease": "7", "epoch": 0, "index": 0, "ids": []})
    assert (info.value.reason, info.value.detail) == ("bad_field", "batch.lease = '7'")


@pytest.mark.parametrize(("config", "said"), [
    ({"version": wire.CONFIG_VERSION + 1}, "config version"),
    ({"version": wire.CONFIG_VERSION, "features": {"n_mels_new": 3}}, "features.n_mels_new"),  # a key we lack
    ({"version": wire.CONFIG_VERSION, "features": {"n_mels": "80"}}, "features.n_mels"),
    ({"version": wire.CONFIG_VERSION, "faults": ["x"]}, "config.faults"),
])
def test_a_config_this_producer_cannot_take_is_refused(config: dict, said: str) -> None:
    err = _typed_reason(_with(wire.WELCOME, config=config))
    assert err.reason in ("bad_config", "bad_field") and said in err.detail, err.detail


def test_a_config_section_the_trainer_leaves_out_keeps_this_installs_defaults() -> None:
    welcome, _ = wire.read(_with(wire.WELCOME, config={"version": wire.CONFIG_VERSION, "features": {"n_mels": 8}}))
    assert welcome.config == wire.ProducerConfig(FeaturesConfig(n_mels=8))


def test_a_field_the_class_lacks_is_ignored() -> None:
    assert wire.read(_with(wire.READY, note="from a later minor change"))[0] == wire.Ready(7)


def test_the_config_schema_names_what_a_producer_lacks() -> None:
    local = wire.ConfigSchema.local()
    assert set(local.sections) == set(wire.CONFIG_SECTIONS) and "n_mels" in local.sections["features"]
    assert local.differs(local) == ""
    features = tuple(k for k in local.sections["features"] if k != "top_db")
    older = wire.ConfigSchema(local.version, {**local.sections, "features": features})
    assert older.differs(local) == "it lacks the config keys features.top_db"
    assert local.differs(older) == ""  # a key the trainer does not send keeps the producer's default
    assert "config version 0 here and" in wire.ConfigSchema(0, local.sections).differs(local)


# --------------------------------------------------------------------------- other versions

def test_a_message_of_another_version_says_its_version_and_kind() -> None:
    frames = [msgpack.packb({"v": 3, "k": "hello", "a": [], "producer": "p0", "host": "h", "pid": 1})]
    with pytest.raises(wire.OtherVersion) as info:
        wire.decode(frames)
    err = info.value
    assert (err.reason, err.version, err.kind, err.fields["producer"]) == ("bad_version", 3, wire.HELLO, "p0")
    assert err.reason_refused() is None


def test_a_refuse_is_encoded_in_any_version_as_every_version_reads_it() -> None:
    frames = wire.Refuse("speaks protocol version 3", metadata_file="x.csv").encode(version=3)
    assert msgpack.unpackb(frames[0], raw=False) == {"v": 3, "k": "refuse", "a": [],
                                                      "reason": "speaks protocol version 3"}
    with pytest.raises(wire.OtherVersion) as info:
        wire.decode(frames)
    assert info.value.reason_refused() == "speaks protocol version 3"
    with pytest.raises(ValueError, match="protocol version"):
        wire.Stop("x").encode(version=3)  # only a REFUSE has the same layout in every version


# --------------------------------------------------------------------------- fuzz

def _decode_only_protocol_errors(frames) -> None:
    try:
        wire.read(frames, max_bytes=1 << 20)
    except ProtocolError:
        pass  # any other exception type fails the test


def test_fuzz_random_bytes() -> None:
    rng = random.Random(FUZZ_SEED)
    for _ in range(FUZZ_RANDOM):
        n_frames = rng.randint(1, 4)
        frames = [rng.randbytes(rng.randint(0, 64)) for _ in range(n_frames)]
        _decode_only_protocol_errors(frames)


def _random_msgpack_value(rng: random.Random, depth: int = 0):
    choices = [None, True, False, rng.randint(-2**63, 2**64 - 1), rng.random(), "x" * rng.randint(0, 5),
               rng.randbytes(rng.randint(0, 4)), rng.choice(sorted(ALLOWED_DTYPES)), rng.choice(sorted(KINDS)),
               -1, 0, 1, PROTOCOL_VERSION]
    if depth < 2:
        choices.append([_random_msgpack_value(rng, depth + 1) for _ in range(rng.randint(0, 3))])
        choices.append({str(rng.randint(0, 3)): _random_msgpack_value(rng, depth + 1)})
    return rng.choice(choices)


def test_fuzz_mutations_of_a_valid_message() -> None:
    rng = random.Random(FUZZ_SEED + 1)
    valid = wire.Batch(3, 0, 0, ("a", "b"), prep_ms=1.0).encode(
        make_batch(batch_size=2, max_tokens=4, max_frames=4, n_mels=3, seed=1))
    valid = [bytes(f) if isinstance(f, bytes) else f.tobytes() for f in valid]
    header = msgpack.unpackb(valid[0], raw=False)
    for i in range(FUZZ_MUTATIONS):
        frames = list(valid)
        op = i % 5
        if op == 0:  # flip bytes of the header
            head = bytearray(frames[0])
            for _ in range(rng.randint(1, 4)):
                head[rng.randrange(len(head))] = rng.randrange(256)
            frames[0] = bytes(head)
        elif op == 1:  # truncate or extend a frame
            j = rng.randrange(len(frames))
            frames[j] = frames[j][:rng.randrange(len(frames[j]) + 1)] + rng.randbytes(rng.randint(0, 3))
        elif op == 2:  # drop, duplicate or reorder frames
            j = rng.randrange(len(frames))
            choice = rng.randrange(3)
            if choice == 0:
                del frames[j]
            elif choice == 1:
                frames.insert(j, frames[j])
            else:
                rng.shuffle(frames)
        elif op == 3:  # replace a header value with something of a random type
            mutated = dict(header)
            key = rng.choice(["v", "k", "a", "lease", "ids", "rejected", "prep_ms", "cache"])
            mutated[key] = _random_msgpack_value(rng)
            frames[0] = msgpack.packb(mutated, use_bin_type=True)
        else:  # corrupt one array spec
            mutated = dict(header)
            specs = [list(s) for s in header["a"]]
            j = rng.randrange(len(specs))
            specs[j][rng.randrange(3)] = _random_msgpack_value(rng)
            mutated["a"] = specs
            frames[0] = msgpack.packb(mutated, use_bin_type=True)
        _decode_only_protocol_errors(frames)
    # The untouched message still decodes.
    assert wire.parse(wire.decode(valid)).lease == 3


def test_a_lease_with_a_negative_clip_position_or_more_positions_than_clips_is_refused() -> None:
    lease = EXAMPLES[wire.LEASE]
    for positions in ((3, -1), (1, 2, 3)):
        with pytest.raises(ProtocolError, match="positions"):
            wire.parse(wire.decode(dataclasses.replace(lease, positions=positions).encode()))
