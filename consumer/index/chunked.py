"""A large manifest whose clips all give their durations, indexed in pieces (pieces.py) by helper
processes, each piece spilled to a run file (spill.py), and merged on disk into the cache file:
ids repeated across pieces, the rejections' order, the vocabulary, the lost-character report and
the fingerprints, so that the index and its cache file are the one-process build's, and the
build's memory is a piece and a block per piece, however large the manifest.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import msgpack
import numpy as np
from ...shared.config import DataConfig, FeaturesConfig, TextConfig
from ...shared.dataset.agreement import FINGERPRINT_HEX
from ...shared.dataset.cache import (PROBE_FIELDS, REJECTION_FIELDS, STALE_CACHE, UNITS_FIELDS, CachedIndex,
                                     IndexWriter, columns_of, index_key_of, open_index, read_cache, write_cache_with)
from .groups import number_groups
from .indexed import DatasetIndex, finished_index
from .parallel import index_workers, shared_work
from .pieces import fixed_width, manifest_chunk, manifest_ranges, unit_symbols, widest
from .reuse import cached_table, loaded_index
from .rules import LostReport
from .spill import Run, gathered, merged, remove_spill, span_strings, spill_dir, write_run
from ...shared.dataset.table import (ENCODING_ERRORS, GROUPS_SECTION, ID_ORDER_SECTION, NUMBER_COLUMNS, STRING_COLUMNS,
                                     UNITS_AS_TEXT, SampleTable, _same_strings, sorts_as_str)
from ...shared.dataset.types import IndexStats
from ...shared.dataset.layouts import Rejection
from ...shared.text import Frontend
from ...shared.vocab import Vocabulary

log = logging.getLogger(__name__)

# A manifest whose clips all give their durations needs no audio header: its index is its lines
# through the JSON parser, the text front-end and the rules, which worker processes do a piece
# of the file each (pieces.py), each piece becoming columns rather than an object per clip,
# written to a run file of its own (its ids sorted, with their lines in that order). What spans
# pieces is done here after, reading the runs a block at a time: ids repeated in two pieces (the
# runs' sorted id hashes merged), the order of the rejections, the vocabulary, the lost-character
# report, the dataset fingerprints and the rows in id order (the runs' sorted ids merged), each
# section of the cache file streamed into it, so that the index (and its cache file) is the one
# the one-process build makes.


# A manifest at least this large is built in pieces; a smaller one in one pass (its build takes
# a second or two, less than the helper processes take to start).
CHUNKED_MIN_BYTES = 32 << 20


# A piece of a manifest given to one worker: some 60,000 clips of a typical manifest (its run
# file is about its size), many pieces so that the last ones balance the load.
BUILD_CHUNK_BYTES = 8 << 20


# The first of a run file's sections that only the repeated ids need (_repeated_ids, _drop_repeated):
# it and those after it are given back before the cache file is written.
RELEASED_FIRST = "rows"


class RunsReleased(RuntimeError):
    """A cache file's write, tried again after a failure, finds the run files already given back."""


# What a spilled piece keeps in memory: its results that are not columns (rejections, lost
# characters, the units listed apart, the names), a few of each piece.
SMALL_RESULTS = ("parsed", "tokenized", "rejected", "lost", "seen", "speakers", "languages")


def _run_chunks(fn: Callable[..., dict[str, Any] | None], tasks: list[tuple],
                workers: int) -> tuple[list[dict[str, Any] | None], int]:
    """``fn`` of every piece's task, in order, in ``workers`` processes (this one included)."""
    return shared_work(fn, tasks, workers - 1, "manifest indexing")


