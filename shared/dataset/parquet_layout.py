"""A Parquet dataset's rows as manifest entries: which column is a clip's id, text, speaker,
language and duration, and the locator of a row's audio.

A Parquet corpus (as the Hugging Face ``datasets`` library writes it: ParsVoice, ManaTTS, Common
Voice) holds one clip per row. Its listing (shared/dataset/parquet.py) makes a JSON line per row:
``{"audio_filepath": AUDIO, "row": ID, "columns": {NAME: VALUE, ...}}``, with every column but the
audio (AUDIO: the row's locator, :data:`ROW_LOCATOR`, or the path its path column names; ID: the
file's stem and the row's number in the file, ``train-00000-of-00004_17``). :func:`parquet_entries`
reads those lines with ``data.columns``: each field of a manifest (shared/dataset/layouts.py) from the
column ``data.columns`` names for it, ``ROLE=COLUMN`` pairs separated by ``|`` (e.g.
``"text=sentence|speaker=client_id"``), else from the first column of its usual names
(:data:`ROLES`); a row without an ``id`` column is its ID. The rows are then checked as a
manifest's lines are, and a rejection names the row and its file instead of a manifest line.
A large dataset's pieces (consumer/index/parquet_pieces.py) make the same entries from the
columns, without the lines (:func:`role_columns`, :func:`checked_columns`).
"""

from __future__ import annotations

import math
import re
from typing import Any

import orjson

from .layouts import (_CONTROL, Entry, LayoutError, ManifestColumns, Rejection, _speaker_problem, language_problem,
                      nfc, parse_manifest, shown)

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


# The part of a row's locator that names its file and row group (consumer/shard_order.py).
GROUP_END = ":"


_MANIFEST_LINE = re.compile(r"manifest line (\d+)")


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


def role_columns(values: dict[str, list[Any]], mapping: dict[str, str]) -> dict[str, list[Any]]:
    """Each role's values over a piece of rows (:func:`manifest_object` a column at a time, from
    ``values``: each column's values, None for null): from the column ``mapping`` names, else the
    first non-null of its usual names; an id column's integers as strings. A role no column
    fills is left out."""
    roles: dict[str, list[Any]] = {}
    for role, names in ROLES.items():
        if role in mapping:
            column = values.get(mapping[role])
        else:
            candidates = [values[n] for n in names if n in values]
            column = (candidates[0] if len(candidates) == 1 else
                      [next((v for v in row if v is not None), None) for row in zip(*candidates)] if candidates
                      else None)
        if column is not None:
            roles[role] = [str(v) if type(v) is int else v for v in column] if role == "id" else column
    return roles


def checked_columns(roles: dict[str, list[Any]], audio: list[str], row_ids: list[str],
                    first_line: int) -> ManifestColumns | None:
    """The manifest columns of a piece of rows (``roles``: :func:`role_columns`; ``audio``: their
    locators; ``row_ids``: their own ids; the first of them line ``first_line``) where every row
    passes every check a manifest line gets, without a repeated id: the columns
    :func:`shared.dataset.layouts.manifest_columns` makes of the rows' manifest lines, without the lines
    (layouts._checked_columns' checks and values, made on the columns). None where a row fails
    one, or a value is of a kind a JSON line would not keep as it is (a NaN): then the lines are
    made and parsed, which word each fault."""
    size = len(audio)
    given = roles.get("id")
    ids = row_ids if given is None else given if None not in given else \
        [row if v is None else v for v, row in zip(given, row_ids)]
    if not size or _kinds(ids) != {str} or _kinds(audio) != {str}:
        return None
    audio = list(map(str.strip, audio))
    ids = list(map(str.strip, ids))
    if not "".join(ids).isascii():
        ids = list(map(nfc, ids))
    joined = "\n" + "\n".join(ids)
    if (not all(audio) or not all(ids) or _has_control("".join(audio)) or _has_control("".join(ids))
            or "\n." in joined or "/" in joined or "\\" in joined or len(set(ids)) != size):
        return None
    spoken = _spoken(roles, size)
    speakers = _names(roles.get("speaker"), size, {str, int})
    languages = _names(roles.get("language"), size, {str})
    durations = roles.get("duration")
    if spoken is None or speakers is None or languages is None or durations is None:
        return None
    if (any(s and _speaker_problem(s) for s in set(speakers))
            or any(s and language_problem(s) for s in set(languages))):
        return None
    kinds = _kinds(durations)
    if not kinds or not kinds <= {float, int}:
        return None
    durations = durations if kinds == {float} else list(map(float, durations))
    if not all(map(math.isfinite, durations)):
        return None
    return ManifestColumns(ids, spoken, list(range(first_line, first_line + size)), speakers, languages, audio,
                           durations)


def _spoken(roles: dict[str, list[Any]], size: int) -> list[str] | None:
    """Each row's text (its normalized text where it has one), stripped; None where a row has no
    text or a text that is not a string."""
    text = roles.get("text")
    normalized = roles.get("normalized_text", [None] * size)
    kinds = _kinds(normalized)
    if text is None or _kinds(text) != {str} or not kinds <= {str, type(None)}:
        return None
    if kinds == {type(None)}:
        return list(map(str.strip, text))
    return [(n.strip() if n else "") or t.strip() for t, n in zip(text, normalized)]


def _names(column: list[Any] | None, size: int, allowed: set[type]) -> list[str] | None:
    """A speaker or language column's names, stripped ("" for none); None where a value is of
    none of the ``allowed`` kinds (a JSON line's would be rejected)."""
    if column is None:
        return [""] * size
    kinds = _kinds(column)
    if not kinds <= allowed | {type(None)}:
        return None
    if kinds != {str}:
        column = ["" if v is None else str(v) for v in column]
    return list(map(str.strip, column))


def _has_control(text: str) -> bool:
    """Whether ``text`` has a control character (layouts' _CONTROL): of ASCII, whether it is not
    printable (one pass in C, where the pattern's search is several times slower)."""
    return not (text.isascii() and text.isprintable()) and _CONTROL.search(text) is not None


def _kinds(values: list[Any]) -> set[type]:
    return set(map(type, values))


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
    where = row_where(audio) if ROW_LOCATOR.match(audio) else f"the row of {audio}"
    return Rejection(rejection.id, _MANIFEST_LINE.sub(where, rejection.reason, count=1), rejection.producer,
                     None, audio, rejection.kind)
