"""Dataset layouts: metadata bytes in, entries and rejections out (pure functions, no I/O).

This module is the one reader of a dataset's metadata. :func:`parse_entries` picks the
layout from the metadata file's name; every line that cannot be used becomes a
:class:`Rejection` that names its line number and the reason, so nothing is dropped
silently and nothing here raises for a fault in the data. Only a ``data.columns`` that
cannot be right raises, a :class:`LayoutError` (a user mistake: one line to read).

LJSpeech-style metadata (any other file name: ``metadata.csv``, ``metadata_train.csv``, ...)
    One clip per line, fields separated by ``|``, UTF-8 (a leading byte order mark is
    ignored; line ends may be ``\\n``, ``\\r\\n`` or ``\\r``; blank lines are skipped).
    Audio is ``wavs/<id>.<suffix>`` in the dataset directory.

    ``data.columns`` names the fields in order, separated by ``|``:

    ===================  ==================================================================
    ``id``               required; the audio file's name without the suffix (no ``/``,
                         ``\\``, nor a leading ``.``); an id seen before is a duplicate (the
                         first line wins)
    ``text``             the text spoken; at least one of ``text`` and ``normalized_text``
    ``normalized_text``  preferred to ``text`` when not empty (LJSpeech's third column)
    ``speaker``          any name without control characters; empty = the dataset's speaker
    ``language``         a code such as ``fa``, ``en-us`` or ``pt_BR`` (2 to 16 letters,
                         digits, ``-`` or ``_``); empty = ``text.language``
    ``_``                a field to ignore (may repeat)
    ===================  ==================================================================

    For example ``data.columns: "id|speaker|text"`` or ``"id|_|text|language"``. Every
    line must then have exactly that many fields. Values are stripped of surrounding
    spaces.

    The default, ``data.columns: ""``, chooses by the number of fields:

    - 2 fields: ``id|text``
    - 3 fields: ``id|text|normalized_text`` (LJSpeech; 2- and 3-field lines may mix)
    - 5 fields: ``id|text|normalized_text|speaker|language``

    The file's first line decides whether speaker and language columns are there: when it
    has 5 fields every line must, and when it has 2 or 3 no line may have 5. Any other
    number of fields is a malformed line; set ``data.columns`` for other forms.

JSON-lines manifests (``*.jsonl``, ``*.json``; NeMo and Coqui style)
    One JSON object per line (UTF-8; blank lines skipped)::

        {"audio_filepath": "wavs/a1.wav", "text": "Hello.", "duration": 1.7, "speaker": 3, "language": "en"}

    ``audio_filepath``   required: a path relative to the dataset directory, or absolute
    ``text``             required (a string); ``normalized_text`` is preferred to it when not
                         empty, and a line with only ``normalized_text`` is accepted
    ``speaker``          optional: a string or an integer (made a string)
    ``language``         optional: a code, as above
    ``duration``         optional: a number, checked for its type only (the audio header
                         is the truth)
    ``id``               optional: without it, a clip's id is its audio file's name without
                         the suffix, so two lines whose files share that name are duplicates

    ``null`` is the same as leaving an optional key out; other keys are ignored.

Mixes of datasets (``*.yaml``, ``*.yml``)
    Several datasets in one run: see the section on mixes below (:func:`parse_mix_spec`).

A speaker or language left empty takes the dataset's default (the speaker ``default``, or
the mix dataset's name; the language ``text.language``, or the mix dataset's language).
Whether a language code is one the text front-ends know is the index's question
(shared/dataset.py), not the layout's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

COLUMNS_AUTO = ""  # data.columns default: the mapping chosen by the number of fields
ID, TEXT, NORMALIZED_TEXT, SPEAKER, LANGUAGE, IGNORED = "id", "text", "normalized_text", "speaker", "language", "_"
KNOWN_COLUMNS = (ID, TEXT, NORMALIZED_TEXT, SPEAKER, LANGUAGE, IGNORED)
# Auto mode: the mapping by the number of fields of a line.
AUTO_COLUMNS = {
    2: (ID, TEXT),
    3: (ID, TEXT, NORMALIZED_TEXT),
    5: (ID, TEXT, NORMALIZED_TEXT, SPEAKER, LANGUAGE),
}
MANIFEST_SUFFIXES = (".jsonl", ".json")
# A language code, BCP 47 style (fa, en-us, pt_BR, cmn-Hans-CN): 2 to 16 characters.
_LANGUAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{1,15}")
# A speaker name or a manifest's id or audio path is one line of printable text: a tab or a
# newline would make the metadata fingerprint's "id TAB text TAB speaker TAB language" lines
# ambiguous, and a NUL is refused by every file system call.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_BOM = b"\xef\xbb\xbf"
# What bytes.strip() strips: a line of only these is blank. (str.strip() would also take
# Unicode spaces such as U+00A0 for blank; the reader has always counted them as content.)
_ASCII_SPACE = " \t\n\r\x0b\x0c"
# Longest JSON value quoted in a manifest rejection (a reason stays one short line).
MAX_SHOWN_CHARS = 40
# The JSON names of the values json.loads makes, for "manifest line 2 is a JSON list, not an object".
_JSON_TYPES = {list: "list", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}
_NO_FIELDS = ("", "", "", "", "")  # a manifest line's (id, text, speaker, language, audio) before its id is known


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
    """The column names of a ``data.columns`` spec; LayoutError (one line) when it cannot work."""
    known = f"known: {', '.join(KNOWN_COLUMNS)}"
    if not spec.strip():
        raise LayoutError(f"data.columns {spec!r} is blank: leave it unset for the mapping by field count, or name "
                          f"the fields ({known})")
    names = tuple(part.strip() for part in spec.split("|"))
    for position, name in enumerate(names, start=1):
        if not name:
            raise LayoutError(f"data.columns {spec!r}: field {position} has no name (write _ for a field to ignore; "
                              f"{known})")
        if name not in KNOWN_COLUMNS:
            raise LayoutError(f"data.columns {spec!r}: unknown column {name!r} ({known})")
    twice = next((n for n in names if n != IGNORED and names.count(n) > 1), None)
    if twice is not None:
        raise LayoutError(f"data.columns {spec!r}: {twice!r} is named twice (only _ may repeat; {known})")
    if ID not in names or (TEXT not in names and NORMALIZED_TEXT not in names):
        raise LayoutError(f"data.columns {spec!r} must name id and text (or normalized_text) ({known})")
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


def _speaker_problem(speaker: str) -> str:
    if _CONTROL.search(speaker) or "|" in speaker:
        return f"speaker {speaker!r} has a control character or '|'"
    return ""


def _text_lines(raw: bytes) -> tuple[list[str], bool]:
    """The lines of ``raw`` decoded, cut where ``bytes.splitlines`` cuts (``\\r\\n``, ``\\r``, ``\\n``), and
    whether all of ``raw`` is UTF-8. One decode of the whole file is several times cheaper than one
    per line; when it fails, ``surrogateescape`` keeps each bad byte as a lone surrogate, so a
    line can still be checked alone (:func:`_encodes`) and its bytes recovered exactly."""
    if raw.startswith(_BOM):  # a UTF-8 byte order mark (Windows editors) is not part of the id
        raw = raw[len(_BOM):]
    try:
        text = raw.decode("utf-8")
        clean = True
    except UnicodeDecodeError:
        text = raw.decode("utf-8", "surrogateescape")
        clean = False
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text.split("\n"), clean  # a last "" (the file's final line end) is a blank line


def _encodes(line: str) -> bool:
    """Whether text encodes to UTF-8: holds no lone surrogate (for a line of :func:`_text_lines`,
    whether it came from valid UTF-8; for a JSON string, whether it had no unpaired \\ud800 escape)."""
    if line.isascii():
        return True
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _line_bytes(line: str) -> bytes:
    return line.encode("utf-8", "surrogateescape")


def _positions(names: tuple[str, ...]) -> tuple[int, int, int, int, int]:
    """Field positions of id, text, normalized_text, speaker, language (-1: absent)."""
    return tuple(names.index(n) if n in names else -1  # type: ignore[return-value]
                 for n in (ID, TEXT, NORMALIZED_TEXT, SPEAKER, LANGUAGE))


def _plural(count: int) -> str:
    return f"{count} field{'s' if count != 1 else ''}"


def _count_problem(count: int, names: tuple[str, ...] | None) -> str:
    """Why a line of ``count`` fields has no mapping."""
    if names is not None:
        return f"{_plural(count)}, data.columns expects {len(names)} ({'|'.join(names)})"
    problem = f"{_plural(count)}, expected id|text|normalized_text or id|text"
    if count > 3:
        problem += " (or id|text|normalized_text|speaker|language; set data.columns for other forms)"
    return problem


def parse_metadata(raw: bytes, columns: str = COLUMNS_AUTO) -> tuple[list[Entry], list[Rejection]]:
    """Parse LJSpeech-style metadata (module docstring); malformed lines become rejections, never
    exceptions. LayoutError only for a ``columns`` spec that cannot work."""
    names = parse_columns(columns) if columns else None
    layouts = ({count: _positions(auto) for count, auto in AUTO_COLUMNS.items()} if names is None
               else {len(names): _positions(names)})
    id_at = 0 if names is None else names.index(ID)  # where a malformed line's id is looked for
    lines, clean = _text_lines(raw)
    entries: list[Entry] = []
    rejected: list[Rejection] = []
    first_line: dict[str, int] = {}
    wide_line = 0  # auto mode: the first line mapped, and whether it has speaker and language columns
    wide = False
    for number, line in enumerate(lines, start=1):
        if not line.strip(_ASCII_SPACE):
            continue
        if not clean and not _encodes(line):
            line_bytes = _line_bytes(line)
            fields = line_bytes.split(b"|", id_at + 1)
            head = fields[id_at].strip() if id_at < len(fields) else b""
            try:
                sample_id = head.decode("utf-8")
            except UnicodeDecodeError:
                sample_id = ""
            rejected.append(Rejection(sample_id or f"line:{number}",
                                      f"metadata line {number} is not valid UTF-8 ({_utf8_problem(line_bytes)})",
                                      line=number))
            continue
        parts = line.split("|")
        at = layouts.get(len(parts))
        problem = ""
        if at is None:
            problem = _count_problem(len(parts), names)
        elif names is None:
            has_speaker = at[3] >= 0
            if not wide_line:
                wide_line, wide = number, has_speaker
            elif has_speaker != wide:
                problem = (f"{len(parts)} fields, but the first line (line {wide_line}) "
                           f"{'has' if wide else 'has no'} speaker and language columns "
                           f"(id|text|normalized_text|speaker|language): every line must {'have' if wide else 'lack'} "
                           "them")
        if problem:
            sample_id = parts[id_at].strip() if id_at < len(parts) else ""
            rejected.append(Rejection(sample_id or f"line:{number}", f"malformed metadata line {number}: {problem}",
                                      line=number))
            continue
        i_id, i_text, i_normalized, i_speaker, i_language = at  # type: ignore[misc]
        sample_id = parts[i_id].strip()
        text = (parts[i_normalized].strip() if i_normalized >= 0 else "") or (
            parts[i_text].strip() if i_text >= 0 else "")
        speaker = parts[i_speaker].strip() if i_speaker >= 0 else ""
        language = parts[i_language].strip() if i_language >= 0 else ""
        if not sample_id or "/" in sample_id or "\\" in sample_id or sample_id[0] == ".":
            problem = _id_problem(sample_id)
        elif language and not _LANGUAGE.fullmatch(language):
            problem = _language_problem(language)
        elif speaker:
            problem = _speaker_problem(speaker)
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


def _stem(path: str) -> str:
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    stem, dot, _ = name.rpartition(".")
    return stem if dot and stem else name


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= MAX_SHOWN_CHARS else shown[:MAX_SHOWN_CHARS - 3] + "..."


def _json_object(line: str) -> tuple[Any, str]:
    """A manifest line's JSON value, or why it has none."""
    try:
        return json.loads(line), ""
    except json.JSONDecodeError as exc:
        return None, f"is not JSON: {exc.msg} at column {exc.colno}"
    except ValueError as exc:  # e.g. an integer of more digits than int() converts (sys.get_int_max_str_digits)
        return None, f"is not JSON: {str(exc).split(':')[0]}"
    except RecursionError:  # arrays or objects nested deeper than the interpreter's stack
        return None, "is not JSON: nested too deeply"


