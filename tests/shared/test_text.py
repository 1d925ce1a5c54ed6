"""Tests for shared/text.py: normalisation per language, the front-ends and the vocabulary."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stoker.shared.text import EOS_ID, LANGUAGES, PAD_ID, Characters, TextError, Units, make_frontend, normalize

from stoker.shared.vocab import Vocabulary, load_vocabulary, save_vocabulary
from tests.shared.user_tokenizers import TOKENIZER_ENV, train_bpe, write_editable

IMPORT_TIMEOUT_S = 60  # a cold interpreter importing numpy, with a wide margin
PERSIAN = "امروز هوا آفتابی و کمی سرد است."


@pytest.mark.parametrize(
    ("raw", "code", "expected"),
    [
        ("Hello World.", "en", "hello world."),
        ("Café déjà vu, naïve Zoë!", "en", "café déjà vu, naïve zoë!"),  # accents are letters, kept
        ("\u201cQuoted,\u201d she said \u2014 it\u2019s fine\u2026", "en", '"quoted," she said - it\'s fine...'),
        ("  lots \t of\n\n   space  ", "en", "lots of space"),
        ("Room 101 costs $5", "en", "room one hundred and one costs $five"),  # digits spelled, never dropped
        ("Chapter 13,100 on the 3rd day", "en", "chapter thirteen thousand, one hundred on the third day"),
        ("It is 2.5 metres", "en", "it is two point five metres"),
        ("\ufb01ne", "en", "fine"),  # NFKC ligature
        (PERSIAN, "fa", PERSIAN),  # Persian survives as it is
        ("كتاب علي", "fa", "کتاب علی"),  # Arabic kaf and yeh become the Persian letters
        ("کتاب علی", "ar", "كتاب علي"),  # and the other way round for Arabic
        ("می\u200cروم", "fa", "می\u200cروم"),  # the zero-width non-joiner is part of Persian spelling
        ("می\u200cروم", "en", "می روم"),  # elsewhere it separates
        ("۱۲ سال", "fa", "دوازده سال"),  # Persian digits spelled in Persian
        ("12 سال", "fa", "دوازده سال"),
        ("Привет, Мир 5", "ru", "привет, мир пять"),  # Cyrillic, case folded
        ("日本 3", "ja", "日本 三"),
        ("٣ كتب", "ar", "ثلاثة كتب"),
    ],
)
def test_normalize_examples(raw: str, code: str, expected: str) -> None:
    normalized, lost = normalize(raw, code)
    assert normalized == expected and lost == ""


def test_digits_can_be_kept_and_unknown_num2words_languages_keep_them() -> None:
    assert normalize("Room 101", "en", digits="keep") == ("room 101", "")
    assert normalize("१० 10", "hi") == ("१० 10", "")  # num2words has no Hindi: symbols, not silence


def test_lost_characters_are_reported_in_order() -> None:
    normalized, lost = normalize("ok \u263a fine\x00 \U0001f600!", "en")
    assert normalized == "ok fine !" and lost == "\u263a\x00\U0001f600"
    made = Characters().units(["ok \u263a"], "en")[0]
    assert made == Units("ok", "\u263a") and made.lost_frac == pytest.approx(1 / 3)


@pytest.mark.parametrize("digits", ["spell", "keep"])
@pytest.mark.parametrize("code", ["en", "de", "fa", "hi"])
def test_unit_columns_are_normalize_of_each_text(digits: str, code: str) -> None:
    """The characters front-end's batch path (plain ASCII texts in C-level calls) is normalize()."""
    texts = ["Hello,  World!", " tab\tand\nnewline ", "back`tick", "Room 101, 3rd floor", "ctrl\x00char\x7f",
             "", "   ", "Grüße", "ﬁne \u00a0space", "ok \u263a", "سلام\u200cها", "MiXeD CaSe.", "1,000 ways"] * 2
    units, lost = make_frontend("characters", digits).unit_columns(texts, code)
    assert list(zip(units, lost)) == [normalize(t, code, digits) for t in texts]
    assert make_frontend("characters", digits).units(texts, code) == [Units(u, x) for u, x in zip(units, lost)]


