"""ZeroMQ endpoints as the user writes them (``--bind``, ``--connect``, ``pipeline.bind``, the
Feed's ``bind``), checked whole before any socket sees them.

ZeroMQ itself is lenient in ways that hide the mistake: ``tcp://HOST:99999`` binds some other
port (the number wraps) or connects nowhere forever, and an unknown transport such as
``http://`` surfaces as a ``ZMQError`` in whichever process first uses it. Here an endpoint
is ``tcp://HOST:PORT`` (PORT 1-65535; ``*``, a free port, when binding; HOST a name, an
IPv4 address, ``[IPv6]``, an interface name, or ``*`` when binding), ``ipc://PATH`` or
``inproc://NAME``; anything else is one line saying what is wrong.
"""

from __future__ import annotations

import ipaddress
import re

from .errors import UserError

TRANSPORTS = ("tcp", "ipc", "inproc")
# TCP port numbers are 16 bits; 0 is not a port one can reach (binding it is spelled "*").
PORT_MIN, PORT_MAX = 1, 65535
_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")
_FORM = "tcp://HOST:PORT, ipc://PATH or inproc://NAME"


class EndpointError(UserError, ValueError):
    """An endpoint that cannot be used; the message names it and what is wrong."""


def check_endpoint(endpoint: str, bind: bool) -> str:
    """``endpoint`` unchanged when it can be bound (``bind``) or connected to; EndpointError
    (one line, naming the endpoint) otherwise."""
    problem = _problem(endpoint, bind)
    if problem:
        raise EndpointError(f"{endpoint!r} is not an endpoint to {'bind' if bind else 'connect to'}: {problem}")
    return endpoint


def _problem(endpoint: str, bind: bool) -> str:
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return f"expected {_FORM}"
    if scheme not in TRANSPORTS:
        return f"unsupported transport {scheme!r} (expected {_FORM})"
    if not rest.strip():
        return f"nothing after {scheme}://"
    if scheme != "tcp":
        return ""
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        return "a tcp endpoint is tcp://HOST:PORT"
    if port == "*":
        if not bind:
            return "a port to connect to is a number, not * (that picks a free port when binding)"
    elif not port.isdigit():
        return f"port {port!r} is not a number"
    elif not PORT_MIN <= int(port) <= PORT_MAX:
        return f"port {port} is out of range ({PORT_MIN}-{PORT_MAX}{' or *' if bind else ''})"
    return _host_problem(host, bind)


def _host_problem(host: str, bind: bool) -> str:
    if host == "*":
        return "" if bind else "a host to connect to is a name or an address, not *"
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host} is not an IPv6 address"
        return ""
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{host} is not an IPv4 address"
        return ""
    if ":" in host:
        return f"an IPv6 address is written in brackets: tcp://[{host}]:PORT"
    if not _HOST_NAME.fullmatch(host):
        return f"{host!r} is not a host name"
    return ""
