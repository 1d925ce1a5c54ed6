"""Tests for shared/dataset/layouts.py: metadata bytes to entries, for every layout, every bad line counted."""

from __future__ import annotations

import dataclasses
import inspect
import json
import random

import pytest

from stoker.shared.dataset import layouts
from stoker.shared.dataset.layouts import (Entry, LayoutError, Rejection, manifest_columns, parse_columns, parse_manifest,
                                    parse_metadata)


PERSIAN = "امروز هوا آفتابی و کمی سرد است."
PERSIAN_ZWNJ = "می‌خواهم"  # with a zero-width non-joiner (U+200C), which must survive as is
FIVE = "id|text|normalized_text|speaker|language"


def _lines(*lines: str, end: str = "\n") -> bytes:
    return (end.join(lines) + end).encode("utf-8")


def _manifest(*objects: dict | str | bytes, ascii_only: bool = False) -> bytes:
    """One line per object: a dict as JSON, a str or bytes as written."""
    out = []
    for obj in objects:
        if isinstance(obj, dict):
            out.append(json.dumps(obj, ensure_ascii=ascii_only).encode("utf-8"))
        else:
            out.append(obj if isinstance(obj, bytes) else obj.encode("utf-8"))
    return b"\n".join(out) + b"\n"


def _faults(rejected: list[Rejection]) -> list[tuple[str, int | None, str]]:
    return [(r.id, r.line, r.reason) for r in rejected]


# ------------------------------------------------------------------ the entry and rejection types

def test_entry_init_is_the_dataclass_fields() -> None:
    """Entry writes its own __init__ (speed); it must take exactly the fields, with their defaults."""
    fields = [(f.name, f.default) for f in dataclasses.fields(Entry)]
    params = [(p.name, p.default if p.default is not inspect.Parameter.empty else dataclasses.MISSING)
              for p in list(inspect.signature(Entry.__init__).parameters.values())[1:]]
    assert params == fields
    entry = Entry("A", "Hi.", 3, speaker="s", language="fa", audio="a/A.wav")
    assert (entry.id, entry.text, entry.line, entry.speaker, entry.language, entry.audio) == (
        "A", "Hi.", 3, "s", "fa", "a/A.wav")
    assert entry == Entry("A", "Hi.", 3, "s", "fa", "a/A.wav") and hash(entry) == hash(Entry("A", "Hi.", 3, "s", "fa",
                                                                                             "a/A.wav"))
    assert dataclasses.replace(entry, text="Bye.") == Entry("A", "Bye.", 3, "s", "fa", "a/A.wav")
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.text = "changed"  # type: ignore[misc]


def test_rejection_to_json() -> None:
    assert Rejection("A", "why").to_json() == {"id": "A", "reason": "why", "producer": "index"}
    assert Rejection("A", "why", "p1", 4, "wavs/A.wav", "missing").to_json() == {
        "id": "A", "reason": "why", "producer": "p1", "line": 4, "file": "wavs/A.wav", "kind": "missing"}


# ------------------------------------------------------------------ LJSpeech-style metadata, auto mode

def test_ljspeech_two_and_three_fields_may_mix() -> None:
    entries, rejected = parse_metadata(_lines("A|Text one.|Text one, normalized.", "B|Just text.", "C|Raw 1.|"))
    assert rejected == []
    assert entries == [Entry("A", "Text one, normalized.", 1), Entry("B", "Just text.", 2), Entry("C", "Raw 1.", 3)]


def test_five_fields_carry_speaker_and_language() -> None:
    entries, rejected = parse_metadata(_lines(f"A|{PERSIAN}|{PERSIAN}|spk1|fa", "B|Hello.|Hello, normalized.|spk 2|en-us",
                                              "C| Spaced. | | Ann |  pt_BR  ", "D|Defaults.|Defaults.||"))
    assert rejected == []
    assert entries == [Entry("A", PERSIAN, 1, "spk1", "fa"), Entry("B", "Hello, normalized.", 2, "spk 2", "en-us"),
                       Entry("C", "Spaced.", 3, "Ann", "pt_BR"), Entry("D", "Defaults.", 4, "", "")]


