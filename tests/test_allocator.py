"""peer/allocator.py: glibc's thresholds set once per peer process, and left alone where asked.

Each case runs in a fresh interpreter, since ``mallopt`` changes the whole process (so the tier is
"integration": subprocesses, no sockets).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only"
)

# How many blocks glibc serves by mmap, before and after one 24 MiB malloc (mallinfo2: glibc >= 2.33).
_PROBE = """
import ctypes, ctypes.util, json, sys
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
if not hasattr(libc, "mallinfo2"):
    print(json.dumps({"skip": "no mallinfo2"})); sys.exit(0)
libc.mallinfo2.restype = Info
answers = []
if sys.argv[1] == "keep":
    from peer.allocator import keep_freed_memory
    answers = [keep_freed_memory(), keep_freed_memory()]
libc.malloc.restype = ctypes.c_void_p
before = libc.mallinfo2().hblks
block = libc.malloc(24 << 20)
after = libc.mallinfo2().hblks
libc.free(ctypes.c_void_p(block))
print(json.dumps({"answers": answers, "mmapped_blocks_added": after - before}))
"""


def _probe(mode: str, **env: str) -> dict:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "SWARMPIPE_MALLOC"))
    }
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in answer:
        pytest.skip(answer["skip"])
    return answer


@glibc_only
def test_large_blocks_come_from_the_heap_once_set():
    control = _probe("plain")
    assert control["mmapped_blocks_added"] == 1, "glibc's defaults serve a 24 MiB block with mmap"
    kept = _probe("keep")
    first, again = kept["answers"]
    assert "stay mapped" in first and again == first, "set once; a second call repeats the first answer"
    assert kept["mmapped_blocks_added"] == 0


@glibc_only
def test_switch_off_and_user_settings_leave_the_defaults():
    off = _probe("keep", SWARMPIPE_MALLOC="default")
    assert off["answers"][0] == "allocator: the C library's defaults (SWARMPIPE_MALLOC=default)"
    assert off["mmapped_blocks_added"] == 1
    user = _probe("keep", MALLOC_TRIM_THRESHOLD_="1000000")
    assert user["answers"][0] == "allocator: left as set by MALLOC_TRIM_THRESHOLD_"
    assert user["mmapped_blocks_added"] == 1