@pytest.mark.parametrize("digits", ["spell", "keep"])
def test_a_column_of_spaced_ascii_texts_is_normalize_of_each(digits: str) -> None:
    """A column whose texts are all printable ASCII and spaces is normalised as one string: each
    text as normalize() makes it, spaces at either end, runs of them and empty texts included."""
    rng = random.Random(7)
    alphabet = "ab Z `'.,-?" + ("" if digits == "spell" else "09")
    texts = ["", " ", "  lead", "trail  ", "in   between", "`quoted`", " ", "A", ""]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(12))) for _ in range(300)]
    units, lost = make_frontend("characters", digits).unit_columns(texts, "en")
    assert list(zip(units, lost)) == [normalize(t, "en", digits) for t in texts]
    assert make_frontend("characters", digits).unit_columns([], "en") == ([], [])


@pytest.mark.parametrize("name", ["characters", "tests.shared.user_tokenizers:bytes_tokenizer"])
def test_counts_are_count_of_each(name: str) -> None:
    """The index's token counts of a column of units (in C for the built-in front-ends) are count() of each."""
    frontend = make_frontend(name)
    units = [u.units for u in frontend.units(["Hello, World!", "", "a", "Grüße", "سلام"], "en")]
    assert frontend.counts(units).tolist() == [frontend.count(u) for u in units]
    expected = [14, 0, 2] if name == "characters" else [13, 0, 1]  # symbols and EOS; a tokenizer's ids alone
    assert frontend.counts(units).tolist()[:3] == expected


def test_unknown_language_is_one_clear_error() -> None:
    with pytest.raises(TextError, match="unknown language code 'xx'.*known: .*fa"):
        normalize("hi", "xx")
    assert {"en", "fa", "ar"} <= set(LANGUAGES)


def test_two_persian_sentences_get_different_tokens() -> None:
    frontend = Characters()
    texts = [PERSIAN, "فردا باران می‌بارد."]
    units = [u.units for u in frontend.units(texts, "fa")]
    vocab = Vocabulary.build(frontend, units, ["fa"], ["default"])
    first, second = (vocab.encode(u) for u in units)
    assert first.tolist() != second.tolist()
    assert vocab.decode(first) == PERSIAN and vocab.decode(second) == units[1]
    assert first[-1] == EOS_ID and PAD_ID not in first.tolist()
    # the vocabulary is the Persian inventory, after <pad> and <eos>; the texts hold some of it
    assert vocab.symbols[2:] == tuple(frontend.inventory(["fa"])) and vocab.size == len(vocab.symbols)
    assert set("".join(units)) < set(vocab.symbols)


def test_vocabulary_round_trip_and_fingerprint(tmp_path: Path) -> None:
    frontend = Characters()
    vocab = Vocabulary.build(frontend, ["hello", "سلام"], ["fa", "en", "fa"], ["b", "a"])
    assert vocab.languages == ("en", "fa") and vocab.speakers == ("a", "b")  # sorted: stable ids
    assert vocab.language_id("fa") == 1 and vocab.speaker_id("b") == 1
    save_vocabulary(vocab, tmp_path / "vocab.json")
    again = load_vocabulary(tmp_path / "vocab.json")
    assert again == vocab and again.fingerprint == vocab.fingerprint
    assert again.encode("سلام").tolist() == vocab.encode("سلام").tolist()
    other = Vocabulary.build(frontend, ["hello"], ["en"], ["a"])
    assert other.fingerprint != vocab.fingerprint
    assert vocab.missing("hello\u06a4") == "\u06a4"  # veh: Arabic script, not a Persian letter
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vocab.decode([vocab.size])
    (tmp_path / "bad.json").write_text('{"frontend": "characters"}', encoding="utf-8")
    with pytest.raises(TextError, match="not a stoker vocabulary"):
        load_vocabulary(tmp_path / "bad.json")
    with pytest.raises(TextError, match="not found"):
        load_vocabulary(tmp_path / "none.json")


def test_engine_change_is_named() -> None:
    frontend = Characters()
    vocab = Vocabulary.build(frontend, ["a"])
    assert vocab.check_engine(frontend) == ""
    changed = Vocabulary.from_state_dict({**vocab.state_dict(), "engine": {**vocab.engine, "num2words": "0.0.1"}})
    assert "num2words '0.0.1'" in changed.check_engine(frontend)
    assert "not phonemes" not in changed.check_engine(frontend)
    other = Vocabulary.from_state_dict({**vocab.state_dict(), "frontend": "phonemes"})
    assert other.check_engine(frontend) == "the run used the phonemes front-end, not characters"


