"""User tokenizers for the tests of shared/text.py (``--text-frontend module:function``)."""

from __future__ import annotations

from pathlib import Path


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


def write_editable(folder: Path, name: str, offset: int) -> str:
    """Write (or rewrite) the module ``folder/name.py`` of a tokenizer giving ``offset + code point % 200``,
    always at version 1; its spec. A new offset of another digit count gives another file size,
    so a reload never takes a stale bytecode cache."""
    (folder / f"{name}.py").write_text(f'__version__ = "1"\nVOCAB_SIZE = 300\n\n\ndef ids(text, language):\n'
                                       f'    return [{offset} + ord(c) % 200 for c in text]\n', encoding="utf-8")
    return f"{name}:ids"
