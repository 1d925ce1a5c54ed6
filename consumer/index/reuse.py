"""What an index build takes from the index cache: a cache file found without parsing the
metadata (by its stamp or content digest, its measured files stat'ed), a cached index loaded,
and what a stale one still holds (audio headers, text units); what the build writes back.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Sequence

import msgpack
import numpy as np
from ...shared.config import TextConfig
from ...shared.dataset.cache import (PROBE_FIELDS, REJECTION_FIELDS, UNITS_FIELDS, CachedIndex, columns_of, open_index,
                                     rejections_of, write_cache)
from ...shared.dataset.corpus.base import Located
from ...shared.dataset.files import UNMEASURED
from .parallel import TextKey, Item, probe_tuple
from ...shared.dataset.storage import file_sha256, is_url, remote_stat
from ...shared.dataset.table import SampleTable
from ...shared.dataset.types import AudioFile, AudioProbe, DatasetError, IndexStats, Sample
from ...shared.dataset.layouts import Entry, Rejection
from ...shared.text import LANGUAGES, Frontend, Units
from ...shared.vocab import Vocabulary


def absent_files(rejected: Sequence[Rejection]) -> list[list[Any]]:
    """The files of clips rejected as missing, as :func:`measured_files` lists a missing one ([name,
    None, None]): a warm load by the metadata's stamp (:func:`manifest_hit`) takes the long way
    when one of them has come since."""
    return sorted({r.file: [r.file, None, None] for r in rejected if r.kind == "missing-audio" and r.file}.values())


def restamp(path: Path, cached: CachedIndex, rejected: Sequence[Rejection], digest: str) -> None:
    """The cache file of a local LJSpeech layout (or of shards) found the long way (its listing and
    the metadata's bytes as they were: ``Format.loose``) written again with the metadata's (the
    shards') present stamp (``digest``), so that the next start finds it by the stamp, without a
    listing; as it is when it has that stamp already."""
    manifest = cached.header.get("manifest")
    if isinstance(manifest, dict) and manifest.get("digest") == digest:
        return
    header = {**cached.header, "manifest": {"digest": digest, "measured": absent_files(rejected)}}
    write_cache([path], header, cached.sections)


def with_files(table: SampleTable, samples: Sequence[Sample], audio: dict[str, AudioFile]) -> SampleTable:
    """``table`` (of ``samples``) with each clip's audio file as listed (table.FILE_COLUMNS):
    UNMEASURED where the build looked at none (a manifest's clip with its duration); the table as
    it is when it looked at no file at all."""
    files = [audio.get(s.id) for s in samples]
    if not any(files):
        return table
    sizes = np.fromiter((f.size if f is not None else UNMEASURED for f in files), np.int64, len(files))
    mtimes = np.fromiter((f.mtime_ns if f is not None else UNMEASURED for f in files), np.int64, len(files))
    return table.with_files(sizes, mtimes)


def loaded_index(cached: CachedIndex, fixed: Vocabulary | None) -> tuple[SampleTable, list[Rejection], dict[str, Any],
                                                                      dict[str, Any], Vocabulary]:
    """(samples, rejections, lost characters, agreement fingerprints, vocabulary) of a cache file."""
    header = cached.header
    return (cached_table(cached), rejections_of(header["rejected"]), dict(header["lost"]), dict(header["agreement"]),
            fixed or Vocabulary.from_state_dict(header["vocabulary"]))


def cache_digest(config: dict[str, Any], manifest: str) -> str:
    """What a manifest's cache file is found by: the config and the manifest's stamp
    (storage.file_stamp), or its content's SHA-256 (hex) where it has none."""
    return hashlib.sha256(f"{sorted(config.items())!r}\0{manifest}".encode()).hexdigest()


def sha256_of(path: str) -> str:
    """A manifest's SHA-256 (hex), here or at a URL, read a piece at a time; "" when it cannot be
    read (the build says why). With the config, it is the digest the manifest's cache is found by
    (:func:`manifest_hit`)."""
    try:
        return file_sha256(path)
    except OSError:
        return ""


def read_small_manifest(located: Located) -> bytes | None:
    """The bytes of a manifest (the one-pass build's: a small one, or one at a URL); None when it
    cannot be read (the build reads it again, and says why)."""
    try:
        return located.read()
    except DatasetError:
        return None


def file_size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def measured_files(entries: Sequence[Entry], audio: dict[str, AudioFile]) -> list[list[Any]]:
    """The audio files a manifest's index looked at (those of clips without a duration), as
    [name, size, mtime] ([name, None, None] for one missing), for :func:`manifest_hit`."""
    out: dict[str, list[Any]] = {}
    for entry in entries:
        if entry.duration is None and entry.audio:
            file = audio.get(entry.id)
            out.setdefault(file.name if file else entry.audio,
                           [file.name, file.size, file.mtime_ns] if file else [entry.audio, None, None])
    return sorted(out.values())


def manifest_hit(root: Path, candidates: list[Path], digest: str) -> tuple[Path, CachedIndex] | None:
    """A cache file of this manifest (or local LJSpeech layout's metadata: ``Format.loose``)
    under this config whose measured audio files are as they were (:func:`measured_files`,
    :func:`absent_files`): one stat each, no parse of the metadata; its sections checked. None: take the
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


def cached_table(cached: CachedIndex) -> SampleTable:
    names = cached.header["names"]
    sections = {name: cached.blob(name) if name in READ_BY_CLIP else view for name, view in cached.sections.items()}
    table = SampleTable.from_sections(sections, names["speakers"], names["languages"], checksummed=cached.checked)
    table.stored_in = cached
    return table


def reusable(cached: CachedIndex | None, frontend: Frontend) -> tuple[dict[str, tuple], dict[TextKey, Units]]:
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
            table = cached_table(cached)
            old_units = {(lang, txt): Units(units) for lang, txt, units in
                         zip([table.languages[c] for c in table.column("language").tolist()], table.strings("text"),
                             table.strings("units"))}
            old_units.update({(lang, txt): Units(units, lost)
                              for lang, txt, units, lost in zip(*(u[f] for f in UNITS_FIELDS))})
        return old_probes, old_units
    except (KeyError, TypeError, ValueError):
        return {}, {}


def to_read(entries: Sequence[Any], audio: dict[str, Any], old_probes: dict[str, tuple],
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


def cache_payload(key: str, root: Path, config: dict[str, Any], rejected: Sequence[Any],
                  entries: Sequence[Any], audio: dict[str, Any], probes: dict[str, AudioProbe],
                  units: dict[TextKey, Units], frontend: Frontend, text: TextConfig, lost: dict[str, Any],
                  vocab: Vocabulary) -> tuple[dict[str, Any], bytes]:
    """The index cache's header (without the samples: their columns are sections of their own,
    and their names the caller's to add), and what a later rebuild can reuse (a msgpack section)."""
    used = {a.name for a in audio.values()}
    probe_rows = [(name, audio_file.size, audio_file.mtime_ns, *probe_tuple(probes[name]))
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

