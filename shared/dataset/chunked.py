"""A large manifest whose clips all give their durations, indexed in pieces (pieces.py) by helper
processes and merged: ids repeated across pieces, the rejections' order, the vocabulary, the
lost-character report and the fingerprints, so that the index and its cache file are the
one-process build's.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np
from ..config import DataConfig, FeaturesConfig, TextConfig
from ..dataset.agreement import FINGERPRINT_HEX
from ..dataset.cache import (PROBE_FIELDS, REJECTION_FIELDS, UNITS_FIELDS, columns_of, index_key_of, pack_index,
                             read_cache, write_cache)
from ..dataset.groups import number_groups
from ..dataset.indexed import DatasetIndex, finished_index
from ..dataset.parallel import index_workers, shared_work
from ..dataset.pieces import fixed_width, manifest_chunk, manifest_ranges, unit_symbols, widest
from ..dataset.reuse import loaded_index
from ..dataset.rules import LostReport
from ..dataset.table import ENCODING_ERRORS, NUMBER_COLUMNS, STRING_COLUMNS, SampleTable, sorts_as_str
from ..dataset.types import IndexStats
from ..layouts import Rejection
from ..text import Frontend
from ..vocab import Vocabulary

log = logging.getLogger(__name__)

# A manifest whose clips all give their durations needs no audio header: its index is its lines
# through the JSON parser, the text front-end and the rules, which worker processes do a piece
# of the file each (pieces.py), each piece becoming columns rather than an object
# per clip, and its ids sorted. What spans pieces is done here after: ids repeated in two
# pieces, the order of the rejections, the vocabulary, the lost-character report and the
# dataset fingerprints (the pieces' sorted ids merged), so that the index (and its cache file)
# is the one the one-process build makes. This process only takes the pieces' columns in while
# the workers run (a piece's are megabytes: a worker would wait for this one to read them).


# A manifest at least this large is built in pieces; a smaller one in one pass (its build takes
# a second or two, less than the helper processes take to start).
CHUNKED_MIN_BYTES = 32 << 20


# A piece of a manifest given to one worker: some 60,000 clips of a typical manifest (the
# columns it sends back are about its size), many pieces so that the last ones balance the load.
BUILD_CHUNK_BYTES = 8 << 20


# Rows at a time when hashing the fingerprints' lines in id order (a gather index of
# about 8 bytes per byte of those rows).
FINGERPRINT_ROWS = 1 << 16


def _run_chunks(fn: Callable[..., dict[str, Any] | None], tasks: list[tuple],
                workers: int) -> tuple[list[dict[str, Any] | None], int]:
    """``fn`` of every piece's task, in order: in ``workers`` helper processes (this one taking
    their columns in) or, ``workers`` 1, in this one."""
    return shared_work(fn, tasks, workers if workers > 1 else 0, "manifest indexing", here=False)


def build_manifest(root: Path, data: DataConfig, features: FeaturesConfig, text: TextConfig, frontend: Frontend,
                   config: dict[str, Any], candidates: list[Path], manifest_sha256: str, digest: str,
                   started: float, pieces: tuple[Callable[..., Any], list[tuple]] | None = None,
                   named: Callable[[Rejection], Rejection] | None = None) -> DatasetIndex | None:
    """The index of a manifest whose clips all give their durations, built in pieces (the
    module's comment); None when a clip gives none (then the one-process build reads its
    header). ``pieces``: the work of each piece (a function and its tasks) where it is not the
    manifest's byte ranges (Parquet files: parquet_pieces.py); ``named``: what a line's rejection
    becomes there (a row's, naming it). A cache file of the same content
    is loaded before anything is parsed (the manifest's stamp changed, not its bytes);
    ``digest``: what the cache file written is found by (:func:`manifest_hit`)."""
    key = index_key_of(bytes.fromhex(manifest_sha256), {}, config)
    cache_path, cached, state = read_cache(candidates, key) if candidates else (None, None, "off")
    if state == "hit" and cached is not None:
        try:
            loaded = loaded_index(cached, None)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("index cache %s is unusable (%s); rebuilding the index", cache_path, exc)
            state = "corrupt"
        else:
            stats = IndexStats(cache="hit", cache_file=str(cache_path))
            return finished_index(root, *loaded, key, stats, started, False, None, data)
    read_started = time.perf_counter()
    if pieces is None:
        path = root / data.metadata_file
        try:
            ranges = manifest_ranges(path, BUILD_CHUNK_BYTES)
        except OSError:
            return None  # the one-process build says why
        pieces = (manifest_chunk, [(str(path), *piece, data, features, text) for piece in ranges])
    chunks, workers = _run_chunks(*pieces, max(1, index_workers(data)))
    if any(chunk is None for chunk in chunks):
        log.info("%s has clips without a duration: their audio headers are read", root / data.metadata_file)
        return None
    stats = IndexStats(cache=state, workers=workers)
    parts: list[dict[str, Any]] = chunks  # type: ignore[assignment]
    return _merged(root, data, frontend, config, candidates, (key, digest, manifest_sha256), parts, stats,
                   (started, read_started), named)


def _merged(root: Path, data: DataConfig, frontend: Frontend, config: dict[str, Any], candidates: list[Path],
            keys: tuple[str, str, str], parts: list[dict[str, Any]], stats: IndexStats,
            times: tuple[float, float], named: Callable[[Rejection], Rejection] | None) -> DatasetIndex:
    """The index of the pieces' columns merged (the module's comment), written to the cache under
    ``keys`` (the index key, the digest it is found by, the manifest's SHA-256)."""
    key, digest, manifest_sha256 = keys
    stats.texts_tokenized = sum(p["tokenized"] for p in parts)
    parsed = [r for p in parts for r in p["parsed"]] + _repeated_ids(parts)
    parsed.sort(key=lambda r: r.line)  # as one pass over the lines finds them
    for p in parts:
        _drop_repeated(p)
    if named is not None:
        parsed = [named(r) for r in parsed]
    rejected = parsed + [r for p in parts for _, r in p["rejected"]]
    report = LostReport()
    for p in parts:
        for _, sample_id, lost_chars in p["lost"]:
            report.add(sample_id, lost_chars)
    lost = report.to_json()
    agreed, by_id = _manifest_fingerprints(parts, manifest_sha256)
    table = _concatenated(parts, _table_id_order(parts, by_id))
    number_groups(table)
    stats.read_s = time.perf_counter() - times[1]
    seen: set[str] = set()
    for p in parts:
        seen.update(p["seen"])
    vocab = Vocabulary.build(frontend, ["".join(sorted(seen))], table.languages, table.speakers)
    if candidates:
        header = {"key": key, "root": str(root), "config": config, "rejected": columns_of(rejected, REJECTION_FIELDS),
                  "lost": lost, "vocabulary": vocab.state_dict(), "agreement": agreed,
                  "manifest": {"digest": digest, "measured": []},
                  "names": {"speakers": table.speakers, "languages": table.languages}}
        written = write_cache(candidates, pack_index(header, {**table.sections(),
                                                              "reuse": _reuse(frontend, parts, parsed, table)}))
        stats.cache_file = str(written) if written else ""
    return finished_index(root, table, rejected, lost, agreed, vocab, key, stats, times[0], True, None, data)


def _reuse(frontend: Frontend, parts: list[dict[str, Any]], parsed: list[Rejection], table: SampleTable) -> bytes:
    """The cache file's section of what a rebuild reuses: no audio header (none was read), and
    the units of the texts the samples do not hold (:func:`_listed`)."""
    listed = _listed(parts, parsed, table)
    return msgpack.packb({"probes": {f: [] for f in PROBE_FIELDS},
                          "units": {"frontend": [frontend.name, frontend.cache_key()],
                                    **{f: [row[i] for row in listed] for i, f in enumerate(UNITS_FIELDS)}}},
                         use_bin_type=True)


def _repeated_ids(parts: list[dict[str, Any]]) -> list[Rejection]:
    """The rejections of ids repeated in a later piece than their first (each piece found its
    own); the entries they reject are marked in ``part["drop"]`` (positions in that piece). Only
    the entries whose id hashes collide are looked at, in file order."""
    for p in parts:
        p["drop"] = []
    if not parts:
        return []
    hashes = np.concatenate([p["hashes"] for p in parts])
    order = np.argsort(hashes)  # not stable: the few entries that collide are put in file order below
    ranked = hashes[order]
    same = np.flatnonzero(ranked[1:] == ranked[:-1])
    if not len(same):
        return []
    colliding = np.sort(order[np.unique(np.concatenate([same, same + 1]))])
    colliding = colliding[np.argsort(hashes[colliding], kind="stable")]  # by hash, each in file order
    bases = np.cumsum([0] + [len(p["hashes"]) for p in parts])
    pieces = np.searchsorted(bases, colliding, side="right") - 1
    out = []
    firsts: dict[str, int] = {}
    for k, n in zip(pieces.tolist(), (colliding - bases[pieces]).tolist()):
        offsets, blob = parts[k]["ids"]
        sample_id = blob[offsets[n]:offsets[n + 1]].decode("utf-8", ENCODING_ERRORS)
        line = int(parts[k]["lines"][n])
        if sample_id not in firsts:
            firsts[sample_id] = line
        else:
            out.append(Rejection(sample_id, f"duplicate id on manifest line {line} (first on line "
                                            f"{firsts[sample_id]})", line=line))
            parts[k]["drop"].append(n)
    return out


def _drop_repeated(part: dict[str, Any]) -> None:
    """Take the entries :func:`_repeated_ids` rejected out of a piece's results; note the symbols
    of its samples' units (``part["seen"]``) for the vocabulary."""
    drop = set(part["drop"])
    if not drop:
        return
    for name in ("rejected", "lost", "listed"):
        part[name] = [row for row in part[name] if row[0] not in drop]
    gone = part["rows"][sorted(drop)]
    keep = np.setdiff1d(np.arange(len(part["numbers"]["num_frames"])), gone[gone >= 0])
    part["numbers"] = {name: col[keep] for name, col in part["numbers"].items()}
    for name, (offsets, blob) in part["strings"].items():
        part["strings"][name] = _taken(offsets, blob, keep)
    part["seen"] = unit_symbols(part["strings"]["units"][1])


def _taken(offsets: np.ndarray, blob: bytes, rows: np.ndarray) -> tuple[np.ndarray, bytes]:
    """(offsets, blob) of the strings ``rows`` of (offsets, blob)."""
    pieces = [blob[offsets[n]:offsets[n + 1]] for n in rows.tolist()]
    out = np.zeros(len(pieces) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, pieces), np.int64, len(pieces)), out=out[1:])
    return out, b"".join(pieces)


