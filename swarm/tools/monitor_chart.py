"""The monitor's line charts: inline SVG (markup in ``monitor_assets/chart.svg``), pure and dependency-free.

Drawn on the server so the page is complete without JavaScript and testable without a browser.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from swarm.tools.monitor_assets import esc, snippets
from swarm.tools.status import human

__all__ = ["line_chart_svg", "PALETTE", "MAX_SERIES"]

PALETTE = ("#dc2626", "#2563eb", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777")
MAX_SERIES = len(PALETTE)
_PAD_L, _PAD_R, _PAD_T, _PAD_B = 56, 16, 28, 36


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values covering [lo, hi] (1, 2, 5 times a power of ten apart)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    ticks = []
    t = first
    while t <= hi + step * 1e-9 and len(ticks) < 3 * count:
        ticks.append(round(t, 12))
        t += step
    return ticks


@dataclass(frozen=True)
class _Frame:
    """Data ranges mapped onto the plot area of a ``width`` x ``height`` chart."""

    width: int
    height: int
    x0: float
    x1: float
    y0: float
    y1: float

    @classmethod
    def fit(
        cls, points: list[tuple[float, float]], x_range: tuple[float, float] | None, width: int, height: int
    ) -> _Frame:
        """Ranges covering ``points`` (x: ``x_range`` when given), a flat line widened, y padded by 6%."""
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        x0, x1 = x_range if x_range is not None else (min(xs), max(xs))
        y0, y1 = min(ys), max(ys)
        if x1 <= x0:
            x1 = x0 + 1.0
        if y1 == y0:
            y0, y1 = y0 - max(abs(y0) * 0.05, 1e-3), y1 + max(abs(y1) * 0.05, 1e-3)
        margin = (y1 - y0) * 0.06
        return cls(width, height, x0, x1, y0 - margin, y1 + margin)

    @property
    def plot_w(self) -> int:
        return self.width - _PAD_L - _PAD_R

    @property
    def plot_h(self) -> int:
        return self.height - _PAD_T - _PAD_B

    def sx(self, x: float) -> float:
        return _PAD_L + (x - self.x0) / (self.x1 - self.x0) * self.plot_w

    def sy(self, y: float) -> float:
        return _PAD_T + (1.0 - (y - self.y0) / (self.y1 - self.y0)) * self.plot_h


def _axes(f: _Frame, x_label: str) -> list[str]:
    """Grid lines with y tick labels, x tick labels, the x axis label and the plot's frame."""
    t = snippets("chart.svg")
    parts = []
    for y in _nice_ticks(f.y0, f.y1, 5):
        if f.y0 <= y <= f.y1:
            sy = f"{f.sy(y):.1f}"
            label_y = f"{f.sy(y) + 4:.1f}"
            parts.append(
                t["y_tick"].substitute(
                    left=_PAD_L,
                    right=f.width - _PAD_R,
                    y=sy,
                    label_x=_PAD_L - 6,
                    label_y=label_y,
                    label=esc(human(y)),
                )
            )
    for x in _nice_ticks(f.x0, f.x1, 6):
        if f.x0 <= x <= f.x1:
            parts.append(
                t["x_tick"].substitute(x=f"{f.sx(x):.1f}", y=f.height - _PAD_B + 16, label=esc(human(x)))
            )
    frame = t["frame"].substitute(
        label_x=_PAD_L + f.plot_w / 2,
        label_y=f.height - 4,
        x_label=esc(x_label),
        left=_PAD_L,
        top=_PAD_T,
        width=f.plot_w,
        height=f.plot_h,
    )
    return [*parts, frame]


def _lines(
    f: _Frame, lines: list[tuple[str, list[tuple[float, float]]]], palette: Sequence[str]
) -> list[str]:
    """One polyline per series with a dot on its last point; a legend row each when there are several."""
    t = snippets("chart.svg")
    parts = []
    for i, (label, pts) in enumerate(lines):
        color = palette[i % len(palette)]
        lx, ly = pts[-1]
        parts.append(
            t["line"].substitute(
                points=" ".join(f"{f.sx(x):.1f},{f.sy(y):.1f}" for x, y in pts),
                color=color,
                label=esc(label),
                dot_x=f"{f.sx(lx):.1f}",
                dot_y=f"{f.sy(ly):.1f}",
            )
        )
        if len(lines) > 1:  # legend, top right, one row per line
            y = _PAD_T + 14 + 14 * i
            parts.append(
                t["legend"].substitute(
                    x=f.width - _PAD_R - 118,
                    y=y - 8,
                    color=color,
                    label_x=f.width - _PAD_R - 104,
                    label_y=y - 3,
                    label=esc(label[:18]),
                )
            )
    return parts


def line_chart_svg(
    series: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    *,
    title: str,
    x_label: str,
    x_range: tuple[float, float] | None = None,
    palette: Sequence[str] = PALETTE,
    width: int = 520,
    height: int = 220,
) -> str:
    """An inline SVG chart of named lines ``[(label, [(x, y), ...]), ...]`` (x ascending), round ticks,
    a legend when there are several lines. Non-finite points are left out.
    """
    t = snippets("chart.svg")
    head = t["head"].substitute(width=width, height=height, title=esc(title), left=_PAD_L)
    lines = [
        (label, [(x, y) for x, y in pts if math.isfinite(x) and math.isfinite(y)])
        for label, pts in list(series)[:MAX_SERIES]
    ]
    lines = [(label, pts) for label, pts in lines if pts]
    every = [p for _, pts in lines for p in pts]
    if len(every) < 2:
        message = "waiting for data: trainers publish progress every few seconds"
        empty = t["empty"].substitute(x=width / 2, y=height / 2, message=message)
        return head + empty + t["end"].template
    frame = _Frame.fit(every, x_range, width, height)
    return "".join([head, *_axes(frame, x_label), *_lines(frame, lines, palette), t["end"].template])
