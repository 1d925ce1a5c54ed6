"""The coordinator process and the trainer process (consumer/coordinator/coordproc.py, consumer/feed/handoff.py,
consumer/slots.py): a batch's arrays cross in shared memory unchanged, a slot the trainer holds is never
written again until it lets it go, and the coordinator process neither outlives its trainer nor
dies unseen."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest

import stoker
import stoker.feed_run as feed_run
from stoker.consumer.buffer import QueuedBatch, QueueFull
from stoker.consumer.coordinator.coordproc import SlotQueue
from stoker.consumer.feed.feed import FeedCore, PreparedRun
from stoker.consumer.feed.frameworks import Staging
from stoker.consumer.coordinator import coordproc
from stoker.consumer.feed.handoff import CoordinatorGone, write_start
from stoker.consumer.slots import ALIGN, SlotFile
from stoker.shared.config import Config
from stoker.shared.dataset.cache import open_index
from tests.factories import make_dataset
from tests.procs import free_port
from tests.trained import Recorder, check_trained, clips_of

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]


def batch(lease: int, seed: int) -> dict[str, np.ndarray]:
    """Arrays of several dtypes and shapes, one of them not contiguous, with ``seed``'s values."""
    rng = np.random.default_rng(seed)
    return {"mel": rng.standard_normal((3, 7, 5)).astype(np.float32),
            "tokens": rng.integers(0, 90, (3, 11)).astype(np.int32),
            "mel_lengths": np.arange(3, dtype=np.int64) + lease,
            "strided": rng.standard_normal((4, 6))[:, ::2]}


def test_a_batch_crosses_in_a_slot_with_its_values_dtypes_and_shapes_read_only(tmp_path) -> None:
    writer = SlotFile(tmp_path / "slots", 2, 4096, create=True)
    reader = SlotFile(tmp_path / "slots", 2, 4096)  # as the other process maps it
    arrays = batch(1, 7)
    layout = writer.write(1, arrays)
    got = reader.views(layout)
    assert list(got) == list(arrays)
    for name, array in arrays.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape
        np.testing.assert_array_equal(got[name], array)
        assert not got[name].flags.writeable
        assert got[name].ctypes.data % ALIGN == 0
    assert all(offset >= 4096 for *_, offset in layout)  # in slot 1, not slot 0


class Sent(list):
    """The descriptors a SlotQueue sends to the trainer process."""

    def __call__(self, message) -> None:
        self.append(message)


def item(lease: int) -> QueuedBatch:
    return QueuedBatch(lease=lease, epoch=0, index=lease, ids=[f"c{lease}"], arrays=batch(lease, lease), producer="p")


def test_a_slot_the_trainer_holds_is_never_written_until_it_is_released(tmp_path) -> None:
    file = SlotFile(tmp_path / "slots", 5, 4096, create=True)
    reader = SlotFile(tmp_path / "slots", 5, 4096)
    sent = Sent()
    queue = SlotQueue(capacity=3, slots=list(range(5)), hold=2, file=file, queue="train", send=sent)
    held = {}
    for lease in range(5):  # each taken at once and kept: the trainer trains it, its step not confirmed
        queue.put(item(lease))
        slot = sent[-1]["slot"]
        assert slot not in held
        held[slot] = reader.views(sent[-1]["layout"])
        queue.taken(slot)
    # Every slot is held: the queue says it is full, so the scheduler grants no credit, and a
    # batch arriving anyway (a credit accounting error) is refused, not written over a held one.
    assert len(queue) == queue.capacity
    with pytest.raises(QueueFull):
        queue.put(item(5))
    for lease, (slot, views) in enumerate(sorted(held.items(), key=lambda kv: kv[1]["mel_lengths"][0])):
        np.testing.assert_array_equal(views["mel"], batch(lease, lease)["mel"])
    released = sent[1]["slot"]
    queue.release(released)  # the step of lease 1 was confirmed
    queue.put(item(6))
    assert sent[-1]["slot"] == released
    np.testing.assert_array_equal(reader.views(sent[-1]["layout"])["mel"], batch(6, 6)["mel"])
    for slot, views in held.items():  # the others are as they were
        if slot != released:
            lease = int(views["mel_lengths"][0])
            np.testing.assert_array_equal(views["mel"], batch(lease, lease)["mel"])