def _concatenated(parts: list[dict[str, Any]], id_order: np.ndarray | None) -> SampleTable:
    """The samples of every piece as one table, speaker and language codes into sorted names;
    ``id_order``: its rows in id order (None: the table sorts its ids when asked)."""
    speakers = sorted({p["speakers"][n] for p in parts for n in _used(p["numbers"]["speaker"], len(p["speakers"]))})
    languages = sorted({p["languages"][n] for p in parts
                        for n in _used(p["numbers"]["language"], len(p["languages"]))})
    codes = {"speaker": {name: n for n, name in enumerate(speakers)},
             "language": {name: n for n, name in enumerate(languages)}}
    numbers = {}
    for name, kind in NUMBER_COLUMNS.items():
        cols = []
        for p in parts:
            col = p["numbers"][name]
            if name in codes:
                local = p[f"{name}s"]
                lookup = np.array([codes[name].get(n, -1) for n in local], np.int32)
                col = lookup[col] if len(col) else col
            cols.append(np.asarray(col, kind))
        numbers[name] = np.concatenate(cols) if cols else np.zeros(0, kind)
    strings = {}
    for name in STRING_COLUMNS:
        offsets = np.empty(sum(len(p["strings"][name][0]) - 1 for p in parts) + 1, np.int64)
        row = base = 0
        for p in parts:
            piece, blob = p["strings"][name]
            np.add(piece[:-1], base, out=offsets[row:row + len(piece) - 1])
            row, base = row + len(piece) - 1, base + len(blob)
        offsets[-1] = base
        strings[name] = (offsets, b"".join(p["strings"][name][1] for p in parts))
    return SampleTable(numbers, strings, speakers, languages, id_order=id_order)


