"""Shared test fixtures.

``no_leftover_processes`` runs around every test module: hivemind starts a forked DHT process and a
``p2pd`` daemon per node, and SIGKILL of a parent leaves them running (see shared/HIVEMIND_NOTES.md).
A module that leaves descendants behind fails here (after a short grace period), and the leftovers are
killed so that they do not disturb the next module.

The same fixture checks hivemind's unix socket files: every DHT/P2P started through
``swarm.network.start_dht`` in this session (in-process, forked or as a subprocess, which inherit the
environment) names its sockets with the per-session prefix ``SWARMPIPE_SOCKET_PREFIX`` set below, so
a file with that prefix that outlives its module was left behind (e.g. by a P2P never shut down, or
by a SIGKILLed process whose test did not clean up after it). Such files fail the module and are
removed.
"""

from __future__ import annotations

import glob
import os
import time

import psutil
import pytest


def _descendants() -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process(os.getpid()).children(recursive=True) if p.is_running()]
    except psutil.Error:
        return []


SOCKET_PREFIX = f"/tmp/hivemind-t{os.getpid()}-"
os.environ.setdefault("SWARMPIPE_SOCKET_PREFIX", SOCKET_PREFIX)  # read by swarm.network.start_dht
SOCKET_PREFIX = os.environ["SWARMPIPE_SOCKET_PREFIX"]


def _socket_files() -> set[str]:
    return set(glob.glob(glob.escape(SOCKET_PREFIX) + "*.sock"))


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
    sockets_before = _socket_files()
    yield
    deadline = time.monotonic() + 10.0
    leftovers = []
    while time.monotonic() < deadline:
        leftovers = _alive([p for p in _descendants() if p.pid not in before])
        if not leftovers:
            break
        time.sleep(0.2)
    if not leftovers:
        _check_socket_files(sockets_before)
        return
    described = []
    for p in leftovers:
        try:
            described.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            p.kill()
        except psutil.Error:
            pass
    pytest.fail("processes left behind by this test module:\n  " + "\n  ".join(described))


def _check_socket_files(before: set[str]) -> None:
    """Fail (and clean up) if the module left hivemind socket files with this session's prefix."""
    deadline = time.monotonic() + 5.0
    left = _socket_files() - before
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _socket_files() - before
    for path in left:
        try:
            os.remove(path)
        except OSError:
            pass
    if left:
        pytest.fail("hivemind socket files left behind by this test module:\n  " + "\n  ".join(sorted(left)))
