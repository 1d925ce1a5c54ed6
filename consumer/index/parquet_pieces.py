"""Large Parquet datasets indexed in pieces: each piece's rows (row groups of a file) made a
manifest piece's entries in a helper process, straight from their columns (mapped to a clip's
fields as shared/dataset/parquet_layout.py maps them; JSON lines only for a piece with a faulty row,
whose parse words the fault), indexed as a large manifest's piece is (pieces.py), then merged
(chunked.py), so that ten million rows are never a Python object each in one process. Only where
every row has its audio bytes and a duration: otherwise the listing's one-process build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from ...shared.config import DataConfig, FeaturesConfig, TextConfig
from ...shared.dataset.parquet import audio_column, parquet_file, pyarrow_modules, scalar_columns, stem
from .pieces import Pieces, Renamed, columns_piece, manifest_piece
from ...shared.dataset.shards import list_shards
from ...shared.dataset.storage import StorageError, is_url
from ...shared.dataset.layouts import Rejection
from ...shared.dataset.parquet_layout import ROLES, checked_columns, is_column_map, parse_column_map, role_columns, row_rejection

# A Parquet dataset of at least this many rows is indexed in pieces; a smaller one by the
# listing in one process (its build takes a few seconds, about what helper processes take to start).
PARQUET_CHUNKED_MIN_ROWS = 200_000


# Rows of a piece (whole row groups, at least one): about a large manifest's piece of 8 MB, many
# pieces so that the last ones balance the load and none is a file's millions of rows at once.
PIECE_ROWS = 65_536


def parquet_pieces(root: Path, pattern: str, data: DataConfig, features: FeaturesConfig, text: TextConfig,
                   candidates: list[Path], min_rows: int | None = None) -> Pieces | None:
    """The pieces of a local Parquet dataset (row groups of a file: :func:`parquet_chunk` and its tasks) and
    what a line's rejection becomes (its row's, naming it); nothing is spilled beside ``candidates``. None
    where the one-process build is the way: a small dataset (under ``min_rows``, default
    :data:`PARQUET_CHUNKED_MIN_ROWS`; a mix's part is its pieces at any size), files at a URL, a file whose
    footer cannot be read, or a row group whose statistics do not show every row with audio bytes and a duration."""
    if is_url(pattern):
        return None
    mapping = parse_column_map(data.columns) if is_column_map(data.columns) else {}
    pa, _ = pyarrow_modules()
    files: list[tuple[str, list[int]]] = []  # (name, rows of each row group)
    for shard in list_shards(root, pattern):
        try:
            with parquet_file(root, shard.name) as parquet:
                groups = _complete_groups(parquet, mapping)
        except (OSError, StorageError, pa.ArrowException):
            return None
        if groups is None:
            return None
        files.append((shard.name, groups))
    if sum(sum(groups) for _, groups in files) < (PARQUET_CHUNKED_MIN_ROWS if min_rows is None else min_rows):
        return None
    tasks, first, starts = [], 1, []
    for name, groups in files:
        starts.append((first, name, groups))
        group, row = 0, 0  # the piece's first row group, and its first row in the file
        while group < len(groups):
            end = group + 1
            while end < len(groups) and sum(groups[group:end + 1]) <= PIECE_ROWS:
                end += 1
            tasks.append((str(root), name, (group, end, row), first, data, features, text))
            rows = sum(groups[group:end])
            group, row, first = end, row + rows, first + rows
    return Pieces((parquet_chunk, tasks), lambda rejection, dataset: _named(rejection, starts))


def _complete_groups(parquet: Any, mapping: dict[str, str]) -> list[int] | None:
    """The rows of each row group of a Parquet file whose every row has audio bytes and a
    duration (the row groups' statistics say so: no null); None otherwise."""
    found = audio_column(parquet.schema_arrow)
    columns = scalar_columns(parquet.schema_arrow, found[0]) if found is not None else []
    duration = mapping.get("duration") or next((n for n in ROLES["duration"] if n in columns), None)
    if found is None or not found[1] or duration not in columns:
        return None
    schema = parquet.metadata.schema
    leaves = {schema.column(n).path: n for n in range(len(schema))}
    rows = []
    for group in range(parquet.metadata.num_row_groups):
        meta = parquet.metadata.row_group(group)
        for path in (found[1], duration):
            stats = meta.column(leaves[path]).statistics
            if stats is None or not stats.has_null_count or stats.null_count:
                return None
        rows.append(meta.num_rows)
    return rows


def _named(rejection: Rejection, starts: list[tuple[int, str, list[int]]]) -> Rejection:
    """A manifest line's rejection as its row's (:func:`shared.dataset.parquet_layout.row_rejection`): line
    N is the Nth row of the files in order."""
    line = rejection.line
    if line is None:
        return rejection
    for first, name, groups in reversed(starts):
        if line >= first:
            row = line - first
            for group, count in enumerate(groups):
                if row < count:
                    return row_rejection(rejection, f"{name}#{group}:{row}")
                row -= count
    return rejection


def parquet_chunk(root: str, name: str, groups: tuple[int, int, int], first_line: int, data: DataConfig,
                  features: FeaturesConfig, text: TextConfig, renamed: Renamed | None = None) -> dict[str, Any] | None:
    """The rows of row groups ``groups[0]`` to ``groups[1]`` - 1 of a Parquet file (the first of
    them its row ``groups[2]``) indexed as a manifest's piece of their manifest lines (each the
    listing line's manifest object: shared.dataset.parquet_layout.manifest_object; runs in helper
    processes). The entries are made straight from the columns where every row passes the
    manifest's checks (:func:`shared.dataset.parquet_layout.checked_columns`); else the lines are made
    and parsed, which word each fault."""
    pa, _ = pyarrow_modules()
    mapping = parse_column_map(data.columns) if is_column_map(data.columns) else {}
    try:
        with parquet_file(Path(root), name) as parquet:
            found = audio_column(parquet.schema_arrow)
            others = scalar_columns(parquet.schema_arrow, found[0]) if found is not None else []
            tables = [parquet.read_row_group(group, columns=others) for group in range(groups[0], groups[1])]
    except (OSError, StorageError, pa.ArrowException):
        return None  # a row group that cannot be read: the listing's build words its rows' rejections
    audio = [f"{name}#{group}:{r}" for group, read in enumerate(tables, groups[0]) for r in range(read.num_rows)]
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    roles = role_columns({n: table.column(n).to_pylist() for n in others}, mapping)
    del tables, table
    row_id = f"{stem(name)}_"
    given = roles.get("id")
    row_ids = ([f"{row_id}{row}" for row in range(groups[2], groups[2] + len(audio))]
               if given is None or None in given else [])  # none where every row has its id
    columns = checked_columns(roles, audio, row_ids, first_line)
    if columns is not None:
        return columns_piece(columns, [], data, features, text, renamed)
    return manifest_piece(_lines(roles, audio, row_ids), first_line, data, features, text, renamed)


def _lines(roles: dict[str, list[Any]], audio: list[str], row_ids: list[str]) -> bytes:
    """The rows' manifest lines: each role's value where the row has one, the row's own id
    (``STEM_ROW``) where it has none."""
    dumps = orjson.dumps
    out = []
    for r, locator in enumerate(audio):
        obj: dict[str, Any] = {"audio_filepath": locator}
        for role, column in roles.items():
            value = column[r]
            if value is not None:
                obj[role] = value
        if "id" not in obj:
            obj["id"] = row_ids[r]
        out.append(dumps(obj) + b"\n")
    return b"".join(out)