def _used(codes: np.ndarray, names: int) -> list[int]:
    """The codes (0 to ``names`` - 1) that ``codes`` holds, each once, in order."""
    return np.flatnonzero(np.bincount(codes, minlength=names)).tolist()


def _table_id_order(parts: list[dict[str, Any]], by_id: np.ndarray) -> np.ndarray | None:
    """The table's rows in id order (SampleTable.id_order) from the fingerprints' sort of every
    entry the pieces kept (``by_id``: positions in those entries, one piece after the other): the
    entries that became samples, as rows, with no second sort. None where the ids' bytes do not
    sort as the ids do (table.sorts_as_str): the table sorts them itself when asked."""
    if not all(sorts_as_str(p["strings"]["id"][1]) for p in parts):
        return None
    sampled = []
    for p in parts:
        kept = np.ones(len(p["lines"]), bool)
        kept[np.asarray(p["drop"], np.int64)] = False
        sampled.append(p["rows"][kept] >= 0)
    became = np.concatenate(sampled) if sampled else np.zeros(0, bool)
    rows = np.cumsum(became) - 1  # an entry's row in the table, where it became a sample
    return rows[by_id[became[by_id]]]


def _listed(parts: list[dict[str, Any]], parsed: list[Rejection], table: SampleTable) -> list[tuple[str, str, str,
                                                                                                       str]]:
    """What :func:`cache_payload` lists of the units (texts that lost characters, and the clips rejected or
    named by a rejection), in file order, one row per text."""
    rows: list[tuple[int, str, str, str, str]] = [(int(p["lines"][n]), *rest) for p in parts
                                                  for n, *rest in p["listed"]]
    named = sorted({r.id for r in parsed})
    for row in (r for r in table.find_rows(named) if r >= 0) if named else ():
        language = table.languages[int(table.column("language")[row])]
        rows.append((int(table.column("line")[row]), language, table.string("text", row), table.string("units", row),
                     ""))
    out: dict[tuple[str, str], tuple[str, str, str, str]] = {}
    for _, language, spoken, made, lost_chars in sorted(rows, key=lambda row: row[0]):
        out.setdefault((language, spoken), (language, spoken, made, lost_chars))
    return list(out.values())


