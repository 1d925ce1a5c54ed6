"""Where a dataset's files are: its directory, a metadata file's bytes here or at a URL, the
audio file of each id (any format libsndfile reads; :data:`AUDIO_SUFFIXES` in order of
preference) in ``wavs/`` or as a manifest names it; which files a format reads: corpus/. Names
are matched to ids in Unicode normal form C (shared/dataset/layouts.nfc): a file whose name is
decomposed on disk is its composed id's.
"""

from __future__ import annotations

import os
import stat as stat_module
from pathlib import Path
from typing import Iterable

from ..dataset.storage import StorageError, file_sha256, is_url, read_url, remote_stat, shown
from ..dataset.types import AUDIO_SUFFIXES, AudioFile, DatasetError
from .layouts import Entry, nfc

DEMO_DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "demo"


AUDIO_DIR = "wavs"


AUDIO_SUFFIX = ".wav"  # the LJSpeech suffix, named in "missing" reasons


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
        if is_url(name):  # a manifest at a URL's (corpus/manifest.py): one request each
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


def metadata_error(meta: Path, exc: OSError) -> DatasetError:
    """The one line for a metadata file that cannot be read."""
    if isinstance(exc, FileNotFoundError):
        return DatasetError(f"{meta} not found (expected LJSpeech layout: metadata.csv and wavs/)")
    if isinstance(exc, IsADirectoryError):
        return DatasetError(f"{meta} is a directory, not a metadata file")
    return DatasetError(f"cannot read {meta}: {exc.strerror}")


def read_file(root: Path, metadata_file: str) -> bytes:
    """The bytes of a metadata file below ``root`` or at a URL; DatasetError (one line) when it cannot be read."""
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


def hashed_file(root: Path, metadata_file: str) -> str:
    """The SHA-256 of a metadata file here or at a URL, hashed a piece at a time (never parsed nor
    held whole); DatasetError (one line) when it cannot be read."""
    where = metadata_location(root, metadata_file)
    try:
        return file_sha256(where)
    except OSError as exc:  # StorageError too: a read at a URL that failed after its retries
        if is_url(where):
            raise DatasetError(f"{shown(where)} not found" if isinstance(exc, FileNotFoundError)
                               else f"cannot read {shown(where)}: {shown(str(exc))}") from None
        raise metadata_error(Path(where), exc) from None