def spilled_piece(path: str, fn: Callable[..., dict[str, Any] | None], task: tuple) -> dict[str, Any] | None:
    """``fn(*task)`` (a piece's columns: pieces.py) written to the run file ``path``, and what
    the merge keeps of it in memory (:data:`SMALL_RESULTS`, sizes and flags); None as ``fn``.
    Runs in worker processes, and in this one."""
    piece = fn(*task)
    if piece is None:
        return None
    ids, order = piece["ids"], piece["id_order"]
    hash_order = np.argsort(piece["hashes"], kind="stable")
    width = max(1, widest(ids[0]))
    # The sections in the reverse of the order the merge is done with them (RELEASED_FIRST, then
    # _Merge.write's columns, then its id merge's), each given back as soon as it is (Run.release).
    arrays: dict[str, Any] = {"key": fixed_width(*ids, width)[order], "rid": piece["rows"][order],
                              "order": order.astype(np.int64)}
    for name in ("metadata_lines", "audio_lines"):
        offsets, blob = _taken(*piece[name], order)
        arrays[f"{name}.o"], arrays[f"{name}.s"] = offsets, blob
    for name in reversed(STRING_COLUMNS):
        arrays[f"c.{name}.o"], arrays[f"c.{name}.s"] = piece["strings"][name]
    arrays.update({f"n.{name}": piece["numbers"][name] for name in reversed(NUMBER_COLUMNS)})
    arrays.update({RELEASED_FIRST: piece["rows"], "lines": piece["lines"], "ids.o": ids[0], "ids.s": ids[1],
                   "h": piece["hashes"][hash_order], "hpos": hash_order.astype(np.int64)})
    write_run(Path(path), {}, arrays)
    strings = piece["strings"]
    return {**{name: piece[name] for name in SMALL_RESULTS}, "path": path,
            "listed": [(n, int(piece["lines"][n]), *rest) for n, *rest in piece["listed"]],
            "entries": len(piece["lines"]), "samples": len(piece["rows"][piece["rows"] >= 0]), "width": width,
            "sorts": sorts_as_str(strings["id"][1]),
            "units_as_text": _same_strings(strings[UNITS_AS_TEXT[0]], strings[UNITS_AS_TEXT[1]]),
            "line_bytes": len(arrays["metadata_lines.s"]) + len(arrays["audio_lines.s"])}


def build_manifest(root: Path, data: DataConfig, features: FeaturesConfig, text: TextConfig, frontend: Frontend,
                   config: dict[str, Any], candidates: list[Path], manifest_sha256: str, digest: str,
                   started: float, pieces: tuple[Callable[..., Any], list[tuple]] | None = None,
                   named: Callable[[Rejection, int], Rejection] | None = None, release: bool = True,
                   repeated: str | tuple[str, ...] = "duplicate id on manifest line",
                   datasets: tuple[int, ...] = ()) -> DatasetIndex | None:
    """The index of a manifest whose clips all give their durations, built in pieces (the
    module's comment); None when a clip gives none (then the one-process build reads its
    header). ``pieces``: the work of each piece (a function and its tasks) where it is not the
    manifest's byte ranges (Parquet files: parquet_pieces.py; a cut manifest's blocks:
    cuts_pieces.py; a mix's parts: mix_pieces.py); ``named``: what a line's rejection of dataset
    ``n`` becomes there (a row's, naming it; a mix's part's, prefixed), ``named(rejection, n)``;
    ``repeated``: the words of an id repeated in a later piece than its first (one per dataset of
    a mix); ``datasets``: the dataset (of a mix) each piece is of, the rejections ordered by
    (dataset, line) as one pass over the parts in turn finds them. A cache file of the same content
    is loaded before anything is parsed (the manifest's stamp changed, not its bytes);
    ``digest``: what the cache file written is found by (:func:`manifest_hit`). ``release``: the
    run files given back as the merge is done with them (the build's peak disk is its runs', not
    its runs' and its cache file's); a cache file whose write fails after that is built again
    without it, for the next place to take it."""
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
    if state == "stale":
        log.info(STALE_CACHE, cache_path)
    read_started = time.perf_counter()
    if pieces is None:
        path = root / data.metadata_file
        try:
            ranges = manifest_ranges(path, BUILD_CHUNK_BYTES)
        except OSError:
            return None  # the one-process build says why
        pieces = (manifest_chunk, [(str(path), *piece, data, features, text) for piece in ranges])
    spill = spill_dir(candidates)
    try:
        fn, tasks = pieces
        chunks, workers = _run_chunks(spilled_piece, [(str(spill / f"piece-{n}.run"), fn, task)
                                                      for n, task in enumerate(tasks)],
                                      max(1, index_workers(data)))
        if any(chunk is None for chunk in chunks):
            log.info("%s has clips without a duration: their audio headers are read", root / data.metadata_file)
            return None
        stats = IndexStats(cache=state, workers=workers)
        parts: list[dict[str, Any]] = chunks  # type: ignore[assignment]
        for p, dataset in zip(parts, datasets or (0,) * len(parts)):
            p["dataset"] = dataset
        runs = [Run(Path(p["path"])) for p in parts]
        try:
            return _merged(root, data, frontend, config, candidates, (key, digest, manifest_sha256), parts, runs,
                           spill, stats, (started, read_started), (named, repeated), release)
        except RunsReleased:
            log.warning("the index cache of %s could not be written where first tried; building it again",
                        root / data.metadata_file)
        finally:
            for run in runs:
                run.close()
    finally:
        remove_spill(spill)
    return build_manifest(root, data, features, text, frontend, config, candidates, manifest_sha256, digest, started,
                          pieces, named, release=False, repeated=repeated, datasets=datasets)


