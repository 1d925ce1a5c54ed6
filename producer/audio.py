"""Reading one clip: any format libsndfile reads, downmixed to mono, resampled.

The result has exactly :func:`shared.dataset.expected_samples` samples, so the mel
frame count a producer computes always equals the one the consumer planned with.
Stereo (or more channels) is averaged to mono; another sample rate is converted with
soxr at its "HQ" quality (a 20-bit-class polyphase filter), then padded or trimmed by
the rounding sample so the length is exactly ``ceil(n * target / source)``.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import soundfile

from ..shared.dataset.corpus.address import Member, Row
from ..shared.dataset.corpus.cuts import END_TOLERANCE_S
from ..shared.dataset.parquet import row_reader
from ..shared.dataset.probe import expected_samples, libsndfile_message, riff_facts_of, riff_problem
from ..shared.dataset.storage import Reader, StorageError, read_url, shown

# soxr's "HQ" recipe: passband to 0.91 of Nyquist, ~125 dB stopband; librosa's default
# resampler ("soxr_hq") is the same one.
RESAMPLE_QUALITY = "HQ"


# libsndfile's float from 16-bit PCM: the integer over this (its normalisation, on by default).
INT16_SCALE = 0x8000


class AudioError(Exception):
    """A clip that cannot be used; ``str(exc)`` is the rejection reason."""


class AudioMissing(AudioError):
    """The clip's file is not on this host; another host may have it."""


def load_audio(path: Path, target_rate_hz: int, where: str | None = None,
               span: tuple[float, float] | None = None) -> np.ndarray:
    """Return mono float32 audio at ``target_rate_hz``; raise :class:`AudioError`.

    ``where`` names the file in reasons (the dataset-relative path); default: its name.
    A file absent on this host raises :class:`AudioMissing`. ``span``: only the seconds
    ``[start, end)`` of the file (a lhotse cut's window, shared/dataset/corpus/cuts.py), read without the rest.
    """
    where = where or Path(path).name
    try:
        size = Path(path).stat().st_size
        problem = riff_problem(Path(path), size) if size else ""
    except FileNotFoundError:
        raise AudioMissing(f"audio file missing: {where}") from None
    except OSError as exc:
        raise AudioError(f"audio file unreadable: {where}: {exc.strerror}") from None
    if size == 0:
        raise AudioError(f"audio file empty: {where}")
    if problem:
        raise AudioError(f"audio file truncated: {where}: {problem}")
    try:
        if span is None:
            audio, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
        else:
            with soundfile.SoundFile(str(path)) as f:
                rate = f.samplerate
                start, stop = _frames_of(span, rate, f.frames, where)
                f.seek(start)
                audio = f.read(stop - start, dtype="float32", always_2d=True)
    except AudioError:
        raise
    except Exception as exc:  # libsndfile raises LibsndfileError/RuntimeError for corrupt data
        if not Path(path).exists():  # soundfile reports a missing file as LibsndfileError, not FileNotFoundError
            raise AudioMissing(f"audio file missing: {where}") from None
        raise AudioError(f"audio file unreadable: {where}: {libsndfile_message(exc)}") from None
    return _resampled(audio, rate, target_rate_hz, where)


def _frames_of(span: tuple[float, float], rate: int, frames: int, where: str) -> tuple[int, int]:
    """The frames [start, stop) of a file of ``frames`` frames at ``rate`` that the seconds ``span``
    are (a frame or so past the end is rounding: cut off); AudioError when the span ends beyond the file."""
    start, stop = round(span[0] * rate), round(span[1] * rate)
    if stop > frames + max(1, round(END_TOLERANCE_S * rate)):
        raise AudioError(f"cut ends at {span[1]:.3f} s, beyond its recording's end ({frames / rate:.3f} s): {where}")
    return start, min(stop, frames)


