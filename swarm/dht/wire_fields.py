"""Declaring a DHT record once: field rules that both the readers and the DHT nodes enforce.

A record (``swarm/dht/records.py``) is a frozen dataclass whose fields carry a ``Rule`` in their
metadata. From that one declaration come the wire dict (``to_wire``), the reader's check of a value
received from the DHT (``parse_wire``: ``RecordError`` naming the field, the value and the rule), the
coercion of natural local spellings (an int throughput, a list of codecs) and the pydantic v1 model
that hivemind's ``SchemaValidator`` runs in every DHT node before it stores a value. The schema
calls the same check functions as the readers, so the two cannot drift apart: a node stores a value
exactly when its fields pass the reader's field rules (the reader's checks that need context -- run
id, subkey, spec hash -- come on top).

Why pydantic v1 and not a v2 model: hivemind 1.1.12 validates with ``pydantic.v1`` models and compares
the parsed dict with the raw one (docs/HIVEMIND.md), so the schema types here accept a value only as
it is and never convert it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import pydantic.v1 as pydantic

from swarm.errors import RecordError

__all__ = [
    "RECORD_VERSION",
    "MAX_COUNT",
    "Rule",
    "text",
    "choice",
    "count",
    "real",
    "blob",
    "items",
    "WireRecord",
    "v1_value_type",
]

RECORD_VERSION = 1
MAX_COUNT = 1 << 62  # tokens, steps, queue, version: fits msgpack int64 with room


@dataclass(frozen=True)
class Rule:
    """What one wire field must be: ``ok(value)`` and the same rule in words (``want``) for errors."""

    ok: Callable[[object], bool]
    want: str
    nullable: bool = False  # None is allowed (and is the value of a missing field)
    local: Callable[[object], object] = lambda value: value  # the coercion of a locally built value
    wire: Callable[[object], object] = lambda value: value  # the local value as it goes on the wire

    def check(self, name: str, value: object) -> object:
        if value is None and self.nullable:
            return value
        if not self.ok(value):
            raise RecordError(f"field {name!r}={value!r:.60} must be {self.want}")
        return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def text(pattern: re.Pattern | None = None, max_len: int = 128) -> Rule:
    """A non-empty string of at most ``max_len`` characters, all of it matching ``pattern``."""
    want = f"a non-empty string of at most {max_len} chars"
    if pattern is not None:
        want += f" matching {pattern.pattern}"

    def ok(value: object) -> bool:
        return (
            isinstance(value, str)
            and 0 < len(value) <= max_len
            and (pattern is None or pattern.fullmatch(value) is not None)
        )

    return Rule(ok, want)


def choice(options: tuple[str, ...]) -> Rule:
    """One of a few fixed strings."""
    return Rule(lambda value: isinstance(value, str) and value in options, f"one of {options}")


def count(lo: int = 0, hi: int = MAX_COUNT) -> Rule:
    """An integer (not a bool) in ``lo..hi``."""
    hi_text = "2**62" if hi == MAX_COUNT else str(hi)
    return Rule(lambda value: _is_int(value) and lo <= value <= hi, f"an integer in {lo}..{hi_text}")


def _to_float(value: object) -> object:
    return float(value) if _is_int(value) else value


def real(lo: float | None, hi: float | None, what: str, *, nullable: bool = False) -> Rule:
    """A finite float (an int on the wire is a type error; locally it becomes a float) in ``[lo, hi]``."""

    def ok(value: object) -> bool:
        return (
            isinstance(value, float)
            and math.isfinite(value)
            and (lo is None or value >= lo)
            and (hi is None or value <= hi)
        )

    return Rule(ok, what, nullable=nullable, local=_to_float)


def blob(max_len: int, what: str) -> Rule:
    """1..``max_len`` bytes."""
    return Rule(lambda value: isinstance(value, bytes) and 0 < len(value) <= max_len, what)


def items(item: Rule, min_len: int, max_len: int, what: str) -> Rule:
    """A list (a tuple locally) of ``min_len..max_len`` values that each pass ``item``."""

    def ok(value: object) -> bool:
        return isinstance(value, list) and min_len <= len(value) <= max_len and all(map(item.ok, value))

    def local(value: object) -> object:
        return tuple(map(item.local, value)) if isinstance(value, list | tuple) else value

    def wire(value: object) -> object:
        return list(value) if isinstance(value, tuple | list) else value

    return Rule(ok, what, local=local, wire=wire)


@functools.cache
def _rules(cls: type) -> list[tuple[dataclasses.Field, str, Rule]]:
    """(field, wire name, rule) of every field of a record class, in declaration (= wire) order."""
    return [(f, f.metadata.get("wire_name", f.name), f.metadata["rule"]) for f in dataclasses.fields(cls)]


class WireRecord:
    """Base of the records: wire dict, reader check and local coercion, all from the field rules.

    A subclass is a ``@dataclass(frozen=True, kw_only=True)`` whose fields are declared with
    ``field(metadata={"rule": ...})`` (optionally ``"wire_name"`` when the wire key differs) and sets
    ``KIND`` (its name in errors). ``cross_check`` holds the rules that relate fields to each other.
    """

    KIND: ClassVar[str]

    def __post_init__(self) -> None:
        for f, _, rule in _rules(type(self)):
            object.__setattr__(self, f.name, rule.local(getattr(self, f.name)))
        type(self).parse_wire(self.to_wire())

    def to_wire(self) -> dict:
        out: dict[str, Any] = {"v": RECORD_VERSION}
        for f, wire_name, rule in _rules(type(self)):
            out[wire_name] = rule.wire(getattr(self, f.name))
        return out

    @classmethod
    def parse_wire(cls, value: object) -> dict[str, object]:
        """The fields (by attribute name) of a wire value; ``RecordError`` if any rule fails."""
        if not isinstance(value, dict):
            raise RecordError(f"{cls.KIND} value is a {type(value).__name__}, expected a dict")
        version = value.get("v")
        if version != RECORD_VERSION or isinstance(version, bool):
            raise RecordError(
                f"{cls.KIND} has record version {version!r}; this software reads version {RECORD_VERSION}"
            )
        fields = {f.name: rule.check(wire_name, value.get(wire_name)) for f, wire_name, rule in _rules(cls)}
        cls.cross_check(fields)
        return fields

    @classmethod
    def cross_check(cls, fields: dict[str, Any]) -> None:
        """Rules between fields (none by default); raise ``RecordError``."""

    @classmethod
    def v1_schema(cls) -> type[pydantic.BaseModel]:
        """The pydantic v1 model of the record's wire value, for hivemind's ``SchemaValidator``.

        It checks ``v`` only for its type (a newer record version may still be stored; readers skip
        it) and allows unknown fields (newer peers may add some), like the readers.
        """
        fields = {
            wire_name: (v1_value_type(rule, wire_name), None if rule.nullable else ...)
            for _, wire_name, rule in _rules(cls)
        }
        return pydantic.create_model(
            f"{cls.__name__}Schema",
            __module__=cls.__module__,
            __config__=_ValueConfig,
            v=(pydantic.StrictInt, ...),
            **fields,
        )


class _ValueConfig:
    extra = pydantic.Extra.allow


def v1_value_type(rule: Rule, name: str) -> Any:
    """A pydantic v1 field type that runs ``rule`` and returns the value unchanged (no conversion)."""

    class Checked:
        @classmethod
        def __get_validators__(cls):
            yield cls.validate

        @classmethod
        def validate(cls, value: object) -> object:
            return rule.check(name, value)  # RecordError is a ValueError: pydantic reports it

    Checked.__name__ = Checked.__qualname__ = f"Checked_{name}"
    return Optional[Checked] if rule.nullable else Checked  # noqa: UP045 (pydantic v1 reads Optional)