def test_a_speaker_column_in_some_lines_and_not_others_is_rejected_by_line() -> None:
    entries, rejected = parse_metadata(_lines("A|One.|One.|spk1|en", "B|Two.|Two.", "C|Three.|Three.|spk1|en", "D|Four."))
    assert [e.id for e in entries] == ["A", "C"]
    assert _faults(rejected) == [
        ("B", 2, "malformed metadata line 2: 3 fields, but the first line (line 1) has speaker and language columns "
                 "(id|text|normalized_text|speaker|language): every line must have them"),
        ("D", 4, "malformed metadata line 4: 2 fields, but the first line (line 1) has speaker and language columns "
                 "(id|text|normalized_text|speaker|language): every line must have them")]
    entries, rejected = parse_metadata(_lines("", "A|One.|One.", "B|Two.|Two.|spk1|en"))
    assert [e.id for e in entries] == ["A"]
    assert _faults(rejected) == [
        ("B", 3, "malformed metadata line 3: 5 fields, but the first line (line 2) has no speaker and language "
                 "columns (id|text|normalized_text|speaker|language): every line must lack them")]


def test_a_malformed_first_line_does_not_decide_the_mapping() -> None:
    entries, rejected = parse_metadata(_lines("A|x|y|z", "B|One.|One.|spk|fa", "C|Two.|Two.|spk|en"))
    assert [(e.id, e.speaker, e.language) for e in entries] == [("B", "spk", "fa"), ("C", "spk", "en")]
    assert [(r.id, r.line) for r in rejected] == [("A", 1)]


@pytest.mark.parametrize("fields", [4, 6, 9])
def test_other_field_counts_say_to_set_data_columns(fields: int) -> None:
    line = "|".join(["A"] + ["x"] * (fields - 1))
    entries, rejected = parse_metadata(_lines("B|One.", line))
    assert entries == [Entry("B", "One.", 1)]
    assert _faults(rejected) == [("A", 2, f"malformed metadata line 2: {fields} fields, expected id|text|normalized_text "
                                          "or id|text (or id|text|normalized_text|speaker|language; set data.columns "
                                          "for other forms)")]


def test_the_faults_of_ljspeech_lines_keep_their_reasons() -> None:
    raw = b"\n".join([b"A|One.", b"just one field", b"|No id.", b"../x|Up.", b"sub/x|Down.", b".hidden|Dot.",
                      b"A|Again.", b"C|caf\xe9|x", b"\xff\xfe|bad id", b"D|Fine.|Fine, normalized."]) + b"\n"
    entries, rejected = parse_metadata(raw)
    assert entries == [Entry("A", "One.", 1), Entry("D", "Fine, normalized.", 10)]
    assert _faults(rejected) == [
        ("just one field", 2, "malformed metadata line 2: 1 field, expected id|text|normalized_text or id|text"),
        ("line:3", 3, "malformed metadata line 3: empty id"),
        ("../x", 4, "malformed metadata line 4: id '../x' is not a plain file name"),
        ("sub/x", 5, "malformed metadata line 5: id 'sub/x' is not a plain file name"),
        (".hidden", 6, "malformed metadata line 6: id '.hidden' is not a plain file name"),
        ("A", 7, "duplicate id on metadata line 7 (first on line 1)"),
        ("C", 8, "metadata line 8 is not valid UTF-8 (byte 0xe9 at column 6)"),
        ("line:9", 9, "metadata line 9 is not valid UTF-8 (byte 0xff at column 1)")]


# ------------------------------------------------------------------ explicit data.columns

@pytest.mark.parametrize(("columns", "line", "expected"), [
    ("id|text", "A|Hello.", Entry("A", "Hello.", 1)),
    ("id|speaker|text", "A| spk |Hello.", Entry("A", "Hello.", 1, "spk", "")),
    ("id|_|text|language", "A|ignored|Hello.|de", Entry("A", "Hello.", 1, "", "de")),
    ("_|id|_|text", "x|A|y|Hello.", Entry("A", "Hello.", 1)),
    ("language|id|normalized_text", "fa|A|" + PERSIAN, Entry("A", PERSIAN, 1, "", "fa")),
    ("text|id", "Hello.|A", Entry("A", "Hello.", 1)),
    ("id|normalized_text|text", "A||Raw.", Entry("A", "Raw.", 1)),  # normalized_text preferred only when not empty
    ("id|normalized_text|text", "A|Norm.|Raw.", Entry("A", "Norm.", 1)),
    ("speaker|language|id|text", "Ann|fa|A|" + PERSIAN, Entry("A", PERSIAN, 1, "Ann", "fa")),
    (FIVE, "A|Raw.|Norm.|spk|en", Entry("A", "Norm.", 1, "spk", "en")),
    (" id | text ", "A|Hello.", Entry("A", "Hello.", 1)),
])
def test_explicit_columns(columns: str, line: str, expected: Entry) -> None:
    entries, rejected = parse_metadata(_lines(line), columns)
    assert rejected == [] and entries == [expected]


