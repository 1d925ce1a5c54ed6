"""Character tokenizer: a fixed, documented vocabulary shared by producers and the trainer.

The vocabulary is part of the data format: a model trained with it expects exactly these
ids, so the table below must never be reordered (append only, and bump the model).

====  ==========  ==========================================
id    symbol      meaning
====  ==========  ==========================================
0     ``<pad>``   padding (``PAD_ID``); never produced by :func:`encode_text`
1     ``<eos>``   end of sentence (``EOS_ID``); appended by :func:`encode_text`
2     ``" "``     a single space (runs of whitespace collapse to one)
3-28  ``a``-``z``  the lowercase letters, in order (``a`` = 3, ``z`` = 28)
29    ``'``       apostrophe (also curly single quotes)
30    ``,``       comma
31    ``.``       full stop
32    ``!``       exclamation mark
33    ``?``       question mark
34    ``-``       hyphen (also en/em dashes and the minus sign)
35    ``;``       semicolon
36    ``:``       colon
37    ``"``       double quote (also curly double quotes)
====  ==========  ==========================================

``VOCAB_SIZE`` is 38.

Normalisation (:func:`normalize_text`), in order:

1. Unicode NFKD, then drop combining marks (``"café"`` -> ``"cafe"``; compatibility
   forms such as the ligature ``"ﬁ"`` become ``"fi"``, the ellipsis ``"…"`` becomes
   ``"..."``).
2. Lowercase with :meth:`str.casefold` (so ``"ß"`` becomes ``"ss"``), and spell out a
   few Latin letters that NFKD does not decompose (``æ``, ``œ``, ``ø``, ``ł``, ``đ``,
   ``ð``, ``þ``, ``ı``).
3. Map typographic punctuation to the ASCII symbols of the vocabulary: curly single
   quotes and primes to ``'``, curly/low/angle double quotes to ``"``, dashes and the
   minus sign to ``-``.
4. Every whitespace character becomes a space; every other character outside the
   vocabulary (digits included: spell numbers out before tokenizing) is dropped.
5. Collapse runs of spaces to one, strip both ends.

This module does not import TensorFlow: it runs in every process, including ones that
never touch a tensor.
"""

from __future__ import annotations

import string
import unicodedata
from typing import Iterable

import numpy as np

PAD_SYMBOL = "<pad>"
EOS_SYMBOL = "<eos>"
_PUNCTUATION = ("'", ",", ".", "!", "?", "-", ";", ":", '"')

SYMBOLS: tuple[str, ...] = (PAD_SYMBOL, EOS_SYMBOL, " ", *string.ascii_lowercase, *_PUNCTUATION)
"""The vocabulary, indexed by token id (see the table in the module docstring)."""

PAD_ID: int = 0
EOS_ID: int = 1
VOCAB_SIZE: int = len(SYMBOLS)

_SYMBOL_TO_ID: dict[str, int] = {s: i for i, s in enumerate(SYMBOLS)}
# Single characters that can appear in normalised text (everything but <pad> and <eos>).
_TEXT_CHARS = frozenset(s for s in SYMBOLS if len(s) == 1)

# Characters NFKD leaves alone but that have an obvious spelling in a-z.
_LETTER_SPELLINGS = {
    "æ": "ae", "œ": "oe", "ø": "o", "ł": "l", "đ": "d", "ð": "d", "þ": "th", "ı": "i",
}
# Typographic punctuation mapped onto the vocabulary's ASCII symbols.
_PUNCTUATION_MAP = {
    "\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'", "\u02bc": "'",
    "`": "'", "\u00b4": "'",
    "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u201f": '"', "\u2033": '"',
    "\u00ab": '"', "\u00bb": '"',
    "\u2010": "-", "\u2011": "-", "\u2012": "-", "\u2013": "-", "\u2014": "-",
    "\u2015": "-", "\u2212": "-", "\u2043": "-",
}
_CHAR_MAP = {**_LETTER_SPELLINGS, **_PUNCTUATION_MAP}

# Token ids are int32: the dtype the batches and the model's embedding lookup use.
_ID_DTYPE = np.int32


def _ascii_table() -> dict[int, str | None]:
    """One str.translate table doing steps 2-4 for ASCII text (steps 1 and 3 change
    nothing there but the backtick): lowercase, ` -> ', whitespace -> space, drop the rest."""
    table: dict[int, str | None] = {}
    for code in range(128):
        ch = chr(code).lower()
        ch = _CHAR_MAP.get(ch, ch)
        table[code] = " " if ch.isspace() else ch if ch in _TEXT_CHARS else None
    return table


_ASCII_TABLE = _ascii_table()
# Normalised text is ASCII: bytes.translate maps it to token ids in one C call.
_ID_BYTES = bytes(_SYMBOL_TO_ID.get(chr(code), 0) for code in range(256))


def normalize_text(text: str) -> str:
    """Return ``text`` reduced to the vocabulary (see the module docstring for the rules)."""
    if text.isascii():  # the common case (LJSpeech): one C-level pass, same result as below
        return " ".join(text.translate(_ASCII_TABLE).split())
    decomposed = unicodedata.normalize("NFKD", text)
    no_marks = "".join(ch for ch in decomposed if not unicodedata.combining(ch))
    lowered = no_marks.casefold()
    out: list[str] = []
    for ch in lowered:
        ch = _CHAR_MAP.get(ch, ch)
        if len(ch) == 1 and ch.isspace():
            out.append(" ")
        elif ch in _TEXT_CHARS or (len(ch) > 1 and all(c in _TEXT_CHARS for c in ch)):
            out.append(ch)
        # anything else is outside the vocabulary and dropped
    return " ".join("".join(out).split())


def encode_text(text: str) -> np.ndarray:
    """Normalise ``text`` and map it to token ids, with ``EOS_ID`` appended.

    Returns an int32 array of shape [T] (T = number of normalised characters + 1). If the
    normalised text is empty the result is an empty array of shape [0] (no EOS), so that
    callers can reject the sample with ``if ids.size == 0``.
    """
    normalized = normalize_text(text)
    if not normalized:
        return np.zeros((0,), dtype=_ID_DTYPE)
    ids = np.empty(len(normalized) + 1, dtype=_ID_DTYPE)
    ids[:-1] = np.frombuffer(normalized.encode("ascii").translate(_ID_BYTES), dtype=np.uint8)
    ids[-1] = EOS_ID
    return ids


def count_tokens(text: str) -> int:
    """``len(encode_text(text))`` without building the array: normalised length + EOS, or 0."""
    normalized = normalize_text(text)
    return len(normalized) + 1 if normalized else 0


def decode_ids(ids: Iterable[int] | np.ndarray) -> str:
    """Map token ids [T] back to text.

    ``PAD_ID`` is skipped and decoding stops at the first ``EOS_ID`` (what follows it in
    a padded batch row is padding). ``decode_ids(encode_text(t)) == normalize_text(t)``.
    Raises ValueError for an id outside ``[0, VOCAB_SIZE)``.
    """
    chars: list[str] = []
    for raw in np.asarray(ids).reshape(-1).tolist():
        token = int(raw)
        if not 0 <= token < VOCAB_SIZE:
            raise ValueError(f"token id {token} is outside the vocabulary [0, {VOCAB_SIZE})")
        if token == EOS_ID:
            break
        if token == PAD_ID:
            continue
        chars.append(SYMBOLS[token])
    return "".join(chars)
