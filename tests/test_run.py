"""End-to-end: ``python run.py`` on real processes, sockets and the demo data."""

from __future__ import annotations

import collections
import signal

import psutil
import pytest
import soundfile
import zmq

from stoker.shared import config as config_mod
from tests.factories import add_clip, append_metadata, make_dataset
from tests.procs import RunProcess, read_json, read_jsonl, run_cli
from tests.trained import check_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SUMMARY_FIELDS = {"steps", "epochs_completed", "samples", "wall_s", "steps_per_s", "samples_per_s",
                  "data_wait_frac", "queue_depth_mean", "starved_steps", "rejected", "producers", "verdict",
                  "recommended_producers", "loss_first", "loss_last", "exit_reason", "frames_useful_frac", "replicas"}
PRODUCER_FIELDS = {"id", "host", "batches", "samples", "rejected", "status"}
METRIC_FIELDS = {"step", "epoch", "t", "queue_depth", "wait_ms", "step_ms", "loss"}
DEMO_CLIPS = 64
# Fast failure detection for the fault tests: a dead producer's leases move after this.
FAST_HEARTBEAT = ["--set", "pipeline.heartbeat_interval_s=0.3", "--set", "pipeline.heartbeat_timeout_s=1.5"]
NUMPY_FEATURES = ["--set", "features.backend=numpy"]
# A run of a TensorFlow model traces its step ahead for every bucket shape (seconds each on a
# CPU): runs that check no bucketing plan one bucket shape (and the short batch's) or two.
ONE_BUCKET = ["--set", "batching.num_buckets=1"]
TWO_BUCKETS = ["--set", "batching.num_buckets=2"]


