"""End to end from tar shards, on this host and in an S3-compatible store (moto's server on
loopback, behind a proxy that cuts responses): a producer killed by SIGKILL mid-run and
restarted, the whole run killed after a checkpoint and resumed, and every clip trained exactly
once per epoch; in the store, the resumed run's reads cut mid-shard are retried and counted."""

from __future__ import annotations

import contextlib

import psutil
import pytest

from tests.factories import make_shards
from tests.objectstore import DroppingProxy, S3Server
from tests.procs import RunProcess, read_json, read_jsonl
from tests.test_resume import CHECKPOINT_LINE, crash
from tests.test_run import FAST_HEARTBEAT, NUMPY_FEATURES, check_exactly_once

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

EPOCHS = 3
# 40 clips in 4 shards, batches of 4: 10 steps an epoch of 60 ms, a checkpoint every 3.
RUN = ["--model", "synthetic:60", "--batch-size", "4", "--producers", "2", "--epochs", str(EPOCHS),
       "--record-samples", "--model-start-delay", "0.2", "--set", "trainer.checkpoint_every_steps=3",
       "--set", "trainer.log_every_steps=1", "--set", "batching.shard_window=2", *NUMPY_FEATURES, *FAST_HEARTBEAT]
DROPS = 2  # responses the proxy cuts during the resumed run


def _command(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:  # a short-lived child of the run, gone since it was listed
        return ""


@pytest.mark.parametrize("store", ["local", "s3"])
def test_shards_train_every_clip_once_per_epoch_through_a_producer_kill_and_a_resume(tmp_path, store):
    shards = make_shards(tmp_path / "shards", shards=4, per_shard=10)
    run_dir = tmp_path / "run"
    with contextlib.ExitStack() as stack:
        data, env, proxy = str(shards.root), {}, None
        if store == "s3":
            server = stack.enter_context(S3Server())
            proxy = stack.enter_context(DroppingProxy(server.endpoint))
            server.upload(shards.root, "corpus", "train")
            data, env = "s3://corpus/train/", {**server.env(proxy.endpoint), "XDG_CACHE_HOME": str(tmp_path / "cache")}
        with RunProcess("--data", data, "--run-dir", str(run_dir), *RUN, env=env) as run:
            run.wait_for_line(r"step 2/", timeout=60)
            producers = [p for p in run.remember_children().values() if "stoker.producer.worker" in _command(p)]
            assert len(producers) == 2
            producers[0].kill()  # SIGKILL: its leases move, it is restarted
            run.wait_for_line(r"crashed .*restarting it", timeout=30)
            run.descendants.pop(producers[0].pid)  # gone: crash() kills the rest
            run.wait_for_line(CHECKPOINT_LINE, timeout=60, count=2)
            crash(run)
        if proxy is not None:
            proxy.arm(DROPS)  # the resumed run's member reads (its index comes from the cache)
        with RunProcess("--resume", str(run_dir), env=env) as again:
            assert again.wait(timeout=90) == 0, again.output()
    check_exactly_once(read_jsonl(run_dir / "samples.jsonl"), EPOCHS, set(shards.clips))
    summary = read_json(run_dir / "summary.json")
    assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == EPOCHS
    assert summary["resumed_from_step"] >= 6
    if proxy is not None:
        assert proxy.dropped == DROPS
        assert sum(p["read_retries"] for p in summary["producers"]) == DROPS  # nothing lost, each retry counted
