"""Mixes of datasets: ``--data mix.yaml`` names several, each with its own layout and language.

Reads the mix file, then each part in turn through its own format (the registry's, handed in):
its metadata read, listed or parsed, and let go before the next is read; names its clips
``NAME:ID``. The mix's SHA-256 is of its parts' own SHA-256s, its stamp of their stamps, so that
neither reads every part's bytes; a large mix is built in pieces (consumer/index/mix_pieces.py).
The file's format: docs/design/data.md, "Layouts".
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import msgpack
import yaml

from ..layouts import COLUMNS_AUTO, Entry, LayoutError, Rejection, language_problem, parse_columns
from ..files import read_file
from ..storage import is_url, shown
from ..types import AudioFile, DatasetError
from .base import Format, Listing

MIX_SUFFIXES = (".yaml", ".yml")
MIX_ID_SEPARATOR = ":"
_MIX_KEYS = {"path", "name", "language", "metadata_file", "columns"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
T = TypeVar("T")  # what a part gives: its bytes or its SHA-256


@dataclass(frozen=True)
class MixPart:
    """One dataset of a mix."""

    name: str
    path: str  # as the mix file wrote it
    language: str
    metadata_file: str
    columns: str


def parse_mix_spec(text: str, metadata_file: str, columns: str) -> list[MixPart]:
    """The datasets a mix file lists; LayoutError (one line) when it is not a usable mix."""
    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise LayoutError(f"mix file is not valid YAML: {str(exc).splitlines()[0]}") from None
    items = spec.get("datasets") if isinstance(spec, dict) else None
    if not isinstance(items, list) or not items or set(spec) != {"datasets"}:
        raise LayoutError("a mix file must hold one key, datasets: a list of {path, language, name, metadata_file, "
                          "columns}")
    parts: list[MixPart] = []
    for n, item in enumerate(items, start=1):
        where = f"mix dataset {n}"
        if not isinstance(item, dict) or not isinstance(item.get("path"), str) or not item["path"].strip():
            raise LayoutError(f"{where} must be a mapping with a path")
        unknown = sorted(set(item) - _MIX_KEYS)
        if unknown:
            raise LayoutError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_MIX_KEYS))})")
        values = {k: item.get(k) for k in _MIX_KEYS}
        for key in ("name", "language", "metadata_file", "columns"):
            if values[key] is not None and not isinstance(values[key], str):
                raise LayoutError(f"{where}: {key} must be a string, got {values[key]!r}")
        path = item["path"].strip()
        name = values["name"] or path.rstrip("/").rsplit("/", 1)[-1]
        if not _NAME.fullmatch(name):
            raise LayoutError(f"{where}: name {name!r} must be letters, digits, '.', '_' or '-' (it prefixes ids)")
        language = (values["language"] or "").strip()
        problem = language_problem(language)
        if problem:
            raise LayoutError(f"{where}: {problem}")
        part_columns = values["columns"] if values["columns"] is not None else columns
        if part_columns:
            parse_columns(part_columns)
        parts.append(MixPart(name, path, language, values["metadata_file"] or metadata_file, part_columns))
    names = [p.name for p in parts]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise LayoutError(f"mix names dataset {twice[0]!r} twice: give each a distinct name")
    return parts


@dataclass(frozen=True)
class _Part:
    """A mix's dataset as read: its part, its directory as the index names its files (relative to
    the mix file's, absolute, or a URL), where its metadata is read from, and its metadata file."""

    part: MixPart
    directory: str
    where: Path
    metadata_file: str

    def packed(self, identity: str) -> dict[str, Any]:
        """The part as the mix's SHA-256 and stamp take it: its place in the mix and ``identity``
        (its metadata's SHA-256, or its stamp)."""
        p = self.part
        return {"name": p.name, "dir": self.directory, "language": p.language, "metadata_file": p.metadata_file,
                "columns": p.columns, "identity": identity}


