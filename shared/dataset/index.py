"""Building the index: the usable samples and the rejections of a dataset, from its
metadata and audio headers (read in parallel when worth it), through the text front-end,
with the index cache reused where it still holds.

One file of some 1,060 lines: the index build, whose reuse of a stale cache, parallel reads,
rules and a large manifest's build in pieces (the last section) share one set of facts about
the dataset.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import gc
import hashlib
import logging
import mmap
import multiprocessing
import operator
import os
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import msgpack
import numpy as np
from ..config import DataConfig, FeaturesConfig, TextConfig
from ..dataset.agreement import FINGERPRINT_HEX, DatasetScan, file_sha256, fingerprints, scan_dataset, scan_from
from ..dataset.cache import (PROBE_FIELDS, REJECTION_FIELDS, UNITS_FIELDS, CachedIndex, columns_of,
                                  index_cache_file, index_config, index_key, index_key_of, open_index, pack_index,
                                  read_cache, rejections_of, write_cache)
from ..dataset.files import (UNMEASURED, list_audio, locate, metadata_location, read_metadata_bytes, relative_audio,
                             resolve_audio)
from ..dataset.probe import expected_samples, probe_audio
from ..dataset.shards import is_locator, probe_member, read_shards, remote_stat
from ..dataset.storage import COUNTS, file_stamp, is_url
from ..dataset.table import (ENCODING_ERRORS, NUMBER_COLUMNS, STRING_COLUMNS, SampleTable, hash_strings, pack_strings,
                             sorts_as_str)
from ..dataset.types import AudioFile, AudioProbe, DEFAULT_SPEAKER, DatasetError, IndexStats, Sample
from ..layouts import COLUMNS_AUTO, Entry, Rejection, is_cuts, is_manifest, is_shards, manifest_columns
from ..mel import min_num_samples, num_frames, num_frames_of
from ..mixes import is_mix, parse_entries
from ..text import LANGUAGES, LOST_EXAMPLES, Frontend, TextError, Units, make_frontend
from ..vocab import Vocabulary

log = logging.getLogger(__name__)


# Header reads are shared with spawned helper processes only when the work would take
# this long in one process: a helper needs ~0.5 s to start (a fresh interpreter importing
# numpy and this package), so shorter work is done sooner alone.
PARALLEL_MIN_SECONDS = 2.0


# A dataset where more than this share of the clips is rejected for one cause ends the run
# with one line naming the cause and the setting that fixes it (a wrong front-end,
# language or column mapping rejects nearly everything).
MOSTLY_REJECTED_FRAC = 0.5


# Estimated cost of one item, to apply that rule before reading anything (measured on a
# 2-core VM): a WAV header walk, a libsndfile header read, a FLAC header plus the decode
# of its last block, and one text's tokenization.
WAV_HEADER_S = 50e-6


OTHER_HEADER_S = 100e-6


FLAC_HEADER_S = 400e-6


TEXT_S = 10e-6


PHONEMES_S = 400e-6  # one sentence through espeak-ng


# Headers per task handed to a worker: large enough to amortise the task overhead,
# small enough that the last tasks balance the load.
CHUNK_ITEMS = 1000


# Texts through the phonemizer cost ~8x a header: smaller chunks, so the last ones still balance.
PHONEME_CHUNK_ITEMS = 250


@dataclass
class DatasetIndex:
    """The usable samples and the rejections of a dataset.

    ``fingerprint`` is the index cache key (it tracks the config too); ``scan`` is the
    dataset as seen on this host (its fingerprints: :attr:`dataset_fingerprint`), derived on
    first use from the metadata bytes and audio listing the index was built from (a warm
    cache load does not pay for parsing the metadata unless a scan is wanted; a manifest is
    read again then, rather than held through the run).
    """

    root: Path
    samples: SampleTable  # a sequence of Sample, columnar (shared/dataset/table.py)
    rejected: list[Rejection]
    fingerprint: str
    stats: IndexStats = field(default_factory=IndexStats)
    metadata_file: str = "metadata.csv"
    columns: str = COLUMNS_AUTO
    vocabulary: Vocabulary | None = None  # None only for indexes made without a front-end (tests)
    lost: dict[str, Any] = field(default_factory=dict)  # lost characters: see LostReport.to_json
    # The scan's fingerprints and the metadata's SHA-256, stored with the index
    # (agreement.fingerprints): a warm load has them without parsing the metadata; a producer on
    # another host is checked against the SHA-256 (agreement.Reference).
    agreement: dict[str, Any] = field(default_factory=dict)
    _scan: DatasetScan | None = field(default=None, repr=False)
    _scan_inputs: tuple[bytes, dict[str, AudioFile]] | None = field(default=None, repr=False)

    @property
    def scan(self) -> DatasetScan:
        if self._scan is None:
            if self._scan_inputs is not None:
                metadata, audio = self._scan_inputs
                self._scan = scan_from(self.root, self.metadata_file, metadata, audio, self.columns)
                self._scan_inputs = None
            else:
                self._scan = scan_dataset(self.root, self.metadata_file, self.columns)
        return self._scan

    @property
    def dataset_fingerprint(self) -> str:
        """The metadata and audio fingerprints as one short string (DatasetScan.fingerprint), for
        logs, summary.json, checkpoints and the mel statistics' key."""
        if not self.agreement:
            return self.scan.fingerprint
        return f"{self.agreement['metadata'][:8]}{self.agreement['audio'][:8]}"

    def by_id(self) -> dict[str, Sample]:
        return {s.id: s for s in self.samples}

    def sample(self, sample_id: str) -> Sample:
        """One clip by id (KeyError when the index has none)."""
        return self.samples[self.samples.row_of(sample_id)]


def _probe_tuple(p: AudioProbe) -> tuple[int, int, int, str, str]:
    return tuple(p)  # type: ignore[return-value]


# A text work item: (language, text); its result: (units, lost characters).
TextKey = tuple[str, str]


Item = tuple["str | None", int, "TextKey | None"]


_FRONTENDS: dict[tuple[str, str], Frontend] = {}  # per process: a phonemizer backend is set up once


def _frontend(spec: tuple[str, str]) -> Frontend:
    frontend = _FRONTENDS.get(spec)
    if frontend is None or frontend.changed():
        frontend = _FRONTENDS[spec] = make_frontend(*spec)
    return frontend


