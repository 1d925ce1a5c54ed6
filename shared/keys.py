"""CURVE keys: who may connect to a trainer, and how a producer proves it may.

:func:`make_keys` writes ``python run.py keys DIR``'s pairs and allow-list;
:func:`load_server_keys` and :func:`load_client_keys` read them for ``--keys DIR``. The files,
who gets which, and what is never logged: docs/design/protocol.md, "Security".
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from .errors import UserError

log = logging.getLogger(__name__)

SERVER = "server"
DEFAULT_CLIENT = "client"
AUTHORIZED_DIR = "authorized"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
# Client names become file names: keep them plain.
CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# Public keys are named in logs by this many Z85 characters (of 40): enough to tell
# keys apart, and a public key is not a secret anyway.
KEY_PREFIX_CHARS = 8
SECRET_MODE = 0o600
DIR_MODE = 0o700


class KeysError(UserError):
    """Keys that cannot be made or used; the message is one line for the user."""


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    authorized_dir: Path
    allowed: int  # public keys in the allow-list

    def __repr__(self) -> str:  # never show the secret, even in a traceback or debug log
        return f"ServerKeys(public={short(self.public)}, authorized_dir={self.authorized_dir}, allowed={self.allowed})"


@dataclass(frozen=True)
class ClientKeys:
    name: str
    public: bytes
    secret: bytes
    server_public: bytes

    def __repr__(self) -> str:
        return f"ClientKeys(name={self.name}, public={short(self.public)}, server={short(self.server_public)})"


def short(public_key: bytes) -> str:
    return public_key[:KEY_PREFIX_CHARS].decode("ascii", "replace") + "..."


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise KeysError("this ZeroMQ library was built without CURVE security; --keys needs it")


def _load(path: Path, want_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise KeysError(f"cannot read key file {path}: {exc}") from None
    if want_secret and not secret:
        raise KeysError(f"{path} holds no secret key")
    if not public:
        raise KeysError(f"{path} holds no public key")
    return public, secret


def make_keys(directory: Path, clients: list[str]) -> list[str]:
    """Create the server pair and one pair per client (keeping existing ones); return report lines."""
    _require_curve()
    for name in clients:
        if not CLIENT_NAME.fullmatch(name) or name == SERVER:
            raise KeysError(f"client name {name!r}: use letters, digits, '.', '_' or '-' (not 'server')")
    authorized = directory / AUTHORIZED_DIR
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        authorized.mkdir(exist_ok=True, mode=DIR_MODE)
    except OSError as exc:
        raise KeysError(f"cannot create key directory {directory}: {exc.strerror}") from None
    report = []
    for name in [SERVER, *clients]:
        public, secret = directory / f"{name}{PUBLIC_SUFFIX}", directory / f"{name}{SECRET_SUFFIX}"
        if secret.exists():
            report.append(f"kept     {secret} (exists)")
        else:
            try:
                zmq.auth.create_certificates(str(directory), name)
                os.chmod(secret, SECRET_MODE)
            except OSError as exc:
                raise KeysError(f"cannot write keys in {directory}: {exc.strerror}") from None
            report.append(f"created  {public} and {secret}")
        if name != SERVER:
            allowed = authorized / f"{name}{PUBLIC_SUFFIX}"
            if not allowed.exists():
                shutil.copyfile(public, allowed)
                report.append(f"allowed  {allowed}")
    return report


def load_server_keys(directory: Path) -> ServerKeys:
    _require_curve()
    if not directory.is_dir():
        raise KeysError(f"key directory {directory} does not exist (make one with: python run.py keys DIR)")
    public, secret = _load(directory / f"{SERVER}{SECRET_SUFFIX}", want_secret=True)
    authorized = directory / AUTHORIZED_DIR
    allowed = sorted(authorized.glob(f"*{PUBLIC_SUFFIX}")) if authorized.is_dir() else []
    if not allowed:
        raise KeysError(f"{authorized} holds no client public key (*.key): no producer could connect")
    for path in allowed:
        _load(path, want_secret=False)  # a broken file is an error now, not a silent refusal later
    assert secret is not None
    return ServerKeys(public=public, secret=secret, authorized_dir=authorized, allowed=len(allowed))


def load_client_keys(directory: Path) -> ClientKeys:
    _require_curve()
    if not directory.is_dir():
        raise KeysError(f"key directory {directory} does not exist (copy server.key and a client key pair there)")
    server_public, _ = _load(directory / f"{SERVER}{PUBLIC_SUFFIX}", want_secret=False)
    default = directory / f"{DEFAULT_CLIENT}{SECRET_SUFFIX}"
    if default.exists():
        path = default
    else:
        candidates = sorted(p for p in directory.glob(f"*{SECRET_SUFFIX}") if p.name != f"{SERVER}{SECRET_SUFFIX}")
        if len(candidates) != 1:
            found = ", ".join(p.name for p in candidates) or "none"
            raise KeysError(f"{directory} must hold one producer secret key ({DEFAULT_CLIENT}{SECRET_SUFFIX}, or "
                            f"exactly one other *{SECRET_SUFFIX}); found: {found}")
        path = candidates[0]
    public, secret = _load(path, want_secret=True)
    assert secret is not None
    return ClientKeys(name=path.name[:-len(SECRET_SUFFIX)], public=public, secret=secret, server_public=server_public)
