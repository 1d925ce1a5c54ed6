"""The one place a corpus format is chosen: by its metadata file's name (:func:`format_of`), or
from what ``--data`` names (:func:`locate`). A new format is a module of its own (base.py's
contract) and one line of :data:`FORMATS`; docs/DESIGN.md, Corpus formats.
"""

from __future__ import annotations

from pathlib import Path

from ...layouts import COLUMNS_AUTO, Entry, Rejection
from ..cuts_pieces import cuts_pieces
from ..mix_pieces import mix_pieces
from ..files import resolve_root
from ..storage import is_url
from .base import Format, Located
from .cuts import Cuts
from .ljspeech import LJSpeech
from .manifest import Manifest
from .mix import Mix
from .parquet import Parquet
from .shar import Shar
from .tar import Tar
from .url import LJSPEECH_SUFFIX, Url


def format_of(metadata_file: str) -> Format:
    """The format of a metadata file (a name, a pattern of shards, or a URL): the first of
    :data:`FORMATS` that claims its name (LJSpeech claims every name)."""
    return next(f for f in FORMATS if f.claims(metadata_file))


# In the order they are asked: a mix, a cut manifest before the manifests, a Shar pattern before
# tar shards', any other URL an LJSpeech layout there, and LJSpeech last.
FORMATS: list[Format] = [
    Mix(format_of, mix_pieces),
    Cuts(cuts_pieces),
    Manifest(),
    Parquet(),
    Shar(),
    Tar(),
    Url(format_of),
    LJSpeech(),
]


def _finders() -> list[Format]:
    """The formats asked where ``--data`` names a dataset, in order: a URL's finder before the
    shards' (any other URL is a shard directory), then those found by a file name of their own,
    then any other with a finder of its own (one of each finder: Parquet's and Shar's are tar's)."""
    by_name = {f.name: f for f in FORMATS}
    first = [by_name[n] for n in ("url", "tar", "mix", "cuts") if n in by_name]
    found: list[Format] = []
    for fmt in first + [f for f in FORMATS if f not in first]:
        finder = type(fmt).locate
        if finder is not Format.locate and finder not in {type(f).locate for f in found}:
            found.append(fmt)
    return found


def locate(path: str, metadata_file: str) -> Located:
    """The dataset ``--data`` (``path``) names, its format chosen once: a dataset directory (its
    metadata file ``metadata_file``), a mix file, a cut manifest, tar shards or Parquet files (a
    directory of them, or their pattern), or a dataset at a URL; '' is the embedded demo set."""
    for fmt in _finders():
        found = fmt.locate(path, metadata_file)
        if found is not None:
            return Located(found[0], found[1], format_of(found[1]))
    return Located(resolve_root(path), metadata_file, format_of(metadata_file))  # a dataset directory


def beside(path: str, metadata_file: str) -> str:
    """What ``--data`` names for a second metadata file ``metadata_file`` beside the one ``path``
    names (data.eval_file beside the training set's): a URL naming a manifest or an LJSpeech
    metadata file (``s3://b/c/train.jsonl``): its directory's URL, so that :func:`locate` finds
    ``metadata_file`` there; ``metadata_file`` itself when it is a URL; else ``path`` as given."""
    if is_url(metadata_file):
        return metadata_file
    name = path.rstrip("/").rpartition("/")[2]
    if is_url(path) and (format_of(name).manifest or name.lower().endswith(LJSPEECH_SUFFIX)):
        return path.rpartition("/")[0] + "/"
    return path


def read_metadata(root: Path, metadata_file: str = "metadata.csv",
                  columns: str = COLUMNS_AUTO) -> tuple[list[Entry], list[Rejection]]:
    """A dataset's entries and rejections, as its format reads them for the index."""
    return format_of(metadata_file).clips(root, metadata_file, columns)
