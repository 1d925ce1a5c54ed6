"""An S3-compatible server on loopback for tests (moto's server mode, in a thread of the test
process, on a free port), and a TCP proxy in front of it that drops connections in the middle
of a response, as a flaky network does. Both stop when their ``with`` block ends."""

from __future__ import annotations

import contextlib
import os
import re
import select
import socket
import struct
import threading
import urllib.request
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

# The fake credentials moto accepts; the endpoint variable is how every S3 client finds the server.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


_RANGE = re.compile(rb"(?i)\r\nrange: *bytes=(\d+)-")


# A proxied connection idle this long is closed (a test never waits on one).
IDLE_S = 30.0


class S3Server:
    """moto's S3 on 127.0.0.1 (a free port); ``env`` points clients at it (or at ``proxy``)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer  # the test extra's; only these tests need it

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint = ""

    def __enter__(self) -> "S3Server":
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        # moto keeps its buckets in process-wide state that outlives a server: start empty, not
        # with what an earlier test of this process uploaded
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST"),
                               timeout=10).close()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.stop()

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint or self.endpoint}

    @contextlib.contextmanager
    def client(self, **more: str) -> Iterator[None]:
        """This process as the server's client: its variables (and ``more``) in the environment,
        and no S3 filesystem of fsspec's instance cache made for an earlier server reused."""
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        try:
            with mock.patch.dict(os.environ, {**self.env(), **more}):
                yield
        finally:
            s3fs.S3FileSystem.clear_instance_cache()

    def upload(self, directory: Path, bucket: str, prefix: str) -> None:
        """Every file of ``directory`` to ``s3://bucket/prefix/NAME`` (the bucket made first)."""
        import boto3  # moto's own dependency

        client = boto3.client("s3", endpoint_url=self.endpoint, **{
            "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "region_name": CREDENTIALS["AWS_DEFAULT_REGION"]})
        client.create_bucket(Bucket=bucket)
        for path in sorted(directory.iterdir()):
            if path.is_file():
                client.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=path.read_bytes())


def use_env(env: dict[str, str], monkeypatch: Any) -> None:
    """Point this process's S3 clients at ``env``'s server (fsspec's cached clients forgotten)."""
    import s3fs

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()


class DroppingProxy:
    """A TCP proxy on 127.0.0.1 (a free port) to ``target``; once armed with ``drops``, each
    response to a ranged GET from past a file's start (a member's read, not a shard's listing,
    which starts at byte 0; with ``from_start``, a ranged GET from byte 0 too: a loose file's
    whole read) that passes ``after_bytes`` is cut there (a reset), until that many were cut.
    ``done`` is set when the last armed drop happened; ``received`` counts the bytes of responses
    passed on (what readers fetched)."""

    def __init__(self, target: str, after_bytes: int = 16 << 10, from_start: bool = False) -> None:
        host, port = target.rsplit("://", 1)[-1].split(":")
        self.target = (host, int(port))
        self.after_bytes = after_bytes
        self.from_start = from_start
        self.dropped = 0
        self.received = 0
        self.done = threading.Event()
        self._left = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    def arm(self, drops: int) -> None:
        with self._lock:
            self._left = drops
            self.done.clear()

    def __enter__(self) -> "DroppingProxy":
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()
        self._threads.append(accept)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:  # the listener closed: the proxy stops
                return
            thread = threading.Thread(target=self._pump, args=(client,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _take_drop(self) -> bool:
        with self._lock:
            if self._left <= 0:
                return False
            self._left -= 1
            self.dropped += 1
            if self._left == 0:
                self.done.set()
            return True

    def _pump(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=IDLE_S)
        except OSError:
            client.close()
            return
        passed, droppable = 0, False
        try:
            while not self._stop.is_set():
                readable, _, _ = select.select([client, upstream], [], [], IDLE_S)
                if not readable:
                    return
                for sock in readable:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    if sock is client:  # a request: its response is counted from its first byte
                        ranged = _RANGE.search(data)
                        if ranged is not None or data.startswith((b"GET", b"HEAD", b"PUT")):
                            passed, droppable = 0, ranged is not None and (self.from_start or int(ranged[1]) > 0)
                        upstream.sendall(data)
                        continue
                    if droppable and passed + len(data) > self.after_bytes and self._take_drop():
                        client.sendall(data[:max(0, self.after_bytes - passed)])
                        # a reset, not a clean close: the reader sees its response cut mid-body
                        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        return
                    passed += len(data)
                    with self._lock:
                        self.received += len(data)
                    client.sendall(data)
        except OSError:
            return  # either side went away: this connection ends
        finally:
            client.close()
            upstream.close()