def test_phonemes_front_end_persian_and_english() -> None:
    frontend = make_frontend("phonemes")
    fa = frontend.units([PERSIAN, "سلام، خوبی؟"], "fa")
    assert fa[0].units.startswith("emrˈuz") and fa[0].lost == ""
    # Arabic-script punctuation is kept as punctuation, not read out as a word
    assert fa[1].units.endswith("؟") and "،" in fa[1].units
    en = frontend.units(["Chapter 3."], "en")[0].units
    assert "θɹˈiː" in en and en.endswith(".")  # the digit was spelled, then phonemized
    assert frontend.units([PERSIAN], "fa") == fa[:1]  # the same output twice
    vocab = Vocabulary.build(frontend, [u.units for u in fa])
    assert "ˈ" in vocab.symbols and vocab.decode(vocab.encode(fa[0].units)) == fa[0].units


def test_user_tokenizer() -> None:
    frontend = make_frontend("tests.shared.user_tokenizers:bytes_tokenizer")
    made = frontend.units(["hé"], "fa")[0]
    assert made.units == "105 196 170"  # ids + 1 of the UTF-8 bytes, as the tokenizer returns them
    vocab = Vocabulary.build(frontend, [made.units])
    assert vocab.size == 257 and vocab.is_user
    assert vocab.encode(made.units).tolist() == [105, 196, 170] and frontend.count(made.units) == 3
    for name, message in [("no_such_module_xyz:f", "cannot be imported: ModuleNotFoundError"),
                          ("tests.shared.user_tokenizers:missing", "has no function 'missing'"),
                          ("tests.shared.user_tokenizers:no_size", "has no vocabulary size"),
                          ("tests.shared.user_tokenizers:broken_import_target", "has no function")]:
        with pytest.raises(TextError, match=message):
            make_frontend(name)
    with pytest.raises(TextError, match="returned 1.5 \\(float\\).*ids must be integers"):
        make_frontend("tests.shared.user_tokenizers:floats").units(["a"], "en")
    with pytest.raises(TextError, match="failed on 'boom': RuntimeError: no"):
        make_frontend("tests.shared.user_tokenizers:raises").units(["boom"], "en")
    with pytest.raises(TextError, match="outside \\[0, 4\\)"):
        make_frontend("tests.shared.user_tokenizers:too_large").units(["a"], "en")


DEMO_TEXTS = [line.split("|")[2] for line in
              (Path(__file__).resolve().parents[2] / "data" / "demo" / "metadata.csv").read_text().splitlines()]
HF = "tests.shared.user_tokenizers:hf_tokenizer"


