"""Tests for shared/text.py: the fixed vocabulary, normalisation and encode/decode."""

from __future__ import annotations

import string
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shared.text import EOS_ID, PAD_ID, SYMBOLS, VOCAB_SIZE, count_tokens, decode_ids, encode_text, normalize_text

IMPORT_TIMEOUT_S = 60  # a cold interpreter importing numpy, with a wide margin


def test_vocabulary_table_is_stable() -> None:
    # The ids are part of the data format: a change here breaks every trained model.
    assert PAD_ID == 0 and SYMBOLS[PAD_ID] == "<pad>"
    assert EOS_ID == 1 and SYMBOLS[EOS_ID] == "<eos>"
    assert SYMBOLS[2] == " "
    assert SYMBOLS[3:29] == tuple(string.ascii_lowercase)
    assert SYMBOLS[29:] == ("'", ",", ".", "!", "?", "-", ";", ":", '"')
    assert VOCAB_SIZE == len(SYMBOLS) == 38
    assert len(set(SYMBOLS)) == VOCAB_SIZE


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("Hello World.", "hello world."),
        ("Café déjà vu, naïve Zoë!", "cafe deja vu, naive zoe!"),  # accents dropped
        ("\u201cQuoted,\u201d she said \u2014 it\u2019s fine\u2026", '"quoted," she said - it\'s fine...'),
        ("  lots \t of\n\n   space  ", "lots of space"),
        ("Room 101 costs $5 #today", "room costs today"),  # digits and symbols dropped
        ("Stra\u00dfe \u00c6sop \u0141\u00f3d\u017a", "strasse aesop lodz"),
        ("\ufb01ne", "fine"),  # NFKD ligature
        ("semi; colon: dash-ed?", "semi; colon: dash-ed?"),
        ("\u65e5\u672c", ""),  # nothing in the vocabulary
    ],
)
def test_normalize_text_examples(raw: str, expected: str) -> None:
    assert normalize_text(raw) == expected


def test_normalize_text_is_idempotent_and_in_vocabulary() -> None:
    sample = "  \u00c0 bient\u00f4t \u2013 \u00ab mon ami \u00bb!  "
    once = normalize_text(sample)
    assert normalize_text(once) == once
    assert set(once) <= set(SYMBOLS[2:])


def test_encode_decode_round_trip() -> None:
    sentence = "The quick brown fox, isn't it? Yes: \"jumps\" - over; the lazy dog!"
    ids = encode_text(sentence)
    assert ids.dtype == np.int32
    assert ids.ndim == 1
    assert ids[-1] == EOS_ID
    assert PAD_ID not in ids[:-1] and EOS_ID not in ids[:-1]
    assert len(ids) == len(normalize_text(sentence)) + 1
    assert decode_ids(ids) == normalize_text(sentence)
    assert encode_text("ab").tolist() == [3, 4, EOS_ID]


def test_decode_skips_padding_and_stops_at_eos() -> None:
    row = np.concatenate([encode_text("hi there"), np.full(5, PAD_ID, dtype=np.int32)])
    assert decode_ids(row) == "hi there"
    assert decode_ids([PAD_ID, 10, 11]) == "hi"
    with pytest.raises(ValueError):
        decode_ids([VOCAB_SIZE])


@pytest.mark.parametrize("empty", ["", "   ", "123 456", "\u2603"])
def test_empty_text_encodes_to_empty_array(empty: str) -> None:
    ids = encode_text(empty)
    assert ids.shape == (0,)
    assert ids.dtype == np.int32


def test_module_does_not_import_tensorflow() -> None:
    code = "import shared.text, sys; assert 'tensorflow' not in sys.modules"
    repo_root = Path(__file__).resolve().parents[2]
    completed = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True,
                               timeout=IMPORT_TIMEOUT_S)
    assert completed.returncode == 0, completed.stderr


def _normalize_slowly(text: str) -> str:
    """The general path of normalize_text, without its ASCII shortcut."""
    import unicodedata

    from shared import text as text_mod

    decomposed = unicodedata.normalize("NFKD", text)
    lowered = "".join(ch for ch in decomposed if not unicodedata.combining(ch)).casefold()
    out = []
    for ch in lowered:
        ch = text_mod._CHAR_MAP.get(ch, ch)
        if len(ch) == 1 and ch.isspace():
            out.append(" ")
        elif ch in text_mod._TEXT_CHARS or (len(ch) > 1 and all(c in text_mod._TEXT_CHARS for c in ch)):
            out.append(ch)
    return " ".join("".join(out).split())


def test_ascii_shortcut_equals_the_general_rules() -> None:
    rng = np.random.default_rng(7)
    samples = ["".join(chr(c) for c in rng.integers(0, 128, size=int(rng.integers(0, 60)))) for _ in range(3000)]
    samples += [string.printable, "`Back`ticks` and\x1c\x1fseparators", "ALL CAPS, Mixed; Case: fine?!"]
    for raw in samples:
        assert normalize_text(raw) == _normalize_slowly(raw), repr(raw)
        ids = encode_text(raw)
        expected = [SYMBOLS.index(ch) for ch in _normalize_slowly(raw)]
        assert ids.dtype == np.int32
        assert ids.tolist() == (expected + [EOS_ID] if expected else [])
        assert count_tokens(raw) == len(ids)
