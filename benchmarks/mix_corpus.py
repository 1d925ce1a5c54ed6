"""The scale benchmark's corpus: a mix of three corpora as users download them, N clips in all.

``mix.yaml`` names three datasets of about N/3 clips each (:data:`PARTS`):

- ``manifest/manifest.jsonl``: a JSON-lines manifest (NeMo's keys, as benchmarks/scale.py's);
- ``parquet/train-NNNNN.parquet``: Parquet files laid out as Hugging Face ``datasets`` writes an
  Audio column (an ``audio`` struct of bytes and path beside ``id``, ``text``, ``speaker`` and
  ``duration``, its ``huggingface`` schema metadata, snappy), but for the audio bytes, which are
  dictionary-encoded (``datasets`` writes them PLAIN): each row's audio is one of AUDIO_FILES FLAC
  files of silence, so that 10^8 rows fit on one disk; the index never reads that column;
- ``cuts/cuts.jsonl.gz``: a lhotse cut manifest (one MonoCut a line, as ``CutSet.to_file`` writes
  it; gzip level CUTS_GZIP_LEVEL, not lhotse's 9, for the generation's speed).

Each clip has a duration of 1 to 20 s (its audio file exactly that long; files reused, as
benchmarks/scale.py's), a speaker of SPEAKERS of its dataset's own and a text of its own of
some 100 characters (WORDS_PER_TEXT words of a Zipf vocabulary, one of them the clip's own).
Every part is written CHUNK clips at a time (bounded memory), its texts made by numpy, the same
corpus at every run (SEED).
"""

from __future__ import annotations

import io
import json
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import soundfile

from ..shared.config import FeaturesConfig

# The audio files the clips share (s): every half second from 1 to 20 s.
AUDIO_SECONDS = tuple(1.0 + 0.5 * n for n in range(39))
AUDIO_FILES = len(AUDIO_SECONDS)
SAMPLE_RATE_HZ = FeaturesConfig.sample_rate_hz
# Speakers of each dataset (the mix's: three times as many).
SPEAKERS = 2000
# A text's words (inclusive bounds), drawn from VOCABULARY words by Zipf's law, one of them the
# clip's own (OWN_LETTERS letters: its number in base 26), letters by English frequency and word
# lengths as English words have them: ~100 characters a text, as LJSpeech's and the large corpora's.
WORDS_PER_TEXT = (14, 26)
VOCABULARY = 20_000
ZIPF_EXPONENT = 1.05
OWN_LETTERS = 6  # 26^6 > 3 * 10^8 clips
LETTER_FREQUENCY = {"e": 12.7, "t": 9.1, "a": 8.2, "o": 7.5, "i": 7.0, "n": 6.7, "s": 6.3, "h": 6.1, "r": 6.0,
                    "d": 4.3, "l": 4.0, "c": 2.8, "u": 2.8, "m": 2.4, "w": 2.4, "f": 2.2, "g": 2.0, "y": 2.0,
                    "p": 1.9, "b": 1.5, "v": 1.0, "k": 0.8, "j": 0.15, "x": 0.15, "q": 0.1, "z": 0.07}
SEED = 0
# Clips made and written at a time.
CHUNK = 20_000  # (larger chunks cost more: their arrays are new pages each time)
# Rows of a Parquet file and of its row groups (``datasets`` writes 100-row groups of real audio, some
# 20 MB; here a group of 10,000 rows is some 1.5 MB).
PARQUET_FILE_ROWS = 1_000_000
PARQUET_GROUP_ROWS = 10_000
CUTS_GZIP_LEVEL = 1
MIX_FILE = "mix.yaml"


@dataclass(frozen=True)
class Part:
    """One dataset of the mix: its name (the mix's id prefix), directory, metadata file and the
    first letter of its ids."""

    name: str
    directory: str
    metadata_file: str
    letter: str


PARTS = (Part("manifest", "manifest", "manifest.jsonl", "m"), Part("parquet", "parquet", "*.parquet", "p"),
         Part("cuts", "cuts", "cuts.jsonl.gz", "k"))