def test_a_hugging_face_tokenizer_s_ids_size_pad_and_eos_are_its_own(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A factory returning a tokenizers.Tokenizer: each text's units are encode(text).ids, nothing
    re-mapped or appended; the vocabulary's size, pad and EOS ids are the tokenizer's, kept by vocab.json."""
    pytest.importorskip("tokenizers")
    tokenizer = train_bpe(DEMO_TEXTS, tmp_path / "bpe.json")
    monkeypatch.setenv(TOKENIZER_ENV, str(tmp_path / "bpe.json"))
    frontend = make_frontend(HF)
    made = frontend.units(DEMO_TEXTS, "en")
    expected = [tokenizer.encode(t).ids for t in DEMO_TEXTS]
    assert [[int(i) for i in m.units.split()] for m in made] == expected and all(not m.lost for m in made)
    assert frontend.counts([m.units for m in made]).tolist() == [len(ids) for ids in expected]
    vocab = Vocabulary.build(frontend, [m.units for m in made], ["en"])
    assert vocab.size == tokenizer.get_vocab_size() == 200 and vocab.is_user
    assert (vocab.pad_id, vocab.eos_id) == (tokenizer.token_to_id("<pad>"), tokenizer.token_to_id("</s>")) == (0, 1)
    assert all(vocab.encode(m.units).tolist() == ids for m, ids in zip(made, expected))
    save_vocabulary(vocab, tmp_path / "vocab.json")
    saved = load_vocabulary(tmp_path / "vocab.json")
    assert saved == vocab and (saved.pad_id, saved.eos_id) == (0, 1) and saved.check_engine(frontend) == ""
    # another tokenizer at the same file: another vocabulary, refused by the run's, another cache key
    train_bpe(DEMO_TEXTS, tmp_path / "bpe.json", vocab_size=150)
    other = make_frontend(HF)
    assert other.vocab_size == 150 and other.cache_key() != frontend.cache_key()
    assert "config" in saved.check_engine(other) and "vocab_size 200 -> 150" in saved.check_engine(other)
    # padding switched on in the tokenizer: a batch of texts is still each text's own encode
    tokenizer.enable_padding(pad_id=0, pad_token="<pad>")
    tokenizer.save(str(tmp_path / "bpe.json"))
    padded = make_frontend(HF)
    assert [[int(i) for i in m.units.split()] for m in padded.units(DEMO_TEXTS[:4], "en")] == expected[:4]


def test_a_codebase_class_or_object_is_used_through_its_own_encode() -> None:
    for name in ("CodebaseTokenizer", "codebase_instance"):  # the class (called as a factory) or the object
        frontend = make_frontend(f"tests.shared.user_tokenizers:{name}")
        assert frontend.units(["ab"], "fr")[0].units == "99 100 1" and frontend.count("99 100 1") == 3
        vocab = Vocabulary.build(frontend, ["99 100 1"])
        assert (vocab.size, vocab.pad_id, vocab.eos_id) == (130, 0, 1)
    sized = Vocabulary.build(make_frontend("tests.shared.user_tokenizers:Sized"), [])
    assert (sized.size, sized.pad_id, sized.eos_id) == (10, None, None)  # none of its own: none said
    function = Vocabulary.build(make_frontend("tests.shared.user_tokenizers:bytes_tokenizer"), [])
    assert (function.pad_id, function.eos_id) == (None, None)
    assert (Vocabulary.build(Characters(), ["a"]).pad_id, Vocabulary.build(Characters(), ["a"]).eos_id) == (PAD_ID,
                                                                                                           EOS_ID)
    for name, message in [("Unsized", "its Unsized tells no vocabulary size"),
                          ("not_a_tokenizer", "returned int, which has no encode method"),
                          ("failing_factory", "factory .*failing_factory failed: OSError: tokenizer.json not found")]:
        with pytest.raises(TextError, match=message):
            make_frontend(f"tests.shared.user_tokenizers:{name}")


def test_text_module_does_not_import_tensorflow() -> None:
    code = "import stoker.shared.text, sys; assert 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=IMPORT_TIMEOUT_S,
                   cwd=Path(__file__).resolve().parents[2])


def test_encode_is_the_vocabulary_order() -> None:
    vocab = Vocabulary.build(Characters(), ["ba"], ["en"])
    assert vocab.symbols[:2] == ("<pad>", "<eos>") and list(vocab.symbols[2:]) == sorted(vocab.symbols[2:])
    a = vocab.symbols.index("a")
    assert vocab.symbols[a + 1] == "b" and vocab.encode("ab").tolist() == [a, a + 1, EOS_ID]
    assert vocab.encode("ab").dtype == np.int32
    row = np.concatenate([vocab.encode("ab"), np.zeros(3, np.int32)])
    assert vocab.decode(row) == "ab"


def test_the_vocabulary_names_its_pad_and_eos_ids_as_a_row_holds_them() -> None:
    vocab = Vocabulary.build(Characters(), ["ba"], ["en"])
    row = vocab.encode("ab")
    assert (vocab.pad_id, vocab.eos_id) == (0, 1) and row[-1] == vocab.eos_id
    assert vocab.symbols[vocab.pad_id] == "<pad>" and vocab.symbols[vocab.eos_id] == "<eos>"
    user = Vocabulary.build(make_frontend("tests.shared.user_tokenizers:bytes_tokenizer"), [], ["en"])
    assert (user.pad_id, user.eos_id, user.symbols) == (None, None, ())  # a tokenizer function: its ids its own, no pad or EOS of its own


def test_ascii_shortcut_gives_what_the_general_path_gives() -> None:
    """normalize() takes a C-level path for ASCII text; it must not differ from the per-character one."""
    import random
    import string

    from stoker.shared import text as text_mod

    rng = random.Random(0)
    alphabet = string.printable + "\x00\x01\x7f`"
    english = text_mod.language("en")
    for _ in range(2000):
        raw = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        general, lost = text_mod._normalize_chars(raw, english)
        # a non-ASCII character that normalisation removes sends the text down the general path
        assert normalize(raw, "en") == normalize(raw + "\u0640", "en"), repr(raw)
        assert normalize(raw, "en")[1] == lost
        assert general.isascii()


def test_phonemes_without_phonemizer_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ["phonemizer", *(m for m in sys.modules if m.startswith("phonemizer."))]:
        monkeypatch.setitem(sys.modules, name, None)  # as on a host where it is not installed
    with pytest.raises(TextError, match="the phonemes front-end needs phonemizer and espeakng-loader \\(phonemizer is "
                                        "not installed\\): python -m pip install -e ."):
        make_frontend("phonemes")


def test_numbers_never_break_normalisation() -> None:
    """Any digit string in any language: spelled, or kept as digits (codes, numbers num2words cannot say)."""
    import random

    rng = random.Random(1)
    assert normalize("1" * 40, "en") == ("1" * 40, "")  # an id, not a quantity
    assert normalize("3.14159265358979323846", "fa")[0] == "3.14159265358979323846"
    for code in LANGUAGES:
        for _ in range(30):
            digits = "".join(rng.choice("0123456789.,") for _ in range(rng.randint(1, 20)))
            normalized, lost = normalize(f"x {digits} y", code)
            assert lost == "" and normalized


def test_a_text_the_phonemizer_fails_on_is_lost_whole_and_the_others_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    frontend = make_frontend("phonemes")
    backend = frontend._backend("en")
    real = backend.phonemize

    def fragile(texts, **kw):
        if any("boom" in t for t in texts):
            raise RuntimeError("espeak failed")
        return real(texts, **kw)

    monkeypatch.setattr(backend, "phonemize", fragile)
    made = frontend.units(["hello", "boom now", "world"], "en")
    assert made[0] == frontend.units(["hello"], "en")[0] and made[2].units
    assert made[1] == Units("", "boomnow") and made[1].lost_frac == 1.0


# Sentences in a few languages with their own letters, for the inventories' completeness.
SENTENCES = {
    "en": ["The quick brown fox jumps over the lazy dog; isn't it?", "Judge, my vow: 1984 boxes (of jam)!"],
    "fa": [PERSIAN, "ژاله، آیا نامه‌ی مؤسسه را خواندی؟", "بچه‌ها در حیاط فوتبال بازی می‌کنند.",
           "قیمت این کالا ۲۵٪ گران‌تر شده است.", "او «شاهنامه» را به‌خوبی می‌شناسد."],
    "ar": ["ذهبَ الطالبُ إلى المدرسةِ صباحاً.", "هل قرأتَ هذه الرسالة؟ إنّها مهمّة جدًّا."],
    "de": ["Größere Übungen für Mädchen und Jungen.", "Der Fuß ist weiß, nicht süß."],
    "fr": ["Où est la bibliothèque ? Ça dépend, garçon.", "Noël était à l'hôtel près du lac."],
    "es": ["¿Dónde está el niño? ¡Aquí, señor!", "La pingüina comió pequeñas frutas."],
    "ru": ["Съешь же ещё этих мягких французских булок, да выпей чаю.", "Ёлка стоит в углу."],
    "tr": ["İstanbul'da güzel bir gün, değil mi?", "Çocuklar şarkı söylüyor ve ağaçlara tırmanıyor."],
    "hi": ["मैं आज बाज़ार जा रहा हूँ।", "क्या आप हिंदी बोलते हैं?"],
}


def _pseudo_words(code: str, count: int, seed: int) -> list[str]:
    """Texts of random words of the language's letters: they exercise its letter-to-sound rules."""
    import random

    rng = random.Random(seed)
    letters = [ch for ch in (LANGUAGES[code].alphabet or "") + "abcdefghijklmnopqrstuvwxyz" if ch.isalpha()]
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 9))) for _ in range(count)]
    return [" ".join(words[n:n + 10]) for n in range(0, count, 10)]