def _manifest_fields(obj: dict[str, Any]) -> tuple[str, tuple[str, str, str, str, str]]:
    """A manifest object's (id, text, speaker, language, audio), or why the line is unusable (then
    the fields are empty but for the id, once it is known, so that the rejection names it)."""
    audio = obj.get("audio_filepath")
    if audio is None:
        return "lacks 'audio_filepath'", _NO_FIELDS
    if not isinstance(audio, str) or not audio.strip():
        return f"has an 'audio_filepath' that is not a path ({_shown(audio)})", _NO_FIELDS
    audio = audio.strip()
    if _CONTROL.search(audio):
        return f"has an 'audio_filepath' with a control character ({_shown(audio)})", _NO_FIELDS
    given_id = obj.get("id")
    if given_id is None:
        sample_id = _stem(audio).strip()
        if _id_problem(sample_id):
            return f"has an 'audio_filepath' whose file name makes no id ({_shown(audio)}): give it an 'id'", _NO_FIELDS
    elif not isinstance(given_id, str):
        return f"has an 'id' that is not a string ({_shown(given_id)})", _NO_FIELDS
    else:
        sample_id = given_id.strip()
        if not sample_id:
            return "has an empty 'id'", _NO_FIELDS
        if _id_problem(sample_id) or _CONTROL.search(sample_id):
            return f"has an 'id' that is not a plain file name ({_shown(given_id)})", _NO_FIELDS
    named = (sample_id, "", "", "", "")
    if "text" not in obj and "normalized_text" not in obj:
        return "lacks 'text'", named
    text, normalized = obj.get("text"), obj.get("normalized_text")
    if "text" in obj and not isinstance(text, str):
        return f"has a 'text' that is not a string ({_shown(text)})", named
    if normalized is not None and not isinstance(normalized, str):
        return f"has a 'normalized_text' that is not a string ({_shown(normalized)})", named
    speaker = obj.get("speaker")
    if speaker is not None and (isinstance(speaker, bool) or not isinstance(speaker, (str, int))):
        return f"has a 'speaker' that is not a string or integer ({_shown(speaker)})", named
    language = obj.get("language")
    if language is not None and not isinstance(language, str):
        return f"has a 'language' that is not a string ({_shown(language)})", named
    duration = obj.get("duration")
    if duration is not None and (isinstance(duration, bool) or not isinstance(duration, (int, float))):
        return f"has a 'duration' that is not a number ({_shown(duration)})", named
    spoken = (normalized.strip() if normalized else "") or (text.strip() if text else "")
    speaker = "" if speaker is None else str(speaker).strip()
    language = (language or "").strip()
    problem = _language_problem(language) or (_speaker_problem(speaker) if speaker else "")
    if problem:
        return f"has a {problem}", named
    return "", (sample_id, spoken, speaker, language, audio)


