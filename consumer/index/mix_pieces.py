"""A large mix indexed in pieces: each part's pieces made as its format alone makes them (a
JSON-lines manifest's byte ranges, a Parquet dataset's row groups, a lhotse cut manifest's
blocks of lines), worked by the helper processes, each piece's clips named as the mix names them
before the rules (:class:`MixNames`), then merged by chunked.py into one index whose rejections
come in (part, line) order: the one-process build's index, its memory a piece's and a block per
piece however large the mix. A mix with a part of another format (an LJSpeech layout, tar
shards: their audio headers are read) or at a URL is built in one process, as those are alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, cast

from ...shared.config import DataConfig, FeaturesConfig, TextConfig
from ...shared.dataset.corpus.mix import MIX_ID_SEPARATOR, Mix, mix_digest
from ...shared.dataset.corpus.registry import format_of
from ...shared.dataset.files import hashed_file
from ...shared.dataset.layouts import ManifestColumns, Rejection
from ...shared.dataset.shards import list_shards
from ...shared.dataset.storage import StorageError, is_url
from ...shared.dataset.types import DatasetError
from .cuts_pieces import REPEATED_CUT, cuts_chunk, cuts_tasks
from .parquet_pieces import parquet_pieces
from .pieces import Pieces, manifest_chunk, manifest_ranges
from .reuse import file_size
from .spill import remove_spill, spill_dir

# A mix whose parts' metadata files hold at least this many bytes in all is built in pieces (a
# cut manifest's threshold, cuts_pieces.CUTS_CHUNKED_MIN_BYTES: some parts are compressed, some
# 60,000 clips of a JSON-lines manifest); a smaller one in one pass (helpers cost more to start).
MIX_CHUNKED_MIN_BYTES = 8 << 20

# A piece of a manifest part (a large manifest's, chunked.BUILD_CHUNK_BYTES).
PIECE_BYTES = 8 << 20

# What a manifest's own rejection of a repeated id says (layouts.parse_manifest's), for one in a later piece.
REPEATED_LINE = "duplicate id on manifest line"


@dataclasses.dataclass(frozen=True)
class MixNames:
    """What a part's clips become in the mix, as :meth:`Mix.clips` makes them: ids prefixed
    ``NAME:``, the part's name the speaker and its language the language of a clip that names
    none, audio paths from the mix file's directory (a URL or an absolute path as written); its
    lines' rejections under prefixed ids (their reasons prefixed in the merge, :func:`mix_pieces`).
    Applied in the helper processes, before the rules (pieces.columns_piece)."""

    name: str
    directory: str
    language: str

    def __call__(self, entries: ManifestColumns, parsed: list[Rejection]) -> tuple[ManifestColumns, list[Rejection]]:
        prefix, directory = f"{self.name}{MIX_ID_SEPARATOR}", self.directory
        audio = [a if a.startswith("/") or is_url(a) else f"{directory}/{a}" if a else f"{directory}/wavs/{i}.wav"
                 for i, a in zip(entries.id, entries.audio)]
        named = ManifestColumns([prefix + i for i in entries.id], entries.text, entries.line,
                                [s or self.name for s in entries.speaker],
                                [code or self.language for code in entries.language], audio, entries.duration)
        return named, [Rejection(prefix + r.id, r.reason, r.producer, r.line, r.file, r.kind) for r in parsed]


def mix_chunk(fn: Callable[..., dict[str, Any] | None], *task: Any) -> dict[str, Any] | None:
    """A piece of a mix's part: its format's piece function ``fn`` of ``task`` (runs in helper processes)."""
    return fn(*task)


def mix_pieces(root: Path, metadata_file: str, data: DataConfig, features: FeaturesConfig, text: TextConfig,
               candidates: list[Path]) -> Pieces | None:
    """The pieces of a large local mix whose every part is a JSON-lines manifest, a Parquet
    dataset or a lhotse cut manifest (the module's docstring), their cut manifests' blocks spilled
    beside the index cache, and the mix's SHA-256 (:meth:`Mix.sha256`, its cut manifests' taken
    as their blocks are spilled); None where the one-process build is the way. The mix's parts
    are read through the registry's format of a mix file (index.IN_PIECES picks this by its name)."""
    mix = cast(Mix, format_of(metadata_file))
    try:
        parts = mix.parts(root, metadata_file)
    except DatasetError:
        return None  # the one-process build says why
    formats = [mix.format_of(part.metadata_file) for part in parts]
    if any(is_url(part.directory) or fmt.name not in ("manifest", "parquet", "cuts")
           for part, fmt in zip(parts, formats)):
        return None
    try:
        size = sum(file_size(part.where / part.metadata_file) if fmt.name != "parquet" else
                   sum(s.size for s in list_shards(part.where, part.metadata_file))
                   for part, fmt in zip(parts, formats))
    except (DatasetError, StorageError, OSError):
        return None
    if size < MIX_CHUNKED_MIN_BYTES:
        return None
    spill = spill_dir(candidates)
    try:
        found = _part_pieces(parts, formats, data, features, text, spill)
    except (DatasetError, StorageError, OSError):
        found = None
    if found is None:
        remove_spill(spill)
        return None
    tasks, datasets, named, words, sha256s = found
    prefixes = [f"{part.part.name}: " for part in parts]

    def in_mix(rejection: Rejection, dataset: int) -> Rejection:
        """A line's rejection as its format names it (a Parquet row's), its reason prefixed ``NAME: ``."""
        own = named[dataset]
        r = own(rejection, 0) if own is not None else rejection
        return Rejection(r.id, prefixes[dataset] + r.reason, r.producer, r.line, r.file, r.kind)

    return Pieces((mix_chunk, tasks), in_mix, tuple(words), mix_digest(parts, sha256s).hexdigest(), spill,
                  tuple(datasets))