@pytest.mark.parametrize("code", sorted(LANGUAGES))
def test_the_inventories_hold_every_symbol_of_a_varied_text(code: str) -> None:
    """Sentences, spelled numbers and random words of the language's letters: every symbol the
    characters (where the language lists its alphabet) or phonemes front-end makes of them is
    in that front-end's inventory."""
    from num2words import num2words

    numbers = [str(n) for n in range(0, 2000, 37)]
    texts = SENTENCES.get(code, []) + _pseudo_words(code, 600, seed=len(code)) + [" ".join(numbers)]
    if LANGUAGES[code].num2words:
        texts.append(" ".join(num2words(int(n), lang=LANGUAGES[code].num2words) for n in numbers))
    listed = [Characters()] if LANGUAGES[code].alphabet is not None else []
    for frontend in (*listed, make_frontend("phonemes"), make_frontend("phonemes", "keep")):
        made = frontend.units(texts, code)
        assert not any(u.lost for u in made)
        outside = set("".join(u.units for u in made)) - set(frontend.inventory([code]))
        assert not outside, f"{frontend.name} {code}: {sorted(outside)}"


def test_a_sentence_with_symbols_no_training_text_had_encodes() -> None:
    """A vocabulary built from a few texts encodes a new Persian sentence whose phonemes
    (an English word read in English: "ɐ") and letters the texts never held."""
    new = "این کتاب about ژاله، مؤسسه و گل‌ها است؟"
    for frontend in (make_frontend("phonemes"), Characters()):
        training = [u.units for u in frontend.units([PERSIAN, "فردا باران می‌بارد."], "fa")]
        vocab = Vocabulary.build(frontend, training, ["fa"], ["default"])
        made = frontend.units([new], "fa")[0]
        unseen = set(made.units) - set("".join(training))
        assert made.lost == "" and vocab.missing(made.units) == ""
        assert vocab.decode(vocab.encode(made.units)) == made.units
        if frontend.name == "phonemes":
            assert {"ɐ", "؟", "،"} <= unseen, made.units
        else:
            assert {"ژ", "ؤ", "،", "؟"} <= unseen


