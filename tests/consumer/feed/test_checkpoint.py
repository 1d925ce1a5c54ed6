"""Tests for consumer/feed/checkpoint.py: input position, checkpoint files, resume checks, and the
coordinator leasing only what a resumed position left. No TensorFlow here (see
test_checkpoint_tf.py for the model state)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import msgpack
import numpy as np
import pytest

from stoker.consumer.feed.checkpoint import (CKPT_DIR, MANIFEST, POSITION, POSITION_STATE, CheckpointError,
                                                 Checkpointer, RunCheckpoints, checkpoint_name, trim_step_log)
from stoker.consumer.feed import checkpoint as checkpoint_module
from stoker.consumer.plan import EpochPlanner
from stoker.consumer.position import InputPosition, PositionError
from stoker.shared import wire
from stoker.shared.config import BatchingConfig, Config
from stoker.shared.runfiles import RunFileError
from tests.consumer.harness import make_config, samples
from tests.factories import make_samples

pytestmark = pytest.mark.timeout(60)

BATCHING = BatchingConfig(batch_size=4, num_buckets=3, seed=7)


def planner(n: int = 30, batching: BatchingConfig = BATCHING) -> EpochPlanner:
    return EpochPlanner(make_samples(n, seed=3), batching)


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` by its content hash: to prove nothing changed."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- position
def test_position_marks_planned_batches_done_and_round_trips():
    plan_of = planner()
    position = InputPosition(plan_of)
    plan0 = plan_of.plan(0)
    for batch in plan0[:3]:
        position.record(0, batch.ids)
    assert position.done_batches(0) == {0, 1, 2}
    assert position.trained_counts() == {0: sum(len(b.ids) for b in plan0[:3])}
    saved = msgpack.unpackb(msgpack.packb(position.state_dict(), use_bin_type=True), raw=False)
    assert saved["complete_below"] == 0 and saved["complete"] == [] and saved["plan"] == plan_of.key
    assert [(e["epoch"], e["batches"], e["done"], e["places"]) for e in saved["open"]] == [
        (0, len(plan0), bytes([0b11100000]), b"")]  # a bit per planned batch, the first three set
    again = InputPosition.from_state_dict(saved, plan_of)
    assert again.done_batches(0) == {0, 1, 2}
    assert again.remaining(plan0) == plan0[3:]  # the same plan, the remaining batches only
    # The form before (JSON, done batches by index) still restores to the same position.
    old = InputPosition.from_state_dict({"complete_below": 0, "complete": [], "open": {"0": {"done": [0, 1, 2],
                                                                                             "ids": []}}}, plan_of)
    assert old.state_dict() == position.state_dict() and old.trained_counts() == position.trained_counts()


def test_split_and_replanned_samples_count_for_their_planned_batch():
    plan_of = planner()
    position = InputPosition(plan_of)
    plan0 = plan_of.plan(0)
    target = plan0[2]
    # A producer lacking one clip delivered the rest; the missed clip rode in another batch.
    position.record(0, target.ids[1:])
    assert position.done_batches(0) == set()
    left = InputPosition.from_state_dict(position.state_dict(), plan_of).remaining(plan0)
    assert [b.index for b in left] == [b.index for b in plan0]
    part = next(b for b in left if b.index == target.index)
    assert part.ids == target.ids[:1] and part.shape == target.shape and part.bucket == target.bucket
    position.record(0, [*plan0[5].ids, target.ids[0]])  # re-planned into batch 5's delivery
    assert position.done_batches(0) == {2, 5}
    assert position.state_dict()["open"][0]["places"] == b""


def test_epochs_in_flight_complete_ones_and_first_open():
    plan_of = planner()
    position = InputPosition(plan_of)
    for epoch in (0, 1, 2):
        position.record(epoch, plan_of.plan(epoch)[0].ids)
    position.complete.update({0, 2})  # leasing ahead can finish a later epoch first
    assert position.first_open() == 1
    saved = position.state_dict()
    assert saved["complete_below"] == 1 and saved["complete"] == [2] and [e["epoch"] for e in saved["open"]] == [1]
    again = InputPosition.from_state_dict(saved, plan_of)
    assert again.remaining(plan_of.plan(0)) == [] and again.remaining(plan_of.plan(2)) == []
    assert again.remaining(plan_of.plan(1)) == plan_of.plan(1)[1:]
    assert again.remaining(plan_of.plan(3)) == plan_of.plan(3)
    assert again.trained_counts() == {1: len(plan_of.plan(1)[0].ids)}


def test_position_that_does_not_fit_the_plan_is_refused():
    with pytest.raises(PositionError, match="not in the plan of epoch 0"):
        InputPosition.from_state_dict({"complete_below": 0, "complete": [], "open": {"0": {"done": [], "ids": ["X"]}}},
                                      planner())
    with pytest.raises(PositionError, match="no planned batch 999"):
        InputPosition.from_state_dict({"complete_below": 0, "complete": [], "open": {"0": {"done": [999], "ids": []}}},
                                      planner())
    with pytest.raises(PositionError, match="does not fit"):
        InputPosition.from_state_dict({"open": {}}, planner())


# --------------------------------------------------------------------------- files
def test_keeps_the_last_k_and_ignores_an_unfinished_save(tmp_path):
    ckpt = Checkpointer(tmp_path / CKPT_DIR, keep=2)
    assert ckpt.latest() is None
    for step in (5, 10, 15):
        ckpt.save(step, {"position": {}})
    assert [s for s, _ in ckpt.checkpoints()] == [10, 15]
    leftover = tmp_path / CKPT_DIR / ".tmp-ckpt-000020-1"  # a save a crash cut short
    leftover.mkdir()
    (leftover / POSITION).write_text("{")
    assert ckpt.latest() == tmp_path / CKPT_DIR / checkpoint_name(15)
    assert Checkpointer.verify(ckpt.latest())["step"] == 15
    ckpt.save(20, {"position": {}})
    assert not leftover.exists()
    assert [s for s, _ in ckpt.checkpoints()] == [15, 20]


@pytest.mark.parametrize("damage, message", [
    (lambda d: d.joinpath(POSITION).write_bytes(d.joinpath(POSITION).read_bytes().replace(b'"step":5', b'"step":6')),
     "position.json: checksum mismatch"),
    (lambda d: d.joinpath(POSITION).write_bytes(d.joinpath(POSITION).read_bytes()[:-9]), "position.json has"),
    (lambda d: d.joinpath(MANIFEST).unlink(), "MANIFEST.json is missing"),
    (lambda d: d.joinpath(MANIFEST).write_text("{not json"), "MANIFEST.json unreadable"),
    (lambda d: d.joinpath(POSITION).unlink(), "position.json is missing"),
])
def test_corrupt_checkpoint_is_one_clear_error(tmp_path, damage, message):
    ckpt = Checkpointer(tmp_path / CKPT_DIR, keep=3)
    path = ckpt.save(5, {"position": {}})
    damage(path)
    with pytest.raises(CheckpointError, match="corrupt") as caught:
        Checkpointer.verify(path)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_newer_format_is_refused(tmp_path):
    path = Checkpointer(tmp_path / CKPT_DIR, keep=3).save(5, {"position": {}})
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps({**manifest, "format": 99}))
    with pytest.raises(CheckpointError, match="format 99"):
        Checkpointer.verify(path)


def test_trim_step_log_keeps_rows_up_to_the_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "t": s / 10}) + "\n" for s in range(1, 8)) + '{"step": 8, "t"')
    assert trim_step_log(path, 5) == {"step": 5, "t": 0.5}
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert trim_step_log(tmp_path / "absent.jsonl", 5) is None


# --------------------------------------------------------------------------- resume checks
class Fake:
    """A trainer without TensorFlow state (as synthetic:MS)."""

    name = "fake"
    uses_tensorflow = False

    def trackables(self) -> None:
        return None


def run_checkpoints(run_dir: Path, plan_of: EpochPlanner, model: str = "synthetic:1",
                    fingerprint: str = "data-1") -> RunCheckpoints:
    cfg = Config()
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, model=model, checkpoint_every_steps=2))
    return RunCheckpoints(run_dir, cfg, plan_of, fingerprint)


def first_session(run_dir: Path, plan_of: EpochPlanner, steps: int = 5) -> RunCheckpoints:
    """Train ``steps`` planned batches of epoch 0, checkpointing every 2, logging every step."""
    checkpoints = run_checkpoints(run_dir, plan_of)
    checkpoints.attach(Fake())
    with open(run_dir / "samples.jsonl", "w") as log:
        for step, batch in enumerate(plan_of.plan(0)[:steps], start=1):
            log.write(json.dumps({"step": step, "epoch": 0, "ids": list(batch.ids)}) + "\n")
            checkpoints.position.record(0, batch.ids)
            if checkpoints.due(step):
                log.flush()
                checkpoints.save(step)
    return checkpoints


def test_resume_continues_at_the_checkpoint_position(tmp_path):
    plan_of = planner()
    first_session(tmp_path, plan_of, steps=5)  # checkpoints at 2 and 4; step 5 trained after the last
    resumed = run_checkpoints(tmp_path, plan_of)
    got = resumed.resume()
    assert got.step == 4
    step, trained, complete = got.step, resumed.position.trained(0), resumed.position.complete
    assert step == 4 and complete == set() and trained == sum(len(b.ids) for b in plan_of.plan(0)[:4])
    assert resumed.position.remaining(plan_of.plan(0)) == plan_of.plan(0)[4:]
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # step 5 is trained again, so its row goes


def test_a_checkpoint_keeps_the_position_as_bit_arrays_beside_a_summary_in_position_json(tmp_path):
    plan_of = planner()
    first_session(tmp_path, plan_of, steps=4)
    latest = Checkpointer(tmp_path / CKPT_DIR, keep=3).latest()
    assert sorted(p.name for p in latest.iterdir()) == [MANIFEST, POSITION, POSITION_STATE]
    summary = json.loads((latest / POSITION).read_text())["position"]
    assert summary == {"complete_below": 0, "complete": [], "open": [0], "file": POSITION_STATE}
    state = msgpack.unpackb((latest / POSITION_STATE).read_bytes(), raw=False)
    assert np.flatnonzero(np.unpackbits(np.frombuffer(state["open"][0]["done"], np.uint8))).tolist() == [0, 1, 2, 3]


def test_a_checkpoint_of_the_format_before_still_resumes(tmp_path, monkeypatch):
    """Format 1: the whole position in position.json, its partly trained clips by id."""
    plan_of = planner()
    plan0 = plan_of.plan(0)
    old = {"complete_below": 0, "complete": [], "open": {"0": {"done": [0, 1], "ids": list(plan0[2].ids[:1])}}}
    monkeypatch.setattr(checkpoint_module, "FORMAT", 1)
    Checkpointer(tmp_path / CKPT_DIR, keep=3).save(2, {"model": "synthetic:1", "state": [], "position": old,
                                                       "plan": run_checkpoints(tmp_path, plan_of).identity})
    monkeypatch.undo()
    resumed = run_checkpoints(tmp_path, plan_of)
    assert resumed.resume().step == 2
    left = resumed.position.remaining(plan0)
    assert [b.index for b in left] == [b.index for b in plan0[2:]] and left[0].ids == plan0[2].ids[1:]
    assert resumed.position.trained(0) == len(plan0[0].ids) + len(plan0[1].ids) + 1


@pytest.mark.parametrize("change, message", [
    (dict(plan_of=planner(batching=dataclasses.replace(BATCHING, batch_size=5))), "batching.batch_size 4 then, 5 now"),
    (dict(plan_of=planner(n=31), fingerprint="data-2"), "dataset fingerprint data-1 then, data-2 now"),
    (dict(model="tiny"), "holds the state of --model synthetic:1, not tiny"),
])
def test_resume_refuses_another_plan_or_model_and_changes_nothing(tmp_path, change, message):
    first_session(tmp_path, planner())
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError, match="cannot resume") as caught:
        run_checkpoints(tmp_path, change.get("plan_of", planner()), model=change.get("model", "synthetic:1"),
                        fingerprint=change.get("fingerprint", "data-1")).resume()
    assert message in str(caught.value)
    assert snapshot(tmp_path) == before


def test_a_resume_refused_for_a_changed_dataset_names_the_clips_and_the_way_on(tmp_path):
    clips = make_samples(30, seed=3)
    first_session(tmp_path, EpochPlanner(clips, BATCHING))
    before = snapshot(tmp_path)
    longer = clips[7]._replace(num_frames=clips[7].num_frames + 600)
    changed = [*clips[:3], *clips[4:7], longer, *clips[8:], *make_samples(40, seed=9, prefix="N")[:7]]
    with pytest.raises(CheckpointError) as caught:
        run_checkpoints(tmp_path, EpochPlanner(changed, BATCHING), fingerprint="data-2").resume()
    assert str(caught.value) == (
        f"cannot resume from {tmp_path / CKPT_DIR / checkpoint_name(4)}: this run's epoch plan differs from the "
        "checkpoint's (dataset fingerprint data-1 then, data-2 now; the dataset's clips changed: 7 added (N00000, "
        "N00001, N00002, N00003, N00004, ...); 1 removed (S00003); 5 in another bucket (S00007, S00013, S00026, S00027, S00029)). "
        f"To go on training its model on the data as it is now: --resume {tmp_path} --fresh-plan (keeps the "
        "weights, the optimizer and the step count; the epochs start anew); or start a new run")
    assert snapshot(tmp_path) == before


def test_a_plan_of_more_clips_than_listed_is_identified_by_its_digest_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_module, "PLAN_CLIPS_LISTED", 20)
    clips = make_samples(30, seed=3)
    first_session(tmp_path, EpochPlanner(clips, BATCHING))
    position = json.loads((tmp_path / CKPT_DIR / checkpoint_name(4) / "position.json").read_text())
    assert all(bucket[3] is None for bucket in position["plan"]["buckets"])
    with pytest.raises(CheckpointError) as caught:
        run_checkpoints(tmp_path, EpochPlanner(clips[:29], BATCHING), fingerprint="data-2").resume()
    assert "(dataset fingerprint data-1 then, data-2 now). To go on" in str(caught.value)
    assert run_checkpoints(tmp_path, EpochPlanner(clips, BATCHING)).resume().step == 4


def test_a_fresh_plan_keeps_the_step_and_model_state_and_starts_the_epochs_anew(tmp_path, caplog):
    clips = make_samples(30, seed=3)
    first_session(tmp_path, EpochPlanner(clips, BATCHING))
    changed = EpochPlanner(clips[:20], BATCHING)
    resumed = run_checkpoints(tmp_path, changed, fingerprint="data-2")
    caplog.set_level("INFO", logger="stoker.consumer.feed.checkpoint")
    got = resumed.resume(fresh_plan=True)
    assert got.step == 4 and resumed.last_step == 4 and got.state == []
    assert resumed.position.complete == set() and resumed.position.trained(0) == 0
    assert resumed.position.remaining(changed.plan(0)) == changed.plan(0)  # every batch of the new plan is to train
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert (f"--fresh-plan: keeping no model state (the trainer has none) and the step count (4) of "
            f"{tmp_path / CKPT_DIR / checkpoint_name(4)}; a new epoch plan over the dataset as it is now (20 clips, "
            f"{changed.batches_per_epoch} batches per epoch) starts at epoch 0") in caplog.text
    resumed.position.record(0, changed.plan(0)[0].ids)
    resumed.attach(Fake())
    resumed.save(6)  # the next checkpoint is of the new plan: a plain resume goes on from it
    again = run_checkpoints(tmp_path, changed, fingerprint="data-2")
    assert again.resume().step == 6 and again.position.trained(0) == len(changed.plan(0)[0].ids)


def test_corrupt_latest_checkpoint_changes_nothing(tmp_path):
    plan_of = planner()
    first_session(tmp_path, plan_of)
    latest = tmp_path / CKPT_DIR / checkpoint_name(4)
    raw = bytearray((latest / POSITION).read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (latest / POSITION).write_bytes(bytes(raw))
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError, match=f"{latest} is corrupt .position.json: checksum mismatch"):
        run_checkpoints(tmp_path, plan_of).resume()
    assert snapshot(tmp_path) == before


def test_no_checkpoint_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        run_checkpoints(tmp_path, planner()).resume()


# --------------------------------------------------------------------------- coordinator
@pytest.mark.slow  # processes or sockets
def test_coordinator_leases_only_what_the_position_left(harness):
    cfg = make_config(lease_ahead=20)
    plan_of = EpochPlanner(samples(14), cfg.batching)  # 4 batches an epoch: 3 of 4 clips, 1 of 2
    position = InputPosition(plan_of)
    plan0 = plan_of.plan(0)
    position.record(0, plan0[0].ids)
    position.record(0, plan0[2].ids)
    position.record(0, plan0[1].ids[:1])
    h = harness(cfg=cfg, n=14, max_epochs=2, resume=InputPosition.from_state_dict(position.state_dict(), plan_of))
    sock = h.producer()
    h.recv(sock, wire.WELCOME)
    expected = [(0, 1, list(plan0[1].ids[1:])), (0, 3, list(plan0[3].ids)),
                *((1, b.index, list(b.ids)) for b in plan_of.plan(1))]
    leases = [h.recv(sock, wire.LEASE) for _ in expected]
    assert [(m.epoch, m.index, list(m.ids)) for m in leases] == expected
    assert leases[0].rows == len(plan0[1].ids) - 1  # the partly trained batch: only its untrained rows
    # Nothing more was leased: the HELLO that leased the whole window (lease_ahead covers both
    # epochs) was answered before the READY below, so any further LEASE arrives before its CREDIT.
    h.credit(sock, leases[0])


@pytest.mark.slow  # processes or sockets
def test_coordinator_skips_complete_epochs(harness):
    cfg = make_config(lease_ahead=20)
    plan_of = EpochPlanner(samples(12), cfg.batching)
    position = InputPosition(plan_of)
    position.complete.update({0, 1})
    h = harness(cfg=cfg, max_epochs=3, resume=position)
    sock = h.producer()
    h.recv(sock, wire.WELCOME)
    leases = [h.recv(sock, wire.LEASE) for _ in plan_of.plan(2)]
    assert {m.epoch for m in leases} == {2}


def test_complete_epochs_are_forgotten():
    plan_of = planner()
    position = InputPosition(plan_of)
    for batch in plan_of.plan(0):
        position.record(0, batch.ids)
    position.complete.add(0)  # the trainer marks it once its samples are all trained
    position.record(1, plan_of.plan(1)[0].ids)
    assert position.trained_counts() == {1: len(plan_of.plan(1)[0].ids)}
    assert position.done_batches(0) == set() and position.state_dict()["complete_below"] == 1


class _FullDiskCheckpoint:
    """A tf.train.Checkpoint whose write meets a full disk, in TensorFlow's words."""

    def write(self, prefix: str) -> None:
        Path(prefix + ".index").write_text("part")
        raise RuntimeError(f"{prefix}_temp/part-00000-of-00001; No space left on device [Op:SaveV2]")


def test_a_checkpoint_that_meets_a_full_disk_is_one_line_and_leaves_no_part(tmp_path, small_disk):
    ckpt = Checkpointer(small_disk.path / CKPT_DIR, keep=3)
    ckpt.save(3, {"position": {}})
    with pytest.raises(RunFileError, match=r"cannot write .*ckpt-000006: No space left on device \(ENOSPC\)"):
        ckpt.save(6, {"position": {}}, _FullDiskCheckpoint())
    small_disk.fill()
    with pytest.raises(RunFileError, match=r"cannot write .*ckpt-000009: No space left on device"):
        ckpt.save(9, {"position": {}, "pad": "x" * 100000})
    assert [step for step, _ in ckpt.checkpoints()] == [3]  # no partial checkpoint counts, the last one kept
    assert sorted(p.name for p in ckpt.directory.iterdir()) == ["ckpt-000003"]
    assert Checkpointer.verify(ckpt.latest())["step"] == 3
