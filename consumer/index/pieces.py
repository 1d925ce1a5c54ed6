"""One piece of a large manifest whose clips all give their durations, indexed as columns in a
helper process: the manifest cut at line ends, a piece's lines parsed, through the front-end
and the rules, its ids hashed and sorted (chunked.py merges the pieces).
"""

from __future__ import annotations

import collections
import mmap
import operator
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from ...shared.config import DataConfig, FeaturesConfig, TextConfig
from ...shared.dataset.files import UNMEASURED
from .parallel import frontend_of
from .rules import LostReport, audio_rules, text_rules
from ...shared.dataset.table import ENCODING_ERRORS, NUMBER_COLUMNS, STRING_COLUMNS, hash_strings, pack_strings
from ...shared.dataset.types import DEFAULT_SPEAKER
from ...shared.dataset.layouts import ManifestColumns, Rejection, manifest_columns
from ...shared.mel import min_num_samples, num_frames_of
from ...shared.text import LANGUAGES, Frontend, Units


@dataclass(frozen=True)
class Pieces:
    """How a large dataset's index is built in pieces (chunked.py): each piece's work (a function
    and its tasks), what a line's rejection of dataset N becomes (None: as it is), the wording of
    an id repeated in a later piece (one per dataset of a mix), the metadata's SHA-256 where the
    pieces were cut from a stream or a mix's parts (else its stamp keys the cache), a directory of
    spilled blocks to remove after the build, and the dataset (of a mix) each piece is of."""

    work: tuple[Callable[..., Any], list[tuple]]
    named: Callable[[Rejection, int], Rejection] | None = None
    repeated: str | tuple[str, ...] = "duplicate id on manifest line"
    sha256: str = ""
    spill: Path | None = None
    datasets: tuple[int, ...] = ()


# Line feed and carriage return, as bytes of a manifest.
LF, CR = ord("\n"), ord("\r")


def manifest_ranges(path: Path, chunk_bytes: int) -> list[tuple[int, int, int]]:
    """The pieces of a manifest: (start byte, end byte, the number of its first line), each of
    about ``chunk_bytes`` and ending at a line end (``\\n``) but the last; lines counted as
    :func:`layouts._text_lines` cuts them (``\\r\\n``, ``\\r``, ``\\n``). The file is mapped, not
    read: its line ends are counted in place, each piece's pages let go of after (a mapped
    file's pages read count as this process's memory: the whole manifest, else)."""
    ranges: list[tuple[int, int, int]] = []
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return ranges
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            start, line = 0, 1
            while start < size:
                end = mapped.rfind(b"\n", start, start + chunk_bytes) + 1 if start + chunk_bytes < size else size
                if not end:  # a line longer than a piece: the piece ends with it
                    end = mapped.find(b"\n", start + chunk_bytes) + 1 or size
                ranges.append((start, end, line))
                line += _line_ends(mapped, start, end)
                _let_go(mapped, start, end)
                start = end
    return ranges


def _let_go(mapped: mmap.mmap, start: int, end: int) -> None:
    """Drop the whole pages of bytes [start, end) of ``mapped`` from this process (clean pages of
    a file: read again from the page cache if touched)."""
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first and hasattr(mapped, "madvise"):  # madvise: not on every platform
        mapped.madvise(mmap.MADV_DONTNEED, first, last - first)


def _line_ends(mapped: mmap.mmap, start: int, end: int) -> int:
    """The line ends (``\\r\\n``, ``\\r``, ``\\n``) in bytes ``start:end`` of ``mapped``."""
    raw = np.frombuffer(mapped, np.uint8, end - start, start)
    ends = int(np.count_nonzero(raw == LF))
    if mapped.find(b"\r", start, end) >= 0:
        returns = raw == CR
        ends += int(np.count_nonzero(returns)) - int(np.count_nonzero(returns[:-1] & (raw[1:] == LF)))
    return ends


# What a piece's entries and rejections become before the rules (a mix's part's: named as the
# mix names them, mix_pieces.py); a picklable callable, as helper processes are handed it.
Renamed = Callable[[ManifestColumns, list[Rejection]], tuple[ManifestColumns, list[Rejection]]]


