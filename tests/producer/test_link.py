"""producer/link.py: a producer's connection tells a trainer that refuses it, another service and
no answer yet apart, each with its one line (a real Producer in a thread, or the link alone)."""

from __future__ import annotations

import errno
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth

from stoker.producer import link
from stoker.producer.link import HANDSHAKE_FAILURES_FATAL, Link, Refused
from stoker.producer.worker import Producer
from tests.factories import make_dataset

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


@pytest.mark.parametrize("case", ["wrong server key", "server without keys"])
def test_a_security_mismatch_ends_with_status_2(tmp_path, case):
    from stoker.shared.keys import load_client_keys, make_keys

    make_keys(tmp_path / "keys", ["client"])
    make_keys(tmp_path / "other", [])
    make_dataset(tmp_path / "data", count=2)
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.linger = 0
    if case == "wrong server key":  # the producer holds keys/server.key, the trainer other/server's pair
        public, secret = zmq.auth.load_certificate(str(tmp_path / "other" / "server.key_secret"))
        server.curve_server, server.curve_publickey, server.curve_secretkey = True, public, secret
    endpoint = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    stop = threading.Event()
    producer = Producer(endpoint, tmp_path / "data", "p-keys", stop, context=ctx,
                        keys=load_client_keys(tmp_path / "keys"))
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", producer.run()), daemon=True)
    thread.start()
    try:
        thread.join(20)
        assert result.get("code") == 2
    finally:
        stop.set()
        thread.join(5)
        server.close()
        ctx.term()


def run_producer_against(endpoint: str, tmp_path: Path, ctx: zmq.Context) -> tuple[threading.Event, threading.Thread,
                                                                                 dict]:
    make_dataset(tmp_path / "data", count=2)
    stop = threading.Event()
    producer = Producer(endpoint, tmp_path / "data", "p-wrong", stop, context=ctx)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", producer.run()), daemon=True)
    thread.start()
    return stop, thread, result


def test_an_http_server_at_the_endpoint_is_named_not_a_trainer(tmp_path, monkeypatch, caplog):
    """The peer answered (the web server logs a bad request), so the producer says so and ends
    with status 2, instead of waiting for a trainer that is not there."""
    import http.server

    monkeypatch.setattr(link, "HANDSHAKE_TIMEOUT_S", 0.5)
    requests: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            requests.append(format % args)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"tcp://127.0.0.1:{server.server_address[1]}"
    ctx = zmq.Context()
    stop, thread, result = run_producer_against(endpoint, tmp_path, ctx)
    try:
        thread.join(20)
        assert result.get("code") == 2
        said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert said == [f"{endpoint} answered, but not as a stoker trainer (it accepted the connection but did not "
                        "answer ZeroMQ's greeting in 0.5 s: another service, such as a web server, listens there): "
                        "is this the trainer's endpoint?"]
        assert any("400" in r for r in requests)  # the server did answer
    finally:
        stop.set()
        thread.join(5)
        server.shutdown()
        server.server_close()
        ctx.term()


def test_a_zeromq_peer_of_another_kind_is_named_not_a_trainer(tmp_path, caplog):
    """A PUB socket takes the connection and drops it (DEALER does not pair with PUB)."""
    ctx = zmq.Context()
    other = ctx.socket(zmq.PUB)
    other.linger = 0
    endpoint = f"tcp://127.0.0.1:{other.bind_to_random_port('tcp://127.0.0.1')}"
    stop, thread, result = run_producer_against(endpoint, tmp_path, ctx)
    try:
        thread.join(20)
        assert result.get("code") == 2
        said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert said == [f"{endpoint} answered, but not as a stoker trainer (it speaks ZeroMQ, but with a socket of "
                        "another kind): is this the trainer's endpoint?"]
    finally:
        stop.set()
        thread.join(5)
        other.close()
        ctx.term()