def _work_items(root: str, items: Sequence[Item], text_spec: tuple[str, str]) -> list[tuple[tuple | None,
                                                                                               tuple | None]]:
    """Read headers and make units: [(audio name or None, its size, (language, text) or None)]
    -> [(probe, (units, lost))].

    Runs in worker processes (so it takes and returns plain tuples) and in-process. Texts
    go to the front-end one list per language (a phonemizer call has a set-up cost).
    """
    join = os.path.join
    probes = [_probe_tuple(probe_member(Path(root), name) if is_url(name) or is_locator(name)
                           else probe_audio(join(root, name), size))
              if name is not None else None for name, size, _ in items]
    by_language: dict[str, list[int]] = collections.defaultdict(list)
    for n, (_, _, key) in enumerate(items):
        if key is not None:
            by_language[key[0]].append(n)
    units: list[tuple | None] = [None] * len(items)
    if by_language:
        frontend = _frontend(text_spec)
        for code, positions in by_language.items():
            made = frontend.units([items[n][2][1] for n in positions], code)  # type: ignore[index]
            for n, u in zip(positions, made):
                units[n] = (u.units, u.lost)
    return list(zip(probes, units))


def _estimated_seconds(items: Sequence[Item], text_s: float) -> float:
    """What :func:`_work_items` would take in one process, from the file suffixes alone."""
    total = 0.0
    for name, _, text in items:
        if name is not None:
            suffix = name.rpartition(".")[2].lower()
            total += WAV_HEADER_S if suffix == "wav" else FLAC_HEADER_S if suffix == "flac" else OTHER_HEADER_S
        if text is not None:
            total += text_s
    return total


def _run_items(root: Path, items: list[Item], workers: int,
               text_spec: tuple[str, str]) -> tuple[list[tuple[tuple | None, tuple | None]], int]:
    """:func:`_work_items` over all items, in ``workers`` processes (this one included)."""
    text_s = PHONEMES_S if text_spec[0] == "phonemes" else TEXT_S
    if workers <= 1 or len(items) < 2 or _estimated_seconds(items, text_s) < PARALLEL_MIN_SECONDS:
        return _work_items(str(root), items, text_spec), 1
    size = PHONEME_CHUNK_ITEMS if text_spec[0] == "phonemes" else CHUNK_ITEMS
    tasks = [(str(root), items[i:i + size], text_spec) for i in range(0, len(items), size)]
    results, processes = _shared_work(_work_items, tasks, workers - 1, "header reading")
    return [item for chunk in results for item in chunk], processes


