"""A real Producer (in a thread) against a scripted consumer on a ROUTER socket."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from stoker.producer.features import log_mel_spectrogram_numpy, pad_value
from stoker.producer.worker import Producer, endpoints_from
from stoker.shared import wire
from stoker.shared.config import BatchingConfig, FeaturesConfig, TransformsConfig
from stoker.shared.dataset.agreement import metadata_sha256
from tests.factories import make_dataset

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

RECV_TIMEOUT_MS = 10000


class FakeConsumer:
    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.rcvtimeo = RECV_TIMEOUT_MS
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.identity = b""

    def recv(self, kind: str, skip: tuple[str, ...] = (wire.HEARTBEAT,)) -> Any:
        """The next message of ``kind`` (shared/wire.py's class; its arrays in ``self.arrays``)."""
        while True:
            frames = self.sock.recv_multipart()
            self.identity = frames[0]
            msg, self.arrays = wire.read(frames[1:])
            if msg.KIND == kind:
                return msg
            assert msg.KIND in skip, f"expected {kind}, got {msg.KIND}"

    def send(self, msg: wire.Body) -> None:
        self.sock.send_multipart([self.identity, *msg.encode()])


@pytest.fixture
def setup(tmp_path):
    ids = make_dataset(tmp_path / "data", count=6)
    ctx = zmq.Context()
    consumer = FakeConsumer(ctx)
    stop = threading.Event()
    producer = Producer(consumer.endpoint, tmp_path / "data", "p-test", stop, context=ctx)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", producer.run()), daemon=True)
    thread.start()
    features = FeaturesConfig(backend="numpy", n_mels=16)
    yield consumer, producer, stop, thread, result, ids, tmp_path / "data", features
    stop.set()
    thread.join(10)
    consumer.sock.close()
    ctx.term()


def tokens_of(sample_id: str) -> list[int]:
    """Distinct token ids per clip, as the trainer's TokenTable would send them."""
    return [2 + (ord(c) % 30) for c in sample_id] + [1]


def lease(lease_id: int, ids: list[str], index: int = 0, **fields: Any) -> wire.Lease:
    """A lease as the trainer sends it: each clip's text too (a producer reads no metadata of its own)."""
    fields.setdefault("texts", {i: f"text of {i}" for i in ids})
    return wire.Lease(lease_id, 0, index, tuple(ids), (64, 128), 4, tuple(tuple(tokens_of(i)) for i in ids), **fields)


def welcome_of(features: FeaturesConfig, fields: str = "", fixed_rows: bool = False, user: str = "",
               versions: dict[str, str] | None = None, models: str = "", model_fields: str = "") -> wire.Welcome:
    transforms = TransformsConfig(user=user, models=models, model_fields=model_fields)
    return wire.Welcome(producer_index=0, producer_name="p-test",
                        config=wire.ProducerConfig(features, transforms), fields=fields,
                        fixed_rows=fixed_rows, ref_frames=BatchingConfig.ref_frames, transform_versions=versions or {},
                        metadata_file="metadata.csv", feature_cache="",
                        heartbeat_interval_s=0.5, heartbeat_timeout_s=30.0)


def welcome(consumer: FakeConsumer, features: FeaturesConfig, fields: str = "", fixed_rows: bool = False) -> None:
    consumer.recv(wire.HELLO)
    consumer.send(welcome_of(features, fields, fixed_rows))


def test_lease_ready_credit_batch_with_a_rejected_clip(setup):
    consumer, producer, stop, thread, result, ids, root, features = setup
    (root / "wavs" / f"{ids[1]}.wav").write_bytes(b"RIFF....WAVEgarbage")
    welcome(consumer, features)
    lease_ids = [ids[0], ids[1], ids[2]]
    consumer.send(lease(7, lease_ids, index=0))
    assert consumer.recv(wire.READY).lease == 7
    consumer.send(wire.Credit(7))
    batch = consumer.recv(wire.BATCH)
    assert batch.lease == 7
    assert batch.ids == (ids[0], ids[2])
    assert [r.id for r in batch.rejected] == [ids[1]]
    # the tokens are the lease's, row for row, padded with 0
    for row, sample_id in enumerate(batch.ids):
        expected_tokens = tokens_of(sample_id)
        assert consumer.arrays["token_lengths"][row] == len(expected_tokens)
        assert consumer.arrays["tokens"][row].tolist() == expected_tokens + [0] * (64 - len(expected_tokens))
    assert batch.rejected[0].reason == (f"audio file truncated: wavs/{ids[1]}.wav: the header ends at byte 19 "
                                              "without a data chunk")
    mel, lengths = consumer.arrays["mel"], consumer.arrays["mel_lengths"]
    assert mel.shape == (2, 128, 16) and all(lengths > 0)  # only the real rows (batching.fixed_rows off)
    import soundfile

    audio, _ = soundfile.read(str(root / "wavs" / f"{ids[0]}.wav"), dtype="float32")
    expected = log_mel_spectrogram_numpy(audio, features, dtype=np.float32)
    assert lengths[0] == expected.shape[0]
    np.testing.assert_allclose(mel[0, :lengths[0]], expected, rtol=1e-5, atol=1e-5)
    assert np.all(mel[0, lengths[0]:] == np.float32(pad_value(features)))
    consumer.send(wire.Stop("test over"))
    thread.join(10)
    assert result["code"] == 0


def test_stop_signal_sends_bye_with_held_leases(setup):
    consumer, producer, stop, thread, result, ids, root, features = setup
    welcome(consumer, features)
    consumer.send(lease(3, [ids[0]], index=0))
    consumer.send(lease(4, [ids[3]], index=1))
    consumer.recv(wire.READY)
    stop.set()  # what SIGTERM/SIGINT do
    bye = consumer.recv(wire.BYE, skip=(wire.HEARTBEAT, wire.READY))
    assert sorted(bye.leases) == [3, 4]
    thread.join(10)
    assert result["code"] == 0


def test_garbage_from_the_consumer_is_ignored(setup):
    consumer, producer, stop, thread, result, ids, root, features = setup
    welcome(consumer, features)
    consumer.sock.send_multipart([consumer.identity, b"\xc1 not msgpack"])
    consumer.send(lease(1, [ids[0]], index=0))
    assert consumer.recv(wire.READY).lease == 1
    assert thread.is_alive()


def test_hello_describes_the_copy_by_its_metadata_sha256_without_listing_audio(tmp_path):
    make_dataset(tmp_path / "data", count=4)
    shutil.rmtree(tmp_path / "data" / "wavs")  # joining looks at no audio file: missing ones are found when read
    ctx = zmq.Context()
    consumer = FakeConsumer(ctx)
    stop = threading.Event()
    producer = Producer(consumer.endpoint, tmp_path / "data", "p-scan", stop, context=ctx)
    thread = threading.Thread(target=producer.run, daemon=True)
    thread.start()
    try:
        hello = consumer.recv(wire.HELLO)
        assert hello.dataset == {"metadata_file": "metadata.csv", "columns": "",
                                 "sha256": metadata_sha256(tmp_path / "data")}
        assert isinstance(hello.session, str) and hello.launcher > 0
    finally:
        stop.set()
        thread.join(10)
        consumer.sock.close()
        ctx.term()


def test_a_file_missing_on_this_host_is_missed_not_rejected(setup):
    consumer, producer, stop, thread, result, ids, root, features = setup
    (root / "wavs" / f"{ids[1]}.wav").unlink()
    welcome(consumer, features)
    consumer.send(lease(5, [ids[0], ids[1]]))
    consumer.recv(wire.READY)
    consumer.send(wire.Credit(5))
    batch = consumer.recv(wire.BATCH)
    assert batch.ids == (ids[0],) and batch.rejected == ()
    assert [m.id for m in batch.missed] == [ids[1]]
    assert f"on host {producer.host}" in batch.missed[0].reason


def test_a_file_of_another_size_than_the_trainers_is_missed_with_both_sizes(setup):
    """A lease to a remote producer names each file's size on the trainer: a copy of another size
    here (resampled, re-encoded, truncated) is not the trainer's file; another host may have it."""
    consumer, producer, stop, thread, result, ids, root, features = setup
    sizes = {i: (root / "wavs" / f"{i}.wav").stat().st_size for i in ids[:3]}
    welcome(consumer, features)
    consumer.send(lease(5, ids[:3], sizes={**sizes, ids[1]: sizes[ids[1]] + 2}))
    consumer.recv(wire.READY)
    consumer.send(wire.Credit(5))
    batch = consumer.recv(wire.BATCH)
    assert batch.ids == (ids[0], ids[2]) and batch.rejected == ()
    assert batch.missed == (wire.Entry(ids[1], f"wavs/{ids[1]}.wav is {sizes[ids[1]]} bytes on this host and "
                                               f"{sizes[ids[1]] + 2} on the trainer (a resampled, re-encoded or "
                                               f"truncated copy?) on host {producer.host}"),)


def test_refused_hello_ends_with_status_2(setup):
    consumer, producer, stop, thread, result, ids, root, features = setup
    consumer.recv(wire.HELLO)
    consumer.send(wire.Refuse("dataset on h does not match the trainer's"))
    thread.join(10)
    assert result["code"] == 2


def test_a_refusal_of_another_protocol_version_ends_with_status_2_and_one_line(setup, caplog):
    """A newer trainer refuses this producer in its own version: the REFUSE layout is every version's."""
    consumer, producer, stop, thread, result, ids, root, features = setup
    consumer.recv(wire.HELLO)
    newer = wire.PROTOCOL_VERSION + 1
    consumer.sock.send_multipart([consumer.identity, *wire.Refuse("too old").encode(version=newer)])
    thread.join(10)
    assert result["code"] == 2
    errors = [r.getMessage() for r in caplog.records if r.name == "producer" and r.levelno >= logging.WARNING]
    assert errors == [f"the trainer at {consumer.endpoint} (protocol version {newer}, this producer "
                      f"{wire.PROTOCOL_VERSION}) refused this producer: too old"]


@pytest.mark.parametrize("changes, said", [
    ({"config": {"version": wire.CONFIG_VERSION, "features": {"n_mels_v2": 3}}},
     "bad_config: unknown config key 'features.n_mels_v2'"),  # a key added after this producer's version
    ({"config": {"version": wire.CONFIG_VERSION + 1}}, f"config version {wire.CONFIG_VERSION + 1}"),
    ({"transform_versions": None}, "bad_field: welcome.transform_versions = None"),
])
def test_a_welcome_this_producer_cannot_take_ends_with_status_2_and_one_line(setup, caplog, changes, said):
    consumer, producer, stop, thread, result, ids, root, features = setup
    consumer.recv(wire.HELLO)
    header = {**welcome_of(features).to_header(), **changes}
    consumer.sock.send_multipart([consumer.identity, *wire.encode(wire.WELCOME, header)])
    thread.join(10)
    assert result["code"] == 2
    errors = [r.getMessage() for r in caplog.records if r.name == "producer" and r.levelno >= logging.WARNING]
    assert len(errors) == 1 and said in errors[0] and "run the trainer's stoker version" in errors[0], errors


def test_refusal_naming_another_metadata_file_makes_it_describe_that(setup):
    consumer, producer, stop, thread, result, ids, root, features = setup
    (root / "train.csv").write_text((root / "metadata.csv").read_text().splitlines()[0] + "\n")
    assert consumer.recv(wire.HELLO).dataset["metadata_file"] == "metadata.csv"
    consumer.send(wire.Refuse("reads train.csv", metadata_file="train.csv"))
    again = consumer.recv(wire.HELLO)
    assert again.dataset == {"metadata_file": "train.csv", "columns": "", "sha256": metadata_sha256(root, "train.csv")}


def test_a_rejoin_request_drops_work_and_says_hello_again(setup):
    consumer, producer, stop, thread, result, ids, root, features = setup
    welcome(consumer, features)
    consumer.send(lease(8, [ids[0]], index=0))
    consumer.recv(wire.READY)
    producer.books[0].link.last_hello -= 10  # the REFUSE answers a message sent after our HELLO
    consumer.send(wire.Refuse("unknown producer", rejoin=True))
    consumer.recv(wire.HELLO, skip=(wire.HEARTBEAT, wire.READY))
    assert producer.books[0].held == set() and thread.is_alive()


def test_a_revoked_lease_is_never_delivered(setup):
    consumer, producer, stop, thread, result, ids, root, features = setup
    welcome(consumer, features)
    consumer.send(lease(1, [ids[0]], index=0))
    consumer.send(wire.Revoke(1))
    consumer.send(lease(2, [ids[2]], index=1))
    # lease 1 may have been prepared and offered before the REVOKE was read (the consumer
    # drops that READY); what must hold is that it is never delivered
    offered = consumer.recv(wire.READY).lease
    while offered != 2:
        assert offered == 1
        offered = consumer.recv(wire.READY).lease
    consumer.send(wire.Credit(1))  # a credit for the revoked lease is ignored
    consumer.send(wire.Credit(2))
    assert consumer.recv(wire.BATCH).lease == 2


class SentFrames:
    """A socket stand-in for the io thread's handlers: it keeps what they send."""

    def __init__(self) -> None:
        self.sent: list[wire.Body] = []

    def send_multipart(self, frames: list, **_: object) -> None:
        self.sent.append(wire.read(frames)[0])


def test_a_lease_revoked_while_it_is_prepared_is_neither_offered_nor_sent(tmp_path):
    producer = Producer("tcp://127.0.0.1:1", tmp_path, "p-book", threading.Event())
    book = producer.books[0]
    sock = book.link.sock = SentFrames()
    producer._handle(book, lease(1, ["T0000"]), now=0.0)
    producer._handle(book, wire.Revoke(1), now=0.0)
    book.ready[1] = wire.Batch(1, 0, 0, ()).encode()  # the compute thread finishes it
    assert producer._on_wake(b"0:1")
    producer._handle(book, wire.Credit(1), now=0.0)
    assert sock.sent == [] and book.ready == {} and book.held == set()
    # the same lease not revoked is offered, then sent on its credit
    producer._handle(book, lease(2, ["T0001"]), now=0.0)
    book.ready[2] = wire.Batch(2, 0, 0, ()).encode()
    producer._on_wake(b"0:2")
    producer._handle(book, wire.Credit(2), now=0.0)
    assert sock.sent == [wire.Ready(2), wire.Batch(2, 0, 0, ())]


def test_heartbeats_carry_a_ping_and_the_pong_gives_the_round_trip(setup):
    consumer, producer, stop, thread, result, ids, root, features = setup
    welcome(consumer, features)
    beat = consumer.recv(wire.HEARTBEAT, skip=(wire.HELLO,))
    assert isinstance(beat.ping, float)
    consumer.send(wire.Heartbeat(pong=beat.ping))
    beat = consumer.recv(wire.HEARTBEAT, skip=(wire.HELLO,))
    while beat.rtt_ms is None:
        beat = consumer.recv(wire.HEARTBEAT, skip=(wire.HELLO,))
    assert 0 <= beat.rtt_ms < 10000


def test_stop_is_answered_with_bye(setup):
    consumer, producer, stop, thread, result, ids, root, features = setup
    welcome(consumer, features)
    consumer.send(wire.Stop("run over"))
    consumer.recv(wire.BYE, skip=(wire.HEARTBEAT, wire.HELLO))
    thread.join(10)
    assert result["code"] == 0


# A producer process on a host without any text front-end: importing one fails there.
NO_FRONT_END = """
import sys
for name in ("phonemizer", "num2words", "espeakng_loader"):
    sys.modules[name] = None  # import fails
from stoker.producer.worker import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_producer_needs_no_text_front_end(tmp_path):
    """The trainer tokenizes: a producer host without phonemizer, num2words or espeak-ng
    delivers exactly the lease's token ids, so its front-end cannot disagree with the trainer's."""
    import subprocess
    import sys

    ids = make_dataset(tmp_path / "data", count=3)
    ctx = zmq.Context()
    consumer = FakeConsumer(ctx)
    proc = subprocess.Popen([sys.executable, "-c", NO_FRONT_END, "--connect", consumer.endpoint, "--data",
                             str(tmp_path / "data"), "--name", "bare"], cwd=Path(__file__).resolve().parents[2],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        welcome(consumer, FeaturesConfig(backend="numpy", n_mels=16))
        consumer.send(lease(1, ids))
        assert consumer.recv(wire.READY).lease == 1
        consumer.send(wire.Credit(1))
        batch = consumer.recv(wire.BATCH)
        for row, sample_id in enumerate(batch.ids):
            expected = tokens_of(sample_id)
            assert consumer.arrays["tokens"][row, :len(expected)].tolist() == expected
        assert list(batch.ids) == ids
        consumer.send(wire.Stop("test over"))
        assert proc.wait(timeout=20) == 0, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        consumer.sock.close()
        ctx.term()


def test_optional_fields_come_from_the_lease(setup):
    consumer, producer, stop, thread, result, ids, root, features = setup
    # The WELCOME of a run of fixed rows: the lease's 4 rows, the 2 empty ones marked by row_mask.
    welcome(consumer, features, fields="speaker_id,language_id,stop,row_mask", fixed_rows=True)
    consumer.send(lease(2, [ids[0], ids[1]], speakers=(3, 1), languages=(1, 0)))
    assert consumer.recv(wire.READY).lease == 2
    consumer.send(wire.Credit(2))
    assert consumer.recv(wire.BATCH).ids == (ids[0], ids[1])
    assert consumer.arrays["speaker_id"].tolist() == [3, 1, 0, 0]
    assert consumer.arrays["language_id"].tolist() == [1, 0, 0, 0]
    assert consumer.arrays["row_mask"].tolist() == [1.0, 1.0, 0.0, 0.0]
    lengths = consumer.arrays["mel_lengths"]
    for row in range(4):
        assert consumer.arrays["stop"][row].tolist() == [float(t >= lengths[row] - 1) for t in range(128)]
    consumer.send(wire.Stop("test over"))
    thread.join(10)


@pytest.mark.parametrize("versions, said", [
    ({"tests.producer.user_transforms:halve": "1.0"}, "is version sha256:"),
    ({}, "and None on the trainer"),
])
def test_a_transform_of_another_version_than_the_trainers_ends_with_status_2(setup, caplog, versions, said):
    consumer, producer, stop, thread, result, ids, root, features = setup
    consumer.recv(wire.HELLO)
    consumer.send(welcome_of(features, user="tests.producer.user_transforms:halve", versions=versions))
    thread.join(10)
    assert result["code"] == 2
    assert "transform tests.producer.user_transforms:halve" in caplog.text and said in caplog.text


def test_a_mel_function_of_another_version_than_the_trainers_ends_with_status_2(setup, caplog):
    consumer, producer, stop, thread, result, ids, root, features = setup
    spec = "tests.producer.user_mels:frame_levels"
    consumer.recv(wire.HELLO)
    consumer.send(welcome_of(dataclasses.replace(features, user=spec), versions={spec: "sha256:0"}))
    thread.join(10)
    assert result["code"] == 2
    assert f"transform {spec} is version sha256:" in caplog.text and "sha256:0 on the trainer" in caplog.text


def test_the_trainers_transform_version_is_accepted(setup):
    from stoker.producer.transforms import load_user

    consumer, producer, stop, thread, result, ids, root, features = setup
    spec = "tests.producer.user_transforms:halve"
    (_, _, version), = load_user(spec)
    consumer.recv(wire.HELLO)
    consumer.send(welcome_of(features, user=spec, versions={spec: version}))
    consumer.send(lease(1, ids[:2]))
    consumer.recv(wire.READY)
    assert "code" not in result


@pytest.mark.parametrize("spec, same", [("tests.producer.user_models:mean_level", True),
                                         ("tests.producer.user_models:mean_level", False),
                                         ("tests.producer.user_models_torch:level", False)])
def test_a_producer_model_of_other_weights_or_source_than_the_trainers_ends_with_status_2(setup, caplog, monkeypatch,
                                                                                         spec, same):
    from stoker.producer.models import model_versions

    consumer, producer, stop, thread, result, ids, root, features = setup
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")  # as the launcher pins a producer: here, no GPU
    framework = "torch" if "torch" in spec else "tensorflow"
    versions = model_versions(spec) if same else {f"model:{spec}": f"{framework}:sha256:0+sha256:0"}
    consumer.recv(wire.HELLO)
    consumer.send(welcome_of(features, models=spec, model_fields="score:float32:-:0", versions=versions))
    if same:
        consumer.send(lease(1, ids[:2]))
        consumer.recv(wire.READY, skip=(wire.HEARTBEAT, wire.HELLO))  # a HELLO again while TensorFlow was imported
        assert "code" not in result
        return
    thread.join(20)
    assert result["code"] == 2
    assert f"producer model {spec} is version {framework}:sha256:" in caplog.text
    assert f"{framework}:sha256:0+sha256:0 on the trainer: every host must run the same model code and weights" \
        in caplog.text


@pytest.fixture
def two_trainers(tmp_path):
    """One producer serving two trainers (the ranks of a host), each a scripted consumer."""
    ids = make_dataset(tmp_path / "data", count=6)
    ctx = zmq.Context()
    first, second = FakeConsumer(ctx), FakeConsumer(ctx)
    stop = threading.Event()
    producer = Producer([first.endpoint, second.endpoint], tmp_path / "data", "p-test", stop, context=ctx)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", producer.run()), daemon=True)
    thread.start()
    yield first, second, stop, thread, result, ids, tmp_path / "data", FeaturesConfig(backend="numpy", n_mels=16)
    stop.set()
    thread.join(10)
    first.sock.close()
    second.sock.close()
    ctx.term()


def check_rows(consumer: FakeConsumer, batch: wire.Batch, root: Path, features: FeaturesConfig) -> None:
    """Each row of ``batch`` is its id's clip: the lease's tokens and the clip's own log-mel."""
    import soundfile

    for row, sample_id in enumerate(batch.ids):
        expected_tokens = tokens_of(sample_id)
        assert consumer.arrays["tokens"][row, :len(expected_tokens)].tolist() == expected_tokens
        audio, _ = soundfile.read(str(root / "wavs" / f"{sample_id}.wav"), dtype="float32")
        expected = log_mel_spectrogram_numpy(audio, features, dtype=np.float32)
        assert consumer.arrays["mel_lengths"][row] == expected.shape[0]
        np.testing.assert_allclose(consumer.arrays["mel"][row, :expected.shape[0]], expected, rtol=1e-5, atol=1e-5)


def test_one_producer_serves_two_trainers_each_its_own_leases_and_stop(two_trainers):
    first, second, stop, thread, result, ids, root, features = two_trainers
    welcome(first, features)
    welcome(second, features)
    first.send(lease(1, [ids[0], ids[1]]))
    second.send(lease(1, [ids[2], ids[3]]))  # the same lease id: each trainer's book is its own
    for consumer, mine in ((first, (ids[0], ids[1])), (second, (ids[2], ids[3]))):
        assert consumer.recv(wire.READY).lease == 1
        consumer.send(wire.Credit(1))
        batch = consumer.recv(wire.BATCH)
        assert batch.ids == mine
        check_rows(consumer, batch, root, features)
    first.send(wire.Stop("rank 0 is done"))
    assert first.recv(wire.BYE).leases == ()
    second.send(lease(2, [ids[4]], index=1))  # the other trainer is still served
    assert second.recv(wire.READY).lease == 2
    second.send(wire.Credit(2))
    batch = second.recv(wire.BATCH)
    assert batch.ids == (ids[4],) and thread.is_alive()
    check_rows(second, batch, root, features)
    second.send(wire.Stop("rank 1 is done"))
    second.recv(wire.BYE)
    thread.join(10)
    assert result["code"] == 0


def test_a_stop_signal_says_bye_to_every_trainer_with_its_own_leases(two_trainers):
    first, second, stop, thread, result, ids, root, features = two_trainers
    welcome(first, features)
    welcome(second, features)
    first.send(lease(3, [ids[0]]))
    second.send(lease(4, [ids[1]]))
    first.recv(wire.READY)
    second.recv(wire.READY)
    stop.set()
    assert first.recv(wire.BYE).leases == (3,)
    assert second.recv(wire.BYE).leases == (4,)
    thread.join(10)
    assert result["code"] == 0


def test_trainers_that_make_batches_otherwise_refuse_the_producer_in_one_line(two_trainers, caplog):
    first, second, stop, thread, result, ids, root, features = two_trainers
    welcome(first, features)
    second.recv(wire.HELLO)
    second.send(welcome_of(dataclasses.replace(features, n_mels=32)))
    thread.join(10)
    assert result["code"] == 2
    errors = [r.getMessage() for r in caplog.records if r.name == "producer" and r.levelno >= logging.WARNING]
    assert errors == [f"the trainers at {first.endpoint} and {second.endpoint} make batches with other settings "
                      "(config, batch fields or transforms): a producer serves the ranks of one job"]


def test_a_producer_started_before_its_trainer_reads_the_endpoints_from_one_line():
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, b"tcp://127.0.0.1:5555 tcp://127.0.0.1:5556\nignored")
        assert endpoints_from(read_fd, threading.Event()) == ["tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"]
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_a_producer_whose_trainer_never_bound_has_no_endpoint_at_the_end_of_its_stdin_or_on_stop():
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"tcp://127.0.0.1:5555")  # no end of line: the launcher never finished it
    os.close(write_fd)
    try:
        assert endpoints_from(read_fd, threading.Event()) == []
    finally:
        os.close(read_fd)
    stopped = threading.Event()
    stopped.set()
    read_fd, write_fd = os.pipe()
    try:
        assert endpoints_from(read_fd, stopped) == []
    finally:
        os.close(read_fd)
        os.close(write_fd)
