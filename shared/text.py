"""Text front-ends: what a clip's text becomes before the model sees it, for any language.

A front-end (``characters``, ``phonemes`` or a user's ``package.module:function``) turns
``(text, language)`` into units, whose characters are the tokens, and reports the characters
it loses; :func:`normalize` is the normalisation the built-in ones apply first. The
front-ends, the normalisation's steps, lost characters and the token ids: docs/design/text.md.
This module does not import TensorFlow.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import re
import string
import sys
import unicodedata
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from . import userfn
from .errors import UserError

log = logging.getLogger(__name__)

PAD_SYMBOL = "<pad>"
EOS_SYMBOL = "<eos>"
PAD_ID: int = 0
EOS_ID: int = 1
# Ids of the vocabulary's first symbol: after <pad> and <eos>.
FIRST_SYMBOL_ID = 2
# Token ids are int32: the dtype the batches and the model's embedding lookup use.
ID_DTYPE = np.int32

FRONTEND_CHARACTERS = "characters"
FRONTEND_PHONEMES = "phonemes"
DIGITS_SPELL = "spell"
DIGITS_KEEP = "keep"
# Bump when a rule that maps text to units changes: it is part of the index cache key,
# so cached units are derived again, and of every saved vocabulary.
TEXT_FORMAT = 1
# Units of a user tokenizer are its ids written as decimal numbers joined by this.
USER_ID_SEPARATOR = " "
# The run's vocabulary (symbols, language and speaker tables), in the run directory.
# Lost characters listed per dataset with this many example clip ids each.
LOST_EXAMPLES = 3

ZWNJ = "\u200c"
ZWJ = "\u200d"
TATWEEL = "\u0640"


class TextError(UserError, ValueError):
    """A text setting a user chose cannot be used; the message is one line for the user."""


@dataclass(frozen=True)
class Language:
    """What normalisation and the phonemizer need to know about one language."""

    code: str
    name: str
    espeak: str  # espeak-ng voice for the phonemes front-end
    num2words: str | None  # num2words language, None where it has none (digits are kept)
    letters: dict[str, str] = field(default_factory=dict)  # per-language letter unification
    keeps_zwnj: bool = False  # the zero-width non-joiner is part of the spelling
    # The letters, marks and punctuation the language writes besides COMMON_CHARACTERS, as
    # written (normalisation decides what they become); None where none are listed.
    alphabet: str | None = None


def _block(first: int, last: int) -> str:
    """Every assigned character of a Unicode block: a script's letters, marks and punctuation."""
    return "".join(chr(c) for c in range(first, last + 1) if unicodedata.category(chr(c)) != "Cn")


def _cased(letters: str) -> str:
    return letters + letters.upper()


_ARABIC_TO_PERSIAN = {"\u064a": "\u06cc", "\u0649": "\u06cc", "\u0643": "\u06a9"}  # yeh, alef maksura, kaf
_PERSIAN_TO_ARABIC = {"\u06cc": "\u064a", "\u06a9": "\u0643"}

# Arabic-script marks written in Persian, Arabic and Urdu: tanwin, fatha, damma, kasra, shadda,
# sukun, hamza above and below, superscript alef; and the Arabic comma, semicolon, question mark,
# percent sign, thousands separator and the guillemets these languages quote with.
_ARABIC_MARKS = "\u064b\u064c\u064d\u064e\u064f\u0650\u0651\u0652\u0654\u0655\u0670"
_ARABIC_PUNCTUATION = "\u060c\u061b\u061f\u066a\u066c\u00ab\u00bb"
_PERSIAN_ALPHABET = ("\u0621\u0622\u0623\u0624\u0625\u0626\u0627\u0628\u067e\u062a\u062b\u062c\u0686\u062d"
                     "\u062e\u062f\u0630\u0631\u0632\u0698\u0633\u0634\u0635\u0636\u0637\u0638\u0639\u063a"
                     "\u0641\u0642\u06a9\u06af\u0644\u0645\u0646\u0648\u0647\u06cc\u0629\u06c0"
                     + _ARABIC_MARKS + _ARABIC_PUNCTUATION)  # ... yeh, teh marbuta, heh with yeh above
_ARABIC_ALPHABET = ("\u0621\u0622\u0623\u0624\u0625\u0626\u0627\u0628\u0629\u062a\u062b\u062c\u062d\u062e"
                    "\u062f\u0630\u0631\u0632\u0633\u0634\u0635\u0636\u0637\u0638\u0639\u063a\u0641\u0642"
                    "\u0643\u0644\u0645\u0646\u0647\u0648\u0649\u064a\u0671"
                    "\u067e\u0686\u0698\u06a4\u06af"  # peh, tcheh, jeh, veh, gaf: foreign sounds
                    + _ARABIC_MARKS + _ARABIC_PUNCTUATION)
