"""End to end from tar shards, on this host and in an S3-compatible store (moto's server on
loopback, behind a proxy that cuts responses): a producer killed by SIGKILL mid-run and
restarted, the whole run killed after a checkpoint and resumed, and every clip trained exactly
once per epoch; in the store, the resumed run's reads cut mid-shard are retried and counted. A
JSON-lines manifest in the store, its loose audio files beside it: every clip once per epoch,
a read cut mid-file one counted retry; the same files as an LJSpeech layout in the store, every
clip once."""

from __future__ import annotations

import contextlib
import json

import pytest
import soundfile

from tests.factories import make_dataset, make_shards
from tests.objectstore import DroppingProxy, S3Server
from tests.procs import RunProcess, read_json
from tests.test_resume import kill_a_producer_then_crash
from tests.test_run import FAST_HEARTBEAT, NUMPY_FEATURES
from tests.trained import check_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

EPOCHS = 3
# 40 clips in 4 shards, batches of 4: 10 steps an epoch of 60 ms, a checkpoint every 3.
RUN = ["--model", "synthetic:60", "--batch-size", "4", "--producers", "2", "--epochs", str(EPOCHS),
       "--record-samples", "--model-start-delay", "0.2", "--set", "trainer.checkpoint_every_steps=3",
       "--set", "trainer.log_every_steps=1", "--set", "batching.shard_window=2", *NUMPY_FEATURES, *FAST_HEARTBEAT]
DROPS = 2  # responses the proxy cuts during the resumed run


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
            kill_a_producer_then_crash(run)
        if proxy is not None:
            proxy.arm(DROPS)  # the resumed run's member reads (its index comes from the cache)
        with RunProcess("--resume", str(run_dir), env=env) as again:
            assert again.wait(timeout=90) == 0, again.output()
        with server.client(XDG_CACHE_HOME=str(tmp_path / "cache")) if store == "s3" else contextlib.nullcontext():
            check_run(run_dir, EPOCHS, set(shards.clips))  # the clips as the store holds them
    summary = read_json(run_dir / "summary.json")
    assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == EPOCHS
    assert summary["resumed_from_step"] >= 6
    if proxy is not None:
        assert proxy.dropped == DROPS
        assert sum(p["read_retries"] for p in summary["producers"]) == DROPS  # nothing lost, each retry counted


def test_a_manifest_in_s3_trains_every_clip_once_per_epoch_and_a_cut_read_costs_a_counted_retry(tmp_path):
    root = tmp_path / "corpus"
    ids = make_dataset(root, count=8)
    rows = [{"audio_filepath": f"wavs/{i}.wav", "text": f"clip number {n}.",
             "duration": soundfile.info(str(root / "wavs" / f"{i}.wav")).duration} for n, i in enumerate(ids)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    run_dir = tmp_path / "run"
    with S3Server() as server, DroppingProxy(server.endpoint, after_bytes=8 << 10, from_start=True) as proxy:
        server.upload(root, "corpus", "ljs")
        server.upload(root / "wavs", "corpus", "ljs/wavs")
        env = {**server.env(proxy.endpoint), "XDG_CACHE_HOME": str(tmp_path / "cache")}
        proxy.arm(1)  # the first audio read (the manifest is shorter than the cut)
        with RunProcess("--data", "s3://corpus/ljs/train.jsonl", "--run-dir", str(run_dir), "--model", "synthetic:5",
                        "--batch-size", "4", "--producers", "2", "--epochs", "2", "--record-samples",
                        *NUMPY_FEATURES, *FAST_HEARTBEAT, env=env) as run:
            assert run.wait(timeout=90) == 0, run.output()
        # The same upload as an LJSpeech layout (its metadata.csv, its wavs/ listed in the store)
        with RunProcess("--data", "s3://corpus/ljs", "--run-dir", str(tmp_path / "ljs"), "--model", "synthetic:5",
                        "--batch-size", "4", "--producers", "2", "--epochs", "1", "--record-samples",
                        *NUMPY_FEATURES, *FAST_HEARTBEAT, env=env) as run:
            assert run.wait(timeout=90) == 0, run.output()
        with server.client(XDG_CACHE_HOME=str(tmp_path / "cache")):
            check_run(run_dir, 2, set(ids))  # the clips as the store holds them
            check_run(tmp_path / "ljs", 1, set(ids))
    summary = read_json(run_dir / "summary.json")
    assert proxy.dropped == 1 and sum(p["read_retries"] for p in summary["producers"]) == 1
