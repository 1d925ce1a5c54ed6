"""Large lhotse cut manifests indexed in pieces: the gzip stream read once, as it is decompressed
cut into blocks of whole lines spilled to files (its SHA-256 taken on the way), each block's cuts
parsed in a helper process into a manifest piece's columns (pieces.py) and removed, then merged
(chunked.py), so that millions of cuts are never a Python object each in one process, and the
blocks' disk goes as the run files' grows."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import zlib
from pathlib import Path
from typing import Any

from ...shared.config import DataConfig, FeaturesConfig, TextConfig
from ...shared.dataset.corpus.cuts import GZIP_MAGIC, parse_cuts
from .pieces import Pieces, Renamed, columns_piece
from .spill import remove_spill, spill_dir
from ...shared.dataset.storage import is_url
from ...shared.dataset.layouts import ManifestColumns

# A cut manifest whose file (gzip) is at least this large is indexed in pieces; a smaller one in
# one pass (about a large JSON-lines manifest's threshold, lhotse's gzip being some 4 to 8 times smaller).
CUTS_CHUNKED_MIN_BYTES = 8 << 20

# A block of a cut manifest's lines given to one worker: a large manifest's piece (chunked.py).
BLOCK_BYTES = 8 << 20

# How much of the decompressed stream is read at a time.
_READ_BYTES = 1 << 20

# What a cut manifest's own rejection of a repeated id says (parse_cuts'), for one in a later block.
REPEATED_CUT = "duplicate cut id on cut manifest line"


def cuts_pieces(root: Path, metadata_file: str, data: DataConfig, features: FeaturesConfig, text: TextConfig,
                candidates: list[Path]) -> Pieces | None:
    """The pieces of a large local cut manifest (blocks of its lines spilled beside the index
    cache: :func:`cuts_chunk` and its tasks) and the SHA-256 of its lines; None where the
    one-process build is the way: a small manifest, one at a URL, or a gzip stream that cannot be
    read (the one-process build words why)."""
    path = root / metadata_file
    if is_url(metadata_file):
        return None
    try:
        if path.stat().st_size < CUTS_CHUNKED_MIN_BYTES:
            return None
    except OSError:
        return None
    spill = spill_dir(candidates)
    found = cuts_tasks(path, spill, data, features, text)
    if found is None:
        remove_spill(spill)
        return None
    return Pieces((cuts_chunk, found[0]), repeated=REPEATED_CUT, sha256=found[1], spill=spill)


def cuts_tasks(path: Path, spill: Path, data: DataConfig, features: FeaturesConfig, text: TextConfig,
               renamed: Renamed | None = None) -> tuple[list[tuple], str] | None:
    """:func:`cuts_chunk`'s tasks of a cut manifest's blocks spilled to ``spill`` (a mix's part's
    entries ``renamed``), each with where its lines are in the manifest's stream, and the SHA-256
    of its lines; None where its gzip stream cannot be read."""
    try:
        blocks, sha256 = _spilled_blocks(path, spill, BLOCK_BYTES)
        sizes = [block.stat().st_size for block, _ in blocks]
    except (OSError, EOFError, zlib.error):
        return None
    starts = [0, *itertools.accumulate(sizes)][:-1]  # each block's first byte in the stream
    return [(str(block), first, data, features, text, renamed, (str(path), start, size))
            for (block, first), start, size in zip(blocks, starts, sizes)], sha256


def _spilled_blocks(path: Path, spill: Path, chunk_bytes: int) -> tuple[list[tuple[Path, int]], str]:
    """The manifest's lines (gunzipped where it is gzip) written to block files in ``spill`` of
    about ``chunk_bytes`` each, ending at a line end (``\\n``) but the last: (each block's file,
    the number of its first line), and the SHA-256 of all the lines. Lines counted as
    :meth:`bytes.splitlines` (parse_cuts) counts them."""
    with open(path, "rb") as f:
        gzipped = f.read(2) == GZIP_MAGIC
    digest = hashlib.sha256()
    blocks: list[tuple[Path, int]] = []
    line = 1

    def spilled(block: bytes) -> None:
        nonlocal line
        where = spill / f"block-{len(blocks)}"
        where.write_bytes(block)
        blocks.append((where, line))
        line += len(block.splitlines())

    with (gzip.open(path, "rb") if gzipped else open(path, "rb")) as stream:
        held = bytearray()
        while True:
            read = stream.read(_READ_BYTES)
            digest.update(read)
            held += read
            while held and (len(held) > chunk_bytes or not read):
                end = held.rfind(b"\n", 0, chunk_bytes) + 1 if len(held) > chunk_bytes else len(held)
                if not end:  # a line longer than a block: the block ends with it
                    end = held.find(b"\n", chunk_bytes) + 1
                    if not end and read:
                        break  # its end is still to come
                    end = end or len(held)
                spilled(bytes(held[:end]))
                del held[:end]
            if not read:
                return blocks, digest.hexdigest()


def _stream_bytes(path: Path, start: int, size: int) -> bytes:
    """Bytes ``start:start + size`` of a cut manifest's lines (gunzipped where it is gzip), read as a stream."""
    with open(path, "rb") as f:
        gzipped = f.read(2) == GZIP_MAGIC
    with (gzip.open(path, "rb") if gzipped else open(path, "rb")) as stream:
        skipped = 0
        while skipped < start:
            read = stream.read(min(_READ_BYTES, start - skipped))
            if not read:
                break
            skipped += len(read)
        return stream.read(size)


def cuts_chunk(block: str, first_line: int, data: DataConfig, features: FeaturesConfig,
               text: TextConfig, renamed: Renamed | None = None,
               source: tuple[str, int, int] | None = None) -> dict[str, Any] | None:
    """The cuts of a block file (its first line the manifest's ``first_line``) indexed as a
    manifest's piece (runs in helper processes, and in this one). The block is removed once
    parsed, so that the blocks' disk goes as the runs' grows; a block already removed (its piece
    worked again: a retried cache write, a helper lost) is read again from ``source`` (the
    manifest, and where its lines are in the decompressed stream)."""
    where = Path(block)
    try:
        raw = where.read_bytes()
    except FileNotFoundError:
        if source is None:
            raise
        raw = _stream_bytes(Path(source[0]), source[1], source[2])
    entries, rejected = parse_cuts(raw, start_line=first_line)
    del raw
    where.unlink(missing_ok=True)
    columns = ManifestColumns([e.id for e in entries], [e.text for e in entries], [e.line for e in entries],
                              [e.speaker for e in entries], [e.language for e in entries],
                              [e.audio for e in entries], [e.duration for e in entries])
    return columns_piece(columns, rejected, data, features, text, renamed)
