"""Building the index (build_index): the usable samples and the rejections of a dataset, from its
metadata and audio headers, through the text front-end, with the index cache reused where it
still holds; a large manifest with durations (chunked.py), a large Parquet dataset
(parquet_pieces.py), a large lhotse cut manifest (cuts_pieces.py) and a large mix of those
(mix_pieces.py) are built in pieces.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import logging
import time
from pathlib import Path
from typing import Any, Callable

from ...shared.config import DataConfig, FeaturesConfig, TextConfig
from ...shared.dataset.agreement import fingerprints
from ...shared.dataset.cache import (STALE_CACHE, CachedIndex, index_cache_file, index_config, index_key_of, read_cache,
                                     write_cache)
from .chunked import CHUNKED_MIN_BYTES, build_manifest
from ...shared.dataset.corpus.base import Listing, Located
from ...shared.dataset.corpus.registry import locate
from .cuts_pieces import cuts_pieces
from ...shared.dataset.files import metadata_location
from .groups import number_groups
from .indexed import DatasetIndex, finished_index
from .mix_pieces import mix_pieces
from .parallel import TextKey, frontend_of, index_workers, run_items
from .parquet_pieces import parquet_pieces
from .pieces import Pieces
from .reuse import (absent_files, cache_digest, cache_payload, file_size, loaded_index,
                    manifest_hit, measured_files, read_small_manifest, restamp, reusable, sha256_of, to_read,
                    with_files)
from .rules import apply_rules, vocabulary_of
from .spill import remove_spill
from ...shared.dataset.storage import COUNTS, is_url
from ...shared.dataset.table import SampleTable
from ...shared.dataset.types import AudioFile, AudioProbe, IndexStats
from ...shared.dataset.layouts import Entry
from ...shared.text import Frontend, TextError, Units
from ...shared.vocab import Vocabulary

log = logging.getLogger(__name__)

# The formats whose large local datasets are built in pieces, by name: each function gives the
# pieces (blocks spilled beside the index cache's candidates), or None where the one-pass build is the way.
IN_PIECES: dict[str, Callable[..., Pieces | None]] = {"parquet": parquet_pieces, "cuts": cuts_pieces,
                                                     "mix": mix_pieces}


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


@dataclasses.dataclass
class _Build:
    """What every way of building an index starts from: the dataset located, the front-end and
    config, the cache files to look in, and how the metadata is found there (its stamp, or its
    content's SHA-256 where a store gives no stamp)."""

    root: Path
    located: Located
    data: DataConfig
    features: FeaturesConfig
    text: TextConfig
    fixed: Vocabulary | None
    frontend: Frontend
    config: dict[str, Any]
    candidates: list[Path]
    started: float
    chunked: bool = False
    stamp: str = ""
    metadata: bytes | None = None
    manifest_sha256: str = ""


def _build_index(data: DataConfig, features: FeaturesConfig, text: TextConfig,
                 fixed: Vocabulary | None) -> DatasetIndex:
    build = _started(data, features, text, fixed)
    found = _found_by_stamp(build)
    if found is not None:
        return found
    if build.chunked:
        build.manifest_sha256 = build.manifest_sha256 or sha256_of(metadata_location(build.root,
                                                                                     build.data.metadata_file))
    if fixed is None:
        built = _in_pieces(build)
        if built is not None:
            return built
    if build.manifest_sha256 and build.chunked:
        built = build_manifest(build.root, build.data, features, text, build.frontend, build.config,
                               build.candidates, build.manifest_sha256,
                               cache_digest(build.config, build.stamp or build.manifest_sha256), build.started)
        if built is not None:
            return built
    return _one_pass(build)


def _in_pieces(build: _Build) -> DatasetIndex | None:
    """The index of a large local dataset its format builds in pieces (Parquet: parquet_pieces.py;
    lhotse cuts: cuts_pieces.py; a mix: mix_pieces.py), found by its listing's key (its files'
    stamps, a SHA-256, the SHA-256 of a stream the pieces were cut from or of a mix's parts'); None
    where the listing's build is the way."""
    in_pieces = IN_PIECES.get(build.located.format.name)
    pieces = None if in_pieces is None else in_pieces(build.root, build.data.metadata_file, build.data,
                                                      build.features, build.text, build.candidates)
    if pieces is None:
        return None
    key = build.stamp or build.located.stamp()
    try:
        return build_manifest(build.root, build.data, build.features, build.text, build.frontend, build.config,
                              build.candidates, pieces.sha256 or key, cache_digest(build.config, key), build.started,
                              pieces.work, pieces.named, repeated=pieces.repeated, datasets=pieces.datasets)
    finally:
        if pieces.spill is not None:
            remove_spill(pieces.spill)


def _started(data: DataConfig, features: FeaturesConfig, text: TextConfig, fixed: Vocabulary | None) -> _Build:
    """The dataset located and the build's facts gathered, before any metadata is parsed. A
    manifest's cache is found by its stamp (size and mtime, or a store's version or ETag: no
    read), taken before the manifest is read; by its content's hash where there is no stamp: then a
    manifest built in one pass is read whole once, its hash the cache lookup's and the cache's (a
    large one, built in pieces, is hashed a piece at a time and never held). A local LJSpeech
    layout's is found by its metadata's stamp too, without listing its audio: each file is
    checked against the index when a producer reads it (corpus/base.py: ``Format.loose``)."""
    started = time.perf_counter()
    located = locate(data.path, data.metadata_file)
    root, metadata_file, fmt = located.root, located.metadata_file, located.format
    data = dataclasses.replace(data, metadata_file=metadata_file)
    frontend = frontend_of((text.frontend, text.digits), fresh=True)
    if fixed is not None:
        problem = fixed.check_engine(frontend)
        if problem:
            raise TextError(f"cannot keep the run's vocabulary: {problem}")
    build = _Build(root, located, data, features, text, fixed, frontend,
                   index_config(data, features, text, frontend, fixed), index_cache_file(root, data), started)
    # a manifest at a URL is read whole by the one-process build (its pieces are local byte ranges);
    # a lhotse cut manifest's pieces are blocks of its gzip stream (its format's pieces: _in_pieces)
    size = file_size(root / metadata_file) if fmt.split and not is_url(metadata_file) else 0
    build.chunked = fixed is None and size >= CHUNKED_MIN_BYTES
    if not build.candidates:
        return build
    # shards (tar, Parquet, Shar): found by their files' stamps, their listing not read
    build.stamp = located.stamp()
    if not build.chunked and not build.stamp and fmt.manifest:
        build.metadata = read_small_manifest(located)
    build.manifest_sha256 = (hashlib.sha256(build.metadata).hexdigest() if build.metadata is not None
                             else sha256_of(metadata_location(root, metadata_file)) if fmt.manifest and not build.stamp
                             else "")
    return build


def _found_by_stamp(build: _Build) -> DatasetIndex | None:
    """The index of a manifest (or local LJSpeech layout) as cached, found by its stamp or content
    digest: not parsed (nor, a large one, held in memory); None when there is none."""
    quick = build.stamp or build.manifest_sha256
    found = manifest_hit(build.root, build.candidates, cache_digest(build.config, quick)) if quick else None
    if found is None:
        return None
    try:
        loaded = loaded_index(found[1], build.fixed)
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("index cache %s is unusable (%s); rebuilding the index", found[0], exc)
        return None
    stats = IndexStats(cache="hit", cache_file=str(found[0]))
    return finished_index(build.root, *loaded, found[1].header["key"], stats, build.started, False, None, build.data)


def _one_pass(build: _Build) -> DatasetIndex:
    """The index from the metadata's listing (its digest and the audio listed: the metadata read
    whole, a mix's parts in turn): the cache file of that key loaded, else the index derived
    again, reusing what a stale cache file still holds."""
    root, data, metadata_file, fmt = build.root, build.data, build.data.metadata_file, build.located.format
    hashed = build.metadata is not None  # what manifest_sha256 is the hash of
    listing = build.located.listing(data.columns, build.metadata)
    if not hashed and fmt.manifest and build.candidates and not build.stamp:
        build.manifest_sha256 = listing.sha256.hex()
    build.metadata = None  # held below as long as it is needed, not by the build's facts
    audio = listing.audio
    key = index_key_of(listing.sha256, audio, build.config)
    cache_path, cached, state = read_cache(build.candidates, key) if build.candidates else (None, None, "off")
    if state == "stale":
        log.info(STALE_CACHE, cache_path)
    stats = IndexStats(cache=state)
    # Kept for the scan, but a manifest's: it may be of millions of clips, read again if a scan is wanted.
    scan_inputs = None if fmt.manifest or listing.raw is None else (metadata_file, listing.raw, audio)
    if state == "hit" and cached is not None:
        try:
            loaded = loaded_index(cached, build.fixed)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("index cache %s is unusable (%s); rebuilding the index", cache_path, exc)
            cached, stats.cache = None, "corrupt"
        else:
            stats.cache_file = str(cache_path)
            if not fmt.manifest and build.stamp and cache_path is not None:  # found by its stamp next
                restamp(cache_path, cached, loaded[1] if fmt.loose else [], cache_digest(build.config, build.stamp))
            return finished_index(root, *loaded, key, stats, build.started, False, scan_inputs, data)
    return _derived(build, listing, key, cached, stats, scan_inputs)


def _derived(build: _Build, listing: Listing, key: str, cached: CachedIndex | None,
             stats: IndexStats, scan_inputs: tuple[str, bytes, dict[str, AudioFile]] | None) -> DatasetIndex:
    """The index derived from the metadata's entries, the headers and texts read (those a stale
    cache file holds reused), through the rules; written to the cache."""
    root, data, text, fmt, audio = build.root, build.data, build.text, build.located.format, listing.audio
    entries, rejected = build.located.clips(data.columns, listing.raw)  # at a URL: its audio paths beside it
    agreed = fingerprints(entries, audio, listing.sha256.hex())
    del listing  # the metadata's bytes: not held while the clips are read
    walked, probes = fmt.walked(root, data.metadata_file)  # a shards' walk's rejections, headers
    rejected = rejected + walked
    units = _read(build, entries, audio, cached, probes, stats)
    samples, rejected, lost = apply_rules(entries, rejected, audio, probes, units, data, build.features, text,
                                          build.frontend, build.fixed)
    vocab = build.fixed or vocabulary_of(build.frontend, samples)
    if build.candidates:
        header, reuse = cache_payload(key, root, build.config, rejected, entries, audio, probes, units,
                                      build.frontend, text, lost, vocab)
        header["agreement"] = agreed
        if fmt.manifest:
            header["manifest"] = {"digest": cache_digest(build.config, build.stamp or build.manifest_sha256),
                                  "measured": measured_files(entries, audio)}
        elif build.stamp:  # found by the metadata's (or shards') stamp: a layout's missing files looked for
            header["manifest"] = {"digest": cache_digest(build.config, build.stamp),
                                  "measured": absent_files(rejected) if fmt.loose else []}
    del entries, units, probes  # the clips are in the samples now: not held while they become columns
    table = with_files(SampleTable.from_samples(samples), samples, audio)
    del samples
    number_groups(table)  # once, here: the cache stores them, the planners and the coordinator read them
    if build.candidates:
        header["names"] = {"speakers": table.speakers, "languages": table.languages}
        written = write_cache(build.candidates, header, {**table.sections(), "reuse": reuse})
        stats.cache_file = str(written) if written else ""
    return finished_index(root, table, rejected, lost, agreed, vocab, key, stats, build.started, True, scan_inputs,
                          data)


def _read(build: _Build, entries: list[Entry], audio: dict[str, AudioFile], cached: CachedIndex | None,
          probes: dict[str, AudioProbe], stats: IndexStats) -> dict[TextKey, Units]:
    """The audio headers (into ``probes``) and the texts' units the build needs: those a stale
    cache file holds reused, the rest read (in helper processes when worth it); counted in ``stats``."""
    text = build.text
    old_probes, old_units = reusable(cached, build.frontend)
    todo = to_read(entries, audio, old_probes, old_units, text, probes, stats)
    read_started = time.perf_counter()
    results, stats.workers = run_items(build.root, todo, max(1, index_workers(build.data)),
                                       (text.frontend, text.digits))
    stats.read_s = time.perf_counter() - read_started
    units = dict(old_units)
    for (name, _, text_key), (probe, made) in zip(todo, results):
        if name is not None and probe is not None:
            probes[name] = AudioProbe(*probe)
            stats.headers_read += 1
        if text_key is not None and made is not None:
            units[text_key] = Units(*made)
            stats.texts_tokenized += 1
    return units