def test_explicit_columns_reject_other_field_counts_by_line() -> None:
    entries, rejected = parse_metadata(_lines("A|spk|Hello.", "B|Hello.", "C|s|Hi.|extra"), "id|speaker|text")
    assert entries == [Entry("A", "Hello.", 1, "spk")]
    assert _faults(rejected) == [
        ("B", 2, "malformed metadata line 2: 2 fields, data.columns expects 3 (id|speaker|text)"),
        ("C", 3, "malformed metadata line 3: 4 fields, data.columns expects 3 (id|speaker|text)")]
    entries, rejected = parse_metadata(_lines("A|One.|One.|spk|en", "B|Two.|Two.|spk"), FIVE)
    assert [e.id for e in entries] == ["A"]
    assert _faults(rejected) == [("B", 2, "malformed metadata line 2: 4 fields, data.columns expects 5 "
                                          "(id|text|normalized_text|speaker|language)")]


def test_explicit_columns_name_a_bad_line_by_its_id_column() -> None:
    entries, rejected = parse_metadata(b"fa|A|one|extra\nen\nfa|B|\xff\n", "language|id|text")
    assert entries == []
    assert [(r.id, r.line) for r in rejected] == [("A", 1), ("line:2", 2), ("B", 3)]


@pytest.mark.parametrize(("spec", "message"), [
    ("id|txt", "data.columns 'id|txt': unknown column 'txt' (known: id, text, normalized_text, speaker, language, _)"),
    ("id|text|text", "data.columns 'id|text|text': 'text' is named twice (only _ may repeat; known: id, text, "
                     "normalized_text, speaker, language, _)"),
    ("speaker|text", "data.columns 'speaker|text' must name id and text (or normalized_text) (known: "),
    ("id|speaker", "must name id and text (or normalized_text)"),
    ("id||text", "data.columns 'id||text': field 2 has no name (write _ for a field to ignore; known: "),
    ("ID|Text", "unknown column 'ID'"),
    ("  ", "data.columns '  ' is blank"),
])
def test_bad_column_spec_is_one_line(spec: str, message: str) -> None:
    with pytest.raises(LayoutError) as caught:
        parse_columns(spec)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(LayoutError):
        parse_metadata(_lines("A|Hello."), spec)


def test_parse_columns_returns_the_names() -> None:
    assert parse_columns("id|_|text|_|language") == ("id", "_", "text", "_", "language")
    assert parse_columns(" id | normalized_text ") == ("id", "normalized_text")


# ------------------------------------------------------------------ speakers and languages

@pytest.mark.parametrize("code", ["fa", "en", "en-us", "pt_BR", "cmn-Hans-CN", "x" * 16, "419"])
def test_language_codes_that_pass(code: str) -> None:
    entries, rejected = parse_metadata(_lines(f"A|One.|One.|spk|{code}"))
    assert rejected == [] and entries[0].language == code


@pytest.mark.parametrize("code", ["f a", "e", "x" * 17, "-en", "en/us", "فا", "en.us"])
def test_a_bad_language_code_is_rejected(code: str) -> None:
    entries, rejected = parse_metadata(_lines(f"A|One.|One.|spk|{code}", "B|Two.|Two.|spk|en"))
    assert [e.id for e in entries] == ["B"]
    assert _faults(rejected) == [("A", 1, f"malformed metadata line 1: language {code!r} is not a language code")]


def test_a_speaker_with_a_control_character_is_rejected() -> None:
    entries, rejected = parse_metadata(_lines("A|One.|One.|Ann\tLee|en", "B|Two.|Two.|آرش|fa"))
    assert entries == [Entry("B", "Two.", 2, "آرش", "fa")]
    assert _faults(rejected) == [("A", 1, "malformed metadata line 1: speaker 'Ann\\tLee' has a control character "
                                          "or '|'")]


# ------------------------------------------------------------------ bytes: BOM, line ends, Persian