class Texts:
    """Texts of clips made a chunk at a time (module docstring): :meth:`chunk` gives their
    offsets and bytes (ASCII letters, spaces, a capital and a full stop)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        letters = np.frombuffer("".join(LETTER_FREQUENCY).encode(), np.uint8)
        weights = np.array(list(LETTER_FREQUENCY.values()))
        lengths = np.maximum(1, rng.gamma(2.2, 2.1, VOCABULARY).astype(np.int64))
        drawn = rng.choice(letters, size=int(lengths.sum()), p=weights / weights.sum())
        # each word followed by a space, the vocabulary's bytes end to end
        ends = np.cumsum(lengths + 1)
        blob = np.full(int(ends[-1]), ord(" "), np.uint8)
        starts = ends - lengths - 1
        blob[_spans(starts, lengths)] = drawn
        self.blob, self.starts, self.lengths = blob, starts, lengths + 1
        zipf = 1.0 / np.arange(1, VOCABULARY + 1) ** ZIPF_EXPONENT
        self.cdf = np.cumsum(zipf / zipf.sum())

    def chunk(self, first: int, count: int) -> tuple[np.ndarray, bytes]:
        """The texts of clips ``first`` to ``first + count``: (offsets, count + 1 of them; bytes)."""
        words = self.rng.integers(WORDS_PER_TEXT[0], WORDS_PER_TEXT[1] + 1, count)
        drawn = np.minimum(np.searchsorted(self.cdf, self.rng.random(int(words.sum()) - count)), VOCABULARY - 1)
        clip_of = np.repeat(np.arange(count), words)
        word_starts = np.cumsum(words) - words
        own = np.zeros(len(clip_of), bool)
        own[word_starts + (words - 1) // 2] = True  # the clip's own word in the middle of its text
        tokens = np.empty(len(clip_of), np.int64)
        tokens[~own] = drawn
        tokens[own] = VOCABULARY + np.arange(count)
        numbers = first + np.arange(count)
        own_words = np.empty((count, OWN_LETTERS + 1), np.uint8)
        for n in range(OWN_LETTERS):
            own_words[:, n] = ord("a") + numbers // 26 ** n % 26
        own_words[:, OWN_LETTERS] = ord(" ")
        blob = np.concatenate([self.blob, own_words.ravel()])
        starts = np.concatenate([self.starts, len(self.blob) + (OWN_LETTERS + 1) * np.arange(count)])
        lengths = np.concatenate([self.lengths, np.full(count, OWN_LETTERS + 1)])
        taken = lengths[tokens]
        out = blob[_spans(starts[tokens], taken)]
        ends = np.cumsum(np.bincount(clip_of, weights=taken, minlength=count).astype(np.int64))
        offsets = np.concatenate([[0], ends])
        out[ends - 1] = ord(".")  # the last word's space
        out[offsets[:-1]] -= ord("a") - ord("A")  # a capital (every word is lower-case letters)
        return offsets, out.tobytes()


def _spans(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The positions ``start, ..., start + length - 1`` of each span (every length > 0), end to
    end: a cumulative sum of steps of 1 that jump at each span's start (np.repeat of millions of
    short spans is ten times slower)."""
    ends = np.cumsum(lengths)
    steps = np.ones(int(ends[-1]), np.int32)  # positions in a blob of < 2 GiB
    steps[0] = starts[0]
    steps[ends[:-1]] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
    return np.cumsum(steps)


@dataclass
class Chunk:
    """A chunk of one dataset's clips: their numbers, texts (offsets, bytes), audio files
    (indices of AUDIO_SECONDS) and speakers (their numbers in the mix)."""

    first: int
    texts: tuple[np.ndarray, bytes]
    kinds: np.ndarray
    speakers: np.ndarray

    def text_list(self) -> list[str]:
        offsets, blob = self.texts
        text = blob.decode("ascii")
        bounds = offsets.tolist()
        return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def chunks(part: int, size: int) -> Iterator[Chunk]:
    """The clips of dataset ``part`` (of PARTS), ``size`` of them, CHUNK at a time."""
    rng = np.random.default_rng([SEED, part])
    texts = Texts(rng)
    for first in range(0, size, CHUNK):
        count = min(size, first + CHUNK) - first
        yield Chunk(first, texts.chunk(first, count), rng.integers(0, AUDIO_FILES, count),
                    part * SPEAKERS + rng.integers(0, SPEAKERS, count))