_URDU_ALPHABET = ("\u0621\u0622\u0623\u0624\u0626\u0627\u0628\u067e\u062a\u0679\u062b\u062c\u0686\u062d"
                  "\u062e\u062f\u0688\u0630\u0631\u0691\u0632\u0698\u0633\u0634\u0635\u0636\u0637\u0638"
                  "\u0639\u063a\u0641\u0642\u06a9\u06af\u0644\u0645\u0646\u06ba\u0648\u06c1\u06c2\u06be"
                  "\u06cc\u06d2\u06d3\u06d4\u0629\u06c3\u0647" + _ARABIC_MARKS + _ARABIC_PUNCTUATION)

LANGUAGES: dict[str, Language] = {lang.code: lang for lang in (
    Language("en", "English", "en-us", "en", alphabet=""),
    Language("fa", "Persian", "fa", "fa", _ARABIC_TO_PERSIAN, keeps_zwnj=True, alphabet=_PERSIAN_ALPHABET),
    Language("ar", "Arabic", "ar", "ar", _PERSIAN_TO_ARABIC, alphabet=_ARABIC_ALPHABET),
    Language("ur", "Urdu", "ur", None, _ARABIC_TO_PERSIAN, keeps_zwnj=True, alphabet=_URDU_ALPHABET),
    Language("de", "German", "de", "de", alphabet=_cased("äöüß") + "«»"),
    Language("fr", "French", "fr-fr", "fr", alphabet=_cased("àâæçéèêëîïôœùûüÿ") + "«»"),
    Language("es", "Spanish", "es", "es", alphabet=_cased("áéíñóúü") + "¡¿«»"),
    Language("it", "Italian", "it", "it", alphabet=_cased("àèéìíîòóùú") + "«»"),
    Language("pt", "Portuguese", "pt", "pt", alphabet=_cased("áâãàçéêíóôõúü") + "«»"),
    Language("nl", "Dutch", "nl", "nl", alphabet=_cased("áéíóúàèëïöü")),
    Language("pl", "Polish", "pl", "pl", alphabet=_cased("ąćęłńóśźż") + "«»"),
    Language("cs", "Czech", "cs", "cs", alphabet=_cased("áčďéěíňóřšťúůýž")),
    Language("sv", "Swedish", "sv", "sv", alphabet=_cased("åäöé")),
    Language("tr", "Turkish", "tr", "tr", alphabet="çğıöşüâîûÇĞİÖŞÜÂÎÛ"),
    Language("ru", "Russian", "ru", "ru", alphabet=_cased("абвгдеёжзийклмнопрстуфхцчшщъыьэюя") + "«»"),
    Language("uk", "Ukrainian", "uk", "uk", alphabet=_cased("абвгґдеєжзиіїйклмнопрстуфхцчшщьюя") + "«»"),
    Language("he", "Hebrew", "he", "he", alphabet=_block(0x0590, 0x05FF)),  # the Hebrew block
    Language("hi", "Hindi", "hi", None, alphabet=_block(0x0900, 0x097F)),  # the Devanagari block
    Language("zh", "Chinese (Mandarin)", "cmn", None),
    Language("ja", "Japanese", "ja", "ja"),
    Language("ko", "Korean", "ko", "ko"),
)}
# What a text of any language may hold besides its alphabet: Latin letters, the accented ones of
# Latin-1 too (names, loanwords, abbreviations; "café" keeps its "é"), ASCII digits (numbers kept
# as digits; Persian and Arabic-Indic digits are ASCII after normalisation), ASCII punctuation
# (typographic quotes and dashes become it) and the space; casefolded, as normalisation leaves them.
COMMON_CHARACTERS = (string.ascii_lowercase + "".join(chr(c) for c in range(0xE0, 0x100) if c != 0xF7)
                     + string.digits + string.punctuation.replace("`", "") + " ")

_QUOTES_AND_DASHES = {
    "\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'", "\u02bc": "'", "`": "'",
    "\u00b4": "'", "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u201f": '"', "\u2033": '"',
    "\u2010": "-", "\u2011": "-", "\u2012": "-", "\u2013": "-", "\u2014": "-", "\u2015": "-",
    "\u2212": "-", "\u2043": "-",
}
# Arabic-Indic (U+0660) and Extended Arabic-Indic (U+06F0, Persian/Urdu) digits, and the
# Arabic decimal separator, as ASCII for num2words.
_DIGITS = {**{chr(0x0660 + d): str(d) for d in range(10)}, **{chr(0x06F0 + d): str(d) for d in range(10)},
           "\u066b": "."}
