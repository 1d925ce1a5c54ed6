"""Audio headers, read without decoding: what libsndfile and a RIFF chunk walk say of a
file, or why it cannot be used (truncated, empty, corrupt). The index and the producer's
reader (producer/audio.py) share these checks.
"""

from __future__ import annotations

import io
import math
import os
import struct
from pathlib import Path
from typing import Any, Callable, NamedTuple

from ..dataset.storage import RetryingFile, StorageError, shown
from ..dataset.types import AudioProbe

# A RIFF header (fmt, LIST, fact chunks) nearly always fits in this; larger chunks are
# skipped by seeking, not read.
RIFF_PROBE_BYTES = 4096


# RIFF/RF64 data sizes that mean "unknown, read to the end" (streamed writers).
RIFF_UNKNOWN_SIZES = (0, 0xFFFFFFFF)


# Longest libsndfile message kept in a reason.
MAX_DETAIL_CHARS = 160


def expected_samples(num_samples: int, source_rate_hz: int, target_rate_hz: int) -> int:
    """Length of a clip after resampling; producers pad or trim to exactly this."""
    if source_rate_hz == target_rate_hz:
        return num_samples
    return int(math.ceil(num_samples * target_rate_hz / source_rate_hz))


class RiffFacts(NamedTuple):
    """What a RIFF/RF64 WAVE header says: whether the data is complete, and the length.

    ``frames`` is None when the fmt chunk is not plain PCM or IEEE float (or the data
    size is unknown): libsndfile then says how long the file is.
    """

    problem: str = ""
    frames: int | None = None
    rate: int = 0
    channels: int = 0
    pcm16_offset: int = 0  # where the samples start when they are 16-bit integer PCM (else 0)


# WAVE format tags whose frame count is simply data bytes / block align (PCM, IEEE float);
# 0xFFFE (WAVE_FORMAT_EXTENSIBLE) names one of them in its sub-format GUID.
_PCM_TAG, _FLOAT_TAG, _EXTENSIBLE_TAG = 1, 3, 0xFFFE


_PLAIN_BITS = {_PCM_TAG: (8, 16, 24, 32), _FLOAT_TAG: (32, 64)}


def riff_facts(path: str | Path, size: int) -> RiffFacts | None:
    """Walk a WAVE file's chunks (seeking over their bodies); None if it is not RIFF WAVE.

    libsndfile silently clamps a WAV whose ``data`` chunk claims more bytes than the
    file holds (a copy cut short), so the ``data`` chunk's declared size is compared
    with the bytes that follow its header. For PCM and float data the length comes
    from the same walk (``data bytes // block align``, as libsndfile computes it), so
    the index need not open the file with libsndfile at all.
    """
    fd = os.open(path, os.O_RDONLY)  # os-level reads: no buffered file object per header
    try:
        return _riff_walk(lambda n, offset: os.pread(fd, n, offset), size)
    finally:
        os.close(fd)


def riff_facts_of(data: bytes) -> RiffFacts | None:
    """:func:`riff_facts` of a file held in memory (a tar shard's member)."""
    view = memoryview(data)
    return _riff_walk(lambda n, offset: bytes(view[offset:offset + n]), len(data))


