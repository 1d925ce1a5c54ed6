"""Speech for multilingual test datasets, from the espeak-ng the phonemes front-end uses.

The ``espeakng-loader`` wheel (a stoker dependency) ships libespeak-ng and its data;
this module drives the library through ctypes in synchronous mode and collects the
samples its callback hands over. A fresh process gives the same samples for the same
calls; within one process espeak-ng carries state from one utterance to the next, so
speaking a text again can differ by a few samples (tests compare texts and ids, not
waveforms across calls).

Dataset factories write small LJSpeech-style directories (or a manifest) and return
``{id: (text, speaker, language)}`` so tests can check every clip's values.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import soundfile

RATE_HZ = 22050  # FeaturesConfig's default rate: no resampling in the tests' producers
# espeak-ng's speak_lib.h
AUDIO_OUTPUT_SYNCHRONOUS = 2
POS_CHARACTER = 1
ESPEAK_CHARS_UTF8 = 1
EE_OK = 0
BUFFER_MS = 500  # the callback's chunk length

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

_ENGINE: "_Espeak | None" = None


class _Espeak:
    def __init__(self) -> None:
        import espeakng_loader

        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        self.lib.espeak_Initialize.restype = ctypes.c_int
        self.lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        self.chunks: list[np.ndarray] = []
        callback_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)

        def collect(wav: ctypes._Pointer, count: int, events: int) -> int:
            if wav and count > 0:
                self.chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
            return 0  # go on

        self._callback = callback_type(collect)  # kept: the library holds the pointer
        self.rate = self.lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, BUFFER_MS,
                                               espeakng_loader.get_data_path().encode(), 0)
        if self.rate <= 0:
            raise RuntimeError(f"espeak-ng did not initialise ({self.rate})")
        self.lib.espeak_SetSynthCallback(self._callback)
        self.lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        self.lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
                                          ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]

    def speak(self, text: str, voice: str) -> np.ndarray:
        if self.lib.espeak_SetVoiceByName(voice.encode()) != EE_OK:
            raise RuntimeError(f"espeak-ng has no voice {voice!r}")
        self.chunks = []
        data = text.encode("utf-8") + b"\0"
        if self.lib.espeak_Synth(data, len(data), 0, POS_CHARACTER, 0, ESPEAK_CHARS_UTF8, None, None) != EE_OK:
            raise RuntimeError(f"espeak-ng could not speak {text!r}")
        self.lib.espeak_Synchronize()
        samples = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.int16)
        return samples.astype(np.float32) / 32768.0


def speak(text: str, voice: str) -> tuple[np.ndarray, int]:
    """``(float32 mono samples in [-1, 1], sample rate)`` of ``text`` spoken by espeak-ng ``voice``."""
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = _Espeak()
    audio = _ENGINE.speak(text, voice)
    return audio, _ENGINE.rate


def write_clip(path: Path, text: str, voice: str, rate_hz: int = RATE_HZ) -> float:
    """Speak ``text`` into a 16-bit WAV at ``rate_hz``; return its duration in seconds."""
    audio, rate = speak(text, voice)
    if rate != rate_hz:
        import soxr

        audio = soxr.resample(audio, rate, rate_hz)
    path.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(str(path), audio, rate_hz, subtype="PCM_16")
    return len(audio) / rate_hz


VOICES = {"fa": "fa", "en": "en-us"}


def _write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _write_dataset(root: Path, metadata_file: str, prefix: str, sentences: tuple[str, ...], language: str,
                   n: int, offset: int = 0) -> dict[str, tuple[str, str, str]]:
    """``n`` clips of one language, ``id|text|text`` lines, sentences taken in turn from ``offset``."""
    made, lines = {}, []
    for i in range(offset, offset + n):
        sample_id, text = f"{prefix}-{i + 1:04d}", sentences[i % len(sentences)]
        write_clip(root / "wavs" / f"{sample_id}.wav", text, VOICES[language])
        lines.append(f"{sample_id}|{text}|{text}")
        made[sample_id] = (text, "default", language)
    _write_lines(root / metadata_file, lines)
    return made


def make_persian_dataset(root: Path, n: int = 8) -> dict[str, tuple[str, str, str]]:
    """``n`` Persian clips, ``id|text|text`` lines (no language column: pass ``--language fa``)."""
    return _write_dataset(root, "metadata.csv", "FA", PERSIAN, "fa", n)


def make_english_digits_dataset(root: Path, n: int = 8) -> dict[str, tuple[str, str, str]]:
    """``n`` English clips whose texts have digits."""
    return _write_dataset(root, "metadata.csv", "EN", ENGLISH_DIGITS, "en", n)


def _mixed_rows(n: int) -> list[tuple[str, str, str, str]]:
    """(id, text, speaker, language): Persian and English in turn, two Persian speakers, one English."""
    rows = []
    for i in range(n):
        if i % 2 == 0:
            rows.append((f"MIX-{i + 1:04d}", PERSIAN[(i // 2) % len(PERSIAN)], f"spk_fa{1 + (i // 2) % 2}", "fa"))
        else:
            rows.append((f"MIX-{i + 1:04d}", ENGLISH[(i // 2) % len(ENGLISH)], "spk_en1", "en"))
    return rows


def make_mixed_dataset(root: Path, n: int = 8) -> dict[str, tuple[str, str, str]]:
    """``n`` clips, half Persian, half English: ``id|text|normalized_text|speaker|language`` lines."""
    made, lines = {}, []
    for sample_id, text, speaker, language in _mixed_rows(n):
        write_clip(root / "wavs" / f"{sample_id}.wav", text, VOICES[language])
        lines.append(f"{sample_id}|{text}|{text}|{speaker}|{language}")
        made[sample_id] = (text, speaker, language)
    _write_lines(root / "metadata.csv", lines)
    return made


def make_manifest_dataset(root: Path, n: int = 6) -> dict[str, tuple[str, str, str]]:
    """A NeMo/Coqui-style ``manifest.jsonl`` (audio under ``audio/``), mixed Persian and English."""
    made, lines = {}, []
    for sample_id, text, speaker, language in _mixed_rows(n):
        relative = f"audio/{sample_id}.wav"
        duration = write_clip(root / relative, text, VOICES[language])
        lines.append(json.dumps({"audio_filepath": relative, "text": text, "duration": round(duration, 6),
                                 "speaker": speaker, "language": language}, ensure_ascii=False))
        made[sample_id] = (text, speaker, language)
    _write_lines(root / "manifest.jsonl", lines)
    return made


def make_train_eval_dataset(root: Path, n_train: int = 6, n_eval: int = 2) -> tuple[dict[str, tuple[str, str, str]],
                                                                                     dict[str, tuple[str, str, str]]]:
    """``metadata_train.csv`` and ``metadata_eval.csv`` sharing ``wavs/`` (English); (train, eval)."""
    return (_write_dataset(root, "metadata_train.csv", "TE", ENGLISH_DIGITS, "en", n_train),
            _write_dataset(root, "metadata_eval.csv", "TE", ENGLISH_DIGITS, "en", n_eval, offset=n_train))