# A number: digits, optionally one decimal part ("3.5"); thousands separators are
# removed first ("13,100" is one number, a comma between words is not touched).
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_ORDINAL_EN = re.compile(r"\b(\d+)(?:st|nd|rd|th)\b", re.IGNORECASE)
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?:\D|$))")
# Unicode general categories no front-end represents (docs/design/text.md).
_LOST_CATEGORIES = frozenset({"Cc", "Cf", "Co", "Cn", "Cs", "So"})
# ASCII text: control characters other than whitespace are lost, whitespace is a space, ` is '.
_ASCII_LOST = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")
_ASCII_TABLE = {**{c: None for c in [*range(0x00, 0x09), *range(0x0E, 0x20), 0x7F]},
                **{c: " " for c in range(0x09, 0x0E)}, ord("`"): "'"}
_ANY_DIGIT = re.compile(r"\d")
# Characters outside printable ASCII and its whitespace (which normalize() keeps lost and joiners
# out of), and the same with the digits that it spells: a text without them normalises with
# the ASCII table alone (Characters.unit_columns).
_NOT_PLAIN = re.compile(r"[^\x09-\x0d\x20-\x7e]")
_NOT_PLAIN_OR_DIGIT = re.compile(r"[^\x09-\x0d\x20-\x2f\x3a-\x7e]")
# The same without the whitespace other than a space: a column of such texts normalises as one
# string, a text a line (Characters.unit_columns).
_NOT_SPACED = re.compile(r"[^\x20-\x7e]")
_NOT_SPACED_OR_DIGIT = re.compile(r"[^\x20-\x2f\x3a-\x7e]")
_SPACES = re.compile(" +")
_SPACES_AT_LINE_ENDS = re.compile("^ | $", re.MULTILINE)
# Longer digit strings are kept as digits: codes and ids rather than quantities, and past a
# float's precision num2words would say another number.
MAX_SPELLED_DIGITS = 15


def language(code: str) -> Language:
    """The :class:`Language` of ``code``; TextError naming the known codes otherwise."""
    found = LANGUAGES.get(code)
    if found is None:
        raise TextError(f"unknown language code {code!r} (known: {', '.join(sorted(LANGUAGES))})")
    return found


# ----------------------------------------------------------------------- normalisation


def _spell_numbers(text: str, lang: Language) -> str:
    from num2words import num2words  # only the trainer normalises text: a producer host needs no num2words

    def spell(match: re.Match[str]) -> str:
        raw, source = match.group(0), match.string
        if sum(c.isdigit() for c in raw) > MAX_SPELLED_DIGITS:
            return raw
        value: int | float = float(raw) if "." in raw else int(raw)
        try:
            words = num2words(value, lang=lang.num2words)
        except (ArithmeticError, IndexError, KeyError, NotImplementedError, ValueError) as exc:
            log.debug("num2words cannot spell %s in %s (%s): kept as digits", raw, lang.code, exc)
            return raw
        before = " " if match.start() > 0 and source[match.start() - 1].isalnum() else ""
        after = " " if match.end() < len(source) and source[match.end()].isalnum() else ""
        return f"{before}{words}{after}"

    text = _THOUSANDS.sub("", text)
    if lang.code == "en":  # "3rd" is "third", not "three rd"
        text = _ORDINAL_EN.sub(lambda m: num2words(int(m.group(1)), lang="en", to="ordinal"), text)
    return _NUMBER.sub(spell, text)


def normalize(text: str, code: str, digits: str = DIGITS_SPELL) -> tuple[str, str]:
    """``(normalised text, lost characters)`` of ``text`` in language ``code``.

    Lost characters are returned in order of appearance, once per occurrence.
    """
    lang = language(code)
    if text.isascii():  # the common case (LJSpeech): C-level passes, same result as the loop below
        lost = "".join(_ASCII_LOST.findall(text))
        joined = text.translate(_ASCII_TABLE)
    else:
        joined, lost = _normalize_chars(text, lang)
    if digits == DIGITS_SPELL and lang.num2words is not None and _ANY_DIGIT.search(joined):
        joined = _spell_numbers(joined, lang)
    joined = joined.casefold()
    if ZWNJ not in joined and ZWJ not in joined:
        return " ".join(joined.split()), lost
    # A joiner next to a space joins nothing: it goes with the space.
    words = [w.strip(ZWNJ + ZWJ) for w in joined.split()]
    return " ".join(w for w in words if w), lost


