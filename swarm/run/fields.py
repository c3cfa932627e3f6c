"""Config fields declared once: a field's default, bound and hint live in its dataclass metadata.

The run spec's sections (``swarm/run/spec.py``) and the configs of the commands (``peer/config.py``,
the trainer's, keeper's and demo's) are frozen dataclasses. A field made with :func:`integer`,
:func:`number`, :func:`one_of` or :func:`flag` carries its rule; :func:`check_fields` (called first in
``__post_init__``) applies every rule and stores the normalised value (ints of a float field become
floats, so ``1`` and ``1.0`` hash alike). Only rules that relate several fields stay hand-written.
The CLI reads the same metadata (``swarm/cli/flags.py``), so a default is written once.

Every rejection has one shape, ``<path> = <value> is invalid: <rule>. <next step>``: it names the field,
the value, the rule and what to do (:func:`reject`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swarm.errors import ConfigError

__all__ = [
    "Rule",
    "reject",
    "check_int",
    "check_float",
    "check_choice",
    "check_bool",
    "integer",
    "number",
    "one_of",
    "flag",
    "rule_of",
    "check_fields",
]

RULE = "rule"  # the metadata key of a field's Rule


def reject(path: str, value: Any, rule: str, next_step: str) -> ConfigError:
    """Build the error for one rejected value: ``<path> = <value> is invalid: <rule>. <next step>``."""
    shown = repr(value)
    if len(shown) > 120:
        shown = shown[:117] + "..."
    return ConfigError(f"{path} = {shown} is invalid: {rule}. {next_step}")


def check_int(path: str, value: Any, *, lo: int | None = None, hi: int | None = None, hint: str) -> int:
    """An int (bools are rejected: `True` as a layer count is always a mistake) within [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise reject(path, value, f"it must be an integer, not {type(value).__name__}", hint)
    if lo is not None and value < lo:
        raise reject(path, value, f"it must be >= {lo}", hint)
    if hi is not None and value > hi:
        raise reject(path, value, f"it must be <= {hi}", hint)
    return value


def check_float(
    path: str,
    value: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    hint: str,
) -> float:
    """A finite real number within the given bounds, returned as ``float`` (so 1 and 1.0 hash alike)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise reject(path, value, f"it must be a number, not {type(value).__name__}", hint)
    value = float(value)
    if not math.isfinite(value):
        raise reject(path, value, "it must be a finite number", hint)
    if gt is not None and not value > gt:
        raise reject(path, value, f"it must be > {gt}", hint)
    if ge is not None and not value >= ge:
        raise reject(path, value, f"it must be >= {ge}", hint)
    if lt is not None and not value < lt:
        raise reject(path, value, f"it must be < {lt}", hint)
    if le is not None and not value <= le:
        raise reject(path, value, f"it must be <= {le}", hint)
    return value


def check_choice(path: str, value: Any, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise reject(
            path, value, f"it must be one of {', '.join(choices)}", f"Set {path} to one of those values."
        )
    return value


def check_bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise reject(path, value, "it must be true or false", f"Set {path} to true or false.")
    return value


@dataclass(frozen=True)
class Rule:
    """The rule of one field: what ``kind`` of value, its bounds or choices, and the hint of its errors.

    ``optional``: None is a valid value (left unchecked). ``bounds`` are ``lo``/``hi`` of an integer or
    ``gt``/``ge``/``lt``/``le`` of a number.
    """

    kind: str  # "int" | "float" | "choice" | "bool"
    hint: str = ""
    optional: bool = False
    bounds: tuple[tuple[str, Any], ...] = ()
    choices: tuple[str, ...] = ()

    def check(self, path: str, value: Any) -> Any:
        if value is None and self.optional:
            return None
        if self.kind == "int":
            return check_int(path, value, hint=self.hint, **dict(self.bounds))
        if self.kind == "float":
            return check_float(path, value, hint=self.hint, **dict(self.bounds))
        if self.kind == "choice":
            return check_choice(path, value, self.choices)
        return check_bool(path, value)

    def describe(self) -> str:
        """The rule in a few words, for help texts: ``>= 1``, ``> 0, <= 10``, ``one of a, b``."""
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        words = {"lo": ">=", "hi": "<=", "gt": ">", "ge": ">=", "lt": "<", "le": "<="}
        return ", ".join(f"{words[k]} {v}" for k, v in self.bounds)


def _field(rule: Rule, default: Any, metadata: dict[str, Any] | None, **kw: Any) -> Any:
    meta = {RULE: rule, **(metadata or {})}
    if isinstance(default, (list, dict, set)):
        raise TypeError("give a mutable default as default_factory")
    return dataclasses.field(default=default, metadata=meta, **kw)


def _bounds(**given: Any) -> tuple[tuple[str, Any], ...]:
    return tuple((k, v) for k, v in given.items() if v is not None)


def integer(
    default: Any = dataclasses.MISSING,
    *,
    lo: int | None = None,
    hi: int | None = None,
    hint: str = "",
    optional: bool = False,
    metadata: dict[str, Any] | None = None,
    **kw: Any,
) -> Any:
    """A dataclass field holding an integer in ``lo..hi`` (None too when ``optional``)."""
    return _field(Rule("int", hint, optional, _bounds(lo=lo, hi=hi)), default, metadata, **kw)


def number(
    default: Any = dataclasses.MISSING,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    hint: str = "",
    optional: bool = False,
    metadata: dict[str, Any] | None = None,
    **kw: Any,
) -> Any:
    """A dataclass field holding a finite number, stored as a float (None too when ``optional``)."""
    return _field(Rule("float", hint, optional, _bounds(gt=gt, ge=ge, lt=lt, le=le)), default, metadata, **kw)


def one_of(
    choices: Sequence[str],
    default: Any = dataclasses.MISSING,
    *,
    metadata: dict[str, Any] | None = None,
    **kw: Any,
) -> Any:
    """A dataclass field holding one of ``choices``."""
    return _field(Rule("choice", choices=tuple(choices)), default, metadata, **kw)


def flag(default: Any = dataclasses.MISSING, *, metadata: dict[str, Any] | None = None, **kw: Any) -> Any:
    """A dataclass field holding True or False."""
    return _field(Rule("bool"), default, metadata, **kw)


def rule_of(f: dataclasses.Field) -> Rule | None:
    """The rule of a field made by this module, else None."""
    return f.metadata.get(RULE)


def check_fields(obj: Any, section: str = "", *, only: Sequence[str] | None = None) -> None:
    """Apply every field rule of the frozen dataclass ``obj`` and store the normalised values.

    ``section`` prefixes the paths in errors (``optimizer`` -> ``optimizer.lr``); ``only`` restricts the
    check to these fields, in this order (for sections whose cross-field rules must come in between).
    """
    by_name = {f.name: f for f in dataclasses.fields(obj)}
    for name in only if only is not None else by_name:
        rule = rule_of(by_name[name])
        if rule is not None:
            path = f"{section}.{name}" if section else name
            object.__setattr__(obj, name, rule.check(path, getattr(obj, name)))