def load_member(reader: Reader, locator: Member | Row, target_rate_hz: int) -> np.ndarray:
    """:func:`load_audio` of a tar shard's member (shared/dataset/shards.py), its bytes read through
    ``reader`` (local or at a URL, retried: shared/dataset/storage.py); or of a Parquet row
    (shared/dataset/parquet.py), its row group read by this process's row reader of ``reader``'s dataset."""
    where = locator.where
    if isinstance(locator, Row):
        try:
            data = row_reader(reader.root).read(locator.name)
        except FileNotFoundError:
            raise AudioMissing(f"audio file missing: {where}: no such Parquet file") from None
        except StorageError as exc:
            raise AudioError(f"audio file unreadable: {where}: {exc}") from None
        return _decoded(data, target_rate_hz, where)
    try:
        data = reader.read(locator.shard, locator.offset, locator.size)
    except FileNotFoundError:
        raise AudioMissing(f"audio file missing: {where}: no such shard") from None
    except StorageError as exc:
        raise AudioError(f"audio file unreadable: {where}: {exc}") from None
    return _decoded(data, target_rate_hz, where)


def load_url(url: str, target_rate_hz: int, span: tuple[float, float] | None = None) -> np.ndarray:
    """:func:`load_audio` of a loose file at a URL (a manifest's at a URL), its bytes read whole
    through shared/dataset/storage.py (a read failing in transit retried and counted); ``span``
    as :func:`load_audio`'s."""
    where = shown(url)
    try:
        data = read_url(url)
    except FileNotFoundError:
        raise AudioMissing(f"audio file missing: {where}") from None
    except StorageError as exc:
        raise AudioError(f"audio file unreadable: {where}: {exc}") from None
    if not data:
        raise AudioError(f"audio file empty: {where}")
    return _decoded(data, target_rate_hz, where, span)


def _decoded(data: bytes, target_rate_hz: int, where: str, span: tuple[float, float] | None = None) -> np.ndarray:
    """:func:`load_audio` of a file's bytes (a shard member's, a file's at a URL)."""
    riff = riff_facts_of(data)
    if riff is not None and riff.problem:
        raise AudioError(f"audio file truncated: {where}: {riff.problem}")
    if riff is not None and riff.frames and riff.pcm16_offset:
        # 16-bit PCM WAV, the commonest member: the samples as libsndfile scales them (x / 32768,
        # exact in float32), without its reads through Python callbacks of an in-memory file
        pcm = np.frombuffer(data, "<i2", riff.frames * riff.channels, riff.pcm16_offset)
        audio = (pcm.astype(np.float32) * np.float32(1 / INT16_SCALE)).reshape(-1, riff.channels)
        return _resampled(_window(audio, riff.rate, span, where), riff.rate, target_rate_hz, where)
    try:
        audio, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as exc:  # libsndfile raises LibsndfileError/RuntimeError for corrupt data
        raise AudioError(f"audio file unreadable: {where}: {libsndfile_message(exc)}") from None
    return _resampled(_window(audio, rate, span, where), rate, target_rate_hz, where)


def _window(audio: np.ndarray, rate: int, span: tuple[float, float] | None, where: str) -> np.ndarray:
    """The frames of decoded ``audio`` that ``span`` names (all of them for None)."""
    if span is None:
        return audio
    start, stop = _frames_of(span, rate, audio.shape[0], where)
    return audio[start:stop]


def _resampled(audio: np.ndarray, rate: int, target_rate_hz: int, where: str) -> np.ndarray:
    """Decoded frames [N, channels] at ``rate`` as mono float32 at ``target_rate_hz``."""
    if audio.shape[0] == 0:
        raise AudioError(f"audio file has no samples: {where}")
    mono = audio.mean(axis=1, dtype=np.float32) if audio.shape[1] > 1 else audio[:, 0]
    if not np.all(np.isfinite(mono)):
        raise AudioError(f"audio contains NaN or inf: {where}")
    want = expected_samples(mono.shape[0], rate, target_rate_hz)
    if rate != target_rate_hz:
        import soxr  # only a clip at another rate needs it (80 ms to import)

        mono = soxr.resample(mono, rate, target_rate_hz, quality=RESAMPLE_QUALITY).astype(np.float32, copy=False)
        if mono.shape[0] < want:
            mono = np.pad(mono, (0, want - mono.shape[0]))
        mono = mono[:want]
    return np.ascontiguousarray(mono, dtype=np.float32)
