"""Where a dataset's metadata and audio are: the directory (or mix file) a user names, here
or at a URL (:func:`locate`: a manifest, an LJSpeech layout or a mix file in an object
store), the audio file of each id (any format libsndfile reads; :data:`AUDIO_SUFFIXES` in
order of preference), and the metadata bytes as read. Names are matched to ids in Unicode normal
form C (shared/layouts.nfc): a file whose name is decomposed on disk is its composed id's.
"""

from __future__ import annotations

import os
import posixpath
import stat as stat_module
from pathlib import Path
from typing import Iterable

from ..dataset.shards import list_remote, read_shards, remote_root, remote_stat, shard_source
from ..dataset.storage import StorageError, is_url, read_url, shown
from ..dataset.types import AUDIO_SUFFIXES, AudioFile, DatasetError
from ..cuts import decompressed
from ..layouts import (COLUMNS_AUTO, Entry, LayoutError, Rejection, is_cuts, is_manifest, is_parquet, is_shards,
                       nfc)
from ..mixes import MIX_ID_SEPARATOR, is_mix, pack_mix, parse_entries, parse_mix_spec, unpack_mix

DEMO_DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "demo"


AUDIO_DIR = "wavs"


AUDIO_SUFFIX = ".wav"  # the LJSpeech suffix, named in "missing" reasons


LJSPEECH_SUFFIX = ".csv"  # LJSpeech metadata's: a URL ending so names the metadata file, not a directory (locate)


# The size and mtime of an audio file not looked at (a manifest gives its clip's duration): a
# value no file has, so that the index key and the agreement fingerprints tell it apart.
UNMEASURED = -1


def resolve_root(path: str) -> Path:
    """The dataset directory a user named, or the embedded demo set for ''."""
    root = Path(path).expanduser() if path else DEMO_DATA_DIR
    if not root.exists():
        raise DatasetError(f"dataset directory {root} does not exist")
    if not root.is_dir():
        raise DatasetError(f"dataset path {root} is not a directory")
    return root.resolve()


def locate(path: str, metadata_file: str) -> tuple[Path, str]:
    """(root, metadata file) of what ``--data`` names: a dataset directory, a mix file
    (``*.yaml``, shared/layouts.py), whose directory is the root its datasets are found from,
    or tar shards (shared/dataset/shards.py: their root, and their pattern as the metadata file),
    or a lhotse cut manifest (``DIR/cuts.jsonl.gz``, shared/cuts.py: its directory the root).

    A JSON-lines manifest at a URL (``s3://bucket/corpus/train.jsonl``, or a directory URL with
    ``data.metadata_file`` a manifest's name) is its own metadata file, the URL; its root a
    directory of this host's cache (as for shards at a URL) that holds the index and feature
    caches, and its clips' relative audio paths are beside it (:func:`resolve_audio`). So is an
    LJSpeech layout at a URL (:func:`_remote_metadata`): its metadata file's URL, its clips'
    audio the files of ``wavs/`` beside it (:func:`scan_remote_audio`). So is a mix file at a
    URL, each of its datasets a URL or a path relative to the mix file's URL
    (:func:`_read_remote_mix`)."""
    if path and is_url(path):
        name = path.rstrip("/").rpartition("/")[2]
        if not is_manifest(name) and not is_shards(name) and is_manifest(metadata_file):
            path, name = f"{path.rstrip('/')}/{metadata_file}", metadata_file
        if is_manifest(name) or is_mix(name):
            return remote_root(path), path
        metadata = _remote_metadata(path, name, metadata_file)
        if metadata is not None:
            return remote_root(metadata), metadata
    shards = shard_source(path, metadata_file) if path else None
    if shards is not None:
        return shards
    given = Path(path).expanduser() if path else None
    if given is not None and is_mix(given.name):
        if not given.is_file():
            raise DatasetError(f"mix file {given} does not exist")
        return given.resolve().parent, given.name
    if given is not None and is_cuts(given.name) and not given.is_dir():  # a lhotse cut manifest: its directory
        return resolve_root(str(given.parent)), given.name
    return resolve_root(path), metadata_file