def _normalize_chars(text: str, lang: Language) -> tuple[str, str]:
    """Steps 1-3 of normalisation, one character at a time: (text, lost characters)."""
    text = unicodedata.normalize("NFKC", text)
    out: list[str] = []
    lost: list[str] = []
    for ch in text:
        ch = lang.letters.get(ch, ch)
        ch = _QUOTES_AND_DASHES.get(ch, ch)
        ch = _DIGITS.get(ch, ch)
        if ch == TATWEEL:
            continue
        if ch in (ZWNJ, ZWJ):
            out.append(ch if lang.keeps_zwnj else " ")
        elif ch.isspace():
            out.append(" ")
        elif unicodedata.category(ch) in _LOST_CATEGORIES:
            lost.append(ch)
        else:
            out.append(ch)
    return "".join(out), "".join(lost)


# ----------------------------------------------------------------------- front-ends


@dataclass(frozen=True)
class Units:
    """What a front-end made of one text: the units (tokens as characters) and what was lost."""

    units: str
    lost: str = ""

    @property
    def lost_frac(self) -> float:
        """Share of the text's characters that were lost."""
        total = len(self.units) + len(self.lost)
        return len(self.lost) / total if total else 0.0


class Frontend:
    """Text to units, one language at a time. Subclasses implement :meth:`units`."""

    name: str = ""

    def __init__(self, digits: str = DIGITS_SPELL) -> None:
        self.digits = digits

    def units(self, texts: Sequence[str], code: str) -> list[Units]:
        raise NotImplementedError

    def unit_columns(self, texts: Sequence[str], code: str) -> tuple[list[str], list[str]]:
        """:meth:`units` as two columns, (units, lost characters): many texts without an object each."""
        made = self.units(texts, code)
        return [m.units for m in made], [m.lost for m in made]

    def engine(self) -> dict[str, Any]:
        """The versions that decide the units: part of the vocabulary and the index cache key."""
        return {"text_format": TEXT_FORMAT, "digits": self.digits, "num2words": _version("num2words")}

    def cache_key(self) -> dict[str, Any]:
        """What the index cache keys this front-end's units by: :meth:`engine`, and for a user
        tokenizer the hash of its source too."""
        return self.engine()

    def changed(self) -> bool:
        """Whether the code behind this front-end changed since it was made (a user tokenizer's source)."""
        return False

    def inventory(self, codes: Iterable[str]) -> str:
        """Every symbol this front-end can make of a text in the languages ``codes``, in code-point
        order: the vocabulary's first symbols, whatever the texts ("" for a user tokenizer)."""
        return ""

    def is_user(self) -> bool:
        return False

    def count(self, units: str) -> int:
        """Token ids ``units`` become: one per symbol plus EOS (0 for empty units)."""
        return len(units) + 1 if units else 0

    def counts(self, units: Sequence[str]) -> np.ndarray:
        """:meth:`count` of each of ``units`` (int64): the symbols counted in C where :meth:`count`
        is this class's, else :meth:`count` of each."""
        if type(self).count is not Frontend.count:
            return np.fromiter(map(self.count, units), np.int64, len(units))
        lengths = np.fromiter(map(len, units), np.int64, len(units))
        return lengths + (lengths > 0)


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return ""


class Characters(Frontend):
    name = FRONTEND_CHARACTERS

    def units(self, texts: Sequence[str], code: str) -> list[Units]:
        return list(map(Units, *self.unit_columns(texts, code)))

    def unit_columns(self, texts: Sequence[str], code: str) -> tuple[list[str], list[str]]:
        """normalize() of each text; a plain ASCII one (most of an English corpus) in four C-level
        calls, the others through normalize(). What normalize() does to a plain text: its ASCII
        table makes whitespace a space (split() takes it as whitespace already) and ` a ', it
        casefolds (lower(), in ASCII) and joins the words with one space."""
        spelled = self.digits == DIGITS_SPELL and language(code).num2words is not None
        if texts and (_NOT_SPACED_OR_DIGIT if spelled else _NOT_SPACED).search("".join(texts)) is None:
            return _plain_column(texts), [""] * len(texts)
        special = list(map((_NOT_PLAIN_OR_DIGIT if spelled else _NOT_PLAIN).search, texts))
        units = [" ".join(t.lower().split()).replace("`", "'") if s is None else "" for t, s in zip(texts, special)]
        lost = [""] * len(texts)
        for n in [n for n, s in enumerate(special) if s is not None]:
            units[n], lost[n] = normalize(texts[n], code, self.digits)
        return units, lost

    def inventory(self, codes: Iterable[str]) -> str:
        """COMMON_CHARACTERS and each language's alphabet, as normalisation leaves them."""
        symbols = set(COMMON_CHARACTERS)
        for code in sorted(set(codes)):
            lang = language(code)
            if lang.alphabet is None:
                log.info("no alphabet is listed for %s (%s): the characters vocabulary holds the characters of "
                         "its texts, and synth refuses a %s sentence with others", lang.name, code, lang.name)
            # one character at a time: casefolding may make two of one ("ß" is "ss"), and none is lost
            symbols.update(*(normalize(ch, code, DIGITS_KEEP)[0] for ch in lang.alphabet or ""))
            if lang.keeps_zwnj:  # inside a word (normalize drops a joiner alone)
                symbols.update((ZWNJ, ZWJ))
        return "".join(sorted(symbols))