def test_demo_synthetic_run_writes_contract_files(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("--model", "synthetic:5", "--epochs", "2", "--producers", "2", "--record-samples",
                     "--model-start-delay", "0.5", "--run-dir", str(run_dir), *NUMPY_FEATURES)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(run_dir / "summary.json")
    assert SUMMARY_FIELDS <= set(summary)
    assert summary["exit_reason"] == "completed" and summary["replicas"] == 1
    assert summary["epochs_completed"] == 2
    assert summary["samples"] == 2 * DEMO_CLIPS
    assert summary["verdict"] in ("producer-bound", "consumer-bound", "balanced")
    assert summary["recommended_producers"] >= 1
    assert summary["loss_first"] is None  # the synthetic trainer has no loss
    assert len(summary["producers"]) == 2
    for producer in summary["producers"]:
        assert PRODUCER_FIELDS <= set(producer)
    assert sum(p["samples"] for p in summary["producers"]) == 2 * DEMO_CLIPS
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert len(metrics) == summary["steps"] == 8
    for row in metrics:
        assert METRIC_FIELDS <= set(row)
        assert 0 <= row["queue_depth"] <= 3
        assert row["step_ms"] >= 5.0
    assert [r["step"] for r in metrics] == list(range(1, 9))
    saved = config_mod.load(run_dir / "config.yaml")
    assert saved.trainer.model == "synthetic:5" and saved.trainer.epochs == 2
    from stoker.shared.dataset.corpus.registry import read_metadata
    from stoker.shared.dataset.files import DEMO_DATA_DIR

    demo_ids = {e.id for e in read_metadata(DEMO_DATA_DIR)[0]}
    check_run(run_dir, 2, demo_ids)
    assert "verdict:" in result.stdout


def test_frame_budget_run_trains_every_clip_once_in_few_static_shapes(tmp_path):
    """--max-frames: rows per bucket, each batch within the budget, every clip once per epoch."""
    run_dir = tmp_path / "run"
    budget = 800
    result = run_cli("--model", "synthetic:5", "--epochs", "2", "--producers", "2", "--record-samples",
                     "--max-frames", str(budget), "--model-start-delay", "0.5", "--run-dir", str(run_dir),
                     *NUMPY_FEATURES)
    assert result.returncode == 0, result.stderr[-3000:]
    from stoker.shared.dataset.corpus.registry import read_metadata
    from stoker.shared.dataset.files import DEMO_DATA_DIR

    check_run(run_dir, 2, {e.id for e in read_metadata(DEMO_DATA_DIR)[0]})
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    computed = {r["frames_computed"] for r in metrics}
    # One rows x T per bucket shape, and the epoch's one short batch (only its real rows).
    assert len(computed) <= config_mod.BatchingConfig().num_buckets + 1
    assert all(c <= budget for c in computed)
    assert sum(1 for r in metrics if r["frames_computed"] <= budget * 0.5) <= 2  # at most one an epoch
    rows = {len(r["ids"]) for r in read_jsonl(run_dir / "samples.jsonl")}
    assert max(rows) > min(rows)  # short clips in more rows than long ones
    summary = read_json(run_dir / "summary.json")
    assert summary["frames_per_batch"]["max"] <= budget and summary["samples"] == 2 * DEMO_CLIPS
    assert summary["frames_useful_frac"] == round(sum(r["frames"] for r in metrics) / sum(
        r["frames_computed"] for r in metrics), 4)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_tiny_model_learns_validates_checkpoints_and_synthesizes(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("--model", "tiny", "--steps", "40", "--producers", "1", "--batch-size", "8",
                     "--run-dir", str(run_dir), "--set", "trainer.log_every_steps=10",
                     "--set", "trainer.val_every_steps=20", *TWO_BUCKETS, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(run_dir / "summary.json")
    assert summary["steps"] == 40
    assert summary["loss_last"] < 0.5 * summary["loss_first"]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    losses = [r["loss"] for r in rows]
    assert len(losses) == 40 and all(isinstance(x, float) for x in losses)
    for row in rows:  # the total is the terms' weighted sum (trainer.length_loss_weight 0.1)
        assert set(row["terms"]) == {"mel_l1", "length"}
        assert row["loss"] == pytest.approx(row["terms"]["mel_l1"] + 0.1 * row["terms"]["length"], rel=1e-4)
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10
    # Held-out clips (4 of the 64), validated at step 20 and at the end.
    assert summary["val_clips"] == 4 and [v["step"] for v in summary["val_losses"]] == [20, 40]
    assert all(v["loss"] > 0 for v in summary["val_losses"])
    trainer = summary["trainer"]
    assert trainer["params"] > 100_000 and trainer["precision"] == "float32" and trainer["jit_compile"] is False
    assert trainer["traces"] == trainer["bucket_shapes"] and trainer["retraces"] == 0
    assert "trainable parameters" in result.stderr and "validation loss" in result.stderr
    # tb/ as TensorBoard itself reads it: every documented scalar, and the mel image as a PNG.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir / "tb"), size_guidance={"tensors": 0})
    board.Reload()
    tags = set(board.Tags()["tensors"])
    assert {"train/loss", "train/loss/mel_l1", "train/loss/length", "train/learning_rate", "train/skipped_steps",
            "pipeline/data_wait_frac", "pipeline/step_ms", "pipeline/queue_depth", "pipeline/samples_per_s",
            "pipeline/producers_alive", "val/loss", "val/loss/mel_l1", "val/mel_target_vs_predicted"} <= tags
    assert [e.step for e in board.Tensors("train/loss")] == [10, 20, 30, 40]
    width, height, png = board.Tensors("val/mel_target_vs_predicted")[-1].tensor_proto.string_val
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int(width) > 0 and int(height) > 0
    assert (run_dir / "ckpt" / "ckpt-000040" / "MANIFEST.json").exists()
    out = tmp_path / "said" / "mel.npy"
    synth = run_cli("synth", str(run_dir), "--text", "The dog barked.", "--out", str(out), timeout=90)
    assert synth.returncode == 0, synth.stderr[-2000:]
    assert out.exists() and out.with_suffix(".png").exists()
    assert "ckpt-000040" in synth.stdout
    # A second restore, here (the synth command's own function, without another TensorFlow start).
    import numpy as np

    from stoker.consumer.training.synth import synthesize

    again = synthesize(run_dir, "The dog barked.", tmp_path / "again.npy")
    # Every weight restored, twice. Two processes whose TensorFlow threads split the sums
    # differently agree to float32 rounding (seen: 3e-6 on values near -5), a weight restored
    # wrong by far more.
    np.testing.assert_allclose(np.load(out), np.load(again.mel_path), rtol=0, atol=1e-4)


@pytest.mark.slow
def test_nan_loss_stops_the_run_with_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("--model", "tests.consumer.training.user_models:nan_loss", "--steps", "50", "--producers", "1",
                     "--batch-size", "8", "--run-dir", str(run_dir), "--set", "trainer.log_every_steps=2",
                     "--set", "trainer.max_bad_steps=4", "--model-start-delay", "0", *ONE_BUCKET,
                     timeout=150)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "NaN or inf for 4 steps in a row" in result.stderr.strip().splitlines()[-1]
    summary = read_json(run_dir / "summary.json")
    assert summary["steps"] == 4 and summary["skipped_steps"] == 4
    assert summary["trainer"]["optimizer_updates"] == 0
    assert summary["exit_reason"].startswith("failed: the loss was NaN or inf")
    assert (run_dir / "ckpt" / "ckpt-000004").is_dir()


# docs/examples/neural_features.py: the model trained on the codes and speaker embeddings its
# producer models compute (the same through stoker.Feed: tests/stoker/test_feed.py).
NEURAL_FEATURES = ["--producer-models", "neural_features:codec,neural_features:speaker",
                   "--set", "transforms.model_fields=codes:int32:T/4:-1,speaker_embedding:float32:64:0",
                   "--set", "batching.fields=ref_mel"]


@pytest.mark.slow
@pytest.mark.parametrize("model, more", [("conv_tts:build", []), ("neural_features:build", NEURAL_FEATURES)])
def test_docs_example_user_model_trains(tmp_path, model, more):
    run_dir = tmp_path / "run"
    result = run_cli("--model", model, "--steps", "12", "--producers", "1", "--batch-size", "8",
                     "--run-dir", str(run_dir), "--set", "trainer.log_every_steps=4", "--model-start-delay", "0",
                     *ONE_BUCKET, *more,
                     env={"PYTHONPATH": "docs/examples", "NEURAL_FEATURES_WEIGHTS": str(tmp_path / "weights")},
                     timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(run_dir / "summary.json")
    assert summary["steps"] == 12 and summary["trainer"]["params"] > 10_000
    assert summary["loss_last"] < summary["loss_first"]
    assert (sum(p["model_runs"] for p in summary["producers"]) > 0) == bool(more)


def test_user_model_breaking_the_contract_is_one_line(tmp_path):
    result = run_cli("--model", "tests.consumer.training.user_models:wrong_shape", "--steps", "5", "--producers", "1",
                     "--run-dir", str(tmp_path / "run"), timeout=150)
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("stoker: error: --model tests.consumer.training.user_models:wrong_shape: "
                           "output 'mel' has shape")
    assert "docs/MODELS.md" in last and "Traceback" not in result.stderr


def test_unknown_user_module_is_refused_before_starting(tmp_path):
    result = run_cli("--model", "no_such_module_xyz:build", "--run-dir", str(tmp_path / "run"), timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "stoker: error: --model no_such_module_xyz:build: no module named no_such_module_xyz "
        "(is its directory on PYTHONPATH?)")
    assert not (tmp_path / "run").exists()


def test_a_producer_model_that_cannot_load_is_one_line_naming_it(tmp_path):
    result = run_cli("--model", "synthetic:5", "--steps", "3", "--run-dir", str(tmp_path / "run"),
                     "--producer-models", "tests.producer.user_models:broken",
                     "--set", "transforms.model_fields=score:float32:-:0", *NUMPY_FEATURES, timeout=90)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "stoker: error: transforms.models tests.producer.user_models:broken: cannot build or load the model: "
        "OSError: weights file missing")
    assert "Traceback" not in result.stderr


def test_killed_producer_is_restarted_and_nothing_is_lost(tmp_path):
    run_dir = tmp_path / "run"
    with RunProcess("--model", "synthetic:100", "--epochs", "8", "--producers", "2", "--record-samples",
                    "--model-start-delay", "0.5", "--run-dir", str(run_dir), "--set", "trainer.log_every_steps=2",
                    *NUMPY_FEATURES, *FAST_HEARTBEAT) as run:
        run.wait_for_line(r"step 2/32", timeout=60)
        children = run.remember_children().values()
        producers = [p for p in children if "stoker.producer.worker" in " ".join(p.cmdline())]
        consumer = [p for p in children if "stoker.consumer.training.main" in " ".join(p.cmdline())]
        assert len(producers) == 2 and len(consumer) == 1
        # The pinning environment each child really got (CPU mode here: no GPU visible).
        for p in [*producers, *consumer]:
            assert p.environ().get("CUDA_VISIBLE_DEVICES") == ""
        # The other producer is stopped meanwhile, so that the run cannot end before the restarted one
        # joins, however slow its start. Its leases move after the 1.5 s heartbeat timeout.
        producers[1].suspend()
        producers[0].kill()
        run.wait_for_line(r"crashed .*restarting it", timeout=30)
        # A producer of another pid joins: the restarted one (the other may not have joined before it
        # was stopped, when its start is slow).
        started = "|".join(str(p.pid) for p in producers)
        run.wait_for_line(rf"producer \S+ joined from \S+ \(pid (?!(?:{started})\))\d+\)", timeout=60)
        producers[1].resume()
        assert run.wait(timeout=120) == 0, run.output()
        run.remember_children()
    summary = read_json(run_dir / "summary.json")
    assert summary["exit_reason"] == "completed"
    assert summary["epochs_completed"] == 8
    from stoker.shared.dataset.corpus.registry import read_metadata
    from stoker.shared.dataset.files import DEMO_DATA_DIR

    demo_ids = {e.id for e in read_metadata(DEMO_DATA_DIR)[0]}
    check_run(run_dir, 8, demo_ids)
    assert max(p["connections"] for p in summary["producers"]) >= 2  # the restarted one joined again


def test_ctrl_c_drains_writes_summary_and_leaves_no_orphans(tmp_path):
    run_dir = tmp_path / "run"
    with RunProcess("--model", "synthetic:50", "--steps", "100000", "--producers", "2", "--run-dir", str(run_dir),
                    "--model-start-delay", "0.5", "--set", "trainer.log_every_steps=5", *NUMPY_FEATURES) as run:
        run.wait_for_line(r"step 5/", timeout=60)
        run.remember_children()
        assert len(run.descendants) == 4  # the consumer, its coordinator process and two producers
        run.proc.send_signal(signal.SIGINT)
        code = run.wait(timeout=10)
        assert code == 130, run.output()
        gone, alive = psutil.wait_procs(list(run.descendants.values()), timeout=2)
        assert not alive, f"orphans: {alive}"
    summary = read_json(run_dir / "summary.json")
    assert summary["exit_reason"] == "interrupted"
    assert summary["steps"] >= 5
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == summary["steps"]


def test_a_consumer_killed_by_sigkill_is_named_and_its_summary_keeps_the_figures(tmp_path):
    """kill -9 of the consumer (as the out-of-memory killer does): the launcher's line and
    exit_reason name SIGKILL, and the summary it writes counts the steps and epochs trained."""
    run_dir = tmp_path / "run"
    with RunProcess("--model", "synthetic:5", "--steps", "100000", "--producers", "1", "--run-dir", str(run_dir),
                    "--model-start-delay", "0.2", "--set", "trainer.log_every_steps=4",
                    "--set", "trainer.checkpoint_every_steps=8", *NUMPY_FEATURES) as run:
        run.wait_for_line(r"step 40/", timeout=60)
        consumer, = [p for p in run.remember_children().values()
                     if "stoker.consumer.training.main" in " ".join(p.cmdline())]
        consumer.kill()
        assert run.wait(timeout=20) == 1, run.output()
        gone, alive = psutil.wait_procs(list(run.descendants.values()), timeout=2)
        assert not alive, f"orphans: {alive}"
    summary = read_json(run_dir / "summary.json")
    assert summary["written_by"] == "launcher"
    assert summary["exit_reason"].startswith("consumer killed by SIGKILL from outside stoker")
    assert f"ERROR   launcher launcher: {summary['exit_reason']}" in run.output()
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    # Rows still in the consumer's write buffer die with it: the summary counts what reached the file.
    assert summary["steps"] == len(metrics) >= 8 and summary["samples"] == sum(r["samples"] for r in metrics)
    trained: collections.Counter[int] = collections.Counter()
    for row in metrics:
        trained[row["epoch"]] += row["samples"]
    complete = sum(1 for samples in trained.values() if samples == DEMO_CLIPS)
    assert summary["epochs_completed"] == complete >= len(metrics) // 4 - 1  # 4 steps an epoch


def test_unreadable_clip_is_rejected_and_run_goes_on(tmp_path):
    data = tmp_path / "data"
    ids = make_dataset(data, count=12)
    (data / "wavs" / f"{ids[3]}.wav").write_bytes(b"RIFF\x00\x00\x00\x00not really a wav file at all")
    append_metadata(data, ["BROKEN-LINE-WITHOUT-TEXT", "GHOST|a clip with no audio file|a clip with no audio file"])
    run_dir = tmp_path / "run"
    result = run_cli("--data", str(data), "--model", "synthetic:1", "--epochs", "1", "--batch-size", "4",
                     "--producers", "1", "--record-samples", "--run-dir", str(run_dir),
                     "--model-start-delay", "0.2", *NUMPY_FEATURES)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(run_dir / "summary.json")
    rejected = {r["id"]: r for r in read_jsonl(run_dir / "rejected.jsonl")}
    assert summary["rejected"] == len(rejected) == 3
    assert rejected[ids[3]]["reason"].startswith(f"audio file unreadable: wavs/{ids[3]}.wav: ")
    assert "missing" in rejected["GHOST"]["reason"]
    assert "malformed metadata line 13" in rejected["BROKEN-LINE-WITHOUT-TEXT"]["reason"]
    check_run(run_dir, 1, set(ids) - {ids[3]})


def _one_error_line(result) -> str:
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("stoker: error:")]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return errors[0]


def test_nonexistent_data_is_one_line(tmp_path):
    line = _one_error_line(run_cli("--data", str(tmp_path / "nope"), "--run-dir", str(tmp_path / "r")))
    assert "does not exist" in line


def test_missing_gpu_is_one_line(tmp_path):
    line = _one_error_line(run_cli("--data-gpu", "7", "--model-gpu", "1", "--run-dir", str(tmp_path / "r")))
    assert "devices.data_gpu (--data-gpu): GPU 7 requested, but no GPU is visible" in line


def test_bad_flag_and_unknown_key_are_one_line(tmp_path):
    assert "unrecognized arguments" in _one_error_line(run_cli("--no-such-flag"))
    assert "trainer.stepz" in _one_error_line(run_cli("--set", "trainer.stepz=3"))
    assert "expected an integer" in _one_error_line(run_cli("--set", "batching.batch_size=big"))
    assert "synthetic:MS" in _one_error_line(run_cli("--model", "synthetic:fast"))


def test_non_loopback_bind_needs_insecure(tmp_path):
    line = _one_error_line(run_cli("--bind", "tcp://0.0.0.0:5599", "--run-dir", str(tmp_path / "r")))
    assert "--insecure" in line


def test_endpoint_in_use_is_one_line(tmp_path):
    ctx = zmq.Context.instance()
    holder = ctx.socket(zmq.ROUTER)
    holder.linger = 0
    try:
        port = holder.bind_to_random_port("tcp://127.0.0.1")
        line = _one_error_line(run_cli("--bind", f"tcp://127.0.0.1:{port}", "--model", "synthetic:1",
                                       "--run-dir", str(tmp_path / "r"), *NUMPY_FEATURES))
        assert "cannot bind" in line and "in use" in line
    finally:
        holder.close()


def test_dataset_without_usable_clip_is_one_line(tmp_path):
    data = tmp_path / "data"
    ids = make_dataset(data, count=2)
    for sample_id in ids:
        (data / "wavs" / f"{sample_id}.wav").write_bytes(b"garbage")
    line = _one_error_line(run_cli("--data", str(data), "--model", "synthetic:1", "--run-dir", str(tmp_path / "r")))
    assert "no usable clip" in line


def test_a_plan_whose_batch_cannot_cross_the_wire_is_one_line_before_training(tmp_path):
    data = tmp_path / "data"
    make_dataset(data, count=3)
    add_clip(data, "LONG", 40.0)  # ~3450 frames of 80 channels: 1.1 MB of mel per row, over max_message_mb=1
    run_dir = tmp_path / "run"
    result = run_cli("--data", str(data), "--model", "synthetic:1", "--epochs", "1", "--batch-size", "2",
                     "--producers", "1", "--run-dir", str(run_dir), "--set", "data.max_audio_s=60",
                     "--set", "pipeline.max_message_mb=1", *NUMPY_FEATURES, timeout=120)
    line = _one_error_line(result)
    assert "over pipeline.max_message_mb=1" in line and "data.max_audio_s (now 60)" in line, line
    assert not (run_dir / "metrics.jsonl").exists()  # refused before training: no step, no producer work


def test_stereo_and_other_rate_clips_are_used(tmp_path):
    data = tmp_path / "data"
    ids = make_dataset(data, count=6, rate_hz=16000)
    audio, rate = soundfile.read(str(data / "wavs" / f"{ids[0]}.wav"))
    soundfile.write(str(data / "wavs" / f"{ids[0]}.wav"), [[a, a] for a in audio], rate)
    run_dir = tmp_path / "run"
    result = run_cli("--data", str(data), "--model", "synthetic:1", "--epochs", "1", "--batch-size", "3",
                     "--producers", "1", "--run-dir", str(run_dir), "--model-start-delay", "0.2", *NUMPY_FEATURES)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_json(run_dir / "summary.json")["samples"] == 6


@pytest.mark.parametrize("settings, failed, reason", [
    (["transforms.user=tests.producer.user_transforms:raises"], "transform tests.producer.user_transforms:raises",
     "ValueError: no pitch for "),
    (["transforms.models=tests.producer.user_models:raising", "transforms.model_fields=score:float32:-:0"],
     "producer model tests.producer.user_models:raising", "ValueError: the model cannot take this batch"),
])
def test_a_transform_or_producer_model_failing_every_clip_is_one_line(tmp_path, settings, failed, reason):
    sets = [arg for setting in settings for arg in ("--set", setting)]
    result = run_cli("--model", "synthetic:5", "--steps", "5", "--producers", "1", "--run-dir", str(tmp_path / "run"),
                     *sets, *NUMPY_FEATURES, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("stoker: error:")]
    assert lines == [line for line in lines if f"every clip failed {failed}" in line] and len(lines) == 1
    rejected = read_jsonl(tmp_path / "run" / "rejected.jsonl")
    assert len(rejected) >= 32 and all(r["reason"].startswith(f"{failed}: {reason}") for r in rejected)


def test_the_installed_command_runs_from_another_directory(tmp_path):
    """``stoker`` (the console command pip installs) does what ``python run.py`` does, from anywhere."""
    import shutil
    import subprocess

    command = shutil.which("stoker")
    if command is None:
        pytest.skip("the stoker command is not installed: python -m pip install -e . makes it")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir = tmp_path / "run"
    done = subprocess.run([command, "--model", "synthetic:5", "--steps", "3", "--producers", "1", "--run-dir",
                           str(run_dir), *NUMPY_FEATURES], cwd=elsewhere, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-2000:]
    assert read_json(run_dir / "summary.json")["steps"] == 3
    diagnosed = subprocess.run([command, "diagnose", str(run_dir)], cwd=elsewhere, capture_output=True, text=True,
                               timeout=60)
    assert diagnosed.returncode == 0 and "verdict" in diagnosed.stdout
    wrong = subprocess.run([command, "--bogus"], cwd=elsewhere, capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2
    assert wrong.stderr.strip().splitlines() == ["stoker: error: unrecognized arguments: --bogus (see stoker --help)"]
