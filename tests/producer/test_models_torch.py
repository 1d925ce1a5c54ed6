"""PyTorch and JAX producer models (producer/models_torch.py, models_jax.py) in a producer's
batch maker: the fields equal the same module run alone in this process (eager, TorchScript,
exported), later epochs and runs read the cache without calling the model (counted in the
model), JAX compiles once per bucket shape, failures are the clips' rejection reasons, the
version names the framework and follows the weights, no TensorFlow is imported for them, and
the data GPU's device and memory share are set as planned (a fake GPU here; the real one:
tests/producer/test_models_gpu.py). A producer killed mid-run: tests/stoker/test_feed_models_torch.py."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from stoker.producer import models_jax, models_torch
from stoker.producer.batches import BatchMaker
from stoker.producer.models import ModelSetupError, frameworks_of, load_model, weights_digest
from stoker.shared import wire
from stoker.shared.batch import schema_for
from stoker.shared.config import FeaturesConfig, TransformsConfig
from stoker.shared.dataset.corpus.registry import read_metadata
from stoker.shared.dataset.files import scan_audio
from tests.factories import make_dataset

torch = pytest.importorskip("torch")
from tests.producer import user_models_torch as um  # noqa: E402  (imports torch)

nft = um.nft
FEATURES = FeaturesConfig(backend="numpy")
SHAPE = (64, 160)  # (L, T): room for every clip of make_dataset
REF_FRAMES = 40
SPEC = "tests.producer.user_models_torch"
MODELS = f"{SPEC}:codec,{SPEC}:speaker"
SCORE = "score:float32:-:0"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("models") / "data"
    return root, make_dataset(root, count=5)


@pytest.fixture(autouse=True)
def weights(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURAL_FEATURES_WEIGHTS", str(tmp_path_factory.getbasetemp() / "weights"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU, as the launcher gives a producer without a GPU
    for name in models_jax.environment(None):  # what a runner sets for JAX: this process's own values come back
        monkeypatch.delenv(name, raising=False)


def _maker(root: Path, models: str, fields: str, cache: Path | None = None, batch_fields: str = "ref_mel") -> BatchMaker:
    entries, _ = read_metadata(root)
    files = {k: v.name for k, v in scan_audio(root).items()}
    return BatchMaker(root, {e.id: e.text for e in entries}, FEATURES, None, "p0", files=files,
                      schema=schema_for(batch_fields, "", fields), ref_frames=REF_FRAMES, feature_cache=str(cache or ""),
                      transforms=TransformsConfig(models=models, model_fields=fields))


def _lease(ids: list[str], refs: list[str], shape: tuple[int, int] = SHAPE) -> wire.Lease:
    return wire.Lease(1, 0, 0, tuple(ids), shape, len(ids), tuple((2, 3, 1) for _ in ids), refs=tuple(refs))


def assert_relative(actual: np.ndarray, expected: np.ndarray, tolerance: float = 1e-5) -> None:
    error = np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)
    assert error <= tolerance, f"relative error {error:.2e}"


def alone(arrays: dict[str, np.ndarray], row: int, codec: object, speaker: object) -> tuple[np.ndarray, np.ndarray]:
    """The codes and embedding of one row, its valid frames alone through the modules here."""
    frames, ref_frames = int(arrays["mel_lengths"][row]), int(arrays["ref_mel_lengths"][row])
    with torch.no_grad():
        codes = codec(mel=torch.from_numpy(arrays["mel"][row:row + 1, :frames]),
                      mel_lengths=torch.tensor([frames], dtype=torch.int32))["codes"]
        embedding = speaker(ref_mel=torch.from_numpy(arrays["ref_mel"][row:row + 1, :ref_frames]),
                            ref_mel_lengths=torch.tensor([ref_frames], dtype=torch.int32))["speaker_embedding"]
    return codes.numpy()[0], embedding.numpy()[0]


def test_fields_equal_the_modules_alone_and_later_epochs_and_runs_call_no_model(dataset, tmp_path) -> None:
    root, ids = dataset
    cache = tmp_path / "cache"
    lease = _lease(ids[:4], [ids[4], ids[3], ids[0], ids[1]])
    before = dict(um.CALLS)
    maker = _maker(root, MODELS, nft.MODEL_FIELDS, cache)
    assert {m.framework for m in maker.models.models} == {"torch"}
    first = maker.make(lease)
    assert first.batch.cache["model_runs"] == 2 and first.batch.cache["model_hits"] == 0
    assert um.CALLS["codec"] - before.get("codec", 0) == 1 and um.CALLS["speaker"] - before.get("speaker", 0) == 1
    arrays = first.arrays
    codec, speaker = nft.codec(), nft.speaker()
    for row in range(len(lease.ids)):
        codes, embedding = alone(arrays, row, codec, speaker)
        valid = -(-int(arrays["mel_lengths"][row]) // nft.GROUP)
        np.testing.assert_array_equal(arrays["codes"][row, :valid], codes)
        assert (arrays["codes"][row, valid:] == -1).all()  # the declared padding past the valid codes
        assert_relative(arrays["speaker_embedding"][row], embedding)
    assert arrays["codes"].shape == (4, SHAPE[1] // nft.GROUP) and arrays["codes"].dtype == np.int32
    calls = dict(um.CALLS)
    # Epoch 2, and a later run's producer (a new batch maker on the same cache): no model called.
    for again in (maker.make(lease), _maker(root, MODELS, nft.MODEL_FIELDS, cache).make(lease)):
        assert again.batch.cache["model_runs"] == 0 and again.batch.cache["model_hits"] == 8
        for name in ("codes", "speaker_embedding"):
            np.testing.assert_array_equal(again.arrays[name], arrays[name])
    assert dict(um.CALLS) == calls


@pytest.mark.parametrize("form", ["scripted", "exported"])
def test_torchscript_and_exported_codecs_give_the_eager_codes_in_every_bucket(dataset, form) -> None:
    root, ids = dataset
    eager = _maker(root, f"{SPEC}:codec", "codes:int32:T/4:-1", batch_fields="")
    other = _maker(root, f"{SPEC}:{form}", "codes:int32:T/4:-1", batch_fields="")
    for shape in (SHAPE, (64, 120)):
        lease = _lease(ids[:3], ids[:3], shape)
        want, got = eager.make(lease).arrays, other.make(lease).arrays
        assert got["codes"].shape == (3, shape[1] // 4)
        np.testing.assert_array_equal(got["codes"], want["codes"])


def test_a_jax_model_is_compiled_once_per_bucket_shape_and_equals_its_function(dataset) -> None:
    root, ids = dataset
    maker = _maker(root, f"{SPEC}:jax_level", SCORE, batch_fields="")
    (model,) = maker.models.models
    assert model.framework == "jax" and model.inputs == ("mel", "mel_lengths")
    traces = um.TRACES["jax_level"]
    for shape in (SHAPE, (64, 120), SHAPE):
        made = maker.make(_lease(ids[:3], ids[:3], shape)).arrays
        assert_relative(made["score"], um.numpy_level_of(made["mel"], made["mel_lengths"]))
    assert um.TRACES["jax_level"] - traces == 2  # one per bucket shape: the third batch reused the first's


def test_a_jax_model_jit_cannot_trace_runs_without_it_once_warned(dataset, caplog) -> None:
    root, ids = dataset
    maker = _maker(root, f"{SPEC}:jax_python_branch", SCORE, batch_fields="")
    for _ in range(2):
        made = maker.make(_lease(ids[:2], ids[:2]))
        np.testing.assert_array_equal(made.arrays["score"], 3.0 * made.arrays["mel_lengths"])
    assert not maker.models.models[0].jit
    assert caplog.text.count("jax.jit cannot trace it") == 1


def test_a_torch_batch_the_model_fails_on_rejects_its_clips_with_the_reason(dataset) -> None:
    root, ids = dataset
    made = _maker(root, f"{SPEC}:raising", SCORE, batch_fields="").make(_lease(ids[:3], ids[:3]))
    assert made.batch.ids == () and [e.id for e in made.batch.rejected] == list(ids[:3])
    assert {e.reason for e in made.batch.rejected} == {
        f"producer model {SPEC}:raising: RuntimeError: the model cannot take this batch"}


def test_torch_models_reading_other_fields_or_of_no_framework_are_one_line() -> None:
    with pytest.raises(ModelSetupError, match=r"inputs \['tokens'\]; a model reads the fields of one clip"):
        load_model(f"{SPEC}:reads_tokens")
    with pytest.raises(ModelSetupError, match=r"^transforms.models tests.producer.user_models_torch:not_a_model returned "
                                              r"int, not a PyTorch module .*, a JAX \(apply_fn, params\) pair, a Keras"):
        load_model(f"{SPEC}:not_a_model")


def test_the_version_names_the_framework_and_follows_the_weights() -> None:
    level, jax_level = load_model(f"{SPEC}:level"), load_model(f"{SPEC}:jax_level")
    assert level.version.startswith("torch:sha256:") and level.version.count("+sha256:") == 1
    assert jax_level.version.startswith("jax:sha256:") and jax_level.version.count("+sha256:") == 1
    assert frameworks_of({f"model:{SPEC}:level": level.version, f"model:{SPEC}:jax_level": jax_level.version,
                          "some.transform:fn": "sha256:0"}) == {"torch", "jax"}
    assert load_model(f"{SPEC}:level").version == level.version
    module = um.level()
    before = weights_digest(module)
    with torch.no_grad():
        module.scale.fill_(3.0)
    assert weights_digest(module) != before
    apply, params = um.jax_level()
    assert weights_digest((apply, {**params, "shift": [params["shift"][0] + 1]})) != weights_digest((apply, params))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_no_tensorflow_is_imported_for_torch_and_jax_models(dataset) -> None:
    """A fresh process (this one may have TensorFlow from another test) runs a batch through a
    PyTorch and a JAX model: TensorFlow is never imported."""
    root, ids = dataset
    script = f"""
