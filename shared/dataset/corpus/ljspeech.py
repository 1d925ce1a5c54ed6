"""LJSpeech-style metadata (``metadata.csv``: ``id|text[|normalized_text[|speaker|language]]``,
or the fields ``data.columns`` names) beside ``wavs/``, on this host; parsed by shared/dataset/layouts.py."""

from __future__ import annotations

from pathlib import Path

from ..layouts import Entry, Rejection, parse_metadata
from ..files import hashed_file, metadata_location, read_file, scan_audio
from ..storage import file_stamp
from ..types import AudioFile
from .base import Format


class LJSpeech(Format):
    """The layout every other name falls to: its cache found by the metadata's stamp, its audio
    the listing of ``wavs/`` (not looked at on a warm start: checked when a producer reads it)."""

    name = "ljspeech"
    loose = True

    def claims(self, metadata_file: str) -> bool:
        return True

    def read(self, root: Path, metadata_file: str) -> bytes:
        return read_file(root, metadata_file)

    def parse(self, raw: bytes, columns: str) -> tuple[list[Entry], list[Rejection]]:
        return parse_metadata(raw, columns)

    def audio(self, root: Path, metadata_file: str, raw: bytes, columns: str) -> dict[str, AudioFile]:
        return scan_audio(root)

    def stamp(self, root: Path, metadata_file: str) -> str:
        return file_stamp(metadata_location(root, metadata_file))

    def sha256(self, root: Path, metadata_file: str) -> str:
        return hashed_file(root, metadata_file)
