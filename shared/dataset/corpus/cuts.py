"""lhotse CutSet manifests as a dataset layout (pure functions, no I/O; lhotse is not needed).

:func:`parse_cuts` reads a cut manifest (``cuts*.jsonl`` or ``.jsonl.gz``), or a Shar shard's cuts
file (``shar=True``: shared/dataset/shar.py), as one clip per MonoCut; a window of a longer recording is
named ``FILE#t=START,END`` (address.py). The fields read, the windows and the
rejections: docs/design/data.md, "lhotse cut manifests".
"""

from __future__ import annotations

import gzip
import hashlib
import math
import re
import zlib
from pathlib import Path
from typing import Any, Callable

import orjson

from ..layouts import Entry, Rejection, _id_problem, _shown, _speaker_problem, language_problem, nfc
from ..files import metadata_error, metadata_location, read_file, resolve_root
from ..storage import is_url
from ..types import DatasetError
from .address import span_name
from .manifest import Manifest

# How far a cut may end beyond its recording's duration and still be read (frames rounded to seconds).
END_TOLERANCE_S = 1e-3
GZIP_MAGIC = b"\x1f\x8b"
_SOURCE_TYPES = ("file", "url")
# A cut manifest's file name (cuts.jsonl.gz, librispeech_cuts_train.jsonl.gz).
_CUTS_NAME = re.compile(r"(?i)(^|.*/)[^/]*cuts[^/]*\.jsonl(\.gz)?$")


def decompressed(raw: bytes) -> bytes:
    """A cut manifest's lines: ``raw`` gunzipped when it is gzip (lhotse's ``.jsonl.gz``), else as it
    is; ValueError (one line) when its gzip stream is broken."""
    if not raw.startswith(GZIP_MAGIC):
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"not a readable gzip file ({exc})") from None


def manifest_line(number: int) -> str:
    """Where a cut manifest's line is, as its rejections name it."""
    return f"cut manifest line {number}"


def parse_cuts(raw: bytes, place: Callable[[int], str] = manifest_line, shar: bool = False,
               start_line: int = 1) -> tuple[list[Entry], list[Rejection]]:
    """The entries of a cut manifest's lines (``raw`` decompressed); faults become rejections, each
    naming its line as ``place`` words it. ``start_line`` > 1: ``raw`` is a block of a manifest cut
    at a line end, whose first line is that line of the file (consumer/index/cuts_pieces.py: duplicate
    ids are then found within the block only). ``shar``: the cuts of a lhotse Shar shard, whose
    recordings are members of the shard's tar (shared/dataset/shar.py): their entries' audio is
    left empty, for the caller to fill, and a cut must be all of its recording (as lhotse's
    ``to_shar`` writes every cut)."""
    entries: list[Entry] = []
    rejected: list[Rejection] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(raw.splitlines(), start=start_line):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            rejected.append(Rejection(f"line:{number}", f"{place(number)} is not JSON ({exc})", line=number))
            continue
        said = _cut_entry(obj, number, place(number), shar) if type(obj) is dict else \
            Rejection(f"line:{number}", f"{place(number)} is not a JSON object", line=number)
        if isinstance(said, Rejection):
            rejected.append(said)
        elif said.id in first_line:
            rejected.append(Rejection(said.id, f"duplicate cut id on {place(number)} "
                                               f"(first on line {first_line[said.id]})", line=number))
        else:
            first_line[said.id] = number
            entries.append(said)
    return entries, rejected


