"""The registry of corpus formats (shared/dataset/corpus/registry.py): a metadata file's format
chosen by its name, once, and what ``--data`` names found."""

from __future__ import annotations

import json

import pytest

from stoker.shared.dataset.corpus.registry import format_of
from stoker.shared.dataset.layouts import Entry


def _lines(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode("utf-8")


def _manifest(obj: dict) -> bytes:
    return json.dumps(obj).encode("utf-8") + b"\n"


@pytest.mark.parametrize("name, kind", [("train.jsonl", "manifest"), ("manifest.json", "manifest"),
                                        ("sub/dir/EVAL.JSONL", "manifest"), ("cuts.jsonl.gz", "cuts"),
                                        ("librispeech_cuts_train.jsonl", "cuts"), ("mix.yaml", "mix"),
                                        ("a-{000..009}.tar", "tar"), ("recording*.tar", "shar"),
                                        ("data/*.parquet", "parquet"), ("s3://b/lj/metadata.csv", "url"),
                                        ("s3://b/c/train.jsonl", "manifest"), ("metadata.csv", "ljspeech"),
                                        ("list.txt", "ljspeech")])
def test_a_metadata_files_format_is_chosen_by_its_name(name: str, kind: str) -> None:
    assert format_of(name).name == kind


@pytest.mark.parametrize("name", ["train.jsonl", "manifest.json", "sub/dir/EVAL.JSONL"])
def test_a_manifest_is_read_by_its_name(name: str) -> None:
    manifest = _manifest({"audio_filepath": "a/A.wav", "text": "Hi.", "speaker": 2})
    entries, rejected = format_of(name).parse(manifest, "id|speaker|text")  # columns are for metadata files only
    assert rejected == [] and entries == [Entry("A", "Hi.", 1, "2", "", "a/A.wav")]


@pytest.mark.parametrize("name", ["metadata.csv", "metadata_train.csv", "list.txt", "jsonl.csv", "data"])
def test_metadata_is_read_otherwise(name: str) -> None:
    fmt = format_of(name)
    assert fmt.parse(_lines("A|Hi."), "") == ([Entry("A", "Hi.", 1)], [])
    assert fmt.parse(_lines("A|spk|Hi."), "id|speaker|text") == ([Entry("A", "Hi.", 1, "spk")], [])
    entries, rejected = fmt.parse(_manifest({"audio_filepath": "a/A.wav", "text": "Hi."}), "")
    assert entries == [] and [r.line for r in rejected] == [1]  # JSON in a metadata file is one malformed line
