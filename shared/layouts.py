"""Dataset layouts: metadata bytes in, entries and rejections out (pure functions, no I/O).

LJSpeech-style metadata (``metadata.csv``, ``metadata_train.csv``, ...)
    One clip per line, fields separated by ``|``. ``data.columns`` names the fields:
    ``id``, ``text``, ``normalized_text``, ``speaker``, ``language``, and ``_`` for a
    field to ignore, e.g. ``id|speaker|text``. The default (``""``) decides by the
    number of fields of the file's first line: 2 = ``id|text``, 3 =
    ``id|text|normalized_text`` (LJSpeech; 2- and 3-field lines may mix), 5 =
    ``id|text|normalized_text|speaker|language``; a file whose first line has speaker and
    language columns must have them on every line, and one whose first line has none
    must not have them on others. The text spoken is
    ``normalized_text`` when it is there and not empty, else ``text``. Audio is
    ``wavs/<id>.<suffix>``.
JSON-lines manifests (``*.jsonl``, ``*.json``; NeMo and Coqui style)
    One JSON object per line: ``audio_filepath`` (relative to the dataset directory, or
    absolute) and ``text`` are required; ``normalized_text`` is preferred to ``text``
    when not empty; ``speaker`` (string or integer), ``language`` (a code),
    ``duration`` (a number, checked for its type only: the audio header is the truth)
    and ``id`` are optional. Without ``id``, a clip's id is its audio file's name
    without the suffix.

A speaker or language left empty takes the dataset's default (``text.language``; the
speaker ``default``). Every line that cannot be used becomes a :class:`Rejection` naming
its line number; nothing here raises for a data fault. A ``data.columns`` that cannot
be right is a :class:`LayoutError` (a user mistake: one line).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

COLUMNS_AUTO = ""
ID, TEXT, NORMALIZED_TEXT, SPEAKER, LANGUAGE, IGNORED = "id", "text", "normalized_text", "speaker", "language", "_"
KNOWN_COLUMNS = (ID, TEXT, NORMALIZED_TEXT, SPEAKER, LANGUAGE, IGNORED)
# Auto mode: the mapping by the number of fields of the first line.
AUTO_COLUMNS = {
    2: (ID, TEXT),
    3: (ID, TEXT, NORMALIZED_TEXT),
    5: (ID, TEXT, NORMALIZED_TEXT, SPEAKER, LANGUAGE),
}
MANIFEST_SUFFIXES = (".jsonl", ".json")
# A language code: letters, digits, '-' or '_' (BCP 47 style: fa, en-us, pt_BR).
_LANGUAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{1,15}")
_BOM = b"\xef\xbb\xbf"


class LayoutError(ValueError):
    """``data.columns`` cannot describe a metadata file; the message is one line for the user."""


@dataclass(frozen=True)
class Rejection:
    """A clip (or metadata line) that is not used, and why."""

    id: str
    reason: str
    producer: str = "index"  # who rejected it: "index" (consumer) or a producer name
    line: int | None = None  # metadata line, where one applies
    file: str | None = None  # dataset-relative audio file, where one applies
    kind: str = ""  # the cause, for counting (shared/dataset.KIND_HINTS): "" for faults of one line

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "reason": self.reason, "producer": self.producer}
        if self.line is not None:
            out["line"] = self.line
        if self.file is not None:
            out["file"] = self.file
        if self.kind:
            out["kind"] = self.kind
        return out


@dataclass(frozen=True)
class Entry:
    """One clip as the metadata describes it."""

    id: str
    text: str
    line: int
    speaker: str = ""  # "" = not given (the dataset default applies)
    language: str = ""  # "" = not given (text.language applies)
    audio: str = ""  # audio path as a manifest wrote it; "" = wavs/<id>.<suffix>


def is_manifest(file_name: str) -> bool:
    return file_name.lower().endswith(MANIFEST_SUFFIXES)


def parse_columns(spec: str) -> tuple[str, ...]:
    """The column names of a ``data.columns`` spec; LayoutError when it cannot work."""
    names = tuple(part.strip() for part in spec.split("|"))
    unknown = [n for n in names if n not in KNOWN_COLUMNS]
    if unknown:
        raise LayoutError(f"data.columns {spec!r}: unknown column {unknown[0]!r} (known: {', '.join(KNOWN_COLUMNS)})")
    twice = [n for n in set(names) if n != IGNORED and names.count(n) > 1]
    if twice:
        raise LayoutError(f"data.columns {spec!r}: {twice[0]!r} is named twice")
    if ID not in names or (TEXT not in names and NORMALIZED_TEXT not in names):
        raise LayoutError(f"data.columns {spec!r} must name id and text (or normalized_text)")
    return names


def _utf8_problem(raw: bytes) -> str:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"byte 0x{raw[exc.start]:02x} at column {exc.start + 1}"
    return ""


def _id_problem(sample_id: str) -> str:
    if not sample_id:
        return "empty id"
    if "/" in sample_id or "\\" in sample_id or sample_id.startswith("."):
        return f"id {sample_id!r} is not a plain file name"
    return ""


def _language_problem(code: str) -> str:
    if code and not _LANGUAGE.fullmatch(code):
        return f"language {code!r} is not a language code"
    return ""


def parse_metadata(raw: bytes, columns: str = COLUMNS_AUTO) -> tuple[list[Entry], list[Rejection]]:
    """Parse LJSpeech-style metadata; malformed lines become rejections, never exceptions."""
    names = parse_columns(columns) if columns else None
    if raw.startswith(_BOM):  # a UTF-8 byte order mark (Windows editors) is not part of the id
        raw = raw[len(_BOM):]
    entries: list[Entry] = []
    rejected: list[Rejection] = []
    first_line: dict[str, int] = {}
    auto_speaker: bool | None = None  # auto mode: whether the first line has speaker and language columns
    for number, line_bytes in enumerate(raw.splitlines(), start=1):
        if not line_bytes.strip():
            continue
        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError:
            head = line_bytes.split(b"|", 1)[0].strip()
            try:
                sample_id = head.decode("utf-8") if head else ""
            except UnicodeDecodeError:
                sample_id = ""
            rejected.append(Rejection(sample_id or f"line:{number}",
                                      f"metadata line {number} is not valid UTF-8 ({_utf8_problem(line_bytes)})",
                                      line=number))
            continue
        parts = line.split("|")
        sample_id = parts[0].strip()
        problem = ""
        line_names = names
        if not columns:
            line_names = AUTO_COLUMNS.get(len(parts))
            with_speaker = len(parts) == len(AUTO_COLUMNS[5])
            if line_names is None:
                problem = f"{len(parts)} field{'s' if len(parts) != 1 else ''}, expected id|text|normalized_text or id|text"
                if len(parts) > 3:
                    problem += " (or id|text|normalized_text|speaker|language; set data.columns for other forms)"
            elif auto_speaker is None:
                auto_speaker = with_speaker
            elif with_speaker != auto_speaker:
                problem = (f"{len(parts)} fields, but the first line {'has' if auto_speaker else 'has no'} speaker and "
                           "language columns (id|text|normalized_text|speaker|language): every line must "
                           f"{'have' if auto_speaker else 'lack'} them")
        elif len(parts) != len(names):
            expected = "|".join(names)
            problem = (f"{len(parts)} field{'s' if len(parts) != 1 else ''}, data.columns expects {len(names)} "
                       f"({expected})")
        speaker = language = text = ""
        if not problem and line_names is not None:
            at = _positions(line_names)
            sample_id = parts[at[0]].strip()
            text = (parts[at[2]].strip() if at[2] >= 0 else "") or (parts[at[1]].strip() if at[1] >= 0 else "")
            speaker = parts[at[3]].strip() if at[3] >= 0 else ""
            language = parts[at[4]].strip() if at[4] >= 0 else ""
            problem = _id_problem(sample_id) or (_language_problem(language) if language else "")
        if problem:
            rejected.append(Rejection(sample_id or f"line:{number}", f"malformed metadata line {number}: {problem}",
                                      line=number))
            continue
        if sample_id in first_line:
            rejected.append(Rejection(sample_id, f"duplicate id on metadata line {number} "
                                                 f"(first on line {first_line[sample_id]})", line=number))
            continue
        first_line[sample_id] = number
        entries.append(Entry(sample_id, text, number, speaker, language))
    return entries, rejected


@functools.lru_cache(maxsize=None)
def _positions(names: tuple[str, ...]) -> tuple[int, int, int, int, int]:
    """Field positions of id, text, normalized_text, speaker, language (-1: absent)."""
    return tuple(names.index(n) if n in names else -1  # type: ignore[return-value]
                 for n in (ID, TEXT, NORMALIZED_TEXT, SPEAKER, LANGUAGE))


def _stem(path: str) -> str:
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    stem, dot, _ = name.rpartition(".")
    return stem if dot and stem else name


def parse_manifest(raw: bytes) -> tuple[list[Entry], list[Rejection]]:
    """Parse a JSON-lines manifest; faulty lines become rejections, never exceptions."""
    if raw.startswith(_BOM):
        raw = raw[len(_BOM):]
    entries: list[Entry] = []
    rejected: list[Rejection] = []
    first_line: dict[str, int] = {}
    for number, line_bytes in enumerate(raw.splitlines(), start=1):
        if not line_bytes.strip():
            continue
        where = f"manifest line {number}"

        def reject(problem: str, sample_id: str = "") -> None:
            rejected.append(Rejection(sample_id or f"line:{number}", f"{where} {problem}", line=number))

        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError:
            reject(f"is not valid UTF-8 ({_utf8_problem(line_bytes)})")
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            reject(f"is not JSON: {exc.msg} at column {exc.colno}")
            continue
        if not isinstance(obj, dict):
            reject(f"is a JSON {type(obj).__name__}, not an object")
            continue
        audio = obj.get("audio_filepath")
        if not isinstance(audio, str) or not audio.strip():
            reject("lacks 'audio_filepath'" if audio is None else "has an 'audio_filepath' that is not a path")
            continue
        given_id = obj.get("id")
        if given_id is not None and not isinstance(given_id, str):
            reject(f"has an 'id' that is not a string ({given_id!r})")
            continue
        sample_id = (given_id if given_id is not None else _stem(audio.strip())).strip()
        text = obj.get("normalized_text") or obj.get("text")
        speaker = obj.get("speaker", "")
        language = obj.get("language", "")
        duration = obj.get("duration")
        problem = _id_problem(sample_id)
        if not problem and "text" not in obj and "normalized_text" not in obj:
            problem = "lacks 'text'"
        elif not problem and not isinstance(text, str):
            problem = f"has a 'text' that is not a string ({text!r})"
        elif not problem and (isinstance(speaker, bool) or not isinstance(speaker, (str, int))):
            problem = f"has a 'speaker' that is not a string or integer ({speaker!r})"
        elif not problem and not isinstance(language, str):
            problem = f"has a 'language' that is not a string ({language!r})"
        elif not problem and duration is not None and (isinstance(duration, bool)
                                                      or not isinstance(duration, (int, float))):
            problem = f"has a 'duration' that is not a number ({duration!r})"
        if not problem:
            problem = _language_problem(language.strip())
        if problem:
            reject(problem, sample_id)
            continue
        if sample_id in first_line:
            rejected.append(Rejection(sample_id, f"duplicate id on {where} (first on line {first_line[sample_id]})",
                                      line=number))
            continue
        first_line[sample_id] = number
        entries.append(Entry(sample_id, str(text).strip(), number, str(speaker).strip(), language.strip(),
                             audio.strip()))
    return entries, rejected


def parse_entries(raw: bytes, file_name: str, columns: str = COLUMNS_AUTO) -> tuple[list[Entry], list[Rejection]]:
    """:func:`parse_manifest` for ``*.jsonl`` / ``*.json`` file names, :func:`parse_mix` for a
    mix (``*.yaml``: the blob of :func:`pack_mix`), else :func:`parse_metadata`."""
    if is_manifest(file_name):
        return parse_manifest(raw)
    if is_mix(file_name):
        return parse_mix(raw)
    return parse_metadata(raw, columns)


# ----------------------------------------------------------------------- mixes of datasets
#
# ``--data mix.yaml``: several datasets in one run, each with its own layout and language:
#
#     datasets:
#       - path: persian              # a dataset directory: relative to this file, or absolute
#         language: fa               # its clips' language where their metadata names none
#       - path: /data/LJSpeech-1.1
#         name: lj                   # default: the directory's name
#         metadata_file: metadata.csv   # default: data.metadata_file (a manifest works too)
#         columns: ""                # default: data.columns
#
# A clip's id becomes ``NAME:ID`` (two datasets may both have an ``0001``), its audio path
# is relative to the mix file's directory, and a clip whose metadata names no speaker is
# the dataset's own speaker, ``NAME``. The mix and every part's metadata bytes are packed
# into one blob (:func:`pack_mix`), so the index key, the scan and the dataset agreement
# see a mix exactly as they see one metadata file.

MIX_SUFFIXES = (".yaml", ".yml")
MIX_ID_SEPARATOR = ":"
_MIX_KEYS = {"path", "name", "language", "metadata_file", "columns"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class MixPart:
    """One dataset of a mix."""

    name: str
    path: str  # as the mix file wrote it
    language: str
    metadata_file: str
    columns: str


def is_mix(file_name: str) -> bool:
    return file_name.lower().endswith(MIX_SUFFIXES)


def parse_mix_spec(text: str, metadata_file: str, columns: str) -> list[MixPart]:
    """The datasets a mix file lists; LayoutError (one line) when it is not a usable mix."""
    import yaml

    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise LayoutError(f"mix file is not valid YAML: {str(exc).splitlines()[0]}") from None
    items = spec.get("datasets") if isinstance(spec, dict) else None
    if not isinstance(items, list) or not items or set(spec) != {"datasets"}:
        raise LayoutError("a mix file must hold one key, datasets: a list of {path, language, name, metadata_file, "
                          "columns}")
    parts: list[MixPart] = []
    for n, item in enumerate(items, start=1):
        where = f"mix dataset {n}"
        if not isinstance(item, dict) or not isinstance(item.get("path"), str) or not item["path"].strip():
            raise LayoutError(f"{where} must be a mapping with a path")
        unknown = sorted(set(item) - _MIX_KEYS)
        if unknown:
            raise LayoutError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_MIX_KEYS))})")
        values = {k: item.get(k) for k in _MIX_KEYS}
        for key in ("name", "language", "metadata_file", "columns"):
            if values[key] is not None and not isinstance(values[key], str):
                raise LayoutError(f"{where}: {key} must be a string, got {values[key]!r}")
        path = item["path"].strip()
        name = values["name"] or path.rstrip("/").rsplit("/", 1)[-1]
        if not _NAME.fullmatch(name):
            raise LayoutError(f"{where}: name {name!r} must be letters, digits, '.', '_' or '-' (it prefixes ids)")
        language = (values["language"] or "").strip()
        problem = _language_problem(language)
        if problem:
            raise LayoutError(f"{where}: {problem}")
        part_columns = values["columns"] if values["columns"] is not None else columns
        if part_columns:
            parse_columns(part_columns)
        parts.append(MixPart(name, path, language, values["metadata_file"] or metadata_file, part_columns))
    names = [p.name for p in parts]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise LayoutError(f"mix names dataset {twice[0]!r} twice: give each a distinct name")
    return parts


def pack_mix(parts: list[tuple[MixPart, str, bytes]]) -> bytes:
    """One blob of a mix: each part, its directory relative to the mix file's (or absolute), its metadata bytes."""
    import msgpack

    return msgpack.packb([{"name": p.name, "dir": d, "language": p.language, "metadata_file": p.metadata_file,
                           "columns": p.columns, "metadata": raw} for p, d, raw in parts], use_bin_type=True)