def _remote_metadata(path: str, name: str, metadata_file: str) -> str | None:
    """The URL of the LJSpeech metadata file that ``path`` (a URL whose last name is ``name``)
    names: itself when it ends in ``.csv`` or is named as ``data.metadata_file``, else
    ``path/metadata_file`` when the store holds it (one request); None: not an LJSpeech layout
    (a directory of tar shards, shared/dataset/shards.py)."""
    if is_shards(name):
        return None
    if name.lower().endswith(LJSPEECH_SUFFIX) or name == metadata_file.rpartition("/")[2]:
        return path
    candidate = f"{path.rstrip('/')}/{metadata_file}"
    return candidate if remote_stat(candidate) is not None else None


def beside(path: str, metadata_file: str) -> str:
    """What ``--data`` names for a second metadata file ``metadata_file`` beside the one ``path``
    names (data.eval_file beside the training set's): a URL naming a manifest or an LJSpeech
    metadata file (``s3://b/c/train.jsonl``): its directory's URL, so that :func:`locate` finds
    ``metadata_file`` there; ``metadata_file`` itself when it is a URL; else ``path`` as given
    (a dataset directory, or a directory URL)."""
    if is_url(metadata_file):
        return metadata_file
    name = path.rstrip("/").rpartition("/")[2]
    if is_url(path) and (is_manifest(name) or name.lower().endswith(LJSPEECH_SUFFIX)):
        return path.rpartition("/")[0] + "/"
    return path


def audio_path(root: Path, sample_id: str, name: str | None = None) -> Path:
    """Where a clip's audio is: ``name`` (relative to the dataset, or absolute), by default ``wavs/<id>.wav``."""
    return root / relative_audio(sample_id, name)


def relative_audio(sample_id: str, name: str | None = None) -> str:
    """The audio path named in reasons and stored in the index: ``name``, by default ``wavs/<id>.wav``."""
    return name or f"{AUDIO_DIR}/{sample_id}{AUDIO_SUFFIX}"


def scan_audio(root: Path) -> dict[str, AudioFile]:
    """Every audio file of ``root/wavs`` by id (its name without the suffix), named ``wavs/<file>``.

    One directory listing (sizes and mtimes come with it); when an id has files with
    several suffixes, the first in :data:`AUDIO_SUFFIXES` wins. A missing directory
    gives an empty map (each clip is then rejected as missing).
    """
    rank = {suffix: i for i, suffix in enumerate(AUDIO_SUFFIXES)}
    directory = root / AUDIO_DIR
    chosen: dict[str, tuple[int, str]] = {}  # stem -> (suffix rank, file name)
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                name = entry.name
                stem, dot, suffix = name.rpartition(".")
                order = rank.get("." + suffix.lower()) if dot and stem else None
                if order is None or not entry.is_file():
                    continue
                stem = nfc(stem)  # the id, whatever normal form the file system keeps the name in
                previous = chosen.get(stem)
                if previous is None or order < previous[0]:
                    chosen[stem] = (order, name)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError as exc:
        raise DatasetError(f"cannot list {directory}: {exc.strerror}") from None
    # stat relative to the directory's descriptor: no path to resolve per file (the
    # per-file stat is most of a warm index load, and unavoidable: mtimes are the key)
    found: dict[str, AudioFile] = {}
    fd = os.open(directory, os.O_RDONLY)
    try:
        stat = os.stat
        for stem, (_, name) in chosen.items():
            try:
                st = stat(name, dir_fd=fd)
            except OSError:
                continue  # vanished while listing: the clip is reported missing
            found[stem] = AudioFile(f"{AUDIO_DIR}/{name}", st.st_size, st.st_mtime_ns)
    finally:
        os.close(fd)
    return found