def _part_pieces(parts: list[Any], formats: list[Any], data: DataConfig, features: FeaturesConfig, text: TextConfig,
                 spill: Path) -> tuple[list[tuple], list[int], list[Any], list[str], list[str]] | None:
    """Every part's pieces in turn: (the tasks of :func:`mix_chunk`, each task's part, each part's
    naming of a line's rejection (None: as it is), wording of a repeated id, and SHA-256)."""
    tasks: list[tuple] = []
    datasets: list[int] = []
    named: list[Any] = []
    words: list[str] = []
    sha256s: list[str] = []
    for n, (part, fmt) in enumerate(zip(parts, formats)):
        p = part.part
        names = MixNames(p.name, part.directory, p.language)
        given = dataclasses.replace(data, columns=p.columns)  # a Parquet part's column map
        path = part.where / part.metadata_file
        if fmt.name == "manifest":
            own = [(manifest_chunk, str(path), *piece, given, features, text, names)
                   for piece in manifest_ranges(path, PIECE_BYTES)]
            named.append(None)
            words.append(REPEATED_LINE)
            sha256s.append(hashed_file(part.where, part.metadata_file))
        elif fmt.name == "parquet":
            found = parquet_pieces(part.where, part.metadata_file, given, features, text, [spill], min_rows=0)
            if found is None:
                return None
            fn, made = found.work
            own = [(fn, *task, names) for task in made]
            named.append(found.named)
            words.append(REPEATED_LINE)
            sha256s.append(fmt.sha256(part.where, part.metadata_file))
        else:  # a lhotse cut manifest
            where = spill / f"part-{n}"
            where.mkdir()
            cut = cuts_tasks(path, where, given, features, text, names)
            if cut is None:
                return None
            own = [(cuts_chunk, *task) for task in cut[0]]
            named.append(None)
            words.append(REPEATED_CUT)
            sha256s.append(cut[1])
        tasks += own
        datasets += [n] * len(own)
    return tasks, datasets, named, words, sha256s
