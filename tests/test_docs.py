"""The README's layout table names every module of the package, so a reader finds each file's
job there (a module added without a word in the table fails here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Folder -> the table's row that describes its modules (shared/dataset/ is described in shared/'s row).
ROWS = {"stoker": "stoker/", "shared": "shared/", "shared/dataset": "shared/", "producer": "producer/",
        "consumer/index": "consumer/index/",
        "consumer/pipeline": "consumer/pipeline/", "consumer/training": "consumer/training/"}


def layout_rows() -> dict[str, str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+)` \| (.*) \|$", readme, re.M)}


@pytest.mark.parametrize("folder", sorted(ROWS))
def test_the_layout_table_names_every_module(folder: str) -> None:
    row = layout_rows()[ROWS[folder]]
    missing = [path.name for path in sorted((ROOT / folder).glob("*.py"))
               if path.name != "__init__.py" and f"`{path.name}`" not in row]
    assert not missing, f"README.md's layout row for {ROWS[folder]} does not name: {', '.join(missing)}"


def test_the_check_reads_the_table() -> None:
    assert "`service.py`" in layout_rows()["stoker/"] and "`wire.py`" in layout_rows()["shared/"]