def manifest_chunk(path: str, start: int, end: int, first_line: int, data: DataConfig, features: FeaturesConfig,
                   text: TextConfig, renamed: Renamed | None = None) -> dict[str, Any] | None:
    """One piece of a manifest, parsed, through the front-end and the rules, as columns (runs in
    worker processes, and in this one). None when a clip gives no duration (its audio header
    would be read: the one-process build's work)."""
    with open(path, "rb") as f:
        f.seek(start)
        raw = f.read(end - start)
    return manifest_piece(raw, first_line, data, features, text, renamed)


def manifest_piece(raw: bytes, first_line: int, data: DataConfig, features: FeaturesConfig,
                   text: TextConfig, renamed: Renamed | None = None) -> dict[str, Any] | None:
    """:func:`manifest_chunk` of a piece's lines (``raw``, its first line numbered ``first_line``)."""
    return columns_piece(*manifest_columns(raw, first_line), data, features, text, renamed)


def columns_piece(entries: ManifestColumns, parsed: list[Rejection], data: DataConfig, features: FeaturesConfig,
                  text: TextConfig, renamed: Renamed | None = None) -> dict[str, Any] | None:
    """:func:`manifest_piece` of a piece's entries as columns (``parsed``: its lines' rejections),
    however they were made (parquet_pieces.py makes a Parquet piece's from its columns), each
    first ``renamed`` where given (a mix's ids, speakers, languages and audio paths)."""
    if None in entries.duration:
        return None
    if renamed is not None:
        entries, parsed = renamed(entries, parsed)
    size = len(entries.id)
    unnamed = entries.language.count("")  # clips that name no language: the config's
    codes = (entries.language if not unnamed else [text.language] * size if unnamed == size
             else [code or text.language for code in entries.language])
    frontend = frontend_of((text.frontend, text.digits))
    # Each distinct (language, text) once, in file order (at: its place there of each clip), and
    # its units (None: an unknown language) and lost characters.
    at, made, lost_of, tokenized = _distinct_units(codes, entries.text, frontend)
    known = None if None not in made else np.fromiter((u is not None for u in made), bool, len(made))
    if known is None:
        counts = frontend.counts(made)
    else:  # an unknown language's texts: no units, no tokens
        counts = np.zeros(len(made), np.int64)
        counts[known] = frontend.counts([u for u in made if u is not None])
    counts = counts[at]
    clean = np.fromiter(map(operator.not_, lost_of), bool, len(lost_of))  # no character lost
    clean = (clean if known is None else clean & known)[at]
    durations = np.asarray(entries.duration, np.float64).reshape(size)
    # The clips every rule passes without a word, told apart at once (the others go through the
    # rules one by one, which say why: _ruled): units that lost nothing, a token count within
    # bounds, a duration within bounds and long enough for the framing (audio_rules).
    heard = (durations <= data.max_audio_s) & (durations >= data.min_audio_s)
    samples = np.rint(np.where(heard, durations, 0.0) * features.sample_rate_hz).astype(np.int64)
    passed = (clean & (counts > 0) & (counts <= data.max_tokens) & heard & (samples >= min_num_samples(features)))
    ruled = _ruled(entries, codes, at, made, lost_of, passed, data, features, text, frontend)
    numbers = {"num_tokens": counts, "num_frames": samples, "duration_s": durations}
    return {"parsed": parsed, "tokenized": tokenized, **ruled,
            **_columns(entries, codes, at, made, numbers, passed, features)}


