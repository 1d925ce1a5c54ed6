"""CURVE keys (shared/keys.py): making, keeping and loading them."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from stoker.shared.keys import KeysError, load_client_keys, load_server_keys, make_keys

pytestmark = pytest.mark.timeout(30)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_make_keys_writes_pairs_allow_list_and_private_modes(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    report = make_keys(keys, ["client"])
    assert {p.name for p in keys.iterdir()} == {"server.key", "server.key_secret", "client.key",
                                                "client.key_secret", "authorized"}
    assert [p.name for p in (keys / "authorized").iterdir()] == ["client.key"]
    assert mode(keys / "server.key_secret") == 0o600 and mode(keys / "client.key_secret") == 0o600
    assert mode(keys) == 0o700
    assert any("created" in line for line in report)
    server = load_server_keys(keys)
    client = load_client_keys(keys)
    assert server.allowed == 1 and client.server_public == server.public and client.name == "client"
    assert server.secret.decode() not in repr(server) and client.secret.decode() not in repr(client)


def test_running_again_keeps_existing_keys_and_adds_clients(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    make_keys(keys, ["client"])
    before = (keys / "server.key_secret").read_bytes(), (keys / "client.key_secret").read_bytes()
    report = make_keys(keys, ["client", "hostb"])
    assert ((keys / "server.key_secret").read_bytes(), (keys / "client.key_secret").read_bytes()) == before
    assert any("kept" in line for line in report)
    assert load_server_keys(keys).allowed == 2


@pytest.mark.parametrize("name", ["server", "../up", "", "a b"])
def test_bad_client_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(KeysError):
        make_keys(tmp_path / "keys", [name])


def test_loading_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(KeysError, match="does not exist"):
        load_server_keys(tmp_path / "nope")
    keys = tmp_path / "keys"
    make_keys(keys, ["client"])
    (keys / "authorized" / "client.key").unlink()
    with pytest.raises(KeysError, match="no client public key"):
        load_server_keys(keys)


def test_a_producer_directory_needs_one_client_secret(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    make_keys(keys, ["a", "b"])
    with pytest.raises(KeysError, match="found: a.key_secret, b.key_secret"):
        load_client_keys(keys)
    producer_dir = tmp_path / "producer"
    producer_dir.mkdir()
    for name in ("server.key", "b.key", "b.key_secret"):
        (producer_dir / name).write_bytes((keys / name).read_bytes())
    assert load_client_keys(producer_dir).name == "b"
    (producer_dir / "server.key").unlink()
    with pytest.raises(KeysError, match="server.key"):
        load_client_keys(producer_dir)
