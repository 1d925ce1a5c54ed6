"""Mixes of datasets (shared/dataset/corpus/mix.py): the mix file's parts."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgpack
import pytest

from stoker.shared.dataset.corpus import registry
from stoker.shared.dataset.corpus.ljspeech import LJSpeech
from stoker.shared.dataset.corpus.mix import parse_mix_spec
from stoker.shared.dataset.layouts import LayoutError
from tests.factories import make_dataset


def test_mix_spec_defaults_and_names() -> None:
    parts = parse_mix_spec("datasets:\n  - path: data/persian\n    language: fa\n  - path: /x/lj\n    name: lj\n"
                           "    metadata_file: metadata_train.csv\n", "metadata.csv", "")
    assert [(p.name, p.path, p.language, p.metadata_file) for p in parts] == [
        ("persian", "data/persian", "fa", "metadata.csv"), ("lj", "/x/lj", "", "metadata_train.csv")]
    with pytest.raises(LayoutError, match="not valid YAML"):
        parse_mix_spec("datasets: [", "metadata.csv", "")
    with pytest.raises(LayoutError, match="columns 'id\\|nope': unknown column 'nope'"):
        parse_mix_spec("datasets:\n  - path: a\n    columns: id|nope\n", "metadata.csv", "")


def test_a_mix_streams_its_parts_one_at_a_time_and_hashes_them_as_it_goes(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Each part is read and listed before the next is read (never all parts' metadata at once),
    and the mix's SHA-256, which the index is keyed by and producers agree on, is that of its parts'
    places and their own SHA-256s (not of all their bytes); its stamp of their stamps."""
    make_dataset(tmp_path / "a", count=3, prefix="A")
    make_dataset(tmp_path / "b", count=2, prefix="B")
    (tmp_path / "mix.yaml").write_text("datasets:\n  - path: a\n    language: en\n  - path: b\n")
    located = registry.locate(str(tmp_path / "mix.yaml"), "metadata.csv")
    events: list[str] = []
    read, audio = LJSpeech.read, LJSpeech.audio
    monkeypatch.setattr(LJSpeech, "read", lambda self, root, name: events.append(f"read {root.name}") or
                        read(self, root, name))
    monkeypatch.setattr(LJSpeech, "audio", lambda self, root, *args: events.append(f"list {root.name}") or
                        audio(self, root, *args))
    listing = located.listing()
    assert events == ["read a", "list a", "read b", "list b"] and listing.raw is None
    assert sorted(listing.audio) == ["a:A0000", "a:A0001", "a:A0002", "b:B0000", "b:B0001"]
    parts = [{"name": name, "dir": name, "language": language, "metadata_file": "metadata.csv", "columns": "",
              "identity": hashlib.sha256((tmp_path / name / "metadata.csv").read_bytes()).hexdigest()}
             for name, language in (("a", "en"), ("b", ""))]
    whole = hashlib.sha256(msgpack.packb(parts, use_bin_type=True))
    assert listing.sha256 == whole.digest() and located.sha256() == whole.hexdigest()
    assert located.stamp() == ""  # an LJSpeech part's audio is listed for the mix: found by its key
    entries, rejected = located.clips()
    assert rejected == [] and [(e.id, e.speaker, e.language) for e in entries] == [
        ("a:A0000", "a", "en"), ("a:A0001", "a", "en"), ("a:A0002", "a", "en"), ("b:B0000", "b", ""),
        ("b:B0001", "b", "")]
    assert entries[0].audio == "a/wavs/A0000.wav"
