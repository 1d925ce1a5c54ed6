"""The vocabulary of a run: token ids of the text front-end's symbols, and the language and
speaker tables, saved in the run directory (vocab.json) and in every checkpoint, so that
synth, resume and export read texts as the run did. The front-ends are shared/text.py's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .runfiles import write_json
from .text import (EOS_ID, EOS_SYMBOL, FIRST_SYMBOL_ID, ID_DTYPE, PAD_ID, PAD_SYMBOL, USER_ID_SEPARATOR,
                                Frontend, TextError, UserTokenizer)


@dataclass(frozen=True)
class Vocabulary:
    """Token ids, and the language and speaker tables, of one run.

    ``symbols`` is empty for a user tokenizer (its ids are its own, ``size`` of them).
    Languages and speakers are listed in sorted order; a name's id is its position.
    """

    frontend: str
    symbols: tuple[str, ...]
    size: int
    engine: dict[str, Any]
    languages: tuple[str, ...] = ()
    speakers: tuple[str, ...] = ()

    @classmethod
    def build(cls, frontend: Frontend, units: Iterable[str], languages: Iterable[str] = (),
              speakers: Iterable[str] = ()) -> "Vocabulary":
        """The vocabulary of a dataset in ``languages``: the front-end's inventory of those
        languages in code-point order, whatever the texts, then any other symbol the units
        use, in code-point order (a language without a listed alphabet)."""
        codes = tuple(sorted(set(languages)))
        if frontend.is_user():
            assert isinstance(frontend, UserTokenizer)
            symbols: tuple[str, ...] = ()
            size = frontend.vocab_size
        else:
            inventory = frontend.inventory(codes)
            seen: set[str] = set()
            for u in units:
                seen.update(u)
            symbols = (PAD_SYMBOL, EOS_SYMBOL, *inventory, *sorted(seen.difference(inventory)))
            size = len(symbols)
        return cls(frontend.name, symbols, size, frontend.engine(), codes, tuple(sorted(set(speakers))))

    @property
    def is_user(self) -> bool:
        return not self.symbols

    @property
    def pad_id(self) -> int | None:
        """The padding id: ``PAD_ID``, or a user tokenizer object's own (None where it has none, and
        for a tokenizer function). The batch pads token rows with :attr:`padding_id`."""
        return self.engine.get("pad_id") if self.is_user else PAD_ID

    @property
    def padding_id(self) -> int:
        """The id the batch pads token rows with: :attr:`pad_id`, or ``PAD_ID`` where there is none."""
        pad = self.pad_id
        return PAD_ID if pad is None else int(pad)

    @property
    def eos_id(self) -> int | None:
        """The id ending each text: ``EOS_ID``, or a user tokenizer object's own (None where it has
        none, and for a tokenizer function): a user tokenizer's ids are its own, none appended."""
        return self.engine.get("eos_id") if self.is_user else EOS_ID

    def missing(self, units: str) -> str:
        """The characters of ``units`` this vocabulary lacks, in order ("" for a user tokenizer)."""
        if self.is_user:
            return ""
        known = self._ids
        return "".join(ch for ch in units if ch not in known)

    @property
    def _ids(self) -> dict[str, int]:
        ids = self.__dict__.get("_id_cache")
        if ids is None:
            ids = {s: i for i, s in enumerate(self.symbols)}
            object.__setattr__(self, "_id_cache", ids)
        return ids

    def encode(self, units: str) -> np.ndarray:
        """Ids [L] of ``units``: one per symbol then ``EOS_ID``, or a user tokenizer's ids.

        Raises KeyError for a symbol outside the vocabulary (the index rejects such texts first).
        """
        if self.is_user:
            return np.array(units.split(USER_ID_SEPARATOR) if units else [], dtype=ID_DTYPE)
        ids = self._ids
        out = np.empty(len(units) + 1, dtype=ID_DTYPE)
        for n, ch in enumerate(units):
            out[n] = ids[ch]
        out[-1] = EOS_ID
        return out

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Units of ids [L]: padding skipped, stopping at the first EOS (ids joined by spaces for a user tokenizer)."""
        values = [int(v) for v in np.asarray(ids).reshape(-1).tolist()]
        for v in values:
            if not 0 <= v < self.size:
                raise ValueError(f"token id {v} is outside the vocabulary [0, {self.size})")
        if self.is_user:
            pad = self.padding_id
            return USER_ID_SEPARATOR.join(str(v) for v in values if v != pad)
        out = []
        for v in values:
            if v == EOS_ID:
                break
            if v != PAD_ID:
                out.append(self.symbols[v])
        return "".join(out)

    def language_id(self, code: str) -> int:
        return self.languages.index(code)

    def speaker_id(self, name: str) -> int:
        return self.speakers.index(name)

    @property
    def fingerprint(self) -> str:
        """16 hex digits over everything that decides the ids."""
        blob = json.dumps(self.state_dict(), sort_keys=True, ensure_ascii=False).encode("utf-8")
        return hashlib.sha256(blob).hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        return {"frontend": self.frontend, "symbols": list(self.symbols), "size": self.size,
                "engine": dict(self.engine), "languages": list(self.languages), "speakers": list(self.speakers)}

    @classmethod
    def from_state_dict(cls, state: Any) -> "Vocabulary":
        """The vocabulary a run saved; ValueError if ``state`` is not one."""
        try:
            vocab = cls(str(state["frontend"]), tuple(str(s) for s in state["symbols"]), int(state["size"]),
                        dict(state["engine"]), tuple(str(s) for s in state["languages"]),
                        tuple(str(s) for s in state["speakers"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a stoker vocabulary ({type(exc).__name__}: {exc})") from None
        if vocab.symbols and (vocab.symbols[:FIRST_SYMBOL_ID] != (PAD_SYMBOL, EOS_SYMBOL)
                              or vocab.size != len(vocab.symbols)):
            raise ValueError("not a stoker vocabulary (symbols do not start with <pad>, <eos>)")
        return vocab

    def check_engine(self, frontend: Frontend) -> str:
        """Why ``frontend`` would not make this vocabulary's units ("" when it would)."""
        if frontend.name != self.frontend:
            return f"the run used the {self.frontend} front-end, not {frontend.name}"
        now = frontend.engine()
        changed = [f"{k} {self.engine.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(now) | set(self.engine))
                   if now.get(k) != self.engine.get(k)]
        return f"the {self.frontend} front-end changed since the run ({'; '.join(changed)})" if changed else ""


def save_vocabulary(vocab: Vocabulary, path: Any) -> None:
    """Write ``vocab`` as JSON (UTF-8, symbols as they are), atomically."""
    write_json(path, vocab.state_dict(), indent=1)


def load_vocabulary(path: Any) -> Vocabulary:
    """The vocabulary saved at ``path``; TextError (one line) if it is missing or not one."""

    try:
        state = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TextError(f"{path} not found: the run's vocabulary is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TextError(f"{path} cannot be read as a vocabulary: {exc}") from None
    try:
        return Vocabulary.from_state_dict(state)
    except ValueError as exc:
        raise TextError(f"{path}: {exc}") from None