def _cut_entry(cut: dict[str, Any], number: int, where: str, shar: bool) -> Entry | Rejection:
    """One cut's entry, or why it is unusable (naming the cut once its id is known, and ``where``
    its line is)."""
    given = cut.get("id")
    sample_id = nfc(given.strip()) if type(given) is str else ""
    if not sample_id or _id_problem(sample_id) or "\t" in sample_id or "\n" in sample_id:
        return Rejection(f"line:{number}", f"{where} has an 'id' that is not a plain file name ({_shown(given)})",
                         line=number)

    def rejection(problem: str, file: str | None = None) -> Rejection:
        return Rejection(sample_id, f"cut {sample_id} ({where}) {problem}", line=number, file=file)

    recording = cut.get("recording")
    if type(recording) is not dict:
        return rejection(f"is a {cut.get('type', 'cut')} without a recording: only a MonoCut (a window of one "
                         "recording) is read")
    sources = recording.get("sources")
    source = sources[0] if type(sources) is list and sources and type(sources[0]) is dict else {}
    path = source.get("source")
    if shar:
        path = ""  # the shard's member, found by the cut's id
    elif source.get("type") not in _SOURCE_TYPES or type(path) is not str or not path.strip():
        return rejection(f"has a recording whose source is not a file or URL ({_shown(source or sources)})")
    path = path.strip()
    start, duration = cut.get("start", 0), cut.get("duration")
    for key, value in (("start", start), ("duration", duration)):
        if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
            return rejection(f"has a '{key}' that is not a number of seconds ({_shown(value)})", path)
    if duration == 0:
        return rejection("has a duration of 0 s", path)
    whole = recording.get("duration")
    end = start + duration
    if type(whole) in (int, float) and end > whole + END_TOLERANCE_S:
        named = f": {_shown(path)}" if path else ""  # a Shar cut's recording is the member of its id
        return rejection(f"ends at {end:.3f} s, beyond its recording's end ({whole:.3f} s{named})", path)
    supervisions = cut.get("supervisions") or []
    if type(supervisions) is not list or not all(type(s) is dict for s in supervisions):
        return rejection("has 'supervisions' that are not a list of objects", path)
    spoken = sorted((s for s in supervisions if type(s.get("text")) is str and s["text"].strip()),
                    key=lambda s: s.get("start", 0) if type(s.get("start", 0)) in (int, float) else 0)
    if not spoken:
        return rejection("has no supervision with text", path)
    first = spoken[0]
    speaker, language = first.get("speaker") or "", first.get("language") or ""
    if type(speaker) is int:
        speaker = str(speaker)
    if type(speaker) is not str or (speaker.strip() and _speaker_problem(speaker.strip())):
        return rejection(f"has a supervision 'speaker' that is not usable ({_shown(speaker)})", path)
    if type(language) is not str or (language.strip() and language_problem(language.strip())):
        return rejection(f"has a supervision 'language' that is not a language code ({_shown(language)})", path)
    covers = start == 0 and type(whole) in (int, float) and abs(duration - whole) <= END_TOLERANCE_S
    if shar and not covers:
        length = f"{whole:.3f} s" if type(whole) in (int, float) else "unknown length"
        return rejection(f"is {duration:.3f} s from {start:.3f} s of a recording of {length}: a cut of a Shar "
                         "shard is read whole (as lhotse's to_shar writes it)")
    audio = path if covers else span_name(path, start, end)
    return Entry(sample_id, " ".join(s["text"].strip() for s in spoken), number, speaker.strip(), language.strip(),
                 audio, duration=float(duration))


class Cuts(Manifest):
    """A lhotse cut manifest (``cuts.jsonl.gz``, ``librispeech_cuts_train.jsonl.gz``): a manifest
    whose lines are cuts; a large local one is decompressed as a stream into blocks of lines,
    built in pieces (consumer/index/cuts_pieces.py), a small one read whole."""

    name = "cuts"
    split = False

    def claims(self, metadata_file: str) -> bool:
        return _CUTS_NAME.match(metadata_file) is not None

    def locate(self, path: str, metadata_file: str) -> tuple[Path, str] | None:
        """``--data DIR/cuts.jsonl.gz``: its directory the root."""
        given = Path(path).expanduser() if path and not is_url(path) else None
        if given is None or not self.claims(given.name) or given.is_dir():
            return None
        return resolve_root(str(given.parent)), given.name

    def named(self, root: Path, metadata_file: str, configured: str) -> str:
        return metadata_file if is_url(metadata_file) else str(root / metadata_file)

    def read(self, root: Path, metadata_file: str) -> bytes:
        try:
            return decompressed(read_file(root, metadata_file))
        except ValueError as exc:
            raise DatasetError(f"{metadata_location(root, metadata_file)}: {exc}") from None

    def parse(self, raw: bytes, columns: str) -> tuple[list[Entry], list[Rejection]]:
        return parse_cuts(raw)

    def sha256(self, root: Path, metadata_file: str) -> str:
        """Of its lines, gunzipped (a local file's as a stream, a MB at a time: never held whole)."""
        if is_url(metadata_file):
            return hashlib.sha256(self.read(root, metadata_file)).hexdigest()
        path = root / metadata_file
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                gzipped = f.read(2) == GZIP_MAGIC
            with (gzip.open(path, "rb") if gzipped else open(path, "rb")) as stream:
                for read in iter(lambda: stream.read(1 << 20), b""):
                    digest.update(read)
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise DatasetError(f"{path}: not a readable gzip file ({exc})") from None
        except OSError as exc:
            raise metadata_error(path, exc) from None
        return digest.hexdigest()
