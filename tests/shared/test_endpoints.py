"""Endpoints checked whole: one line for each kind of mistake, at every door (--connect,
--bind / pipeline.bind, the Feed's bind), before any socket or process."""

from __future__ import annotations

import pytest

from stoker.shared.endpoints import EndpointError, check_endpoint


@pytest.mark.parametrize("endpoint, bind", [
    ("tcp://127.0.0.1:5555", False), ("tcp://trainer-01.example:1", False), ("tcp://[::1]:65535", False),
    ("tcp://0.0.0.0:*", True), ("tcp://*:5555", True), ("tcp://eth0:*", True), ("tcp://[fe80::1]:*", True),
    ("ipc:///tmp/stoker.sock", False), ("ipc:///tmp/stoker.sock", True), ("inproc://feed", True),
])
def test_endpoints_zeromq_can_use_pass_unchanged(endpoint, bind) -> None:
    assert check_endpoint(endpoint, bind) == endpoint


@pytest.mark.parametrize("endpoint, bind, said", [
    ("http://127.0.0.1:8000", False, "unsupported transport 'http' (expected tcp://HOST:PORT, ipc://PATH or "
                                     "inproc://NAME)"),
    ("127.0.0.1:5555", False, "expected tcp://HOST:PORT, ipc://PATH or inproc://NAME"),
    ("tcp://127.0.0.1:99999", False, "port 99999 is out of range (1-65535)"),
    ("tcp://127.0.0.1:99999", True, "port 99999 is out of range (1-65535 or *)"),
    ("tcp://127.0.0.1:0", True, "port 0 is out of range (1-65535 or *)"),
    ("tcp://127.0.0.1:*", False, "a port to connect to is a number, not * (that picks a free port when binding)"),
    ("tcp://127.0.0.1:http", False, "port 'http' is not a number"),
    ("tcp://127.0.0.1", False, "a tcp endpoint is tcp://HOST:PORT"),
    ("tcp://:5555", True, "a tcp endpoint is tcp://HOST:PORT"),
    ("tcp://*:5555", False, "a host to connect to is a name or an address, not *"),
    ("tcp://127.0.0.256:5555", False, "127.0.0.256 is not an IPv4 address"),
    ("tcp://::1:5555", False, "an IPv6 address is written in brackets: tcp://[::1]:PORT"),
    ("tcp://[::g]:5555", False, "[::g] is not an IPv6 address"),
    ("tcp://host name:5555", False, "'host name' is not a host name"),
    ("ipc://", True, "nothing after ipc://"),
])
def test_a_wrong_endpoint_is_one_line_naming_it_and_the_fault(endpoint, bind, said) -> None:
    with pytest.raises(EndpointError) as caught:
        check_endpoint(endpoint, bind)
    role = "bind" if bind else "connect to"
    assert str(caught.value) == f"{endpoint!r} is not an endpoint to {role}: {said}"


def test_the_command_line_and_the_feed_say_the_one_line(capsys) -> None:
    from stoker import Feed
    from stoker.cli import main
    from stoker.feed import FeedError

    assert main(["produce", "--connect", "http://127.0.0.1:8000"]) == 2
    assert capsys.readouterr().err == ("stoker: error: --connect: 'http://127.0.0.1:8000' is not an endpoint to "
                                       "connect to: unsupported transport 'http' (expected tcp://HOST:PORT, "
                                       "ipc://PATH or inproc://NAME)\n")
    assert main(["--bind", "tcp://127.0.0.1:99999", "--steps", "1"]) == 2
    assert capsys.readouterr().err == ("stoker: error: pipeline.bind (--bind): 'tcp://127.0.0.1:99999' is not an "
                                       "endpoint to bind: port 99999 is out of range (1-65535 or *)\n")
    with pytest.raises(FeedError, match=r"^stoker.Feed: pipeline.bind: 'tcp://127.0.0.1:99999' is not an "
                                        r"endpoint to bind: port 99999 is out of range"):
        Feed(bind="tcp://127.0.0.1:99999", steps=1)
