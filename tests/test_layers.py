"""The layers go one way: each package imports only those below it (docs/DESIGN.md, Layers).

    benchmarks   measure the application                      (top)
    stoker       command line, launcher, auto-scaler, devices, diagnose, watch
    consumer     the trainer's side, its processes' parts side by side on what both use:
                   training     stoker's trainers, the model, the consumer process's training loop (on feed)
                   feed         the trainer process's side: the feed core, hand-out, staging, checkpoints
                   coordinator  the coordinator process: its ROUTER loop, the scheduler, leases, peers
                   (consumer/)  what both use: the protocol between them, the queue, the plan, the slots
                   index        the index build (the trainer's alone), below all of them
    producer     a producer's process: audio, features, batches
    shared       what both sides use: config, wire, batch schema, the dataset as read, text (a leaf:
                 it never imports consumer/, the trainer's index build included)

Every import counts, also one inside a function: a lazy import hides a cycle, it does not
remove it. Processes are started by module name (``python -m stoker.consumer.training.main``), which is
not an import.

Below the layers, module by module: no module imports itself back through others; an import
inside a function is for a heavy dependency or says why on its line; and every module has one
name, stoker's (``import shared`` is refused, ``stoker.run`` does not exist).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import stoker
from stoker.shared.proc import with_stoker_path

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
        elif isinstance(node, ast.ImportFrom) and node.level > 0:  # relative: resolved from the file's package
            package = package or path.resolve().relative_to(ROOT).parent.parts  # e.g. ("shared", "dataset")
            names = [resolve_relative(("stoker", *package), node.level, node.module)]
        else:
            continue
        found.update((layer_of(name), node.lineno) for name in names if name.split(".")[0] == "stoker")
    return found


def resolve_relative(package: tuple[str, ...], level: int, module: str | None) -> str:
    """The absolute name of ``from {'.' * level}{module} import ...`` in ``package``: shared/, producer/,
    consumer/ and benchmarks/ are stoker's subpackages, so ``..`` climbs from a layer to stoker."""
    base = package[:len(package) - (level - 1)] if level - 1 < len(package) else ("stoker",)
    return ".".join((*base, *([module] if module else [])))