def test_untaken_batches_count_against_the_capacity_whatever_slots_are_free(tmp_path) -> None:
    file = SlotFile(tmp_path / "slots", 7, 4096, create=True)
    queue = SlotQueue(capacity=3, slots=list(range(7)), hold=4, file=file, queue="train", send=Sent())
    for lease in range(3):
        queue.put(item(lease))
    assert len(queue) == 3
    with pytest.raises(QueueFull):
        queue.put(item(3))
    assert sorted(queue.positions()) == [(0, 0), (0, 1), (0, 2)]


def config(tmp_path: Path, count: int = 6) -> Config:
    make_dataset(tmp_path / "data", count=count)
    cfg = Config()
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(tmp_path / "data")),
                               pipeline=dataclasses.replace(cfg.pipeline, bind="tcp://127.0.0.1:*"))


@pytest.mark.slow
def test_the_coordinator_process_dying_ends_the_wait_with_one_line_and_no_process_is_left(tmp_path) -> None:
    core = FeedCore(PreparedRun(config(tmp_path), tmp_path / "run"), threading.Event())
    child = core.coordinator.proc
    try:
        assert psutil.Process(child.pid).is_running()
        batches = core.batches()
        os.kill(child.pid, signal.SIGKILL)
        with pytest.raises(CoordinatorGone) as caught:
            next(batches)
        message = str(caught.value)
        assert "\n" not in message and f"coordinator process (pid {child.pid}) ended unexpectedly" in message
        assert "SIGKILL" in message or "-9" in message
    finally:
        core.close()
    assert child.poll() is not None


@pytest.mark.slow
def test_the_coordinator_process_binds_reports_its_endpoint_and_exits_when_the_core_closes(tmp_path) -> None:
    core = FeedCore(PreparedRun(config(tmp_path), tmp_path / "run"), threading.Event())
    child = core.coordinator.proc
    try:
        host, port = core.endpoint.rsplit(":", 1)
        assert host == "tcp://127.0.0.1" and int(port) > 0
        listening = {c.laddr.port for c in psutil.Process(child.pid).net_connections() if c.status == "LISTEN"}
        assert int(port) in listening  # bound by the coordinator process, not this one
    finally:
        core.close()
    assert child.wait(10) == 0
    assert not core.coordinator.dir.exists() and not core.coordinator.slots.path.exists()  # slots, sockets gone


@pytest.mark.slow
def test_the_coordinator_process_ends_when_its_trainer_process_is_killed(tmp_path) -> None:
    script = textwrap.dedent(f"""
        import dataclasses, sys, threading
        sys.path.insert(0, {str(ROOT)!r})
        from stoker.consumer.feed.feed import FeedCore, PreparedRun
        from stoker.shared.config import Config
        cfg = Config()
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path={str(tmp_path / "data")!r}),
                                  pipeline=dataclasses.replace(cfg.pipeline, bind="tcp://127.0.0.1:*"))
        core = FeedCore(PreparedRun(cfg, __import__("pathlib").Path({str(tmp_path / "run")!r})), threading.Event())
        print(core.coordinator.proc.pid, flush=True)
        threading.Event().wait()
        """)
    make_dataset(tmp_path / "data", count=6)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(trainer.stdout.readline()))
        trainer.kill()
        trainer.wait(10)
        gone, alive = psutil.wait_procs([child], timeout=30)
        assert not alive, "the coordinator process outlived its trainer process"
    finally:
        trainer.kill()
        trainer.wait()
        trainer.stdout.close()


