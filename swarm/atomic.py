"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["atomic_torch_save"]


def atomic_torch_save(payload: Any, path: Path, *, prefix: str = ".tmp-") -> Path:
    """``torch.save`` to a temporary file next to ``path``, fsync it and rename it over ``path``."""
    import torch

    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
