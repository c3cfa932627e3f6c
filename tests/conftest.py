"""Shared test fixtures, and the test tiers.

Tiers (README, "Tests"): a test marked ``integration`` (directly, by its module's ``pytestmark``, or
through ``slow``, which implies it) starts real peers, DHT nodes, servers or subprocesses on
loopback; every other test is marked ``unit`` here, and ``unit_tests_stay_in_process`` holds it to
that: binding or connecting a socket, or starting a subprocess, fails the test with a hint to mark it
``integration``. ``make test-fast`` runs ``-m unit``.

``no_leftover_processes`` runs around every test module: hivemind starts a forked DHT process and a
``p2pd`` daemon per node, and SIGKILL of a parent leaves them running (see docs/HIVEMIND.md, "Processes").
A module that leaves descendants behind fails here (after a short grace period), and the leftovers are
killed so that they do not disturb the next module.

The same fixture checks hivemind's unix socket files: every DHT/P2P started through
``swarm.dht.network.start_dht`` in this session (in-process, forked or as a subprocess, which inherit the
environment) names its sockets with the per-session prefix ``SWARMPIPE_SOCKET_PREFIX`` set below, so
a file with that prefix that outlives its module was left behind (e.g. by a P2P never shut down, or
by a SIGKILLed process whose test did not clean up after it). Files still listened on (a P2P left
open) fail the module; stale ones (their process was SIGKILLed) are removed with a warning.
"""

from __future__ import annotations

import glob
import os
import platform
import socket
import subprocess
import time
import warnings

import psutil
import pytest


def _descendants() -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process(os.getpid()).children(recursive=True) if p.is_running()]
    except psutil.Error:
        return []


SOCKET_PREFIX = f"/tmp/hivemind-t{os.getpid()}-"
os.environ.setdefault("SWARMPIPE_SOCKET_PREFIX", SOCKET_PREFIX)  # read by swarm.dht.network.start_dht
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


def _listened_on(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
            return True
        except OSError:  # ConnectionRefusedError: nobody listens (its process is gone)
            return False


def _check_socket_files(before: set[str]) -> None:
    """Fail if the module left hivemind socket files with this session's prefix that a process of
    ours still listens on (a P2P never shut down); remove stale ones and warn about them.

    Stale files (nobody listens) are what a SIGKILLed process leaves: it cannot remove its own. A
    test that SIGKILLs should remove them (see tests/test_chaos.py); the fixture cleans up the rest
    and names them in a warning rather than failing, since their owner is gone for good.
    """
    deadline = time.monotonic() + 5.0
    left = _socket_files() - before
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _socket_files() - before
    live = sorted(p for p in left if _listened_on(p))
    for path in left:
        try:
            os.remove(path)
        except OSError:
            pass
    stale = sorted(set(left) - set(live))
    if stale:
        warnings.warn(
            f"removed {len(stale)} stale hivemind socket files (their processes were killed):\n  "
            + "\n  ".join(stale),
            stacklevel=1,
        )
    if live:
        pytest.fail("hivemind socket files left open by this test module:\n  " + "\n  ".join(live))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("integration") is not None:
            continue
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.integration)
        else:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(autouse=True)
def unit_tests_stay_in_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """A ``unit`` test that binds or connects a socket or starts a subprocess fails (see the docstring)."""
    if request.node.get_closest_marker("unit") is not None:

        def refuse(what: str):
            def refused(*args, **kwargs):
                raise AssertionError(
                    f"a unit test {what}: mark it @pytest.mark.integration (tiers: tests/conftest.py)"
                )

            return refused

        platform.processor()  # runs `uname -p` once per process (then cached): not the test's subprocess
        monkeypatch.setattr(socket.socket, "bind", refuse("binds a socket"))
        monkeypatch.setattr(socket.socket, "connect", refuse("connects a socket"))
        monkeypatch.setattr(socket.socket, "connect_ex", refuse("connects a socket"))
        monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse("starts a subprocess"))
    yield
