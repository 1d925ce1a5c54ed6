"""WebDataset-style tar shards as a dataset: which shards ``--data`` names, their members
grouped into clips, and each clip's locator.

:func:`read_shards` walks the shards' tar headers and text members (a Parquet file's rows and a
Shar shard's recording tar alike) into a :class:`ShardListing`, read as a JSON-lines manifest
whose audio is each member's locator ``SHARD#MEMBER@OFFSET+SIZE``. The members, the names
``--data`` takes, the listing's cache and the rejections: docs/design/data.md, "Tar shards and
object stores".
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import msgpack

from ..config import DataConfig
from ..dataset.cache import index_cache_file, read_cache, remote_root, write_cache
from ..dataset.parquet import list_file, probe_row
from ..dataset.probe import probe_bytes, probe_url
from ..dataset.shar import SHAR_GLOB, add_cuts, audio_member, cuts_file, is_shar, is_shar_directory
from ..dataset.storage import (Reader, StorageError, first_line, is_url, list_remote, open_file, shown, stamp_of,
                               transit_errors, url_fs)
from ..dataset.types import (AUDIO_SUFFIXES, AudioFile, AudioProbe, DatasetError, Shard,
                             ShardListing)
from ..dataset.corpus.address import Member, Row, address_of
from .layouts import Rejection, nfc

log = logging.getLogger(__name__)


# The pattern a directory of shards stands for.
SHARD_GLOB = "*.tar"


# The pattern a directory of Parquet files stands for (shared/dataset/parquet.py).
PARQUET_GLOB = "*.parquet"


# The text members, in order of preference for the text itself.
TEXT_SUFFIXES = ("json", "txt")


# A text or JSON member larger than this is not a clip's text (a mislabelled file): rejected, not read.
MAX_TEXT_BYTES = 1 << 20


# Bump when the listing's rules or its cached form change (PARQUET_LISTING_FORMAT: a Parquet file's).
LISTING_FORMAT = 1
PARQUET_LISTING_FORMAT = 1




_BRACE_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_BRACE_LIST = re.compile(r"\{([^{}]*,[^{}]*)\}")
_GLOB_CHARS = re.compile(r"[*?\[]")


def _kind(pattern: str) -> str:
    """The kind of files a shard pattern names: "parquet", "shar" (a Shar directory's recording
    tars), "tar", or "" (not a pattern of shards)."""
    lowered = pattern.lower()
    if lowered.endswith(PARQUET_GLOB[1:]):
        return "parquet"
    if lowered.endswith(SHARD_GLOB[1:]):
        return "shar" if is_shar(pattern) else "tar"
    return ""


def shard_source(path: str, metadata_file: str) -> tuple[Path, str] | None:
    """(root, shard pattern) when ``--data`` names shards (docs/design/data.md, "Tar shards and
    object stores"), else None.

    ``metadata_file``: the configured metadata file; a directory that holds it is not a shard
    directory."""
    if is_url(path):
        pattern = path if _kind(path) else path.rstrip("/") + "/" + _directory_glob(path)
        return remote_root(pattern), pattern
    given = Path(path).expanduser()
    if _kind(given.name):
        return given.parent.resolve(), given.name
    if given.is_dir() and not (given / metadata_file).exists():
        if is_shar_directory([p.name for p in given.iterdir()]):  # a lhotse Shar directory (shar.py)
            return given.resolve(), SHAR_GLOB
        for glob in (SHARD_GLOB, PARQUET_GLOB):
            if any(given.glob(glob)):
                return given.resolve(), glob
    return None


def _directory_glob(url: str) -> str:
    """The pattern a directory URL stands for: its Parquet files where it holds some and no tar
    shard (one listing), else its tar shards (also where the store cannot be asked now: listing
    them says why)."""
    try:
        names = [s.name.lower() for s in list_remote(url)]
    except DatasetError:
        return SHARD_GLOB
    if is_shar_directory(names):
        return SHAR_GLOB
    parquet = any(n.endswith(PARQUET_GLOB[1:]) for n in names) and not any(n.endswith(SHARD_GLOB[1:]) for n in names)
    return PARQUET_GLOB if parquet else SHARD_GLOB


def expand_braces(pattern: str) -> list[str]:
    """``a-{000..002}.tar`` -> a-000.tar, a-001.tar, a-002.tar (widths kept); ``{a,b}`` -> each."""
    found = [m for m in (_BRACE_RANGE.search(pattern), _BRACE_LIST.search(pattern)) if m is not None]
    if not found:
        return [pattern]
    match = min(found, key=lambda m: m.start())  # the leftmost brace varies slowest
    if match.re is _BRACE_RANGE:
        first, last = match[1], match[2]
        width = len(first) if first.startswith("0") or len(first) == len(last) else 0
        values = [str(n).zfill(width) for n in range(int(first), int(last) + 1)]
    else:
        values = match[1].split(",")
    return [p for v in values for p in expand_braces(pattern[:match.start()] + v + pattern[match.end():])]


def list_shards(root: Path, pattern: str) -> list[Shard]:
    """The shards ``pattern`` names, in name order; DatasetError when there are none or one is missing."""
    shards: list[Shard] = []
    for name in expand_braces(pattern):
        found = _remote_shards(name) if is_url(name) else _local_shards(root, name)
        if not found:
            where = shown(name) if is_url(name) else str(root / name)
            kind = "Parquet file" if _kind(name) == "parquet" else "tar shard"
            raise DatasetError(f"no {kind} at {where}" if not _GLOB_CHARS.search(name)
                               else f"no {kind} matches {where}")
        shards.extend(found)
    unique = {s.name: s for s in shards}
    return [unique[n] for n in sorted(unique)]


def _local_shards(root: Path, name: str) -> list[Shard]:
    paths = sorted(root.glob(name)) if _GLOB_CHARS.search(name) else [root / name]
    found = []
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            continue
        if path.is_file():
            found.append(Shard(path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path),
                               st.st_size, st.st_mtime_ns))
    return found


def _remote_shards(url: str) -> list[Shard]:
    try:
        fs, path = url_fs(url)
        protocol = url.split("://", 1)[0]
        if _GLOB_CHARS.search(path):
            infos = list(fs.glob(path, detail=True).values())
        else:
            infos = [fs.info(path)]
    except FileNotFoundError:
        return []
    except (ValueError, *transit_errors()) as exc:  # no such bucket, no credentials, no connection
        raise DatasetError(f"cannot list {shown(url)}: {type(exc).__name__}: {first_line(exc)}") from None
    found = []
    for info in infos:
        if info.get("type", "file") != "file":
            continue
        name = info["name"]  # without the protocol (s3, gs, file), or the whole URL (http)
        found.append(Shard(name if is_url(name) else f"{protocol}://{name}", int(info.get("size") or 0), stamp_of(info)))
    return found


@dataclass
class _Clip:
    """A key's members as the walk finds them."""

    key: str
    audio: tuple[int, str, int, int] | None = None  # (suffix rank, member, offset, size)
    texts: dict[str, bytes] = field(default_factory=dict)  # suffix -> bytes
    members: list[str] = field(default_factory=list)
    rejected: bool = False  # a member of it was rejected (and the rejection noted)


_LISTINGS: dict[tuple[str, str], tuple[tuple[Shard, ...], ShardListing]] = {}  # one per dataset, while unchanged


def read_shards(root: Path, pattern: str) -> ShardListing:
    """The listing of the shards ``pattern`` names below ``root`` (docs/design/data.md, "Tar shards
    and object stores"). It is kept
    beside the index cache (``DATASET/.stoker/shards-*.msgpack``, else the user cache dir),
    keyed on every shard's name, size and stamp, so that only a changed set of shards is
    walked again; and in this process, which asks for the manifest and the audio in turn."""
    shards, stamps, key = _listed_files(root, pattern)
    kind = _kind(pattern)
    parquet, shar = kind == "parquet", kind == "shar"
    cached = _LISTINGS.get((str(root), pattern))
    if cached is not None and cached[0] == stamps:
        return cached[1]
    candidates = [path.with_name(path.name.replace("index-", "shards-", 1))
                  for path in index_cache_file(root, DataConfig(path=str(root), metadata_file=pattern))]
    listing = _cached_listing(candidates, key)
    if listing is None:
        listing = ShardListing(shards=len(shards))
        seen: dict[str, str] = {}  # id -> where it was first
        for shard in shards:
            if parquet:
                list_file(root, shard, listing)
            elif shar:
                _list_shar_shard(root, shard, listing, seen)
            else:
                _list_shard(root, shard, listing, seen)
        listed = msgpack.packb(listing.to_payload(), use_bin_type=True)
        write_cache(candidates, {"key": key}, {"listing": listed})
    _LISTINGS.clear()
    _LISTINGS[(str(root), pattern)] = (stamps, listing)
    log.info("%d %s of %s: %d clips, %d rejected", len(shards),
             "Parquet files" if parquet else "Shar shards" if shar else "tar shards",
             shown(pattern) if is_url(pattern)
             else root / pattern, len(listing.lines), len(listing.rejected))
    return listing


def listing_stamp(root: Path, pattern: str) -> str:
    """What the listing of the shards ``pattern`` names is of (their names, sizes and stamps, a
    Shar shard's cuts file's too, and the listing's rules), as one digest: a shard dataset's index
    cache is found by it without reading the listing (consumer/index/index.py). DatasetError as :func:`list_shards`."""
    return _listed_files(root, pattern)[2]


def _listed_files(root: Path, pattern: str) -> tuple[tuple[Shard, ...], tuple[Shard, ...], str]:
    """The shards ``pattern`` names, every file their listing reads (a Shar shard's cuts file
    too), and the listing's key: a digest of those files and the listing's rules."""
    shards = tuple(list_shards(root, pattern))
    kind = _kind(pattern)
    parquet, shar = kind == "parquet", kind == "shar"
    # a Shar shard's texts are its cuts file's: theirs are part of what the listing is of
    stamps = shards + tuple(_shar_cuts(root, shards)) if shar else shards
    kind = ("parquet", PARQUET_LISTING_FORMAT) if parquet else ("shar", LISTING_FORMAT) if shar else LISTING_FORMAT
    return shards, stamps, hashlib.sha256(repr((kind, pattern, stamps)).encode("utf-8", "surrogateescape")).hexdigest()


def _cached_listing(candidates: list[Path], key: str) -> ShardListing | None:
    """The listing a cache file holds under ``key``, or None (no such file, or another key)."""
    _, cached, state = read_cache(candidates, key)
    if state != "hit" or cached is None:
        return None
    try:
        return ShardListing.from_payload(cached.unpack("listing"))
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("the cached listing of the shards is unusable (%s); walking them again", exc)
        return None


def _list_shard(root: Path, shard: Shard, listing: ShardListing, seen: dict[str, str]) -> None:
    """Walk one shard's tar headers, reading its text members; add its clips and rejections."""
    path = shard.name if is_url(shard.name) or Path(shard.name).is_absolute() else str(root / shard.name)
    clips: dict[str, _Clip] = {}
    rank = {suffix.lstrip("."): n for n, suffix in enumerate(AUDIO_SUFFIXES)}
    try:
        with open_file(path) as f, tarfile.open(fileobj=f, mode="r:") as tar:
            for member in _members(tar, shard, listing):
                directory, _, base = member.name.rpartition("/")
                stem, dot, suffix = base.partition(".")
                if not dot or not stem:
                    continue  # no key (a README, a directory's metadata): not a clip's
                key = f"{directory}/{stem}" if directory else stem
                clip = clips.setdefault(key, _Clip(key))
                clip.members.append(member.name)
                suffix = suffix.lower()
                if member.offset_data + member.size > shard.size:
                    held = max(0, shard.size - member.offset_data)
                    listing.rejected.append(Rejection(
                        nfc(stem), f"member {member.name} of shard {shown(shard.name)} is truncated: the shard "
                                   f"holds {held} of its {member.size} bytes", file=f"{shard.name}#{member.name}",
                        kind="unreadable-audio" if suffix in rank else ""))
                    clip.rejected = True
                    continue
                if suffix in rank:
                    if clip.audio is None or rank[suffix] < clip.audio[0]:
                        clip.audio = (rank[suffix], member.name, member.offset_data, member.size)
                elif suffix in TEXT_SUFFIXES:
                    if member.size > MAX_TEXT_BYTES:
                        listing.rejected.append(Rejection(
                            nfc(stem), f"member {member.name} of shard {shown(shard.name)} is {member.size} bytes, "
                                       f"too large for a text", file=f"{shard.name}#{member.name}"))
                        clip.rejected = True
                        continue
                    handle = tar.extractfile(member)
                    clip.texts[suffix] = handle.read() if handle is not None else b""
    except (OSError, StorageError, tarfile.TarError, EOFError) as exc:
        listing.rejected.append(Rejection(f"shard:{shard.name}", f"shard {shown(shard.name)} cannot be read: "
                                                                 f"{type(exc).__name__}: {first_line(exc)}"))
    for clip in clips.values():
        _add_clip(shard, clip, listing, seen)


def _shar_cuts(root: Path, shards: tuple[Shard, ...]) -> list[Shard]:
    """The cuts files of a Shar dataset's recording tars, as listed (their sizes and stamps: the
    listing's key); a missing one is left out (its shard's listing says so)."""
    found: list[Shard] = []
    for shard in shards:
        name = cuts_file(shard.name)
        found.extend(_remote_shards(name) if is_url(name) else _local_shards(root, name))
    return found


def _list_shar_shard(root: Path, shard: Shard, listing: ShardListing, seen: dict[str, str]) -> None:
    """Walk one Shar recording tar's headers (its audio members by cut id; a truncated one a
    rejection naming the cut and shard), then add its cuts (shar.py)."""
    path = shard.name if is_url(shard.name) or Path(shard.name).is_absolute() else str(root / shard.name)
    members: dict[str, tuple[str, int, int] | None] = {}  # None: its member truncated (rejected here)
    try:
        with open_file(path) as f, tarfile.open(fileobj=f, mode="r:") as tar:
            for member in _members(tar, shard, listing):
                cut = audio_member(member.name.rpartition("/")[2])
                if cut is None:
                    continue
                if member.offset_data + member.size > shard.size:
                    held = max(0, shard.size - member.offset_data)
                    listing.rejected.append(Rejection(
                        nfc(cut), f"member {member.name} of Shar shard {shown(shard.name)} (the audio of cut {cut}) "
                                  f"is truncated: the shard holds {held} of its {member.size} bytes",
                        file=f"{shard.name}#{member.name}", kind="unreadable-audio"))
                    members[nfc(cut)] = None
                    continue
                members[nfc(cut)] = (member.name, member.offset_data, member.size)
    except (OSError, StorageError, tarfile.TarError, EOFError) as exc:
        listing.rejected.append(Rejection(f"shard:{shard.name}", f"Shar shard {shown(shard.name)} cannot be read: "
                                                                 f"{type(exc).__name__}: {first_line(exc)}"))
    add_cuts(root, shard, members, listing, seen)


def _members(tar: tarfile.TarFile, shard: Shard, listing: ShardListing) -> Iterator[tarfile.TarInfo]:
    """The regular file members of a tar, one header at a time; a header that cannot be read
    ends the walk with a rejection naming the shard and the byte."""
    while True:
        at = tar.offset
        try:
            member = tar.next()
        except tarfile.TarError as exc:
            listing.rejected.append(Rejection(
                f"shard:{shard.name}", f"shard {shown(shard.name)} has an unreadable tar header at byte {at} "
                                       f"({first_line(exc)}): the members after it are not indexed"))
            return
        if member is None:  # the end, or (past the first header) one tarfile could not read
            tar.fileobj.seek(at)
            block = tar.fileobj.read(tarfile.BLOCKSIZE)
            if block.strip(b"\0"):
                listing.rejected.append(Rejection(
                    f"shard:{shard.name}", f"shard {shown(shard.name)} has an unreadable tar header at byte {at} "
                                           f"(invalid header): the members after it are not indexed"))
            return
        tar.members = []  # the walk keeps nothing: a shard of 100,000 members is no list of 100,000
        if member.isfile():
            yield member


def _add_clip(shard: Shard, clip: _Clip, listing: ShardListing, seen: dict[str, str]) -> None:
    sample_id = nfc(clip.key.rpartition("/")[2])
    named = f"{clip.key}.* of shard {shown(shard.name)}"
    if clip.rejected:
        return
    if clip.audio is None:
        listing.rejected.append(Rejection(sample_id, f"no audio member for {named} (members: "
                                                     f"{', '.join(clip.members)})", kind="missing-audio"))
        return
    _, member, offset, size = clip.audio
    locator = str(Member(shard.name, member, offset, size))
    fields, problem = _text_fields(clip)
    if problem:
        listing.rejected.append(Rejection(sample_id, f"{problem} for {named}", file=locator))
        return
    if sample_id in seen:
        listing.rejected.append(Rejection(sample_id, f"duplicate id {sample_id}: {named} (first in {seen[sample_id]})",
                                          file=locator))
        return
    seen[sample_id] = f"shard {shown(shard.name)}"
    line = {"id": sample_id, "audio_filepath": locator, **fields}
    duration = fields.get("duration")
    if type(duration) in (int, float) and duration > 0:
        listing.durations[locator] = float(duration)
    listing.lines.append(json.dumps(line, ensure_ascii=False))
    listing.audio[sample_id] = AudioFile(locator, size, shard.mtime_ns)


def _text_fields(clip: _Clip) -> tuple[dict[str, Any], str]:
    """A clip's manifest fields from its JSON and text members, or why there are none."""
    fields: dict[str, Any] = {}
    raw = clip.texts.get("json")
    if raw is not None:
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            return {}, f"{clip.key}.json is not JSON ({first_line(exc)})"
        if not isinstance(obj, dict):
            return {}, f"{clip.key}.json is not a JSON object"
        fields = {k: obj[k] for k in ("text", "normalized_text", "speaker", "language", "duration") if k in obj}
    txt = clip.texts.get("txt")
    if txt is not None and not fields.get("text") and not fields.get("normalized_text"):
        try:
            fields["text"] = txt.decode("utf-8").strip()
        except UnicodeDecodeError:
            return {}, f"{clip.key}.txt is not UTF-8"
    if "text" not in fields and "normalized_text" not in fields:
        return {}, "no text (a .txt member, or a .json member with 'text')"
    return fields, ""


_READER: Reader | None = None  # this process's, for the index's header reads


def probe_member(root: Path, name: str) -> AudioProbe:
    """The audio header facts of the member a locator names (its bytes read, not decoded), or of
    a loose file at a URL (a manifest's clip without a duration, an LJSpeech layout's wav: its
    header read, :func:`probe_url`); or why it cannot be used."""
    global _READER
    locator = address_of(name)
    if isinstance(locator, Row):  # a Parquet row's (shared/dataset/parquet.py)
        return probe_row(root, name)
    if not isinstance(locator, Member):
        return probe_url(name)
    if _READER is None or _READER.root != root:
        _READER = Reader(root)
    try:
        data = _READER.read(locator.shard, locator.offset, locator.size)
    except FileNotFoundError:
        return AudioProbe(error="audio file missing", detail=f"no shard {shown(locator.shard)}")
    except StorageError as exc:
        return AudioProbe(error="audio file unreadable", detail=str(exc))
    return probe_bytes(data)