def unpack_mix(blob: bytes) -> list[tuple[MixPart, str, bytes]]:
    import msgpack

    return [(MixPart(d["name"], d["dir"], d["language"], d["metadata_file"], d["columns"]), d["dir"], d["metadata"])
            for d in msgpack.unpackb(blob, raw=False)]


def parse_mix(blob: bytes) -> tuple[list[Entry], list[Rejection]]:
    """The entries of every dataset of a mix, ids prefixed with the dataset's name."""
    entries: list[Entry] = []
    rejected: list[Rejection] = []
    for part, directory, raw in unpack_mix(blob):
        prefix = f"{part.name}{MIX_ID_SEPARATOR}"
        found, bad = parse_entries(raw, part.metadata_file, part.columns)
        for e in found:
            # a manifest's path from the mix file's directory; for LJSpeech, where the clip is expected
            audio = (e.audio if e.audio.startswith("/") else f"{directory}/{e.audio}" if e.audio
                     else f"{directory}/wavs/{e.id}.wav")
            entries.append(Entry(prefix + e.id, e.text, e.line, e.speaker or part.name, e.language or part.language,
                                 audio))
        rejected += [Rejection(prefix + r.id, f"{part.name}: {r.reason}", r.producer, r.line, r.file, r.kind)
                     for r in bad]
    return entries, rejected
