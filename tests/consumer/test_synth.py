"""``run.py synth`` (consumer/synth.py): a checkpointed model turns text into a mel and a PNG."""

from __future__ import annotations

import numpy as np
import pytest

from consumer.checkpoint import CKPT_DIR, Checkpointer
from consumer.synth import SynthError, synthesize
from shared import config as config_mod
from tests.procs import run_cli

tf = pytest.importorskip("tensorflow")


def _run_dir(tmp_path, model: str = "tiny", weights: bool = True):
    from consumer import tts
    from shared.text import VOCAB_SIZE

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = config_mod.load(None, {"trainer.model": model})
    config_mod.save(cfg, run_dir / "config.yaml")
    if weights:
        net = tts.build(model, VOCAB_SIZE, cfg.features.n_mels)
        net(tts.dummy_inputs(1, 8, 16, cfg.features.n_mels, -11.5))
        state = tf.train.Checkpoint(model=net, step=tf.Variable(7, dtype=tf.int64))
        Checkpointer(run_dir / CKPT_DIR, keep=1).save(7, {"state": ["model"], "model": model}, state)
    return run_dir


def test_synth_writes_mel_and_png(tmp_path) -> None:
    run_dir = _run_dir(tmp_path)
    result = synthesize(run_dir, "Printing, in the only sense with which we are concerned.", tmp_path / "o" / "mel.npy")
    mel = np.load(result.mel_path)
    assert mel.shape == (result.frames, 80) and mel.dtype == np.float32 and np.isfinite(mel).all()
    assert 1 <= result.frames <= 5000 and result.checkpoint.endswith("ckpt-000007")
    assert result.png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fixed = synthesize(run_dir, "Hello.", tmp_path / "fixed.npy", frames=50)
    assert np.load(fixed.mel_path).shape == (50, 80)


def test_synth_refusals(tmp_path) -> None:
    run_dir = _run_dir(tmp_path, weights=False)
    with pytest.raises(SynthError, match="no checkpoint in"):
        synthesize(run_dir, "Hello.", tmp_path / "mel.npy")
    with pytest.raises(SynthError, match="nothing to say"):
        synthesize(run_dir, "  ", tmp_path / "mel.npy")
    with pytest.raises(SynthError, match="--frames must be between"):
        synthesize(run_dir, "Hello.", tmp_path / "mel.npy", frames=0)


def test_synth_corrupt_checkpoint(tmp_path) -> None:
    run_dir = _run_dir(tmp_path)
    data = next((run_dir / CKPT_DIR).glob("ckpt-*/state.data-*"))
    data.write_bytes(b"\0" * data.stat().st_size)
    with pytest.raises(SynthError, match="corrupt"):
        synthesize(run_dir, "Hello.", tmp_path / "mel.npy")


@pytest.mark.timeout(60)
def test_synth_cli_errors_are_one_line(tmp_path) -> None:
    missing = run_cli("synth", str(tmp_path / "nope"), "--text", "hi")
    assert missing.returncode == 2 and missing.stderr.strip().endswith("is not a directory")
    run_dir = _run_dir(tmp_path, model="synthetic:5", weights=False)
    synthetic = run_cli("synth", str(run_dir), "--text", "hi")
    assert synthetic.returncode == 2
    assert synthetic.stderr.strip().splitlines()[-1] == (
        f"stoker: error: run {run_dir} trained the stand-in trainer synthetic:5, which has no model to synthesize with")
