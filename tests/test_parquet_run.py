"""End to end from Parquet files written by the Hugging Face ``datasets`` library, on this host and
in an S3-compatible store (moto's server on loopback, behind a proxy that cuts responses): a
producer killed by SIGKILL mid-run and restarted, the whole run killed after a checkpoint and
resumed, and every clip trained exactly once per epoch (the resumed run's reads cut mid-file in
the store retried and counted); a corrupt row group and a row whose audio does not decode are
counted rejections naming the file and row, the other clips trained once per epoch."""

from __future__ import annotations

import contextlib

import pytest

from tests.factories import clip_member
from tests.parquet_data import corrupt_row_group, make_parquet, write_parquet
from tests.procs import RunProcess, read_json, read_jsonl
from tests.test_resume import kill_a_producer_then_crash
from tests.test_run import FAST_HEARTBEAT, NUMPY_FEATURES
from tests.test_shards_run import DROPS, RUN
from tests.objectstore import DroppingProxy, S3Server
from tests.trained import check_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

EPOCHS = 3  # RUN's


@pytest.mark.parametrize("store", ["local", "s3"])
def test_parquet_trains_every_clip_once_per_epoch_through_a_producer_kill_and_a_resume(tmp_path, store):
    made = make_parquet(tmp_path / "pq", files=4, per_file=10, row_group=5)  # 8 row groups, windows of 2
    run_dir = tmp_path / "run"
    with contextlib.ExitStack() as stack:
        data, env, proxy = str(made.root), {}, None
        if store == "s3":
            server = stack.enter_context(S3Server())
            proxy = stack.enter_context(DroppingProxy(server.endpoint))
            server.upload(made.root, "corpus", "data")
            data, env = "s3://corpus/data/", {**server.env(proxy.endpoint), "XDG_CACHE_HOME": str(tmp_path / "cache")}
        with RunProcess("--data", data, "--run-dir", str(run_dir), *RUN, env=env) as run:
            kill_a_producer_then_crash(run)
        if proxy is not None:
            proxy.arm(DROPS)  # the resumed run's row group reads (its index comes from the cache)
        with RunProcess("--resume", str(run_dir), env=env) as again:
            assert again.wait(timeout=90) == 0, again.output()
        with server.client(XDG_CACHE_HOME=str(tmp_path / "cache")) if store == "s3" else contextlib.nullcontext():
            check_run(run_dir, EPOCHS, set(made.clips))  # the clips as the store holds them
    summary = read_json(run_dir / "summary.json")
    assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == EPOCHS
    assert summary["resumed_from_step"] >= 6 and summary["rejected"] == 0
    if proxy is not None:
        assert proxy.dropped == DROPS
        assert sum(p["read_retries"] for p in summary["producers"]) == DROPS  # nothing lost, each retry counted


def test_a_corrupt_row_group_and_an_undecodable_row_are_counted_rejections_naming_file_and_row(tmp_path):
    made = make_parquet(tmp_path / "pq", files=2, per_file=8, row_group=4)
    corrupt_row_group(made.paths[1], 1)  # rows 4 to 7 of train-001: the index cannot read them
    good = clip_member(99, 0.9, "wav")
    write_parquet(tmp_path / "pq" / "train-002.parquet", {  # a duration column: the junk row is read by a producer
        "id": ["fine", "junk"], "text": ["Some words here.", "Other words there."], "duration": [0.9, 0.9],
        "audio": [{"bytes": good, "path": "fine.wav"}, {"bytes": b"this is no audio at all\n" * 40, "path": "j.flac"}]},
        row_group=2)
    run_dir = tmp_path / "run"
    with RunProcess("--data", str(made.root), "--run-dir", str(run_dir), "--model", "synthetic:5", "--batch-size", "4",
                    "--producers", "2", "--epochs", "2", "--record-samples", *NUMPY_FEATURES, *FAST_HEARTBEAT) as run:
        assert run.wait(timeout=90) == 0, run.output()
    lost = {i for i, (file, group, _) in made.rows.items() if file == "train-001.parquet" and group == 1}
    check_run(run_dir, 2, set(made.clips) - lost | {"fine"})
    rejected = {r["id"]: r for r in read_jsonl(run_dir / "rejected.jsonl")}
    assert sorted(rejected) == ["junk", *(f"train-001_{r}" for r in range(4, 8))]
    for r in range(4):
        assert rejected[f"train-001_{r + 4}"]["reason"].startswith(f"row {r} of row group 1 of train-001.parquet "
                                                                   f"cannot be read")
    assert rejected["junk"]["reason"].startswith("audio file unreadable: row 1 of row group 0 of train-002.parquet")
    assert rejected["junk"]["producer"] != "index"
    assert read_json(run_dir / "summary.json")["rejected"] == 5
