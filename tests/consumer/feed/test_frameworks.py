"""Tests for consumer/feed/frameworks.py: what a feed hands out for PyTorch, JAX and numpy.

The CUDA path of the torch staging cannot run on a host without a GPU: its order of
operations (the slots page-locked, or pinned host memory; copies queued on a side stream, an
event after them, the loop's stream waiting on that event and marking each tensor as used; the
event waited for before a slot is written again) is checked against a recording stand-in for
``torch``; the CPU path runs on the real torch, and the CUDA path on a GPU host
(tests/test_feed_frameworks.py, marked gpu). The jax staging's accelerator path (puts
that block on nothing, each array waited for before its slot is released) is recorded the same way.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import pytest

from stoker.consumer.buffer import BatchQueue, QueuedBatch
from stoker.consumer.feed.frameworks import CopiedBatch, FunctionStaging, JaxStaging, Staging, TorchStaging

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0


def host_batch() -> dict[str, np.ndarray]:
    """A batch as the receive thread makes it: read-only views on the message's bytes."""
    mel = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    lengths = np.array([3, 2], dtype=np.int32)
    return {"mel": np.frombuffer(mel.tobytes(), np.float32).reshape(mel.shape),
            "mel_lengths": np.frombuffer(lengths.tobytes(), np.int32)}


# ---------------------------------------------------------------- torch on CUDA, recorded