def _ruled(entries: Any, codes: list[str], at: np.ndarray, made: list[str | None], lost_of: list[str],
           passed: np.ndarray, data: DataConfig, features: FeaturesConfig, text: TextConfig,
           frontend: Frontend) -> dict[str, list[Any]]:
    """The clips of a piece that did not pass at once, through the rules one by one (a clip they
    pass is marked in ``passed``): the rejections, the lost characters and the units listed apart
    for the cache (texts that lost characters, or of a rejected clip), each with its position."""
    report = LostReport()  # what is lost is listed per clip here, in order, for the whole index's report
    rejected: list[tuple[int, Rejection]] = []
    lost: list[tuple[int, str, str]] = []
    listed: list[tuple[int, str, str, str, str]] = []
    for n in np.flatnonzero(~passed).tolist():
        entry, k, key = entries.entry(n), int(at[n]), (codes[n], entries.text[n])
        unit = Units(made[k], lost_of[k]) if made[k] is not None else None
        outcome = text_rules(entry, {key: unit} if unit is not None else {}, data, text, frontend, None, report)
        if not isinstance(outcome, Rejection):
            outcome = audio_rules(entry, {}, {}, data, features)
        if isinstance(outcome, Rejection):
            rejected.append((n, outcome))
        else:
            passed[n] = True
        if unit is not None and unit.lost:
            lost.append((n, entry.id, unit.lost))
        if unit is not None and (unit.lost or isinstance(outcome, Rejection)):
            listed.append((n, *key, unit.units, unit.lost))
    return {"rejected": rejected, "lost": lost, "listed": listed}


def _columns(entries: Any, codes: list[str], at: np.ndarray, made: list[str | None], numbers: dict[str, np.ndarray],
             passed: np.ndarray, features: FeaturesConfig) -> dict[str, Any]:
    """A piece's samples (the clips ``passed``) as columns, and what the merge needs of all its
    entries: their ids (packed, hashed and in id order), lines, and fingerprint lines."""
    size = len(entries.id)
    picked = np.flatnonzero(passed)
    rows = np.full(size, -1, np.int64)
    rows[picked] = np.arange(len(picked))
    chosen = picked.tolist()
    every = len(chosen) == size
    speaker_names = entries.speaker if every else [entries.speaker[n] for n in chosen]
    if "" in speaker_names:
        speaker_names = [s or DEFAULT_SPEAKER for s in speaker_names]
    speakers, speaker_codes = _coded(speaker_names)
    languages, language_codes = _coded(codes if every else [codes[n] for n in chosen])
    columns = {"id": entries.id if every else [entries.id[n] for n in chosen],
               "text": entries.text if every else [entries.text[n] for n in chosen],
               "audio": entries.audio if every else [entries.audio[n] for n in chosen],
               "units": made if every and len(made) == size else [made[k] for k in at[picked].tolist()]}
    picked_numbers = {"num_tokens": numbers["num_tokens"][picked],
                      "num_frames": num_frames_of(numbers["num_frames"][picked], features),
                      "duration_s": numbers["duration_s"][picked], "line": np.asarray(entries.line, np.int64)[picked],
                      "speaker": speaker_codes, "language": language_codes}
    ids = pack_strings(entries.id)
    strings = {name: ids if name == "id" and every else pack_strings(columns[name]) for name in STRING_COLUMNS}
    return {
        "rows": rows, "ids": ids, "lines": np.asarray(entries.line, np.int64).reshape(size),
        "hashes": hash_strings(ids[0], np.frombuffer(ids[1], np.uint8), np.arange(size)),
        "id_order": np.argsort(fixed_width(*ids, max(1, widest(ids[0]))), kind="stable"),
        "metadata_lines": _tab_lines([entries.id, entries.text, entries.speaker, entries.language]),
        "audio_lines": _suffixed(ids, entries.id, f"\t{UNMEASURED}\n"),
        "seen": unit_symbols(strings["units"][1]),
        "numbers": {name: np.asarray(picked_numbers[name], kind) for name, kind in NUMBER_COLUMNS.items()},
        "strings": strings,
        "speakers": speakers, "languages": languages,
    }