def scan_remote_audio(metadata_file: str) -> dict[str, AudioFile]:
    """:func:`scan_audio` of an LJSpeech layout at a URL: the files of ``wavs/`` beside the
    metadata file at ``metadata_file``, by id, each named by its URL, from one listing of the
    store (sizes and modification stamps come with it), the first of :data:`AUDIO_SUFFIXES`
    winning; no such directory: an empty map (each clip rejected as missing)."""
    rank = {suffix: i for i, suffix in enumerate(AUDIO_SUFFIXES)}
    chosen: dict[str, tuple[int, AudioFile]] = {}  # id -> (suffix rank, file)
    for file in list_remote(f"{metadata_file.rpartition('/')[0]}/{AUDIO_DIR}/"):
        stem, dot, suffix = file.name.rpartition("/")[2].rpartition(".")
        order = rank.get("." + suffix.lower()) if dot and stem else None
        if order is None:
            continue
        stem = nfc(stem)
        previous = chosen.get(stem)
        if previous is None or order < previous[0]:
            chosen[stem] = (order, AudioFile(file.name, file.size, file.mtime_ns))
    return {stem: file for stem, (_, file) in chosen.items()}


def resolve_audio(entries: list[Entry], metadata_file: str) -> list[Entry]:
    """``entries`` of a manifest at a URL (:func:`locate`) with each relative audio path made the
    URL beside the manifest (``wavs/a.wav`` of ``s3://b/c/train.jsonl``: ``s3://b/c/wavs/a.wav``);
    a URL or an absolute path stays as written. An LJSpeech layout's at a URL each get the URL
    ``wavs/<id>.wav`` beside its metadata, which a clip without audio is reported missing as (its
    file is found by :func:`scan_remote_audio`). Changed in place (the entries are the caller's
    fresh parse); other metadata's entries (shards at a URL: their locators are URLs) are returned
    as they are."""
    if is_url(metadata_file) and not is_manifest(metadata_file) and not is_shards(metadata_file) \
            and not is_mix(metadata_file):
        audio_dir = f"{metadata_file.rpartition('/')[0]}/{AUDIO_DIR}/"
        for entry in entries:
            entry.__dict__["audio"] = f"{audio_dir}{entry.id}{AUDIO_SUFFIX}"
        return entries
    if not is_url(metadata_file) or not is_manifest(metadata_file):
        return entries
    base = metadata_file.rpartition("/")[0] + "/"
    for entry in entries:
        audio = entry.audio
        if audio and not is_url(audio) and not audio.startswith("/"):
            entry.__dict__["audio"] = base + (audio[2:] if audio.startswith("./") else audio)
    return entries


def metadata_location(root: Path, metadata_file: str) -> str:
    """Where a dataset's metadata file is: its URL, or its path below ``root``."""
    return metadata_file if is_url(metadata_file) else str(root / metadata_file)


def locate_audio(root: Path, entries: Iterable[Entry]) -> dict[str, AudioFile]:
    """The audio files a manifest names, by id: one stat each (a missing file is left out). A
    clip whose duration the manifest gives is not looked up, nor listed here: its file is
    taken as named (``Entry.audio``), its size :data:`UNMEASURED`, and a file missing on this
    host is found when a producer reads it.

    ``AudioFile.name`` is the path as the manifest wrote it: relative to the dataset
    directory, or absolute; as the file system spells it where only its Unicode normal
    form differs (one listing per directory, and only for paths not found as written).
    """
    found: dict[str, AudioFile] = {}
    listings: dict[Path, dict[str, str]] = {}
    for entry in entries:
        if not entry.audio:
            continue
        if entry.duration is not None:
            continue
        name = entry.audio
        if is_url(name):  # a manifest at a URL's (resolve_audio): one request each
            found_at = remote_stat(name)
            if found_at is not None:
                found[entry.id] = AudioFile(name, *found_at)
            continue
        try:
            st = os.stat(root / name)
        except OSError:
            name = _other_form(root, entry.audio, listings) or ""  # the path in another Unicode normal form?
            try:
                st = os.stat(root / name) if name else None
            except OSError:
                st = None
        if st is not None and stat_module.S_ISREG(st.st_mode):  # else reported as missing, with the path
            found[entry.id] = AudioFile(name, st.st_size, st.st_mtime_ns)
    return found