@pytest.mark.parametrize("end", ["\n", "\r\n", "\r"])
def test_bom_and_line_ends(end: str) -> None:
    raw = b"\xef\xbb\xbf" + _lines("A|One.|One.", "", "B|Two.|Two.", end=end)
    entries, rejected = parse_metadata(raw)
    assert rejected == [] and entries == [Entry("A", "One.", 1), Entry("B", "Two.", 3)]


def test_a_bom_is_only_dropped_at_the_start() -> None:
    entries, rejected = parse_metadata("A|One.\n\ufeffB|Two.\n".encode("utf-8"))
    assert rejected == [] and [e.id for e in entries] == ["A", "\ufeffB"]


def test_only_ascii_line_ends_split_lines() -> None:
    """U+2028, U+0085 and form feeds are text to a byte-level reader, as they were before."""
    raw = "A|one\u2028two\x85three\x0cfour.\nB|\u00a0\n\u00a0\n".encode("utf-8")
    entries, rejected = parse_metadata(raw)
    assert entries == [Entry("A", "one\u2028two\x85three\x0cfour.", 1), Entry("B", "", 2)]
    assert _faults(rejected) == [("line:3", 3, "malformed metadata line 3: 1 field, expected "
                                               "id|text|normalized_text or id|text")]


def test_persian_text_is_kept_byte_for_byte() -> None:
    raw = _lines(f"fa_001|{PERSIAN}|{PERSIAN_ZWNJ}", f"fa_002|{PERSIAN}")
    entries, rejected = parse_metadata(raw)
    assert rejected == [] and entries == [Entry("fa_001", PERSIAN_ZWNJ, 1), Entry("fa_002", PERSIAN, 2)]
    assert [e.text.encode("utf-8") for e in entries] == [PERSIAN_ZWNJ.encode("utf-8"), PERSIAN.encode("utf-8")]
    assert entries[0].text.encode("utf-8") in raw and "\u200c" in entries[0].text
    entries, rejected = parse_metadata(_lines(f"fa_003|{PERSIAN}|{PERSIAN}|گوینده|fa"))
    assert rejected == [] and entries == [Entry("fa_003", PERSIAN, 1, "گوینده", "fa")]


def test_a_bad_byte_rejects_its_line_only() -> None:
    raw = _lines("A|One.", f"B|{PERSIAN}") + b"C|\xd8\n" + _lines(f"D|{PERSIAN}")
    entries, rejected = parse_metadata(raw)
    assert entries == [Entry("A", "One.", 1), Entry("B", PERSIAN, 2), Entry("D", PERSIAN, 4)]
    assert _faults(rejected) == [("C", 3, "metadata line 3 is not valid UTF-8 (byte 0xd8 at column 3)")]


# ------------------------------------------------------------------ the reader before data.columns