import json, sys
from pathlib import Path
from tests.producer.test_models_torch import _lease, _maker
maker = _maker(Path({str(root)!r}), "{SPEC}:level,{SPEC}:jax_level", "score:float32:-:0",
               batch_fields="")
made = maker.make(_lease({ids[:2]!r}, {ids[:2]!r}))
print(json.dumps({{"rejected": [e.reason for e in made.batch.rejected], "tensorflow": "tensorflow" in sys.modules,
                  "frameworks": sorted(m.framework for m in maker.models.models)}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"rejected": [], "tensorflow": False, "frameworks": ["jax", "torch"]}


class FakeCuda:
    """torch.cuda of a host with one 80 GB card, recording the memory share asked for."""

    def __init__(self) -> None:
        self.fraction: tuple[float, object] | None = None

    def is_available(self) -> bool:
        return True

    def get_device_properties(self, device: object) -> types.SimpleNamespace:
        return types.SimpleNamespace(total_memory=80_000 * 2 ** 20)

    def set_per_process_memory_fraction(self, fraction: float, device: object) -> None:
        self.fraction = (fraction, device)


def test_a_producer_given_a_gpu_runs_torch_on_it_within_its_memory_share(monkeypatch) -> None:
    fake = types.SimpleNamespace(cuda=FakeCuda(), device=torch.device)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert models_torch.device_for(fake, 8000) == torch.device("cuda", 0)
    assert fake.cuda.fraction == (pytest.approx(0.1), torch.device("cuda", 0))
    fake.cuda.is_available = lambda: False
    with pytest.raises(ModelSetupError, match=r"given GPU 3 \(CUDA_VISIBLE_DEVICES\), but PyTorch sees no GPU"):
        models_torch.device_for(fake, 8000)


def test_jax_gets_its_memory_share_of_the_pinned_card_or_the_cpu_on_one_thread(monkeypatch) -> None:
    asked: list[object] = []

    def handle(index: int) -> str:
        asked.append(index)
        return "card"

    nvml = types.SimpleNamespace(NVMLError=RuntimeError, nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=handle,
                                 nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=80_000 * 2 ** 20))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert models_jax.environment(8000) == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.1000"} and asked == [2]
    assert models_jax.environment(None) == models_jax.NO_PREALLOCATION
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed: JAX allocates as it goes
    assert models_jax.environment(8000) == models_jax.NO_PREALLOCATION
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/dev/null")
    assert models_jax.environment(8000) == {"JAX_PLATFORMS": "cpu",
                                            "XLA_FLAGS": "--xla_dump_to=/dev/null --xla_cpu_multi_thread_eigen=false"}
