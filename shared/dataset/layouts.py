"""Dataset layouts: metadata bytes in, entries and rejections out (pure functions, no I/O).

LJSpeech-style metadata (``metadata.csv`` or any other name, its fields named by
``data.columns`` or told by their count) and JSON-lines manifests (``*.jsonl``, ``*.json``);
which a metadata file is, its format tells (shared/dataset/corpus/: chosen once by its registry). Every line that
cannot be used becomes a :class:`Rejection` naming its line and why; only a ``data.columns``
that cannot be right raises (:class:`LayoutError`). docs/design/data.md, "Layouts", says what
each layout's fields may hold.
"""
from __future__ import annotations

import collections
import functools
import itertools
import json
import math
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..errors import UserError

COLUMNS_AUTO = ""  # data.columns default: the mapping chosen by the number of fields
ID, TEXT, NORMALIZED_TEXT, SPEAKER, LANGUAGE, IGNORED = "id", "text", "normalized_text", "speaker", "language", "_"
KNOWN_COLUMNS = (ID, TEXT, NORMALIZED_TEXT, SPEAKER, LANGUAGE, IGNORED)
# Auto mode: the mapping by the number of fields of a line.
AUTO_COLUMNS = {
    2: (ID, TEXT),
    3: (ID, TEXT, NORMALIZED_TEXT),
    5: (ID, TEXT, NORMALIZED_TEXT, SPEAKER, LANGUAGE),
}
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
_JSON = json.JSONDecoder()
_JSON_SPACE_CHARS = " \t\n\r"  # the whitespace JSON allows around a value
_JSON_SPACE = re.compile(f"[{_JSON_SPACE_CHARS}]*")
_NO_FIELDS = ("", "", "", "", "")  # a manifest line's (id, text, speaker, language, audio) before its id is known
# orjson reads a manifest's lines several times faster than json and makes the same values, but
# for what json alone decides, which goes to json: an integer of 19 digits or more (orjson makes
# a float of one beyond 64 bits; such a run of digits, in a number or not, sends the whole piece
# to json: found as a run of zeros once every digit is a zero, faster than a regular expression),
# NaN, Infinity, lone surrogate escapes and overflowing numbers (orjson refuses them: that line
# goes to json), and nesting deeper than json's recursion limit allows (orjson takes 1,024
# levels: a piece with this many more brackets than objects goes to json).
_DIGITS_AS_ZERO = bytes(b"0"[0] if b"0"[0] <= b <= b"9"[0] else b" "[0] for b in range(256))
_LONG_DIGITS = b"0" * 19
_DEEPEST_FAST = 500
_UNPARSED = object()  # orjson refused the line: json reads it (and words the rejection)


class LayoutError(UserError, ValueError):
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


@dataclass(frozen=True, init=False)
class Entry:
    """One clip as the metadata describes it."""

    id: str
    text: str
    line: int
    speaker: str = ""  # "" = not given (the dataset default applies)
    language: str = ""  # "" = not given (text.language applies)
    audio: str = ""  # audio path as a manifest wrote it; "" = wavs/<id>.<suffix>
    # A metadata line with fewer fields than the file's others ("2 fields where the file's lines
    # have 3 (...)"): read as id|text, it is a clip if its id has audio, else a line that lost
    # a field, and the index rejects it as that rather than as a missing audio file.
    short: str = field(default="", compare=False)
    duration: float | None = None  # seconds, as a manifest gives them (None: the audio header tells)

    def __init__(self, id: str, text: str, line: int, speaker: str = "", language: str = "",
                 audio: str = "", short: str = "", duration: float | None = None) -> None:
        # The generated __init__ of a frozen dataclass sets each field through object.__setattr__:
        # 9 ms for LJSpeech's 13,100 entries, against 4 ms for filling __dict__ (the instance is
        # as frozen either way). tests/shared/test_layouts.py checks this signature is the fields'.
        fields = self.__dict__
        fields["id"] = id
        fields["text"] = text
        fields["line"] = line
        fields["speaker"] = speaker
        fields["language"] = language
        fields["audio"] = audio
        fields["short"] = short
        fields["duration"] = duration


def nfc(name: str) -> str:
    """``name`` in Unicode normal form C: how ids and audio file names are compared, so that a
    name decomposed on disk (NFD, as macOS writes it and a copy keeps it) is the same id as
    the composed one a metadata file holds."""
    return name if name.isascii() else unicodedata.normalize("NFC", name)