def _plain_column(texts: Sequence[str]) -> list[str]:
    """What Characters.unit_columns makes of each of ``texts``, printable ASCII and spaces (no
    other whitespace, so no line end): the column joined a text a line, lowered and its runs of
    spaces made one, and each line stripped, in a few C-level passes over the whole."""
    joined = "\n".join(texts).lower().replace("`", "'")
    if "  " in joined:
        joined = _SPACES.sub(" ", joined)
    if joined.startswith(" ") or joined.endswith(" ") or " \n" in joined or "\n " in joined:
        joined = _SPACES_AT_LINE_ENDS.sub("", joined)
    return joined.split("\n")


# Punctuation the phonemizer keeps as it is (phonemizer's own set plus the Arabic-script
# comma, semicolon and question mark, which espeak would otherwise read out as words).
PHONEME_PUNCTUATION = ';:,.!?¡¿—…"«»“”()\u060c\u061b\u061f'
# Every symbol espeak-ng (1.52) can write for a phoneme, in any of its languages: for each phoneme
# of every phoneme table (phsource/), the characters of its ``ipa`` strings (U+XXXX decoded, the
# "|" no-tie flag dropped), and for a phoneme without one, its mnemonic through espeak-ng's ASCII
# to IPA table (dictionary.c WritePhMnemonic: digits after the first character skipped, "/" ends
# it); plus the stress marks. Not "_": phonemizer removes it (its phone separator). Phonemizing
# espeak-ng's word lists of every language in LANGUAGES (73,628 words) gives no other symbol;
# tests/shared/test_text.py checks a varied sample of each language.
ESPEAK_IPA = ('!"#%+-.12456789:=?AFKNOSUXZ[\\^`abcdefghijklmnopqrstuvwxyz|'
              "äæçðõøħĩŋœũɐɑɒɔɕɖɗɘəɚɛɜɟɡɢɣɤɥɧɨɪɫɬɭɯɱɲɳɴɵɸɹɻɽɾʀʁʂʃʈʉʊʋʌʍʎʏʐʑʒʔʕʝʤʦʰʲʷˈˌːˑˤ˥˦˧˨˩"
              "\u0303\u0306\u030a\u031d\u031e\u0325\u0329\u032a\u032f\u033a\u033b\u0361"  # combining diacritics
              "Φβεθχᵐᵑᵝᵻᶮᶯⁿ")


class Phonemes(Frontend):
    """espeak-ng through phonemizer, with the library and data of the espeakng-loader wheel."""

    name = FRONTEND_PHONEMES

    def __init__(self, digits: str = DIGITS_SPELL) -> None:
        super().__init__(digits)
        self._backends: dict[str, Any] = {}

    def inventory(self, codes: Iterable[str]) -> str:
        """ESPEAK_IPA, the punctuation kept and the space: the same for every language (a
        foreign word is read with another language's phonemes)."""
        return "".join(sorted(set(ESPEAK_IPA + PHONEME_PUNCTUATION + " ")))

    def _backend(self, code: str) -> Any:
        backend = self._backends.get(code)
        if backend is None:
            voice = language(code).espeak
            EspeakBackend = load_espeak()
            try:
                backend = EspeakBackend(voice, preserve_punctuation=True, punctuation_marks=PHONEME_PUNCTUATION,
                                        with_stress=True, language_switch="remove-flags", words_mismatch="ignore",
                                        logger=_QUIET)
            except RuntimeError as exc:
                raise TextError(f"espeak-ng cannot phonemize language {code!r} (voice {voice}): {exc}") from None
            self._backends[code] = backend
        return backend

    def units(self, texts: Sequence[str], code: str) -> list[Units]:
        normalized = [normalize(t, code, self.digits) for t in texts]
        backend = self._backend(code)
        try:  # one call for the whole list: espeak is set up once, not per sentence
            phones = backend.phonemize([n for n, _ in normalized], strip=True, njobs=1)
        except RuntimeError:  # one text the phonemizer cannot take: find it, keep the others
            return [self._one(backend, n, lost) for n, lost in normalized]
        return [Units(" ".join(p.split()), lost) for p, (_, lost) in zip(phones, normalized)]

    @staticmethod
    def _one(backend: Any, text: str, lost: str) -> Units:
        """One text alone; a text the phonemizer fails on is lost whole (its clip is rejected, counted)."""
        try:
            return Units(" ".join(backend.phonemize([text], strip=True, njobs=1)[0].split()), lost)
        except RuntimeError as exc:
            log.warning("espeak-ng cannot phonemize %r: %s", text[:60], exc)
            return Units("", lost + text.replace(" ", ""))

    def engine(self) -> dict[str, Any]:
        # package versions, not the library's own: a cache key must not cost an espeak set-up
        return {**super().engine(), "phonemizer": _version("phonemizer"),
                "espeakng_loader": _version("espeakng-loader")}


