"""A producer process: planned batches (leases) in, padded batches out, against credits.

Two threads:
  io thread       owns the DEALER socket: HELLO, heartbeats, LEASE -> work queue,
                  READY when a batch is prepared, BATCH when the consumer grants a
                  CREDIT for it, BYE on stop. Polls with a timeout; never blocks.
  compute thread  reads audio, computes log-mels (TensorFlow ops on the data device, or
                  the numpy reference), collates to the bucket shape, encodes the frames,
                  and hands the lease id to the io thread over an inproc socket.

A producer keeps up to ``lease_ahead`` batches leased; prepared ones wait for their
credit, so a credit is answered at once. A clip that cannot be read is dropped from
its batch and reported in the batch header (``rejected``); any other failure is sent
to the consumer as an ERROR message and ends the process with status 1 (the launcher
restarts local producers).

Shutdown: STOP from the consumer, SIGTERM/SIGINT, or a dead parent. On SIGTERM/SIGINT
the producer sends BYE with the leases it still holds, so they are re-planned at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import os
import queue
import socket as pysocket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from shared import wire
from shared.config import FaultsConfig, FeaturesConfig
from shared.dataset import (AUDIO_SUFFIX, DatasetError, audio_path, read_metadata_bytes, parse_metadata,
                            relative_audio, resolve_root, scan_audio)
from shared.proc import StatusWriter, die_with_parent, install_stop_handlers, parent_alive, setup_logging
from shared.text import encode_text

log = logging.getLogger("producer")

# The io thread wakes at least this often to send heartbeats and check its parent.
POLL_INTERVAL_MS = 100
# Without a WELCOME this long after HELLO, say HELLO again (the consumer may have restarted).
HELLO_RETRY_S = 2.0
# Reconnect back-off after the consumer went silent: doubles up to the maximum.
RECONNECT_MIN_S = 0.5
RECONNECT_MAX_S = 8.0
# How long the compute thread waits for work before re-checking the stop flag.
WORK_POLL_S = 0.2
# Closing the socket after BYE or an ERROR: give the last message this long to leave.
FINAL_LINGER_MS = 500


class BatchMaker:
    """Turns one lease into the frames of a BATCH message.

    Per clip: tokens from the metadata text; the log-mel from the feature cache when
    one is configured and holds a valid entry, else from the audio (read, downmixed,
    resampled, then transformed with the other clips of the batch at once, and stored
    in the cache). Clips that cannot be used are reported as rejected, with the reason.
    """

    def __init__(self, root: Path, texts: dict[str, str], features: FeaturesConfig,
                 batch_size: int, device: str | None, name: str, files: dict[str, str] | None = None,
                 feature_cache: str = "", faults: FaultsConfig | None = None) -> None:
        from producer.collate import collate
        from producer.feature_cache import FeatureCache
        from producer.features import MelComputer, pad_value

        self.root = root
        self.texts = texts
        self.files = files if files is not None else {}
        self.features = features
        self.batch_size = batch_size
        self.name = name
        self._collate = collate
        self._pad = pad_value(features)
        self._mels = MelComputer(features, device=device)
        self.cache = FeatureCache(feature_cache, features, root) if feature_cache else None
        self.faults = faults or FaultsConfig()
        self._next_stall = time.monotonic() + self.faults.producer_stall_every_s

    def _inject_faults(self) -> None:
        """Configured fault injection: sleeping is the simulated slow storage or stall."""
        f = self.faults
        if f.producer_delay_ms > 0:
            time.sleep(f.producer_delay_ms / 1000)
        if f.producer_stall_s > 0 and time.monotonic() >= self._next_stall:
            log.info("%s: injected stall of %.2f s", self.name, f.producer_stall_s)
            time.sleep(f.producer_stall_s)
            self._next_stall += f.producer_stall_every_s

    def make(self, lease: dict[str, Any]) -> list[Any]:
        """The BATCH frames of one lease (fields include the clips rejected and cache counts)."""
        from producer.audio import AudioError, load_audio
        from producer.feature_cache import CacheCounts

        started = time.perf_counter()
        max_tokens, max_frames = lease["shape"]
        before = dataclasses.replace(self.cache.counts) if self.cache is not None else None
        rows: list[tuple[str, np.ndarray, np.ndarray | None]] = []  # (id, tokens, mel or None: to compute)
        clips: list[np.ndarray] = []
        to_store: list[tuple[str, str, os.stat_result]] = []
        rejected: list[dict[str, str]] = []
        for sample_id in lease["ids"]:
            text = self.texts.get(sample_id)
            if text is None:
                rejected.append({"id": sample_id, "reason": f"id not in metadata on host {pysocket.gethostname()}"})
                continue
            name = self.files.get(sample_id) or f"{sample_id}{AUDIO_SUFFIX}"
            where = relative_audio(sample_id, name)
            path = audio_path(self.root, sample_id, name)
            tok = encode_text(text)
            mel = None
            if self.cache is not None:
                try:
                    st = os.stat(path)
                except OSError:
                    st = None  # load_audio says why
                if st is not None:
                    mel = self.cache.get(sample_id, name, st.st_size, st.st_mtime_ns)
                    if mel is None:
                        to_store.append((sample_id, name, st))
            if mel is None:
                try:
                    audio = load_audio(path, self.features.sample_rate_hz, where)
                except AudioError as exc:
                    rejected.append({"id": sample_id, "reason": str(exc)})
                    continue
                frames = 1 + len(audio) // self.features.hop_length
            else:
                frames = mel.shape[0]
            if len(tok) > max_tokens or frames > max_frames:
                rejected.append({"id": sample_id, "reason": f"clip changed since indexing ({len(tok)} tokens, "
                                                            f"{frames} frames > bucket {max_tokens}x{max_frames})"})
                continue
            rows.append((sample_id, tok, mel))
            if mel is None:
                clips.append(audio)
        computed = iter(self._mels(clips) if clips else [])
        ids, tokens, mels = [], [], []
        computed_by_id: dict[str, np.ndarray] = {}
        for sample_id, tok, mel in rows:
            if mel is None:
                mel = computed_by_id[sample_id] = next(computed)
            ids.append(sample_id)
            tokens.append(tok)
            mels.append(mel)
        if self.cache is not None:
            for sample_id, name, st in to_store:
                if sample_id in computed_by_id:
                    self.cache.put(sample_id, name, st.st_size, st.st_mtime_ns, computed_by_id[sample_id])
        self._inject_faults()
        arrays = self._collate(tokens, mels, self.batch_size, max_tokens, max_frames,
                               self.features.n_mels, self._pad)
        prep_ms = (time.perf_counter() - started) * 1e3
        fields = {"lease": lease["lease"], "epoch": lease["epoch"], "index": lease["index"],
                  "ids": ids, "rejected": rejected, "prep_ms": round(prep_ms, 3)}
        if self.cache is not None and before is not None:
            delta = CacheCounts(**{k: v - getattr(before, k) for k, v in self.cache.counts.to_json().items()})
            fields["cache"] = {**delta.to_json(), "computed": len(computed_by_id)}
        return wire.encode(wire.BATCH, fields, arrays)


class Producer:
    def __init__(self, endpoint: str, data_root: Path, name: str, stop: threading.Event,
                 parent_pid: int | None = None, memory_mb: int | None = None,
                 status: StatusWriter | None = None, context: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self.root = data_root
        self.name = name
        self.stop = stop
        self.parent_pid = parent_pid
        self.memory_mb = memory_mb
        self.status = status or StatusWriter(None)
        self.ctx = context or zmq.Context.instance()
        self.identity = f"{name}-{uuid.uuid4().hex[:8]}".encode()
        self.host = pysocket.gethostname()
        self._wake_addr = f"inproc://producer-wake-{uuid.uuid4().hex}"
        self._work: queue.Queue = queue.Queue()
        self._ready: dict[int, list[Any]] = {}
        self._ready_lock = threading.Lock()
        self._held: set[int] = set()  # leases given to us and not yet delivered
        self._credited: set[int] = set()  # credits that arrived before their batch was ready
        self._generation = 0  # bumps on reconnect; work of an older generation is dropped
        self._failure: BaseException | None = None
        self._welcome: dict[str, Any] | None = None
        self._welcomed = threading.Event()
        self._texts: dict[str, str] | None = None
        self._files: dict[str, str] | None = None
        self.batches_sent = 0

    # ---------------------------------------------------------------- compute thread
    def _compute(self) -> None:
        wake = self.ctx.socket(zmq.PAIR)
        wake.linger = 0
        wake.connect(self._wake_addr)
        maker: BatchMaker | None = None
        try:
            while not self.stop.is_set():
                try:
                    generation, lease = self._work.get(timeout=WORK_POLL_S)
                except queue.Empty:
                    continue
                if generation != self._generation:
                    continue
                if maker is None:
                    maker = self._make_maker()
                frames = maker.make(lease)
                if generation != self._generation:
                    continue
                with self._ready_lock:
                    self._ready[lease["lease"]] = frames
                wake.send(str(lease["lease"]).encode())
        except BaseException as exc:  # reported by the io thread as an ERROR message
            self._failure = exc
            log.exception("producer %s failed while preparing a batch", self.name)
            wake.send(b"failed")
        finally:
            wake.close()

    def _make_maker(self) -> BatchMaker:
        from producer.features import resolve_backend
        from shared.devices import configure_tensorflow

        welcome = self._welcome or {}
        features = resolve_backend(FeaturesConfig(**welcome["features"]))
        device = None
        if features.backend == "tf":
            _, device = configure_tensorflow(self.memory_mb)
        cache_dir = str(welcome.get("feature_cache") or "")
        log.info("%s computing log-mels with %s on %s%s", self.name, features.backend, device or "CPU",
                 f"; feature cache {cache_dir}" if cache_dir else "")
        faults = FaultsConfig(**welcome.get("faults", {}))
        return BatchMaker(self.root, self._texts or {}, features, int(welcome["batch_size"]), device, self.name,
                          files=self._files or {}, feature_cache=cache_dir, faults=faults)

    # ---------------------------------------------------------------- io thread
    def _connect(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.identity = self.identity
        sock.connect(self.endpoint)
        return sock

    def _send(self, sock: zmq.Socket, kind: str, fields: dict[str, Any] | None = None) -> None:
        try:
            sock.send_multipart(wire.encode(kind, fields), flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("could not send %s: consumer not reachable", kind)

    def _hello(self, sock: zmq.Socket) -> None:
        self._send(sock, wire.HELLO, {"producer": self.name, "host": self.host, "pid": os.getpid(),
                                      "fingerprint": ""})

    def _reset_work(self) -> None:
        self._generation += 1
        with self._ready_lock:
            self._ready.clear()
        self._held.clear()
        self._credited.clear()

    def _send_batch(self, sock: zmq.Socket, lease_id: int) -> None:
        with self._ready_lock:
            frames = self._ready.pop(lease_id, None)
        if frames is None:
            self._credited.add(lease_id)
            return
        sock.send_multipart(frames, copy=False)
        self._held.discard(lease_id)
        self.batches_sent += 1

    def _handle(self, sock: zmq.Socket, msg: wire.Message) -> bool:
        """Act on one consumer message; return False when the producer must stop."""
        if msg.kind == wire.WELCOME:
            first = self._welcome is None
            self._welcome = msg.fields
            if first:
                self._load_metadata(msg.get("metadata_file", "metadata.csv"), msg.get("metadata_sha256"))
            self._welcomed.set()
            log.info("%s joined %s as producer %s", self.name, self.endpoint, msg.get("producer_index"))
        elif msg.kind == wire.LEASE:
            wire.require(msg, lease=int, epoch=int, index=int, ids=list, shape=list)
            self._held.add(msg["lease"])
            self._work.put((self._generation, msg.fields))
        elif msg.kind == wire.CREDIT:
            wire.require(msg, lease=int)
            if msg["lease"] in self._held:
                self._send_batch(sock, msg["lease"])
        elif msg.kind == wire.STOP:
            log.info("%s: consumer says stop (%s)", self.name, msg.get("reason", ""))
            return False
        elif msg.kind == wire.REFUSE:
            reason = msg.get("reason", "refused")
            self.status.send("error", type="Refused", message=str(reason), where=self.name, user_error=True)
            log.error("consumer refused %s: %s", self.name, reason)
            raise SystemExit(2)
        return True

    def _load_metadata(self, metadata_file: str, consumer_sha256: Any = None) -> None:
        """The same metadata parser and audio file lookup as the consumer's index."""
        raw = read_metadata_bytes(self.root, metadata_file)
        entries, rejected = parse_metadata(raw)
        self._texts = {e.id: e.text for e in entries}
        self._files = {sample_id: f.name for sample_id, f in scan_audio(self.root).items()}
        if isinstance(consumer_sha256, str) and consumer_sha256 != hashlib.sha256(raw).hexdigest():
            log.warning("%s: %s on this host differs from the trainer's; clips whose text changed will be rejected",
                        self.name, self.root / metadata_file)
        log.info("%s read %d metadata entries (%d malformed) and %d audio files from %s",
                 self.name, len(entries), len(rejected), len(self._files), self.root)

    def run(self) -> int:
        """Serve until STOP, a signal or a dead parent; return the exit status."""
        wake = self.ctx.socket(zmq.PAIR)
        wake.linger = 0
        wake.bind(self._wake_addr)
        worker = threading.Thread(target=self._compute, name=f"{self.name}-compute", daemon=True)
        worker.start()
        sock = self._connect()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        self._hello(sock)
        now = time.monotonic()
        last_heard = last_hello = last_beat = now
        backoff = RECONNECT_MIN_S
        interval = 1.0
        timeout = 5.0
        exit_code = 0
        try:
            while not self.stop.is_set():
                events = dict(poller.poll(POLL_INTERVAL_MS))
                now = time.monotonic()
                if wake in events:
                    token = wake.recv()
                    if token == b"failed":
                        exc = self._failure or RuntimeError("compute thread failed")
                        self._send(sock, wire.ERROR, {**wire.error_fields(exc, self.name), "fatal": True})
                        self.status.error(exc, self.name)
                        sock.close(linger=FINAL_LINGER_MS)
                        return 1
                    lease_id = int(token)
                    if lease_id in self._credited:
                        self._credited.discard(lease_id)
                        self._send_batch(sock, lease_id)
                    elif lease_id in self._held:
                        self._send(sock, wire.READY, {"lease": lease_id})
                if sock in events:
                    try:
                        msg = wire.decode(sock.recv_multipart())
                    except wire.ProtocolError as exc:
                        log.warning("dropped a malformed message from the consumer: %s", exc)
                        continue
                    last_heard = now
                    backoff = RECONNECT_MIN_S
                    if msg.kind == wire.WELCOME:
                        interval = float(msg.get("heartbeat_interval_s", interval))
                        timeout = float(msg.get("heartbeat_timeout_s", timeout))
                    if not self._handle(sock, msg):
                        break
                if not parent_alive(self.parent_pid):
                    log.warning("%s: parent process is gone, exiting", self.name)
                    exit_code = 1
                    break
                if now - last_beat >= interval:
                    with self._ready_lock:
                        ready = len(self._ready)
                    self._send(sock, wire.HEARTBEAT, {"ready": ready, "working": len(self._held) - ready})
                    last_beat = now
                if not self._welcomed.is_set() and now - last_hello >= HELLO_RETRY_S:
                    self._hello(sock)
                    last_hello = now
                elif self._welcomed.is_set() and now - last_heard > timeout:
                    log.warning("%s: consumer silent for %.1f s; dropping %d leases and reconnecting in %.1f s",
                                self.name, now - last_heard, len(self._held), backoff)
                    self._reset_work()
                    self._welcomed.clear()
                    poller.unregister(sock)
                    sock.close()
                    if self.stop.wait(backoff):
                        break
                    backoff = min(backoff * 2, RECONNECT_MAX_S)
                    sock = self._connect()
                    poller.register(sock, zmq.POLLIN)
                    self._hello(sock)
                    last_hello = last_heard = time.monotonic()
            else:
                if self._held:
                    log.info("%s: leaving, returning %d leases", self.name, len(self._held))
                self._send(sock, wire.BYE, {"leases": sorted(self._held)})
            return exit_code
        finally:
            self.stop.set()
            worker.join(timeout=2.0)
            if not sock.closed:
                sock.close(linger=FINAL_LINGER_MS)
            wake.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m producer.worker")
    parser.add_argument("--connect", required=True)
    parser.add_argument("--data", default="")
    parser.add_argument("--name", default=f"p0@{pysocket.gethostname()}")
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--gpu-memory-mb", type=int, default=None)
    parser.add_argument("--status-fd", type=int, default=None)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    setup_logging(args.name, args.log_level)
    status = StatusWriter(args.status_fd)
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        die_with_parent(args.parent_pid)
        root = resolve_root(args.data)
        producer = Producer(args.connect, root, args.name, stop, args.parent_pid, args.gpu_memory_mb, status)
        return producer.run()
    except DatasetError as exc:
        status.error(exc, args.name, user_error=True)
        log.error("%s", exc)
        return 2
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:
        status.error(exc, args.name)
        log.exception("producer %s failed", args.name)
        return 1


if __name__ == "__main__":
    sys.exit(main())