def _distinct_units(codes: list[str], texts: list[str], frontend: Frontend) -> tuple[np.ndarray, list[str | None],
                                                                                       list[str], int]:
    """Each distinct (language, text) of a manifest piece once, in file order, through the
    front-end one list per language (as _work_items sends them): the place there of each clip,
    the units of each (None: a language the front-end does not know), its lost characters, and
    how many texts were tokenized. A piece of one language (the common case) keys by text alone."""
    one = not codes or codes.count(codes[0]) == len(codes)
    distinct, at = _coded(texts if one else list(zip(codes, texts)), np.int64)
    if one:
        if codes and codes[0] in LANGUAGES:
            made, lost_of = frontend.unit_columns(distinct, codes[0])
            return at, made, lost_of, len(distinct)
        return at, [None] * len(distinct), [""] * len(distinct), 0
    by_language: dict[str, list[int]] = collections.defaultdict(list)
    for n, (code, _) in enumerate(distinct):
        if code in LANGUAGES:
            by_language[code].append(n)
    units: list[str | None] = [None] * len(distinct)
    lost = [""] * len(distinct)
    for code, rows in by_language.items():
        units_column, lost_column = frontend.unit_columns([distinct[n][1] for n in rows], code)
        for n, u, lost_chars in zip(rows, units_column, lost_column):
            units[n], lost[n] = u, lost_chars
    return at, units, lost, sum(map(len, by_language.values()))


def _coded(values: list[Any], kind: type = np.int32) -> tuple[list[Any], np.ndarray]:
    """The distinct ``values`` in first-seen order, and each value's place there (``kind``)."""
    names = list(dict.fromkeys(values))
    if len(names) == len(values):  # each value once (a column of texts often is): its place is its own
        return names, np.arange(len(values), dtype=kind)
    place = dict(zip(names, range(len(names))))
    return names, np.fromiter(map(place.__getitem__, values), kind, len(values))


def unit_symbols(blob: bytes) -> set[str]:
    """The characters of UTF-8 ``blob``, each once (of ASCII, counted over its bytes in C)."""
    if blob.isascii():
        return set(bytes(np.flatnonzero(np.bincount(np.frombuffer(blob, np.uint8), minlength=128)).tolist())
                   .decode("ascii"))
    return set(blob.decode("utf-8", ENCODING_ERRORS))


def _tab_lines(columns: list[list[str]]) -> tuple[np.ndarray, bytes]:
    """``pack_strings`` of each row of ``columns`` as a line, its values joined by tabs (as
    :func:`agreement.metadata_fingerprint` hashes an entry): one join where they are ASCII."""
    joined = "\n".join(map("\t".join, zip(*columns))) + ("\n" if columns[0] else "")
    if not joined.isascii():
        return pack_strings(["\t".join(row) + "\n" for row in zip(*columns)])
    offsets = np.zeros(len(columns[0]) + 1, np.int64)
    lengths = sum(np.fromiter(map(len, column), np.int64, len(column)) for column in columns)
    np.cumsum(lengths + len(columns), out=offsets[1:])
    return offsets, joined.encode("ascii")


def _suffixed(packed: tuple[np.ndarray, bytes], values: list[str], suffix: str) -> tuple[np.ndarray, bytes]:
    """``pack_strings([v + suffix for v in values])`` from ``packed``, ``pack_strings(values)``: one join."""
    size = len(suffix.encode("utf-8"))
    return (packed[0] + size * np.arange(len(values) + 1),
            "".join((suffix.join(values), suffix if values else "")).encode("utf-8", ENCODING_ERRORS))


def widest(offsets: np.ndarray) -> int:
    """The longest of the strings at ``offsets`` (0 when there are none)."""
    return int(np.diff(offsets).max()) if len(offsets) > 1 else 0


def fixed_width(offsets: np.ndarray, blob: bytes, width: int) -> np.ndarray:
    """Strings of (offsets, blob) as numpy ``S{width}``, zero-padded (bytes order is str order for UTF-8)."""
    starts, lengths = offsets[:-1], np.diff(offsets)
    if len(lengths) and (lengths == width).all():  # ids all as long (often so): the blob as it is
        return np.frombuffer(blob, f"S{width}", len(lengths))
    raw = np.frombuffer(blob, np.uint8)
    keys = np.zeros((len(starts), width), np.uint8)
    for k in range(width):
        has = np.flatnonzero(lengths > k)
        keys[has, k] = raw[starts[has] + k]
    return keys.view(f"S{width}").ravel()

