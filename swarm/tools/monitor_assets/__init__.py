"""The monitor page's markup, style and script, kept as files next to this module (package data).

Why files: the HTML, SVG, CSS and JavaScript read (and diff) as what they are, and the Python that
fills them in stays logic. Templates are :class:`string.Template` (``$name`` placeholders, ``$$`` for
a literal dollar), so the monitor needs nothing beyond the standard library. A template file holds
named snippets, each introduced by a line ``<!-- @name -->`` and running to the next such line; a
snippet's lines are kept as they are (newlines included), its last newline dropped. Values are put
in as given: callers escape text with :func:`esc` (markup they built themselves goes in unescaped).
"""

from __future__ import annotations

import functools
import html
import re
from importlib import resources
from string import Template

__all__ = ["esc", "asset", "snippets"]

_MARKER = re.compile(r"^<!-- @([a-z_]+) -->$", re.MULTILINE)


def esc(value: object) -> str:
    """``value`` as HTML/SVG text or attribute value (quotes escaped too)."""
    return html.escape(str(value), quote=True)


@functools.cache
def asset(name: str) -> str:
    """The text of the file ``name`` in this package (read once)."""
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


@functools.cache
def snippets(name: str) -> dict[str, Template]:
    """The named snippets of the template file ``name`` (see the module docstring)."""
    text = asset(name)
    found = list(_MARKER.finditer(text))
    if not found or text[: found[0].start()].strip():
        raise ValueError(f"{name}: a template file starts with a '<!-- @name -->' line")
    out: dict[str, Template] = {}
    for this, following in zip(found, [*found[1:], None], strict=True):
        end = following.start() if following is not None else len(text)
        body = text[this.end() + 1 : end]
        out[this.group(1)] = Template(body[:-1] if body.endswith("\n") else body)
    return out