def _shared_work(fn: Callable[..., Any], tasks: Sequence[tuple], helpers: int, what: str,
                 here: bool = True) -> tuple[list[Any], int]:
    """``[fn(*task) for task in tasks]``, in order, worked by up to ``helpers`` spawned processes
    (never forked: the caller may have imported TensorFlow), and by this one where ``here``: the
    helpers take tasks from the front while this process works from the back. Not ``here``
    (results of megabytes each): this process only takes the results in, at once, so that a
    helper never waits in a full pipe for this process to finish a task of its own. A broken
    pool (e.g. a script without a __main__ guard) must not stop the work: the rest is done here,
    logged; a TextError (the front-end itself failed, as it would here) is raised. Returns the
    results and how many processes worked."""
    results: list[Any] = [None] * len(tasks)
    done = [False] * len(tasks)
    helpers = min(helpers, len(tasks) - here) if len(tasks) > 1 else 0
    if helpers > 0:
        todo = collections.deque(range(len(tasks)))
        context = multiprocessing.get_context("spawn")
        try:
            with concurrent.futures.ProcessPoolExecutor(helpers, mp_context=context) as pool:
                running: dict[concurrent.futures.Future, int] = {}

                def top_up() -> None:
                    while todo and len(running) < 2 * helpers:
                        n = todo.popleft()
                        running[pool.submit(_counted, fn, *tasks[n])] = n

                def take(future: concurrent.futures.Future) -> None:
                    m = running.pop(future)
                    results[m], retries = future.result()
                    done[m] = True
                    COUNTS.retries += retries  # a helper's reads retried, counted as this process's

                top_up()
                while todo or running:
                    if here and todo:
                        n = todo.pop()
                        results[n], done[n] = fn(*tasks[n]), True
                        finished = [f for f in running if f.done()]
                    else:
                        finished = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED).done
                    for future in finished:
                        take(future)
                    top_up()
        except TextError:
            raise
        except Exception as exc:  # any failure of the pool itself; the work is redone here
            log.warning("parallel %s failed (%s: %s); doing the rest in this process", what,
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            helpers = 0
    for n, finished in enumerate(done):
        if not finished:
            results[n] = fn(*tasks[n])
    return results, helpers + here if helpers else 1


def _counted(fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """``fn(*args)`` in a helper process, with the read retries it made there (storage.COUNTS),
    for :func:`_shared_work` to add to this process's count."""
    before = COUNTS.retries
    result = fn(*args)
    return result, COUNTS.retries - before


def build_index(data: DataConfig, features: FeaturesConfig, text: TextConfig | None = None,
                vocabulary: Vocabulary | None = None) -> DatasetIndex:
    """The index of ``data.path``: from the cache when nothing changed, else built and cached.

    ``vocabulary``: a run's vocabulary to keep (``--resume``); texts with symbols it lacks,
    or languages and speakers outside its tables, are rejected. None: built from the data.
    Raises DatasetError when the dataset cannot be used and TextError when the text
    front-end cannot (both one line for the user).
    """
    # Building creates a few small objects per clip and frees none of them: the cyclic
    # collector would walk the growing heap again and again (a 100,000-item index took
    # 40% longer per item than a 13,100-item one). Nothing here makes reference cycles.
    enabled = gc.isenabled()
    gc.disable()
    retries = COUNTS.retries
    try:
        index = _build_index(data, features, text or TextConfig(), vocabulary)
        index.stats.read_retries = COUNTS.retries - retries  # reads at a URL, helpers' included (storage.py)
        return index
    finally:
        if enabled:
            gc.enable()


def _build_index(data: DataConfig, features: FeaturesConfig, text: TextConfig,
                 fixed: Vocabulary | None) -> DatasetIndex:
    started = time.perf_counter()
    root, metadata_file = locate(data.path, data.metadata_file)
    data = dataclasses.replace(data, metadata_file=metadata_file)
    frontend = _frontend((text.frontend, text.digits))
    if fixed is not None:
        problem = fixed.check_engine(frontend)
        if problem:
            raise TextError(f"cannot keep the run's vocabulary: {problem}")
    config = index_config(data, features, text, frontend, fixed)
    candidates = index_cache_file(root, data)
    # a manifest at a URL is read whole by the one-process build (its pieces are local byte ranges)
    # (a lhotse cut manifest's too, gzip: not cut in pieces)
    size = (_size(root / metadata_file) if is_manifest(metadata_file) and not is_url(metadata_file)
            and not is_cuts(metadata_file) else 0)
    chunked = fixed is None and size >= CHUNKED_MIN_BYTES
    # A manifest's cache is found by its stamp (size and mtime, or a store's version or ETag: no
    # read), taken before the manifest is read; by its content's hash where there is no stamp: then a
    # manifest built in one pass is read whole once, its hash the cache lookup's and the cache's (a
    # large one, built in pieces, is hashed a piece at a time and never held). A local LJSpeech
    # layout's is found by its metadata's stamp too, without listing its audio: each file is
    # checked against the index when a producer reads it (:func:`_loose_layout`).
    loose = _loose_layout(metadata_file)
    stamp = (file_stamp(metadata_location(root, metadata_file)) if (is_manifest(metadata_file) or loose) and candidates
             else "")
    metadata = _read_small_manifest(root, data.metadata_file) if candidates and not chunked and not stamp else None
    manifest_sha256 = (hashlib.sha256(metadata).hexdigest() if metadata is not None
                       else _sha256_of(metadata_location(root, metadata_file))
                       if is_manifest(metadata_file) and candidates and not stamp else "")
    quick = _digest(config, stamp or manifest_sha256) if stamp or manifest_sha256 else ""
    found = _manifest_hit(root, candidates, quick) if quick else None
    if found is not None:  # a manifest as cached: not parsed (nor, a large one, held in memory)
        try:
            loaded = _loaded(found[1], fixed)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("index cache %s is unusable (%s); rebuilding the index", found[0], exc)
        else:
            stats = IndexStats(cache="hit", cache_file=str(found[0]))
            return _finish(root, *loaded, found[1].header["key"], stats, started, False, None, data)
    if chunked:
        manifest_sha256 = manifest_sha256 or _sha256_of(metadata_location(root, metadata_file))
    if manifest_sha256 and chunked:
        built = _build_manifest(root, data, features, text, frontend, config, candidates, manifest_sha256,
                                _digest(config, stamp or manifest_sha256), started)
        if built is not None:
            return built
    hashed = metadata is not None  # what manifest_sha256 is the hash of
    if metadata is None:
        metadata = read_metadata_bytes(root, data.metadata_file)
    audio = list_audio(root, data.metadata_file, metadata, data.columns)
    key = index_key(metadata, audio, config)
    cache_path, cached, state = read_cache(candidates, key) if candidates else (None, None, "off")
    stats = IndexStats(cache=state)
    # Kept for the scan, but a manifest's: it may be of millions of clips, read again if a scan is wanted.
    scan_inputs = None if is_manifest(metadata_file) else (data.metadata_file, metadata, audio)
    if state == "hit" and cached is not None:
        try:
            loaded = _loaded(cached, fixed)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("index cache %s is unusable (%s); rebuilding the index", cache_path, exc)
            cached, stats.cache = None, "corrupt"
        else:
            stats.cache_file = str(cache_path)
            if loose and stamp and cache_path is not None:  # the metadata touched, not changed: found by its stamp next
                _restamp(cache_path, cached, loaded[1], _digest(config, stamp))
            return _finish(root, *loaded, key, stats, started, False, scan_inputs, data)
    entries, rejected = parse_entries(metadata, data.metadata_file, data.columns)
    entries = resolve_audio(entries, metadata_file)  # a manifest at a URL: its audio paths beside it
    agreed = fingerprints(entries, audio, metadata)
    old_probes, old_units = _reusable(cached, frontend)
    probes: dict[str, AudioProbe] = {}
    if is_shards(data.metadata_file):  # the members the shards' walk rejected; the headers their JSON gave
        listing = read_shards(root, data.metadata_file)
        rejected, probes = rejected + listing.rejected, listing.probes()
    todo = _to_read(entries, audio, old_probes, old_units, text, probes, stats)
    read_started = time.perf_counter()
    results, stats.workers = _run_items(root, todo, max(1, _workers(data)), (text.frontend, text.digits))
    stats.read_s = time.perf_counter() - read_started
    units = dict(old_units)
    for (name, _, text_key), (probe, made) in zip(todo, results):
        if name is not None and probe is not None:
            probes[name] = AudioProbe(*probe)
            stats.headers_read += 1
        if text_key is not None and made is not None:
            units[text_key] = Units(*made)
            stats.texts_tokenized += 1
    del todo, results, old_units  # an item or two per clip: not to be held through the rest of the build
    samples, rejected, lost = _apply_rules(entries, rejected, audio, probes, units, data, features, text, frontend,
                                           fixed)
    vocab = fixed or _vocabulary(frontend, samples)
    if candidates:
        header, reuse = _payload(key, root, config, rejected, entries, audio, probes, units, frontend, text, lost,
                                 vocab)
        header["agreement"] = agreed
        if is_manifest(metadata_file):
            header["manifest"] = {"digest": _digest(config, stamp or (manifest_sha256 if hashed
                                                                    else hashlib.sha256(metadata).hexdigest())),
                                  "measured": _measured(entries, audio)}
        elif loose and stamp:  # found by the metadata's stamp: its missing files looked for, no listing
            header["manifest"] = {"digest": _digest(config, stamp), "measured": _absent(rejected)}
    del entries, units, probes  # the clips are in the samples now: not held while they become columns
    table = _with_files(SampleTable.from_samples(samples), samples, audio)
    del samples
    if candidates:
        header["names"] = {"speakers": table.speakers, "languages": table.languages}
        written = write_cache(candidates, pack_index(header, {**table.sections(), "reuse": reuse}))
        stats.cache_file = str(written) if written else ""
    return _finish(root, table, rejected, lost, agreed, vocab, key, stats, started, True, scan_inputs, data)


def _loose_layout(metadata_file: str) -> bool:
    """Whether ``metadata_file`` is a local LJSpeech layout's (``wavs/`` beside it): its index
    cache is found by the metadata's stamp alone, not by a listing and a stat of every audio file
    (a million of them take seconds): a file changed or deleted since indexing is found when a
    producer reads it (each clip's file size and mtime are columns of the index, which its lease
    carries: agreement.stamp_problem), a clip rejected as missing by a stat of its file
    (:func:`_absent`)."""
    return not (is_url(metadata_file) or is_manifest(metadata_file) or is_shards(metadata_file)
                or is_mix(metadata_file))


def _absent(rejected: Sequence[Rejection]) -> list[list[Any]]:
    """The files of clips rejected as missing, as :func:`_measured` lists a missing one ([name,
    None, None]): a warm load by the metadata's stamp (:func:`_manifest_hit`) takes the long way
    when one of them has come since."""
    return sorted({r.file: [r.file, None, None] for r in rejected if r.kind == "missing-audio" and r.file}.values())


def _restamp(path: Path, cached: CachedIndex, rejected: Sequence[Rejection], digest: str) -> None:
    """The cache file of a local LJSpeech layout found the long way (its listing and the metadata's
    bytes as they were: :func:`_loose_layout`) written again with the metadata's present stamp
    (``digest``), so that the next start finds it by the stamp, without a listing; as it is when
    it has that stamp already."""
    manifest = cached.header.get("manifest")
    if isinstance(manifest, dict) and manifest.get("digest") == digest:
        return
    header = {**cached.header, "manifest": {"digest": digest, "measured": _absent(rejected)}}
    write_cache([path], pack_index(header, cached.sections))


def _with_files(table: SampleTable, samples: Sequence[Sample], audio: dict[str, AudioFile]) -> SampleTable:
    """``table`` (of ``samples``) with each clip's audio file as listed (table.FILE_COLUMNS):
    UNMEASURED where the build looked at none (a manifest's clip with its duration); the table as
    it is when it looked at no file at all."""
    files = [audio.get(s.id) for s in samples]
    if not any(files):
        return table
    sizes = np.fromiter((f.size if f is not None else UNMEASURED for f in files), np.int64, len(files))
    mtimes = np.fromiter((f.mtime_ns if f is not None else UNMEASURED for f in files), np.int64, len(files))
    return table.with_files(sizes, mtimes)


def _loaded(cached: CachedIndex, fixed: Vocabulary | None) -> tuple[SampleTable, list[Rejection], dict[str, Any],
                                                                      dict[str, Any], Vocabulary]:
    """(samples, rejections, lost characters, agreement fingerprints, vocabulary) of a cache file."""
    header = cached.header
    return (_table(cached), rejections_of(header["rejected"]), dict(header["lost"]), dict(header["agreement"]),
            fixed or Vocabulary.from_state_dict(header["vocabulary"]))


def _digest(config: dict[str, Any], manifest: str) -> str:
    """What a manifest's cache file is found by: the config and the manifest's stamp
    (storage.file_stamp), or its content's SHA-256 (hex) where it has none."""
    return hashlib.sha256(f"{sorted(config.items())!r}\0{manifest}".encode()).hexdigest()


def _sha256_of(path: str) -> str:
    """A manifest's SHA-256 (hex), here or at a URL, read a piece at a time; "" when it cannot be
    read (the build says why). With the config, it is the digest the manifest's cache is found by
    (:func:`_manifest_hit`)."""
    try:
        return file_sha256(path)
    except OSError:
        return ""


def _read_small_manifest(root: Path, metadata_file: str) -> bytes | None:
    """The bytes of a manifest (the one-pass build's: a small one, or one at a URL); None for
    other metadata, or when it cannot be read (the build reads it again, and says why)."""
    if not is_manifest(metadata_file):
        return None
    try:
        return read_metadata_bytes(root, metadata_file)
    except DatasetError:
        return None


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _measured(entries: Sequence[Entry], audio: dict[str, AudioFile]) -> list[list[Any]]:
    """The audio files a manifest's index looked at (those of clips without a duration), as
    [name, size, mtime] ([name, None, None] for one missing), for :func:`_manifest_hit`."""
    out: dict[str, list[Any]] = {}
    for entry in entries:
        if entry.duration is None and entry.audio:
            file = audio.get(entry.id)
            out.setdefault(file.name if file else entry.audio,
                           [file.name, file.size, file.mtime_ns] if file else [entry.audio, None, None])
    return sorted(out.values())


def _manifest_hit(root: Path, candidates: list[Path], digest: str) -> tuple[Path, CachedIndex] | None:
    """A cache file of this manifest (or local LJSpeech layout's metadata: :func:`_loose_layout`)
    under this config whose measured audio files are as they were (:func:`_measured`,
    :func:`_absent`): one stat each, no parse of the metadata; its sections checked. None: take the
    long way (which also reports a corrupt cache)."""
    for path in candidates:
        try:
            cached = open_index(path, check=False)
        except (OSError, ValueError):
            continue
        manifest = cached.header.get("manifest")
        if not isinstance(manifest, dict) or manifest.get("digest") != digest:
            continue
        try:
            if all(_stat(name if is_url(name) else root / name) == (size, mtime)
                   for name, size, mtime in manifest["measured"]):
                return path, cached.check()
        except (TypeError, ValueError):
            continue
    return None


def _stat(path: Path | str) -> tuple[int | None, int | None]:
    if isinstance(path, str):  # a URL (a manifest's at a URL); a store that cannot answer: the long way
        try:
            return remote_stat(path) or (None, None)
        except DatasetError:
            return None, None
    try:
        st = os.stat(path)
    except OSError:
        return None, None
    return st.st_size, st.st_mtime_ns


# The string columns read a clip at a time (what a lease carries): left in the cache file and
# read by pread (table.FileBlob), so that a long run's reads of them stay page cache, not the
# coordinator's memory. The ids stay mapped: planning and lookups read all of them at once.
READ_BY_CLIP = ("s.text", "s.audio", "s.units")


def _table(cached: CachedIndex) -> SampleTable:
    names = cached.header["names"]
    sections = {name: cached.blob(name) if name in READ_BY_CLIP else view for name, view in cached.sections.items()}
    return SampleTable.from_sections(sections, names["speakers"], names["languages"], checksummed=cached.checked)


def _reusable(cached: CachedIndex | None, frontend: Frontend) -> tuple[dict[str, tuple], dict[TextKey, Units]]:
    """What a stale index cache still holds that is good: audio headers by file (checked against
    size and mtime by the caller), and text units from the same front-end, settings and versions."""
    if cached is None:
        return {}, {}
    try:
        reuse = cached.unpack("reuse")
        p = reuse["probes"]
        old_probes = {name: row for name, *row in zip(*(p[f] for f in PROBE_FIELDS))}
        old_units: dict[TextKey, Units] = {}
        u = reuse["units"]
        if u["frontend"] == [frontend.name, frontend.cache_key()]:
            table = _table(cached)
            old_units = {(lang, txt): Units(units) for lang, txt, units in
                         zip([table.languages[c] for c in table.column("language").tolist()], table.strings("text"),
                             table.strings("units"))}
            old_units.update({(lang, txt): Units(units, lost)
                              for lang, txt, units, lost in zip(*(u[f] for f in UNITS_FIELDS))})
        return old_probes, old_units
    except (KeyError, TypeError, ValueError):
        return {}, {}


def _to_read(entries: Sequence[Any], audio: dict[str, Any], old_probes: dict[str, tuple],
             old_units: dict[TextKey, Units], text: TextConfig, probes: dict[str, AudioProbe],
             stats: IndexStats) -> list[Item]:
    """The audio headers and texts the build must read (headers still good go into ``probes``)."""
    todo: list[Item] = []
    wanted: set[TextKey] = set()
    for entry in entries:
        file = audio.get(entry.id)
        name = None
        size = 0
        if file is not None and file.name not in probes and entry.duration is None:
            old = old_probes.get(file.name)
            if old is not None and old[0] == file.size and old[1] == file.mtime_ns:
                probes[file.name] = AudioProbe(*old[2:])
                stats.headers_reused += 1
            else:
                name, size = file.name, file.size
        text_key: TextKey | None = (entry.language or text.language, entry.text)
        if text_key in old_units or text_key in wanted or text_key[0] not in LANGUAGES:
            text_key = None
        else:
            wanted.add(text_key)
        if name is not None or text_key is not None:
            todo.append((name, size, text_key))
    return todo


def _payload(key: str, root: Path, config: dict[str, Any], rejected: Sequence[Any],
             entries: Sequence[Any], audio: dict[str, Any], probes: dict[str, AudioProbe],
             units: dict[TextKey, Units], frontend: Frontend, text: TextConfig, lost: dict[str, Any],
             vocab: Vocabulary) -> tuple[dict[str, Any], bytes]:
    """The index cache's header (without the samples: their columns are sections of their own,
    and their names the caller's to add), and what a later rebuild can reuse (a msgpack section)."""
    used = {a.name for a in audio.values()}
    probe_rows = [(name, audio_file.size, audio_file.mtime_ns, *_probe_tuple(probes[name]))
                  for audio_file in audio.values() for name in (audio_file.name,) if name in probes and name in used]
    # Units of every text of the metadata, so that a later re-derivation sends only texts
    # that changed through the front-end: the samples hold theirs; the rest (rejected
    # clips, and texts that lost characters) are listed apart.
    rejected_ids = {r.id for r in rejected}
    listed: dict[TextKey, Units] = {}
    for e in entries:
        text_key = (e.language or text.language, e.text)
        made = units.get(text_key)
        if made is not None and (made.lost or e.id in rejected_ids):
            listed[text_key] = made
    unit_rows = [(lang, txt, made.units, made.lost) for (lang, txt), made in listed.items()]
    header = {
        "key": key, "root": str(root), "config": config,
        "rejected": columns_of(rejected, REJECTION_FIELDS),
        "lost": lost, "vocabulary": vocab.state_dict(),
    }
    reuse = {
        "probes": {f: [row[i] for row in probe_rows] for i, f in enumerate(PROBE_FIELDS)},
        "units": {"frontend": [frontend.name, frontend.cache_key()],
                  **{f: [row[i] for row in unit_rows] for i, f in enumerate(UNITS_FIELDS)}},
    }
    return header, msgpack.packb(reuse, use_bin_type=True)


def _vocabulary(frontend: Frontend, samples: Sequence[Sample]) -> Vocabulary:
    return Vocabulary.build(frontend, (s.units for s in samples), (s.language for s in samples),
                            (s.speaker for s in samples))


def _workers(data: DataConfig) -> int:
    if data.index_workers > 0:
        return data.index_workers
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# Rejection kinds (Rejection.kind): the cause shared by many clips of a dataset, and what fixes it.
KIND_HINTS = {
    "lost-text": "the text front-end cannot represent its text: check --language, --text-frontend, or allow "
                 "some loss with --set text.max_lost_frac=F",
    "empty-text": "its text is empty after normalisation: check data.columns (which field is the text) and "
                  "--language",
    "language": "its language is unknown: check the language column (data.columns) or --language",
    "vocabulary": "its language or speaker is not in the run's tables: resume only with the run's dataset",
    "too-many-tokens": "its text is longer than data.max_tokens allows: raise --set data.max_tokens=N",
    "missing-audio": "its audio file is missing: check --data (DIR/wavs/ID.wav) or the manifest's paths",
    "unreadable-audio": "its audio file cannot be read",
    "duration": "its duration is outside data.min_audio_s..data.max_audio_s",
}


def _apply_rules(entries: list[Entry], rejected: list[Rejection], audio: dict[str, AudioFile],
                 probes: dict[str, AudioProbe], units: dict[TextKey, Units], data: DataConfig,
                 features: FeaturesConfig, text: TextConfig, frontend: Frontend,
                 fixed: Vocabulary | None) -> tuple[list[Sample], list[Rejection], dict[str, Any]]:
    """Turn parsed metadata, header facts and units into samples, rejections and the lost-character report."""
    rejected = list(rejected)
    samples: list[Sample] = []
    report = LostReport()
    for entry in entries:
        said = _text_rules(entry, units, data, text, frontend, fixed, report)
        if isinstance(said, Rejection):
            rejected.append(said)
            continue
        heard = _audio_rules(entry, audio, probes, data, features)
        if isinstance(heard, Rejection):
            rejected.append(heard)
            continue
        made, count, code, speaker = said
        name, n, duration = heard
        samples.append(Sample(entry.id, entry.text, count, num_frames(n, features), duration, name,
                              entry.line, code, speaker, made.units))
    return samples, rejected, report.to_json()


def _text_rules(entry: Entry, units: dict[TextKey, Units], data: DataConfig, text: TextConfig, frontend: Frontend,
                fixed: Vocabulary | None, report: "LostReport") -> Rejection | tuple[Units, int, str, str]:
    """A clip's text: (its units, token count, language, speaker), or why it is rejected."""
    place = f"metadata line {entry.line}"
    code = entry.language or text.language
    speaker = entry.speaker or DEFAULT_SPEAKER
    made = units.get((code, entry.text))
    if made is None:  # only a language outside LANGUAGES is never sent to the front-end
        return Rejection(entry.id, f"unknown language code {code!r} ({place}; known: "
                                   f"{', '.join(sorted(LANGUAGES))})", line=entry.line, kind="language")
    if fixed is not None:
        missing = fixed.missing(made.units)
        if missing:
            made = Units("".join(ch for ch in made.units if ch not in missing), made.lost + missing)
        if code not in fixed.languages or speaker not in fixed.speakers:
            what = f"language {code!r}" if code not in fixed.languages else f"speaker {speaker!r}"
            return Rejection(entry.id, f"{what} is not in the run's tables ({place})", line=entry.line,
                             kind="vocabulary")
    if made.lost:
        report.add(entry.id, made.lost)
        if made.lost_frac > text.max_lost_frac:
            shown = ", ".join(f"{ch!r} U+{ord(ch):04X}" for ch in dict.fromkeys(made.lost))
            return Rejection(entry.id, f"text loses {len(made.lost)} of {len(made.lost) + len(made.units)} "
                                       f"characters the {text.frontend} front-end cannot represent "
                                       f"({shown}; text.max_lost_frac={text.max_lost_frac:g}) ({place})",
                             line=entry.line, kind="lost-text")
    count = frontend.count(made.units)
    if count == 0:
        detail = ": nothing left after normalisation" if entry.text else ""
        return Rejection(entry.id, f"empty text on {place}{detail}", line=entry.line, kind="empty-text")
    if count > data.max_tokens:
        return Rejection(entry.id, f"text of {count} tokens exceeds data.max_tokens={data.max_tokens} ({place})",
                         line=entry.line, kind="too-many-tokens")
    return made, count, code, speaker


def _audio_rules(entry: Entry, audio: dict[str, AudioFile], probes: dict[str, AudioProbe], data: DataConfig,
                 features: FeaturesConfig) -> Rejection | tuple[str, int, float]:
    """A clip's audio: (its file name, samples at the feature rate, seconds), or why it is rejected."""
    place = f"metadata line {entry.line}"
    file = audio.get(entry.id) if entry.duration is None else AudioFile(entry.audio, UNMEASURED, UNMEASURED)
    if file is None:
        where = relative_audio(entry.id, entry.audio or None)
        if entry.short:  # no clip by that id: the line lost a field, and its first is not an id
            return Rejection(entry.id, f"malformed metadata line {entry.line}: {entry.short}: a field is missing "
                                       f"(read as id|text, its id has no audio file {where})", line=entry.line)
        return Rejection(entry.id, f"audio file missing: {where} ({place})", line=entry.line, file=where,
                         kind="missing-audio")
    where = relative_audio(entry.id, file.name)
    if entry.duration is not None:  # a manifest's: the audio is not looked at (checked when a producer reads it)
        duration = entry.duration
        frames, rate = round(duration * features.sample_rate_hz), features.sample_rate_hz
    else:
        probe = probes[file.name]
        if probe.error:
            detail = f": {probe.detail}" if probe.detail else ""
            return Rejection(entry.id, f"{probe.error}: {where}{detail} ({place})", line=entry.line, file=where,
                             kind="unreadable-audio")
        duration, frames, rate = probe.frames / probe.rate, probe.frames, probe.rate
    if duration > data.max_audio_s or duration < data.min_audio_s:
        bound = (f"longer than data.max_audio_s={data.max_audio_s:g}" if duration > data.max_audio_s
                 else f"shorter than data.min_audio_s={data.min_audio_s:g}")
        return Rejection(entry.id, f"clip of {duration:.2f} s {bound} s: {where} ({place})", line=entry.line,
                         file=where, kind="duration")
    n = expected_samples(frames, rate, features.sample_rate_hz)
    shortest = min_num_samples(features)  # the framing's shortest clip (shared/mel.py)
    if n < shortest:
        return Rejection(entry.id, f"clip of {n} samples at {features.sample_rate_hz} Hz is shorter than the "
                                   f"{shortest} its framing needs (features.padding {features.padding}): {where} "
                                   f"({place})", line=entry.line, file=where,
                         kind="duration")
    return file.name, n, duration


class LostReport:
    """Characters a front-end could not represent, per dataset: occurrences, clips, example ids."""

    def __init__(self) -> None:
        self.chars: dict[str, list[Any]] = {}  # char -> [occurrences, clips, example ids]
        self.clips = 0

    def add(self, sample_id: str, lost: str) -> None:
        self.clips += 1
        for ch, n in collections.Counter(lost).items():
            row = self.chars.setdefault(ch, [0, 0, []])
            row[0] += n
            row[1] += 1
            if len(row[2]) < LOST_EXAMPLES:
                row[2].append(sample_id)

    def to_json(self) -> dict[str, Any]:
        """``{"clips": N, "chars": [{"char", "code", "name", "count", "clips", "examples"}, ...]}``, most first."""
        rows = sorted(self.chars.items(), key=lambda kv: (-kv[1][0], kv[0]))
        return {"clips": self.clips, "chars": [
            {"char": ch, "code": f"U+{ord(ch):04X}", "name": unicodedata.name(ch, "").lower(), "count": count,
             "clips": clips, "examples": examples} for ch, (count, clips, examples) in rows]}


def _mostly_rejected(entries: int, rejected: Sequence[Rejection]) -> str:
    """One line naming the cause when one kind of rejection took most of the dataset, else ""."""
    kinds = collections.Counter(r.kind for r in rejected if r.kind)
    if not kinds or entries <= 0:
        return ""
    kind, count = kinds.most_common(1)[0]
    if count <= MOSTLY_REJECTED_FRAC * entries:
        return ""
    example = next(r for r in rejected if r.kind == kind)
    return (f"{count} of {entries} clips were rejected because {KIND_HINTS[kind]} (e.g. {example.id}: "
            f"{example.reason})")


def _finish(root: Path, samples: SampleTable, rejected: list[Rejection], lost: dict[str, Any], agreed: dict[str, Any],
            vocab: Vocabulary, key: str, stats: IndexStats, started: float, log_rejections: bool,
            scan_inputs: tuple[str, bytes, dict[str, AudioFile]] | None, data: DataConfig) -> DatasetIndex:
    stats.seconds = time.perf_counter() - started
    if log_rejections:
        for r in rejected:
            log.warning("rejected %s: %s", r.id, r.reason)
    if lost.get("chars"):
        shown = ", ".join(f"{c['char']!r} {c['code']} ({c['count']}x in {c['clips']} clips, e.g. "
                          f"{', '.join(c['examples'])})" for c in lost["chars"][:8])
        log.warning("%d clips of %s lose characters the %s front-end cannot represent: %s", lost["clips"], root,
                    vocab.frontend, shown)
    log.info("index of %s: %d clips usable, %d rejected (cache %s, %d headers read, %d reused, %d texts through "
             "the front-end, %d worker(s), %.2f s)", root, len(samples), len(rejected), stats.cache,
             stats.headers_read, stats.headers_reused, stats.texts_tokenized, stats.workers, stats.seconds)
    cause = _mostly_rejected(len(samples) + len(rejected), rejected)
    if not samples:
        raise DatasetError(f"dataset {root} has no usable clip ({len(rejected)} rejected)"
                           + (f": {cause}" if cause else ""))
    if cause:
        raise DatasetError(f"dataset {root}: {cause}")
    return DatasetIndex(root=root, samples=samples, rejected=rejected, fingerprint=key[:16], stats=stats,
                        metadata_file=data.metadata_file, columns=data.columns, vocabulary=vocab, lost=lost,
                        agreement=agreed, _scan_inputs=scan_inputs[1:] if scan_inputs is not None else None)


# ---------------------------------------------------------------- a manifest's chunked build
#
# A manifest whose clips all give their durations needs no audio header: its index is its lines
# through the JSON parser, the text front-end and the rules, which worker processes do a piece
# of the file each (:func:`_manifest_chunk`), each piece becoming columns rather than an object
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


# Line feed and carriage return, as bytes of a manifest.
LF, CR = ord("\n"), ord("\r")
# Rows at a time when hashing the fingerprints' lines in id order (a gather index of
# about 8 bytes per byte of those rows).
FINGERPRINT_ROWS = 1 << 16


def _manifest_ranges(path: Path, chunk_bytes: int) -> list[tuple[int, int, int]]:
    """The pieces of a manifest: (start byte, end byte, the number of its first line), each of
    about ``chunk_bytes`` and ending at a line end (``\\n``) but the last; lines counted as
    :func:`layouts._text_lines` cuts them (``\\r\\n``, ``\\r``, ``\\n``). The file is mapped, not
    read: its line ends are counted in place."""
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
                start = end
    return ranges


def _line_ends(mapped: mmap.mmap, start: int, end: int) -> int:
    """The line ends (``\\r\\n``, ``\\r``, ``\\n``) in bytes ``start:end`` of ``mapped``."""
    raw = np.frombuffer(mapped, np.uint8, end - start, start)
    ends = int(np.count_nonzero(raw == LF))
    if mapped.find(b"\r", start, end) >= 0:
        returns = raw == CR
        ends += int(np.count_nonzero(returns)) - int(np.count_nonzero(returns[:-1] & (raw[1:] == LF)))
    return ends


def _manifest_chunk(path: str, start: int, end: int, first_line: int, data: DataConfig, features: FeaturesConfig,
                    text: TextConfig) -> dict[str, Any] | None:
    """One piece of a manifest, parsed, through the front-end and the rules, as columns (runs in
    worker processes, and in this one). None when a clip gives no duration (its audio header
    would be read: the one-process build's work)."""
    with open(path, "rb") as f:
        f.seek(start)
        raw = f.read(end - start)
    entries, parsed = manifest_columns(raw, first_line)
    del raw
    if None in entries.duration:
        return None
    size = len(entries.id)
    unnamed = entries.language.count("")  # clips that name no language: the config's
    codes = (entries.language if not unnamed else [text.language] * size if unnamed == size
             else [code or text.language for code in entries.language])
    frontend = _frontend((text.frontend, text.digits))
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
    # rules one by one below, which say why): units that lost nothing, a token count within
    # bounds, a duration within bounds and long enough for the framing (_audio_rules).
    heard = (durations <= data.max_audio_s) & (durations >= data.min_audio_s)
    samples = np.rint(np.where(heard, durations, 0.0) * features.sample_rate_hz).astype(np.int64)
    passed = (clean & (counts > 0) & (counts <= data.max_tokens) & heard & (samples >= min_num_samples(features)))
    report = LostReport()  # what is lost is listed per clip below, in order, for the whole index's report
    rejected: list[tuple[int, Rejection]] = []
    lost: list[tuple[int, str, str]] = []
    listed: list[tuple[int, str, str, str, str]] = []
    for n in np.flatnonzero(~passed).tolist():
        entry, k, key = entries.entry(n), int(at[n]), (codes[n], entries.text[n])
        unit = Units(made[k], lost_of[k]) if made[k] is not None else None
        outcome = _text_rules(entry, {key: unit} if unit is not None else {}, data, text, frontend, None, report)
        if not isinstance(outcome, Rejection):
            outcome = _audio_rules(entry, {}, {}, data, features)
        if isinstance(outcome, Rejection):
            rejected.append((n, outcome))
        else:
            passed[n] = True
        if unit is not None and unit.lost:
            lost.append((n, entry.id, unit.lost))
        if unit is not None and (unit.lost or isinstance(outcome, Rejection)):
            listed.append((n, *key, unit.units, unit.lost))
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
    numbers = {"num_tokens": counts[picked], "num_frames": num_frames_of(samples[picked], features),
               "duration_s": durations[picked], "line": np.asarray(entries.line, np.int64)[picked],
               "speaker": speaker_codes, "language": language_codes}
    ids = pack_strings(entries.id)
    strings = {name: ids if name == "id" and every else pack_strings(columns[name]) for name in STRING_COLUMNS}
    return {
        "parsed": parsed, "rejected": rejected, "lost": lost, "listed": listed, "rows": rows,
        "tokenized": tokenized, "ids": ids, "lines": np.asarray(entries.line, np.int64).reshape(size),
        "hashes": hash_strings(ids[0], np.frombuffer(ids[1], np.uint8), np.arange(size)),
        "id_order": np.argsort(_fixed_width(*ids, max(1, _widest(ids[0]))), kind="stable"),
        "metadata_lines": _tab_lines([entries.id, entries.text, entries.speaker, entries.language]),
        "audio_lines": _suffixed(ids, entries.id, f"\t{UNMEASURED}\n"),
        "seen": _symbols(strings["units"][1]),
        "numbers": {name: np.asarray(numbers[name], kind) for name, kind in NUMBER_COLUMNS.items()},
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


def _symbols(blob: bytes) -> set[str]:
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


def _run_chunks(path: Path, ranges: list[tuple[int, int, int]], workers: int, data: DataConfig,
                features: FeaturesConfig, text: TextConfig) -> tuple[list[dict[str, Any] | None], int]:
    """:func:`_manifest_chunk` of every piece, in order: in ``workers`` helper processes (this one
    taking their columns in) or, ``workers`` 1, in this one."""
    tasks = [(str(path), *piece, data, features, text) for piece in ranges]
    return _shared_work(_manifest_chunk, tasks, workers if workers > 1 else 0, "manifest indexing", here=False)


def _build_manifest(root: Path, data: DataConfig, features: FeaturesConfig, text: TextConfig, frontend: Frontend,
                    config: dict[str, Any], candidates: list[Path], manifest_sha256: str, digest: str,
                    started: float) -> DatasetIndex | None:
    """The index of a manifest whose clips all give their durations, built in pieces (section
    comment); None when a clip gives none (then the one-process build reads its header). A cache
    file of the same content is loaded before anything is parsed (the manifest's stamp changed,
    not its bytes); ``digest``: what the cache file written is found by (:func:`_manifest_hit`)."""
    path = root / data.metadata_file
    key = index_key_of(bytes.fromhex(manifest_sha256), {}, config)
    cache_path, cached, state = read_cache(candidates, key) if candidates else (None, None, "off")
    if state == "hit" and cached is not None:
        try:
            loaded = _loaded(cached, None)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("index cache %s is unusable (%s); rebuilding the index", cache_path, exc)
            state = "corrupt"
        else:
            return _finish(root, *loaded, key, IndexStats(cache="hit", cache_file=str(cache_path)), started, False,
                           None, data)
    read_started = time.perf_counter()
    try:
        ranges = _manifest_ranges(path, BUILD_CHUNK_BYTES)
    except OSError:
        return None  # the one-process build says why
    chunks, workers = _run_chunks(path, ranges, max(1, _workers(data)), data, features, text)
    if any(chunk is None for chunk in chunks):
        log.info("%s has clips without a duration: their audio headers are read", path)
        return None
    parts: list[dict[str, Any]] = chunks  # type: ignore[assignment]
    stats = IndexStats(cache=state, workers=workers, texts_tokenized=sum(p["tokenized"] for p in parts))
    parsed = [r for p in parts for r in p["parsed"]] + _repeated_ids(parts)
    parsed.sort(key=lambda r: r.line)  # as one pass over the lines finds them
    for p in parts:
        _drop_repeated(p)
    rejected = parsed + [r for p in parts for _, r in p["rejected"]]
    report = LostReport()
    for p in parts:
        for _, sample_id, lost_chars in p["lost"]:
            report.add(sample_id, lost_chars)
    lost = report.to_json()
    agreed, by_id = _manifest_fingerprints(parts, manifest_sha256)
    table = _concatenated(parts, _table_id_order(parts, by_id))
    stats.read_s = time.perf_counter() - read_started
    seen: set[str] = set()
    for p in parts:
        seen.update(p["seen"])
    vocab = Vocabulary.build(frontend, ["".join(sorted(seen))], table.languages, table.speakers)
    if candidates:
        header = {"key": key, "root": str(root), "config": config, "rejected": columns_of(rejected, REJECTION_FIELDS),
                  "lost": lost, "vocabulary": vocab.state_dict()}
        reuse = {"probes": {f: [] for f in PROBE_FIELDS},
                 "units": {"frontend": [frontend.name, frontend.cache_key()],
                           **{f: [row[i] for row in _listed(parts, parsed, table)] for i, f in
                              enumerate(UNITS_FIELDS)}}}
        header["agreement"] = agreed
        header["manifest"] = {"digest": digest, "measured": []}
        header["names"] = {"speakers": table.speakers, "languages": table.languages}
        written = write_cache(candidates, pack_index(header, {**table.sections(),
                                                              "reuse": msgpack.packb(reuse, use_bin_type=True)}))
        stats.cache_file = str(written) if written else ""
    return _finish(root, table, rejected, lost, agreed, vocab, key, stats, started, True, None, data)


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
    part["seen"] = _symbols(part["strings"]["units"][1])


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
    """What :func:`_payload` lists of the units (texts that lost characters, and the clips rejected or
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
    width = max([1] + [_widest(o) for o, _ in ids])
    keys = np.concatenate([_fixed_width(o, b, width) for o, b in ids]) if ids else np.zeros(0, f"S{width}")
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


def _widest(offsets: np.ndarray) -> int:
    """The longest of the strings at ``offsets`` (0 when there are none)."""
    return int(np.diff(offsets).max()) if len(offsets) > 1 else 0


def _fixed_width(offsets: np.ndarray, blob: bytes, width: int) -> np.ndarray:
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