def test_nothing_listening_is_no_answer_yet(tmp_path, monkeypatch, caplog):
    """Nothing listens at the endpoint: the producer keeps waiting, and its waiting note says no
    answer came, not that a connection was accepted there (the note's other branch)."""
    monkeypatch.setattr(link, "WAITING_NOTE_S", 0.3)
    caplog.set_level("INFO", logger="producer")
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))  # a port that is ours and listens to nothing
    endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    ctx = zmq.Context()
    stop, thread, result = run_producer_against(endpoint, tmp_path, ctx)
    def notes() -> list[str]:
        return [r.getMessage() for r in caplog.records if "waiting for the trainer at" in r.getMessage()]

    try:
        deadline = time.monotonic() + 20
        while not notes() and time.monotonic() < deadline:
            thread.join(0.1)
        said = notes()
        assert said, caplog.text
        no_answer = re.compile(rf"p-wrong: waiting for the trainer at {re.escape(endpoint)} \(no answer for \d+ s\)")
        assert all(no_answer.fullmatch(note) for note in said), said
        assert "answered" not in caplog.text
        assert thread.is_alive()
    finally:
        stop.set()
        thread.join(5)
        probe.close()
        ctx.term()




def test_a_keyless_producer_whose_handshakes_are_closed_names_the_trainers_keys_and_the_wrong_endpoint():
    """A trainer using --keys may close a keyless producer's link without libzmq reporting the
    mechanism mismatch: the one line names that cause beside a wrong endpoint."""
    keyless = Link(zmq.Context.instance(), "tcp://127.0.0.1:9", "p-test", "h", None, lambda session: None)
    closed = {"event": zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, "value": errno.ECONNRESET}
    for _ in range(HANDSHAKE_FAILURES_FATAL - 1):
        keyless.on_monitor_event({"event": zmq.EVENT_CONNECTED, "value": 0})
        keyless.on_monitor_event(closed)  # retried: a trainer may be restarting
    keyless.on_monitor_event({"event": zmq.EVENT_CONNECTED, "value": 0})
    with pytest.raises(Refused) as caught:
        keyless.on_monitor_event(closed)
    assert str(caught.value) == ("tcp://127.0.0.1:9 closed the connection during ZeroMQ's handshake: the trainer uses "
                                 "--keys: pass --keys DIR with server.key and a client key pair, or it is not a stoker "
                                 "trainer's endpoint")


def test_a_link_dropped_after_the_trainers_silence_connects_again_only_after_its_back_off():
    """drop() closes at once and returns (a producer's other links are served meanwhile);
    reopen() connects again and says HELLO once the back-off is over, which doubles."""
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.linger = 0
    server.rcvtimeo = 10000
    server.setsockopt(zmq.ROUTER_HANDOVER, 1)  # as the coordinator's: the link comes back with its identity
    endpoint = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    from stoker.shared import wire

    hello = wire.Hello(producer="p", host="h", pid=1, config=wire.ConfigSchema.local(), launcher=1, session="",
                       dataset=None)
    one = Link(ctx, endpoint, "p-test", "h", None, lambda session: hello)
    try:
        one.open()
        one.drop(now=100.0)
        assert one.sock.closed and one.reopen_at == 100.0 + link.RECONNECT_MIN_S
        assert one.backoff == 2 * link.RECONNECT_MIN_S
        one.reopen(now=100.0)  # the back-off is not over
        assert one.sock.closed
        one.reopen(now=100.0 + link.RECONNECT_MIN_S)
        assert not one.sock.closed and one.reopen_at is None
        for _ in range(100):  # the HELLO leaves once the connection is up, within 10 s
            if server.poll(0):
                break
            one.on_events(dict(one.poller.poll(100)))
            one.court(time.monotonic())  # as a producer's io thread: HELLO again until joined
        assert wire.read(server.recv_multipart()[1:])[0] == hello
    finally:
        one.close()
        server.close()
        ctx.term()
