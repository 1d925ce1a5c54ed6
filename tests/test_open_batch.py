"""End-to-end: a run with every opening at once (optional fields, the model's own
loss terms, AdamW with the Noam schedule, frame-budget batches), killed and resumed."""

from __future__ import annotations

import pytest

from stoker.shared.dataset.corpus.registry import read_metadata
from stoker.shared.dataset.files import DEMO_DATA_DIR
from tests.procs import read_json, read_jsonl, run_cli
from tests.test_run import NUMPY_FEATURES
from tests.trained import check_run

DEMO_IDS = {e.id for e in read_metadata(DEMO_DATA_DIR)[0]}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.slow
def test_open_batch_run_trains_checkpoints_and_resumes(tmp_path):
    from tests.consumer.training.loss_models import CHECKED_REF_FRAMES

    run_dir = tmp_path / "run"
    common = ["--model", "tests.consumer.training.loss_models:fields_checker", "--producers", "1",
              "--set", "batching.fields=speaker_id,stop,audio,ref_mel",
              "--set", f"batching.ref_frames={CHECKED_REF_FRAMES}", "--set", "trainer.optimizer=adamw",
              "--set", "trainer.lr_decay=noam", "--set", "trainer.log_every_steps=3",
              "--set", "trainer.checkpoint_every_steps=6", "--model-start-delay", "0.2", *NUMPY_FEATURES]
    first = run_cli(*common, "--max-frames", "800", "--steps", "6", "--record-samples", "--run-dir", str(run_dir),
                    timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_cli("--resume", str(run_dir), "--steps", "12", timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13))
    for row in rows:
        assert set(row["terms"]) == {"mel_l1", "fit", "level"}
        assert row["loss"] == pytest.approx(sum(row["terms"].values()), rel=1e-3, abs=1e-4)
    summary = read_json(run_dir / "summary.json")
    assert summary["exit_reason"] == "completed" and summary["resumed_from_step"] == 6
    assert summary["frames_per_batch"]["max"] <= 800
    held = set(read_json(run_dir / "validation.json")["ids"])
    epochs = 1 + max(r["epoch"] for r in read_jsonl(run_dir / "trained.jsonl"))
    # every clip the model's steps trained is the clip its tokens name, none twice in an epoch, across the resume
    check_run(run_dir, epochs, DEMO_IDS - held, open_epochs=1)


def test_precompute_measures_the_mel_statistics_a_mel_norm_run_uses(tmp_path):
    import json

    import numpy as np

    from stoker.producer.audio import load_audio
    from stoker.producer.features import log_mel_spectrogram_numpy
    from stoker.shared.config import FeaturesConfig
    from stoker.shared.runfiles import MEL_STATS
    from tests.factories import make_dataset

    data = tmp_path / "data"
    ids = make_dataset(data, count=12)
    settings = ["--set", "transforms.trim_db=30", "--set", "features.backend=numpy"]
    refused = run_cli("--data", str(data), "--model", "synthetic:1", "--steps", "2", "--run-dir", str(tmp_path / "r0"),
                      "--set", "transforms.mel_norm=dataset", *settings, timeout=120)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].startswith(
        "stoker: error: transforms.mel_norm=dataset needs the dataset's mel statistics")
    assert "python run.py precompute" in refused.stderr

    pre = run_cli("precompute", "--data", str(data), "--producers", "1", "--run-dir", str(tmp_path / "pre"),
                  *settings, timeout=120)
    assert pre.returncode == 0, pre.stderr[-2000:]
    measured = json.loads((tmp_path / "pre" / MEL_STATS).read_text())
    from stoker.producer.features import centered_window

    features = FeaturesConfig(backend="numpy")
    mels = []
    for i in ids:  # trim_db=30 on the mel's frames (producer/transforms.py), computed here in float64
        audio = load_audio(data / "wavs" / f"{i}.wav", 22050)
        padded = np.pad(audio.astype(np.float64), features.n_fft // 2, mode="reflect")
        frames = np.lib.stride_tricks.sliding_window_view(padded, features.n_fft)[::features.hop_length]
        energy = np.sum((frames * centered_window(features)) ** 2, axis=1)
        loud = np.flatnonzero(energy > energy.max() * 10 ** (-30 / 10))
        end = min(len(audio), (int(loud[-1]) + 1) * features.hop_length)
        first = int(loud[0])
        mels.append(log_mel_spectrogram_numpy(audio, features)[first:first + 1 + end // features.hop_length - first])
    frames = np.concatenate(mels)
    assert measured["frames"] == len(frames)
    np.testing.assert_allclose(measured["mean"], frames.mean(axis=0), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(measured["std"], frames.std(axis=0), rtol=1e-3, atol=1e-3)

    used = run_cli("--data", str(data), "--model", "synthetic:1", "--steps", "4", "--producers", "1",
                   "--run-dir", str(tmp_path / "run"), "--set", "transforms.mel_norm=dataset", *settings, timeout=120)
    assert used.returncode == 0, used.stderr[-2000:]
    assert json.loads((tmp_path / "run" / MEL_STATS).read_text()) == measured
