"""Speech for multilingual test datasets, from the espeak-ng the phonemes front-end uses.

The ``espeakng-loader`` wheel (a stoker dependency) ships libespeak-ng and its data; this
module drives the library through ctypes in synchronous mode and collects the 16-bit
samples its callback hands over. No espeak-ng program or system package is needed.

Determinism: espeak-ng keeps state from one utterance to the next that no API resets
(the pitch-flutter phase is a function-local ``static`` in wavegen.c, and
``espeak_Initialize`` seeds its noise generator with ``time(NULL)``), so a library
loaded once and reused speaks the same text a little differently each time: lengths
differ by up to a few hundred samples, even after ``espeak_Terminate`` and a new
``espeak_Initialize``. So the library file is copied once per process into a private
temporary directory (module-level, lazily), and each utterance loads that copy afresh,
initialises it, seeds the noise generator with a constant, speaks and unloads it
(``dlclose``): the same text and voice give the same samples, in any order and in any
process. That costs about 5 ms a clip. The private copy keeps the fresh load fresh: a
handle someone else holds on the wheel's own file (phonemizer loads its own copies)
would keep the library, and its state, resident.

Dataset factories write small LJSpeech-style directories (or a manifest) and return
``{id: (text, speaker, language)}`` so tests can check every clip's values.
"""

from __future__ import annotations

import _ctypes
import ctypes
import json
import locale
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np
import soundfile
import soxr

from stoker.shared.dataset.types import DEFAULT_SPEAKER

RATE_HZ = 22050  # espeak-ng's rate and FeaturesConfig's default: no resampling in the tests' producers

# espeak-ng's speak_lib.h (src/include/espeak-ng/speak_lib.h) and espeak_ng.h
AUDIO_OUTPUT_SYNCHRONOUS = 2  # samples reach the callback before espeak_Synth returns; no thread
POS_CHARACTER = 1  # espeak_POSITION_TYPE: the start position counts characters
ESPEAK_CHARS_UTF8 = 1  # the text is UTF-8 (Persian script)
SYNTH_FLAGS = ESPEAK_CHARS_UTF8  # without espeakENDPAUSE (0x1000): no sentence pause after the text, short clips
ESPEAK_INITIALIZE_DONT_EXIT = 0x8000  # a missing data directory returns 0, instead of exit(1) of the test process
EE_OK = 0  # espeak_ERROR / espeak_ng_STATUS success
CALLBACK_CONTINUE = 0  # the synth callback's "go on" (1 aborts the synthesis)
BUFFER_MS = 500  # the callback's chunk length; fewer calls into Python per clip
NOISE_SEED = 0  # espeak_Initialize seeds with time(NULL); a constant keeps noise (breath, Klatt) repeatable
INT16_FULL_SCALE = 32768.0  # int16 samples to float in [-1, 1)
INT16_MAX_FLOAT = 32767 / INT16_FULL_SCALE  # the largest float a 16-bit WAV holds without wrapping

VOICES = {"fa": "fa", "en": "en-us"}  # language code -> espeak-ng voice

PERSIAN = (
    "امروز هوا آفتابی و کمی سرد است.",
    "فردا باران می‌بارد.",
    "کتاب را روی میز گذاشتم.",
    "او هر روز به مدرسه می‌رود.",
    "این شهر خیابان‌های زیبایی دارد.",
    "ما شب‌ها کنار آتش قصه می‌گوییم.",
    "دوستم از سفر برگشته است.",
    "صدای پرندگان در باغ می‌پیچد.",
    "چای داغ در فنجان آبی است.",
    "قطار ساعت هشت حرکت می‌کند.",
)
ENGLISH_DIGITS = (
    "Chapter 3 begins on page 42.",
    "It costs 15 dollars and 50 cents.",
    "The train leaves at 8 in the morning.",
    "We counted 1,200 birds in 2 hours.",
    "Room 101 is on the 3rd floor.",
    "She ran 5 miles before breakfast.",
    "There are 7 days in a week.",
    "He was born in 1984.",
)
ENGLISH = (
    "The weather is sunny and a little cold today.",
    "Tomorrow it will rain.",
    "I put the book on the table.",
    "Birds sing in the garden.",
)

Description = dict[str, tuple[str, str, str]]  # id -> (text, speaker, language)


class _EventId(ctypes.Union):
    """The ``id`` union of ``espeak_EVENT``."""

    _fields_ = [("number", ctypes.c_int),  # WORD and SENTENCE events
                ("name", ctypes.c_char_p),  # MARK and PLAY events (UTF-8)
                ("string", ctypes.c_char * 8)]  # PHONEME events


