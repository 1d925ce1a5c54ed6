"""lhotse Shar directories as a dataset: each shard's cuts (``cuts.NNNNNN.jsonl.gz``) matched to
the audio members of its recording tar (``recording.NNNNNN.tar``), read without lhotse.

shards.py lists a Shar directory as tar shards whose pattern is :data:`SHAR_GLOB`: it walks each
recording tar's headers and hands its members here, where the shard's cuts file (beside it, or at
the URL beside it) is read as a cut manifest (corpus/cuts.py) and each cut becomes a manifest
line whose audio is its member's locator. The long story is in docs/design/data.md, "Shar directories".
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..dataset.corpus.cuts import decompressed, parse_cuts
from ..dataset.corpus.address import Member
from ..dataset.storage import StorageError, first_line, is_url, open_file, shown
from ..dataset.types import AUDIO_SUFFIXES, AudioFile, Shard, ShardListing
from .layouts import Rejection

# The pattern a Shar directory stands for: its recording tars (``recording.tar`` when unsharded).
SHAR_GLOB = "recording*.tar"


# A Shar directory's file names: the cuts of a shard, and its recording tar.
_CUTS_NAME = re.compile(r"^cuts(\.[^/]*)?\.jsonl(\.gz)?$")
_RECORDING_NAME = re.compile(r"^recording(\.[^/]*)?\.tar$")


# The members of a recording tar that hold no audio: each cut's recording manifest, and the
# placeholders of a cut without a recording.
_NOT_AUDIO = ("json", "nodata", "nometa")


def is_shar(pattern: str) -> bool:
    """Whether a shard pattern names a Shar directory's recording tars (``recording*.tar``,
    ``recording.{000000..000009}.tar``, one ``recording.000003.tar``)."""
    return pattern.rpartition("/")[2].startswith("recording") and pattern.lower().endswith(".tar")


def is_shar_directory(names: list[str]) -> bool:
    """Whether the file names of a directory are a Shar directory's: cuts beside recording tars."""
    bases = [n.rpartition("/")[2] for n in names]
    return any(_CUTS_NAME.match(b) for b in bases) and any(_RECORDING_NAME.match(b) for b in bases)


def cuts_file(shard: str) -> str:
    """The cuts file beside a recording tar: ``recording.000003.tar`` -> ``cuts.000003.jsonl.gz``."""
    directory, slash, base = shard.rpartition("/")
    return f"{directory}{slash}cuts{base[len('recording'):-len('.tar')]}.jsonl.gz"


def add_cuts(root: Path, shard: Shard, members: dict[str, tuple[str, int, int] | None], listing: ShardListing,
             seen: dict[str, str]) -> None:
    """Add one Shar shard's clips to ``listing``: each cut of its cuts file whose audio member
    (``members``: cut id -> (member, offset, size), as shards.py walked the tar; None for a
    member rejected there) is there, as a manifest line; the rest as rejections naming the cut
    and the shard."""
    name = cuts_file(shard.name)
    path = name if is_url(name) or Path(name).is_absolute() else str(root / name)
    try:
        with open_file(path) as f:
            raw = decompressed(f.read())
    except (OSError, StorageError, ValueError) as exc:
        listing.rejected.append(Rejection(f"shard:{shard.name}", f"the cuts of Shar shard {shown(shard.name)} "
                                                                 f"({shown(name)}) cannot be read: "
                                                                 f"{type(exc).__name__}: {first_line(exc)}"))
        return
    entries, rejected = parse_cuts(raw, lambda number: f"line {number} of {shown(name)}", shar=True)
    listing.rejected.extend(rejected)
    for entry in entries:
        if entry.id in members and members[entry.id] is None:
            continue  # its member is truncated: rejected by the walk
        found = members.get(entry.id)
        if found is None:
            listing.rejected.append(Rejection(entry.id, f"cut {entry.id} ({shown(name)} line {entry.line}) has no "
                                                        f"audio member in shard {shown(shard.name)}",
                                              file=f"{shard.name}#{entry.id}", kind="missing-audio"))
            continue
        member, offset, size = found
        locator = str(Member(shard.name, member, offset, size))
        if entry.id in seen:
            listing.rejected.append(Rejection(entry.id, f"duplicate cut id {entry.id} in shard {shown(shard.name)} "
                                                        f"(first in {seen[entry.id]})", file=locator))
            continue
        seen[entry.id] = f"shard {shown(shard.name)}"
        line = {"id": entry.id, "audio_filepath": locator, "text": entry.text, "duration": entry.duration}
        line.update({k: v for k, v in (("speaker", entry.speaker), ("language", entry.language)) if v})
        listing.lines.append(json.dumps(line, ensure_ascii=False))
        listing.durations[locator] = float(entry.duration)  # type: ignore[arg-type]
        listing.audio[entry.id] = AudioFile(locator, size, shard.mtime_ns)


def audio_member(base: str) -> str | None:
    """The cut id a recording tar's member holds the audio of (``cut3.flac`` -> ``cut3``), or None
    for a member of no audio (a cut's recording manifest, a placeholder) or of no audio format."""
    stem, dot, suffix = base.rpartition(".")
    if not dot or not stem or suffix.lower() in _NOT_AUDIO:
        return None
    return stem if f".{suffix.lower()}" in AUDIO_SUFFIXES else None
