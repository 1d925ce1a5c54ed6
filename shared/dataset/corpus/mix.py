"""Mixes of datasets: ``--data mix.yaml`` names several, each with its own layout and language.

Reads the mix file, each part through its own format (the registry's, handed in), names its
clips ``NAME:ID`` and packs the mix and its parts' metadata into one blob (:func:`pack_mix`)
that the index, the scan and the dataset agreement see as one metadata file. The file's
format: docs/DESIGN.md, Layouts.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import msgpack
import yaml

from ...layouts import COLUMNS_AUTO, Entry, LayoutError, Rejection, language_problem, parse_columns
from ..files import read_file
from ..storage import is_url, shown
from ..types import AudioFile, DatasetError
from .base import Format

MIX_SUFFIXES = (".yaml", ".yml")
MIX_ID_SEPARATOR = ":"
_MIX_KEYS = {"path", "name", "language", "metadata_file", "columns"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


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


def pack_mix(parts: list[tuple[MixPart, str, bytes]]) -> bytes:
    """One blob of a mix: each part, its directory relative to the mix file's (or absolute), its metadata bytes."""
    return msgpack.packb([{"name": p.name, "dir": d, "language": p.language, "metadata_file": p.metadata_file,
                           "columns": p.columns, "metadata": raw} for p, d, raw in parts], use_bin_type=True)


def unpack_mix(blob: bytes) -> list[tuple[MixPart, str, bytes]]:
    return [(MixPart(d["name"], d["dir"], d["language"], d["metadata_file"], d["columns"]), d["dir"], d["metadata"])
            for d in msgpack.unpackb(blob, raw=False)]


class Mix(Format):
    """A mix file (``*.yaml``): its parts read, parsed and listed each by its own format
    (``format_of``: the registry's choice for a part's metadata file)."""

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
        return self._remote(metadata_file) if is_url(metadata_file) else self._local(root, metadata_file)

    def _local(self, root: Path, mix_file: str) -> bytes:
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
            packed.append((part, label, self.format_of(part.metadata_file).read(where, part.metadata_file)))
        return pack_mix(packed)

    def _remote(self, mix_url: str) -> bytes:
        """:meth:`_local` of a mix file at a URL: each dataset a URL, or a path relative to the
        mix file's URL (``../lj`` of ``s3://b/mixes/all.yaml``: ``s3://b/lj``), read as a dataset
        at a URL; a path of this host is refused."""
        text = read_file(Path(), mix_url)
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
            metadata_file = f"{directory}/{part.metadata_file}"
            try:
                packed.append((part, directory, self.format_of(metadata_file).read(Path(), metadata_file)))
            except DatasetError as exc:
                raise DatasetError(f"{shown(mix_url)}: dataset {part.name}: {exc}") from None
        return pack_mix(packed)

    def parse(self, raw: bytes, columns: str) -> tuple[list[Entry], list[Rejection]]:
        """The entries of every dataset of a mix, ids prefixed with the dataset's name."""
        entries: list[Entry] = []
        rejected: list[Rejection] = []
        for part, directory, part_raw in unpack_mix(raw):
            prefix = f"{part.name}{MIX_ID_SEPARATOR}"
            found, bad = self.format_of(part.metadata_file).parse(part_raw, part.columns)
            for e in found:
                # a manifest's relative path from the mix file's directory (a URL or an absolute path as
                # written); for LJSpeech, where the clip is expected
                audio = (e.audio if e.audio.startswith("/") or is_url(e.audio) else f"{directory}/{e.audio}"
                         if e.audio else f"{directory}/wavs/{e.id}.wav")
                entries.append(Entry(prefix + e.id, e.text, e.line, e.speaker or part.name,
                                     e.language or part.language, audio, e.short, e.duration))
            rejected += [Rejection(prefix + r.id, f"{part.name}: {r.reason}", r.producer, r.line, r.file, r.kind)
                         for r in bad]
        return entries, rejected

    def audio(self, root: Path, metadata_file: str, raw: bytes, columns: str) -> dict[str, AudioFile]:
        """Each dataset's, by prefixed id, named from ``root`` (a dataset at a URL's by their URLs)."""
        found: dict[str, AudioFile] = {}
        for part, directory, part_raw in unpack_mix(raw):
            prefix = f"{part.name}{MIX_ID_SEPARATOR}"
            if is_url(directory):
                part_file = f"{directory}/{part.metadata_file}"
                found.update({prefix + i: a for i, a in
                              self.format_of(part_file).audio(root, part_file, part_raw, part.columns).items()})
                continue
            listed = self.format_of(part.metadata_file).audio(root / directory, part.metadata_file, part_raw,
                                                              part.columns)
            found.update({prefix + i: AudioFile(a.name if a.name.startswith("/") or is_url(a.name) else
                                                f"{directory}/{a.name}", a.size, a.mtime_ns)
                          for i, a in listed.items()})
        return found


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror}") from None
