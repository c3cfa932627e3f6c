"""Process hygiene for command-line entry points: nothing of ours outlives a ``swarm`` command.

Why this exists: hivemind runs each DHT and averager in a forked child (plus a ``p2pd`` daemon).
Those children inherit the parent's Python signal handlers (asyncio's handlers write to the
parent's wake-up socket), so a SIGTERM sent to the whole process group -- ``kill -TERM -PGID``,
a service manager, a container stop -- does not stop them; when their graceful shutdown then
stalls because ``p2pd`` is already gone, multiprocessing's exit hook joins them forever and the
command never exits. After a command has shut down cleanly, :func:`reap_children` gives whatever
is left a grace period and then kills it.

A SIGKILLed process cannot stop its children at all: :func:`exit_with_parent` runs in each hivemind
child we start (the DHT process and the averager, see ``swarm.dht.network.start_dht`` and
``peer.averaging``) and, once its parent is gone, kills the child's own descendants (``p2pd``) and
exits, so nothing is left behind with parent 1 (Linux and macOS: it watches ``os.getppid()``).

A SIGKILLed process cannot remove its hivemind unix socket files either; whoever killed it can, with
:func:`remove_stale_sockets` over the socket prefix its processes were given (``swarm.dht.network``'s
``SWARMPIPE_SOCKET_PREFIX``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType

import psutil

__all__ = [
    "alive_in_groups",
    "child_socket_prefix",
    "exit_with_parent",
    "reap_children",
    "remove_stale_sockets",
    "terminate_as_interrupt",
]

# torch's shared-memory manager exits on its own when its parent does.
SOCKET_PREFIX_ENV = "SWARMPIPE_SOCKET_PREFIX"
"""Environment variable naming the prefix of hivemind's unix socket files (``swarm.dht.network`` applies it)."""

_SELF_EXITING = ("torch_shm_manager",)


def alive_in_groups(pgids: Iterable[int]) -> list[int]:
    """Live processes (not zombies) of these process groups: their pids from /proc on Linux, and
    elsewhere the groups the kernel still knows (``killpg(pgid, 0)``)."""
    groups = set(pgids)
    if not groups:
        return []
    alive: list[int] = []
    if not os.path.isdir("/proc"):
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, 0)
                alive.append(pgid)
        return alive
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after the last ')'
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in groups and fields[0] not in ("Z", "X"):
            alive.append(int(entry))
    return alive


def exit_with_parent(poll_s: float = 0.5) -> threading.Thread:
    """Call first thing in a forked child: a daemon thread that notices the parent's death (this process
    is re-parented) within ``poll_s``, SIGKILLs this process's descendants and exits with status 1."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        os._exit(1)

    thread = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    thread.start()
    return thread


def reap_children(grace_s: float = 5.0) -> list[str]:
    """Wait up to ``grace_s`` for this process's descendants to exit, then SIGKILL the rest.

    Returns a description of each process that had to be killed. Only call it from a process's own
    entry point (never inside a library or a test process that owns other live children).
    """
    try:
        procs = [p for p in psutil.Process().children(recursive=True) if p.name() not in _SELF_EXITING]
    except psutil.Error:
        return []
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    killed = []
    for p in alive:
        try:
            killed.append(f"{p.pid} {p.name()}")
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=2.0)
    return killed


def child_socket_prefix(tag: str) -> str:
    """A hivemind socket-file prefix for the processes this one starts (``SWARMPIPE_SOCKET_PREFIX`` of their
    environment), under this process's own prefix if it has one, so that a test session still sees
    the files: the starter can then :func:`remove_stale_sockets` of what it killed, and only that."""
    base = os.environ.get(SOCKET_PREFIX_ENV) or "/tmp/swarmpipe-"
    return f"{base}{tag}{os.getpid()}-"


def remove_stale_sockets(prefix: str) -> list[str]:
    """Remove the ``PREFIX*.sock`` files that nobody listens on any more; return their paths.

    Those are what a SIGKILLed hivemind process (p2pd or a P2P client) leaves: a live process keeps
    listening on its own, so a live peer's files are never touched.
    """
    removed = []
    listening = _listening_unix_paths()
    for path in sorted(glob.glob(glob.escape(prefix) + "*.sock")):
        if path in listening:
            # listed as listening: no probe. A connection that sends nothing makes hivemind's P2P client
            # log an ERROR traceback ("Unhandled exception in client_connected_cb") in the live process.
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(path)
                continue  # somebody listens: a live process's socket
            except ConnectionRefusedError:  # a file without a listener: its process is gone
                pass
            except OSError:  # not a socket we can judge (permissions, vanished): leave it
                continue
        try:
            os.remove(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def _listening_unix_paths() -> set[str]:
    """Paths of the listening Unix sockets of this network namespace (Linux ``/proc/net/unix``; empty
    elsewhere). A file not listed is probed by connecting (its listener may live in another namespace)."""
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
            return listening_paths(f.read())
    except OSError:
        return set()


def listening_paths(proc_net_unix: str) -> set[str]:
    """The listening socket paths in the text of ``/proc/net/unix``."""
    paths = set()
    for line in proc_net_unix.splitlines()[1:]:
        # Num RefCount Protocol Flags Type St Inode Path; flag 0x10000 (__SO_ACCEPTCON) = listening
        parts = line.split(maxsplit=7)
        if len(parts) == 8:
            with contextlib.suppress(ValueError):
                if int(parts[3], 16) & 0x10000:
                    paths.add(parts[7])
    return paths


def terminate_as_interrupt(
    signals: Iterable[signal.Signals] = (signal.SIGTERM,),
) -> dict[int, Callable[..., object] | int | None]:
    """Make ``signals`` (default SIGTERM) raise ``KeyboardInterrupt``, so ``finally`` blocks shut down
    cleanly; returns the previous handlers, to restore with ``signal.signal``. Does nothing (returns {})
    outside the main thread, where Python cannot handle signals, and on Windows.

    Commands that install their own asyncio signal handlers override this while they run. Passing
    SIGINT as well makes ``asyncio.run`` leave Ctrl-C alone: its own handling first only *cancels* the
    main task, and a cancellation swallowed anywhere below (Python 3.11's ``asyncio.wait_for`` can
    lose one when the awaited call finishes at the same moment) would let the program go on.
    """

    def _handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    if sys.platform == "win32" or threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _handler) for sig in signals}
