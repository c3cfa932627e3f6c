"""How a stage peer's process keeps freed tensor memory for reuse (note "allocator").

torch allocates CPU tensors with the C library's ``malloc``. glibc serves a block above its *mmap
threshold* (128 KiB at first, raised as such blocks are freed) with a fresh ``mmap`` and gives it back
with ``munmap`` when the tensor dies, and it returns the free top of a heap to the system once it
exceeds the *trim threshold*. A stage peer allocates and frees the same large blocks all the time: a
new copy of every parameter at each optimizer step (weight stashing: the old version stays for
in-flight backwards, swarm/run/optimizer.py), a parameter gradient per micro-batch, the activations
of every micro-batch in flight. With the defaults, many of those blocks are fresh pages each time:
the kernel zeroes and maps them on first touch (a minor page fault per 4 KiB page), which on
``examples/bench.yaml``'s stage 0 made a step's parameter copy cost about 3x a write into memory
already mapped (``torch.profiler``: ``copy_`` of a 3 MiB parameter 1.05 ms, ``fill_`` of its
gradient 0.3 ms).

:func:`keep_freed_memory` sets both thresholds once per process (``mallopt``), so blocks up to
``MMAP_THRESHOLD`` come from the heap and freed memory stays mapped for the next tensor of that size;
the process's resident memory then stays near its peak instead of falling between steps. It changes
nothing where the C library is not glibc (macOS, musl), where the user has set glibc's own variables
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or ``GLIBC_TUNABLES``), or with
``SWARMPIPE_MALLOC=default``. CUDA tensors have torch's caching allocator and are not affected.
BENCHMARKS.md ("Where the cycles go", session 18) has what it changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest allowed value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 256 * 1024 * 1024
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
_done: str | None = None


def keep_freed_memory() -> str:
    """Set glibc's mmap and trim thresholds for this process (once; later calls repeat the first
    answer). Returns what was done, one line for the peer's log."""
    global _done
    if _done is None:
        _done = _apply()
    return _done


def _apply() -> str:
    if os.environ.get("SWARMPIPE_MALLOC", "").strip().lower() == "default":
        return "allocator: the C library's defaults (SWARMPIPE_MALLOC=default)"
    user = [name for name in _USER_SETTINGS if name in os.environ]
    if user:
        return f"allocator: left as set by {', '.join(user)}"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"allocator: the C library's defaults ({platform.system()}, not glibc)"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    ok = (
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    )
    if not ok:  # glibc refuses out-of-range values and changes nothing then
        return "allocator: glibc refused the thresholds; the defaults stay"
    return (
        f"allocator: freed blocks up to {MMAP_THRESHOLD >> 20} MiB stay mapped for reuse "
        f"(glibc mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB)"
    )
