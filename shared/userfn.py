"""The user's own functions, named in the config as ``package.module:function`` (a mel
function, transforms): imported once, each failure one line naming the setting."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable

from .errors import UserError


def import_function(spec: str, setting: str, error: type[UserError]) -> tuple[Callable[..., Any], ModuleType]:
    """(function, its module) of ``spec``; ``error`` (one line naming ``setting``) when the module
    does not import or lacks the function."""
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: what it raised on import, in one line
        raise error(f"{setting} {spec}: cannot import {module_name}: {type(exc).__name__}: {exc} "
                    f"(is it on PYTHONPATH?)") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise error(f"{setting} {spec}: {module_name} has no function {name}")
    return fn, module


__all__ = ["import_function"]