def write_audio(directory: Path) -> None:
    """The AUDIO_FILES WAV files ``audio/aK.wav`` a dataset's clips share."""
    audio = directory / "audio"
    audio.mkdir(parents=True, exist_ok=True)
    for n, seconds in enumerate(AUDIO_SECONDS):
        frames = np.arange(int(seconds * SAMPLE_RATE_HZ))
        soundfile.write(str(audio / f"a{n}.wav"), 0.1 * ((frames * (n + 3)) % 200 - 100) / 100, SAMPLE_RATE_HZ,
                        subtype="PCM_16")


def write_manifest(directory: Path, size: int) -> Path:
    """The JSON-lines dataset (PARTS[0]) of ``size`` clips; returns the manifest."""
    part = PARTS[0]
    write_audio(directory)
    path = directory / part.metadata_file
    seconds = [repr(s) for s in AUDIO_SECONDS]
    with open(path, "w", encoding="ascii") as f:
        for c in chunks(0, size):
            f.write("".join(
                f'{{"audio_filepath": "audio/a{k}.wav", "id": "{part.letter}{c.first + n:09d}", "text": "{t}", '
                f'"duration": {seconds[k]}, "speaker": "s{s}"}}\n'
                for n, (t, k, s) in enumerate(zip(c.text_list(), c.kinds.tolist(), c.speakers.tolist()))))
    return path


def write_cuts(directory: Path, size: int) -> Path:
    """The lhotse cut manifest (PARTS[2]) of ``size`` cuts, each all of one recording (one of the
    shared files); returns its path."""
    part = PARTS[2]
    write_audio(directory)
    path = directory / part.metadata_file
    recordings = [f'"recording": {{"id": "a{k}", "sources": [{{"type": "file", "channels": [0], "source": '
                  f'"audio/a{k}.wav"}}], "sampling_rate": {SAMPLE_RATE_HZ}, "num_samples": '
                  f'{int(s * SAMPLE_RATE_HZ)}, "duration": {s!r}, "channel_ids": [0]}}' for k, s in enumerate(AUDIO_SECONDS)]
    seconds = [repr(s) for s in AUDIO_SECONDS]
    packer = zlib.compressobj(CUTS_GZIP_LEVEL, zlib.DEFLATED, 31)  # 31: a gzip stream
    with open(path, "wb") as f:
        for c in chunks(2, size):
            lines = "".join(
                f'{{"id": "{i}", "start": 0.0, "duration": {seconds[k]}, "channel": 0, "supervisions": [{{"id": '
                f'"{i}", "recording_id": "a{k}", "start": 0.0, "duration": {seconds[k]}, "channel": 0, "text": '
                f'"{t}", "speaker": "s{s}"}}], {recordings[k]}, "type": "MonoCut"}}\n'
                for i, t, k, s in zip((f"{part.letter}{c.first + n:09d}" for n in range(len(c.kinds))),
                                      c.text_list(), c.kinds.tolist(), c.speakers.tolist()))
            f.write(packer.compress(lines.encode("ascii")))
        f.write(packer.flush())
    return path