# A URL's start (``s3://``): an object store's or a web server's location, not a path of this host.
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: str) -> bool:
    """Whether ``path`` is a URL (``s3://bucket/key``), not a path on this host."""
    return bool(_URL.match(path))


# A URL's user:password@, never shown.
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")

# A URL's query, which may carry credentials (a presigned URL's signature).
_QUERY = re.compile(r"(://[^\s?'\"]*)\?[^\s'\"]*")


def shown(text: str) -> str:
    """``text`` (a URL, or a message naming URLs) as logs and errors may show it: each URL
    without its ``user:password@`` and its query (a presigned URL's signature)."""
    return _QUERY.sub(r"\1?...", _USERINFO.sub(r"\1", text))


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


# A file has few distinct languages and speakers: their checks are remembered, not repeated per line.
_CHECKS_REMEMBERED = 4096


@functools.lru_cache(maxsize=_CHECKS_REMEMBERED)
def language_problem(code: str) -> str:
    if code and not _LANGUAGE.fullmatch(code):
        return f"language {code!r} is not a language code"
    return ""


@functools.lru_cache(maxsize=_CHECKS_REMEMBERED)
def _speaker_problem(speaker: str) -> str:
    if _CONTROL.search(speaker) or "|" in speaker:
        return f"speaker {speaker!r} has a control character or '|'"
    return ""


def _text_lines(raw: bytes, bom: bool = True) -> tuple[list[str], bool]:
    """The lines of ``raw`` decoded, cut where ``bytes.splitlines`` cuts (``\\r\\n``, ``\\r``, ``\\n``), and
    whether all of ``raw`` is UTF-8. One decode of the whole file is several times cheaper than one
    per line; when it fails, ``surrogateescape`` keeps each bad byte as a lone surrogate, so a
    line can still be checked alone (:func:`_encodes`) and its bytes recovered exactly. ``bom``:
    whether ``raw`` starts the file (only there is a byte order mark dropped)."""
    if bom and raw.startswith(_BOM):  # a UTF-8 byte order mark (Windows editors) is not part of the id
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
    """Parse LJSpeech-style metadata (docs/design/data.md, "Layouts"); malformed lines become rejections, never
    exceptions. LayoutError only for a ``columns`` spec that cannot work."""
    names = parse_columns(columns) if columns else None
    layouts = ({count: _positions(auto) for count, auto in AUTO_COLUMNS.items()} if names is None
               else {len(names): _positions(names)})
    id_at = 0 if names is None else names.index(ID)  # where a malformed line's id is looked for
    lines, clean = _text_lines(raw)
    usual = _usual_count(lines) if names is None else 0
    entries: list[Entry] = []
    rejected: list[Rejection] = []
    first_line: dict[str, int] = {}
    wide_line = 0  # auto mode: the first line mapped, and whether it has speaker and language columns
    wide = False
    for number, line in enumerate(lines, start=1):
        if not line.strip(_ASCII_SPACE):
            continue
        if not clean and not _encodes(line):
            rejected.append(_not_utf8(line, number, id_at))
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
        entry = _entry(parts, at, number)  # type: ignore[arg-type]
        if isinstance(entry, Rejection):
            rejected.append(entry)
            continue
        if len(parts) < usual:  # id|text among longer lines: a clip, or a line that lost a field
            entry.__dict__["short"] = (f"{len(parts)} fields where the file's lines have {usual} "
                                       f"({'|'.join(AUTO_COLUMNS[usual])})")
        sample_id = entry.id
        if sample_id in first_line:
            rejected.append(Rejection(sample_id, f"duplicate id on metadata line {number} "
                                                 f"(first on line {first_line[sample_id]})", line=number))
            continue
        first_line[sample_id] = number
        entries.append(entry)
    return entries, rejected


def _usual_count(lines: list[str]) -> int:
    """Auto mode: the number of fields most lines have (of those with a mapping; the first
    such line's on a tie), so that a line with fewer is known to lack one."""
    counts = collections.Counter(line.count("|") + 1 for line in lines if line.strip(_ASCII_SPACE))
    return max((count for count in counts if count in AUTO_COLUMNS), key=counts.__getitem__, default=0)


