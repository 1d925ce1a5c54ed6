"""``run.py export`` (consumer/training/export.py): the trained model leaves stoker and plain TensorFlow runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from stoker.consumer.training.export import ABOUT_FILE, KERAS_FILE, SAVED_MODEL_DIR, ExportError, export
from stoker.shared.runfiles import VOCAB
from stoker.shared.mel import pad_values
from tests.consumer.training.fake_runs import SAVED_MODELS, fake_run
from tests.procs import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

# Plain TensorFlow in a fresh interpreter where importing any module of stoker fails: an
# editable install would make them importable from anywhere, so they are blocked outright.
LOAD_WITHOUT_STOKER = textwrap.dedent("""
    import sys

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("consumer", "producer", "shared", "stoker", "benchmarks", "tests"):
                raise ImportError(f"{name} is stoker's, and stoker is not here")
            return None

    sys.meta_path.insert(0, Blocked())
    import numpy as np
    import tensorflow as tf
    model = tf.saved_model.load(sys.argv[1])
    tokens = np.load(sys.argv[2])
    out = model.serve(tf.constant(tokens), tf.constant([tokens.shape[1]], tf.int32), tf.constant(40, tf.int32))
    np.save(sys.argv[3], out["mel"].numpy())
    np.save(sys.argv[4], out["log_frames"].numpy())
    assert not [m for m in sys.modules if m.split(".")[0] in ("consumer", "producer", "shared", "stoker")]
    import os
    os._exit(0)  # the checks are done and the files written: TensorFlow's teardown (~1 s) shows nothing
""")


def test_export_round_trip_in_plain_tensorflow(tmp_path) -> None:
    from stoker.consumer.training import tts
    from stoker.consumer.training.synth import encode_for_run, one_batch
    from stoker.shared import config as config_mod
    from stoker.shared.batch import SCHEMA

    run_dir = fake_run(tmp_path)
    result = export(run_dir, tmp_path / "exported")
    out = result.out
    assert sorted(p.name for p in out.iterdir()) == sorted([SAVED_MODEL_DIR, KERAS_FILE, VOCAB, ABOUT_FILE])
    about = json.loads((out / ABOUT_FILE).read_text())
    assert about["step"] == 7 and about["model"] == "tiny" and about["endpoint"]["inputs"] == [
        "tokens", "token_lengths", "frames"]
    assert about["features"]["n_mels"] == 80 and about["keras_file"] == KERAS_FILE

    cfg = config_mod.load(run_dir / "config.yaml")
    tokens, _ = encode_for_run(run_dir, cfg, "Where is the ball?", "en")
    np.save(tmp_path / "tokens.npy", tokens[None, :].astype(np.int32))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_STOKER, str(out / SAVED_MODEL_DIR),
                           str(tmp_path / "tokens.npy"), str(tmp_path / "mel.npy"), str(tmp_path / "lf.npy")],
                          cwd=elsewhere, env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-2000:]

    inputs = one_batch(tokens, 40, 80, pad_values(SCHEMA, cfg.features, "off"), SCHEMA)
    expected = tts.outputs_of(SAVED_MODELS[run_dir](inputs, training=False))
    np.testing.assert_allclose(np.load(tmp_path / "mel.npy"), np.asarray(expected["mel"]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.load(tmp_path / "lf.npy"), np.asarray(expected["log_frames"]), rtol=1e-5)


def test_export_refusals_are_one_line(tmp_path) -> None:
    run_dir = fake_run(tmp_path)
    (tmp_path / "taken").mkdir()
    with pytest.raises(ExportError, match="exists; export writes a new directory"):
        export(run_dir, tmp_path / "taken")
    result = run_cli("export", str(tmp_path / "nowhere"), str(tmp_path / "new"), timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"stoker: error: {tmp_path / 'nowhere'} is not a run directory "
                                                  f"(no config.yaml)"]
    assert not (tmp_path / "new").exists()
