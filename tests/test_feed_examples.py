"""The feed examples of docs/FEED.md train for real: the custom loop (docs/examples/feed_loop.py)
survives a kill -9 of the user's process and resumes from its own checkpoint with every clip
but the held-out ones once per epoch, validating on those; Keras fit on ``as_dataset()``
(docs/examples/feed_fit.py) learns; the tuple trainer (docs/examples/tuple_trainer.py: fit on
the user's own map and prefetch) survives a kill -9 and trains every clip once per epoch, as
counted inside its training step."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.procs import read_json, read_jsonl
from tests.trained import Recorder, check_run, check_trained, clips_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROJECT = Path(__file__).resolve().parents[1]
EXAMPLES = PROJECT / "docs" / "examples"
DEMO_IDS = {line.split("|")[0] for line in (PROJECT / "data" / "demo" / "metadata.csv").read_text().splitlines()}


def run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=PROJECT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, **(env or {})})


def producers_of(pid: int) -> list[psutil.Process]:
    """The feed's processes of trainer ``pid``: its producers and its coordinator process."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if ("stoker.producer.worker" in line and f"--parent-pid {pid}" in line) or (
                "stoker.consumer.coordinator.coordproc" in line and line.endswith(f" {pid}")):
            found.append(p)
    return found


def test_custom_loop_killed_with_sigkill_resumes_from_its_checkpoint_with_every_clip_once(tmp_path):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    argv = ["--epochs", "4", "--run-dir", str(run_dir), "--checkpoint", str(ckpt), "--checkpoint-every", "3",
            "--record-samples"]
    killed = subprocess.Popen([sys.executable, "-m", "tests.feed_user", *argv], cwd=PROJECT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              env={**os.environ, "KILL_AT_STEP": "9"})
    try:  # the trainer's own end, not its stdout's: a process it left would hold that open
        assert killed.wait(timeout=240) == -9
        _, alive = psutil.wait_procs(producers_of(killed.pid), timeout=30)
        assert not alive, f"the killed trainer's producers or coordinator outlived it: {alive}"
    finally:  # a failure above leaves neither the trainer nor its producers running
        leftover = producers_of(killed.pid)
        killed.kill()
        for proc in leftover:
            proc.kill()
        psutil.wait_procs(leftover, timeout=10)
        out = killed.communicate(timeout=30)[0]
    assert "killing myself after the checkpoint of step 9" in out, out
    assert len(read_jsonl(run_dir / "metrics.jsonl")) >= 9
    resumed = run(["-m", "tests.feed_user", *argv])  # feed_loop.py, its steps noted
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "restored" in resumed.stdout and "the feed goes on from step 9" in resumed.stdout
    assert re.findall(r"step (\d+): validation loss", resumed.stdout) == ["12", "16"]  # each epoch's end
    held = sorted(read_json(run_dir / "validation.json")["ids"])
    validated = read_jsonl(run_dir / "validation.jsonl")
    for step in (12, 16):  # the resumed run's passes: every held-out clip once in each
        assert sorted(i for r in validated if r["step"] == step for i in r["ids"]) == held, step
    held = set(read_json(run_dir / "validation.json")["ids"])
    assert len(held) == 4
    check_run(run_dir, 4, DEMO_IDS - held)  # every clip but the held-out ones once per epoch, as the steps saw it
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 17))  # 4 epochs of 4 batches, each step once
    assert rows[-1]["loss"] < 0.6 * rows[0]["loss"], [r["loss"] for r in rows]
    summary = read_json(run_dir / "summary.json")
    assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == 4


def test_fit_on_as_dataset_learns_with_every_clip_once_per_epoch(tmp_path):
    run_dir = tmp_path / "run"
    done = run(["-m", "tests.fit_user", "--epochs", "4", "--run-dir", str(run_dir), "--record-samples"])
    assert done.returncode == 0, done.stderr[-3000:]
    first, last = map(float, re.search(r"loss (\S+) -> (\S+)", done.stdout).groups())
    assert last < 0.6 * first, done.stdout
    held = set(read_json(run_dir / "validation.json")["ids"])
    assert len(held) == 4
    check_run(run_dir, 4, DEMO_IDS - held)  # as fit's steps saw it
    summary = read_json(run_dir / "summary.json")
    assert summary["steps"] == 16 and summary["exit_reason"] == "completed"


def test_tuple_trainer_under_fit_killed_after_a_checkpoint_trains_every_clip_once_per_epoch(tmp_path):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    argv = ["--epochs", "3", "--batch-size", "8", "--run-dir", str(run_dir), "--checkpoint", str(ckpt),
            "--checkpoint-every", "5", "--record-trained"]
    killed = run(["-m", "tests.tuple_user", *argv], env={"KILL_AT_STEP": "10"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run([str(EXAMPLES / "tuple_trainer.py"), *argv])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "restored step-00000010: the feed goes on from step 10" in resumed.stdout
    final = sorted(ckpt.glob("step-*"))[-1]
    rows = json.loads((final / "trained.json").read_text())  # what the model's steps saw, restored with its checkpoint
    clips = DEMO_IDS - set(read_json(run_dir / "validation.json")["ids"])
    assert len(rows) == 3 * len(clips)
    epochs = [{"epoch": e, "rows": rows[e * len(clips):(e + 1) * len(clips)]} for e in range(3)]
    check_trained(epochs, clips_of(run_dir), 3, clips)  # epoch after epoch, each clip once
    losses = [float(v) for v in resumed.stdout.rsplit("loss ", 1)[1].split(";")[0].split(" -> ")]
    assert losses[1] < losses[0], resumed.stdout
    summary = read_json(run_dir / "summary.json")
    assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == 3


def test_the_hugging_face_tokenizer_example_trains_every_clip_once_per_epoch_on_the_tokenizers_own_ids(
        tmp_path, monkeypatch):
    """docs/examples/hf_tokenizer.py in this process: inside each step, every row's ids are the
    tokenizer's own encoding of the text of the clip its ``clip`` field names; each clip but the
    held-out ones is trained once per epoch; the loss falls."""
    pytest.importorskip("tokenizers")
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("HF_TOKENIZER_FILE", "")  # the example sets it; restored after the test
    import hf_tokenizer

    run_dir, recorder, checked = tmp_path / "run", Recorder(), []

    def on_step(feed, batch, epoch):
        recorder.note(batch, epoch)
        clips = feed.clips
        own = hf_tokenizer.tokenizer()
        tokens, lengths = batch["tokens"].cpu().numpy(), batch["token_lengths"].cpu().numpy()
        for row, position in enumerate(batch["clip"].tolist()):
            assert tokens[row, :lengths[row]].tolist() == own.encode(clips[position].text).ids
            assert (tokens[row, lengths[row]:] == own.token_to_id(hf_tokenizer.PAD)).all()
            checked.append(position)

    losses = hf_tokenizer.train(PROJECT / "data" / "demo", run_dir, epochs=3, on_step=on_step)
    held = set(read_json(run_dir / "validation.json")["ids"])
    assert len(held) == 4 and len(checked) == 3 * (len(DEMO_IDS) - 4)
    check_trained(recorder.steps, clips_of(run_dir), 3, DEMO_IDS - held)
    assert read_json(run_dir / "vocab.json")["size"] == hf_tokenizer.tokenizer().get_vocab_size()
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses

