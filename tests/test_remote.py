"""Producers on other hosts, end to end: real ``run.py`` and ``run.py produce`` processes.

On loopback: producers joining and leaving mid-epoch, kill -9 of one, a producer with
another dataset refused, a copy missing a clip, CURVE, and a fuzzer. Every run uses the
numpy features and a synthetic trainer (no TensorFlow), and waits only on log lines and
exits, each with a generous deadline. These tests assert what happened and in which order;
how soon a producer is leased work or presumed dead is tested on a virtual clock
(tests/consumer/coordinator/test_peers.py).
"""

from __future__ import annotations

import re
import shutil
import signal
import threading
import traceback
from pathlib import Path
from typing import Callable

import msgpack
import numpy as np
import psutil
import pytest
import zmq

from stoker.shared import wire
from stoker.shared.dataset.agreement import describe_copy
from stoker.shared.dataset.corpus.registry import read_metadata
from stoker.shared.dataset.files import DEMO_DATA_DIR
from stoker.shared.keys import make_keys
from tests.factories import make_dataset
from tests.procs import RunProcess, read_json, read_jsonl, run_cli
from tests.test_resume import gated_producer
from tests.trained import check_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

NUMPY_FEATURES = ["--set", "features.backend=numpy"]
# A heartbeat timeout no test here reaches: a producer is presumed dead because its connection
# closed, never because a loaded host kept it (or the trainer) from speaking for a while.
QUIET_HEARTBEAT = ["--set", "pipeline.heartbeat_timeout_s=600"]
# For the test of a trainer that went silent: its producers notice after 1.5 s.
FAST_HEARTBEAT = ["--set", "pipeline.heartbeat_interval_s=0.3", "--set", "pipeline.heartbeat_timeout_s=1.5"]
# Seconds allowed for start-up of a run.py process (interpreter, imports, dataset scan).
START_S = 60
DEMO_IDS = {e.id for e in read_metadata(DEMO_DATA_DIR)[0]}
# The join test's first producer prepares this many batches (half of the first epoch), then
# none until the remote one has left: the run cannot end before that, however fast the host.
GATE_BATCHES = 4


def trainer(run_dir: Path, *args: str, heartbeat: list[str] = QUIET_HEARTBEAT,
            prefix: list[str] | None = None) -> RunProcess:
    return RunProcess("--model", "synthetic:100", "--batch-size", "8", "--record-samples", "--model-start-delay",
                      "0.2", "--run-dir", str(run_dir), "--set", "trainer.log_every_steps=4", *NUMPY_FEATURES,
                      *heartbeat, *args, prefix=prefix)


def produce(endpoint: str, *args: str, prefix: list[str] | None = None) -> RunProcess:
    return RunProcess("produce", "--connect", endpoint, "--producers", "1", *args, prefix=prefix)


def endpoint_of(run: RunProcess) -> str:
    line = run.wait_for_line(r"consumer listening on tcp://", START_S)
    return re.search(r"(tcp://\S+)", line).group(1)


def producers_by_id(summary: dict) -> dict[str, dict]:
    return {p["id"]: p for p in summary["producers"]}


def partial_copy(to: Path, drop: str) -> Path:
    shutil.copytree(DEMO_DATA_DIR, to)
    (to / "wavs" / f"{drop}.wav").unlink()
    return to


def one_error_line(run: RunProcess) -> str:
    errors = [line for line in run.lines if line.startswith("stoker: error:")]
    assert len(errors) == 1, run.output()
    assert not any("Traceback" in line for line in run.lines), run.output()
    return errors[0]