def write_parquet(directory: Path, size: int) -> Path:
    """The Parquet dataset (PARTS[1]) of ``size`` rows; returns its directory."""
    import pyarrow as pa  # the parquet extra's, for this layout only
    import pyarrow.parquet as pq  # (as above)

    part = PARTS[1]
    directory.mkdir(parents=True, exist_ok=True)
    flacs = []
    for seconds in AUDIO_SECONDS:
        with io.BytesIO() as f:
            soundfile.write(f, np.zeros(int(seconds * SAMPLE_RATE_HZ), np.int16), SAMPLE_RATE_HZ, format="FLAC",
                            subtype="PCM_16")
            flacs.append(f.getvalue())
    audio = pa.StructArray.from_arrays([pa.array(flacs, pa.binary()), pa.array([f"a{k}.flac" for k in
                                                                                 range(AUDIO_FILES)])],
                                       ["bytes", "path"])
    speakers = pa.array([f"s{n}" for n in range(len(PARTS) * SPEAKERS)])
    features = {"audio": {"_type": "Audio"}, "id": {"dtype": "string", "_type": "Value"},
                "text": {"dtype": "string", "_type": "Value"}, "speaker": {"dtype": "string", "_type": "Value"},
                "duration": {"dtype": "float64", "_type": "Value"}}
    schema = pa.schema([("audio", audio.type), ("id", pa.string()), ("text", pa.string()), ("speaker", pa.string()),
                        ("duration", pa.float64())],
                       metadata={"huggingface": json.dumps({"info": {"features": features}})})
    id_width = 1 + 9
    writer = None
    try:
        for c in chunks(1, size):
            count = len(c.kinds)
            for start in range(0, count, PARQUET_GROUP_ROWS):
                first = c.first + start
                if first % PARQUET_FILE_ROWS == 0:
                    if writer is not None:
                        writer.close()
                    writer = pq.ParquetWriter(directory / f"train-{first // PARQUET_FILE_ROWS:05d}.parquet", schema,
                                              compression="snappy", use_dictionary=True)
                rows = slice(start, min(count, start + PARQUET_GROUP_ROWS))
                kinds = c.kinds[rows]
                offsets, blob = c.texts
                text_offsets = offsets[rows.start:rows.stop + 1]
                texts = pa.StringArray.from_buffers(
                    len(kinds), pa.py_buffer((text_offsets - text_offsets[0]).astype(np.int32)),
                    pa.py_buffer(blob[int(text_offsets[0]):int(text_offsets[-1])]))
                ids = pa.StringArray.from_buffers(len(kinds), pa.py_buffer(
                    (id_width * np.arange(len(kinds) + 1)).astype(np.int32)),
                    pa.py_buffer(_fixed_ids(part.letter, first, len(kinds))))
                table = pa.table([audio.take(pa.array(kinds)), ids, texts,
                                  speakers.take(pa.array(c.speakers[rows])),
                                  pa.array(np.asarray(AUDIO_SECONDS)[kinds])], schema=schema)
                assert writer is not None
                writer.write_table(table, row_group_size=PARQUET_GROUP_ROWS)
    finally:
        if writer is not None:
            writer.close()
    return directory


def _fixed_ids(letter: str, first: int, count: int) -> bytes:
    """``LETTER%09d`` of ``first`` to ``first + count``, end to end."""
    out = np.empty((count, 10), np.uint8)
    out[:, 0] = ord(letter)
    numbers = first + np.arange(count)
    for n in range(9):
        out[:, 9 - n] = ord("0") + numbers // 10 ** n % 10
    return out.tobytes()


WRITERS: tuple[Callable[[Path, int], Path], ...] = (write_manifest, write_parquet, write_cuts)


def sizes(size: int) -> list[int]:
    """The clips of each dataset of a mix of ``size``: a third each, the rest the last's."""
    third = size // len(PARTS)
    return [third] * (len(PARTS) - 1) + [size - third * (len(PARTS) - 1)]


def write_mix(root: Path, size: int, log: Callable[[str], None] | None = None) -> Path:
    """The mix of ``size`` clips under ``root`` (module docstring); returns the mix file. ``log``
    gets each dataset's seconds and bytes."""
    root.mkdir(parents=True, exist_ok=True)
    lines = ["datasets:"]
    for part, count, writer in zip(PARTS, sizes(size), WRITERS):
        started = time.perf_counter()
        writer(root / part.directory, count)
        if log is not None:
            log(f"mix {size}: {part.name}, {count:,} clips, {disk_bytes(root / part.directory) / 1e6:.0f} MB written "
                f"in {time.perf_counter() - started:.1f} s")
        lines.append(f"  - {{path: {part.directory}, name: {part.name}, metadata_file: '{part.metadata_file}'}}")
    path = root / MIX_FILE
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def disk_bytes(path: Path) -> int:
    """The bytes the files under ``path`` hold on disk (their blocks, a hard link once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:
                continue  # removed while walked (a build's run file)
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total