def test_vocabulary_ids_are_the_same_whatever_the_texts() -> None:
    """Two runs of the same languages with different texts number every symbol alike."""
    first = ["امروز هوا آفتابی است.", "Hello there!"]
    second = ["کتاب را روی میز گذاشتم.", "Where is the big red ball?", "Zebra, quiz."]
    for frontend in (Characters(), make_frontend("phonemes")):
        vocabs = [Vocabulary.build(frontend, [u.units for u in frontend.units(texts, "fa")], ["fa", "en"], ["a"])
                  for texts in (first, second)]
        assert vocabs[0].symbols == vocabs[1].symbols and vocabs[0].fingerprint == vocabs[1].fingerprint
    # a character outside the inventory (a language with no listed alphabet) comes after it
    japanese = Vocabulary.build(Characters(), ["日本", "ok"], ["ja"])
    assert japanese.symbols[-2:] == ("日", "本")
    assert japanese.symbols[:-2] == Vocabulary.build(Characters(), ["ok"], ["ja"]).symbols


def test_an_old_vocabulary_keeps_its_ids(tmp_path: Path) -> None:
    """A vocab.json of a run made when the vocabulary was the texts' symbols loads with its ids."""
    import json

    frontend = Characters()
    old = {"frontend": "characters", "symbols": ["<pad>", "<eos>", " ", "b", "a"], "size": 5,
           "engine": frontend.engine(), "languages": ["en"], "speakers": ["default"]}
    (tmp_path / "vocab.json").write_text(json.dumps(old), encoding="utf-8")
    vocab = load_vocabulary(tmp_path / "vocab.json")
    assert vocab.symbols == tuple(old["symbols"]) and vocab.check_engine(frontend) == ""
    assert vocab.encode("ab a").tolist() == [4, 3, 2, 4, EOS_ID] and vocab.missing("abc") == "c"


def test_a_user_tokenizer_s_cache_key_follows_its_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Editing a tokenizer without raising its version changes its cache key and its ids, not its
    engine (a run's vocabulary, which names the version, keeps loading)."""
    import importlib

    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"tokenizer_{tmp_path.name}"
    before = make_frontend(write_editable(tmp_path, name, 2))
    write_editable(tmp_path, name, 30)
    assert before.changed()
    after = make_frontend(f"{name}:ids")
    assert after.engine() == before.engine() and after.cache_key() != before.cache_key()
    assert before.units(["a"], "en")[0].units == "99" and after.units(["a"], "en")[0].units == "127"
    assert not after.changed()
    # a module the user imported before stoker did, then edited: stoker runs the edited code
    other = f"{name}_user"
    importlib.import_module(write_editable(tmp_path, other, 2).partition(":")[0])
    write_editable(tmp_path, other, 40)
    assert make_frontend(f"{other}:ids").units(["a"], "en")[0].units == "137"
