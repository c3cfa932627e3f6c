"""Command-line flags made from config fields, so a flag's default, type and help are written once.

A command lists its flags as :class:`Flag` rows (field name, flag spelling, and only what the config
cannot say: a metavar, an alias, a CLI-only default); :func:`add_flags` reads the rest from the
config dataclass: the default from the field, the type and choices from its rule
(``swarm/run/fields.py``), ``store_true`` for a bool, ``required`` for a field without default, and
the help from the field's docstring (the string right below it in the class body, read with ``ast``).
:func:`flag_values` turns the parsed namespace back into the config's keyword arguments.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from swarm.run.fields import rule_of

__all__ = ["Flag", "add_flags", "flag_values", "field_docs"]

_UNSET: Any = object()


@dataclass(frozen=True)
class Flag:
    """One flag of a config field. Everything left unset comes from the field."""

    field: str  # the config field the flag sets
    name: str  # its spelling, e.g. "--max-queue"
    aliases: tuple[str, ...] = ()  # older spellings still accepted, e.g. ("--dir",)
    dest: str | None = None  # attribute on the namespace (default: the field name)
    metavar: str | None = None
    help: str | None = None  # replaces the docstring's first sentence (flags that invert a field)
    default: Any = _UNSET  # a CLI default other than the field's (None = "the config decides")
    const: Any = _UNSET  # a flag without a value that stores this, e.g. --no-rebalance -> False
    nargs: str | None = None  # "+" for tuple fields
    choices: Sequence[str] | None = None
    type: Any = None  # for fields without a rule, e.g. int for an optional integer

    @property
    def attr(self) -> str:
        return self.dest or self.field


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring (the string literal right after the field in the class body)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (e.g. a frozen binary): flags then have no help text
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = after.value.value
    return docs


def _first_sentence(doc: str) -> str:
    """The docstring's first sentence as plain help text (no RST quotes; '%' escaped for argparse)."""
    text = " ".join(doc.split()).replace("``", "`")
    match = re.search(r"\.(\s|$)", text)
    sentence = text[: match.start()] if match else text
    return sentence.replace("%", "%%")


def _help(flag: Flag, f: dataclasses.Field, default: Any, docs: dict[str, str]) -> str:
    text = flag.help if flag.help is not None else _first_sentence(docs.get(f.name, ""))
    shown = default if flag.const is _UNSET and default is not _UNSET else None
    if shown is not None and not isinstance(shown, bool) and shown != () and "(default" not in text:
        text += f" (default {shown})"
    return text


def _type_of(default: Any) -> type | None:
    """int or float for a field without a rule whose default is one (e.g. ``DataConfig.max_bytes``)."""
    return type(default) if type(default) in (int, float) else None


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, config: type, flags: Iterable[Flag]
) -> None:
    """Add one argparse option per ``Flag``, its default, type, choices and help taken from ``config``."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    docs = field_docs(config)
    for flag in flags:
        f = fields[flag.field]
        field_default = f.default if f.default is not dataclasses.MISSING else _UNSET
        default = flag.default if flag.default is not _UNSET else field_default
        kwargs: dict[str, Any] = {"dest": flag.attr, "help": _help(flag, f, default, docs)}
        if default is _UNSET:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        rule = rule_of(f)
        if flag.const is not _UNSET:
            kwargs.update(action="store_const", const=flag.const)
        elif (rule is not None and rule.kind == "bool") or isinstance(field_default, bool):
            if default is not False:
                raise TypeError(f"--{flag.field}: a bool flag defaults to False; give const= to invert it")
            kwargs["action"] = "store_true"
        else:
            kind = rule.kind if rule is not None else None
            kwargs["type"] = flag.type or {"int": int, "float": float}.get(kind) or _type_of(field_default)
            kwargs["choices"] = flag.choices or (rule.choices if kind == "choice" else None)
            kwargs["metavar"] = flag.metavar
            if flag.nargs is not None:
                kwargs["nargs"] = flag.nargs
        parser.add_argument(flag.name, *flag.aliases, **{k: v for k, v in kwargs.items() if v is not None})


def flag_values(args: argparse.Namespace, flags: Iterable[Flag]) -> dict[str, Any]:
    """The config keyword arguments the parsed ``flags`` give (tuples for ``nargs`` flags)."""
    out = {}
    for flag in flags:
        value = getattr(args, flag.attr)
        out[flag.field] = tuple(value) if flag.nargs is not None and value is not None else value
    return out
