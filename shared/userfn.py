"""The one loader of the user's own code, named in the config as ``package.module:function``
(a model, a loss, an optimizer, a tokenizer, a mel function, transforms): each failure is one
line naming the setting.

A module is found as ``python -m`` finds it in the children (stoker/devices.py, child_env): on
``sys.path`` (``PYTHONPATH``'s entries are on it, and installed packages), else in the current
directory. The current directory is searched by importlib's own path finder, given that one
directory, and the module is executed from the spec it finds: ``sys.path`` is never changed,
not even for the time of the import, since it is shared by every thread of the process (the
feed's, the user's), and an entry added and then removed could be seen by any of them or be
removed after the user's own module changed the path. A module found in the current directory
this way imports its own siblings only where they are importable anyway (the children have that
directory on their path; the launching process may not).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType
from typing import Any, Callable

from .errors import UserError

# Held while a module found in the current directory is executed, so that two threads loading
# it at once make one module.
_LOADING = threading.Lock()


def parse_spec(spec: str, setting: str, error: type[UserError]) -> tuple[str, str]:
    """(module, function) of ``package.module:function``; ``error`` (one line) for another form."""
    module_name, colon, name = spec.partition(":")
    if not colon or not module_name or not name or ":" in name:
        raise error(f"{setting} {spec}: expected package.module:function")
    return module_name, name


def find_module(name: str) -> ModuleSpec | None:
    """Where module ``name`` is (None: nowhere), looked for as :func:`import_module` would,
    without running it; its parent packages, though, are imported, as importlib's find_spec does."""
    top, _, rest = name.partition(".")
    if top not in sys.modules and _path_spec(top) is None:
        found = _cwd_spec(top)
        if found is None or not rest:
            return found
        import_module(top)
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:  # a parent package is missing
        return None


def import_module(name: str) -> ModuleType:
    """The module ``name`` imported (once: a module imported before is returned as it is); what
    importing it raised otherwise (ModuleNotFoundError when it is nowhere)."""
    top = name.partition(".")[0]
    if top not in sys.modules and _path_spec(top) is None:
        found = _cwd_spec(top)
        if found is not None:
            _execute(found)
    return importlib.import_module(name)


def reload(module: ModuleType) -> ModuleType:
    """``module`` executed again from its source as it is now (importlib.reload, which finds a
    top-level module on ``sys.path`` only; one of the current directory is found there)."""
    name = module.__name__
    if "." in name or _path_spec(name) is not None:
        return importlib.reload(module)
    found = _cwd_spec(name)
    if found is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    _execute(found, module)
    return module


def import_function(spec: str, setting: str, error: type[UserError]) -> tuple[Callable[..., Any], ModuleType]:
    """(function, its module) of ``spec`` = ``package.module:function``; ``error`` (one line
    naming ``setting``) when the spec has another form, the module does not import, or it
    lacks the function."""
    module_name, name = parse_spec(spec, setting, error)
    try:
        module = import_module(module_name)
    except Exception as exc:  # the user's module: what it raised on import, in one line
        raise error(f"{setting} {spec}: cannot import {module_name}: {type(exc).__name__}: {first_line(exc)} "
                    f"(is it on PYTHONPATH?)") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise error(f"{setting} {spec}: {module_name} has no function {name}")
    return fn, module


def first_line(exc: BaseException) -> str:
    """The first non-blank line of what ``exc`` says: an error line stays one line."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")


def _path_spec(top: str) -> ModuleSpec | None:
    """The spec of top-level module ``top`` as an import would find it now (the meta path's
    finders: built-ins, ``sys.path``, installed packages' finders), searched afresh."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        found = find(top, None) if find is not None else None
        if found is not None:
            return found
    return None


def _cwd_spec(top: str) -> ModuleSpec | None:
    """The spec of top-level module ``top`` in the current directory (None: not there)."""
    return PathFinder.find_spec(top, [os.getcwd()])


def _execute(spec: ModuleSpec, module: ModuleType | None = None) -> None:
    """Run the module of ``spec`` (a new one, or ``module`` again) as ``sys.modules[spec.name]``;
    a new module that fails is not left there, as an import leaves none."""
    with _LOADING:
        fresh = module is None
        if fresh and spec.name in sys.modules:
            return  # another thread loaded it meanwhile
        module = importlib.util.module_from_spec(spec) if module is None else module
        module.__spec__ = spec
        sys.modules[spec.name] = module
        try:
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader.exec_module(module)
        except BaseException:
            if fresh:
                sys.modules.pop(spec.name, None)
            raise


__all__ = ["find_module", "first_line", "import_function", "import_module", "parse_spec", "reload"]
