"""Which framework's batches a feed hands out (trainer.framework), and what needs TensorFlow:
the option and its one-line refusals, the TensorFlow-only parts of a feed refused for the
other frameworks, the feed's state as PyTorch's Stateful, and one line where stoker's own
trainer or a TensorFlow feed needs TensorFlow and it is not installed. Nothing here starts a
process: the feeds are never started (tests/test_feed_frameworks.py runs them)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

import stoker
from stoker import cli
from stoker.feed import FeedError
from stoker.service import prepare_run, resolve
from stoker.shared import config as config_mod
from stoker.shared.errors import UserError

pytestmark = pytest.mark.timeout(60)

NO_TENSORFLOW = "needs TensorFlow: pip install 'stoker[tf]'"


@pytest.fixture
def without(monkeypatch: pytest.MonkeyPatch):
    """Make a module look not installed in this process: import fails, find_spec says None."""
    def hide(*modules: str) -> None:
        for module in modules:
            monkeypatch.setitem(sys.modules, module, None)
    return hide


def test_framework_is_a_config_key_defaulting_to_tensorflow_and_settable_by_yaml_and_set(tmp_path) -> None:
    assert config_mod.load(None).trainer.framework == "tensorflow"
    (tmp_path / "c.yaml").write_text("trainer:\n  framework: jax\n")
    assert config_mod.load(tmp_path / "c.yaml").trainer.framework == "jax"
    key, value = config_mod.parse_override("trainer.framework=torch")
    assert config_mod.load(None, {key: value}).trainer.framework == "torch"


def test_an_unknown_framework_is_refused_with_one_line_naming_the_choices() -> None:
    with pytest.raises(config_mod.ConfigError) as caught:
        config_mod.load(None, {"trainer.framework": "pytorch"})
    assert str(caught.value) == "trainer.framework must be one of tensorflow, torch, jax, numpy, got 'pytorch'"
    with pytest.raises(FeedError, match="trainer.framework must be one of tensorflow, torch, jax, numpy") as caught:
        stoker.Feed(framework="mxnet")
    assert "\n" not in str(caught.value)


def test_the_producers_tensorflow_backend_is_refused_for_another_framework() -> None:
    with pytest.raises(config_mod.ConfigError, match="features.backend tf .* for TensorFlow runs only"):
        config_mod.load(None, {"trainer.framework": "torch", "features.backend": "tf"})
    assert config_mod.load(None, {"features.backend": "tf"}).features.backend == "tf"


@pytest.mark.parametrize("framework", ["torch", "jax", "numpy"])
def test_a_feed_of_another_framework_has_its_producers_compute_with_numpy(framework: str) -> None:
    """features.backend auto would be TensorFlow ops in a producer given a GPU: numpy instead."""
    pytest.importorskip(framework)
    cfg, _ = prepare_run(stoker.Feed(framework=framework, producers=1).cfg, trains_model=False)
    assert cfg.features.backend == "numpy" and cfg.trainer.framework == framework
    tf_cfg, _ = prepare_run(stoker.Feed(producers=1).cfg, trains_model=False)
    assert tf_cfg.features.backend == "auto"  # each producer decides by its GPU, as before


def test_framework_and_set_must_agree() -> None:
    assert stoker.Feed(set={"trainer.framework": "numpy"}).framework == "numpy"
    assert stoker.Feed(framework="numpy", set={"trainer.framework": "numpy"}).framework == "numpy"
    with pytest.raises(FeedError, match="framework='numpy', but set= has trainer.framework='jax'"):
        stoker.Feed(framework="numpy", set={"trainer.framework": "jax"})



class FakeStrategy:
    class extended:  # noqa: N801 (tf.distribute's attribute)
        worker_devices = ("/CPU:0", "/CPU:1")


def test_strategy_is_tensorflows_and_sharding_jaxs() -> None:
    with pytest.raises(FeedError, match="strategy= is a tf.distribute strategy, for framework='tensorflow'"):
        stoker.Feed(framework="torch", strategy=FakeStrategy())
    with pytest.raises(FeedError, match="sharding= is a jax.sharding.Sharding, for framework='jax'"):
        stoker.Feed(framework="numpy", sharding=object())


def test_sharding_must_be_a_jax_sharding() -> None:
    jax = pytest.importorskip("jax")
    with pytest.raises(FeedError, match="sharding= takes a jax.sharding.Sharding, got str"):
        stoker.Feed(framework="jax", sharding="batch")
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert stoker.Feed(framework="jax", sharding=sharding).framework == "jax"


@pytest.mark.parametrize("framework, module, line", [
    ("torch", "torch", "stoker.Feed(framework='torch') needs PyTorch: pip install torch"),
    ("jax", "jax", "stoker.Feed(framework='jax') needs JAX: pip install 'jax[cpu]'"),
    ("tensorflow", "tensorflow", f"stoker.Feed(framework='tensorflow') {NO_TENSORFLOW}"),
])
def test_a_framework_that_is_not_installed_is_one_line_when_the_feed_is_made(without, framework, module, line):
    without(module)
    with pytest.raises(FeedError) as caught:
        stoker.Feed(framework=framework)
    assert str(caught.value).startswith(line) and "\n" not in str(caught.value)


@pytest.mark.parametrize("use", [
    lambda feed: feed.element_spec, lambda feed: feed.as_dataset(), lambda feed: feed.validation_dataset(),
    lambda feed: feed.trackable(), lambda feed: feed.callback(),
], ids=["element_spec", "as_dataset", "validation_dataset", "trackable", "callback"])
def test_the_tensorflow_parts_of_a_feed_are_refused_for_another_framework_without_importing_it(without, use):
    without("tensorflow", "keras")  # importing either would raise ImportError here, not FeedError
    feed = stoker.Feed(framework="numpy")
    with pytest.raises(FeedError, match="for framework='tensorflow'; this feed hands out numpy batches: iterate it"):
        use(feed)


def test_the_feed_state_is_a_torch_stateful_taken_back_before_the_start() -> None:
    stateful = pytest.importorskip("torch.distributed.checkpoint.stateful")
    feed = stoker.Feed(framework="numpy")
    assert isinstance(feed, stateful.Stateful)
    with pytest.raises(FeedError, match="state_dict\\(\\) before the feed started"):
        feed.state_dict()
    state: dict[str, Any] = {"format": 1, "step": 3, "position": {"complete_below": 0, "complete": [], "open": {}}}
    feed.load_state_dict(state)
    assert feed.state_dict() is state  # what a checkpoint restored, until the feed starts from it


def test_stokers_trainer_without_tensorflow_is_one_line(without, capsys, kept_logging) -> None:
    without("tensorflow", "keras")
    assert cli.main(["--steps", "1", "--producers", "1"]) == 2
    assert capsys.readouterr().err == f"stoker: error: stoker's trainer (trainer.model tiny) {NO_TENSORFLOW}\n"
    for command in (["synth", ".", "--text", "hello", "--out", "mel.npy"], ["export", ".", "exported"]):
        assert cli.main(command) == 2
        assert capsys.readouterr().err.endswith(f"{NO_TENSORFLOW}\n"), command


def test_stokers_trainer_trains_tensorflow_batches_only() -> None:
    cfg = resolve(None, {"pipeline.producers": 1, "trainer.framework": "torch"})
    with pytest.raises(UserError, match="trainer.framework is torch: stoker's trainer .* trains with "
                                               "TensorFlow"):
        prepare_run(cfg)
    synthetic = resolve(None, {"pipeline.producers": 1, "trainer.model": "synthetic:1", "trainer.framework": "torch"})
    assert prepare_run(synthetic)[0].features.backend == "numpy"  # the pipeline alone needs no TensorFlow


def test_under_torchrun_each_rank_of_a_host_stages_onto_its_local_rank_gpu(monkeypatch) -> None:
    """torchrun's LOCAL_RANK picks the GPU (modulo those seen: ranks share GPUs they outnumber);
    without torchrun, the first."""
    from stoker.feed_staging import torchrun_gpu

    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert torchrun_gpu(2) == 0
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["h0:1", "h1:1"]}, "task": {"type": "worker", "index": 1}}')
    assert torchrun_gpu(2) == 0  # a TensorFlow worker: its GPUs are the strategy's business
    monkeypatch.delenv("TF_CONFIG")
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    assert [torchrun_gpu(count) for count in (4, 2, 1)] == [3, 1, 0]