def _other_form(root: Path, path: str, listings: dict[Path, dict[str, str]]) -> str | None:
    """``path`` (relative to ``root``, or absolute) as the file system spells it when only the
    Unicode normal form of some of its names differs (compared in NFC, :func:`nfc`); None when
    there is no such file. ``listings``: directories listed so far, by NFC name."""
    if path.isascii():
        return None
    start = Path(path)
    where = start.anchor and Path(start.anchor) or root
    found: list[str] = [start.anchor] if start.anchor else []
    for part in start.parts[1:] if start.anchor else start.parts:
        if (where / part).exists():
            spelled = part
        else:
            listing = listings.get(where)
            if listing is None:
                try:
                    listing = {nfc(name): name for name in os.listdir(where)}
                except OSError:
                    listing = {}
                listings[where] = listing
            spelled = listing.get(nfc(part))
            if spelled is None:
                return None
        where = where / spelled
        found.append(spelled)
    return str(Path(*found)) if found else None


def list_audio(root: Path, metadata_file: str, metadata: bytes, columns: str = COLUMNS_AUTO) -> dict[str, AudioFile]:
    """The audio of a dataset by id: the files a manifest names, or the listing of ``wavs/`` (at a
    URL: :func:`scan_remote_audio`); for a mix, each dataset's, by prefixed id, with paths from ``root``; for tar shards, each
    clip's audio member, named by its locator (shared/dataset/shards.py); for Parquet files, each row's
    locator, or the file its path column names (shared/dataset/parquet.py)."""
    if is_parquet(metadata_file):  # each row's locator (shared/dataset/parquet.py), or the file a path column names
        listed = read_shards(root, metadata_file).audio
        entries, _ = parse_entries(metadata, metadata_file, columns)
        return {**locate_audio(root, [e for e in entries if e.audio not in listed]),
                **{e.id: listed[e.audio] for e in entries if e.audio in listed}}
    if is_shards(metadata_file):
        return read_shards(root, metadata_file).audio
    if is_manifest(metadata_file):
        entries, _ = parse_entries(metadata, metadata_file, columns)
        return locate_audio(root, resolve_audio(entries, metadata_file))
    if not is_mix(metadata_file):
        return scan_remote_audio(metadata_file) if is_url(metadata_file) else scan_audio(root)
    found: dict[str, AudioFile] = {}
    for part, directory, raw in unpack_mix(metadata):
        prefix = f"{part.name}{MIX_ID_SEPARATOR}"
        if is_url(directory):  # a mix at a URL's dataset: its files named by their URLs
            found.update({prefix + i: a for i, a in
                          list_audio(root, f"{directory}/{part.metadata_file}", raw, part.columns).items()})
            continue
        if is_manifest(part.metadata_file):
            entries, _ = parse_entries(raw, part.metadata_file, part.columns)
            listed = {prefix + i: AudioFile(a.name if a.name.startswith("/") or is_url(a.name) else
                                            f"{directory}/{a.name}", a.size, a.mtime_ns)
                      for i, a in locate_audio(root / directory, entries).items()}
        else:
            listed = {prefix + i: AudioFile(f"{directory}/{a.name}", a.size, a.mtime_ns)
                      for i, a in scan_audio(root / directory).items()}
        found.update(listed)
    return found


def read_metadata_bytes(root: Path, metadata_file: str = "metadata.csv") -> bytes:
    """The bytes of ``root/metadata_file``; for a mix, the blob of every dataset's metadata; for
    tar shards, the manifest made from them; for a lhotse cut manifest, its lines (gunzipped)."""
    if is_cuts(metadata_file):
        raw = _read_metadata(root, metadata_file)
        try:
            return decompressed(raw)
        except ValueError as exc:
            raise DatasetError(f"{metadata_location(root, metadata_file)}: {exc}") from None
    return _read_metadata(root, metadata_file)