_QUIET = logging.getLogger("stoker.phonemizer")
_QUIET.setLevel(logging.ERROR)  # phonemizer warns per line about word-count mismatches it was told to ignore


def load_espeak() -> Any:
    """phonemizer's EspeakBackend, pointed at the espeakng-loader wheel's library and data."""
    try:
        import espeakng_loader  # the phonemes front-end's only, with phonemizer (heavy)
        from phonemizer.backend import EspeakBackend
        from phonemizer.backend.espeak.wrapper import EspeakWrapper
    except ImportError as exc:
        missing = (exc.name or "phonemizer").split(".")[0]
        raise TextError(f"the phonemes front-end needs phonemizer and espeakng-loader ({missing} is not "
                        "installed): python -m pip install -e .") from None
    EspeakWrapper.set_library(espeakng_loader.get_library_path())
    EspeakWrapper.set_data_path(espeakng_loader.get_data_path())
    return EspeakBackend


class UserTokenizer(Frontend):
    """A user's ``package.module:function``: a function mapping ``(text, language)`` to ids, or a
    tokenizer of the user's own (:class:`LoadedTokenizer`) whose ``encode`` gives them."""

    def __init__(self, spec: str, digits: str = DIGITS_SPELL) -> None:
        super().__init__(digits)
        self.name = spec
        loaded = load_user_tokenizer(spec)
        self.function, self.vocab_size, self.version, self.source = (loaded.function, loaded.vocab_size,
                                                                     loaded.version, loaded.source)
        self.tokenizer, self.pad_id, self.eos_id, self.config = (loaded.tokenizer, loaded.pad_id, loaded.eos_id,
                                                                 loaded.config)

    def is_user(self) -> bool:
        return True

    def count(self, units: str) -> int:
        return len(units.split(USER_ID_SEPARATOR)) if units else 0

    def units(self, texts: Sequence[str], code: str) -> list[Units]:
        if self.tokenizer is not None and texts:
            try:  # the tokenizer's own batch call where it has one (in Rust, for a Hugging Face one)
                made = encode_batch(self.tokenizer, texts)
            except Exception as exc:  # the user's tokenizer: its failure is reported as theirs
                raise TextError(f"tokenizer {self.name} failed on a batch of {len(texts)} texts from "
                                f"{texts[0][:40]!r}: {type(exc).__name__}: {exc}") from None
            return [Units(USER_ID_SEPARATOR.join(map(str, self._checked(ids, text)))) for ids, text in zip(made, texts)]
        out = []
        for text in texts:
            try:
                ids = self.function(text, code)
            except Exception as exc:  # the user's code: its failure is reported as theirs
                raise TextError(f"tokenizer {self.name} failed on {text[:40]!r}: {type(exc).__name__}: {exc}") \
                    from None
            out.append(Units(USER_ID_SEPARATOR.join(str(i) for i in self._checked(ids, text))))
        return out

    def _checked(self, ids: Any, text: str) -> list[int]:
        try:
            values = list(ids)
        except TypeError:
            raise TextError(f"tokenizer {self.name} returned {type(ids).__name__}, not a sequence of int") from None
        for v in values:
            if isinstance(v, (bool, float, str)) or not isinstance(v, (int, np.integer)):
                raise TextError(f"tokenizer {self.name} returned {v!r} ({type(v).__name__}) for {text[:40]!r}; "
                                "ids must be integers")
            if not 0 <= int(v) < self.vocab_size:
                raise TextError(f"tokenizer {self.name} returned id {int(v)} outside [0, {self.vocab_size}) "
                                f"for {text[:40]!r}")
        return [int(v) for v in values]

    def engine(self) -> dict[str, Any]:
        found = {"text_format": TEXT_FORMAT, "tokenizer": self.name, "version": self.version,
                 "vocab_size": self.vocab_size}
        if self.tokenizer is None:
            return found
        # a tokenizer object's vocabulary and rules decide its ids: another one is another run's
        return {**found, "config": self.config, "pad_id": self.pad_id, "eos_id": self.eos_id}

    def cache_key(self) -> dict[str, Any]:
        # the source too: an edited tokenizer whose version was not raised tokenizes again
        return {**self.engine(), "source": self.source}

    def changed(self) -> bool:
        return _source_hash(userfn.import_module(self.name.partition(":")[0])) != self.source


