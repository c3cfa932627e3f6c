"""Shared test fixtures.

``no_leftover_processes`` runs around every test module: hivemind starts a forked DHT process and a
``p2pd`` daemon per node, and SIGKILL of a parent leaves them running (see shared/HIVEMIND_NOTES.md).
A module that leaves descendants behind fails here (after a short grace period), and the leftovers are
killed so that they do not disturb the next module.
"""

from __future__ import annotations

import os
import time

import psutil
import pytest


def _descendants() -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process(os.getpid()).children(recursive=True) if p.is_running()]
    except psutil.Error:
        return []


# hivemind switches torch to the file_system sharing strategy, which starts one torch_shm_manager per
# test process that lives until the process exits by design; it is not a leak of any test.
_EXPECTED = ("torch_shm_manager",)


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.name() in _EXPECTED:
                continue
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.fixture(autouse=True, scope="module")
def no_leftover_processes():
    before = {p.pid for p in _descendants()}
    yield
    deadline = time.monotonic() + 10.0
    leftovers = []
    while time.monotonic() < deadline:
        leftovers = _alive([p for p in _descendants() if p.pid not in before])
        if not leftovers:
            return
        time.sleep(0.2)
    described = []
    for p in leftovers:
        try:
            described.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            p.kill()
        except psutil.Error:
            pass
    pytest.fail("processes left behind by this test module:\n  " + "\n  ".join(described))