def _manifest_fingerprints(parts: list[dict[str, Any]], manifest_sha256: str) -> tuple[dict[str, Any], np.ndarray]:
    """:func:`agreement.fingerprints` of the pieces' entries (every clip measured by its
    duration): their lines hashed in id order; and that order (positions in the entries the
    pieces kept, one piece after the other), merged from each piece's own (``part["id_order"]``)."""
    kept = [np.setdiff1d(np.arange(len(p["lines"])), np.asarray(p["drop"], np.int64)) if p["drop"] else None
            for p in parts]
    ids = [_taken(*p["ids"], k) if k is not None else p["ids"] for p, k in zip(parts, kept)]
    lines = [_taken(*p["metadata_lines"], k) if k is not None else p["metadata_lines"] for p, k in zip(parts, kept)]
    width = max([1] + [widest(o) for o, _ in ids])
    keys = np.concatenate([fixed_width(o, b, width) for o, b in ids]) if ids else np.zeros(0, f"S{width}")
    runs, base = [], 0
    for p, k in zip(parts, kept):
        run = p["id_order"]
        if k is not None:  # positions among the entries kept
            at = np.full(len(p["lines"]), -1, np.int64)
            at[k] = np.arange(len(k))
            run = at[run]
            run = run[run >= 0]
        runs.append(run + base)
        base += len(run)
    runs_order = np.concatenate(runs) if runs else np.zeros(0, np.int64)
    order = runs_order[np.argsort(keys[runs_order], kind="stable")]  # the sorted runs merged (timsort finds them)
    meta = _gathered_digest(lines, order)
    audio = _gathered_digest([_taken(*p["audio_lines"], k) if k is not None else p["audio_lines"]
                              for p, k in zip(parts, kept)], order)
    return {"metadata": meta, "audio": audio, "missing": 0, "metadata_sha256": manifest_sha256}, order


def _gathered_digest(columns: list[tuple[np.ndarray, bytes]], order: np.ndarray) -> str:
    """:func:`agreement._digest` of the strings of the concatenated (offsets, blob) pieces, taken in ``order``."""
    digest = hashlib.sha256()
    if (order == np.arange(len(order))).all():  # the ids in file order already (often so): no gather
        for _, piece in columns:
            digest.update(piece)
        return digest.hexdigest()[:FINGERPRINT_HEX]
    bases = np.cumsum([0] + [len(b) for _, b in columns])
    offsets = np.concatenate([o[:-1] + base for (o, _), base in zip(columns, bases)] + [bases[-1:]])
    blob = np.frombuffer(b"".join(b for _, b in columns), np.uint8)
    for first in range(0, len(order), FINGERPRINT_ROWS):
        rows = order[first:first + FINGERPRINT_ROWS]
        starts, lengths = offsets[rows], offsets[rows + 1] - offsets[rows]
        at = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) + np.arange(lengths.sum())
        digest.update(blob[at].tobytes())
    return digest.hexdigest()[:FINGERPRINT_HEX]
