"""A clip's address, typed: where its audio is, parsed once from the name the index stores and
a lease carries (that name, ``str(address)``, is what the cache file and the wire hold).

Four kinds: a loose file (a path relative to the dataset root, or absolute), a file at a URL,
a tar shard's member (``SHARD.tar#MEMBER@OFFSET+SIZE``) and a Parquet row (``FILE.parquet#G:R``).
A file of either kind may be a window of a longer recording (a lhotse cut: ``FILE#t=START,END``).
The formats write their clips' names; only :func:`address_of` reads one back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from ..parquet_layout import ROW_LOCATOR, row_where
from ..storage import is_url, shown

_MEMBER = re.compile(r"^(?P<shard>.+\.tar)#(?P<member>.+)@(?P<offset>\d+)\+(?P<size>\d+)$")
_SPAN = re.compile(r"^(?P<file>.+)#t=(?P<start>[0-9.eE+-]+),(?P<end>[0-9.eE+-]+)$")


@dataclass(frozen=True)
class File:
    """A loose audio file: ``path`` relative to the dataset root or absolute; ``span``: only
    the seconds ``[start, end)`` of it (a lhotse cut's window), else the whole file."""

    path: str
    span: tuple[float, float] | None = None

    def __str__(self) -> str:
        return self.path if self.span is None else span_name(self.path, *self.span)


@dataclass(frozen=True)
class Url:
    """A loose audio file at a URL (an object store's or a web server's), read whole; ``span`` as a File's."""

    path: str
    span: tuple[float, float] | None = None

    def __str__(self) -> str:
        return self.path if self.span is None else span_name(self.path, *self.span)


@dataclass(frozen=True)
class Member:
    """A tar shard's member: ``size`` bytes at ``offset`` of ``shard`` (relative to the root, or a URL)."""

    shard: str
    member: str
    offset: int
    size: int

    def __str__(self) -> str:
        return f"{self.shard}#{self.member}@{self.offset}+{self.size}"

    @property
    def where(self) -> str:
        """The shard and member, for reasons: ``member M of shard S``."""
        return f"member {self.member} of shard {shown(self.shard)}"


@dataclass(frozen=True)
class Row:
    """A Parquet file's row: row ``row`` of row group ``group`` of ``file`` (relative, or a URL)."""

    file: str
    group: int
    row: int
    name: str  # as written (its suffix's case kept): what the row reader is asked for

    def __str__(self) -> str:
        return self.name

    @property
    def where(self) -> str:
        """The row, for reasons: ``row R of row group G of FILE``."""
        return row_where(self.name)


Address = Union[File, Url, Member, Row]
IN_SHARDS = (Member, Row)  # the kinds read through a dataset's reader, never cached by their file


def span_name(file: str, start: float, end: float) -> str:
    """The name of a clip that is ``[start, end)`` seconds of ``file``."""
    return f"{file}#t={float(start)!r},{float(end)!r}"


def address_of(name: str) -> Address:
    """The address a clip's stored name stands for (the one place a name's syntax is read)."""
    if "#" in name:
        match = _MEMBER.match(name)
        if match is not None:
            return Member(match["shard"], match["member"], int(match["offset"]), int(match["size"]))
        match = ROW_LOCATOR.match(name)
        if match is not None:
            return Row(match["file"], int(match["group"]), int(match["row"]), name)
    match = _SPAN.match(name) if "#t=" in name else None
    span = _seconds(match["start"], match["end"]) if match is not None else None
    path = match["file"] if span is not None else name  # type: ignore[index]
    return Url(path, span) if is_url(path) else File(path, span)


def _seconds(start: str, end: str) -> tuple[float, float] | None:
    """A window's seconds, or None where they are not numbers (then the name is a file's, as written)."""
    try:
        return float(start), float(end)
    except ValueError:
        return None


def member_of(name: str) -> Member:
    """The member a tar shard's clip name stands for; ValueError for any other name."""
    address = address_of(name)
    if not isinstance(address, Member):
        raise ValueError(f"not a shard member's locator: {name!r}")
    return address