def layer_of(module: str) -> str:
    """The layer of a module of the project: stoker.LAYER... for the libraries, else stoker."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "stoker"


def runs_up(package: str, found: set[tuple[str, int]]) -> list[tuple[str, int]]:
    """The (layer, line) of ``found`` (a file's imports) that a module of ``package`` may not import."""
    allowed = set(LAYERS[:LAYERS.index(package) + 1])
    return [(name, line) for name, line in sorted(found) if name not in allowed]


@pytest.mark.parametrize("package", LAYERS)
def test_a_package_imports_only_the_layers_below_it(package: str) -> None:
    upward = [f"{path.relative_to(ROOT)}:{line} imports {name}"
              for path in sorted((ROOT / package).rglob("*.py"))
              for name, line in runs_up(package, imported_packages(path))]
    assert not upward, "imports that run back up a layer:\n" + "\n".join(upward)


# consumer/'s parts, each with the parts it may import besides itself. The index build (index/) is the lowest:
# it imports no part. consumer/'s own modules ("") are what both processes use, the protocol between them among
# them. The coordinator process's modules and the trainer process's (feed/) meet only there; training runs on
# the feed.
CONSUMER_PARTS = {"index": (), "": ("index",), "coordinator": ("", "index"), "feed": ("", "index"),
                  "training": ("", "feed", "index")}


def consumer_part(module: str) -> str | None:
    """The part of consumer/ a module is in: its subpackage, "" for consumer/'s own modules, None outside."""
    parts = module.split(".")
    if parts[:2] != ["stoker", "consumer"]:
        return None
    return parts[2] if len(parts) > 2 and parts[2] in CONSUMER_PARTS else ""


def consumer_crossings(imports: list[tuple[str, str, str]]) -> list[str]:
    """Of (module, module it imports, where), the imports from one part of consumer/ into another it may not use."""
    return [f"{where} imports {target}" for name, target, where in imports
            if consumer_part(name) is not None and consumer_part(target) is not None
            and consumer_part(target) not in (consumer_part(name), *CONSUMER_PARTS[consumer_part(name)])]


def test_a_part_of_the_consumer_imports_only_the_parts_it_stands_on() -> None:
    """The coordinator process's modules and the trainer process's import each other only through
    consumer/protocol.py (and what both use); training may use the feed; the feed feeds any training loop."""
    modules = project_modules()
    imports = [(name, target, f"{path.relative_to(ROOT)}:{node.lineno}")
               for name, path in modules.items() for target, node, _ in module_imports(name, path, set(modules))]
    crossings = consumer_crossings(imports)
    assert not crossings, "imports across the parts of the consumer:\n" + "\n".join(crossings)
    assert {consumer_part(name) for name in modules if name.startswith("stoker.consumer.")} == set(CONSUMER_PARTS)


def test_the_part_check_sees_one_process_import_the_other() -> None:
    assert consumer_crossings([
        ("stoker.consumer.feed.handoff", "stoker.consumer.coordinator.coordproc", "a:1"),
        ("stoker.consumer.coordinator.scheduler", "stoker.consumer.feed.validation", "b:2"),
        ("stoker.consumer.plan", "stoker.consumer.feed", "c:3"),
        ("stoker.consumer.training.main", "stoker.consumer.coordinator.coordinator", "d:4"),
        ("stoker.consumer.feed.handoff", "stoker.consumer.protocol", "e:5"),
        ("stoker.consumer.coordinator.coordproc", "stoker.consumer.protocol", "f:6"),
        ("stoker.consumer.training.main", "stoker.consumer.feed.feed", "g:7"),
        ("stoker.feed", "stoker.consumer.coordinator.coordproc", "h:8"),
    ]) == ["a:1 imports stoker.consumer.coordinator.coordproc", "b:2 imports stoker.consumer.feed.validation",
           "c:3 imports stoker.consumer.feed", "d:4 imports stoker.consumer.coordinator.coordinator"]


def test_the_check_sees_relative_imports_that_climb_out_of_their_layer(tmp_path: Path) -> None:
    source = tmp_path / "m.py"  # as if it were shared/dataset/m.py
    source.write_text("from ..text import Units\nfrom ... import cli\nfrom ...producer import audio\n")
    assert imported_packages(source, ("shared", "dataset")) == {("shared", 1), ("stoker", 2), ("producer", 3)}


LIBRARY_LAYERS = ("shared", "producer", "consumer", "benchmarks")  # folders of their own, stoker's subpackages


@pytest.mark.parametrize("package", LIBRARY_LAYERS + ("stoker",))
def test_imports_within_the_package_are_relative(package: str) -> None:
    """``from ..shared.config import X`` in producer/, not ``from stoker.shared.config``: the dots climb
    the folders a reader sees (producer/.. holds shared/), as the wheel's stoker/ holds them, so an editor
    or a structure tool follows the import from the file tree. Only benchmarks/, above stoker/, name it."""
    named = [f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}"
             for path in sorted((ROOT / package).rglob("*.py")) if not path.is_symlink()
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
             and node.module.split(".")[0] == "stoker"
             and (package != "benchmarks" or layer_of(node.module) in LIBRARY_LAYERS)]
    assert not named, "imports of the package by its name, not relative:\n" + "\n".join(named)


def test_the_check_refuses_shared_importing_the_consumer(tmp_path: Path) -> None:
    """shared/ is what producers and trainers both use: a format reaching into the trainer's index build
    (as the formats' pieces once did) is an import that runs back up, however many dots it climbs."""
    source = tmp_path / "m.py"  # as if it were shared/dataset/corpus/m.py
    source.write_text("from ..layouts import Entry\nfrom ....consumer.index.pieces import Pieces\n"
                      "def f():\n    from stoker.consumer.index import index\n")
    assert runs_up("shared", imported_packages(source, ("shared", "dataset", "corpus"))) == [("consumer", 2),
                                                                                             ("consumer", 4)]


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("import os\n\ndef f():\n    from stoker.consumer.plan import EpochPlanner\n"
                      "    import stoker.cli\n    import stoker\n")
    assert imported_packages(source) == {("consumer", 4), ("stoker", 5), ("stoker", 6)}


# ---------------------------------------------------------------- the modules' import graph

# Imported inside a function without a word of reason: each costs a process that never uses it
# a tenth of a second or more (TensorFlow seconds).
HEAVY = ("tensorflow", "keras", "librosa", "scipy", "phonemizer", "pyloudnorm", "torch", "jax", "pyarrow")