def _not_utf8(line: str, number: int, id_at: int) -> Rejection:
    """The rejection of a metadata line that is not UTF-8, under its id when that part decodes."""
    line_bytes = _line_bytes(line)
    fields = line_bytes.split(b"|", id_at + 1)
    head = fields[id_at].strip() if id_at < len(fields) else b""
    try:
        sample_id = head.decode("utf-8")
    except UnicodeDecodeError:
        sample_id = ""
    return Rejection(sample_id or f"line:{number}",
                     f"metadata line {number} is not valid UTF-8 ({_utf8_problem(line_bytes)})", line=number)


def _entry(parts: list[str], at: tuple[int, int, int, int, int], number: int) -> Entry | Rejection:
    """One well-formed line's entry (its fields at the positions ``at``), or why it is malformed."""
    i_id, i_text, i_normalized, i_speaker, i_language = at
    sample_id = nfc(parts[i_id].strip())
    text = (parts[i_normalized].strip() if i_normalized >= 0 else "") or (
        parts[i_text].strip() if i_text >= 0 else "")
    speaker = parts[i_speaker].strip() if i_speaker >= 0 else ""
    language = parts[i_language].strip() if i_language >= 0 else ""
    if not sample_id or "/" in sample_id or "\\" in sample_id or sample_id[0] == ".":
        problem = _id_problem(sample_id)
    else:
        problem = (language and language_problem(language)) or (speaker and _speaker_problem(speaker))
    if problem:
        return Rejection(sample_id or f"line:{number}", f"malformed metadata line {number}: {problem}", line=number)
    return Entry(sample_id, text, number, speaker, language)


def _stem(path: str) -> str:
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    stem, dot, _ = name.rpartition(".")
    return stem if dot and stem else name


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= MAX_SHOWN_CHARS else shown[:MAX_SHOWN_CHARS - 3] + "..."


def _json_object(line: str) -> tuple[Any, str]:
    """A manifest line's JSON value, or why it has none: what ``json.loads(line)`` does, without
    its per-call overhead (a third of the time of 13,100 short lines)."""
    try:
        start = _JSON_SPACE.match(line).end() if line[0] in _JSON_SPACE_CHARS else 0  # type: ignore[union-attr]
        value, end = _JSON.raw_decode(line, start)
        if end != len(line):
            end = _JSON_SPACE.match(line, end).end()  # type: ignore[union-attr]
            if end != len(line):
                raise json.JSONDecodeError("Extra data", line, end)
        return value, ""
    except json.JSONDecodeError as exc:
        return None, f"is not JSON: {exc.msg} at column {exc.colno}"
    except ValueError as exc:  # e.g. an integer of more digits than int() converts (sys.get_int_max_str_digits)
        return None, f"is not JSON: {str(exc).split(':')[0]}"
    except RecursionError:  # arrays or objects nested deeper than the interpreter's stack
        return None, "is not JSON: nested too deeply"