@dataclass(frozen=True)
class LoadedTokenizer:
    """What ``package.module:function`` names, ready to tokenize.

    The name is a tokenizer function ``(text, language) -> ids`` (its vocabulary size
    ``function.vocab_size`` or ``module.VOCAB_SIZE``), or a tokenizer object with an ``encode``
    method: the object itself, or a factory (a function or class called with no arguments)
    returning it, such as a Hugging Face ``tokenizers.Tokenizer``, a ``transformers`` tokenizer or
    a codebase's own class. An object's ids are ``encode(text)`` (its ``.ids`` where it returns an
    encoding), its size, pad and EOS ids its own (:func:`tokenizer_size`, :func:`special_id`).
    """

    function: Callable[[str, str], Any]
    vocab_size: int
    version: str
    source: str  # hash of the module's source file
    tokenizer: Any = None  # the tokenizer object; None for a tokenizer function
    pad_id: int | None = None
    eos_id: int | None = None
    config: str = ""  # hash of the tokenizer object's vocabulary and rules ("" where it shows none)


# The module of each user tokenizer as load_user_tokenizer last (re)imported it, by source hash.
_LOADED_SOURCES: dict[str, str] = {}

# Special tokens looked up by name in a tokenizer that names no pad or EOS id of its own (a
# Hugging Face tokenizers.Tokenizer: its vocabulary holds them, its rules do not say which is which).
PAD_TOKENS = ("<pad>", "[PAD]", "<|pad|>")
EOS_TOKENS = ("</s>", "<eos>", "<|endoftext|>", "<|eos|>")


