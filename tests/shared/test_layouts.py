"""Tests for shared/layouts.py: metadata bytes to entries, for every layout, every bad line counted."""

from __future__ import annotations

import json

import pytest

from shared.layouts import (Entry, LayoutError, parse_columns, parse_entries, parse_manifest, parse_metadata,
                            parse_mix_spec)

PERSIAN = "امروز هوا آفتابی و کمی سرد است."


def _lines(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode("utf-8")


def test_ljspeech_two_and_three_fields_may_mix() -> None:
    entries, rejected = parse_metadata(_lines("A|Text one.|Text one, normalized.", "B|Just text."))
    assert rejected == []
    assert entries == [Entry("A", "Text one, normalized.", 1), Entry("B", "Just text.", 2)]


def test_five_fields_carry_speaker_and_language() -> None:
    entries, rejected = parse_metadata(_lines(f"A|{PERSIAN}|{PERSIAN}|spk1|fa", "B|Hello.|Hello.|spk2|en"))
    assert rejected == []
    assert entries == [Entry("A", PERSIAN, 1, "spk1", "fa"), Entry("B", "Hello.", 2, "spk2", "en")]
    assert entries[0].text.encode("utf-8") == PERSIAN.encode("utf-8")  # byte for byte


def test_a_speaker_column_in_some_lines_and_not_others_is_rejected_by_line() -> None:
    entries, rejected = parse_metadata(_lines("A|One.|One.|spk1|en", "B|Two.|Two.", "C|Three.|Three.|spk1|en"))
    assert [e.id for e in entries] == ["A", "C"]
    assert [(r.id, r.line) for r in rejected] == [("B", 2)]
    assert "the first line has speaker and language columns" in rejected[0].reason
    entries, rejected = parse_metadata(_lines("A|One.|One.", "B|Two.|Two.|spk1|en"))
    assert [e.id for e in entries] == ["A"] and "has no speaker and language columns" in rejected[0].reason


@pytest.mark.parametrize(("columns", "line", "expected"), [
    ("id|speaker|text", "A|spk|Hello.", Entry("A", "Hello.", 1, "spk", "")),
    ("id|_|text|language", "A|ignored|Hello.|de", Entry("A", "Hello.", 1, "", "de")),
    ("language|id|normalized_text", "fa|A|" + PERSIAN, Entry("A", PERSIAN, 1, "", "fa")),
])
def test_explicit_columns(columns: str, line: str, expected: Entry) -> None:
    entries, rejected = parse_metadata(_lines(line), columns)
    assert rejected == [] and entries == [expected]


def test_explicit_columns_reject_other_field_counts_by_line() -> None:
    entries, rejected = parse_metadata(_lines("A|spk|Hello.", "B|Hello."), "id|speaker|text")
    assert [e.id for e in entries] == ["A"]
    assert rejected[0].reason == "malformed metadata line 2: 2 fields, data.columns expects 3 (id|speaker|text)"


@pytest.mark.parametrize(("spec", "message"), [
    ("id|txt", "unknown column 'txt'"),
    ("id|text|text", "'text' is named twice"),
    ("speaker|text", "must name id and text"),
])
def test_bad_column_spec_is_one_line(spec: str, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        parse_columns(spec)


def test_bad_language_code_is_rejected() -> None:
    entries, rejected = parse_metadata(_lines("A|One.|One.|spk|f a", "B|Two.|Two.|spk|en"))
    assert [e.id for e in entries] == ["B"]
    assert rejected[0].reason == "malformed metadata line 1: language 'f a' is not a language code"


def test_bom_and_crlf() -> None:
    entries, rejected = parse_metadata(b"\xef\xbb\xbfA|One.|One.\r\nB|Two.|Two.\r\n")
    assert rejected == [] and [(e.id, e.text) for e in entries] == [("A", "One."), ("B", "Two.")]


def test_manifest_happy_path() -> None:
    raw = _lines(json.dumps({"audio_filepath": "audio/A.wav", "text": "Hello.", "duration": 1.5, "speaker": 3,
                             "language": "en"}),
                 json.dumps({"audio_filepath": "/abs/B.flac", "text": "raw", "normalized_text": PERSIAN,
                             "language": "fa"}, ensure_ascii=False),
                 json.dumps({"audio_filepath": "x/C.wav", "text": "Given id.", "id": "custom"}))
    entries, rejected = parse_manifest(raw)
    assert rejected == []
    assert entries == [Entry("A", "Hello.", 1, "3", "en", "audio/A.wav"),
                       Entry("B", PERSIAN, 2, "", "fa", "/abs/B.flac"),
                       Entry("custom", "Given id.", 3, "", "", "x/C.wav")]


def test_every_manifest_fault_is_counted_with_its_line() -> None:
    raw = b"\n".join([
        b"{not json",
        b"[1, 2]",
        json.dumps({"text": "no audio"}).encode(),
        json.dumps({"audio_filepath": "a/X.wav"}).encode(),
        json.dumps({"audio_filepath": "a/Y.wav", "text": 5}).encode(),
        json.dumps({"audio_filepath": "a/Z.wav", "text": "t", "speaker": [1]}).encode(),
        json.dumps({"audio_filepath": "a/W.wav", "text": "t", "duration": "long"}).encode(),
        b"\xff\xfe",
        json.dumps({"audio_filepath": "a/V.wav", "text": "first"}).encode(),
        json.dumps({"audio_filepath": "b/V.wav", "text": "again"}).encode(),
    ]) + b"\n"
    entries, rejected = parse_manifest(raw)
    assert [e.id for e in entries] == ["V"] and entries[0].text == "first"
    assert [(r.line, r.reason) for r in rejected] == [
        (1, "manifest line 1 is not JSON: Expecting property name enclosed in double quotes at column 2"),
        (2, "manifest line 2 is a JSON list, not an object"),
        (3, "manifest line 3 lacks 'audio_filepath'"),
        (4, "manifest line 4 lacks 'text'"),
        (5, "manifest line 5 has a 'text' that is not a string (5)"),
        (6, "manifest line 6 has a 'speaker' that is not a string or integer ([1])"),
        (7, "manifest line 7 has a 'duration' that is not a number ('long')"),
        (8, "manifest line 8 is not valid UTF-8 (byte 0xff at column 1)"),
        (10, "duplicate id on manifest line 10 (first on line 9)"),
    ]


def test_parse_entries_dispatches_by_file_name() -> None:
    manifest = _lines(json.dumps({"audio_filepath": "a/A.wav", "text": "Hi."}))
    assert parse_entries(manifest, "train.jsonl")[0][0].audio == "a/A.wav"
    assert parse_entries(_lines("A|Hi."), "metadata_train.csv")[0] == [Entry("A", "Hi.", 1)]
    assert parse_entries(_lines("A|spk|Hi."), "metadata.csv", "id|speaker|text")[0][0].speaker == "spk"


def test_mix_spec_defaults_and_names() -> None:
    parts = parse_mix_spec("datasets:\n  - path: data/persian\n    language: fa\n  - path: /x/lj\n    name: lj\n"
                           "    metadata_file: metadata_train.csv\n", "metadata.csv", "")
    assert [(p.name, p.path, p.language, p.metadata_file) for p in parts] == [
        ("persian", "data/persian", "fa", "metadata.csv"), ("lj", "/x/lj", "", "metadata_train.csv")]
    with pytest.raises(LayoutError, match="not valid YAML"):
        parse_mix_spec("datasets: [", "metadata.csv", "")
    with pytest.raises(LayoutError, match="columns 'id\\|nope': unknown column 'nope'"):
        parse_mix_spec("datasets:\n  - path: a\n    columns: id|nope\n", "metadata.csv", "")
