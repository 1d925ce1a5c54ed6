"""The children's PYTHONPATH (shared/proc.py with_stoker_path, used by the launcher): the directory holding this
stoker only where a child would not import this stoker otherwise, and never ahead of a user's
module named as one of a checkout's folders."""

from __future__ import annotations

import os
import sys
import time
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest

from stoker.devices import DevicePlan
from stoker.launcher import Child, Supervisor
from stoker.shared.proc import PACKAGE_PARENT, STOKER_INIT, with_stoker_path

CHILD_DEADLINE_S = 60.0  # a child that imports stoker.shared.proc on a busy machine

PROBE = """import json, sys
import producer, shared, stoker
from stoker.shared.proc import StatusWriter

fd = int(sys.argv[sys.argv.index("--status-fd") + 1])
StatusWriter(fd).send("imported", stoker=stoker.__file__, shared=shared.__file__, producer=producer.__file__)
"""


def users_modules(folder: Path) -> Path:
    """A user's folder holding a module ``shared``, a package ``producer`` and the probe."""
    (folder / "producer").mkdir(parents=True)
    (folder / "producer" / "__init__.py").write_text("", encoding="utf-8")
    (folder / "shared.py").write_text("", encoding="utf-8")
    (folder / "path_probe.py").write_text(PROBE, encoding="utf-8")
    return folder


@pytest.mark.timeout(90)
def test_a_launched_child_imports_the_users_shared_and_producer_and_this_stoker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    users = users_modules(tmp_path / "user")
    monkeypatch.setenv("PYTHONPATH", str(users))
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")  # the child's first path entry: the user's directory, not a checkout
    sup = Supervisor(DevicePlan("cpu", None, None, None, None))
    try:
        child = sup.spawn(Child("producer", "probe", ["path_probe"], None))
        deadline = time.monotonic() + CHILD_DEADLINE_S
        while child.proc.poll() is None and time.monotonic() < deadline:
            sup.poll_status(0.2)
        sup.poll_status(0)  # what it wrote just before it exited
        assert child.proc.poll() == 0, f"the probe did not finish (status {child.proc.poll()})"
    finally:
        sup.cleanup()
    imported = [e for e in child.events if e.get("event") == "imported"]
    assert len(imported) == 1, child.events
    assert imported[0]["shared"] == str(users / "shared.py")
    assert imported[0]["producer"] == str(users / "producer" / "__init__.py")
    assert Path(imported[0]["stoker"]).resolve() == STOKER_INIT


def test_an_entry_holding_this_stoker_is_enough(tmp_path: Path) -> None:
    users = users_modules(tmp_path / "user")
    for path in (str(PACKAGE_PARENT), os.pathsep.join([str(users), str(PACKAGE_PARENT)])):
        assert with_stoker_path({"PYTHONPATH": path, "HOME": "h"}) == {"PYTHONPATH": path, "HOME": "h"}


def test_another_stoker_on_the_path_gets_this_one_just_before_it(tmp_path: Path) -> None:
    users = users_modules(tmp_path / "user")
    other = tmp_path / "other"
    (other / "stoker").mkdir(parents=True)
    (other / "stoker" / "__init__.py").write_text("", encoding="utf-8")
    path = os.pathsep.join([str(users), str(other)])
    assert with_stoker_path({"PYTHONPATH": path})["PYTHONPATH"] == os.pathsep.join(
        [str(users), str(PACKAGE_PARENT), str(other)])


class InstalledFinder:
    """Stands in for an editable install's finder, naming a stoker at ``origin``."""

    def __init__(self, origin: Path) -> None:
        self.origin = origin

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        return ModuleSpec(name, None, origin=str(self.origin)) if name == "stoker" else None


@pytest.mark.parametrize("installed, added", [(STOKER_INIT, False), (Path("/elsewhere/stoker/__init__.py"), True)])
def test_an_installed_stoker_is_used_only_when_it_is_this_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            installed: Path, added: bool) -> None:
    """An editable install of this checkout needs no entry; one of another worktree does, after the user's."""
    users = users_modules(tmp_path / "user")
    monkeypatch.setattr(sys, "meta_path", [InstalledFinder(installed), *sys.meta_path])
    got = with_stoker_path({"PYTHONPATH": str(users)})["PYTHONPATH"]
    assert got == (os.pathsep.join([str(users), str(PACKAGE_PARENT)]) if added else str(users))
