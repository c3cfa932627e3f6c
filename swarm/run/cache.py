"""Where this machine keeps what it caches for runs (measured throughputs, run tokenizers).

Imports nothing of ours.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_cache_dir"]


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/swarmpipe`` or ``~/.cache/swarmpipe``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "swarmpipe"
