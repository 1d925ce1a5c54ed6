"""JSON-lines manifests (``*.jsonl``, ``*.json``: one object a clip, NeMo's fields), here or at a
URL; parsed by shared/dataset/layouts.py, a large local one in pieces by helper processes
(consumer/index/chunked.py)."""

from __future__ import annotations

from pathlib import Path

from ..layouts import Entry, Rejection, parse_manifest
from ..files import hashed_file, locate_audio, metadata_location, read_file
from ..storage import file_stamp, is_url
from ..types import AudioFile
from .base import Format

SUFFIXES = (".jsonl", ".json")


class Manifest(Format):
    """A manifest: its cache found by its stamp (else its content's SHA-256), its audio the files
    its lines name (relative to the dataset, absolute, or URLs; at a URL, beside it)."""

    name = "manifest"
    manifest = True
    split = True

    def claims(self, metadata_file: str) -> bool:
        return metadata_file.lower().endswith(SUFFIXES)

    def read(self, root: Path, metadata_file: str) -> bytes:
        return read_file(root, metadata_file)

    def parse(self, raw: bytes, columns: str) -> tuple[list[Entry], list[Rejection]]:
        return parse_manifest(raw)

    def resolve(self, entries: list[Entry], metadata_file: str) -> list[Entry]:
        """A manifest at a URL's entries with each relative audio path made the URL beside it
        (``wavs/a.wav`` of ``s3://b/c/train.jsonl``: ``s3://b/c/wavs/a.wav``); a URL or an
        absolute path stays as written. Changed in place (the entries are the caller's fresh parse)."""
        if not is_url(metadata_file):
            return entries
        base = metadata_file.rpartition("/")[0] + "/"
        for entry in entries:
            audio = entry.audio
            if audio and not is_url(audio) and not audio.startswith("/"):
                entry.__dict__["audio"] = base + (audio[2:] if audio.startswith("./") else audio)
        return entries

    def audio(self, root: Path, metadata_file: str, raw: bytes, columns: str) -> dict[str, AudioFile]:
        return locate_audio(root, self.entries(raw, metadata_file, columns)[0])

    def stamp(self, root: Path, metadata_file: str) -> str:
        return file_stamp(metadata_location(root, metadata_file))

    def sha256(self, root: Path, metadata_file: str) -> str:
        return hashed_file(root, metadata_file)
