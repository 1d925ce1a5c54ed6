"""The loader of the user's code: a module on sys.path (PYTHONPATH's entries), else in the current
directory, as the children find it; sys.path never changed; each failure one line naming the spec."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

from stoker.shared.errors import UserError
from stoker.shared.userfn import find_module, import_function, import_module, reload


class Refused(UserError):
    pass


@pytest.fixture
def module_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module name no other test uses, forgotten after the test; the current directory, which
    sys.path does not name, is an empty one."""
    name = f"user_mod_{tmp_path.name.replace('-', '_')}"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # an edited module is read again
    assert not {"", ".", str(cwd)} & set(sys.path)  # found there by the loader, not by sys.path
    yield name
    sys.modules.pop(name, None)


def write(folder: Path, name: str, value: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.py").write_text(f"def where():\n    return {value!r}\n", encoding="utf-8")


def test_a_module_in_the_current_directory_is_loaded_without_changing_sys_path(module_name: str) -> None:
    write(Path.cwd(), module_name, "cwd")
    before = list(sys.path)
    fn, module = import_function(f"{module_name}:where", "features.user", Refused)
    assert fn() == "cwd" and module is sys.modules[module_name]
    assert sys.path == before
    assert import_module(module_name) is module  # loaded once


def test_a_module_on_the_path_wins_over_the_current_directory(module_name: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    write(Path.cwd(), module_name, "cwd")
    write(tmp_path / "pythonpath", module_name, "pythonpath")
    monkeypatch.syspath_prepend(str(tmp_path / "pythonpath"))  # as a PYTHONPATH entry is at start-up
    before = list(sys.path)
    assert import_function(f"{module_name}:where", "features.user", Refused)[0]() == "pythonpath"
    assert sys.path == before


def test_a_package_in_the_current_directory_gives_its_modules(module_name: str) -> None:
    package = Path.cwd() / module_name
    package.mkdir()
    (package / "__init__.py").write_text("", encoding="utf-8")
    write(package, "inner", "inner")
    before = list(sys.path)
    found = find_module(f"{module_name}.inner")
    assert found is not None and found.origin == str(package / "inner.py")
    assert import_function(f"{module_name}.inner:where", "trainer.loss", Refused)[0]() == "inner"
    assert sys.path == before
    sys.modules.pop(f"{module_name}.inner", None)


def test_finding_a_module_does_not_run_it(module_name: str) -> None:
    (Path.cwd() / f"{module_name}.py").write_text("raise RuntimeError('ran')\n", encoding="utf-8")
    found = find_module(module_name)
    assert found is not None and found.origin == str(Path.cwd() / f"{module_name}.py")
    assert module_name not in sys.modules
    assert find_module(f"{module_name}_absent") is None


def test_an_edited_module_of_the_current_directory_is_reloaded(module_name: str) -> None:
    write(Path.cwd(), module_name, "first")
    module = import_module(module_name)
    write(Path.cwd(), module_name, "second")
    assert reload(module) is module and module.where() == "second"


@pytest.mark.parametrize("spec, said", [
    ("no_such_module_q:fn", "features.user no_such_module_q:fn: cannot import no_such_module_q: "
                            "ModuleNotFoundError: No module named 'no_such_module_q' (is it on PYTHONPATH?)"),
    ("{name}:absent", "features.user {name}:absent: {name} has no function absent"),
    ("{name}", "features.user {name}: expected package.module:function"),
    ("{name}:", "features.user {name}:: expected package.module:function"),
])
def test_what_cannot_be_loaded_is_one_line_naming_the_spec(module_name: str, spec: str, said: str) -> None:
    write(Path.cwd(), module_name, "cwd")
    with pytest.raises(Refused) as info:
        import_function(spec.format(name=module_name), "features.user", Refused)
    assert str(info.value) == said.format(name=module_name)


def test_a_module_that_fails_on_import_is_one_line_and_left_unimported(module_name: str) -> None:
    (Path.cwd() / f"{module_name}.py").write_text("raise ValueError('bad\\nsecond line')\n", encoding="utf-8")
    with pytest.raises(Refused) as info:
        import_function(f"{module_name}:fn", "trainer.loss", Refused)
    assert str(info.value) == (f"trainer.loss {module_name}:fn: cannot import {module_name}: ValueError: bad "
                               "(is it on PYTHONPATH?)")
    assert module_name not in sys.modules
