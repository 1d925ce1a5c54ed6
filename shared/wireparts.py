"""Typed msgpack maps: the dataclass base of shared/wire.py's messages.

A :class:`Part` is a dataclass carried as a msgpack map of its fields by name. On the way in
each field is checked against its type hint (``type() is``: msgpack builds plain types, and a
bool is no int), sequences become tuples and nested parts are built from their maps; a field
missing, of the wrong type or out of range raises :class:`FieldError` naming it. The same
hints give the fields as the wire module's docstring table writes them (:meth:`Part.field_table`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Callable, ClassVar, TypeVar

_Check = Callable[[str, Any], Any]


class FieldError(ValueError):
    """A received map's field missing, of the wrong type or out of range; ``detail`` names the
    field by its path (``lease.ids = 'ab'``). shared/wire.py reports it as ``bad_field``."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    @classmethod
    def of(cls, where: str, value: Any) -> FieldError:
        """The field at ``where`` holds ``value``, which it may not."""
        return cls(f"{where} = {value!r}"[:200])


def _scalar(expected: type) -> _Check:
    """``type() is``: msgpack builds plain types, and a bool is no int; an int is a float."""
    def check(where: str, value: Any) -> Any:
        if type(value) is expected:
            return value
        if expected is float and type(value) is int:
            return float(value)
        raise FieldError.of(where, value)
    return check


def _any(where: str, value: Any) -> Any:
    return value


def _checker(annotation: Any) -> _Check:
    """The check (and conversion: list -> tuple) of a field of this type hint."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return _any
    if annotation in (int, float, str, bool):
        return _scalar(annotation)
    if origin in (typing.Union, types.UnionType):  # X | None: the None is the field's absence
        (inner,) = [a for a in args if a is not type(None)]
        return _checker(inner)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _checker(args[0])

        def sequence(where: str, value: Any) -> tuple[Any, ...]:
            if type(value) is not list:
                raise FieldError.of(where, value)
            return tuple([item(where, x) for x in value])
        return sequence
    if origin is tuple:
        items = [_checker(a) for a in args]

        def fixed(where: str, value: Any) -> tuple[Any, ...]:
            if type(value) is not list or len(value) != len(items):
                raise FieldError.of(where, value)
            return tuple([check(where, x) for check, x in zip(items, value)])
        return fixed
    if origin is dict:
        key, item = _checker(args[0]), _checker(args[1])

        def mapping(where: str, value: Any) -> dict[Any, Any]:
            if type(value) is not dict:
                raise FieldError.of(where, value)
            return {key(where, k): item(where, v) for k, v in value.items()}
        return mapping
    if isinstance(annotation, type) and hasattr(annotation, "from_header"):
        return lambda where, value: annotation.from_header(value, where)
    raise TypeError(f"no wire check for {annotation!r}")  # a message class's bug


def _header_value(value: Any) -> Any:
    """A field's value as msgpack packs it (a nested part as its map)."""
    if hasattr(value, "to_header"):
        return value.to_header()
    if type(value) is tuple and value and hasattr(value[0], "to_header"):
        return [v.to_header() for v in value]
    return value


def _type_name(annotation: Any) -> str:
    """A field's type as shared/wire.py's docstring table writes it."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return "any"
    if origin in (typing.Union, types.UnionType):
        return _type_name(next(a for a in args if a is not type(None)))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"[{_type_name(args[0])}]"
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    if origin is dict:
        return f"{{{_type_name(args[0])}: {_type_name(args[1])}}}"
    return annotation.__name__


_PartT = TypeVar("_PartT", bound="Part")


class Part:
    """A dataclass carried as a msgpack map: its fields by name, each checked for its type on
    the way in (``_fields``: name, check, whether it may be absent, its default)."""

    _fields: ClassVar[list[tuple[str, _Check, bool, Any]]]

    @classmethod
    def _spec(cls) -> list[tuple[str, _Check, bool, Any]]:
        if "_fields" not in cls.__dict__:
            hints = typing.get_type_hints(cls)
            spec = []
            for f in dataclasses.fields(cls):  # type: ignore[arg-type]
                has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
                default = f.default if f.default is not dataclasses.MISSING else (
                    f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
                spec.append((f.name, _checker(hints[f.name]), has_default, default))
            cls._fields = spec
        return cls._fields

    def to_header(self) -> dict[str, Any]:
        """The fields as a msgpack map; those None are left out."""
        out = {}
        for name, *_ in self._spec():
            value = getattr(self, name)
            if value is not None:
                out[name] = _header_value(value)
        return out

    @classmethod
    def from_header(cls: type[_PartT], fields: Any, where: str = "") -> _PartT:
        """The part from a received map: FieldError for a field missing or of the wrong type (a
        field this class lacks is ignored), then the class's own checks."""
        where = where or getattr(cls, "KIND", cls.__name__)
        if type(fields) is not dict:
            raise FieldError.of(where, fields)
        values = {}
        try:  # the checks name only the field: formatting "kind.field" for every field costs microseconds
            for name, check, optional, default in cls._spec():
                value = fields.get(name)
                if value is None:
                    if not optional:
                        raise FieldError.of(name, value)
                    values[name] = default
                else:
                    values[name] = check(name, value)
        except FieldError as exc:
            raise FieldError(f"{where}.{exc.detail}"[:200]) from None
        part = cls(**values)
        problem = part.problem()
        if problem:
            raise FieldError(f"{where}: {problem}"[:200])
        return part

    def problem(self) -> str:
        """What is wrong with these values beyond their types (ranges, sizes); "" if nothing."""
        return ""

    @classmethod
    def field_table(cls) -> str:
        """The fields as shared/wire.py's docstring table lists them: ``name: type``, optional ones
        in brackets, after the required ones."""
        hints = typing.get_type_hints(cls)
        required, optional = [], []
        for name, _, absent_ok, _ in cls._spec():
            text = f"{name}: {_type_name(hints[name])}"
            (optional if absent_ok else required).append(f"[{text}]" if absent_ok else text)
        return ", ".join(required + optional)