class FakeStream:
    def __init__(self, log: list[tuple], name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: "FakeEvent") -> None:
        self.log.append(("wait_event", self.name, event.name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


class FakeEvent:
    def __init__(self, log: list[tuple], name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream: FakeStream) -> None:
        self.log.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


class FakeTensor:
    def __init__(self, torch: "FakeTorch", array: np.ndarray, where: str) -> None:
        self.torch, self.array, self.where = torch, array, where

    def pin_memory(self) -> "FakeTensor":
        self.torch.log.append(("pin_memory", self.where))
        return FakeTensor(self.torch, self.array.copy(), "pinned")

    def to(self, device: "FakeDevice", non_blocking: bool = False) -> "FakeTensor":
        cuda = self.torch.cuda
        self.torch.log.append(("copy", self.where, str(device), non_blocking, cuda.current.name, cuda.device_set))
        return FakeTensor(self.torch, self.array, str(device))

    def record_stream(self, stream: FakeStream) -> None:
        self.torch.log.append(("record_stream", self.where, stream.name))


class FakeDevice:
    def __init__(self, name: str) -> None:
        self.type, _, index = name.partition(":")
        self.index = int(index or 0)
        self.name = name

    def __str__(self) -> str:
        return self.name


class FakeCudart:
    """torch.cuda.cudart(): host memory registration, noting the thread and device of each call;
    ``refuse``: the cudaError a registration returns (0: cudaSuccess)."""

    def __init__(self, cuda: "FakeCuda", refuse: int = 0) -> None:
        self.cuda, self.refuse = cuda, refuse

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        thread = threading.current_thread().name
        self.cuda.log.append(("register", address, nbytes, flags, self.cuda.device_set, thread))
        return self.refuse

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802 (CUDA's name)
        self.cuda.log.append(("unregister", address, self.cuda.device_set, threading.current_thread().name))
        return 0


class FakeCuda:
    """torch.cuda as the staging uses it: streams, events, the current stream per thread."""

    def __init__(self, log: list[tuple]) -> None:
        self.log = log
        self.loop_stream = FakeStream(log, "loop")
        self.current = self.loop_stream
        self.device_set: str | None = None
        self.events = 0
        self.runtime: FakeCudart | None = FakeCudart(self)

    def cudart(self) -> FakeCudart:
        if self.runtime is None:
            raise AssertionError("libcudart functions unavailable")  # as torch says it
        return self.runtime

    def Stream(self, device: FakeDevice) -> FakeStream:  # noqa: N802 (torch's name)
        return FakeStream(self.log, f"side@{device}")

    def Event(self) -> FakeEvent:  # noqa: N802 (torch's name)
        self.events += 1
        return FakeEvent(self.log, f"event{self.events}")

    @contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    @contextmanager
    def device(self, device: FakeDevice) -> Iterator[None]:
        before, self.device_set = self.device_set, str(device)
        try:
            yield
        finally:
            self.device_set = before

    def current_stream(self, device: FakeDevice) -> FakeStream:
        self.log.append(("current_stream", str(device)))
        return self.current

    def synchronize(self, device: Any = None) -> None:
        self.log.append(("synchronize", "device"))


class FakeTorch:
    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.cuda = FakeCuda(self.log)

    def device(self, name: str) -> FakeDevice:
        return FakeDevice(name)

    def from_numpy(self, array: np.ndarray) -> FakeTensor:
        return FakeTensor(self, array, "host")


def test_cuda_staging_copies_from_pinned_memory_on_a_side_stream_and_records_an_event_after_the_copies() -> None:
    torch = FakeTorch()
    staging = TorchStaging(torch, "cuda:1")
    staged = staging.stage(host_batch())
    assert isinstance(staged, CopiedBatch) and sorted(staged.tensors) == ["mel", "mel_lengths"]
    assert torch.log == [
        ("pin_memory", "host"), ("copy", "pinned", "cuda:1", True, "side@cuda:1", "cuda:1"),
        ("pin_memory", "host"), ("copy", "pinned", "cuda:1", True, "side@cuda:1", "cuda:1"),
        ("record", "event1", "side@cuda:1"),  # after both copies, on the stream that queued them
    ]
    assert staged.copied.name == "event1"
    assert torch.cuda.current is torch.cuda.loop_stream and torch.cuda.device_set is None  # both restored
    np.testing.assert_array_equal(staged.tensors["mel"].array, host_batch()["mel"])


def test_page_locked_slots_are_copied_from_directly_on_request_and_settled_before_reuse() -> None:
    """Registered with the driver (in a thread of its own, on the model device), the slots'
    memory is copied from with no pinned copy, so staging moves to the asking thread; a batch's
    copies are waited for before its slot may be written again, and the memory is let go at the
    end once the side stream is done."""
    torch = FakeTorch()
    staging = TorchStaging(torch, "cuda:1")
    assert not staging.on_request
    staging.use_memory(4096, 65536)
    assert staging.on_request
    (call,) = torch.log
    assert call[:5] == ("register", 4096, 65536, 1, "cuda:1") and call[5] != threading.current_thread().name
    torch.log.clear()
    staged = staging.stage(host_batch())
    assert torch.log == [("copy", "host", "cuda:1", True, "side@cuda:1", "cuda:1"),
                         ("copy", "host", "cuda:1", True, "side@cuda:1", "cuda:1"),
                         ("record", "event1", "side@cuda:1")]  # no pin_memory: the slot is pinned
    torch.log.clear()
    staging.settle(staged)
    assert torch.log == [("synchronize", "event1")]
    torch.log.clear()
    staging.close()
    assert torch.log[0] == ("synchronize", "side@cuda:1") and torch.log[1][:3] == ("unregister", 4096, "cuda:1")
    staging.close()
    assert len(torch.log) == 2  # once


@pytest.mark.parametrize("runtime", ["refuses", "absent"])
def test_slots_the_driver_does_not_page_lock_go_through_pinned_copies_in_a_stager_thread(
        runtime: str, caplog: pytest.LogCaptureFixture) -> None:
    torch = FakeTorch()
    if runtime == "refuses":
        torch.cuda.runtime = FakeCudart(torch.cuda, refuse=712)  # cudaErrorHostMemoryAlreadyRegistered
    else:
        torch.cuda.runtime = None
    staging = TorchStaging(torch, "cuda:0")
    with caplog.at_level(logging.WARNING, logger="stoker.consumer.feed.frameworks"):
        staging.use_memory(4096, 65536)
    assert not staging.on_request
    reason = "cudaError 712" if runtime == "refuses" else "AssertionError: libcudart functions unavailable"
    assert [r.getMessage() for r in caplog.records] == [
        f"the batch slots could not be page-locked for CUDA ({reason}); each batch is copied to pinned memory "
        f"in a stager thread instead"]
    torch.log.clear()
    staged = staging.stage(host_batch())
    assert [entry[0] for entry in torch.log] == ["pin_memory", "copy", "pin_memory", "copy", "record"]
    torch.log.clear()
    staging.settle(staged)  # the slot was read when the stager copied it to pinned memory
    staging.close()
    assert torch.log == []


def test_taking_a_cuda_batch_makes_the_loops_stream_wait_on_its_event_and_marks_each_tensor_used_there() -> None:
    torch = FakeTorch()
    staging = TorchStaging(torch, "cuda:0")
    staged = staging.stage(host_batch())
    torch.log.clear()
    batch = staging.take(staged)
    assert batch is staged.tensors
    assert torch.log == [("current_stream", "cuda:0"), ("wait_event", "loop", "event1"),
                         ("record_stream", "cuda:0", "loop"), ("record_stream", "cuda:0", "loop")]
    assert not [entry for entry in torch.log if entry[0] == "synchronize"]  # the host never waits


def test_cuda_batches_staged_by_the_queues_stager_thread_reach_the_loop_in_order() -> None:
    """The queue stages in its own thread and the loop takes each batch with ``take``."""
    torch = FakeTorch()
    staging = TorchStaging(torch, "cuda:0")
    queue = BatchQueue(3, staging=staging)
    try:
        for n in range(3):
            arrays = {"mel_lengths": np.full(2, n, np.int32)}
            queue.put(QueuedBatch(lease=n, epoch=0, index=n, ids=[f"c{n}"], arrays=arrays, producer="p0"))
        taken = []
        for _ in range(3):
            got = queue.get(WAIT_S)
            assert got is not None
            taken.append(staging.take(got[0].arrays)["mel_lengths"].array[0])
    finally:
        queue.close()
    assert taken == [0, 1, 2]
    waits = [entry[2] for entry in torch.log if entry[0] == "wait_event"]
    assert waits == ["event1", "event2", "event3"]


# ---------------------------------------------------------------- torch on the CPU, real

def test_cpu_tensors_share_the_received_arrays_memory_made_in_the_loops_thread() -> None:
    torch = pytest.importorskip("torch")
    arrays = host_batch()
    staging = TorchStaging(torch, "cpu")
    assert staging.stage is None  # no stager thread: it would take the interpreter from the step for nothing
    batch = staging.take(arrays)
    assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in batch.values())
    assert batch["mel"].data_ptr() == arrays["mel"].ctypes.data  # torch.from_numpy: no copy
    assert batch["mel_lengths"].dtype == torch.int32 and batch["mel_lengths"].tolist() == [3, 2]


def test_host_arrays_whose_staging_failed_are_torch_tensors_when_taken() -> None:
    torch = pytest.importorskip("torch")
    batch = TorchStaging(torch, "cpu").take(host_batch())  # what the queue keeps when staging raised
    assert all(isinstance(t, torch.Tensor) for t in batch.values())
    assert batch["mel"].shape == (2, 3, 4)


@pytest.mark.slow
def test_taking_read_only_arrays_raises_no_warning_in_a_fresh_process() -> None:
    """torch warns once per process about a tensor made from a read-only array, which every
    received batch is: the feed's loop shows no such warning (a fresh process, whose first
    such call would warn, with warnings as errors)."""
    probe = ("import numpy as np, torch\n"
             "from stoker.consumer.feed.frameworks import TorchStaging\n"
             "batch = TorchStaging(torch, 'cpu').take({'x': np.frombuffer(bytes(16), np.float32)})\n"
             "print(type(batch['x']).__name__, batch['x'].tolist())\n")
    done = subprocess.run([sys.executable, "-W", "error", "-c", probe], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["Tensor", "[0.0,", "0.0,", "0.0,", "0.0]"], done.stdout


# ---------------------------------------------------------------- jax on a GPU, recorded

class FakeJaxDevice:
    def __init__(self, platform: str) -> None:
        self.platform = platform

    def __str__(self) -> str:
        return f"{self.platform}:0"


class FakeJax:
    """jax as the staging uses it, on a device of ``platform``: each put and each wait noted
    with the array's name and the calling thread."""

    def __init__(self, platform: str = "gpu") -> None:
        self.log: list[tuple] = []
        jax = self

        class Array:
            def __init__(self, name: str, host: np.ndarray) -> None:
                self.name, self.host = name, host

            def block_until_ready(self) -> "Array":
                jax.log.append(("ready", self.name, threading.current_thread().name))
                return self

        self.Array = Array
        self.device = FakeJaxDevice(platform)

    def device_put(self, array: np.ndarray, target: Any) -> Any:
        name = next(key for key, value in host_batch().items() if np.array_equal(value, array))
        self.log.append(("put", name, target is self.device, threading.current_thread().name))
        return self.Array(name, array)


def test_jax_on_a_gpu_stages_on_request_and_settle_waits_for_every_transfer() -> None:
    """On an accelerator ``device_put`` returns before its transfers, which read the slot, are done: staging
    blocks on nothing (so it can run between steps, in the asking thread), and ``settle`` waits
    for each array before the slot may be written again."""
    jax = FakeJax("gpu")
    staging = JaxStaging(jax, jax.device)
    assert staging.on_request and staging.device == "gpu:0"
    arrays = host_batch()
    staged = staging.stage(arrays)
    me = threading.current_thread().name
    assert jax.log == [("put", "mel", True, me), ("put", "mel_lengths", True, me)]  # nothing waited for
    assert all(staged[name].host is arrays[name] for name in arrays)  # the slot's own arrays, not a copy
    assert staging.take(staged) is staged and len(jax.log) == 2
    staging.settle(staged)
    assert jax.log[2:] == [("ready", "mel", me), ("ready", "mel_lengths", me)]


def test_jax_on_a_gpu_waits_for_the_transfers_of_a_batch_whose_staging_failed_before_handing_it_out() -> None:
    """Host arrays reach ``take`` when their staging failed; the confirmation's ``settle`` then
    sees only those host arrays, so ``take`` waits for their transfers itself."""
    jax = FakeJax("gpu")
    staging = JaxStaging(jax, jax.device)
    arrays = host_batch()
    batch = staging.take(arrays)
    assert [entry[0] for entry in jax.log] == ["put", "put", "ready", "ready"]
    assert all(isinstance(value, jax.Array) for value in batch.values())
    staging.settle(arrays)  # what the confirmation holds: nothing more to wait for
    assert len(jax.log) == 4


def test_jax_in_host_memory_copies_each_array_in_the_stager_thread() -> None:
    """A put in host memory may share the slot's buffer, which is written again after the step
    is confirmed while JAX's dispatch may still read it: the stager thread puts a copy. A
    sharding of a host memory kind counts as host memory, whatever its devices."""
    cpu = FakeJax("cpu")
    gpu = FakeJax("gpu")
    host_sharding = type("Sharding", (), {"device_set": {gpu.device}, "memory_kind": "pinned_host"})()
    for jax, target in ((cpu, cpu.device), (gpu, host_sharding)):
        staging = JaxStaging(jax, target)
        assert not staging.on_request
        arrays = host_batch()
        staged = staging.stage(arrays)
        for name, value in staged.items():
            assert value.host is not arrays[name] and not np.shares_memory(value.host, arrays[name])
            np.testing.assert_array_equal(value.host, arrays[name])


# ---------------------------------------------------------------- jax and numpy

def test_jax_arrays_are_put_on_the_device_given() -> None:
    jax = pytest.importorskip("jax")
    device = jax.devices()[0]
    staging = JaxStaging(jax, device)
    batch = staging.take(staging.stage(host_batch()))
    assert all(isinstance(a, jax.Array) and a.devices() == {device} for a in batch.values())
    np.testing.assert_array_equal(np.asarray(batch["mel"]), host_batch()["mel"])
    assert staging.device == str(device)


def test_jax_arrays_are_put_with_the_sharding_given_also_when_staging_failed() -> None:
    jax = pytest.importorskip("jax")
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    staging = JaxStaging(jax, sharding)
    for batch in (staging.take(staging.stage(host_batch())), staging.take(host_batch())):
        assert all(isinstance(a, jax.Array) and a.sharding == sharding for a in batch.values())


def test_numpy_batches_are_the_host_arrays_unstaged() -> None:
    arrays = host_batch()
    staging = Staging()
    assert staging.stage is None and staging.take(arrays) is arrays


def test_a_function_staging_hands_out_what_it_staged_and_stages_a_batch_whose_staging_failed() -> None:
    """TensorFlow's (a stoker.Feed's, stoker's trainer's): a staged batch is taken as it is, and a
    batch that reached the loop as host arrays is staged there, once."""
    calls = []

    def stage(arrays):
        calls.append(arrays)
        return {name: ("device", value) for name, value in arrays.items()}

    staging = FunctionStaging(stage, "/GPU:0")
    staged = staging.stage(host_batch())
    assert staging.take(staged) is staged and len(calls) == 1
    failed = host_batch()
    taken = staging.take(failed)
    assert calls[1] is failed and set(taken) == set(failed)
    assert all(taken[name][0] == "device" for name in taken)
    np.testing.assert_array_equal(taken["mel"][1], failed["mel"])