def _merged(root: Path, data: DataConfig, frontend: Frontend, config: dict[str, Any], candidates: list[Path],
            keys: tuple[str, str, str], parts: list[dict[str, Any]], runs: list[Run], spill: Path,
            stats: IndexStats, times: tuple[float, float],
            wording: tuple[Callable[[Rejection, int], Rejection] | None, str | tuple[str, ...]],
            release: bool) -> DatasetIndex:
    """The index of the spilled pieces merged (the module's comment), its cache file written
    under ``keys`` (the index key, the digest it is found by, the manifest's SHA-256) to the
    first candidate that takes it, else to a file in ``spill`` (removed once mapped)."""
    key, digest, manifest_sha256 = keys
    named, repeated = wording
    stats.texts_tokenized = sum(p["tokenized"] for p in parts)
    words = (repeated,) if isinstance(repeated, str) else repeated
    found = [(p["dataset"], r) for p in parts for r in p["parsed"]] + _repeated_ids(parts, runs, words)
    found.sort(key=lambda pair: (pair[0], pair[1].line))  # as one pass over the lines (of each part) finds them
    for p, run in zip(parts, runs):
        _drop_repeated(p, run)
    parsed = [r for _, r in found] if named is None else [named(r, dataset) for dataset, r in found]
    rejected = parsed + [r for p in parts for _, r in p["rejected"]]
    report = LostReport()
    for p in parts:
        for _, sample_id, lost_chars in p["lost"]:
            report.add(sample_id, lost_chars)
    lost = report.to_json()
    seen: set[str] = set()
    for p in parts:
        seen.update(p["seen"])
    speakers, languages = _names(parts, runs, "speaker"), _names(parts, runs, "language")
    if release:
        for run in runs:
            run.release(RELEASED_FIRST)
    vocab = Vocabulary.build(frontend, ["".join(sorted(seen))], languages, speakers)
    header = {"key": key, "root": str(root), "config": config, "rejected": columns_of(rejected, REJECTION_FIELDS),
              "lost": lost, "vocabulary": vocab.state_dict(), "agreement": {},
              "manifest": {"digest": digest, "measured": []},
              "names": {"speakers": speakers, "languages": languages}}
    merge = _Merge(frontend, parts, runs, parsed, header, manifest_sha256, release)
    written = write_cache_with(candidates, merge.write) if candidates else None
    path = written
    if path is None:
        path = spill / "index.idx"
        with open(path, "w+b") as f:
            merge.write(f)
    cached = open_index(path, check=False)
    cached.checked = True  # written just now, by this process
    stats.cache_file = str(written) if written else ""
    stats.read_s = time.perf_counter() - times[1]
    table = cached_table(cached)
    return finished_index(root, table, rejected, lost, merge.agreed, vocab, key, stats, times[0], True, None, data)