def project_modules() -> dict[str, Path]:
    """Every module of the package by its one name: stoker/X.py is stoker.X, LAYER/X.py is
    stoker.LAYER.X (pyproject.toml's package-dir; stoker/LAYER is a link to LAYER/)."""
    found = {}
    for path in sorted((ROOT / "stoker").glob("*.py")):
        found["stoker" if path.stem == "__init__" else f"stoker.{path.stem}"] = path
    for layer in LAYERS[:3] + LAYERS[4:]:
        for path in sorted((ROOT / layer).rglob("*.py")):
            parts = ("stoker", *path.relative_to(ROOT).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def module_imports(name: str, path: Path, known: set[str]) -> list[tuple[str, ast.stmt, bool]]:
    """(module imported, statement, inside a function) for each import in ``path`` (module ``name``),
    with ``from P import m`` as module P.m where that is a module, and relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, ast.stmt, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                continue  # for type checkers only: never imported when the program runs
            if isinstance(child, ast.Import):
                found.extend((alias.name, child, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join([*package.split(".")[:len(package.split(".")) - child.level + 1],
                                     *([base] if base else [])])
                for alias in child.names:
                    target = f"{base}.{alias.name}"
                    found.append((target if target in known else base, child, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports, and the packages those are in (their __init__ runs first),
    except the packages the module is itself in and stoker's own, whose import runs nothing."""
    modules = project_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        for target, _, _ in module_imports(name, path, set(modules)):
            parts = target.split(".")
            for package in (".".join(parts[:n]) for n in range(2, len(parts) + 1)):
                if package in modules and package != name and not name.startswith(package + "."):
                    edges.add(package)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_no_module_imports_itself_through_others() -> None:
    """Counting the imports inside functions too: a lazy import hides a cycle, it does not remove it."""
    graph = import_graph()
    assert "stoker.cli" in graph and "stoker.shared.config" in graph["stoker.service"]
    assert not cycles(graph), "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles(graph))


def test_only_the_entry_point_imports_the_command_line() -> None:
    """The command line parses and dispatches; what it runs is the run service's (stoker/service.py),
    which stoker.Feed and Slurm's tasks call too."""
    graph = import_graph()
    assert sorted(name for name, edges in graph.items() if "stoker.cli" in edges) == ["stoker.__main__"]
    assert {"stoker.service"} <= graph["stoker.cli"] & graph["stoker.feed_run"] & graph["stoker.slurm"]


def test_the_cycle_check_finds_a_cycle_through_a_lazy_import() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_an_import_inside_a_function_says_why() -> None:
    """At the top of the file unless it is a heavy dependency or its line says why (# ...)."""
    modules = project_modules()
    unexplained: dict[str, None] = {}  # one line a statement, in order
    for name, path in modules.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        for target, node, in_function in module_imports(name, path, set(modules)):
            said = any("#" in line for line in lines[node.lineno - 1:node.end_lineno])
            if in_function and not said and target.split(".")[0] not in HEAVY:
                unexplained[f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}"] = None
    assert not unexplained, "imports inside functions with no reason beside them:\n" + "\n".join(unexplained)


def test_each_module_has_one_name() -> None:
    """The layers' folders are stoker's subpackages only; nothing else of the checkout is."""
    for bare in ("shared", "producer", "consumer", "benchmarks"):
        with pytest.raises(ImportError, match=f"import stoker.{bare}, not {bare}"):
            importlib.import_module(bare)
    for stray in ("stoker.run", "stoker.tests", "stoker.docs", "stoker.data"):
        assert importlib.util.find_spec(stray) is None, stray
    assert importlib.import_module("stoker.shared.config").__name__ == "stoker.shared.config"


@pytest.mark.timeout(60)
def test_a_child_process_sees_the_same_names(tmp_path: Path) -> None:
    """What the launcher's children import, from the user's directory: this stoker, by one name (a
    bare ``shared`` is the checkout's refusing, where the checkout is on the child's path, or none)."""
    probe = ("import importlib, importlib.util as u, stoker, stoker.shared.config as c\n"
             "print(stoker.__file__)\n"
             "print(c.__name__, [m for m in ('stoker.run', 'stoker.tests') if u.find_spec(m)])\n"
             "try:\n    importlib.import_module('shared')\nexcept ImportError as exc:\n    print(exc)\n")
    env = with_stoker_path({k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[:2] == [str(Path(stoker.__file__).resolve()), "stoker.shared.config []"]
    assert lines[2:] in (["import stoker.shared, not shared (docs/DESIGN.md, Layout)"], ["No module named 'shared'"])