def mix_digest(parts: list[_Part], identities: list[str]) -> Any:
    """The SHA-256 of a mix's parts each :meth:`_Part.packed` with its identity (a msgpack array)."""
    return hashlib.sha256(msgpack.packb([part.packed(i) for part, i in zip(parts, identities)], use_bin_type=True))


class Mix(Format):
    """A mix file (``*.yaml``): its parts read, parsed and listed each by its own format
    (``format_of``: the registry's choice for a part's metadata file), one part at a time: only
    one part's metadata is held, and the mix's SHA-256 is taken as the parts stream by."""

    name = "mix"

    def __init__(self, format_of: Callable[[str], Format]) -> None:
        self.format_of = format_of

    def claims(self, metadata_file: str) -> bool:
        return metadata_file.lower().endswith(MIX_SUFFIXES)

    def locate(self, path: str, metadata_file: str) -> tuple[Path, str] | None:
        """A mix file of this host: its directory is the root its datasets are found from."""
        given = Path(path).expanduser() if path and not is_url(path) else None
        if given is None or not self.claims(given.name):
            return None
        if not given.is_file():
            raise DatasetError(f"mix file {given} does not exist")
        return given.resolve().parent, given.name

    def named(self, root: Path, metadata_file: str, configured: str) -> str:
        return metadata_file if is_url(metadata_file) else str(root / metadata_file)

    def read(self, root: Path, metadata_file: str) -> bytes:
        """The mix file's own bytes (its parts' are read by :meth:`listing` and :meth:`clips`)."""
        return read_file(root, metadata_file) if is_url(metadata_file) else _read(root / metadata_file)

    def listing(self, root: Path, metadata_file: str, columns: str, raw: bytes | None = None) -> Listing:
        """Every part's audio by prefixed id, named from ``root`` (a dataset at a URL's by their
        URLs), and the mix's SHA-256 (:meth:`sha256`), each part read in turn."""
        audio: dict[str, AudioFile] = {}
        for part in self.parts(root, metadata_file):
            self._listed(root, metadata_file, part, audio)
        return Listing(bytes.fromhex(self.sha256(root, metadata_file)), audio, None)

    def sha256(self, root: Path, metadata_file: str) -> str:
        """Of the parts' places in the mix and each part's own SHA-256 (its format's: a manifest's
        bytes, tar or Parquet shards' names and sizes), not of every part's bytes packed together:
        what the index is keyed by and producers agree on, read a part at a time, never held."""
        parts = self.parts(root, metadata_file)
        return mix_digest(parts, [self._part_sha256(metadata_file, part) for part in parts]).hexdigest()

    def stamp(self, root: Path, metadata_file: str) -> str:
        """Of the parts' places and stamps, so that a warm start finds the cache without reading
        any part; "" where a part has none, or is an LJSpeech layout (its audio listed for the mix)."""
        parts = self.parts(root, metadata_file)
        formats = [self.format_of(part.metadata_file) for part in parts]
        if any(fmt.loose for fmt in formats):
            return ""
        stamps = [fmt.stamp(part.where, part.metadata_file) for part, fmt in zip(parts, formats)]
        return "" if "" in stamps else mix_digest(parts, stamps).hexdigest()

    def clips(self, root: Path, metadata_file: str, columns: str,
              raw: bytes | None = None) -> tuple[list[Entry], list[Rejection]]:
        """The entries of every dataset of the mix, ids prefixed with its name, each part read in turn."""
        entries: list[Entry] = []
        rejected: list[Rejection] = []
        for part in self.parts(root, metadata_file):
            p, directory = part.part, part.directory
            fmt = self.format_of(p.metadata_file)
            found, bad = fmt.parse(self._read_part(metadata_file, part, fmt), p.columns)
            prefix = f"{p.name}{MIX_ID_SEPARATOR}"
            for e in found:
                # a manifest's relative path from the mix file's directory (a URL or an absolute path as
                # written); for LJSpeech, where the clip is expected
                audio = (e.audio if e.audio.startswith("/") or is_url(e.audio) else f"{directory}/{e.audio}"
                         if e.audio else f"{directory}/wavs/{e.id}.wav")
                entries.append(Entry(prefix + e.id, e.text, e.line, e.speaker or p.name, e.language or p.language,
                                     audio, e.short, e.duration))
            rejected += [Rejection(prefix + r.id, f"{p.name}: {r.reason}", r.producer, r.line, r.file, r.kind)
                         for r in bad]
        return entries, rejected

    def _listed(self, root: Path, metadata_file: str, part: _Part, audio: dict[str, AudioFile]) -> None:
        """A part's audio added to ``audio`` by prefixed id (its metadata read, then let go)."""
        p = part.part
        part_format = self.format_of(part.metadata_file)
        part_raw = self._read_part(metadata_file, part, part_format)
        prefix = f"{p.name}{MIX_ID_SEPARATOR}"
        if is_url(part.directory):  # a mix at a URL's dataset: its files named by their URLs
            listed = part_format.audio(root, part.metadata_file, part_raw, p.columns)
            audio.update({prefix + i: a for i, a in listed.items()})
            return
        listed = part_format.audio(part.where, part.metadata_file, part_raw, p.columns)
        audio.update({prefix + i: AudioFile(a.name if a.name.startswith("/") or is_url(a.name) else
                                            f"{part.directory}/{a.name}", a.size, a.mtime_ns)
                      for i, a in listed.items()})

    def _part_sha256(self, mix_file: str, part: _Part) -> str:
        return _of_part(mix_file, part, self.format_of(part.metadata_file).sha256)

    def _read_part(self, mix_file: str, part: _Part, fmt: Format) -> bytes:
        return _of_part(mix_file, part, fmt.read)

    def parts(self, root: Path, mix_file: str) -> list[_Part]:
        """The mix's datasets, found: of a mix file here, each a directory (absolute, or relative to
        the mix file's); of one at a URL, each a URL, or a path relative to the mix file's URL
        (``../lj`` of ``s3://b/mixes/all.yaml``: ``s3://b/lj``), a path of this host refused."""
        shown_as = shown(mix_file) if is_url(mix_file) else str(root / mix_file)
        try:
            parts = parse_mix_spec(self.read(root, mix_file).decode("utf-8", "replace"), "metadata.csv",
                                   COLUMNS_AUTO)
        except LayoutError as exc:
            raise DatasetError(f"{shown_as}: {exc}") from None
        if not is_url(mix_file):
            return [self._local_part(root, mix_file, part) for part in parts]
        scheme, _, where = mix_file.partition("://")
        found = []
        for part in parts:
            if part.path.startswith(("/", "~")):
                raise DatasetError(f"{shown_as}: dataset {part.name}: {part.path} is a path of this host; the "
                                   f"datasets of a mix at a URL are URLs or paths relative to it")
            directory = (part.path.rstrip("/") if is_url(part.path) else
                         f"{scheme}://{posixpath.normpath(posixpath.join(posixpath.dirname(where), part.path))}")
            found.append(_Part(part, directory, Path(), f"{directory}/{part.metadata_file}"))
        return found

    @staticmethod
    def _local_part(root: Path, mix_file: str, part: MixPart) -> _Part:
        directory = Path(part.path).expanduser()
        where = directory if directory.is_absolute() else root / directory
        if not where.is_dir():
            raise DatasetError(f"{root / mix_file}: dataset {part.name}: {where} is not a directory")
        label = str(directory) if directory.is_absolute() else directory.as_posix().rstrip("/")
        return _Part(part, label, where, part.metadata_file)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror}") from None


def _of_part(mix_file: str, part: _Part, read: Callable[[Any, str], T]) -> T:
    """``read(where, metadata_file)`` of a part; a part at a URL's error names the mix and the part."""
    try:
        return read(part.where, part.metadata_file)
    except DatasetError as exc:
        if not is_url(part.directory):
            raise
        raise DatasetError(f"{shown(mix_file)}: dataset {part.part.name}: {exc}") from None