@pytest.mark.slow
def test_batches_the_loop_holds_are_not_written_over_while_the_queue_fills_and_credits_resume_when_let_go(
        tmp_path) -> None:
    make_dataset(tmp_path / "data", count=24)
    with stoker.Feed(data=str(tmp_path / "data"), producers=1, batch_size=4, epochs=3, framework="numpy",
                     run_dir=str(tmp_path / "run"), bind=f"tcp://127.0.0.1:{free_port()}", model_start_delay=0.0,
                     log_level="WARNING", set={"trainer.val_clips": 0}) as feed:
        core = feed.start()._core
        capacity = core.queue.capacity
        batches = core.batches(confirm_on_request=False)  # taken ahead, as tf.data's prefetch takes them
        held = [next(batches) for _ in range(capacity + 1)]  # the slots the trainer may keep beyond a full queue
        # The producer fills the queue meanwhile, into other slots; the loop takes those too.
        assert core.queue.wait_for_depth(capacity, 60) == capacity
        held += [next(batches) for _ in range(capacity)]
        copies = [{name: array.copy() for name, array in item.arrays.items()} for item in held]
        assert len({item.slot for item in held}) == len(held)
        # Every slot is held: no credit, so no batch comes to be written over one the loop holds.
        assert core.queue.wait_for_depth(1, 3.0) == 0
        for item, copy in zip(held, copies):
            for name, array in copy.items():
                np.testing.assert_array_equal(item.arrays[name], array)
        for _ in held:
            assert core.step_done()  # each step confirmed: its slot let go
        after = [next(batches) for _ in range(capacity)]  # credits flow into the let-go slots
        assert len({(item.epoch, item.index) for item in held + after}) == len(held + after)  # each planned batch once


def test_a_warm_index_reaches_the_coordinator_process_as_its_cache_file_not_a_copy(tmp_path) -> None:
    cfg = config(tmp_path, count=24)
    PreparedRun(cfg, tmp_path / "cold")  # indexes the clips, writes the index cache
    prepared = PreparedRun(cfg, tmp_path / "run", hold_out=True)  # warm: the table is views of the cache file
    train = list(prepared.train_samples)
    assert 0 < len(train) < 24 and prepared.val_samples
    passed = write_start(tmp_path / "start", prepared, None, None, {"count": 1, "hold": 0, "val": 0, "size": 64})
    assert len(passed) == 1
    start = open_index(tmp_path / "start")
    assert sorted(name for name in start.sections if name.startswith("train.")) == ["train.rows"]  # no column copied
    # A later build renames another cache file over the name: the coordinator reads the one the trainer checked.
    cache = Path(prepared.index.stats.cache_file)
    os.replace(tmp_path / "start", cache)
    assert list(coordproc._table(start, "train")) == train
    assert list(coordproc._table(start, "val")) == list(prepared.val_samples)