def _legacy_parse_metadata(raw: bytes) -> tuple[list[tuple[str, str, int]], list[tuple[str, str, int | None]]]:
    """shared/dataset.parse_metadata as it was before data.columns (commit 150c609^), the oracle
    for 1- to 3-field lines."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    entries, rejected, first_line = [], [], {}
    for number, line_bytes in enumerate(raw.splitlines(), start=1):
        if not line_bytes.strip():
            continue
        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError as exc:
            head = line_bytes.split(b"|", 1)[0].strip()
            try:
                sample_id = head.decode("utf-8") if head else ""
            except UnicodeDecodeError:
                sample_id = ""
            where = f"byte 0x{line_bytes[exc.start]:02x} at column {exc.start + 1}"
            rejected.append((sample_id or f"line:{number}", f"metadata line {number} is not valid UTF-8 ({where})",
                             number))
            continue
        parts = line.split("|")
        sample_id = parts[0].strip()
        problem = ""
        if len(parts) not in (2, 3):
            problem = f"{len(parts)} field{'s' if len(parts) != 1 else ''}, expected id|text|normalized_text or id|text"
        elif not sample_id:
            problem = "empty id"
        elif "/" in sample_id or "\\" in sample_id or sample_id.startswith("."):
            problem = f"id {sample_id!r} is not a plain file name"
        if problem:
            rejected.append((sample_id or f"line:{number}", f"malformed metadata line {number}: {problem}", number))
            continue
        if sample_id in first_line:
            rejected.append((sample_id, f"duplicate id on metadata line {number} (first on line "
                                        f"{first_line[sample_id]})", number))
            continue
        first_line[sample_id] = number
        entries.append((sample_id, parts[-1].strip() or parts[1].strip(), number))
    return entries, rejected


_PIECES = [b"A", b"B", b" A ", b"", b" ", b"|", b"||", b"Text.", b" Text. ", b"/x", b"\\x", b".x", b"\xff", b"\xd8",
           b"\xc3\xa9", "سلام".encode("utf-8"), b"\xef\xbb\xbf", b"\t", b"\xc2\xa0", b"\x0c", "\u2028".encode("utf-8")]
_BREAKS = [b"\n", b"\r\n", b"\r", b"\n\n"]


def _random_metadata(rng: random.Random, max_fields: int) -> bytes:
    lines = []
    for _ in range(rng.randint(0, 12)):
        fields = [b"".join(rng.choices(_PIECES, k=rng.randint(0, 3))).replace(b"|", b"")
                  for _ in range(rng.randint(1, max_fields))]
        lines.append(b"|".join(fields) + rng.choice(_BREAKS))
    return rng.choice([b"", b"\xef\xbb\xbf"]) + b"".join(lines)


def test_one_to_three_field_lines_parse_exactly_as_before() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        raw = _random_metadata(rng, max_fields=3)
        entries, rejected = parse_metadata(raw)
        assert ([(e.id, e.text, e.line) for e in entries], _faults_legacy(rejected)) == _legacy_parse_metadata(raw), raw
        assert all((e.speaker, e.language, e.audio) == ("", "", "") for e in entries)


def _faults_legacy(rejected: list[Rejection]) -> list[tuple[str, str, int | None]]:
    return [(r.id, r.reason, r.line) for r in rejected]


def test_every_non_blank_line_is_an_entry_or_a_rejection() -> None:
    rng = random.Random(11)
    for columns in ("", "", FIVE, "id|speaker|text", "language|_|id|normalized_text"):
        for _ in range(400):
            raw = _random_metadata(rng, max_fields=7)
            entries, rejected = parse_metadata(raw, columns)
            body = raw[3:] if raw.startswith(b"\xef\xbb\xbf") else raw
            lines = [n for n, line in enumerate(body.splitlines(), start=1) if line.strip()]
            assert sorted([e.line for e in entries] + [r.line for r in rejected]) == lines, raw
            assert all(r.reason and "\n" not in r.reason and r.id for r in rejected)


# ------------------------------------------------------------------ JSON-lines manifests

def test_manifest_happy_path() -> None:
    raw = _manifest({"audio_filepath": "audio/A.wav", "text": "Hello.", "duration": 1.5, "speaker": 3,
                     "language": "en"},
                    {"audio_filepath": "/abs/data/B.flac", "text": "raw", "normalized_text": PERSIAN, "language": "fa",
                     "speaker": " آرش "},
                    {"audio_filepath": "x/C.wav", "text": "Given id.", "id": "custom", "duration": 2},
                    {"audio_filepath": "D.wav", "text": " Only text. ", "normalized_text": "", "speaker": None,
                     "language": None, "duration": None, "id": None, "offset": 0, "extra": [1, 2]},
                    {"audio_filepath": "C:\\data\\E.v2.wav", "text": "Windows path."},
                    {"audio_filepath": "../other/F", "normalized_text": "No text key."})
    entries, rejected = parse_manifest(raw)
    assert rejected == []
    assert entries == [Entry("A", "Hello.", 1, "3", "en", "audio/A.wav", duration=1.5),
                       Entry("B", PERSIAN, 2, "آرش", "fa", "/abs/data/B.flac"),
                       Entry("custom", "Given id.", 3, "", "", "x/C.wav", duration=2.0),
                       Entry("D", "Only text.", 4, "", "", "D.wav"),
                       Entry("E.v2", "Windows path.", 5, "", "", "C:\\data\\E.v2.wav"),
                       Entry("F", "No text key.", 6, "", "", "../other/F")]


@pytest.mark.parametrize("ascii_only", [False, True])
def test_manifest_persian_is_kept_byte_for_byte(ascii_only: bool) -> None:
    raw = _manifest({"audio_filepath": "wavs/fa_001.wav", "text": PERSIAN_ZWNJ, "speaker": "گوینده", "language": "fa"},
                    ascii_only=ascii_only)
    entries, rejected = parse_manifest(raw)
    assert rejected == [] and entries == [Entry("fa_001", PERSIAN_ZWNJ, 1, "گوینده", "fa", "wavs/fa_001.wav")]
    assert entries[0].text.encode("utf-8") == PERSIAN_ZWNJ.encode("utf-8")


def test_manifest_values_json_alone_decides_are_json_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """orjson reads the usual lines; where it would read a line otherwise than json (a long integer,
    NaN, a lone surrogate escape, nesting json may refuse: its depth limit is the interpreter's
    recursion limit) the line is json's, as if orjson were not there."""
    deep = '{"audio_filepath": "a/D.wav", "text": "deep", "x": ' + "[" * 990 + "]" * 990 + "}"
    raw = _manifest({"audio_filepath": "a/A.wav", "text": "plain", "duration": 0.1 + 0.2},
                    '{"audio_filepath": "a/B.wav", "text": "t", "speaker": 123456789012345678901234567890}',
                    '{"audio_filepath": "a/C.wav", "text": "t", "duration": NaN}',
                    '{"audio_filepath": "a/S.wav", "text": "\\ud800"}', deep)
    short = raw.replace(b"123456789012345678901234567890", b"12")  # no long integer: orjson reads the piece
    read, read_short = parse_manifest(raw), parse_manifest(short)
    entries, rejected = read
    assert entries[:2] == [Entry("A", "plain", 1, audio="a/A.wav", duration=0.1 + 0.2),
                           Entry("B", "t", 2, "123456789012345678901234567890", audio="a/B.wav")]
    assert [(r.line, r.reason) for r in rejected][:2] == [
        (3, "manifest line 3 has a 'duration' that is not a finite number (nan)"),
        (4, "manifest line 4 has a lone surrogate escape (\\ud800 to \\udfff) where text should be")]
    monkeypatch.setattr(layouts, "_fast_values", lambda raw, lines, clean: None)  # json alone
    assert read == parse_manifest(raw) and read_short == parse_manifest(short)
    assert read_short[0][1].speaker == "12"