def parse_manifest(raw: bytes) -> tuple[list[Entry], list[Rejection]]:
    """Parse a JSON-lines manifest (module docstring); faulty lines become rejections, never exceptions."""
    lines, clean = _text_lines(raw)
    entries: list[Entry] = []
    rejected: list[Rejection] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip(_ASCII_SPACE):
            continue
        where = f"manifest line {number}"
        if not clean and not _encodes(line):
            rejected.append(Rejection(f"line:{number}", f"{where} is not valid UTF-8 "
                                                        f"({_utf8_problem(_line_bytes(line))})", line=number))
            continue
        obj, problem = _json_object(line)
        if not problem and not isinstance(obj, dict):
            problem = f"is a JSON {_JSON_TYPES.get(type(obj), type(obj).__name__)}, not an object"
        fields = ("", "", "", "", "")
        if not problem:
            problem, fields = _manifest_fields(obj)
        # json.loads turns "\ud800" into a lone surrogate: not text that can be written or encoded again
        if not problem and "\\u" in line and not all(_encodes(value) for value in fields):
            problem = "has a lone surrogate escape (\\ud800-\\udfff) where text should be"
        sample_id = fields[0]
        if problem:
            rejected.append(Rejection(sample_id or f"line:{number}", f"{where} {problem}", line=number))
            continue
        if sample_id in first_line:
            rejected.append(Rejection(sample_id, f"duplicate id on {where} (first on line {first_line[sample_id]})",
                                      line=number))
            continue
        first_line[sample_id] = number
        entries.append(Entry(sample_id, fields[1], number, fields[2], fields[3], fields[4]))
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
