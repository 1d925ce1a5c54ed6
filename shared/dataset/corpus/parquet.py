"""Parquet files as Hugging Face ``datasets`` writes them (one clip a row): the row walk and reader
are ../parquet.py's, a row's fields shared/dataset/parquet_layout.py's; a large local dataset is built
in pieces by the trainer's index build (consumer/index/parquet_pieces.py)."""

from __future__ import annotations

from pathlib import Path

from ..layouts import Entry, Rejection
from ..parquet_layout import parquet_entries
from ..files import locate_audio
from ..shards import read_shards
from ..types import AudioFile
from .tar import Sharded


class Parquet(Sharded):
    name = "parquet"

    def claims(self, metadata_file: str) -> bool:
        return metadata_file.lower().endswith(".parquet")

    def parse(self, raw: bytes, columns: str) -> tuple[list[Entry], list[Rejection]]:
        return parquet_entries(raw, columns)

    def audio(self, root: Path, metadata_file: str, raw: bytes, columns: str) -> dict[str, AudioFile]:
        """Each row's locator, or the file its path column names."""
        listed = read_shards(root, metadata_file).audio
        entries, _ = self.parse(raw, columns)
        return {**locate_audio(root, [e for e in entries if e.audio not in listed]),
                **{e.id: listed[e.audio] for e in entries if e.audio in listed}}
