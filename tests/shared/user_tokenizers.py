"""User tokenizers for the tests of shared/text.py (``--text-frontend module:function``)."""

from __future__ import annotations


def bytes_tokenizer(text: str, language: str) -> list[int]:
    """UTF-8 bytes + 1 (0 is padding)."""
    return [b + 1 for b in text.encode("utf-8")]


bytes_tokenizer.vocab_size = 257  # type: ignore[attr-defined]


def no_size(text: str, language: str) -> list[int]:
    return [1]


def floats(text: str, language: str) -> list[float]:
    return [1.5]


floats.vocab_size = 4  # type: ignore[attr-defined]


def raises(text: str, language: str) -> list[int]:
    raise RuntimeError("no")


raises.vocab_size = 4  # type: ignore[attr-defined]


def too_large(text: str, language: str) -> list[int]:
    return [9]


too_large.vocab_size = 4  # type: ignore[attr-defined]

broken_import_target = None  # not callable: "has no function"