class EspeakEvent(ctypes.Structure):
    """``espeak_EVENT`` of speak_lib.h."""

    _fields_ = [("type", ctypes.c_int),  # espeak_EVENT_TYPE
                ("unique_identifier", ctypes.c_uint),
                ("text_position", ctypes.c_int),
                ("length", ctypes.c_int),
                ("audio_position", ctypes.c_int),
                ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p),
                ("id", _EventId)]


# t_espeak_callback: int SynthCallback(short *wav, int numsamples, espeak_EVENT *events)
SynthCallback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int,
                                 ctypes.POINTER(EspeakEvent))

_LOCK = threading.Lock()  # one loaded instance at a time: a second load of the copy would share its state
_COPY: tempfile.TemporaryDirectory | None = None  # the process's private copy of the library (removed at exit)
_LIBRARY_NAME = "libespeak-ng.so"


def _private_library() -> Path:
    """The process's own copy of the wheel's libespeak-ng, made on first use."""
    global _COPY
    if _COPY is None:
        import espeakng_loader

        _COPY = tempfile.TemporaryDirectory(prefix="stoker-espeak-")
        shutil.copy(espeakng_loader.get_library_path(), Path(_COPY.name) / _LIBRARY_NAME)
    return Path(_COPY.name) / _LIBRARY_NAME


def _declare(lib: ctypes.CDLL) -> None:
    """The prototypes of the functions used, as speak_lib.h and espeak_ng.h declare them."""
    lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.espeak_Initialize.restype = ctypes.c_int
    lib.espeak_SetSynthCallback.argtypes = [SynthCallback]
    lib.espeak_SetSynthCallback.restype = None
    lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    lib.espeak_SetVoiceByName.restype = ctypes.c_int
    lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
                                 ctypes.c_uint, ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p]
    lib.espeak_Synth.restype = ctypes.c_int
    lib.espeak_Synchronize.argtypes = []
    lib.espeak_Synchronize.restype = ctypes.c_int
    lib.espeak_Terminate.argtypes = []
    lib.espeak_Terminate.restype = ctypes.c_int
    lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
    lib.espeak_ng_SetRandSeed.restype = ctypes.c_int


def _synthesize(lib: ctypes.CDLL, text: str, voice: str) -> tuple[np.ndarray, int]:
    """int16 samples and rate of ``text`` from a freshly loaded ``lib``, terminated afterwards."""
    import espeakng_loader

    chunks: list[np.ndarray] = []

    def collect(wav: ctypes._Pointer, count: int, events: ctypes._Pointer) -> int:
        if wav and count > 0:
            chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
        return CALLBACK_CONTINUE

    callback = SynthCallback(collect)  # referenced until Terminate: the library holds the pointer
    rate = lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, BUFFER_MS, espeakng_loader.get_data_path().encode(),
                                 ESPEAK_INITIALIZE_DONT_EXIT)
    try:
        if rate <= 0:
            raise RuntimeError(f"espeak-ng did not initialise with the data at {espeakng_loader.get_data_path()} "
                               f"(returned {rate})")
        lib.espeak_ng_SetRandSeed(NOISE_SEED)
        lib.espeak_SetSynthCallback(callback)
        if lib.espeak_SetVoiceByName(voice.encode("utf-8")) != EE_OK:
            raise RuntimeError(f"espeak-ng has no voice {voice!r}")
        data = text.encode("utf-8")
        status = lib.espeak_Synth(data, len(data) + 1, 0, POS_CHARACTER, 0, SYNTH_FLAGS, None, None)
        if status != EE_OK or lib.espeak_Synchronize() != EE_OK:
            raise RuntimeError(f"espeak-ng could not speak {text!r} with voice {voice!r} (status {status})")
    finally:
        lib.espeak_Terminate()
    samples = np.concatenate(chunks) if chunks else np.zeros(0, np.int16)
    return samples, rate


def speak(text: str, voice: str) -> tuple[np.ndarray, int]:
    """``(float32 mono samples in [-1, 1], sample rate)`` of ``text`` spoken by espeak-ng ``voice``.

    ``voice`` is an espeak-ng voice name ("fa", "en-us", "en"); an unknown one raises
    RuntimeError. The same text and voice always give the same samples.
    """
    with _LOCK:
        lib = ctypes.CDLL(str(_private_library()))
        ctype_locale = locale.setlocale(locale.LC_CTYPE)  # espeak_Initialize sets LC_CTYPE for itself
        try:
            _declare(lib)
            samples, rate = _synthesize(lib, text, voice)
        finally:
            locale.setlocale(locale.LC_CTYPE, ctype_locale)
            _ctypes.dlclose(lib._handle)  # unloaded: the next utterance starts from a fresh state
    return samples.astype(np.float32) / INT16_FULL_SCALE, rate


