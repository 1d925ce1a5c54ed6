"""The records of a dataset: a usable clip (:class:`Sample`), an audio file as listed and as
its header describes it, the index's statistics, and the error of a dataset that cannot
be used at all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..errors import UserError
from .layouts import Rejection

# Suffixes of formats libsndfile reads, in order of preference when one id has several.
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aiff", ".aif", ".aifc", ".au", ".w64",
                  ".rf64", ".caf")


# Clips whose metadata names no speaker are this speaker's.
DEFAULT_SPEAKER = "default"


class DatasetError(UserError):
    """The dataset as a whole cannot be used (missing, unreadable, no usable clip)."""


class Sample(NamedTuple):
    """One usable clip: enough to plan batches without decoding audio.

    A NamedTuple, not a frozen dataclass: a warm index load makes one per clip, and a
    tuple is built several times faster.
    """

    id: str
    text: str
    num_tokens: int  # including EOS
    num_frames: int  # mel frames at the configured rate and hop
    duration_s: float
    audio: str = ""  # file name in the audio directory ("" for synthetic samples)
    line: int = 0  # metadata line
    language: str = ""  # language code (the metadata's, else text.language)
    speaker: str = ""  # speaker name (the metadata's, else DEFAULT_SPEAKER)
    units: str = ""  # what the text front-end made of the text (Vocabulary.encode gives the ids)


class AudioFile(NamedTuple):
    """One file of the audio directory, as listed (no header read)."""

    name: str
    size: int
    mtime_ns: int


class AudioProbe(NamedTuple):
    """What an audio header says, or why the file cannot be used.

    ``error`` names the fault ("audio file truncated"), "" when the file is usable;
    ``detail`` says more where there is more to say (libsndfile's message, byte counts).
    """

    frames: int = 0
    rate: int = 0
    channels: int = 0
    error: str = ""
    detail: str = ""


@dataclass
class IndexStats:
    """How the index was obtained: for logs, summary.json and the cache tests."""

    cache: str = "off"  # hit | miss | stale | corrupt | off
    cache_file: str = ""
    headers_read: int = 0  # audio headers read this time
    headers_reused: int = 0  # header facts taken from the previous cache
    texts_tokenized: int = 0
    workers: int = 1
    read_s: float = 0.0  # reading headers and sending texts through the front-end: the parallel stage
    read_retries: int = 0  # reads at a URL retried by this process and its helpers (shared/dataset/storage.py)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The sample rate of the probe a JSON duration makes (microseconds): the index computes a
# clip's length at the feature rate from frames / rate, exact to a microsecond.
DURATION_RATE_HZ = 1_000_000


@dataclass(frozen=True)
class Shard:
    """One shard as listed: its name (relative to the root, or a URL), size and modification stamp."""

    name: str
    size: int
    mtime_ns: int


@dataclass
class ShardListing:
    """The clips of a set of shards: a manifest line per clip, the audio members as files
    (name = locator, size = the member's, mtime = the shard's), the durations the JSON gave
    (by locator), and the rejected members."""

    lines: list[str] = field(default_factory=list)
    audio: dict[str, AudioFile] = field(default_factory=dict)
    durations: dict[str, float] = field(default_factory=dict)
    rejected: list[Rejection] = field(default_factory=list)
    shards: int = 0

    @property
    def manifest(self) -> bytes:
        return "".join(line + "\n" for line in self.lines).encode("utf-8")

    def to_payload(self) -> dict[str, Any]:
        return {"shards": self.shards, "lines": self.lines, "durations": self.durations,
                "audio": [[i, *a] for i, a in self.audio.items()],
                "rejected": [[r.id, r.reason, r.file, r.kind] for r in self.rejected]}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> "ShardListing":
        return cls(lines=list(payload["lines"]), durations=dict(payload["durations"]), shards=int(payload["shards"]),
                   audio={i: AudioFile(name, size, mtime) for i, name, size, mtime in payload["audio"]},
                   rejected=[Rejection(i, reason, file=file, kind=kind) for i, reason, file, kind in payload["rejected"]])

    def probes(self) -> dict[str, AudioProbe]:
        """The header facts the JSON durations give (no audio read), by locator."""
        return {name: AudioProbe(round(seconds * DURATION_RATE_HZ), DURATION_RATE_HZ, 1)
                for name, seconds in self.durations.items()}
