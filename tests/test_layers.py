"""The layers go one way: each package imports only those below it (docs/DESIGN.md, Layers).

    benchmarks   measure the application                      (top)
    stoker       command line, launcher, auto-scaler, devices, diagnose, watch
    consumer     the trainer's process: coordinator, queue, trainer, checkpoints
    producer     a producer's process: audio, features, batches
    shared       what both sides share: config, wire, batch schema, dataset, text (a leaf)

Every import counts, also one inside a function: a lazy import hides a cycle, it does not
remove it. Processes are started by module name (``python -m stoker.consumer.main``), which is
not an import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("shared", "producer", "consumer", "stoker", "benchmarks")


def imported_packages(path: Path, package: tuple[str, ...] | None = None) -> set[tuple[str, int]]:
    """(layer, line) of every import of the project in a file: absolute ones by name, relative ones by
    how far they climb from ``package`` (default: the file's own, under ROOT)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:  # relative: within its layer, or above it
            package = package or path.resolve().relative_to(ROOT).parent.parts  # e.g. ("shared", "dataset")
            names = ["stoker." + package[0] if node.level <= len(package) else "stoker"]
        else:
            continue
        found.update((layer_of(name), node.lineno) for name in names if name.split(".")[0] == "stoker")
    return found


def layer_of(module: str) -> str:
    """The layer of a module of the project: stoker.LAYER... for the libraries, else stoker."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "stoker"


@pytest.mark.parametrize("package", LAYERS)
def test_a_package_imports_only_the_layers_below_it(package: str) -> None:
    allowed = set(LAYERS[:LAYERS.index(package) + 1])
    upward = [f"{path.relative_to(ROOT)}:{line} imports {name}"
              for path in sorted((ROOT / package).rglob("*.py"))
              for name, line in sorted(imported_packages(path)) if name not in allowed]
    assert not upward, "imports that run back up a layer:\n" + "\n".join(upward)


def test_the_check_sees_relative_imports_that_climb_out_of_their_layer(tmp_path: Path) -> None:
    source = tmp_path / "m.py"  # as if it were shared/dataset/m.py
    source.write_text("from ..text import Units\nfrom ... import cli\n")
    assert imported_packages(source, ("shared", "dataset")) == {("shared", 1), ("stoker", 2)}


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("import os\n\ndef f():\n    from stoker.consumer.plan import EpochPlanner\n    import stoker.cli\n"
                      "    import stoker\n")
    assert imported_packages(source) == {("consumer", 4), ("stoker", 5), ("stoker", 6)}
