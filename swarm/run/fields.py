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
import difflib
import math
from collections.abc import Mapping, Sequence
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


# ---- what the spec's canonical bytes hold, and reading sections from plain dicts

OMIT_IF_NONE = "omit_if_none"
"""Field metadata key: a field whose value is None is left out of ``to_plain`` (and so of a spec's
canonical bytes and hash). Used for options added after runs existed, so that a spec that does not use
the option keeps the hash it had before the option was added."""
OMIT_IF_DEFAULT = "omit_if_default"
"""Same for a field whose value equals its default (a flag added later, e.g. ``model.tie_embeddings``)."""
OMIT_NONE = {OMIT_IF_NONE: True}
OMIT_DEFAULT = {OMIT_IF_DEFAULT: True}


def set_field(obj: Any, name: str, value: Any) -> None:
    """Store a normalised value on a frozen dataclass during ``__post_init__`` (and only then)."""
    object.__setattr__(obj, name, value)


def take_keys(section: str, data: Any, cls: type) -> dict[str, Any]:
    """Check a section's keys against ``cls``'s fields: unknown keys and missing required ones fail."""
    where = section or "the run spec"
    if not isinstance(data, Mapping):
        raise reject(
            section or "spec", data, f"{where} must be a mapping of keys to values", "Check the spec file."
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    valid = sorted(fields)
    unknown = [k for k in data if k not in fields]
    if unknown:
        prefix = f"{section}." if section else ""
        close = difflib.get_close_matches(str(unknown[0]), valid, n=1)
        suggestion = f" Did you mean {prefix}{close[0]}?" if close else ""
        names = ", ".join(f"{prefix}{k}" for k in unknown)
        raise ConfigError(
            f"unknown key(s) {names} in {where}.{suggestion} Valid keys{' of ' + section if section else ''} "
            f"are: {', '.join(valid)}."
        )
    missing = [
        name
        for name, f in fields.items()
        if name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        prefix = f"{section}." if section else ""
        raise ConfigError(
            f"{where} is missing required key(s) {', '.join(prefix + m for m in missing)}. "
            "See examples/tiny.yaml for a complete spec."
        )
    return dict(data)


def to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: to_plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not (f.metadata.get(OMIT_IF_NONE) and getattr(value, f.name) is None)
            and not (f.metadata.get(OMIT_IF_DEFAULT) and getattr(value, f.name) == f.default)
        }
    if isinstance(value, (tuple, list)):
        return [to_plain(v) for v in value]
    return value