def _manifest_fields(obj: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
    """A manifest object's (id, text, speaker, language, audio, duration or None), or why the line is unusable (then
    the fields are empty but for the id, once it is known, so that the rejection names it).
    ``type(v) is str`` rather than isinstance: json makes exact types, and bool is no int here."""
    get = obj.get
    audio = get("audio_filepath")
    if audio is None:
        return "lacks 'audio_filepath'", _NO_FIELDS
    if type(audio) is not str or not audio.strip():
        return f"has an 'audio_filepath' that is not a path ({_shown(audio)})", _NO_FIELDS
    audio = audio.strip()
    if not audio.isprintable() and _CONTROL.search(audio):
        return f"has an 'audio_filepath' with a control character ({_shown(audio)})", _NO_FIELDS
    given_id = get("id")
    if given_id is None:
        sample_id = nfc(_stem(audio).strip())
        if not sample_id or sample_id[0] == ".":
            return f"has an 'audio_filepath' whose file name makes no id ({_shown(audio)}): give it an 'id'", _NO_FIELDS
    elif type(given_id) is not str:
        return f"has an 'id' that is not a string ({_shown(given_id)})", _NO_FIELDS
    else:
        sample_id = nfc(given_id.strip())
        if not sample_id:
            return "has an empty 'id'", _NO_FIELDS
        if _id_problem(sample_id) or _CONTROL.search(sample_id):
            return f"has an 'id' that is not a plain file name ({_shown(given_id)})", _NO_FIELDS
    named = (sample_id, "", "", "", "")
    text = get("text")
    normalized = get("normalized_text")
    if text is None and "text" not in obj and normalized is None:
        return "lacks 'text'", named
    if type(text) is not str and "text" in obj:
        return f"has a 'text' that is not a string ({_shown(text)})", named
    if normalized is not None and type(normalized) is not str:
        return f"has a 'normalized_text' that is not a string ({_shown(normalized)})", named
    speaker = get("speaker", "")
    if type(speaker) is not str:
        if type(speaker) is not int and speaker is not None:
            return f"has a 'speaker' that is not a string or integer ({_shown(speaker)})", named
        speaker = "" if speaker is None else str(speaker)
    language = get("language", "")
    if type(language) is not str:
        if language is not None:
            return f"has a 'language' that is not a string ({_shown(language)})", named
        language = ""
    duration = get("duration")
    if duration is not None and type(duration) is not float and type(duration) is not int:
        return f"has a 'duration' that is not a number ({_shown(duration)})", named
    if duration is not None and not math.isfinite(duration):  # json reads NaN and Infinity
        return f"has a 'duration' that is not a finite number ({_shown(duration)})", named
    spoken = (normalized.strip() if normalized else "") or (text.strip() if text else "")
    speaker = speaker.strip()
    language = language.strip()
    if language and language_problem(language):
        return f"has a 'language' that is not a language code ({_shown(language)})", named
    if speaker and _speaker_problem(speaker):
        return f"has a 'speaker' with a control character or '|' ({_shown(speaker)})", named
    return "", (sample_id, spoken, speaker, language, audio, None if duration is None else float(duration))


def _fast_values(raw: bytes, lines: list[str], clean: bool) -> list[Any] | None:
    """orjson's value of each line (_UNPARSED where it refused one), or None when json must read
    them all (:data:`_LONG_DIGITS`)."""
    if not clean or _LONG_DIGITS in raw.translate(_DIGITS_AS_ZERO):
        return None
    try:
        values = list(map(orjson.loads, lines[:-1] if lines and not lines[-1] else lines))
    except orjson.JSONDecodeError:
        values = list(map(_loads, lines))
    objects = list(map(type, values)).count(dict)
    if raw.count(b"{") + raw.count(b"[") - objects >= _DEEPEST_FAST:  # a line may nest that deep
        return None
    return values


def _loads(line: str) -> Any:
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return _UNPARSED


@dataclass
class ManifestColumns:
    """A manifest's entries as columns (one list per field of :class:`Entry`, a row per entry)."""

    id: list[str] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    line: list[int] = field(default_factory=list)
    speaker: list[str] = field(default_factory=list)
    language: list[str] = field(default_factory=list)
    audio: list[str] = field(default_factory=list)
    duration: list[float | None] = field(default_factory=list)

    def entry(self, n: int) -> Entry:
        return Entry(self.id[n], self.text[n], self.line[n], self.speaker[n], self.language[n], self.audio[n],
                     duration=self.duration[n])


def parse_manifest(raw: bytes, start_line: int = 1) -> tuple[list[Entry], list[Rejection]]:
    """Parse a JSON-lines manifest (docs/design/data.md, "Layouts"); faulty lines become rejections, never exceptions.
    ``start_line`` > 1: ``raw`` is a piece of a manifest cut at a line end, whose first line is that
    line of the file (a chunked index build: duplicate ids are then found within the piece only)."""
    c, rejected = manifest_columns(raw, start_line)
    return list(map(Entry, c.id, c.text, c.line, c.speaker, c.language, c.audio, [""] * len(c.id), c.duration)), \
        rejected


def manifest_columns(raw: bytes, start_line: int = 1) -> tuple[ManifestColumns, list[Rejection]]:
    """:func:`parse_manifest`'s entries as columns. A piece whose every line is an object that every
    check passes, without a repeated id (a manifest as a tool writes it), is checked a column at a
    time (:func:`_checked_columns`); any other a line at a time, each fault worded."""
    lines, clean = _text_lines(raw, bom=start_line == 1)
    values = _fast_values(raw, lines, clean)
    columns = _checked_columns(values, start_line) if values is not None else None
    if columns is not None:
        return columns, []
    columns = ManifestColumns()
    rejected: list[Rejection] = []
    first_line: dict[str, int] = {}
    for at, line in enumerate(lines):
        if not line.strip(_ASCII_SPACE):
            continue
        number = at + start_line
        if not clean and not _encodes(line):
            rejected.append(Rejection(f"line:{number}", f"manifest line {number} is not valid UTF-8 "
                                                        f"({_utf8_problem(_line_bytes(line))})", line=number))
            continue
        obj = values[at] if values is not None else _UNPARSED
        obj, problem = _json_object(line) if obj is _UNPARSED else (obj, "")
        fields = _NO_FIELDS
        if not problem and type(obj) is not dict:
            problem = f"is a JSON {_JSON_TYPES.get(type(obj), type(obj).__name__)}, not an object"
        elif not problem:
            problem, fields = _manifest_fields(obj)
            # json turns an unpaired "\ud800" into a lone surrogate: text that cannot be encoded again
            if not problem and "\\u" in line and not all(_encodes(value) for value in fields[:5]):
                problem = "has a lone surrogate escape (\\ud800 to \\udfff) where text should be"
        sample_id = fields[0]
        if problem:
            rejected.append(Rejection(sample_id or f"line:{number}", f"manifest line {number} {problem}",
                                      line=number))
        elif sample_id in first_line:
            rejected.append(Rejection(sample_id, f"duplicate id on manifest line {number} "
                                                 f"(first on line {first_line[sample_id]})", line=number))
        else:
            first_line[sample_id] = number
            columns.id.append(sample_id)
            columns.text.append(fields[1])
            columns.line.append(number)
            columns.speaker.append(fields[2])
            columns.language.append(fields[3])
            columns.audio.append(fields[4])
            columns.duration.append(fields[5])
    return columns, rejected


def _checked_columns(values: list[Any], start_line: int) -> ManifestColumns | None:
    """The columns of lines that are all objects (orjson's, no blank line among them) when each
    passes every check of :func:`_manifest_fields` and no id repeats, those checks made over whole
    columns (a few C-level passes each) to the same values; None when any fails (then the line at
    a time path finds which, and words why)."""
    if not values or _kinds(values) != {dict}:
        return None
    audio = _column(values, "audio_filepath")
    if _kinds(audio) != {str}:
        return None
    audio = list(map(str.strip, audio))
    if not all(audio) or _CONTROL.search("".join(audio)):
        return None
    given = _column(values, "id")
    kinds = _kinds(given)
    if kinds == {str}:
        ids = list(map(str.strip, given))
    elif kinds == {type(None)}:  # the file name's stem; it has no / or \ (_stem)
        ids = [_stem(path).strip() for path in audio]
    else:
        return None
    if not "".join(ids).isascii():
        ids = list(map(nfc, ids))
    joined = "\n" + "\n".join(ids)
    if (not all(ids) or _CONTROL.search("".join(ids)) or "\n." in joined or "/" in joined or "\\" in joined
            or len(set(ids)) != len(ids)):
        return None
    text, normalized = _column(values, "text"), _column(values, "normalized_text")
    kinds = _kinds(normalized)
    if _kinds(text) != {str} or not kinds <= {str, type(None)}:
        return None
    spoken = (list(map(str.strip, text)) if kinds == {type(None)} else
              [(n.strip() if n else "") or t.strip() for t, n in zip(text, normalized)])
    speakers = _column(values, "speaker")
    kinds = _kinds(speakers)
    if not kinds <= {str, int, type(None)}:
        return None
    if kinds != {str}:
        speakers = ["" if s is None else str(s) for s in speakers]
    speakers = list(map(str.strip, speakers))
    languages = _column(values, "language")
    kinds = _kinds(languages)
    if not kinds <= {str, type(None)}:
        return None
    if kinds == {type(None)}:
        languages = [""] * len(values)
    else:
        languages = list(map(str.strip, ["" if s is None else s for s in languages] if kinds != {str} else languages))
    if any(s and _speaker_problem(s) for s in set(speakers)) or any(s and language_problem(s) for s in set(languages)):
        return None
    durations = _column(values, "duration")
    kinds = _kinds(durations)
    if not kinds <= {float, int, type(None)}:
        return None
    if kinds != {float}:
        durations = [None if d is None else float(d) for d in durations]
    if not all(map(math.isfinite, [d for d in durations if d is not None] if type(None) in kinds else durations)):
        return None
    return ManifestColumns(ids, spoken, list(range(start_line, start_line + len(values))), speakers, languages,
                           audio, durations)


def _kinds(values: list[Any]) -> set[type]:
    return set(map(type, values))


def _column(objects: list[dict[str, Any]], key: str) -> list[Any]:
    """``[o.get(key) for o in objects]`` in C."""
    return list(map(dict.get, objects, itertools.repeat(key, len(objects))))