def write_clip(path: Path, text: str, voice: str, rate_hz: int = RATE_HZ) -> float:
    """Speak ``text`` into a 16-bit PCM WAV at ``rate_hz``; return its duration in seconds."""
    audio, rate = speak(text, voice)
    if rate != rate_hz:
        audio = np.clip(soxr.resample(audio, rate, rate_hz), -1.0, INT16_MAX_FLOAT)  # resampling can overshoot
    path.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(str(path), audio, rate_hz, subtype="PCM_16")
    return len(audio) / rate_hz


def _write_lines(path: Path, lines: list[str]) -> None:
    """UTF-8 lines ending in ``\\n`` on every platform."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write("".join(line + "\n" for line in lines))


def _write_dataset(root: Path, metadata_file: str, prefix: str, sentences: tuple[str, ...], language: str,
                   n: int, offset: int = 0) -> Description:
    """``n`` clips of one language, ``id|text|text`` lines, sentences taken in turn from ``offset``."""
    made, lines = {}, []
    for i in range(offset, offset + n):
        sample_id, text = f"{prefix}-{i + 1:04d}", sentences[i % len(sentences)]
        write_clip(root / "wavs" / f"{sample_id}.wav", text, VOICES[language])
        lines.append(f"{sample_id}|{text}|{text}")
        made[sample_id] = (text, DEFAULT_SPEAKER, language)
    _write_lines(root / metadata_file, lines)
    return made


def make_persian_dataset(root: Path, n: int = 8) -> Description:
    """``n`` Persian clips, ``id|text|normalized_text`` lines in ``metadata.csv`` (no language
    column: pass ``--language fa``); the speaker is the loader's default."""
    return _write_dataset(root, "metadata.csv", "FA", PERSIAN, "fa", n)


def make_english_digits_dataset(root: Path, n: int = 8) -> Description:
    """``n`` English clips whose texts have digits, ``id|text|normalized_text`` lines."""
    return _write_dataset(root, "metadata.csv", "EN", ENGLISH_DIGITS, "en", n)


def _mixed_rows(n: int) -> list[tuple[str, str, str, str]]:
    """(id, text, speaker, language): Persian and English in turn (Persian first, so an odd
    ``n`` has one more Persian clip), two Persian speakers, one English."""
    rows = []
    for i in range(n):
        if i % 2 == 0:
            rows.append((f"MIX-{i + 1:04d}", PERSIAN[(i // 2) % len(PERSIAN)], f"spk_fa{1 + (i // 2) % 2}", "fa"))
        else:
            rows.append((f"MIX-{i + 1:04d}", ENGLISH[(i // 2) % len(ENGLISH)], "spk_en1", "en"))
    return rows


def make_mixed_dataset(root: Path, n: int = 8) -> Description:
    """``n`` clips, half Persian, half English: ``id|text|normalized_text|speaker|language`` lines."""
    made, lines = {}, []
    for sample_id, text, speaker, language in _mixed_rows(n):
        write_clip(root / "wavs" / f"{sample_id}.wav", text, VOICES[language])
        lines.append(f"{sample_id}|{text}|{text}|{speaker}|{language}")
        made[sample_id] = (text, speaker, language)
    _write_lines(root / "metadata.csv", lines)
    return made


def make_manifest_dataset(root: Path, n: int = 6) -> Description:
    """A NeMo/Coqui-style ``manifest.jsonl``, mixed Persian and English: one JSON object a line
    with ``audio_filepath`` (``audio/ID.wav``, relative to ``root``), ``text``, ``duration``
    (seconds, of the written file), ``speaker`` and ``language``."""
    made, lines = {}, []
    for sample_id, text, speaker, language in _mixed_rows(n):
        relative = f"audio/{sample_id}.wav"
        duration = write_clip(root / relative, text, VOICES[language])
        lines.append(json.dumps({"audio_filepath": relative, "text": text, "duration": round(duration, 6),
                                 "speaker": speaker, "language": language}, ensure_ascii=False))
        made[sample_id] = (text, speaker, language)
    _write_lines(root / "manifest.jsonl", lines)
    return made


def make_train_eval_dataset(root: Path, n_train: int = 6, n_eval: int = 2) -> tuple[Description, Description]:
    """``metadata_train.csv`` and ``metadata_eval.csv`` (``id|text|normalized_text``, English
    with digits; different sentences while ``n_train + n_eval`` <= 8) sharing ``wavs/``;
    returns (train, eval)."""
    return (_write_dataset(root, "metadata_train.csv", "TE", ENGLISH_DIGITS, "en", n_train),
            _write_dataset(root, "metadata_eval.csv", "TE", ENGLISH_DIGITS, "en", n_eval, offset=n_train))