def load_user_tokenizer(spec: str) -> LoadedTokenizer:
    """The tokenizer ``module:function`` names; TextError if unusable. A module this process
    imported before is reloaded, unless from the same source."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise TextError(f"text front-end {spec!r} must be characters, phonemes or package.module:function")
    try:
        imported = module_name in sys.modules
        module = userfn.import_module(module_name)
        source = _source_hash(module)
        # imported before (by the user, or by this module from another source): run what the file says
        if imported and _LOADED_SOURCES.get(module_name) != source:
            module = userfn.reload(module)
    except Exception as exc:  # the user's module: any error while importing it is theirs
        raise TextError(f"tokenizer module {module_name!r} cannot be imported: {type(exc).__name__}: "
                        f"{userfn.first_line(exc)} (is it on PYTHONPATH?)") from None
    _LOADED_SOURCES[module_name] = source
    named = getattr(module, attr, None)
    told = getattr(named, "version", "")  # a function's attribute (a class's method is no version)
    version = str(getattr(module, "__version__", "") or (told if isinstance(told, (str, int)) else ""))
    tokenizer = named if _is_tokenizer(named) else _built(spec, named) if _is_factory(named) else None
    if tokenizer is None:
        if not callable(named):
            raise TextError(f"tokenizer {spec}: {module_name} has no function {attr!r}")
        declared = getattr(named, "vocab_size", getattr(module, "VOCAB_SIZE", None))
        if isinstance(declared, bool) or not isinstance(declared, int) or declared < 2:
            raise TextError(f"tokenizer {spec} has no vocabulary size: set {attr}.vocab_size or "
                            f"{module_name}.VOCAB_SIZE to an integer >= 2")
        return LoadedTokenizer(named, declared, version, source)
    size = tokenizer_size(tokenizer)
    size = getattr(module, "VOCAB_SIZE", None) if size is None else size
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 2:
        raise TextError(f"tokenizer {spec}: its {type(tokenizer).__name__} tells no vocabulary size "
                        "(get_vocab_size(), len(), vocab_size, n_vocab or get_piece_size()); set "
                        f"{module_name}.VOCAB_SIZE to an integer >= 2")
    return LoadedTokenizer(lambda text, code: encode_batch(tokenizer, [text])[0], int(size), version, source, tokenizer,
                           special_id(tokenizer, "pad", PAD_TOKENS), special_id(tokenizer, "eos", EOS_TOKENS),
                           tokenizer_config(tokenizer))


def _is_tokenizer(value: Any) -> bool:
    """Whether ``value`` is a tokenizer object itself: an instance with an ``encode`` method."""
    return not isinstance(value, type) and callable(getattr(value, "encode", None))


def _is_factory(value: Any) -> bool:
    """Whether ``value`` is called with no arguments (a factory or a class), not as ``(text, language)``."""
    if not callable(value):
        return False
    try:
        inspect.signature(value).bind()
    except TypeError:
        return False
    except ValueError:  # no signature to read (a built-in): taken as a tokenizer function
        return False
    return True


def _built(spec: str, factory: Callable[[], Any]) -> Any:
    """The tokenizer ``factory()`` returns; TextError when it fails or returns no tokenizer."""
    try:
        tokenizer = factory()
    except Exception as exc:  # the user's factory: its failure is reported as theirs
        raise TextError(f"tokenizer factory {spec} failed: {type(exc).__name__}: {userfn.first_line(exc)}") from None
    if not _is_tokenizer(tokenizer):
        raise TextError(f"tokenizer factory {spec} returned {type(tokenizer).__name__}, which has no encode method")
    return tokenizer


def encode_batch(tokenizer: Any, texts: Sequence[str]) -> list[Any]:
    """The ids of each of ``texts`` as ``tokenizer.encode(text)`` gives them (``.ids`` of an
    encoding), in one ``encode_batch`` call where the tokenizer has one and pads nothing (a Hugging
    Face tokenizer with padding on pads a batch to its longest text, one text alone to none)."""
    batch = getattr(tokenizer, "encode_batch", None)
    padding = getattr(tokenizer, "padding", None)
    made = batch(list(texts)) if callable(batch) and padding is None else [tokenizer.encode(t) for t in texts]
    return [getattr(m, "ids", m) for m in made]


def tokenizer_size(tokenizer: Any) -> Any:
    """The vocabulary size a tokenizer object tells, its added tokens included: ``get_vocab_size()``
    (Hugging Face tokenizers), ``len()`` (transformers), ``vocab_size`` (an attribute or method),
    ``n_vocab`` (tiktoken), ``get_piece_size()`` (SentencePiece); None where it tells none."""
    if callable(getattr(tokenizer, "get_vocab_size", None)):
        return tokenizer.get_vocab_size()
    if callable(getattr(type(tokenizer), "__len__", None)):
        return len(tokenizer)
    for name in ("vocab_size", "n_vocab", "get_piece_size"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return value() if callable(value) else value
    return None


def special_id(tokenizer: Any, kind: str, names: Sequence[str]) -> int | None:
    """The tokenizer's ``kind`` ("pad" or "eos") id: ``{kind}_token_id`` (transformers), ``{kind}_id``
    (an attribute or method: SentencePiece, a codebase's class; negative means none), for
    ``pad`` its padding's ``pad_id`` (Hugging Face tokenizers), else the id of the first token of
    ``names`` its vocabulary holds; None where it has none."""
    for name in (f"{kind}_token_id", f"{kind}_id"):
        value = getattr(tokenizer, name, None)
        value = value() if callable(value) else value
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return int(value) if value >= 0 else None
    padding = getattr(tokenizer, "padding", None) if kind == "pad" else None
    if isinstance(padding, dict) and isinstance(padding.get("pad_id"), int):
        return int(padding["pad_id"])
    lookup = getattr(tokenizer, "token_to_id", None)
    if callable(lookup):
        for token in names:
            found = lookup(token)
            if isinstance(found, int):
                return found
    return None


def tokenizer_config(tokenizer: Any) -> str:
    """16 hex digits over what decides a tokenizer object's ids: its serialised form (``to_str()``
    of a Hugging Face tokenizer, of a transformers one's ``backend_tokenizer``; a SentencePiece
    model's proto), else its ``get_vocab()``; "" where it shows none (then its module's source and
    version key the index's cache alone)."""
    for owner in (tokenizer, getattr(tokenizer, "backend_tokenizer", None)):
        to_str = getattr(owner, "to_str", None)
        if callable(to_str):
            return _digest(to_str())
    proto = getattr(tokenizer, "serialized_model_proto", None)
    if callable(proto):
        return _digest(proto())
    vocab = getattr(tokenizer, "get_vocab", None)
    if callable(vocab):
        return _digest(json.dumps(sorted(vocab().items(), key=repr), ensure_ascii=False, default=str))
    return ""


def _digest(data: str | bytes) -> str:
    return hashlib.sha256(data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data).hexdigest()[:16]


def _source_hash(module: Any) -> str:
    """16 hex digits over the module's source file ("" for a module without one)."""
    try:
        path = inspect.getsourcefile(module) or getattr(module, "__file__", None)
    except TypeError:  # a built-in module
        path = None
    if not path:
        return ""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError:
        return ""


def make_frontend(spec: str, digits: str = DIGITS_SPELL) -> Frontend:
    """The front-end ``text.frontend`` names; TextError when it cannot be used."""
    if digits not in (DIGITS_SPELL, DIGITS_KEEP):
        raise TextError(f"text.digits must be {DIGITS_SPELL!r} or {DIGITS_KEEP!r}, got {digits!r}")
    if spec == FRONTEND_CHARACTERS:
        return Characters(digits)
    if spec == FRONTEND_PHONEMES:
        load_espeak()
        return Phonemes(digits)
    return UserTokenizer(spec, digits)