class _Merge:
    """The cache file of the spilled pieces, written section by section (:meth:`write`, again
    for another candidate when one fails): the columns piece by piece, the rows in id order and
    the fingerprints from the pieces' sorted ids merged (:attr:`agreed`), the clips' groups and
    what a rebuild reuses from the table written so far, then the header. ``release``: each run
    section given back once written (:meth:`_done`); a second write then raises RunsReleased."""

    def __init__(self, frontend: Frontend, parts: list[dict[str, Any]], runs: list[Run], parsed: list[Rejection],
                 header: dict[str, Any], manifest_sha256: str, release: bool) -> None:
        self.frontend, self.parts, self.runs, self.parsed = frontend, parts, runs, parsed
        self.header, self.manifest_sha256 = header, manifest_sha256
        self.release, self.released = release, False
        self.agreed: dict[str, Any] = {}
        names = header["names"]
        self.codes = {"speaker": {name: n for n, name in enumerate(names["speakers"])},
                      "language": {name: n for n, name in enumerate(names["languages"])}}
        self.bases = np.cumsum([0] + [p["samples"] - len(p["gone"]) for p in parts]).tolist()

    def write(self, f: BinaryIO) -> None:
        if self.released:
            raise RunsReleased("the run files were given back to the first write")
        writer = IndexWriter(f)
        for name, kind in NUMBER_COLUMNS.items():
            writer.add(f"n.{name}", self._numbers(name, kind))
        for name in STRING_COLUMNS:
            if name == UNITS_AS_TEXT[0] and all(p["units_as_text"] for p in self.parts):
                for k in range(len(self.runs)):  # the texts' sections serve both (SampleTable.sections)
                    self._done(k, f"c.{name}.o")
                continue
            writer.add(f"o.{name}", self._offsets(name))
            writer.add(f"s.{name}", self._blobs(name))
        rows = self._id_merge()
        if all(p["sorts"] for p in self.parts):
            writer.add(ID_ORDER_SECTION, rows)
        else:  # bytes order is not str order: the table sorts its ids as the one-process build does
            for _ in rows:
                pass
            writer.add(ID_ORDER_SECTION, self._table(f, writer).id_order())
        table = self._table(f, writer)
        number_groups(table)
        groups = table.stored_groups()
        if groups is not None:
            writer.add(GROUPS_SECTION, np.ascontiguousarray(groups, np.int64))
        writer.add("reuse", _reuse(self.frontend, self.parts, self.parsed, table))
        writer.finish({**self.header, "agreement": self.agreed})  # in its place (the one-process build's order)

    def _done(self, k: int, name: str) -> None:
        """Run ``k``'s section ``name``, and those after it, given back (spilled_piece's layout):
        each run's as soon as the cache file holds what it gave, so that the disk holds the runs and
        one piece's column at most."""
        if self.release:
            self.released = True
            self.runs[k].release(name)

    def _table(self, f: BinaryIO, writer: IndexWriter) -> SampleTable:
        """The table of the sections written so far, the file mapped (its blobs read with pread)."""
        f.flush()
        view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        sections = {name: view[writer.start + offset:writer.start + offset + nbytes]
                    for name, (offset, nbytes, _) in writer.table.items()}
        cached = CachedIndex({"names": self.header["names"], "sections": writer.table}, sections, view, writer.start,
                             checked=True, reader=f)
        return cached_table(cached)

    def _kept(self, k: int) -> np.ndarray | None:
        """The rows of piece ``k``'s samples that a later piece's repeat did not take (None: all)."""
        gone = self.parts[k]["gone"]
        return np.setdiff1d(np.arange(self.parts[k]["samples"]), gone) if len(gone) else None

    def _numbers(self, name: str, kind: Any) -> Iterator[np.ndarray]:
        for k, (p, run) in enumerate(zip(self.parts, self.runs)):
            col = run.array(f"n.{name}", kind)
            kept = self._kept(k)
            if kept is not None:
                col = col[kept]
            if name in self.codes:
                lookup = np.array([self.codes[name].get(n, -1) for n in p[f"{name}s"]], np.int32)
                col = lookup[col] if len(col) else col
            yield np.ascontiguousarray(col, kind)
            self._done(k, f"n.{name}")

    def _strings(self, k: int, name: str) -> tuple[np.ndarray, bytes]:
        offsets, blob = self.runs[k].strings(f"c.{name}")
        kept = self._kept(k)
        return _taken(offsets, blob, kept) if kept is not None else (offsets, blob)

    def _offsets(self, name: str) -> Iterator[np.ndarray]:
        base = 0
        for k in range(len(self.parts)):
            offsets, blob = self._strings(k, name)
            yield offsets[:-1] + base
            base += len(blob)
        yield np.array([base], np.int64)

    def _blobs(self, name: str) -> Iterator[bytes]:
        for k in range(len(self.parts)):
            yield self._strings(k, name)[1]
            self._done(k, f"c.{name}.o")

    def _id_merge(self) -> Iterator[np.ndarray]:
        """The table's rows in id order, a round of the merge at a time, and on the way the
        fingerprints (:func:`agreement.fingerprints`: the entries' lines hashed in id order) set
        in :attr:`agreed`. Equal ids (repeats, one of them dropped) in file order."""
        width = max([1] + [p["width"] for p in self.parts])
        entries = max(1, sum(p["entries"] for p in self.parts))
        row_bytes = 16 + sum(p["line_bytes"] for p in self.parts) // entries
        dropped = [np.sort(np.flatnonzero(np.isin(run.array("order", np.int64), p["drop"])))
                   for p, run in zip(self.parts, self.runs)]
        digests = {"metadata": hashlib.sha256(), "audio": hashlib.sha256()}
        dtypes = [f"S{p['width']}" for p in self.parts]
        ends = [run.length("key", dtype) for run, dtype in zip(self.runs, dtypes)]
        for _, perm, spans in merged(self.runs, "key", dtypes, f"S{width}", row_bytes):
            keep = np.concatenate([~np.isin(np.arange(first, stop), dropped[k]) for k, first, stop in spans])
            order = perm[keep[perm]]
            for name, column in (("metadata", "metadata_lines"), ("audio", "audio_lines")):
                digests[name].update(gathered(*span_strings(self.runs, column, spans), order))
            rows = np.concatenate([self._rows(k, first, stop) for k, first, stop in spans])[order]
            for k, _, stop in spans:
                if stop == ends[k]:  # the run's last key: merged reads it no more
                    self._done(k, "key")
            yield rows[rows >= 0]
        self.agreed = {"metadata": digests["metadata"].hexdigest()[:FINGERPRINT_HEX],
                       "audio": digests["audio"].hexdigest()[:FINGERPRINT_HEX], "missing": 0,
                       "metadata_sha256": self.manifest_sha256}

    def _rows(self, k: int, first: int, stop: int) -> np.ndarray:
        """The table rows of piece ``k``'s entries ``first:stop`` in its id order (-1: no sample)."""
        rows = self.runs[k].array("rid", np.int64, first, stop).copy()
        sampled = rows >= 0
        gone = self.parts[k]["gone"]
        rows[sampled] = self.bases[k] + rows[sampled] - np.searchsorted(gone, rows[sampled])
        return rows


