"""stoker.Feed in the user's own process: batches, exactly-once, run files, shutdown, errors.

The loops here take each batch and do no model work (the examples' tests in
tests/test_examples.py train real models through the feed); what is checked is what a
user relies on: every clip once per epoch, the step rows and summary that ``diagnose``
reads, no process left behind, and one clear line for each misuse.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

import stoker
from stoker.consumer.feed.feed import FeedStateError
from stoker.consumer.message_size import MessageTooLarge
from stoker.feed import FeedError
from stoker.shared.errors import UserError
from stoker.shared.runlock import RunLocked
from tests.factories import append_metadata, make_dataset
from tests.procs import RunProcess, free_port, holding_run_lock, read_json, read_jsonl
from tests.trained import IDENTIFYING, Recorder, check_trained, clips_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROJECT = Path(__file__).resolve().parents[2]


def producer_procs(parent_pid: int) -> list[psutil.Process]:
    """The producer processes a feed in process ``parent_pid`` started, alive or zombie."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "stoker.producer.worker" in cmdline and f"--parent-pid {parent_pid}" in cmdline:
            found.append(proc)
    return found


def assert_no_producers_left(parent_pid: int) -> None:
    gone, alive = psutil.wait_procs(producer_procs(parent_pid), timeout=10)
    assert not alive, f"producers left behind: {[p.pid for p in alive]}"


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    make_dataset(root, count=24)
    return root


def options(tmp_path: Path, dataset: Path, **more: Any) -> dict[str, Any]:
    """A feed's options; no clip held out (trainer.val_clips 0) unless ``set`` says otherwise."""
    return {"data": str(dataset), "producers": 2, "batch_size": 4, "run_dir": str(tmp_path / "run"),
            "bind": f"tcp://127.0.0.1:{free_port()}", "model_start_delay": 0.0, "log_level": "WARNING",
            "set": {"trainer.val_clips": 0}, **more}


def test_every_clip_once_per_epoch_with_a_producer_killed_and_the_run_files_diagnose_reads(tmp_path, dataset):
    from stoker.diagnose import analyse

    ids = {line.split("|")[0] for line in (dataset / "metadata.csv").read_text().splitlines()}
    trained = Recorder()
    with stoker.Feed(**options(tmp_path, dataset, epochs=3, record_samples=True)) as feed:
        shapes = set(feed.shapes)
        for n, batch in enumerate(feed):
            if n == 2:  # a producer dies mid-epoch: its leases go to the other, it is restarted
                producer_procs(os.getpid())[0].kill()
            rows = int(batch["token_lengths"].shape[0])
            assert (rows, int(batch["tokens"].shape[1]), int(batch["mel"].shape[1])) in shapes
            assert np.all(batch["mel_lengths"].numpy() <= batch["mel"].shape[1])
            trained.note(batch, feed.epoch)
            feed.step_done(loss=float(n))
        steps = feed.step
        with pytest.raises(StopIteration):  # as an exhausted Python iterator does, at every call
            next(feed)
    run = tmp_path / "run"
    check_trained(trained.steps, clips_of(run), 3, ids)
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))
    assert [r["loss"] for r in metrics] == [float(n) for n in range(steps)]
    summary = read_json(run / "summary.json")
    assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == 3
    assert summary["steps"] == steps and summary["samples"] == 3 * len(ids)
    report = analyse(run)
    assert report["steps"] == steps and summary["trained_by"] == "stoker.Feed" and summary["replicas"] is None
    cure = report["cure"]  # the feed's option (a busy host's cure names it too: producers=0 here, the rest elsewhere)
    assert "stoker.Feed(..., producers=" in cure or cure.startswith("no change needed"), cure
    assert_no_producers_left(os.getpid())


