"""shared/errors.py: every error a user can fix shares one base, which the entry points catch."""

from __future__ import annotations

import pytest

from stoker.shared.errors import UserError


def _user_errors() -> list[type]:
    from stoker.consumer.feed.checkpoint import CheckpointError
    from stoker.consumer.protocol import BindError
    from stoker.consumer.training.synth import SynthError
    from stoker.consumer.training.tts import ModelError
    from stoker.producer.link import Refused
    from stoker.shared.config import ConfigError
    from stoker.shared.dataset.types import DatasetError
    from stoker.shared.keys import KeysError
    from stoker.shared.dataset.layouts import LayoutError
    from stoker.shared.text import TextError
    from stoker.devices import DeviceError
    from stoker.diagnose import DiagnoseError
    from stoker.launcher import LaunchError

    return [CheckpointError, BindError, SynthError, ModelError, Refused, ConfigError, DatasetError, KeysError,
            LayoutError, TextError, DeviceError, DiagnoseError, LaunchError]


@pytest.mark.parametrize("error", _user_errors(), ids=lambda e: e.__name__)
def test_each_user_error_is_one(error: type) -> None:
    assert issubclass(error, UserError)


def test_value_errors_stay_value_errors() -> None:
    """Code that catches ValueError around a config or text check still does."""
    from stoker.shared.config import ConfigError
    from stoker.shared.dataset.layouts import LayoutError
    from stoker.shared.text import TextError

    assert all(issubclass(e, ValueError) for e in (ConfigError, LayoutError, TextError))


def test_the_command_line_prints_any_user_error_as_one_line(monkeypatch, capsys) -> None:
    from stoker import cli
    from stoker.devices import DeviceError

    def fail(args):
        raise DeviceError("--data-gpu 7: no such GPU (found 0)")

    monkeypatch.setattr(cli, "cmd_diagnose", fail)
    assert cli.main(["diagnose", "somewhere"]) == cli.EXIT_USER
    assert capsys.readouterr().err == "stoker: error: --data-gpu 7: no such GPU (found 0)\n"
