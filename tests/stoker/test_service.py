"""The run service's typed API (stoker/service.py), called as a library is: a config file
and overrides by config key, no command line; errors that name the config key; no silent
rewrite of a user's setting."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest

from stoker import service
from stoker.shared.config import DEFAULT_CONFIG
from stoker.shared.errors import UserError

TWO_WORKERS = json.dumps({"cluster": {"worker": ["h0:1", "h1:1"]}, "task": {"type": "worker", "index": 1}})


def test_a_config_is_a_yaml_file_then_overrides_by_config_key(tmp_path) -> None:
    yaml_file = tmp_path / "mine.yaml"
    yaml_file.write_text("batching:\n  batch_size: 7\ntrainer:\n  steps: null\n  epochs: 4\n")
    cfg = service.resolve(yaml_file, {"pipeline.producers": 3, "data.path": "corpus", "text.language": "fa"})
    assert (cfg.batching.batch_size, cfg.trainer.epochs, cfg.pipeline.producers) == (7, 4, 3)
    assert cfg.data.path == str(Path("corpus").resolve()) and cfg.text.language == "fa"
    auto = service.resolve(None, {"pipeline.producers": "auto"}).pipeline
    assert (auto.producers, auto.producers_auto) == (service.AUTO_START, True)


def test_the_service_never_sees_a_command_line() -> None:
    tree = ast.parse(Path(service.__file__).read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert "argparse" not in imported and "argparse" not in service.__dict__


def test_errors_name_the_config_key(tmp_path) -> None:
    with pytest.raises(UserError, match=r"^pipeline.bind: tcp://0.0.0.0:5555 is reachable from other hosts; .*set "
                                        r"pipeline.keys .* or pipeline.insecure"):
        service.prepare_run(service.resolve(None, {"pipeline.bind": "tcp://0.0.0.0:5555"}), trains_model=False)
    with pytest.raises(UserError, match=r"^pipeline.keys: "):
        service.prepare_run(service.resolve(None, {"pipeline.keys": str(tmp_path / "no-keys")}), trains_model=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(UserError, match=r"^run.run_dir: .*full is not empty; choose another run directory"):
        service.make_run_dir(str(tmp_path / "full"))
    with pytest.raises(UserError, match=r"^pipeline.producers: precompute needs at least one local producer"):
        service.precompute_config(service.resolve(None, {"pipeline.producers": 0}))
    with pytest.raises(UserError, match=r"^pipeline.producers: producers for a trainer elsewhere are at least 1"):
        service.produce("tcp://127.0.0.1:5555", "", 0)


def test_the_default_producers_per_replica_are_said_in_one_line_and_a_users_count_is_kept(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="stoker")
    default = service.resolve(None).pipeline.producers
    assert service.resolve(None, {"devices.replicas": 3}).pipeline.producers == 3 * default
    said = [r.getMessage() for r in caplog.records if "pipeline.producers" in r.getMessage()]
    assert said == [f"pipeline.producers: {default} -> {3 * default}, the default per model replica times 3 replicas "
                    f"(give pipeline.producers to choose the count)"]
    caplog.clear()
    assert service.resolve(DEFAULT_CONFIG, {"devices.replicas": 2}).pipeline.producers == 2 * default
    yaml_file = tmp_path / "mine.yaml"
    yaml_file.write_text(f"pipeline:\n  producers: {default}\n")  # the user's count, the default's value
    assert service.resolve(yaml_file, {"devices.replicas": 3}).pipeline.producers == default
    assert service.resolve(None, {"devices.replicas": 3, "pipeline.producers": 1}).pipeline.producers == 1
    assert not [r for r in caplog.records if "pipeline.producers" in r.getMessage()][1:]  # only the default's line


def test_a_value_dropped_from_the_users_file_is_said(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="stoker")
    yaml_file = tmp_path / "mine.yaml"
    yaml_file.write_text("trainer:\n  steps: null\n  epochs: 4\n")
    cfg = service.resolve(yaml_file, {"trainer.steps": 10})
    assert (cfg.trainer.steps, cfg.trainer.epochs) == (10, None)
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.epochs: 4 -> null, since trainer.steps 10 is given (the run stops at the one given)"]
    caplog.clear()
    assert service.resolve(None, {"trainer.epochs": 2}).trainer.steps is None  # the default's steps: nothing said
    assert not caplog.records


def test_resume_takes_the_runs_config_and_names_what_is_wrong(tmp_path) -> None:
    with pytest.raises(UserError, match="no such run directory"):
        service.resume_config(tmp_path / "nope", {})
    with pytest.raises(UserError, match="no config.yaml"):
        service.resume_config(tmp_path, {})
    (tmp_path / "config.yaml").write_text("pipeline:\n  producers: 6\ndevices:\n  replicas: 3\n")
    assert service.resolve(tmp_path / "config.yaml").pipeline.producers == 6  # a run's saved count, not 18
    with pytest.raises(UserError, match=r"^run.run_dir: a resumed run continues in its own directory"):
        service.resume_config(tmp_path, {"run.run_dir": str(tmp_path / "other")})
    with pytest.raises(UserError, match="no checkpoint in"):
        service.resume_config(tmp_path, {})


def test_each_trainer_worker_writes_its_own_directory_of_the_jobs(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert service.job_run_dir(str(tmp_path / "run")) == str(tmp_path / "run")
    monkeypatch.setenv("TF_CONFIG", TWO_WORKERS)
    assert service.job_run_dir(str(tmp_path / "job")) == str(tmp_path / "job" / "worker-1")
    with pytest.raises(UserError, match=r"^run.run_dir: TF_CONFIG names 2 trainer workers: give every worker the same"):
        service.job_run_dir("")


def test_torchrun_ranks_write_their_directories_of_the_jobs_and_feed_only_a_users_loop(tmp_path, monkeypatch) -> None:
    """Under torchrun each rank is a trainer worker of the job, as under TF_CONFIG; stoker's own
    trainer, whose workers are TensorFlow's, is refused there in one line."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert service.job_run_dir(str(tmp_path / "job")) == str(tmp_path / "job" / "worker-1")
    with pytest.raises(UserError, match=r"^run.run_dir: torchrun names 2 trainer workers"):
        service.job_run_dir("")
    cfg = service.resolve(None, {"trainer.model": "synthetic:1", "pipeline.producers": 1})
    with pytest.raises(UserError, match=r"^torchrun started this trainer: stoker's own trainer's workers are "
                                        r"TensorFlow's \(TF_CONFIG\); under torchrun train in your own loop"):
        service.prepare_run(cfg)
    assert service.prepare_run(cfg, trains_model=False)[0].batching.fixed_rows  # a feed's: each rank's share


def test_a_feed_starts_its_producers_through_the_service_not_the_launcher() -> None:
    """stoker.Feed's producers are started and supervised by the run service (start_producers);
    the feed, like the command line and Slurm's tasks, runs on the service."""
    from tests.test_layers import import_graph

    graph = import_graph()
    assert not {"stoker.launcher"} & (graph["stoker.feed"] | graph["stoker.feed_run"])
    assert all("stoker.service" in graph[adapter] for adapter in ("stoker.feed_run", "stoker.slurm", "stoker.cli"))