def test_producer_models_give_the_encoders_outputs_from_the_cache_in_epoch_2_every_clip_once_through_a_kill_and_resume(
        tmp_path, dataset, monkeypatch):
    """docs/examples/neural_features.py's encoders in the producers: each batch's codes and speaker
    embeddings equal the same encoders run here on the batch's mels; epoch 2 reads the codes
    from the cache; a producer killed mid-epoch, and a loop stopped and resumed from its
    state_dict, lose and repeat no clip."""
    examples = PROJECT / "docs" / "examples"
    monkeypatch.syspath_prepend(str(examples))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(examples), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("NEURAL_FEATURES_WEIGHTS", str(tmp_path / "weights"))
    import neural_features as nf

    ids = {line.split("|")[0] for line in (dataset / "metadata.csv").read_text().splitlines()}
    sets = {"trainer.val_clips": 0, "transforms.model_fields": nf.MODEL_FIELDS, "batching.fields": "ref_mel",
            "data.feature_cache": str(tmp_path / "cache")}
    given = options(tmp_path, dataset, epochs=2, record_samples=True, set=sets,
                    producer_models="neural_features:codec,neural_features:speaker")
    codec, speaker = nf.codec(), nf.speaker()

    def check(batch: dict[str, Any]) -> None:
        b = {k: v.numpy() for k, v in batch.items()}
        for row, (frames, ref_frames) in enumerate(zip(b["mel_lengths"], b["ref_mel_lengths"])):
            codes = codec({"mel": b["mel"][row:row + 1, :frames], "mel_lengths": np.array([frames])})["codes"]
            np.testing.assert_array_equal(b["codes"][row, :-(-frames // nf.GROUP)], np.asarray(codes)[0])
            embedding = speaker({"ref_mel": b["ref_mel"][row:row + 1, :ref_frames],
                                 "ref_mel_lengths": np.array([ref_frames])})["speaker_embedding"]
            np.testing.assert_allclose(b["speaker_embedding"][row], np.asarray(embedding)[0], atol=1e-5)

    hits = 0
    trained = Recorder()
    with stoker.Feed(**given) as feed:
        for n, batch in enumerate(feed):
            if n == 2:  # a producer dies mid-epoch: its leases go to the other, it is restarted
                producer_procs(os.getpid())[0].kill()
            check(batch)
            trained.note(batch, feed.epoch)
            feed.step_done()
            if n == 7:  # the loop stops in epoch 2, saving the feed's state as a checkpoint would
                state = json.loads(json.dumps(feed.state_dict()))
                break
    hits += sum(p["model_hits"] for p in read_json(tmp_path / "run" / "summary.json")["producers"])
    trained.rewind(state["step"])
    with stoker.Feed(**given, resume=state) as feed:
        for batch in feed:
            check(batch)
            trained.note(batch, feed.epoch)
            feed.step_done()
    check_trained(trained.steps, clips_of(tmp_path / "run"), 2, ids)
    hits += sum(p["model_hits"] for p in read_json(tmp_path / "run" / "summary.json")["producers"])
    # Epoch 2's codes, at least, came from the cache (its references' embeddings too, where cached).
    assert hits >= len(ids), hits
    assert_no_producers_left(os.getpid())


def test_an_exception_in_the_loop_closes_the_feed_and_leaves_no_process(tmp_path, dataset):
    with pytest.raises(ValueError, match="the user's step failed"):
        with stoker.Feed(**options(tmp_path, dataset, steps=50)) as feed:
            for n, _ in enumerate(feed):
                if n == 3:
                    raise ValueError("the user's step failed")
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["exit_reason"] == "failed: ValueError: the user's step failed"
    assert summary["steps"] == 3  # the fourth batch's step failed: it was not trained
    assert_no_producers_left(os.getpid())


def test_state_dict_resumes_where_it_was_and_refuses_another_plan(tmp_path, dataset):
    ids = {line.split("|")[0] for line in (dataset / "metadata.csv").read_text().splitlines()}
    first = options(tmp_path, dataset, epochs=2, record_samples=True)
    trained = Recorder()
    with stoker.Feed(**first) as feed:
        for n, batch in enumerate(feed):
            trained.note(batch, feed.epoch)
            if n == 4:
                feed.step_done()  # the step on this batch ended: the state counts it
                state = json.loads(json.dumps(feed.state_dict()))  # what a user saves: JSON
                break
    assert state["step"] == 5
    # Batches handed out after the state was taken are not in it: cut back, as after a crash.
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["exit_reason"] == "stopped by the training loop at step 5"
    trained.rewind(state["step"])
    with stoker.Feed(**first, resume=state) as feed:
        steps = 0
        for batch in feed:
            trained.note(batch, feed.epoch)
            steps += 1
    check_trained(trained.steps, clips_of(tmp_path / "run"), 2, ids)
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == list(range(1, 6 + steps))
    other = dict(first, batch_size=3, run_dir=str(tmp_path / "other"))
    with pytest.raises(FeedStateError, match="another epoch plan"):
        stoker.Feed(**other, resume=state).start()
    elsewhere = dict(first, run_dir=str(tmp_path / "elsewhere"))
    with pytest.raises(FeedStateError, match="belongs to another dataset"):
        stoker.Feed(**elsewhere, resume={**state, "dataset_fingerprint": "0" * 16}).start()
    with pytest.raises(FeedError, match="holds a run"):
        stoker.Feed(**first).start()
    assert_no_producers_left(os.getpid())


def test_as_dataset_is_one_epoch_per_iteration_and_ends_with_out_of_range(tmp_path, dataset):
    import tensorflow as tf

    ids = {line.split("|")[0] for line in (dataset / "metadata.csv").read_text().splitlines()}
    with stoker.Feed(**options(tmp_path, dataset, epochs=2, record_samples=True)) as feed:
        data = feed.as_dataset()
        assert data.element_spec["mel"].shape.as_list() == [None, None, 80]
        assert data.element_spec["tokens"].dtype == tf.int32
        seen = []
        trained = Recorder()
        for batch in data.map(lambda b: {k: b[k] for k in IDENTIFYING}).prefetch(2):  # a user's map, taken ahead
            seen.append(int(tf.reduce_sum(tf.cast(batch["mel_lengths"] > 0, tf.int32))))
            trained.note(batch, feed.epoch)
            feed.step_done()  # each step trained, confirmed
            assert feed.epoch == 0
        iterator = iter(data)  # tf.data's own way to the end: OutOfRangeError
        while True:
            try:
                batch = iterator.get_next()
            except tf.errors.OutOfRangeError:
                break
            trained.note(batch, feed.epoch)
            feed.step_done()
            seen.append(-1)
        assert feed.epoch == 1
        with pytest.raises(tf.errors.OutOfRangeError):  # the plan is over: an empty epoch
            iter(data).get_next()
        assert list(feed.validation()) == []  # no clip held out: an empty pass
    assert sum(n for n in seen if n > 0) == len(ids) and len(seen) == 2 * feed.batches_per_epoch
    samples = read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert [r["epoch"] for r in samples] == sorted(r["epoch"] for r in samples)  # epoch after epoch
    check_trained(trained.steps, clips_of(tmp_path / "run"), 2, ids)


def test_epochs_end_where_every_clip_of_the_epoch_was_handed_out(tmp_path, dataset):
    ids = {line.split("|")[0] for line in (dataset / "metadata.csv").read_text().splitlines()}
    with stoker.Feed(**options(tmp_path, dataset, epochs=3, record_samples=True)) as feed:
        epochs = []
        trained = Recorder()
        for epoch, batches in feed.epochs():
            epochs.append(epoch)
            for batch in batches:
                assert feed.epoch == epoch
                trained.note(batch, epoch)
        assert next(iter(feed.epochs()), None) is None and feed.step == 3 * feed.batches_per_epoch
    assert epochs == [0, 1, 2]
    samples = read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert [r["epoch"] for r in samples] == sorted(r["epoch"] for r in samples)
    check_trained(trained.steps, clips_of(tmp_path / "run"), 3, ids)


def test_validation_passes_give_each_held_out_clip_once_as_the_producers_make_it_and_train_none(tmp_path, dataset):
    import tensorflow as tf

    from stoker.producer.audio import load_audio
    from stoker.producer.features import log_mel_spectrogram_numpy

    ids = {line.split("|")[0] for line in (dataset / "metadata.csv").read_text().splitlines()}
    run = tmp_path / "run"
    passes: list[list[dict[str, np.ndarray]]] = []
    fitted: list[tuple[int, ...]] = []  # the shapes of batches whose clips fit a training shape

    def validate(feed: stoker.Feed) -> None:
        before = feed.state_dict()
        batches = []
        for batch in feed.validation():
            rows, shape = int(batch["token_lengths"].shape[0]), tuple(int(batch[k].shape[1]) for k in ("tokens", "mel"))
            longest = (int(tf.reduce_max(batch["token_lengths"])), int(tf.reduce_max(batch["mel_lengths"])))
            assert isinstance(batch["mel"], tf.Tensor)  # training shapes where the clips fit one, of real rows only
            if any(longest[0] <= L and longest[1] <= T for _, L, T in shapes):
                assert any(shape == (L, T) and rows <= B for B, L, T in shapes)
                fitted.append(shape)
            batches.append({k: v.numpy() for k, v in batch.items()})
        passes.append(batches)
        assert feed.state_dict() == before  # no step, the input position unmoved

    # The default trainer.val_clips (4, at most a tenth of 24 clips): 2 clips held out.
    with stoker.Feed(**options(tmp_path, dataset, epochs=1, record_samples=True, set={})) as feed:
        held = set(feed.validation_clips)
        shapes = set(feed.shapes)
        trained = Recorder()
        for n, batch in enumerate(feed):
            trained.note(batch, feed.epoch)
            feed.step_done(loss=float(n))
            if n == 1:  # in the middle, with the training queue full: the pass must not wait for room in it
                assert feed._core.queue.wait_for_depth(3, 30.0) == 3
                validate(feed)
        validate(feed)  # after the loop
        clips = sum(int(tf.reduce_sum(tf.cast(b["mel_lengths"] > 0, tf.int32))) for b in feed.validation_dataset())
        steps, core = feed.step, feed._core
    assert len(held) == 2 and held == set(read_json(run / "validation.json")["ids"]) and clips == 2 and fitted
    # Training: every other clip once, no held-out one; every step once in metrics.jsonl, no validation row.
    check_trained(trained.steps, clips_of(run), 1, ids - held)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, steps + 1))
    assert [r["loss"] for r in read_jsonl(run / "metrics.jsonl")] == [float(n) for n in range(steps)]
    summary = read_json(run / "summary.json")
    assert summary["validation_passes"] == 3 and summary["val_clips"] == 2 and summary["steps"] == steps
    # Each pass: every held-out clip once (validation.jsonl names each batch's clips, in order) ...
    rows = read_jsonl(run / "validation.jsonl")
    assert [r["pass"] for r in rows] == sorted(r["pass"] for r in rows) and {r["step"] for r in rows} == {2, steps}
    # ... each clip's tokens and log-mel as the trainer's vocabulary and the features' definition make them.
    features = feed.cfg.features
    reference = {s.id: (core.vocabulary.encode(s.units), log_mel_spectrogram_numpy(load_audio(
        dataset / "wavs" / f"{s.id}.wav", features.sample_rate_hz), features, dtype=np.float32))
                 for s in core.val_samples}
    for number, batches in enumerate(passes, 1):
        named = [r["ids"] for r in rows if r["pass"] == number]
        assert sorted(i for batch_ids in named for i in batch_ids) == sorted(held), number
        for batch, batch_ids in zip(batches, named, strict=True):
            assert int((batch["mel_lengths"] > 0).sum()) == len(batch_ids)
            for row, clip in enumerate(batch_ids):
                tokens, mel = reference[clip]
                np.testing.assert_array_equal(batch["tokens"][row, :batch["token_lengths"][row]], tokens)
                np.testing.assert_allclose(batch["mel"][row, :batch["mel_lengths"][row]], mel, rtol=1e-4, atol=1e-4)
    assert_no_producers_left(os.getpid())


@pytest.mark.parametrize("given, says", [
    ({"batch_sise": 4}, "unknown option 'batch_sise'"),
    ({"model": "tiny"}, "the feed trains no model"),
    ({"set": {"trainer.nope": 1}}, "unknown config key 'trainer.nope'"),
])
def test_a_wrong_option_is_one_line(given, says):
    with pytest.raises(FeedError, match=says) as caught:
        stoker.Feed(**given)
    assert "\n" not in str(caught.value)


def test_each_option_sets_its_config_key_and_an_error_names_the_key(caplog):
    """The keyword options map onto config keys (docs/FEED.md's table), set= last; a mistake
    names the key, not a flag of the command line."""
    import logging

    from stoker.feed import OPTION_KEYS

    cfg = stoker.Feed(data_gpu_memory=512, model_start_delay=0.5, producer_models="", steps=9,
                      set={"trainer.steps": 11}).cfg
    assert (cfg.devices.data_gpu_memory_mb, cfg.pipeline.model_start_delay_s, cfg.trainer.steps) == (512, 0.5, 11)
    assert OPTION_KEYS["data_gpu_memory"] == "devices.data_gpu_memory_mb"
    with pytest.raises(FeedError, match=r"^stoker.Feed: producers \(pipeline.producers\) must be a number or 'auto'"):
        stoker.Feed(producers=1.5)
    with pytest.raises(FeedError, match=r"^stoker.Feed: pipeline.bind: 'tcp://h:0x' is not an endpoint to bind"):
        stoker.Feed(bind="tcp://h:0x")
    caplog.set_level(logging.INFO, logger="stoker")
    default = stoker.Feed().cfg.pipeline.producers
    assert stoker.Feed(replicas=2).cfg.pipeline.producers == 2 * default  # stoker's default, per replica: said
    assert f"pipeline.producers: {default} -> {2 * default}" in caplog.text
    assert stoker.Feed(replicas=2, producers=3).cfg.pipeline.producers == 3  # the user's count: kept


def test_a_feed_owns_its_run_directory_and_refuses_a_batch_that_cannot_cross_the_wire(tmp_path, dataset):
    with holding_run_lock(tmp_path / "run") as owner:
        with pytest.raises(RunLocked, match=f"in use by host .*, pid {owner.pid}"):
            stoker.Feed(**options(tmp_path, dataset, epochs=1)).prepare()
    feed = stoker.Feed(**options(tmp_path, dataset, epochs=1))
    feed.prepare()
    assert json.loads((tmp_path / "run" / "run.lock").read_text())["pid"] == os.getpid()
    feed.close()
    assert not (tmp_path / "run" / "run.lock").exists()
    big = options(tmp_path, dataset, epochs=1, run_dir=str(tmp_path / "big"), batch_size=24)
    big["set"] = {**big["set"], "pipeline.max_message_mb": 1, "features.n_mels": 400}
    with pytest.raises(MessageTooLarge, match="over pipeline.max_message_mb=1"):
        stoker.Feed(**big).prepare()
    assert not (tmp_path / "big" / "run.lock").exists()  # a refused plan leaves the directory free


def test_a_state_that_is_not_one_is_refused(tmp_path, dataset):
    with pytest.raises(FeedStateError, match="takes what feed.state_dict"):
        stoker.Feed(**options(tmp_path, dataset, epochs=1), resume={"step": 3}).start()


def test_a_feed_never_closed_is_closed_at_exit_with_a_warning(tmp_path, dataset):
    script = ("import stoker, sys\n"
              f"feed = stoker.Feed(**{options(tmp_path, dataset, steps=20, log_level='WARNING')!r})\n"
              "next(feed)\n"
              "feed.step_done()\n"
              "print(__import__('os').getpid(), flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=PROJECT, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "a stoker.Feed was never closed; closing it at exit" in done.stderr
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["steps"] == 1 and summary["exit_reason"] == "stopped by the training loop at step 1"
    assert_no_producers_left(int(done.stdout.split()[-1]))


def test_ctrl_c_in_the_loop_writes_the_summary_and_leaves_no_process(tmp_path, dataset):
    # Ctrl-C as at a terminal: a shell's background job (a test run started with &) ignores SIGINT, and a
    # Python started with SIGINT ignored keeps ignoring it.
    script = ("import signal, stoker\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              f"with stoker.Feed(**{options(tmp_path, dataset, steps=10_000)!r}) as feed:\n"
              "    print(__import__('os').getpid(), flush=True)\n"
              "    for batch in feed:\n"
              "        print('step', feed.step, flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=PROJECT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        # The loop runs, and a step is confirmed (the second batch asked for): SIGINT after it.
        assert [proc.stdout.readline().split()[:2] for _ in range(2)] == [["step", "0"], ["step", "1"]]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in err  # the user's own exception, unchanged
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["exit_reason"] == "interrupted" and summary["steps"] >= 1
    assert_no_producers_left(pid)


def test_producers_on_another_host_feed_the_loop(tmp_path, dataset):
    ids = {line.split("|")[0] for line in (dataset / "metadata.csv").read_text().splitlines()}
    with contextlib.ExitStack() as cleanup:  # a failure leaves neither the launcher nor its producers running
        with stoker.Feed(**options(tmp_path, dataset, producers=0, epochs=1, record_samples=True)) as feed:
            remote = cleanup.enter_context(RunProcess("produce", "--connect", feed.endpoint, "--data", str(dataset),
                                                      "--log-level", "WARNING"))
            trained = Recorder()
            for batch in feed:
                trained.note(batch, feed.epoch)
            steps = len(trained.steps)
        assert remote.wait(timeout=30) == 0, remote.output()  # told STOP when the feed closed
    assert steps == feed.batches_per_epoch
    check_trained(trained.steps, clips_of(tmp_path / "run"), 1, ids)
    assert [p["id"] for p in read_json(tmp_path / "run" / "summary.json")["producers"]] == ["p0@" + __import__(
        "socket").gethostname()]


def _count_clips(strategy: Any) -> Any:
    import tensorflow as tf

    @tf.function
    def clips(batch: dict[str, Any]) -> Any:
        rows = strategy.run(lambda b: tf.reduce_sum(tf.cast(b["mel_lengths"] > 0, tf.int32)), (batch,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, rows, axis=None)

    return clips


def test_a_feed_with_a_strategy_gives_each_replica_its_part_of_every_batch(tmp_path, dataset, replica_devices):
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(replica_devices)
    clips = _count_clips(strategy)
    ids = {line.split("|")[0] for line in (dataset / "metadata.csv").read_text().splitlines()}
    with stoker.Feed(strategy=strategy, **options(tmp_path, dataset, epochs=1, record_samples=True)) as feed:
        assert all(rows == 2 * 4 for rows, _, _ in feed.shapes)  # a global batch: batch_size rows per replica
        assert "row_mask" in feed.element_spec  # replicas fix the rows: the empty ones are marked
        total = marked = 0
        trained = Recorder()
        for batch in feed:
            trained.note(batch, feed.epoch)
            parts = batch["mel"].values
            assert [p.device.split("/")[-1] for p in parts] == ["device:CPU:0", "device:CPU:1"]
            assert parts[0].shape == parts[1].shape and parts[0].shape[0] == 4
            total += int(clips(batch))
            marked += int(sum(float(tf.reduce_sum(p)) for p in batch["row_mask"].values))
        with pytest.raises(FeedError, match="per-replica already"):
            feed.as_dataset()
    assert total == marked == len(ids)
    check_trained(trained.steps, clips_of(tmp_path / "run"), 1, ids)
    assert read_json(tmp_path / "run" / "summary.json")["replicas"] == 2


def test_as_dataset_under_a_mirrored_strategy_gives_every_clip_to_a_replica(tmp_path, dataset, replica_devices):
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(replica_devices)
    clips = _count_clips(strategy)
    ids = {line.split("|")[0] for line in (dataset / "metadata.csv").read_text().splitlines()}
    with stoker.Feed(**options(tmp_path, dataset, epochs=1, record_samples=True, replicas=2)) as feed:
        total = 0
        trained = Recorder()
        for batch in strategy.experimental_distribute_dataset(feed.as_dataset()):
            total += int(clips(batch))
            trained.note(batch, feed.epoch)
            feed.step_done()  # batches may be taken ahead: each step trained is confirmed
        batches = feed.step
    assert total == len(ids) and batches == len(read_jsonl(tmp_path / "run" / "samples.jsonl"))
    check_trained(trained.steps, clips_of(tmp_path / "run"), 1, ids)


DEMO = PROJECT / "data" / "demo"


def test_the_clip_field_names_every_rows_clip_each_once_per_epoch_and_the_held_out_ones_in_validation(tmp_path):
    """Over the demo data (4 clips held out), with fixed rows: inside the step, each real row's clip
    carries the tokens of the clip feed.clips names, an empty row is -1, and every clip of the plan's
    epoch list is trained once per epoch."""
    given = options(tmp_path, DEMO, epochs=2, batch_size=16, framework="numpy")
    given["set"] = {"batching.fields": "clip", "batching.fixed_rows": True}
    trained: dict[int, list[int]] = {}
    empty = 0
    with stoker.Feed(**given) as feed:
        clips, vocabulary = feed.clips, feed.vocabulary
        assert len(clips) == 64 and vocabulary.pad_id == 0 and vocabulary.eos_id == 1
        for epoch, batches in feed.epochs():
            for batch in batches:
                lengths = batch["token_lengths"]
                for row, position in enumerate(batch["clip"].tolist()):
                    if position == -1:
                        assert lengths[row] == 0 and batch["row_mask"][row] == 0
                        empty += 1
                        continue
                    clip = clips[position]
                    assert batch["tokens"][row, :lengths[row]].tolist() == clip.tokens.tolist()
                    assert vocabulary.decode(batch["tokens"][row]) == clip.units and not clip.held_out
                    assert clips.position(clip.id) == position
                    trained.setdefault(epoch, []).append(position)
                feed.step_done()
        validated = [p for batch in feed.validation() for p in batch["clip"].tolist() if p != -1]
        planned = {epoch: clips.epoch(epoch).tolist() for epoch in trained}
        held = clips.validation
    assert sorted(trained) == [0, 1] and empty > 0  # the epoch's short batch: empty rows
    for epoch, positions in trained.items():
        assert len(positions) == len(set(positions)) == 60 and sorted(positions) == sorted(planned[epoch])
    assert sorted(validated) == sorted(held) and len(held) == 4 and all(clips[p].held_out for p in held)
    demo = {line.split("|")[0] for line in (DEMO / "metadata.csv").read_text().splitlines()}
    assert {clips[p].id for p in trained[0] + validated} == demo
    assert read_json(tmp_path / "run" / "summary.json")["rejected_messages"] == {}  # no batch's clip field was off
    assert_no_producers_left(os.getpid())


def test_the_indexs_rejections_are_in_rejected_jsonl_when_the_with_block_starts(tmp_path, dataset):
    append_metadata(dataset, ["T9999|a clip without audio|a clip without audio"])
    with stoker.Feed(**options(tmp_path, dataset, epochs=1, framework="numpy")) as feed:
        assert [r["id"] for r in read_jsonl(tmp_path / "run" / "rejected.jsonl")] == ["T9999"]
        assert len(feed.clips) == 24
        with pytest.raises(KeyError):
            feed.clips.position("T9999")


def test_a_user_transform_only_on_the_callers_sys_path_runs_in_the_producers(tmp_path, dataset, monkeypatch):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "quieter.py").write_text(
        "import os\n\n\ndef halve(audio, sample_id, **_):\n"
        f"    with open({str(tmp_path / 'called')!r}, 'a') as f:\n"
        "        f.write(f'{os.getpid()} {sample_id}\\n')\n"
        "    return audio * 0.5\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(mine))  # beside the user's script: on sys.path, not on PYTHONPATH
    monkeypatch.chdir(tmp_path)
    given = options(tmp_path, dataset, epochs=1, framework="numpy")
    given["set"] = {**given["set"], "transforms.user": "quieter:halve"}
    with stoker.Feed(**given) as feed:
        rows = sum(len(batch["token_lengths"]) for batch in feed)
    assert rows == 24
    called = [line.split() for line in (tmp_path / "called").read_text().splitlines()]
    assert {sample_id for _, sample_id in called} == {f"T{i:04d}" for i in range(24)}
    assert str(os.getpid()) not in {pid for pid, _ in called}  # in the producers
    assert_no_producers_left(os.getpid())


def test_a_feed_whose_start_failed_leaves_a_run_directory_the_next_feed_starts_in(tmp_path, dataset):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = options(tmp_path, dataset, epochs=1, framework="numpy", bind=f"tcp://127.0.0.1:{busy.getsockname()[1]}")
        with pytest.raises(UserError, match="in use"):
            with stoker.Feed(**taken):
                pass
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file() and not (run / "run.lock").exists()
    (run / "notes.txt").write_text("mine", encoding="utf-8")
    with stoker.Feed(**options(tmp_path, dataset, epochs=1, framework="numpy")) as feed:
        rows = sum(len(batch["token_lengths"]) for batch in feed)
    assert rows == 24 and read_json(run / "summary.json")["steps"] == feed.step > 0
    assert (run / "notes.txt").read_text(encoding="utf-8") == "mine"  # not a file of the run's: kept
    with pytest.raises(FeedError, match="holds a run"):  # this one trained: continued only with resume=
        stoker.Feed(**options(tmp_path, dataset, epochs=1, framework="numpy")).start()
    assert_no_producers_left(os.getpid())