def _names(parts: list[dict[str, Any]], runs: list[Run], name: str) -> list[str]:
    """The sorted names of column ``name`` (speaker, language) that the pieces' samples use."""
    used: set[str] = set()
    for p, run in zip(parts, runs):
        local = p[f"{name}s"]
        if len(p["gone"]):
            codes = np.delete(run.array(f"n.{name}", np.int32), p["gone"])
            used.update(local[n] for n in np.flatnonzero(np.bincount(codes, minlength=len(local))).tolist())
        else:
            used.update(local)
    return sorted(used)


def _reuse(frontend: Frontend, parts: list[dict[str, Any]], parsed: list[Rejection], table: SampleTable) -> bytes:
    """The cache file's section of what a rebuild reuses: no audio header (none was read), and
    the units of the texts the samples do not hold (:func:`_listed`)."""
    listed = _listed(parts, parsed, table)
    return msgpack.packb({"probes": {f: [] for f in PROBE_FIELDS},
                          "units": {"frontend": [frontend.name, frontend.cache_key()],
                                    **{f: [row[i] for row in listed] for i, f in enumerate(UNITS_FIELDS)}}},
                         use_bin_type=True)


def _repeated_ids(parts: list[dict[str, Any]], runs: list[Run], words: tuple[str, ...]) -> list[tuple[int,
                                                                                                  Rejection]]:
    """The rejections of ids repeated in a later piece than their first (each piece found its
    own), each with its piece's dataset (of a mix), worded ``WORDS LINE (first on line FIRST)``
    (``words``: of each dataset); the entries they reject are marked in
    ``part["drop"]`` (positions in that piece). Only the entries whose id hashes collide are
    looked at (the pieces' sorted hashes merged), in file order."""
    for p in parts:
        p["drop"] = []
    colliding: list[tuple[int, int]] = []  # (piece, place in its sorted hashes), by hash, each in file order
    last: tuple[int, int, int] | None = None  # the previous round's last hash, and where it is
    for joined, perm, spans in merged(runs, "h", [np.uint64] * len(runs), np.uint64, 8):
        hashes = joined[perm]
        starts = np.cumsum([0] + [stop - first for _, first, stop in spans])

        def place(j: int) -> tuple[int, int]:
            s = int(np.searchsorted(starts, perm[j], "right")) - 1
            return spans[s][0], spans[s][1] + int(perm[j] - starts[s])

        same = np.flatnonzero(hashes[1:] == hashes[:-1])
        picked = np.unique(np.concatenate([same, same + 1])).tolist()
        if last is not None and last[0] == int(hashes[0]):  # a hash across two rounds
            if not colliding or colliding[-1] != last[1:]:
                colliding.append(last[1:])
            if not picked or picked[0] != 0:
                picked.insert(0, 0)
        colliding.extend(place(j) for j in picked)
        last = (int(hashes[-1]), *place(len(hashes) - 1))
    out = []
    firsts: dict[str, int] = {}
    for k, place in colliding:
        n = int(runs[k].array("hpos", np.int64, place, place + 1)[0])
        offsets, blob = runs[k].strings("ids", n, n + 1)
        sample_id = blob.decode("utf-8", ENCODING_ERRORS)
        line = int(runs[k].array("lines", np.int64, n, n + 1)[0])
        if sample_id not in firsts:
            firsts[sample_id] = line
        else:
            dataset = parts[k]["dataset"]
            out.append((dataset, Rejection(sample_id, f"{words[dataset]} {line} (first on line "
                                                      f"{firsts[sample_id]})", line=line)))
            parts[k]["drop"].append(n)
    return out


