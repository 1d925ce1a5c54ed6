"""WebDataset-style tar shards (``--data DIR`` of ``*.tar``, or a pattern ``a-{000..009}.tar``),
here or at a URL: their walk (shards.py) makes a manifest whose audio is each member's locator."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..layouts import Entry, Rejection, parse_manifest
from ..shards import list_shards, listing_stamp, read_shards, shard_source
from ..storage import is_url
from ..types import AudioFile, AudioProbe
from .base import Format


class Sharded(Format):
    """Files of many clips (tar shards, Parquet files, Shar shards), found by their pattern and
    listed by one walk, cached by its stamp: the files' names, sizes and stamps."""

    sharded = True

    def locate(self, path: str, metadata_file: str) -> tuple[Path, str] | None:
        return shard_source(path, metadata_file) if path else None

    def named(self, root: Path, metadata_file: str, configured: str) -> str:
        return metadata_file if is_url(metadata_file) else str(root / metadata_file)

    def read(self, root: Path, metadata_file: str) -> bytes:
        return read_shards(root, metadata_file).manifest

    def parse(self, raw: bytes, columns: str) -> tuple[list[Entry], list[Rejection]]:
        return parse_manifest(raw)

    def audio(self, root: Path, metadata_file: str, raw: bytes, columns: str) -> dict[str, AudioFile]:
        return read_shards(root, metadata_file).audio

    def stamp(self, root: Path, metadata_file: str) -> str:
        return listing_stamp(root, metadata_file)

    def sha256(self, root: Path, metadata_file: str) -> str:
        """Of ``name TAB byte-size LF`` per shard, in name order: one stat each (or one listing at
        a URL), their members not read."""
        return hashlib.sha256("".join(f"{s.name}\t{s.size}\n" for s in list_shards(root, metadata_file))
                              .encode("utf-8", "surrogateescape")).hexdigest()

    def walked(self, root: Path, metadata_file: str) -> tuple[list[Rejection], dict[str, AudioProbe]]:
        listing = read_shards(root, metadata_file)
        return listing.rejected, listing.probes()


class Tar(Sharded):
    name = "tar"

    def claims(self, metadata_file: str) -> bool:
        return metadata_file.lower().endswith(".tar")
