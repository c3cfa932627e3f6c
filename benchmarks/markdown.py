"""``BENCHMARKS.md``: each benchmark owns one ``## `` section and rewrites only that one."""

from __future__ import annotations

from pathlib import Path

MARKDOWN = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def write_section(section: str, path: Path = MARKDOWN) -> None:
    """Replace the section whose title is ``section``'s first line (or append it); the file is read right
    before writing, so that other sections, also ones another benchmark just rewrote, are kept as they are."""
    title = section.split("\n", 1)[0].rstrip()
    if not title.startswith("## "):
        raise ValueError(f"a section starts with its '## ' title line, not {title[:60]!r}")
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.rstrip("\n").split("\n")
    if title in lines:
        start = lines.index(title)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[start:end] = section.rstrip("\n").split("\n") + ([""] if end < len(lines) else [])
        text = "\n".join(lines) + "\n"
    else:
        text = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    path.write_text(text)