@pytest.mark.parametrize("variant", ["plain", "no ids", "given ids", "speakers as integers", "normalized text",
                                     "languages", "decomposed ids", "spaces", "integer durations", "no durations"])
def test_manifest_columns_checked_at_once_are_the_line_at_a_time_ones(variant: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A piece whose lines all pass is checked a column at a time: the entries are those the
    line at a time path makes, values and types alike; one faulty line sends the piece that way."""
    rows = []
    for i in range(12):
        row: dict = {"audio_filepath": f"audio/c{i}.wav", "text": f"Clip {i}.", "duration": 1.5 + i / 8}
        row.update({"no ids": {}, "given ids": {"id": f"clip-{i}"}, "speakers as integers": {"speaker": i % 3},
                    "normalized text": {"normalized_text": None if i % 2 else f"clip {i}"},
                    "languages": {"language": ["en", " de ", None][i % 3], "speaker": [None, "s1", " s2 "][i % 3]},
                    "decomposed ids": {"id": f"Cafe\u0301-{i}"}, "spaces": {"text": f"  t {i} ", "id": f" c{i} "},
                    "integer durations": {"duration": 1 + i % 2}, "no durations": {"duration": None},
                    "plain": {"speaker": "s"}}[variant])
        rows.append(row)
    raw = _manifest(*rows, ascii_only=variant == "spaces")
    checked, taken = layouts._checked_columns, []
    monkeypatch.setattr(layouts, "_checked_columns", lambda *args: taken.append(checked(*args)) or taken[-1])
    fast = manifest_columns(raw, 5)
    assert taken[0] is not None  # the column at a time path
    monkeypatch.setattr(layouts, "_checked_columns", lambda values, start_line: None)
    slow = manifest_columns(raw, 5)
    assert fast == slow and fast[1] == [] and len(fast[0].id) == 12
    assert [type(d) for d in fast[0].duration] == [type(d) for d in slow[0].duration]
    monkeypatch.undo()
    faulty = _manifest(*rows[:6], dict(rows[0], text="again"), *rows[6:])
    columns, rejected = manifest_columns(faulty, 5)
    assert columns.id == fast[0].id and [r.line for r in rejected] == [11] and "duplicate id" in rejected[0].reason


def test_manifest_bom_crlf_and_blank_lines() -> None:
    raw = b"\xef\xbb\xbf" + _manifest({"audio_filepath": "a/A.wav", "text": "One."}, "  ",
                                      {"audio_filepath": "a/B.wav", "text": "Two."}).replace(b"\n", b"\r\n")
    entries, rejected = parse_manifest(raw)
    assert rejected == [] and [(e.id, e.line, e.text) for e in entries] == [("A", 1, "One."), ("B", 3, "Two.")]


def test_every_manifest_fault_is_counted_with_its_line() -> None:
    ok = {"audio_filepath": "a/OK.wav", "text": "t"}
    raw = _manifest(
        "{not json",                                                                   # 1
        "[1, 2]",                                                                      # 2
        {"text": "no audio"},                                                          # 3
        {"audio_filepath": "a/X.wav"},                                                 # 4
        {"audio_filepath": "a/Y.wav", "text": 5},                                      # 5
        {"audio_filepath": "a/Z.wav", "text": "t", "speaker": [1]},                    # 6
        {"audio_filepath": "a/W.wav", "text": "t", "duration": "long"},                # 7
        b"\xff\xfe",                                                                   # 8
        {"audio_filepath": "a/V.wav", "text": "first"},                                # 9
        {"audio_filepath": "b/V.wav", "text": "again"},                                # 10
        {"audio_filepath": 7, "text": "t"},                                            # 11
        {"audio_filepath": " ", "text": "t"},                                          # 12
        {"audio_filepath": "a/U.wav", "text": None},                                   # 13
        {"audio_filepath": "a/T.wav", "text": "t", "normalized_text": ["x"]},          # 14
        {"audio_filepath": "a/S.wav", "text": "t", "speaker": True},                   # 15
        {"audio_filepath": "a/R.wav", "text": "t", "speaker": 1.5},                    # 16
        {"audio_filepath": "a/Q.wav", "text": "t", "language": 1},                     # 17
        {"audio_filepath": "a/P.wav", "text": "t", "language": "english (US)"},        # 18
        {"audio_filepath": "a/O.wav", "text": "t", "duration": True},                  # 19
        {"audio_filepath": "a/N.wav", "text": "t", "id": 12},                          # 20
        {"audio_filepath": "a/M.wav", "text": "t", "id": "a/b"},                       # 21
        {"audio_filepath": "a/L.wav", "text": "t", "id": "a\\b"},                      # 22
        {"audio_filepath": "a/K.wav", "text": "t", "id": "  "},                        # 23
        {"audio_filepath": "a/J.wav", "text": "t", "id": "custom"},                    # 24
        {"audio_filepath": "a/I.wav", "text": "t", "id": "custom"},                    # 25
        '"just a string"',                                                             # 26
        json.dumps(ok) + " {}",                                                        # 27
        '{"audio_filepath": "a/H.wav", "text": "t", "n": ' + "9" * 5000 + "}",        # 28
        "[" * 100_000,                                                                 # 29
        '{"audio_filepath": "a/G.wav", "text": "half \\ud800 a pair"}',                # 30
        {"audio_filepath": "a/F\x00.wav", "text": "t"},                                # 31
        {"audio_filepath": "a/.wav", "text": "t"},                                     # 32
        {"audio_filepath": "a/E.wav", "text": "t", "speaker": "Ann\nLee"},             # 33
        {"audio_filepath": "a/D.wav", "text": "t", "speaker": "Ann|Lee"},              # 34
        "null",                                                                        # 35
        ok,                                                                            # 36
    )
    entries, rejected = parse_manifest(raw)
    assert entries == [Entry("V", "first", 9, audio="a/V.wav"), Entry("custom", "t", 24, audio="a/J.wav"),
                       Entry("OK", "t", 36, audio="a/OK.wav")]
    assert _faults(rejected) == [
        ("line:1", 1, "manifest line 1 is not JSON: Expecting property name enclosed in double quotes at column 2"),
        ("line:2", 2, "manifest line 2 is a JSON list, not an object"),
        ("line:3", 3, "manifest line 3 lacks 'audio_filepath'"),
        ("X", 4, "manifest line 4 lacks 'text'"),
        ("Y", 5, "manifest line 5 has a 'text' that is not a string (5)"),
        ("Z", 6, "manifest line 6 has a 'speaker' that is not a string or integer ([1])"),
        ("W", 7, "manifest line 7 has a 'duration' that is not a number ('long')"),
        ("line:8", 8, "manifest line 8 is not valid UTF-8 (byte 0xff at column 1)"),
        ("V", 10, "duplicate id on manifest line 10 (first on line 9)"),
        ("line:11", 11, "manifest line 11 has an 'audio_filepath' that is not a path (7)"),
        ("line:12", 12, "manifest line 12 has an 'audio_filepath' that is not a path (' ')"),
        ("U", 13, "manifest line 13 has a 'text' that is not a string (None)"),
        ("T", 14, "manifest line 14 has a 'normalized_text' that is not a string (['x'])"),
        ("S", 15, "manifest line 15 has a 'speaker' that is not a string or integer (True)"),
        ("R", 16, "manifest line 16 has a 'speaker' that is not a string or integer (1.5)"),
        ("Q", 17, "manifest line 17 has a 'language' that is not a string (1)"),
        ("P", 18, "manifest line 18 has a 'language' that is not a language code ('english (US)')"),
        ("O", 19, "manifest line 19 has a 'duration' that is not a number (True)"),
        ("line:20", 20, "manifest line 20 has an 'id' that is not a string (12)"),
        ("line:21", 21, "manifest line 21 has an 'id' that is not a plain file name ('a/b')"),
        ("line:22", 22, "manifest line 22 has an 'id' that is not a plain file name ('a\\\\b')"),
        ("line:23", 23, "manifest line 23 has an empty 'id'"),
        ("custom", 25, "duplicate id on manifest line 25 (first on line 24)"),
        ("line:26", 26, "manifest line 26 is a JSON string, not an object"),
        ("line:27", 27, "manifest line 27 is not JSON: Extra data at column 45"),
        ("line:28", 28, "manifest line 28 is not JSON: Exceeds the limit (4300 digits) for integer string conversion"),
        ("line:29", 29, "manifest line 29 is not JSON: nested too deeply"),
        ("G", 30, "manifest line 30 has a lone surrogate escape (\\ud800 to \\udfff) where text should be"),
        ("line:31", 31, "manifest line 31 has an 'audio_filepath' with a control character ('a/F\\x00.wav')"),
        ("line:32", 32, "manifest line 32 has an 'audio_filepath' whose file name makes no id ('a/.wav'): give it "
                        "an 'id'"),
        ("E", 33, "manifest line 33 has a 'speaker' with a control character or '|' ('Ann\\nLee')"),
        ("D", 34, "manifest line 34 has a 'speaker' with a control character or '|' ('Ann|Lee')"),
        ("line:35", 35, "manifest line 35 is a JSON null, not an object"),
    ]


def test_manifest_reasons_quote_long_values_short() -> None:
    entries, rejected = parse_manifest(_manifest({"audio_filepath": "a/A.wav", "text": ["word"] * 100}))
    assert entries == [] and len(rejected) == 1
    assert rejected[0].reason.startswith("manifest line 1 has a 'text' that is not a string (['word', ")
    assert rejected[0].reason.endswith("...)") and len(rejected[0].reason) < 120


def test_every_non_blank_manifest_line_is_an_entry_or_a_rejection() -> None:
    rng = random.Random(5)
    values = ["a/A.wav", "B.wav", "", " ", None, 1, 1.5, True, [], {}, "fa", "f a", PERSIAN, "\ud800", "x/.wav"]
    keys = ["audio_filepath", "text", "normalized_text", "speaker", "language", "duration", "id"]
    for _ in range(500):
        lines = []
        for _ in range(rng.randint(0, 8)):
            kind = rng.random()
            if kind < 0.7:
                obj = {k: rng.choice(values) for k in rng.sample(keys, rng.randint(0, len(keys)))}
                lines.append(json.dumps(obj, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass"))
            else:
                lines.append(rng.choice([b"", b"  ", b"{", b"[]", b"\xff", b"1", b'{"a": 1} x']))
        raw = b"\n".join(lines) + rng.choice([b"", b"\n", b"\r\n"])
        entries, rejected = parse_manifest(raw)
        expected = [n for n, line in enumerate(raw.splitlines(), start=1) if line.strip()]
        assert sorted([e.line for e in entries] + [r.line for r in rejected]) == expected, raw
        for e in entries:  # every string of an entry can be written out again
            assert e.id and "".join((e.id, e.text, e.speaker, e.language, e.audio)).encode("utf-8")
