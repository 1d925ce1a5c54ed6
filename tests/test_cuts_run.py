"""End to end from a lhotse cut manifest (written by lhotse, gzip): windows of long recordings and
whole short ones, a producer killed by SIGKILL mid-run and restarted, the whole run killed after
a checkpoint and resumed, and every clip trained exactly once per epoch; a cut whose recording is
gone and one beyond its recording's end are counted rejections naming them, never a crash."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import soundfile
from lhotse import CutSet, MonoCut, Recording, SupervisionSegment

from stoker.producer.features import log_mel_spectrogram_numpy
from stoker.shared import config as config_mod
from stoker.shared.runfiles import CONFIG, REJECTED
from tests.factories import sentence, tone
from tests.procs import RunProcess, read_json, read_jsonl
from tests.test_resume import kill_a_producer_then_crash
from tests.test_run import FAST_HEARTBEAT, NUMPY_FEATURES
from tests.trained import Clip, check_run, check_trained, clips_of, trained_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

EPOCHS = 3
RATE = 22050
# 4 recordings of 6 s cut into windows of 0.6 to 1.3 s, and 8 whole recordings: 40 clips, batches
# of 4: 10 steps an epoch of 60 ms, a checkpoint every 3.
WINDOWS = (0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 0.8)
RUN = ["--model", "synthetic:60", "--batch-size", "4", "--producers", "2", "--epochs", str(EPOCHS),
       "--record-samples", "--model-start-delay", "0.2", "--set", "trainer.checkpoint_every_steps=3",
       "--set", "trainer.log_every_steps=1", *NUMPY_FEATURES, *FAST_HEARTBEAT]


def _cut(cut_id: str, recording: Recording, start: float, duration: float, seed: int) -> MonoCut:
    text = sentence(seed, words=3 + seed % 6)
    return MonoCut(id=cut_id, start=start, duration=duration, channel=0, recording=recording, supervisions=[
        SupervisionSegment(id=f"{cut_id}-s", recording_id=recording.id, start=0.0, duration=duration, text=text,
                           speaker=f"spk{seed % 3}")])


def write_corpus(root: Path) -> tuple[Path, list[str]]:
    """The recordings and ``root/cuts.jsonl.gz`` over them; the ids of the usable cuts."""
    (root / "recordings").mkdir(parents=True)
    cuts, seed = [], 0
    for r in range(4):
        path = root / "recordings" / f"long{r}.wav"
        soundfile.write(str(path), tone(6.0, RATE, seed=100 + r), RATE, subtype="PCM_16")
        recording, start = Recording.from_file(path), 0.0
        for duration in WINDOWS:
            cuts.append(_cut(f"L{r}-{seed}", recording, start, duration, seed))
            start, seed = round(start + duration, 3), seed + 1
    for n in range(8):
        path = root / "recordings" / f"short{n}.wav"
        soundfile.write(str(path), tone(0.7 + 0.1 * n, RATE, seed=200 + n), RATE, subtype="PCM_16")
        recording = Recording.from_file(path)
        cuts.append(_cut(f"S{n}", recording, 0.0, recording.duration, seed))
        seed += 1
    usable = [c.id for c in cuts]
    long0 = cuts[0].recording
    cuts.append(_cut("past", long0, 5.5, 1.0, seed))  # ends at 6.5 s of a 6 s recording
    soundfile.write(str(root / "recordings" / "gone.wav"), tone(1.0, RATE, seed=300), RATE, subtype="PCM_16")
    cuts.append(_cut("lost", Recording.from_file(root / "recordings" / "gone.wav"), 0.0, 1.0, seed + 1))
    (root / "recordings" / "gone.wav").unlink()
    manifest = root / "cuts.jsonl.gz"
    CutSet.from_cuts(cuts).to_file(manifest)
    return manifest, usable


def window_mels(run_dir: Path, manifest: Path) -> dict[str, Clip]:
    """clips_of's clips with each window's mel computed from its frames as lhotse reads them
    (clips_of computes the mel of whole local files only; the recordings are at the features'
    rate): a producer that read another part of the recording fails."""
    features = config_mod.load(run_dir / CONFIG).features
    clips = clips_of(run_dir)
    for cut in CutSet.from_file(manifest):
        if cut.id in clips and cut.duration < cut.recording.duration:
            assert cut.sampling_rate == features.sample_rate_hz
            mel = log_mel_spectrogram_numpy(cut.load_audio()[0].astype(np.float32), features).astype(np.float64)
            clips[cut.id] = dataclasses.replace(clips[cut.id], mel=(float(mel.mean()), float(np.abs(mel).mean())))
    return clips


def test_cuts_train_every_clip_once_per_epoch_through_a_producer_kill_and_a_resume(tmp_path):
    manifest, usable = write_corpus(tmp_path / "corpus")
    assert len(usable) == 36 and sum(1 for i in usable if i.startswith("L")) == 28
    run_dir = tmp_path / "run"
    with RunProcess("--data", str(manifest), "--run-dir", str(run_dir), *RUN) as run:
        kill_a_producer_then_crash(run)
    with RunProcess("--resume", str(run_dir)) as again:
        assert again.wait(timeout=90) == 0, again.output()
    check_run(run_dir, EPOCHS, set(usable))
    check_trained(trained_steps(run_dir), window_mels(run_dir, manifest), EPOCHS, usable)  # each window's own mel too
    summary = read_json(run_dir / "summary.json")
    assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == EPOCHS
    assert summary["resumed_from_step"] >= 6
    reasons: dict[str, list[str]] = {}
    for row in read_jsonl(run_dir / REJECTED):
        reasons.setdefault(row["id"], []).append(row["reason"])
    assert set(reasons) == {"past", "lost"}, reasons
    assert any("beyond its recording's end" in r for r in reasons["past"])
    assert any("gone.wav" in r for r in reasons["lost"])