def _riff_walk(pread: Callable[[int, int], bytes], size: int) -> RiffFacts | None:
    """The chunk walk of :func:`riff_facts` over ``pread(count, offset)``."""
    buffer = pread(RIFF_PROBE_BYTES, 0)
    base = 0  # file offset of buffer[0]
    if len(buffer) < 12 or buffer[:4] not in (b"RIFF", b"RF64", b"BW64") or buffer[8:12] != b"WAVE":
        return None
    ds64_data: int | None = None
    fmt: tuple[int, int, int, int, int] | None = None  # tag, channels, rate, block align, bits
    offset = 12
    while True:
        if offset + 8 > size:
            return RiffFacts(problem=f"the header ends at byte {size} without a data chunk")
        if offset + 8 > base + len(buffer):
            buffer, base = pread(RIFF_PROBE_BYTES, offset), offset
        at = offset - base
        chunk, length = buffer[at:at + 4], struct.unpack_from("<I", buffer, at + 4)[0]
        if chunk == b"ds64" and at + 8 + 16 <= len(buffer):  # RF64: 64-bit riff and data sizes
            ds64_data = struct.unpack_from("<Q", buffer, at + 8 + 8)[0]
        elif chunk == b"fmt " and length >= 16 and at + 8 + 16 <= len(buffer):
            tag, channels, rate, _, align, bits = struct.unpack_from("<HHIIHH", buffer, at + 8)
            if tag == _EXTENSIBLE_TAG and length >= 40 and at + 8 + 26 <= len(buffer):
                tag = struct.unpack_from("<H", buffer, at + 8 + 24)[0]  # first bytes of the sub-format GUID
            fmt = (tag, channels, rate, align, bits)
        elif chunk == b"data":
            if ds64_data is not None and length == 0xFFFFFFFF:
                length = ds64_data
            elif length in RIFF_UNKNOWN_SIZES:
                return RiffFacts()  # written by a streaming tool: the data runs to the end of the file
            held = size - (offset + 8)
            if held < length:
                return RiffFacts(problem=f"holds {held} of the {length} sample bytes its header declares")
            if fmt is None:
                return RiffFacts()
            tag, channels, rate, align, bits = fmt
            if bits not in _PLAIN_BITS.get(tag, ()) or channels < 1 or rate < 1 or align != channels * bits // 8:
                return RiffFacts()
            pcm16 = offset + 8 if tag == _PCM_TAG and bits == 16 else 0
            return RiffFacts(frames=length // align, rate=rate, channels=channels, pcm16_offset=pcm16)
        offset += 8 + length + (length & 1)  # chunks are padded to an even size


def riff_problem(path: Path, size: int) -> str:
    """Why a WAVE file's sample data is incomplete, or "" (also for files that are not WAVE)."""
    facts = riff_facts(path, size)
    return facts.problem if facts is not None else ""


def probe_audio(path: str | Path, size: int | None = None) -> AudioProbe:
    """Header facts of one audio file (no decoding), or the reason it cannot be used.

    ``size``: the file's size when the caller has just listed it (saves a stat).
    """
    try:
        if size is None:
            size = os.stat(path).st_size
        if size == 0:
            return AudioProbe(error="audio file empty")
        riff = riff_facts(path, size)
    except FileNotFoundError:
        return AudioProbe(error="audio file missing")
    except OSError as exc:
        return AudioProbe(error="audio file unreadable", detail=str(exc.strerror))
    return _probe_header(riff, lambda: str(path))


def probe_bytes(data: bytes) -> AudioProbe:
    """:func:`probe_audio` of a file held in memory (a tar shard's member)."""
    if not data:
        return AudioProbe(error="audio file empty")
    return _probe_header(riff_facts_of(data), lambda: io.BytesIO(data))


def probe_url(url: str) -> AudioProbe:
    """:func:`probe_audio` of a loose file at a URL, through shared/dataset/storage.py (a read
    failing in transit retried and counted), reading its header only: the RIFF walk's few
    ranges of :data:`RIFF_PROBE_BYTES` (libsndfile's own reads for other formats), not the file."""
    try:
        with RetryingFile(url, block_size=RIFF_PROBE_BYTES) as f:
            size = f.seek(0, io.SEEK_END)
            if size == 0:
                return AudioProbe(error="audio file empty")
            riff = _riff_walk(lambda n, offset: (f.seek(offset), f.read(n))[1], size)
            return _probe_header(riff, lambda: (f.seek(0), f)[1])
    except FileNotFoundError:
        return AudioProbe(error="audio file missing", detail=f"no file {shown(url)}")
    except StorageError as exc:
        return AudioProbe(error="audio file unreadable", detail=str(exc))


def _probe_header(riff: RiffFacts | None, source: Callable[[], Any]) -> AudioProbe:
    """The probe from a RIFF walk's facts, else libsndfile's header of ``source()`` (a path or a file object)."""
    if riff is not None and riff.problem:
        return AudioProbe(error="audio file truncated", detail=riff.problem)
    if riff is not None and riff.frames is not None:
        if riff.frames == 0:
            return AudioProbe(0, riff.rate, riff.channels, error="audio file has no samples",
                              detail="empty or truncated stream")
        return AudioProbe(riff.frames, riff.rate, riff.channels)  # plain PCM/float WAV: no libsndfile needed
    import soundfile  # here, so that processes which index only plain WAV files never load libsndfile

    try:
        info = soundfile.info(source())
    except Exception as exc:  # libsndfile reports every unreadable header as RuntimeError/LibsndfileError
        return AudioProbe(error="audio file unreadable", detail=libsndfile_message(exc))
    if info.frames <= 0 or info.samplerate <= 0:
        return AudioProbe(info.frames, info.samplerate, info.channels, error="audio file has no samples",
                          detail="empty or truncated stream")
    if info.format == "FLAC":
        problem = _flac_tail_problem(soundfile, source, info.frames)
        if problem:
            return AudioProbe(info.frames, info.samplerate, info.channels, error="audio file truncated",
                              detail=problem)
    return AudioProbe(info.frames, info.samplerate, info.channels)


def _flac_tail_problem(soundfile: Any, source: Callable[[], Any], frames: int) -> str:
    """Whether a FLAC stream really reaches the last sample its STREAMINFO announces.

    A FLAC file cut short keeps its header, so soundfile.info reports the full length;
    seeking to the last sample and decoding it (one block, ~0.3 ms) finds the cut.
    WAV needs no decoding (:func:`riff_problem`); Ogg has no total in its header, so a
    cut Ogg file reads as a shorter clip (or as one with no samples).
    """
    try:
        with soundfile.SoundFile(source()) as f:
            f.seek(frames - 1)
            got = f.read(1, dtype="float32", always_2d=True).shape[0]
    except Exception:  # libsndfile raises LibsndfileError/RuntimeError when the stream is cut
        got = 0
    if got != 1:
        return f"the stream ends before sample {frames} its header announces"
    return ""


def libsndfile_message(exc: BaseException) -> str:
    """libsndfile's own words for a failure, one short line, without the file path."""
    text = getattr(exc, "error_string", None) or str(exc) or type(exc).__name__
    line = str(text).strip().splitlines()[0] if str(text).strip() else type(exc).__name__
    if line.startswith("Error opening ") and ": " in line:
        line = line.rsplit(": ", 1)[1]
    for prefix in ("Error : ", "Error: "):
        if line.startswith(prefix):
            line = line[len(prefix):]
    return line[:MAX_DETAIL_CHARS]
