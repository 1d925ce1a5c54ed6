"""Producer models (producer/models.py) in a producer's batch maker: the fields the trainer gets
equal the same encoder run alone in this process (docs/examples/neural_features.py), a later
epoch and a later run read them from the cache without calling the model (also after
``python run.py precompute``), and a model that fails rejects its batch's clips with the reason
(a model failing every batch ends the run: tests/test_run.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from stoker.consumer.coordinator.lease_tables import ReferenceTable
from stoker.producer.batches import BatchMaker
from stoker.producer.models import ModelSetupError, load_model, weights_digest
from stoker.shared import config as config_mod
from stoker.shared import wire
from stoker.shared.batch import schema_for
from stoker.shared.config import FeaturesConfig, TransformsConfig
from stoker.shared.dataset.corpus.registry import read_metadata
from stoker.shared.dataset.files import scan_audio
from stoker.shared.dataset.types import Sample
from tests.factories import make_dataset
from tests.procs import read_json, run_cli

pytestmark = pytest.mark.slow  # TensorFlow: not a unit test

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import neural_features as nf  # noqa: E402  (found on docs/examples, as a user's module is on PYTHONPATH)

FEATURES = FeaturesConfig(backend="numpy")
SHAPE = (64, 160)  # (L, T): room for every clip of make_dataset
REF_FRAMES = 40
MODELS = "neural_features:codec,neural_features:speaker"
SCORE = "score:float32:-:0"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("models") / "data"
    return root, make_dataset(root, count=5)


@pytest.fixture(autouse=True)
def weights(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURAL_FEATURES_WEIGHTS", str(tmp_path_factory.getbasetemp() / "weights"))


def _maker(root: Path, models: str, fields: str, cache: Path | None = None,
           batch_fields: str = "ref_mel", features: FeaturesConfig = FEATURES, ref_frames: int = REF_FRAMES,
           transforms: TransformsConfig | None = None) -> BatchMaker:
    entries, _ = read_metadata(root)
    files = {k: v.name for k, v in scan_audio(root).items()}
    return BatchMaker(root, {e.id: e.text for e in entries}, features, None, "p0", files=files,
                      schema=schema_for(batch_fields, "", fields), ref_frames=ref_frames,
                      feature_cache=str(cache or ""),
                      transforms=transforms or TransformsConfig(models=models, model_fields=fields))


def _lease(ids: list[str], refs: list[str]) -> wire.Lease:
    return wire.Lease(1, 0, 0, tuple(ids), SHAPE, len(ids), tuple((2, 3, 1) for _ in ids), refs=tuple(refs))


def test_fields_equal_the_encoder_alone_and_later_epochs_and_runs_read_the_cache(dataset, tmp_path) -> None:
    root, ids = dataset
    cache = tmp_path / "cache"
    lease = _lease(ids[:4], [ids[4], ids[3], ids[0], ids[1]])
    maker = _maker(root, MODELS, nf.MODEL_FIELDS, cache)
    first = maker.make(lease)
    assert first.batch.cache["model_runs"] == 2 and first.batch.cache["model_hits"] == 0
    arrays = first.arrays
    codec, speaker = nf.codec(), nf.speaker()
    for row in range(len(lease.ids)):
        frames, ref_frames = arrays["mel_lengths"][row], arrays["ref_mel_lengths"][row]
        alone = codec({"mel": arrays["mel"][row:row + 1, :frames], "mel_lengths": np.array([frames])})["codes"]
        valid = -(-frames // nf.GROUP)
        np.testing.assert_array_equal(arrays["codes"][row, :valid], np.asarray(alone)[0])
        assert (arrays["codes"][row, valid:] == -1).all()  # the declared padding past the valid codes
        embedding = speaker({"ref_mel": arrays["ref_mel"][row:row + 1, :ref_frames],
                             "ref_mel_lengths": np.array([ref_frames])})["speaker_embedding"]
        np.testing.assert_allclose(arrays["speaker_embedding"][row], np.asarray(embedding)[0], atol=1e-5)
    assert arrays["codes"].shape == (4, SHAPE[1] // nf.GROUP) and arrays["codes"].dtype == np.int32
    # Epoch 2, and a later run's producer (a new batch maker on the same cache): no model called.
    for again in (maker.make(lease), _maker(root, MODELS, nf.MODEL_FIELDS, cache).make(lease)):
        assert again.batch.cache["model_runs"] == 0 and again.batch.cache["model_hits"] == 8
        for name in ("codes", "speaker_embedding"):
            np.testing.assert_array_equal(again.arrays[name], arrays[name])


@pytest.mark.timeout(180)
def test_after_precompute_a_later_run_calls_no_model_and_gets_the_encoders_outputs(dataset, tmp_path) -> None:
    """``python run.py precompute --producer-models``, then a producer of a later run (its batch
    maker, with the run's config) on every clip of its first epoch, each with the reference that
    epoch gives it: no model is called, and the codes and embeddings equal the encoders run here."""
    root, ids = dataset
    cache = tmp_path / "cache"
    settings = {"features.backend": "numpy", "transforms.models": MODELS, "transforms.model_fields": nf.MODEL_FIELDS,
                "batching.fields": "ref_mel", "trainer.val_clips": 0, "data.feature_cache": str(cache)}
    done = run_cli("precompute", "--data", str(root), "--producers", "1", "--batch-size", "2",
                   "--run-dir", str(tmp_path / "pre"), *(a for k, v in settings.items() for a in ("--set", f"{k}={v}")),
                   env={"PYTHONPATH": str(EXAMPLES)}, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sum(p["model_runs"] for p in read_json(tmp_path / "pre" / "summary.json")["producers"]) > 0
    cfg = config_mod.load(None, settings)
    refs = ReferenceTable([Sample(i, "", 0, 0, 0.0) for i in ids], cfg.batching.seed)(0, ids)
    maker = _maker(root, MODELS, nf.MODEL_FIELDS, cache, features=cfg.features, ref_frames=cfg.batching.ref_frames,
                   transforms=cfg.transforms)
    made = maker.make(_lease(ids, refs))
    assert list(made.batch.ids) == ids and not made.batch.rejected
    assert made.batch.cache["model_runs"] == 0 and made.batch.cache["model_hits"] == 2 * len(ids)
    arrays = made.arrays
    codec, speaker = nf.codec(), nf.speaker()
    for row in range(len(ids)):
        frames, ref_frames = arrays["mel_lengths"][row], arrays["ref_mel_lengths"][row]
        alone = codec({"mel": arrays["mel"][row:row + 1, :frames], "mel_lengths": np.array([frames])})["codes"]
        np.testing.assert_array_equal(arrays["codes"][row, :-(-frames // nf.GROUP)], np.asarray(alone)[0])
        embedding = speaker({"ref_mel": arrays["ref_mel"][row:row + 1, :ref_frames],
                             "ref_mel_lengths": np.array([ref_frames])})["speaker_embedding"]
        np.testing.assert_allclose(arrays["speaker_embedding"][row], np.asarray(embedding)[0], atol=1e-5)


@pytest.mark.parametrize("model, reason", [
    ("raising", "ValueError: the model cannot take this batch"),
    ("not_finite", "score holds NaN or inf"),
    ("wrong_shape", "score is float32 [3, 2]; declared float32 [B] = [3]"),
])
def test_a_batch_the_model_fails_on_rejects_its_clips_with_the_reason(dataset, model, reason) -> None:
    root, ids = dataset
    made = _maker(root, f"tests.producer.user_models:{model}", SCORE, batch_fields="").make(_lease(ids[:3], ids[:3]))
    assert made.batch.ids == () and made.arrays["mel"].shape[0] == 0 and made.arrays["score"].shape == (0,)
    assert [e.id for e in made.batch.rejected] == list(ids[:3])
    assert all(e.reason.startswith(f"producer model tests.producer.user_models:{model}: ") and reason in e.reason
               for e in made.batch.rejected), made.batch.rejected


def test_a_callable_module_runs_on_the_batch(dataset) -> None:
    root, ids = dataset
    made = _maker(root, "tests.producer.user_models:mean_level", SCORE, batch_fields="").make(_lease(ids[:2], ids[:2]))
    np.testing.assert_allclose(made.arrays["score"], 2 * made.arrays["mel"].mean(axis=(1, 2)), rtol=1e-5)


def test_a_model_xla_cannot_compile_runs_without_it_once_warned(dataset, caplog) -> None:
    root, ids = dataset
    maker = _maker(root, "tests.producer.user_models:host_op", SCORE, batch_fields="")
    model = maker.models.models[0]
    model.jit = True  # as on a GPU
    for _ in range(2):
        made = maker.make(_lease(ids[:2], ids[:2]))
        np.testing.assert_array_equal(made.arrays["score"], 2 * made.arrays["mel_lengths"])
    assert not model.jit
    assert caplog.text.count("XLA cannot compile it") == 1


def test_models_that_cannot_load_or_read_other_fields_are_one_line_naming_them() -> None:
    with pytest.raises(ModelSetupError, match=r"^transforms.models tests.producer.user_models:broken: cannot build "
                                              r"or load the model: OSError: weights file missing$"):
        load_model("tests.producer.user_models:broken")
    with pytest.raises(ModelSetupError, match=r"inputs \['tokens', 'mel'\]; a model reads the fields of one clip"):
        load_model("tests.producer.user_models:reads_tokens")
    with pytest.raises(ModelSetupError, match="cannot import tests.producer.nothing_here"):
        load_model("tests.producer.nothing_here:model")


def test_the_version_follows_the_weights() -> None:
    level = load_model("tests.producer.user_models:mean_level")
    other = load_model("tests.producer.user_models:mean_level")
    assert level.version == other.version and level.version.count("sha256:") == 2
    module = level.fn
    before = weights_digest(module)
    module.scale.assign(3.0)
    assert weights_digest(module) != before
