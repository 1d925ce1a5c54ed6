"""lhotse Shar directories (``cuts.NNNNNN.jsonl.gz`` beside ``recording.NNNNNN.tar``): tar shards
whose texts are each shard's cuts (the walk: shards.py and ../shar.py)."""

from __future__ import annotations

from ..shar import is_shar
from .tar import Tar


class Shar(Tar):
    name = "shar"

    def claims(self, metadata_file: str) -> bool:
        return is_shar(metadata_file)
