"""The docs a reader follows: the README's layout table names every module of the package, so a
reader finds each file's job there (a module added without a word in the table fails here); every
section of docs/DESIGN.md or docs/design/ that a file names exists; the docs name no issue number."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Folder -> the table's row that describes its modules (shared/dataset/ is described in shared/'s row).
ROWS = {"stoker": "stoker/", "shared": "shared/", "shared/dataset": "shared/", "producer": "producer/",
        "consumer": "consumer/", "consumer/feed": "consumer/feed/", "consumer/coordinator": "consumer/coordinator/",
        "consumer/index": "consumer/index/", "consumer/training": "consumer/training/"}


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


# The design is docs/DESIGN.md (the map) and a page per part in docs/design/. A reference names the
# file, then its sections quoted (`docs/design/index.md, "Index cache"`), or one unquoted
# (`docs/DESIGN.md, Layout)`); a design page names its neighbours by file name alone.
DESIGN = ROOT / "docs" / "DESIGN.md"
PAGES = ROOT / "docs" / "design"
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".toml", ".sh", ".sbatch", ".txt"}
SKIPPED = {".git", "__pycache__", "node_modules", ".whl"}
REFERENCE = re.compile(r'(?<![\w/.-])(?P<file>(?:docs/)?(?:DESIGN\.md|design/[a-z_]+\.md)|[a-z_]+\.md)`?'
                       r'(?P<quoted>(?:,?\s*(?:#\s*)?"[^"]+")*)(?:,\s+(?P<plain>[A-Z][^\n"().;:,]*)(?=[).;:,]))?')
HEADING = re.compile(r"^#+ (?:\d+(?:\.\d+)*\.? )?(.+?)\s*$|^(?:- )?\*\*(.+?)\*\*", re.M)


def design_file(name: str, referrer: Path) -> Path | None:
    """The design file a reference's name stands for (None: not a design file)."""
    if name.endswith("DESIGN.md"):
        return DESIGN
    if name.startswith(("docs/design/", "design/")):
        return PAGES / Path(name).name
    return PAGES / name if referrer.parent == PAGES and (PAGES / name).exists() else None


def sections(path: Path) -> set[str]:
    """Every heading of a design file, and every paragraph's bold lead-in, as a reference names it."""
    names = set()
    for match in HEADING.finditer(path.read_text(encoding="utf-8")):
        title = (match.group(1) or match.group(2)).rstrip(".").rstrip(":")
        names |= {title, re.sub(r" \(.*\)$", "", title), title.split(": ")[0] + ":" * (": " in title)}
    return names


def named(text: str, title: str) -> bool:
    return any(name == title or name.startswith(title + ":") for name in text)


def broken_references(path: Path, text: str) -> list[str]:
    """The references of ``text`` (the file ``path``) to a design file or section that does not exist."""
    broken = []
    for match in REFERENCE.finditer(text):
        target = design_file(match.group("file"), path)
        if target is None:
            continue
        if not target.exists():
            broken.append(match.group("file"))
            continue
        titles = [" ".join(t.replace("#", " ").split()) for t in re.findall(r'"([^"]+)"', match.group("quoted"))]
        titles += [match.group("plain").strip()] if match.group("plain") else []
        have = sections(target)
        broken += [f'{match.group("file")}, "{title}"' for title in titles if not named(have, title)]
    return broken


def text_files() -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(ROOT):  # not into the links stoker/shared, ...: os.walk follows none
        dirs[:] = [d for d in dirs if d not in SKIPPED and not d.startswith(".")]
        found += [Path(folder) / f for f in files if Path(f).suffix in TEXT_SUFFIXES]
    return sorted(path for path in found if path != Path(__file__).resolve())  # this file's are examples


def test_every_design_section_a_file_names_exists() -> None:
    broken = {str(path.relative_to(ROOT)): refs for path in text_files()
              if (refs := broken_references(path, path.read_text(encoding="utf-8", errors="replace")))}
    assert not broken, f"references to design sections that do not exist: {broken}"


def test_the_reference_check_sees_a_missing_section_a_missing_page_and_a_wrapped_title() -> None:
    here = ROOT / "stoker" / "x.py"
    assert broken_references(here, 'docs/design/index.md, "Index cache"; docs/DESIGN.md, Layout).') == []
    assert broken_references(here, '(docs/design/processes.md,\n    # "The trainer\'s\n    # heap")') == []
    assert broken_references(here, 'docs/design/index.md, "No such part"') == ['docs/design/index.md, "No such part"']
    assert broken_references(here, "docs/design/nowhere.md") == ["docs/design/nowhere.md"]
    assert broken_references(here, "docs/DESIGN.md, No such part.") == ['docs/DESIGN.md, "No such part"']
    assert broken_references(PAGES / "feed.md", 'index.md, "Rejections"') == []


ISSUE_NUMBER = re.compile(r"(?i)\bissues? #?\d+|(?<![\w/])#\d+\b")


def test_the_docs_name_no_internal_issue_numbers() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = {str(path.relative_to(ROOT)): ISSUE_NUMBER.findall(path.read_text(encoding="utf-8")) for path in docs}
    assert not {path: hits for path, hits in found.items() if hits}
