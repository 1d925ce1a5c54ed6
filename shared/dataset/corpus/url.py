"""Datasets at a URL (``s3://bucket/corpus/...``): where ``--data`` names one (a manifest, a mix
file or an LJSpeech layout; tar shards and Parquet files at a URL are tar.py's), and an LJSpeech
layout there, its audio the files of ``wavs/`` beside its metadata (one listing of the store).
Its root is a directory of this host's cache that holds its index and feature caches."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..layouts import Entry, nfc
from ..cache import remote_root
from ..files import AUDIO_DIR, AUDIO_SUFFIX
from ..storage import is_url, list_remote, remote_stat
from ..types import AUDIO_SUFFIXES, AudioFile
from .base import Format
from .ljspeech import LJSpeech

LJSPEECH_SUFFIX = ".csv"  # LJSpeech metadata's: a URL ending so names the metadata file, not a directory


class Url(LJSpeech):
    """An LJSpeech layout at a URL (its metadata file's URL); and the finder of every dataset a
    URL names but shards (``format_of``: the registry's choice for a name)."""

    name = "url"
    loose = False

    def __init__(self, format_of: Callable[[str], Format]) -> None:
        self.format_of = format_of

    def claims(self, metadata_file: str) -> bool:
        return is_url(metadata_file)

    def locate(self, path: str, metadata_file: str) -> tuple[Path, str] | None:
        """A manifest at a URL (``s3://b/corpus/train.jsonl``, or a directory URL with
        ``data.metadata_file`` a manifest's name) is its own metadata file; so is a mix file at a
        URL, and an LJSpeech layout's metadata file (:meth:`_metadata`); None: not a URL, or shards."""
        if not path or not is_url(path):
            return None
        name = path.rstrip("/").rpartition("/")[2]
        named = self.format_of(name)
        if not named.manifest and not named.sharded and self.format_of(metadata_file).manifest:
            path, name = f"{path.rstrip('/')}/{metadata_file}", metadata_file
            named = self.format_of(name)
        if named.manifest or named.name == "mix":
            return remote_root(path), path
        metadata = None if named.sharded else self._metadata(path, name, metadata_file)
        return (remote_root(metadata), metadata) if metadata is not None else None

    @staticmethod
    def _metadata(path: str, name: str, metadata_file: str) -> str | None:
        """The URL of the LJSpeech metadata file that ``path`` (whose last name is ``name``) names:
        itself when it ends in ``.csv`` or is named as ``data.metadata_file``, else
        ``path/metadata_file`` when the store holds it (one request); None: not an LJSpeech layout
        (a directory of tar shards)."""
        if name.lower().endswith(LJSPEECH_SUFFIX) or name == metadata_file.rpartition("/")[2]:
            return path
        candidate = f"{path.rstrip('/')}/{metadata_file}"
        return candidate if remote_stat(candidate) is not None else None

    def named(self, root: Path, metadata_file: str, configured: str) -> str:
        """The metadata file's URL; its directory's where it is named as data.metadata_file (found there again)."""
        directory, _, name = metadata_file.rpartition("/")
        return f"{directory}/" if name == configured else metadata_file

    def resolve(self, entries: list[Entry], metadata_file: str) -> list[Entry]:
        """Each clip's audio the URL ``wavs/<id>.wav`` beside the metadata, which a clip without
        audio is reported missing as (its file is found by :meth:`audio`). Changed in place."""
        audio_dir = f"{metadata_file.rpartition('/')[0]}/{AUDIO_DIR}/"
        for entry in entries:
            entry.__dict__["audio"] = f"{audio_dir}{entry.id}{AUDIO_SUFFIX}"
        return entries

    def audio(self, root: Path, metadata_file: str, raw: bytes, columns: str) -> dict[str, AudioFile]:
        """The files of ``wavs/`` beside the metadata file, by id, each named by its URL, from one
        listing of the store (sizes and stamps come with it), the first of AUDIO_SUFFIXES winning;
        no such directory: an empty map (each clip rejected as missing)."""
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

    def stamp(self, root: Path, metadata_file: str) -> str:
        return ""  # found by the listing and the metadata, as they are
