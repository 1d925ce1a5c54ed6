"""Mixes of datasets (shared/dataset/corpus/mix.py): the mix file's parts."""

from __future__ import annotations

import pytest

from stoker.shared.dataset.corpus.mix import parse_mix_spec
from stoker.shared.layouts import LayoutError


def test_mix_spec_defaults_and_names() -> None:
    parts = parse_mix_spec("datasets:\n  - path: data/persian\n    language: fa\n  - path: /x/lj\n    name: lj\n"
                           "    metadata_file: metadata_train.csv\n", "metadata.csv", "")
    assert [(p.name, p.path, p.language, p.metadata_file) for p in parts] == [
        ("persian", "data/persian", "fa", "metadata.csv"), ("lj", "/x/lj", "", "metadata_train.csv")]
    with pytest.raises(LayoutError, match="not valid YAML"):
        parse_mix_spec("datasets: [", "metadata.csv", "")
    with pytest.raises(LayoutError, match="columns 'id\\|nope': unknown column 'nope'"):
        parse_mix_spec("datasets:\n  - path: a\n    columns: id|nope\n", "metadata.csv", "")
