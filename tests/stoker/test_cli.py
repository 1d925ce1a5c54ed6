"""The command line's pure parts: where a trainer worker of a multi-host job writes."""

from __future__ import annotations

import argparse
import json

import pytest

from stoker.cli import _worker_paths
from stoker.shared.cluster import ClusterError
from stoker.shared.errors import UserError

TWO = json.dumps({"cluster": {"worker": ["h0:1", "h1:1"]}, "task": {"type": "worker", "index": 1}})


def args(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"run_dir": None, "resume": None, **given})


def test_each_worker_writes_its_own_directory_of_the_jobs(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TF_CONFIG", TWO)
    new = args(run_dir=str(tmp_path / "job"))
    _worker_paths(new)
    assert new.run_dir == str(tmp_path / "job" / "worker-1")
    resumed = args(resume=str(tmp_path / "job"))
    _worker_paths(resumed)
    assert resumed.resume == str(tmp_path / "job" / "worker-1") and resumed.run_dir is None


def test_a_single_trainer_keeps_its_paths(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    alone = args(run_dir=str(tmp_path / "run"))
    _worker_paths(alone)
    assert alone.run_dir == str(tmp_path / "run")


def test_workers_without_a_shared_run_dir_and_a_broken_tf_config_are_one_line(monkeypatch) -> None:
    monkeypatch.setenv("TF_CONFIG", TWO)
    with pytest.raises(UserError, match="give every worker the same --run-dir DIR"):
        _worker_paths(args())
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ClusterError, match="TF_CONFIG is not valid JSON"):
        _worker_paths(args(run_dir="x"))


def test_a_fresh_plan_without_resume_is_one_line(monkeypatch, capsys) -> None:
    from stoker.cli import main

    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert main(["--fresh-plan", "--steps", "1"]) == 2
    assert capsys.readouterr().err == ("stoker: error: --fresh-plan starts a new epoch plan for a resumed run: give it "
                                       "with --resume RUN_DIR\n")
