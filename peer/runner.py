"""``run_peer``: run one stage peer in the foreground until Ctrl-C or SIGTERM (what ``swarm peer`` calls).

Prints exactly one line ``peer <peer_id> serving stage <i> of run <run_id>`` (flushed) once the peer
is online, so scripts that start peers as subprocesses can wait for it; a move to another stage
prints ``peer <peer_id> moved to stage <i> of run <run_id>``. A peer that stopped by itself (a
background loop crashed for good, peer/tasks.py) says so on stderr and exits with 1. On a signal the peer announces
``leaving``, drains in-flight work, saves a checkpoint (with ``--checkpoint-dir``) and stops its
averager, DHT and daemon, so no process or socket file is left behind.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import TextIO

from peer.allocator import keep_freed_memory
from peer.config import PeerConfig
from peer.server import StagePeer

__all__ = ["run_peer"]

logger = logging.getLogger(__name__)


async def serve_until_stopped(config: PeerConfig, *, out: TextIO = sys.stdout) -> int:
    """Start a peer, print its online line, and serve until SIGINT/SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    peer = StagePeer(config)
    try:
        await peer.start()
        print(f"peer {peer.peer_id} serving stage {peer.stage} of run {config.run_id}", file=out, flush=True)
        stage = peer.stage
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
            if peer.state == "stopped":  # a background loop crashed for good (peer/loops.py)
                print(
                    f"peer {peer.peer_id} stopped: its background task {peer.crashed!r} crashed (see the log)",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            if peer.state == "online" and peer.stage != stage:
                stage = peer.stage
                print(
                    f"peer {peer.peer_id} moved to stage {stage} of run {config.run_id}", file=out, flush=True
                )
    finally:
        await peer.shutdown()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0


def run_peer(config: PeerConfig) -> int:
    """Blocking: serve ``config``'s run until stopped by a signal; returns the exit code. The process
    keeps freed tensor memory mapped for reuse first (note "allocator", peer/allocator.py)."""
    logger.info(keep_freed_memory())
    return asyncio.run(serve_until_stopped(config))
