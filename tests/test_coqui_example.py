"""docs/examples/coqui_glow_tts.py: Coqui TTS's own Glow-TTS, loss and optimizer, trained on stoker.Feed
with every clip but the held-out ones once per epoch, as counted inside the training step.

coqui-tts is not in the test extra: ``import TTS`` needs a torchaudio that loads beside the torch
installed (the example's docstring says how to get one beside a CPU torch); without it this skips."""

from __future__ import annotations

import pytest

from tests.procs import read_json
from tests.test_feed_examples import DEMO_IDS, EXAMPLES, PROJECT
from tests.trained import Recorder, check_trained, clips_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

INSTALL = ("needs coqui-tts and a torchaudio that loads beside this torch (pip install coqui-tts; "
           "docs/examples/coqui_glow_tts.py, Installing)")


def _glow_tts() -> None:
    try:
        from TTS.tts.models.glow_tts import GlowTTS  # noqa: F401
    except (ImportError, OSError) as exc:  # absent, or torchaudio's extension built for another torch
        pytest.skip(f"{INSTALL}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")


def test_coquis_glow_tts_trains_on_the_feed_every_clip_once_per_epoch_and_its_loss_falls(tmp_path, monkeypatch):
    _glow_tts()
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import coqui_glow_tts

    recorder = Recorder()
    run_dir = tmp_path / "run"
    losses = coqui_glow_tts.train({"data": str(PROJECT / "data" / "demo"), "epochs": 2, "batch_size": 16,
                                   "run_dir": str(run_dir)}, on_step=recorder.note)
    held = set(read_json(run_dir / "validation.json")["ids"])
    assert len(held) == 4 and len(recorder.steps) == 8  # 60 clips, batches of 16: 4 a epoch
    check_trained(recorder.steps, clips_of(run_dir), 2, DEMO_IDS - held)
    assert len(losses) == 8 - 2 and losses[-1] < losses[0], losses  # after 2 steps of data-dependent init
