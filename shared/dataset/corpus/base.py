"""The contract every corpus format keeps: found at a path, its metadata read, its entries and
audio listed, its stamp for the index cache, its SHA-256 for the dataset agreement.

A format is one object (one module each: ljspeech.py, manifest.py, cuts.py, tar.py, parquet.py,
shar.py, mix.py, url.py), chosen once by registry.py from the metadata file's name; the index
build and every other caller ask it, never the name. docs/DESIGN.md (Corpus formats) tells the
story: the registry's order, what each method returns, how a format is added.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ...layouts import COLUMNS_AUTO, Entry, Rejection
from ..storage import is_url
from ..types import AudioFile, AudioProbe


@dataclass(frozen=True)
class Listing:
    """What the index is keyed by, before any metadata is parsed: the metadata's SHA-256 (as the
    index stores it), each clip's audio file by id, and the metadata's bytes where they were read
    whole (None: a dataset of parts, each read in turn: :meth:`Format.clips` reads them again)."""

    sha256: bytes
    audio: dict[str, AudioFile]
    raw: bytes | None


@dataclass(frozen=True)
class Pieces:
    """How a large dataset's index is built in pieces (chunked.py): each piece's work (a function
    and its tasks), what a line's rejection of dataset N becomes (None: as it is), the wording of
    an id repeated in a later piece (one per dataset of a mix), the metadata's SHA-256 where the
    pieces were cut from a stream or a mix's parts (else its stamp keys the cache), a directory of
    spilled blocks to remove after the build, and the dataset (of a mix) each piece is of."""

    work: tuple[Callable[..., Any], list[tuple]]
    named: Callable[[Rejection, int], Rejection] | None = None
    repeated: str | tuple[str, ...] = "duplicate id on manifest line"
    sha256: str = ""
    spill: Path | None = None
    datasets: tuple[int, ...] = ()


@dataclass(frozen=True)
class Located:
    """A dataset found: the directory its caches live under (a URL's: a local one), its metadata
    file (a name below ``root``, a pattern of shards, or a URL), and its format."""

    root: Path
    metadata_file: str
    format: "Format"

    @property
    def where(self) -> tuple[Path, str]:
        """(root, metadata file): what a process that is handed the dataset is given."""
        return self.root, self.metadata_file

    def read(self) -> bytes:
        return self.format.read(self.root, self.metadata_file)

    def listing(self, columns: str = COLUMNS_AUTO, raw: bytes | None = None) -> Listing:
        return self.format.listing(self.root, self.metadata_file, columns, raw)

    def clips(self, columns: str = COLUMNS_AUTO, raw: bytes | None = None) -> tuple[list[Entry], list[Rejection]]:
        return self.format.clips(self.root, self.metadata_file, columns, raw)

    def stamp(self) -> str:
        return self.format.stamp(self.root, self.metadata_file)

    def sha256(self) -> str:
        return self.format.sha256(self.root, self.metadata_file)


class Format:
    """One corpus format. ``claims`` is the one test of a metadata file's name; the rest read the
    dataset: :meth:`listing` and :meth:`clips` are what the index build asks (by default from
    :meth:`read`, :meth:`audio` and :meth:`entries`, of metadata read whole; a mix streams its parts). Flags say how the index build treats it: ``manifest`` (a file of one JSON line per
    clip: its cache found by the file's stamp or hash, a large local one built in pieces),
    ``sharded`` (files of many clips, listed by a walk whose stamp finds the cache) and ``loose``
    (a local LJSpeech layout: its cache found by the metadata's stamp, its audio not listed)."""

    name = ""
    manifest = False
    sharded = False
    loose = False
    split = False  # a large local file of this format is built in pieces, cut at line ends (chunked.py)

    def claims(self, metadata_file: str) -> bool:
        """Whether a metadata file of this name is this format's."""
        raise NotImplementedError

    def locate(self, path: str, metadata_file: str) -> tuple[Path, str] | None:
        """(root, metadata file) where ``--data`` (``path``) names this format's dataset; None: not
        this format's, ask the next (registry.py's order)."""
        return None

    def named(self, root: Path, metadata_file: str, configured: str) -> str:
        """What ``--data`` names for a dataset found so (:meth:`locate`'s inverse), as producers are
        given it (``configured``: data.metadata_file): a dataset directory by default; a URL as given."""
        return metadata_file if is_url(metadata_file) else str(root)

    def read(self, root: Path, metadata_file: str) -> bytes:
        """The metadata's bytes, as :meth:`entries` reads them."""
        raise NotImplementedError

    def parse(self, raw: bytes, columns: str) -> tuple[list[Entry], list[Rejection]]:
        """The clips the metadata's bytes describe (each ``audio`` as written), and the lines that
        are not clips, each a rejection naming its line (no I/O: a mix's parts are parsed so too)."""
        raise NotImplementedError

    def resolve(self, entries: list[Entry], metadata_file: str) -> list[Entry]:
        """``entries`` with each audio name made what a producer reads (beside a metadata file at
        a URL); as they are by default."""
        return entries

    def entries(self, raw: bytes, metadata_file: str, columns: str) -> tuple[list[Entry], list[Rejection]]:
        """:meth:`parse`'s clips, each ``audio`` the clip's name (address.py), :meth:`resolve`d."""
        entries, rejected = self.parse(raw, columns)
        return self.resolve(entries, metadata_file), rejected

    def audio(self, root: Path, metadata_file: str, raw: bytes, columns: str) -> dict[str, AudioFile]:
        """Each clip's audio file by id, as found (a clip whose file is missing is left out)."""
        raise NotImplementedError

    def stamp(self, root: Path, metadata_file: str) -> str:
        """What the index cache is found by without reading the metadata (a file's size and mtime,
        a store's version, a listing's digest); "" where there is none (then its content's hash)."""
        return ""

    def listing(self, root: Path, metadata_file: str, columns: str, raw: bytes | None = None) -> Listing:
        """The metadata's SHA-256 and the clips' audio files (``raw``: the metadata's bytes, where held)."""
        raw = self.read(root, metadata_file) if raw is None else raw
        return Listing(hashlib.sha256(raw).digest(), self.audio(root, metadata_file, raw, columns), raw)

    def clips(self, root: Path, metadata_file: str, columns: str,
              raw: bytes | None = None) -> tuple[list[Entry], list[Rejection]]:
        """:meth:`entries` of the metadata (read where ``raw`` is None)."""
        return self.entries(self.read(root, metadata_file) if raw is None else raw, metadata_file, columns)

    def sha256(self, root: Path, metadata_file: str) -> str:
        """The SHA-256 (hex) of the metadata as the index stores it (the dataset agreement's)."""
        return hashlib.sha256(self.read(root, metadata_file)).hexdigest()

    def walked(self, root: Path, metadata_file: str) -> tuple[list[Rejection], dict[str, AudioProbe]]:
        """What a walk of the files found beside the entries: its rejections and the audio headers
        it read (a sharded format's); none by default."""
        return [], {}

    def pieces(self, root: Path, metadata_file: str, data: Any, features: Any, text: Any,
               candidates: list[Path]) -> Pieces | None:
        """The pieces a large dataset's index is built from (parquet_pieces.py's, cuts_pieces.py's,
        mix_pieces.py's: blocks spilled beside the index cache ``candidates``), or None where the one-pass build is
        the way (a manifest's pieces are byte ranges: :attr:`split`)."""
        return None
