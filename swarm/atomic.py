"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Note "write-once files": what goes through here (a stage peer's checkpoint, a keeper's snapshot) is
written once and read only after a restart, so once it is on disk its pages are dropped from the page
cache (``posix_fadvise(DONTNEED)``, where the OS has it). Keeping them would evict the cache of files
that are read, and a long run writes gigabytes of them. On a machine where a new page-cache page is
dear it also makes the next write cheap: it reuses the pages just freed. On the 2-core VM of
BENCHMARKS.md a 77 MB snapshot cost 0.50-0.70 CPU s while the cache kept every file and 0.02-0.04 s
once the pages were dropped (``python -m benchmarks.snapshot_write``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["atomic_torch_save", "drop_cached_pages"]


def drop_cached_pages(fd: int) -> bool:
    """Ask the OS to drop the page cache of the file open as ``fd`` (its data must be on disk: after
    ``fsync``). A hint: False where the OS has no ``posix_fadvise`` (macOS, Windows) or refuses it."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return False
    try:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    return True


def atomic_torch_save(payload: Any, path: Path, *, prefix: str = ".tmp-", drop_cache: bool = True) -> Path:
    """``torch.save`` to a temporary file next to ``path``, fsync it, drop its cached pages (note
    "write-once files"; ``drop_cache=False`` keeps them) and rename it over ``path``."""
    import torch

    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
            if drop_cache:
                drop_cached_pages(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
