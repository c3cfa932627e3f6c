"""Pieces every benchmark report shares: the machine it ran on, table cells, smoothed loss curves."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["cell", "machine_info", "machine_ticks", "smooth"]


def cell(x: Any, fmt: str = ".0f") -> str:
    """A markdown table cell: ``x`` formatted with ``fmt``, or ``-`` for a missing value."""
    return "-" if x is None else format(x, fmt)


def smooth(values: list[float], k: int = 3) -> list[float]:
    """Trailing mean over up to ``k`` values (as long as ``values``; the first ones average fewer)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - k + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def machine_ticks() -> list[int]:
    """The machine's CPU clock ticks so far by state (``/proc/stat``'s ``cpu`` line: user, nice, system,
    idle, iowait, irq, softirq, steal, ...); empty where there is no ``/proc/stat``."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return []


def machine_info() -> dict[str, Any]:
    """CPU, cores, memory, torch / hivemind / Python versions and the load average now."""
    import torch

    try:
        import hivemind

        hv = hivemind.__version__
    except ImportError:
        hv = None
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gib": mem,
        "torch": torch.__version__,
        "hivemind": hv,
        "python": platform.python_version(),
        "load_start": " ".join(f"{x:.1f}" for x in os.getloadavg()),
    }
