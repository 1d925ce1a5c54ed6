"""Mixes of datasets: ``--data mix.yaml`` names several, each with its own layout and language.

Reads the mix file (shared/layouts.py parses each part), names its clips ``NAME:ID`` and packs
the mix and its parts' metadata into one blob (:func:`pack_mix`) that the index, the scan and
the dataset agreement see as one metadata file. The file's format: docs/DESIGN.md, Layouts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgpack
import yaml

from .cuts import parse_cuts
from .layouts import (COLUMNS_AUTO, Entry, LayoutError, Rejection, is_cuts, is_manifest, is_parquet, is_shards, is_url,
                      language_problem, parse_columns, parse_manifest, parse_metadata)
from .parquet_layout import parquet_entries

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


def is_mix(file_name: str) -> bool:
    return file_name.lower().endswith(MIX_SUFFIXES)


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


def parse_mix(blob: bytes) -> tuple[list[Entry], list[Rejection]]:
    """The entries of every dataset of a mix, ids prefixed with the dataset's name."""
    entries: list[Entry] = []
    rejected: list[Rejection] = []
    for part, directory, raw in unpack_mix(blob):
        prefix = f"{part.name}{MIX_ID_SEPARATOR}"
        found, bad = parse_entries(raw, part.metadata_file, part.columns)
        for e in found:
            # a manifest's relative path from the mix file's directory (a URL or an absolute path as
            # written); for LJSpeech, where the clip is expected
            audio = (e.audio if e.audio.startswith("/") or is_url(e.audio) else f"{directory}/{e.audio}" if e.audio
                     else f"{directory}/wavs/{e.id}.wav")
            entries.append(Entry(prefix + e.id, e.text, e.line, e.speaker or part.name, e.language or part.language,
                                 audio, e.short, e.duration))
        rejected += [Rejection(prefix + r.id, f"{part.name}: {r.reason}", r.producer, r.line, r.file, r.kind)
                     for r in bad]
    return entries, rejected


def parse_entries(raw: bytes, file_name: str, columns: str = COLUMNS_AUTO) -> tuple[list[Entry], list[Rejection]]:
    """The one reader of a dataset's metadata: :func:`parse_manifest` for ``*.jsonl`` / ``*.json`` file names,
    :func:`parse_mix` for a mix (``*.yaml``: the blob of :func:`pack_mix`), :func:`shared.cuts.parse_cuts` for a
    lhotse cut manifest (its lines decompressed), else :func:`parse_metadata`."""
    if is_parquet(file_name):  # Parquet files: their rows' columns as data.columns maps them
        return parquet_entries(raw, columns)
    if is_cuts(file_name):
        return parse_cuts(raw)
    if is_manifest(file_name) or is_shards(file_name):  # shards: the manifest made from them
        return parse_manifest(raw)
    if is_mix(file_name):
        return parse_mix(raw)
    return parse_metadata(raw, columns)