def _drop_repeated(part: dict[str, Any], run: Run) -> None:
    """Take the entries :func:`_repeated_ids` rejected out of a piece's results: ``part["gone"]``,
    the rows of its samples they were (sorted); the symbols of its samples' units
    (``part["seen"]``) for the vocabulary."""
    drop = set(part["drop"])
    part["gone"] = np.zeros(0, np.int64)
    if not drop:
        return
    for name in ("rejected", "lost", "listed"):
        part[name] = [row for row in part[name] if row[0] not in drop]
    rows = run.array("rows", np.int64)[sorted(drop)]
    part["gone"] = np.sort(rows[rows >= 0])
    offsets, blob = run.strings("c.units")
    kept = np.setdiff1d(np.arange(part["samples"]), part["gone"])
    part["seen"] = unit_symbols(_taken(offsets, blob, kept)[1])


def _taken(offsets: np.ndarray, blob: bytes, rows: np.ndarray) -> tuple[np.ndarray, bytes]:
    """(offsets, blob) of the strings ``rows`` of (offsets, blob)."""
    lengths = offsets[rows + 1] - offsets[rows]
    out = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out, gathered(offsets, blob, rows)


def _listed(parts: list[dict[str, Any]], parsed: list[Rejection], table: SampleTable) -> list[tuple[str, str, str,
                                                                                                       str]]:
    """What :func:`cache_payload` lists of the units (texts that lost characters, and the clips rejected or
    named by a rejection), in file order (a mix's: part by part), one row per text."""
    rows: list[tuple[tuple[int, int], str, str, str, str]] = [((p["dataset"], line), *rest) for p in parts
                                                              for _, line, *rest in p["listed"]]
    named = sorted({r.id for r in parsed})
    # a table row's dataset (of a mix): its piece's (the pieces' samples laid end to end)
    ends = np.cumsum([p["samples"] - len(p["gone"]) for p in parts])
    for row in (r for r in table.find_rows(named) if r >= 0) if named else ():
        language = table.languages[int(table.column("language")[row])]
        dataset = parts[int(np.searchsorted(ends, row, "right"))]["dataset"]
        rows.append(((dataset, int(table.column("line")[row])), language, table.string("text", row),
                     table.string("units", row), ""))
    out: dict[tuple[str, str], tuple[str, str, str, str]] = {}
    for _, language, spoken, made, lost_chars in sorted(rows, key=lambda row: row[0]):
        out.setdefault((language, spoken), (language, spoken, made, lost_chars))
    return list(out.values())
