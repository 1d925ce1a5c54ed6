"""Tests for shared/wire.py: framing, checks on untrusted input, zero-copy decode."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest
import zmq

from stoker.shared import wire
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

FIELDS_BY_KIND = {
    wire.HELLO: {"producer": "p0", "host": "h", "pid": 123,
                 "dataset": {"metadata_file": "metadata.csv", "metadata": "ab", "audio": "cd", "entries": 2,
                             "missing": ["x"], "missing_count": 1}},
    wire.WELCOME: {"producer_index": 1, "features": {"n_mels": 80, "backend": "numpy"},
                   "heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 5.0},
    wire.REFUSE: {"reason": "fingerprint differs"},
    wire.LEASE: {"lease": 7, "epoch": 0, "index": 3, "ids": ["a", "b"], "shape": [16, 64]},
    wire.READY: {"lease": 7},
    wire.CREDIT: {"lease": 7},
    wire.REVOKE: {"lease": 7},
    wire.BATCH: {"lease": 7, "ids": ["a", "b"], "rejected": [["c", "bad"]], "missed": [{"id": "d", "reason": "gone"}],
                 "prep_ms": 12.5},
    wire.HEARTBEAT: {"ready": 2, "working": 1, "ping": 12.25, "rtt_ms": 0.5},
    wire.ERROR: {"type": "ValueError", "message": "boom", "where": "worker"},
    wire.BYE: {"leases": [1, 2, 3]},
    wire.STOP: {"reason": "done"},
}


def test_every_kind_is_covered() -> None:
    assert set(FIELDS_BY_KIND) == KINDS


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_round_trip_every_kind(kind: str) -> None:
    fields = FIELDS_BY_KIND[kind]
    arrays = make_batch(batch_size=3, valid=2, seed=5) if kind == wire.BATCH else {}
    frames = wire.encode(kind, fields, arrays)
    assert len(frames) == 1 + len(arrays)
    msg = wire.decode(frames)
    assert msg.kind == kind
    assert msg.fields == fields
    assert set(msg.arrays) == set(arrays)
    for name, array in arrays.items():
        assert msg.arrays[name].dtype == array.dtype
        np.testing.assert_array_equal(msg.arrays[name], array)
    for key, value in fields.items():
        assert msg[key] == value
        assert msg.get(key) == value
    assert msg.get("absent", 42) == 42


def test_round_trip_without_fields_or_arrays() -> None:
    msg = wire.decode(wire.encode(wire.HEARTBEAT))
    assert msg.kind == wire.HEARTBEAT and msg.fields == {} and msg.arrays == {}


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
        a.send_multipart(wire.encode(wire.BATCH, {"lease": 9, "ids": ["x"]}, batch), copy=False)
        frames = b.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in frames)
        msg = wire.decode(frames)
        assert msg["lease"] == 9
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


# --------------------------------------------------------------------------- require

def _msg(**fields) -> wire.Message:
    return wire.Message(kind=wire.LEASE, fields=fields)


def test_require_accepts_right_types() -> None:
    wire.require(_msg(lease=1, ids=["a"], name="p", ms=2.5, flag=True),
                 lease=int, ids=list, name=str, ms=(int, float), flag=bool)
    wire.require(_msg(ms=3), ms=(int, float))


@pytest.mark.parametrize(("value", "expected"), [
    (True, int), (False, int), (True, (int,)), (True, (int, float)), ("1", int), (1.0, int),
    (None, int), ([1], str), ({"a": 1}, list), (1, bool),
])
def test_require_refuses_wrong_types(value, expected) -> None:
    with pytest.raises(ProtocolError) as info:
        wire.require(_msg(x=value), x=expected)
    assert info.value.reason == "bad_field"
    assert "lease.x" in info.value.detail


def test_require_refuses_missing_field() -> None:
    with pytest.raises(ProtocolError) as info:
        wire.require(_msg(lease=1), lease=int, ids=list)
    assert info.value.reason == "bad_field" and "ids" in info.value.detail


def test_error_fields_is_plain_data() -> None:
    try:
        raise KeyError("missing")
    except KeyError as exc:
        fields = wire.error_fields(exc, "worker.prepare")
    assert fields["type"] == "KeyError"
    assert fields["where"] == "worker.prepare"
    assert "missing" in fields["message"]
    assert "Traceback" in fields["traceback"]
    msg = wire.decode(wire.encode(wire.ERROR, fields))
    assert msg.fields == fields


# --------------------------------------------------------------------------- fuzz

def _decode_only_protocol_errors(frames) -> None:
    try:
        wire.decode(frames, max_bytes=1 << 20)
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
    valid = wire.encode(wire.BATCH, {"lease": 3, "ids": ["a", "b"], "rejected": [], "prep_ms": 1.0},
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
            key = rng.choice(["v", "k", "a", "lease", "ids"])
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
    assert wire.decode(valid)["lease"] == 3