# ---------------------------------------------------------------- join, leave, die
def test_remote_producer_joins_and_leaves_mid_epoch(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    with trainer(run_dir, "--epochs", "10", "--producers", "0") as run:
        endpoint = endpoint_of(run)
        with gated_producer(endpoint, GATE_BATCHES, monkeypatch) as gate:
            run.wait_for_line(r"step 4/", START_S)
            with produce(endpoint) as remote:
                leased = remote.wait_for_line(r"first lease [0-9.]+ s after connecting", START_S)
                delivered = remote.wait_for_line(r"first batch delivered", START_S)
                assert remote.lines.index(leased) < remote.lines.index(delivered)
                run.wait_for_line(r"producer p0@\S+ joined", START_S)
                remote.proc.send_signal(signal.SIGINT)  # Ctrl-C: its leases come back at once (BYE)
                assert remote.wait(timeout=30) == 130, remote.output()
            left = run.wait_for_line(r"producer p0@\S+ left, returning \d+ leases", START_S)
            gate.set()  # the first producer trains the rest
            assert run.wait(timeout=90) == 0, run.output()
    assert "presumed dead" not in "\n".join(run.lines)  # it left; nobody had to time out
    summary = read_json(run_dir / "summary.json")
    assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == 10
    check_run(run_dir, 10, DEMO_IDS)
    remote_stats = next(p for p in summary["producers"] if p["id"].startswith("p0@"))
    assert remote_stats["status"] == "left" and remote_stats["batches"] >= 1, summary["producers"]
    assert left


def test_kill_9_of_a_remote_producer_loses_nothing(tmp_path):
    run_dir = tmp_path / "run"
    with trainer(run_dir, "--epochs", "8", "--producers", "0") as run:
        endpoint = endpoint_of(run)
        with produce(endpoint) as victim, produce(endpoint) as survivor:
            for remote in (victim, survivor):
                remote.wait_for_line(r"first batch delivered", START_S)
            launcher = psutil.Process(victim.proc.pid)
            child = launcher.children()[0]
            launcher.suspend()  # so that it cannot restart the child before it is gone too
            child.kill()
            launcher.kill()
            victim.wait(timeout=10)
            # the kernel closed its connection: presumed dead for that (the heartbeat timeout is out of reach)
            line = run.wait_for_line(r"connection of producer \S+ closed without BYE: presumed dead", START_S)
            assert run.wait(timeout=90) == 0, run.output()
            assert survivor.wait(timeout=15) == 0, survivor.output()  # the trainer's STOP ended it
    summary = read_json(run_dir / "summary.json")
    assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == 8
    check_run(run_dir, 8, DEMO_IDS)
    dead = [f for f in summary["failovers"] if f["status"] == "dead"]
    assert len(dead) == 1 and dead[0]["reissued"] >= 1, summary["failovers"]
    assert f"connection of producer {dead[0]['producer']} closed without BYE" in line  # the victim, for that
    assert not [x for x in run.lines if re.search(r"silent for [0-9.]+ s: presumed dead", x)]


def test_one_remote_producer_serves_two_trainers_and_leaves_when_both_said_stop(tmp_path):
    """``run.py produce --connect A --connect B`` (the ranks of a job elsewhere): one producer
    process has a link to each trainer, each trains every clip once per epoch from it, and it
    exits once both have said STOP, the first STOP leaving the other trainer served."""
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    with trainer(first_dir, "--epochs", "2", "--producers", "0") as first, \
            trainer(second_dir, "--epochs", "4", "--producers", "0") as second:
        endpoints = [endpoint_of(first), endpoint_of(second)]
        with RunProcess("produce", "--connect", endpoints[0], "--connect", endpoints[1], "--producers", "1") as remote:
            assert first.wait(timeout=90) == 0, first.output()
            stopped = remote.wait_for_line(r"consumer says stop \(" + re.escape(endpoints[0]), START_S)
            assert second.wait(timeout=90) == 0, second.output()  # trained on by the same producer
            assert remote.wait(timeout=30) == 0, remote.output()
    assert remote.lines.index(stopped) < remote.lines.index(
        next(line for line in remote.lines if re.search(r"consumer says stop \(" + re.escape(endpoints[1]), line)))
    check_run(first_dir, 2, DEMO_IDS)
    check_run(second_dir, 4, DEMO_IDS)
    served = [read_json(d / "summary.json")["producers"] for d in (first_dir, second_dir)]
    assert [len(s) for s in served] == [1, 1] and served[0][0]["pid"] == served[1][0]["pid"], served
    assert served[0][0]["batches"] >= 1 and served[1][0]["batches"] >= 1


def test_remote_producer_rejoins_a_restarted_trainer(tmp_path):
    with trainer(tmp_path / "first", "--steps", "100000", "--producers", "0", heartbeat=FAST_HEARTBEAT) as first:
        endpoint = endpoint_of(first)
        with produce(endpoint) as remote:
            remote.wait_for_line(r"first batch delivered", START_S)
            # the trainer crashes: no STOP reaches the producer
            consumer = next(p for p in psutil.Process(first.proc.pid).children()
                            if "stoker.consumer.training.main" in " ".join(p.cmdline()))
            consumer.kill()
            first.kill()
            remote.wait_for_line(r"consumer silent for [0-9.]+ s; dropping \d+ leases and reconnecting", START_S)
            run_dir = tmp_path / "second"
            with trainer(run_dir, "--epochs", "2", "--producers", "0", "--bind", endpoint) as second:
                assert endpoint_of(second) == endpoint
                second.wait_for_line(r"producer p0@\S+ joined", 30)
                assert second.wait(timeout=60) == 0, second.output()
                assert remote.wait(timeout=15) == 0, remote.output()
    check_run(run_dir, 2, DEMO_IDS)


# ---------------------------------------------------------------- dataset agreement
def test_another_dataset_is_refused_and_a_clip_missing_everywhere_is_rejected(tmp_path):
    other = tmp_path / "other"
    make_dataset(other, count=6)
    partial = partial_copy(tmp_path / "partial", "DEMO-0005")
    with open(partial / "wavs" / "DEMO-0003.wav", "ab") as f:  # another size: not the trainer's file
        f.write(b"\0\0")
    run_dir = tmp_path / "run"
    with trainer(run_dir, "--epochs", "2", "--producers", "0") as run:
        endpoint = endpoint_of(run)
        with produce(endpoint, "--data", str(other)) as stranger:
            assert stranger.wait(timeout=30) == 2, stranger.output()
        line = one_error_line(stranger)
        assert f"the trainer at {endpoint} refused this producer: dataset on" in line
        assert "metadata.csv differs (SHA-256" in line
        run.wait_for_line(r"refused producer p0@\S+ from \S+: dataset on .* metadata.csv differs", 10)
        with produce(endpoint, "--data", str(partial)) as remote:
            # it joins at once (its copy's metadata is the trainer's); its files are checked as it reads them
            run.wait_for_line(r"joined from .*checked against the trainer's as it reads them", START_S)
            run.wait_for_line(r"does not have DEMO-0003 \(wavs/DEMO-0003.wav is \d+ bytes on this host and \d+ on "
                              r"the trainer", START_S)
            assert run.wait(timeout=60) == 0, run.output()
            remote.wait(timeout=15)
    summary = read_json(run_dir / "summary.json")
    assert summary["refused_producers"][0]["reason"] in line
    check_run(run_dir, 2, DEMO_IDS - {"DEMO-0003", "DEMO-0005"})
    rejected = read_jsonl(run_dir / "rejected.jsonl")
    # once, although both epochs planned them (a producer-side rejection is recorded once per run)
    assert sorted(r["id"] for r in rejected) == ["DEMO-0003", "DEMO-0005"]
    assert all("missing on every producer host" in r["reason"] for r in rejected)
    resized, = (r["reason"] for r in rejected if r["id"] == "DEMO-0003")
    assert re.search(r"wavs/DEMO-0003.wav is \d+ bytes on this host and \d+ on the trainer", resized), resized
    assert summary["rejected"] == 2 and summary["epochs_completed"] == 2
    remote_stats, = summary["producers"]
    # each missed once per lease out when the first miss came back (one per epoch at most), then not leased again
    assert remote_stats["lacks"] == 2 and 2 <= remote_stats["misses"] <= 4


# ---------------------------------------------------------------- CURVE
def test_curve_an_unauthorised_producer_delivers_nothing_an_authorised_one_trains(tmp_path):
    keys, strangers = tmp_path / "keys", tmp_path / "strangers"
    result = run_cli("keys", str(keys))
    assert result.returncode == 0 and "authorized" in result.stdout, result.stderr
    make_keys(strangers, ["client"])
    intruder_keys = tmp_path / "intruder"
    intruder_keys.mkdir()
    shutil.copy(keys / "server.key", intruder_keys)  # the right server, a key it does not allow
    for name in ("client.key", "client.key_secret"):
        shutil.copy(strangers / name, intruder_keys)
    run_dir = tmp_path / "run"
    with trainer(run_dir, "--epochs", "2", "--producers", "0", "--keys", str(keys)) as run:
        endpoint = endpoint_of(run)
        with produce(endpoint, "--keys", str(intruder_keys)) as intruder:
            assert intruder.wait(timeout=30) == 2, intruder.output()
        assert "rejected this producer's CURVE key" in one_error_line(intruder)
        with produce(endpoint) as plain:
            assert plain.wait(timeout=30) == 2, plain.output()
        assert "the trainer uses --keys" in one_error_line(plain)
        with produce(endpoint, "--keys", str(keys)) as good:
            assert run.wait(timeout=60) == 0, run.output()
            good.wait(timeout=15)
    summary = read_json(run_dir / "summary.json")
    assert len(summary["producers"]) == 1 and summary["producers"][0]["batches"] == 16
    assert summary["rejected_messages"]["unauthenticated"] >= 1
    assert summary["rejected_messages"]["handshake_failed"] >= 1
    check_run(run_dir, 2, DEMO_IDS)
    secrets = [line.split('"')[1] for path in (keys / "server.key_secret", keys / "client.key_secret")
               for line in path.read_text().splitlines() if "secret-key" in line]
    assert len(secrets) == 2
    written = "".join(p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file())
    logs = "\n".join(run.lines + intruder.lines + plain.lines + good.lines)
    for secret in secrets:
        assert secret not in written and secret not in logs


# ---------------------------------------------------------------- hostile peers
FUZZ_EACH = 1000
# The run cannot end while the fuzzer's peer holds leases (it returns them with its BYE, after
# everything it sent was read), so the run need only be long enough to train while it fuzzes.
FUZZ_EPOCHS = 8
# The fuzzer's sockets wait this long, at most, for their messages to leave or an answer to come.
FUZZ_LINGER_MS = 30000
# The fuzzer's whole work: 6,000 messages, 1,002 of them answered, on a loaded 2-core machine.
FUZZ_JOIN_S = 120
# The fuzzer's peer sends a heartbeat after this many messages on its other sockets, so that it
# is never silent for the run's heartbeat timeout (a peer presumed dead loses its leases).
FUZZ_BEAT_EVERY = 100


def fuzz(endpoint: str, dataset: dict, report: dict) -> None:
    """From a peer that registers first and keeps the leases it is given (so the run cannot
    end before the fuzzer is done): FUZZ_EACH messages of each malformed kind, oversized
    frames, and batches for leases never issued; then it leaves, returning its leases."""
    ctx = zmq.Context()
    socks = []

    def dealer() -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = FUZZ_LINGER_MS  # everything sent must arrive, to be counted
        sock.sndtimeo = sock.rcvtimeo = FUZZ_LINGER_MS
        sock.connect(endpoint)
        socks.append(sock)
        return sock

    try:
        peer = dealer()
        held: list[int] = []

        def read_until(done: Callable[[wire.Body], bool]) -> None:
            while True:
                msg, _ = wire.read(peer.recv_multipart())
                if isinstance(msg, wire.Lease):
                    held.append(msg.lease)
                if done(msg):
                    return

        def beat() -> None:  # a peer silent for the heartbeat timeout would lose its leases
            peer.send_multipart(wire.Heartbeat(ready=0, working=0).encode())

        peer.send_multipart(wire.Hello(producer="fuzzer", host="fuzz", pid=1, config=wire.ConfigSchema.local(),
                                       dataset=dataset).encode())
        read_until(lambda msg: isinstance(msg, wire.Lease))  # its WELCOME, then its first lease
        rng = np.random.default_rng(0)
        garbage = dealer()
        for i in range(FUZZ_EACH):
            garbage.send(b"\xc1" + rng.bytes(int(rng.integers(0, 40))))  # 0xc1 is never msgpack
            garbage.send(msgpack.packb({"v": wire.PROTOCOL_VERSION, "k": f"nope{i % 7}", "a": []}))
            garbage.send_multipart([msgpack.packb({"v": wire.PROTOCOL_VERSION, "k": "batch",
                                                   "a": [["mel", "float32", [10, 10]]]}), b"short"])
            if i % FUZZ_BEAT_EVERY == 0:
                beat()
        # A stranger's heartbeat is answered with a REFUSE that asks for a HELLO: the answer proves
        # that the coordinator has read everything sent before it on this connection.
        garbage.send_multipart(wire.Heartbeat(ready=0, working=0).encode())
        refused, _ = wire.read(garbage.recv_multipart())
        assert isinstance(refused, wire.Refuse) and refused.rejoin, refused
        elder = dealer()  # a producer of another protocol version, each HELLO refused in its own
        for i in range(FUZZ_EACH):
            elder.send(msgpack.packb({"v": 99, "k": "hello", "a": []}))
            header = msgpack.unpackb(elder.recv_multipart()[0])
            assert (header["v"], header["k"]) == (99, "refuse"), header
            if i % FUZZ_BEAT_EVERY == 0:
                beat()
        for _ in range(3):  # each above pipeline.max_message_mb=1: the socket closes that connection
            dealer().send(b"\0" * (2 << 20))
            beat()
        for i in range(FUZZ_EACH):
            lease = 10 ** 9 + i
            peer.send_multipart(wire.Batch(lease, 0, 0, ()).encode())
            peer.send_multipart(wire.Ready(lease).encode())
        # The pong to this ping proves the coordinator has read everything the peer sent before it.
        # (Closing a socket with unread input resets the connection, losing what is still in flight.)
        peer.send_multipart(wire.Heartbeat(ready=0, working=0, ping=-1.0).encode())
        read_until(lambda msg: isinstance(msg, wire.Heartbeat) and msg.pong == -1.0)
        peer.send_multipart(wire.Bye(tuple(held)).encode())
        report["ok"] = True
    except BaseException:  # reported to the test thread
        report["error"] = traceback.format_exc()
    finally:
        for sock in socks:
            sock.close()
        ctx.term()


@pytest.mark.timeout(300)
def test_fuzz_thousands_of_malformed_messages_while_training(tmp_path):
    run_dir = tmp_path / "run"
    with trainer(run_dir, "--epochs", str(FUZZ_EPOCHS), "--producers", "1",
                 "--set", "pipeline.max_message_mb=1") as run:
        endpoint = endpoint_of(run)
        run.wait_for_line(r"step 4/", START_S)
        report: dict = {}
        thread = threading.Thread(target=fuzz, args=(endpoint, describe_copy(DEMO_DATA_DIR), report),
                                  daemon=True)
        thread.start()
        thread.join(FUZZ_JOIN_S)
        if not report.get("ok"):
            run.output()  # collects the lines read so far
            about = [line for line in run.lines if "fuzz" in line or "presumed" in line or "refus" in line]
            raise AssertionError(f"{report.get('error')}\n" + "\n".join(about[-40:]))
        assert run.wait(timeout=90) == 0, run.output()
    summary = read_json(run_dir / "summary.json")
    dropped = summary["rejected_messages"]
    assert dropped["not_msgpack"] == FUZZ_EACH
    assert dropped["bad_version"] == FUZZ_EACH
    assert dropped["bad_kind"] == FUZZ_EACH
    assert dropped["size_mismatch"] == FUZZ_EACH
    assert dropped["unknown_lease"] >= 2 * FUZZ_EACH, str(dropped) + "\n" + run.output()
    assert dropped["connection_dropped"] >= 3
    assert summary["exit_reason"] == "completed"
    check_run(run_dir, FUZZ_EPOCHS, DEMO_IDS)