@pytest.mark.slow
def test_two_threads_asking_at_once_each_receive_their_own_batches_every_clip_once(tmp_path) -> None:
    """One socket from the coordinator process, two askers (tf.data's thread taking training
    batches while a validation pass runs, as under Keras fit): whichever thread receives a
    message, each gets its own queue's batches, every clip once, and neither waits forever."""
    ids = make_dataset(tmp_path / "data", count=60)  # a tenth held out at most: 6, in batches of 2 or fewer
    with stoker.Feed(data=str(tmp_path / "data"), producers=1, batch_size=2, epochs=1, framework="numpy",
                     run_dir=str(tmp_path / "run"), bind=f"tcp://127.0.0.1:{free_port()}", model_start_delay=0.0,
                     log_level="WARNING", set={"trainer.val_clips": 6}) as feed:
        core = feed.start()._core
        held_out = sorted(i for b in core.val_batches for i in b.ids)
        planned = {"train": core.planner.batches_per_epoch, "val": len(core.val_batches)}
        seen: dict[str, list[list[str]]] = {"train": [], "val": []}
        failures: list[BaseException] = []

        def take(kind: str) -> None:
            try:
                batches = core.batches() if kind == "train" else core.validation_pass()
                for item in batches:
                    assert item.arrays["tokens"].shape[0] >= len(item.ids)  # the batch's own rows, readable
                    seen[kind].append(list(item.ids))
            except BaseException as exc:  # reported below, in the test's thread
                failures.append(exc)

        threads = [threading.Thread(target=take, args=(kind,)) for kind in ("train", "val")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        assert not any(thread.is_alive() for thread in threads) and failures == []
    assert len(held_out) == 6 and planned["val"] >= 2 and {k: len(v) for k, v in seen.items()} == planned
    assert sorted(i for batch in seen["val"] for i in batch) == held_out
    assert sorted(i for batch in seen["train"] for i in batch) == sorted(set(ids) - set(held_out))


class OnRequestStaging(Staging):
    """Stages as the page-locked CUDA staging does (on request, copies that read the slot
    itself, settled before the slot is written again), noting each call in ``events``."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.memory = (0, 0)
        self.stage = self._stage

    def use_memory(self, address: int, nbytes: int) -> None:
        self.memory = (address, nbytes)
        self.on_request = True

    def _stage(self, arrays: dict[str, np.ndarray]) -> tuple[int, dict[str, np.ndarray]]:
        start, nbytes = self.memory
        where = arrays["tokens"].ctypes.data  # which slot
        assert all(start <= a.ctypes.data and a.ctypes.data + a.nbytes <= start + nbytes for a in arrays.values())
        self.events.append(("stage", where, threading.current_thread().name))
        return where, {name: array.copy() for name, array in arrays.items()}

    def take(self, staged: tuple[int, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        self.events.append(("take", staged[0], threading.current_thread().name))
        return staged[1]

    def settle(self, staged: tuple[int, dict[str, np.ndarray]]) -> None:
        self.events.append(("settle", staged[0]))

    def close(self) -> None:
        self.events.append(("close",))


@pytest.mark.slow
def test_batches_staged_on_request_in_the_loops_thread_are_settled_before_their_slot_is_released(
        tmp_path, monkeypatch) -> None:
    """The wiring of a staging that reads the slots themselves (CUDA's, page-locked): told the
    slots' memory, it stages every batch once, in the loop's thread and before the loop takes it,
    with no stager thread; each slot is released only right after its batch was settled; it is
    closed once, after the last step; and the loop's rows, noted in its step, are every clip once
    per epoch, each the clip its id says (what the staging copied from the slots)."""
    staging = OnRequestStaging()
    monkeypatch.setattr(feed_run, "make_staging", lambda *args: staging)
    ids = make_dataset(tmp_path / "data", count=24)
    recorder = Recorder()
    with stoker.Feed(data=str(tmp_path / "data"), producers=1, batch_size=4, epochs=2, framework="numpy",
                     run_dir=str(tmp_path / "run"), bind=f"tcp://127.0.0.1:{free_port()}", model_start_delay=0.0,
                     log_level="WARNING", set={"trainer.val_clips": 0}) as feed:
        core = feed._core
        released: list[int] = []
        release = core.coordinator.release

        def noted_release(item: QueuedBatch) -> None:
            if item.slot >= 0:
                staging.events.append(("release", item.arrays[0]))
                released.append(item.slot)
            release(item)

        monkeypatch.setattr(core.coordinator, "release", noted_release)
        assert staging.memory == core.coordinator.slots.memory()
        for batch in feed:
            assert not [t for t in threading.enumerate() if t.name == "stager"]
            recorder.note(batch, feed.epoch)
    loop = threading.current_thread().name
    events = staging.events
    assert events[-1] == ("close",) and events.count(("close",)) == 1
    stages = [e for e in events if e[0] == "stage"]
    takes = [e for e in events if e[0] == "take"]
    assert len(takes) == len(recorder.steps) == 2 * core.planner.batches_per_epoch
    check_trained(recorder.steps, clips_of(tmp_path / "run"), 2, ids)
    assert len(stages) == len(takes) and {e[2] for e in stages + takes} == {loop}
    pending: dict[int, int] = {}  # slot address -> batches staged there and not yet taken
    for event in events:
        if event[0] == "stage":
            pending[event[1]] = pending.get(event[1], 0) + 1
        elif event[0] == "take":
            assert pending.get(event[1], 0) == 1, "taken before it was staged, or a slot staged twice"
            pending[event[1]] -= 1
    releases = [n for n, e in enumerate(events) if e[0] == "release"]
    assert len(releases) == len(released) == len(takes)
    assert all(events[n - 1] == ("settle", events[n][1]) for n in releases)
