"""A Parquet dataset's rows as manifest entries: which column is a clip's id, text, speaker,
language and duration, and the locator of a row's audio.

A Parquet corpus (as the Hugging Face ``datasets`` library writes it: ParsVoice, ManaTTS, Common
Voice) holds one clip per row. Its listing (shared/dataset/parquet.py) makes a JSON line per row:
``{"audio_filepath": AUDIO, "row": ID, "columns": {NAME: VALUE, ...}}``, with every column but the
audio (AUDIO: the row's locator, :data:`ROW_LOCATOR`, or the path its path column names; ID: the
file's stem and the row's number in the file, ``train-00000-of-00004_17``). :func:`parquet_entries`
reads those lines with ``data.columns``: each field of a manifest (shared/layouts.py) from the
column ``data.columns`` names for it, ``ROLE=COLUMN`` pairs separated by ``|`` (e.g.
``"text=sentence|speaker=client_id"``), else from the first column of its usual names
(:data:`ROLES`); a row without an ``id`` column is its ID. The rows are then checked as a
manifest's lines are, and a rejection names the row and its file instead of a manifest line.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from .layouts import Entry, LayoutError, Rejection, parse_manifest, shown

# The manifest field each role fills, and the column names it is found by, in order.
ROLES: dict[str, tuple[str, ...]] = {
    "id": ("id",),
    "text": ("text", "sentence", "transcription"),
    "normalized_text": ("normalized_text",),  # preferred to the text where a row has both (as in a manifest)
    "speaker": ("speaker", "speaker_id", "client_id"),
    "language": ("language", "lang", "locale"),
    "duration": ("duration", "duration_s"),
}


# A row's locator: ``FILE.parquet#GROUP:ROW`` (the file relative to the dataset root, or a URL;
# the row group; the row within it), e.g. ``data/train-00000-of-00004.parquet#3:17``.
ROW_LOCATOR = re.compile(r"^(?P<file>.+\.parquet)#(?P<group>\d+):(?P<row>\d+)$", re.IGNORECASE)


# The part of a row's locator that names its file and row group (consumer/pipeline/shard_order.py).
GROUP_END = ":"


_MANIFEST_LINE = re.compile(r"manifest line (\d+)")


def is_row(name: str) -> bool:
    """Whether an audio name (Sample.audio) is a Parquet row's locator."""
    return "#" in name and ROW_LOCATOR.match(name) is not None


def row_where(name: str) -> str:
    """A row's locator as reasons name it: ``row R of row group G of FILE``."""
    match = ROW_LOCATOR.match(name)
    if match is None:
        return name
    return f"row {match['row']} of row group {match['group']} of {shown(match['file'])}"


def is_column_map(spec: str) -> bool:
    """Whether ``data.columns`` is a Parquet dataset's ``ROLE=COLUMN`` pairs (not an LJSpeech layout's names)."""
    return "=" in spec


def parse_column_map(spec: str) -> dict[str, str]:
    """The roles' columns of a ``data.columns`` of ``ROLE=COLUMN`` pairs; LayoutError (one line) when it cannot work."""
    known = f"roles: {', '.join(ROLES)}"
    mapping: dict[str, str] = {}
    for pair in spec.split("|"):
        role, equals, column = (part.strip() for part in pair.partition("="))
        if not equals or not role or not column:
            raise LayoutError(f"data.columns {spec!r}: {pair.strip()!r} is not ROLE=COLUMN ({known})")
        if role not in ROLES:
            raise LayoutError(f"data.columns {spec!r}: unknown role {role!r} ({known})")
        if role in mapping:
            raise LayoutError(f"data.columns {spec!r}: {role!r} is named twice ({known})")
        mapping[role] = column
    return mapping


def manifest_object(line: dict[str, Any], mapping: dict[str, str]) -> dict[str, Any]:
    """The manifest object of one listing line (module docstring): each role's value from its
    column, the row's own id where the rows have no id column."""
    columns = line["columns"]
    out: dict[str, Any] = {"audio_filepath": line["audio_filepath"]}
    for role, names in ROLES.items():
        name = mapping.get(role) or next((n for n in names if n in columns), None)
        value = columns.get(name) if name is not None else None
        if value is not None:
            out[role] = str(value) if role == "id" and type(value) is int else value
    out.setdefault("id", line["row"])
    return out


def parquet_entries(raw: bytes, columns: str = "") -> tuple[list[Entry], list[Rejection]]:
    """The entries of a Parquet listing's lines (module docstring), checked as a manifest's;
    a faulty row a rejection naming the row and its file."""
    mapping = parse_column_map(columns) if is_column_map(columns) else {}
    lines = [orjson.loads(line) for line in raw.splitlines() if line.strip()]
    manifest = b"".join(orjson.dumps(manifest_object(line, mapping)) + b"\n" for line in lines)
    entries, rejected = parse_manifest(manifest)
    return entries, [_of_row(r, lines) for r in rejected]


def _of_row(rejection: Rejection, lines: list[dict[str, Any]]) -> Rejection:
    """A manifest line's rejection as its row's: the row and file named instead of the line."""
    if rejection.line is None or not 0 < rejection.line <= len(lines):
        return rejection
    return row_rejection(rejection, lines[rejection.line - 1]["audio_filepath"])


def row_rejection(rejection: Rejection, audio: str) -> Rejection:
    """A manifest line's rejection as the rejection of the row whose audio is ``audio`` (its
    locator, or a path column's file): the row and file named instead of the line."""
    where = row_where(audio) if is_row(audio) else f"the row of {audio}"
    return Rejection(rejection.id, _MANIFEST_LINE.sub(where, rejection.reason, count=1), rejection.producer,
                     None, audio, rejection.kind)