def _read_metadata(root: Path, metadata_file: str) -> bytes:
    if is_shards(metadata_file):
        return read_shards(root, metadata_file).manifest
    if is_mix(metadata_file):
        return _read_remote_mix(metadata_file) if is_url(metadata_file) else _read_mix(root, metadata_file)
    if is_url(metadata_file):
        try:
            return read_url(metadata_file)
        except FileNotFoundError:
            raise DatasetError(f"{shown(metadata_file)} not found") from None
        except StorageError as exc:
            raise DatasetError(str(exc)) from None
    meta = root / metadata_file
    try:
        return meta.read_bytes()
    except OSError as exc:
        raise metadata_error(meta, exc) from None


def metadata_error(meta: Path, exc: OSError) -> DatasetError:
    """The one line for a metadata file that cannot be read."""
    if isinstance(exc, FileNotFoundError):
        return DatasetError(f"{meta} not found (expected LJSpeech layout: metadata.csv and wavs/)")
    if isinstance(exc, IsADirectoryError):
        return DatasetError(f"{meta} is a directory, not a metadata file")
    return DatasetError(f"cannot read {meta}: {exc.strerror}")


def _read_mix(root: Path, mix_file: str) -> bytes:
    try:
        parts = parse_mix_spec(_read(root / mix_file).decode("utf-8", "replace"), "metadata.csv", COLUMNS_AUTO)
    except LayoutError as exc:
        raise DatasetError(f"{root / mix_file}: {exc}") from None
    packed = []
    for part in parts:
        directory = Path(part.path).expanduser()
        where = directory if directory.is_absolute() else root / directory
        if not where.is_dir():
            raise DatasetError(f"{root / mix_file}: dataset {part.name}: {where} is not a directory")
        label = str(directory) if directory.is_absolute() else directory.as_posix().rstrip("/")
        packed.append((part, label, read_metadata_bytes(where, part.metadata_file)))
    return pack_mix(packed)


def _read_remote_mix(mix_url: str) -> bytes:
    """:func:`_read_mix` of a mix file at a URL: each dataset a URL, or a path relative to the
    mix file's URL (``../lj`` of ``s3://b/mixes/all.yaml``: ``s3://b/lj``), read as a dataset
    at a URL (:func:`locate`); a path of this host is refused."""
    try:
        text = read_url(mix_url)
    except FileNotFoundError:
        raise DatasetError(f"{shown(mix_url)} not found") from None
    except StorageError as exc:
        raise DatasetError(str(exc)) from None
    try:
        parts = parse_mix_spec(text.decode("utf-8", "replace"), "metadata.csv", COLUMNS_AUTO)
    except LayoutError as exc:
        raise DatasetError(f"{shown(mix_url)}: {exc}") from None
    scheme, _, where = mix_url.partition("://")
    packed = []
    for part in parts:
        if part.path.startswith(("/", "~")):
            raise DatasetError(f"{shown(mix_url)}: dataset {part.name}: {part.path} is a path of this host; the "
                               f"datasets of a mix at a URL are URLs or paths relative to it")
        directory = (part.path.rstrip("/") if is_url(part.path) else
                     f"{scheme}://{posixpath.normpath(posixpath.join(posixpath.dirname(where), part.path))}")
        try:
            packed.append((part, directory, read_metadata_bytes(Path(), f"{directory}/{part.metadata_file}")))
        except DatasetError as exc:
            raise DatasetError(f"{shown(mix_url)}: dataset {part.name}: {exc}") from None
    return pack_mix(packed)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror}") from None


def read_metadata(root: Path, metadata_file: str = "metadata.csv",
                  columns: str = COLUMNS_AUTO) -> tuple[list[Entry], list[Rejection]]:
    """Parse ``root/metadata_file``; malformed lines become rejections, never exceptions."""
    return parse_entries(read_metadata_bytes(root, metadata_file), metadata_file, columns)
