"""Tests for shared/wireparts.py: a dataclass as a msgpack map, each field checked by its type hint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import pytest

from stoker.shared.wireparts import FieldError, Part


@dataclass(frozen=True)
class Pair(Part):
    """A nested part."""

    name: str
    weight: float = 1.0


@dataclass(frozen=True)
class Sample(Part):
    """One field of every kind of hint the wire's messages use."""

    count: int
    flag: bool
    shape: tuple[int, int]
    ids: tuple[str, ...]
    sizes: dict[str, int]
    pairs: tuple[Pair, ...] = ()
    first: Pair | None = None
    note: str | None = None
    extra: Any = None

    def problem(self) -> str:
        return "negative count" if self.count < 0 else ""


FULL = Sample(3, True, (2, 4), ("a", "b"), {"a": 1}, (Pair("x", 0.5), Pair("y")), Pair("z"), "n", {"k": [1]})


def _over_msgpack(part: Part) -> Any:
    """The part's map as a receiver gets it: packed and unpacked (lists, not tuples)."""
    return msgpack.unpackb(msgpack.packb(part.to_header(), use_bin_type=True), raw=False)


def test_a_part_round_trips_through_msgpack_with_sequences_as_tuples_and_nested_parts_built() -> None:
    got = Sample.from_header(_over_msgpack(FULL))
    assert got == FULL and type(got.ids) is tuple and type(got.pairs[0]) is Pair


def test_none_fields_are_left_out_and_absent_ones_take_their_defaults() -> None:
    bare = Sample(1, False, (0, 0), (), {})
    header = bare.to_header()
    assert set(header) == {"count", "flag", "shape", "ids", "sizes", "pairs"}
    assert Sample.from_header(_over_msgpack(bare)) == bare


def test_an_int_is_a_float_and_a_field_the_class_lacks_is_ignored() -> None:
    assert Pair.from_header({"name": "x", "weight": 2, "later": "field"}) == Pair("x", 2.0)


@pytest.mark.parametrize(("changes", "detail"), [
    ({"count": True}, "Sample.count = True"),  # a bool is no int
    ({"count": 1.0}, "Sample.count = 1.0"),
    ({"count": None}, "Sample.count = None"),  # a required field missing
    ({"shape": [2]}, "Sample.shape = [2]"),
    ({"ids": ["a", 1]}, "Sample.ids = 1"),
    ({"ids": "ab"}, "Sample.ids = 'ab'"),
    ({"sizes": {"a": "1"}}, "Sample.sizes = '1'"),
    ({"pairs": [{"weight": 1.0}]}, "Sample.pairs.name = None"),  # the nested part's field, by its path
    ({"first": ["z"]}, "Sample.first = ['z']"),
    ({"count": -1}, "Sample: negative count"),  # the class's own check, after the types
])
def test_a_field_missing_or_of_the_wrong_type_is_named_by_its_path(changes: dict, detail: str) -> None:
    header = {**_over_msgpack(FULL), **changes}
    with pytest.raises(FieldError) as info:
        Sample.from_header(header)
    assert info.value.detail == detail and str(info.value) == detail


def test_a_map_that_is_not_one_is_refused_under_the_given_name() -> None:
    with pytest.raises(FieldError, match=r"^batch\.first = \[1\]$"):
        Pair.from_header([1], "batch.first")


def test_the_field_table_lists_required_fields_then_optional_ones_in_brackets() -> None:
    assert Sample.field_table() == ("count: int, flag: bool, shape: [int, int], ids: [str], sizes: {str: int}, "
                                    "[pairs: [Pair]], [first: Pair], [note: str], [extra: any]")


def test_a_hint_the_wire_cannot_check_is_a_bug_found_at_first_use() -> None:
    @dataclass(frozen=True)
    class Odd(Part):
        values: set[int]

    with pytest.raises(TypeError, match="no wire check"):
        Odd.from_header({"values": [1]})
