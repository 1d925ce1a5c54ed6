"""The command line of remote producers: ``run.py keys``, ``--keys`` and ``produce`` mistakes."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tests.procs import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def one_error_line(result) -> str:
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("stoker: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


def test_keys_command_makes_pairs_and_says_how_to_use_them(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    result = run_cli("keys", str(keys), "--client", "hosta", "--client", "hostb")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (keys / "authorized").iterdir()) == ["hosta.key", "hostb.key"]
    assert stat.S_IMODE((keys / "hostb.key_secret").stat().st_mode) == 0o600
    assert "--keys" in result.stdout and "produce --connect" in result.stdout
    secret = (keys / "server.key_secret").read_text()
    assert not any(line.split('"')[1] in result.stdout for line in secret.splitlines() if "secret-key" in line)
    again = run_cli("keys", str(keys), "--client", "hosta")
    assert again.returncode == 0 and "kept" in again.stdout


def test_keys_command_mistakes_are_one_line(tmp_path: Path) -> None:
    assert "client name" in one_error_line(run_cli("keys", str(tmp_path / "k"), "--client", "a/b"))


def test_train_with_a_missing_keys_directory_is_one_line(tmp_path: Path) -> None:
    line = one_error_line(run_cli("--keys", str(tmp_path / "nope"), "--run-dir", str(tmp_path / "r")))
    assert "--keys" in line and "does not exist" in line


def test_non_loopback_bind_without_keys_points_at_keys(tmp_path: Path) -> None:
    line = one_error_line(run_cli("--bind", "tcp://10.200.1.1:5599", "--run-dir", str(tmp_path / "r")))
    assert "--keys" in line and "--insecure" in line


def test_produce_mistakes_are_one_line(tmp_path: Path) -> None:
    assert "is not an endpoint to connect to: expected tcp://HOST:PORT" in one_error_line(
        run_cli("produce", "--connect", "localhost:5555"))
    assert "does not exist" in one_error_line(run_cli("produce", "--connect", "tcp://127.0.0.1:9",
                                                      "--data", str(tmp_path / "nope")))
    assert "key directory" in one_error_line(run_cli("produce", "--connect", "tcp://127.0.0.1:9",
                                                     "--keys", str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    assert "metadata.csv not found" in one_error_line(run_cli("produce", "--connect", "tcp://127.0.0.1:9",
                                                              "--data", str(tmp_path / "empty")))
