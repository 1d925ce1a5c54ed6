"""End to end from a lhotse Shar directory (written by lhotse's ``CutSet.to_shar``), on this host
and in an S3-compatible store (moto's server on loopback): a producer killed by SIGKILL mid-run
and restarted, the whole run killed after a checkpoint and resumed, and every clip trained
exactly once per epoch, each with the mel of its own member's audio as lhotse reads it; a
missing and a corrupt member are counted rejections naming the cut and its shard."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile
from lhotse import CutSet, MonoCut, Recording, SupervisionSegment

from stoker.producer.features import log_mel_spectrogram_numpy
from stoker.shared import config as config_mod
from stoker.shared.runfiles import CONFIG, REJECTED
from tests.factories import sentence, tone
from tests.objectstore import S3Server
from tests.procs import RunProcess, read_json, read_jsonl
from tests.test_resume import kill_a_producer_then_crash
from tests.test_run import FAST_HEARTBEAT, NUMPY_FEATURES
from tests.test_shards_run import RUN
from tests.trained import Clip, check_trained, clips_of, trained_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

EPOCHS = 3  # RUN's
RATE = 22050  # the features' rate (NUMPY_FEATURES): the members' mel is compared as lhotse reads them


def write_shar(root: Path, clips: int = 40, shard_size: int = 10) -> tuple[Path, list[str]]:
    """A CutSet of ``clips`` cuts (every third a window of a longer recording, as lhotse cuts a
    corpus) written by lhotse to ``root/shar`` as Shar (flac members); the directory and the ids."""
    (root / "recordings").mkdir(parents=True)
    cuts = []
    for n in range(clips):
        path = root / "recordings" / f"r{n}.wav"
        long = n % 3 == 0
        soundfile.write(str(path), tone(2.0 if long else 0.6 + 0.05 * (n % 8), RATE, seed=n), RATE,
                        subtype="PCM_16")
        recording = Recording.from_file(path)
        start, duration = (0.5, 0.9) if long else (0.0, recording.duration)
        text = sentence(n, words=3 + n % 5)
        cuts.append(MonoCut(id=f"cut{n:03d}", start=start, duration=duration, channel=0, recording=recording,
                            supervisions=[SupervisionSegment(id=f"s{n}", recording_id=recording.id, start=0.0,
                                                             duration=duration, text=text, speaker=f"spk{n % 3}",
                                                             language="en")]))
    shar = root / "shar"
    shar.mkdir()
    CutSet.from_cuts(cuts).to_shar(shar, fields={"recording": "flac"}, shard_size=shard_size)
    return shar, [c.id for c in cuts]


def member_mels(run_dir: Path, shar: Path) -> dict[str, Clip]:
    """clips_of's clips, each with the mel of its audio as lhotse reads it from the Shar directory
    (clips_of computes the mel of local loose files only): a producer that read another member,
    or another part of it, fails."""
    features = config_mod.load(run_dir / CONFIG).features
    clips = clips_of(run_dir)
    # lhotse's own reader, given its fields (the index cache's .stoker/ beside them is no field of lhotse's)
    fields = {"cuts": sorted(shar.glob("cuts.*.jsonl.gz")), "recording": sorted(shar.glob("recording.*.tar"))}
    for cut in CutSet.from_shar(fields=fields):
        if cut.id in clips:
            assert cut.sampling_rate == features.sample_rate_hz
            mel = log_mel_spectrogram_numpy(cut.load_audio()[0].astype(np.float32), features).astype(np.float64)
            clips[cut.id] = dataclasses.replace(clips[cut.id], mel=(float(mel.mean()), float(np.abs(mel).mean())))
    return clips


@pytest.mark.parametrize("store", ["local", "s3"])
def test_shar_trains_every_clip_once_per_epoch_through_a_producer_kill_and_a_resume(tmp_path, store):
    shar, ids = write_shar(tmp_path / "corpus")
    run_dir = tmp_path / "run"
    with contextlib.ExitStack() as stack:
        data, env = str(shar), {}
        if store == "s3":
            server = stack.enter_context(S3Server())
            server.upload(shar, "corpus", "shar")
            data, env = "s3://corpus/shar/", {**server.env(), "XDG_CACHE_HOME": str(tmp_path / "cache")}
        with RunProcess("--data", data, "--run-dir", str(run_dir), *RUN, env=env) as run:
            kill_a_producer_then_crash(run)
        with RunProcess("--resume", str(run_dir), env=env) as again:
            assert again.wait(timeout=90) == 0, again.output()
        with server.client(XDG_CACHE_HOME=str(tmp_path / "cache")) if store == "s3" else contextlib.nullcontext():
            check_trained(trained_steps(run_dir), member_mels(run_dir, shar), EPOCHS, ids)
    summary = read_json(run_dir / "summary.json")
    assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == EPOCHS
    assert summary["resumed_from_step"] >= 6 and summary["rejected"] == 0


def _rewrite(tar_path: Path, change) -> None:
    """The tar at ``tar_path`` written again, each member through ``change(name, bytes)`` (None: left out)."""
    with tarfile.open(tar_path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(tar_path, "w") as tar:
        for member, data in members:
            data = change(member.name, data)
            if data is not None:
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))


def test_a_missing_and_a_corrupt_member_are_counted_rejections_naming_cut_and_shard(tmp_path):
    shar, ids = write_shar(tmp_path / "corpus", clips=16, shard_size=8)
    _rewrite(shar / "recording.000000.tar", lambda name, data: None if name.startswith("cut002.") else data)
    _rewrite(shar / "recording.000001.tar",
             lambda name, data: b"no audio at all\n" * 100 if name == "cut009.flac" else data)
    run_dir = tmp_path / "run"
    with RunProcess("--data", str(shar), "--run-dir", str(run_dir), "--model", "synthetic:5", "--batch-size", "4",
                    "--producers", "2", "--epochs", "2", "--record-samples", *NUMPY_FEATURES, *FAST_HEARTBEAT) as run:
        assert run.wait(timeout=90) == 0, run.output()
    kept = [i for i in ids if i not in ("cut002", "cut009")]
    check_trained(trained_steps(run_dir), clips_of(run_dir), 2, kept)
    rejected = {r["id"]: r for r in read_jsonl(run_dir / REJECTED)}
    assert sorted(rejected) == ["cut002", "cut009"]
    assert "has no audio member in shard recording.000000.tar" in rejected["cut002"]["reason"]
    assert rejected["cut009"]["producer"] != "index"
    assert "cut009.flac" in rejected["cut009"]["reason"] and "recording.000001.tar" in rejected["cut009"]["reason"]
    assert read_json(run_dir / "summary.json")["rejected"] == 2
