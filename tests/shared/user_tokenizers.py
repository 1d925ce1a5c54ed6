"""User tokenizers for the tests of shared/text.py (``--text-frontend module:function``)."""

from __future__ import annotations

import os
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


# The tokenizer JSON file a test wrote, read by hf_tokenizer (in the test's process and the index's helpers).
TOKENIZER_ENV = "STOKER_TEST_TOKENIZER"
PAD, EOS, UNK = "<pad>", "</s>", "<unk>"


def train_bpe(texts: list[str], path: Path, vocab_size: int = 200,
              specials: tuple[str, ...] = (PAD, EOS, UNK)) -> "tokenizers.Tokenizer":  # noqa: F821
    """A Hugging Face BPE tokenizer trained on ``texts``, its special tokens the first ids in the
    order of ``specials`` (<pad> 0, </s> 1 by default), </s> appended to every text (as stoker's
    own EOS), saved at ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                                             show_progress=False))
    tokenizer.post_processor = processors.TemplateProcessing(single=f"$A {EOS}",
                                                             special_tokens=[(EOS, specials.index(EOS))])
    tokenizer.save(str(path))
    return tokenizer


def hf_tokenizer() -> "tokenizers.Tokenizer":  # noqa: F821
    """The factory of the Hugging Face tokenizer a test saved (its path in TOKENIZER_ENV)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.environ[TOKENIZER_ENV])


class CodebaseTokenizer:
    """A codebase's own tokenizer class: ``encode(text) -> list[int]``, its size and special ids as attributes."""

    vocab_size = 130
    pad_id = 0
    eos_id = 1

    def encode(self, text: str) -> list[int]:
        return [2 + ord(c) % 128 for c in text] + [self.eos_id]


codebase_instance = CodebaseTokenizer()  # a tokenizer object named itself, not its factory


class Sized:
    """A tokenizer telling its size by len() only, without pad or EOS."""

    def __len__(self) -> int:
        return 10

    def encode(self, text: str) -> list[int]:
        return [len(text) % 10]


class Unsized:
    """A tokenizer telling no vocabulary size."""

    def encode(self, text: str) -> list[int]:
        return [1]


def not_a_tokenizer() -> int:
    return 3


def failing_factory() -> None:
    raise OSError("tokenizer.json not found")
