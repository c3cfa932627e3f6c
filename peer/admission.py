"""Admission control: which requests a stage peer lets in, and how many of whose it holds.

Two doors. The access gate runs on a request's header before a byte of its payload is read
(``serve(gate=...)`` in ``swarm/wire/protocol.py``): senders in the penalty box (poison gradients)
and, in a private run, senders without a valid join proof or on the run's lists are refused there.
A validated request then enters the compute queue under two caps: the sender's own
(``SenderLimiter``: one sender cannot fill the queue) and the queue's (``ComputeQueue``: ``busy``
when full), so a sender learns at once that it must route elsewhere (backpressure).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from peer.config import PeerConfig
from peer.runtime import ComputeQueue
from swarm.dht.auth import AuthError, PenaltyBox
from swarm.errors import ConfigError, RequestError

__all__ = ["Admission", "SenderLimiter"]

logger = logging.getLogger(__name__)


class Admission:
    """The access gate and the queue caps of one peer; ``open`` it once the peer knows its run."""

    def __init__(self, config: PeerConfig, counters: dict[str, int]):
        self._counters = counters  # the peer's: refused, refused_auth, penalized
        self._penalty_s = config.penalty_s
        self._penalties = PenaltyBox(config.penalty_s)
        self._limiter = SenderLimiter(config.max_queue_per_sender)
        self._auth: Any = None  # swarm.dht.auth.RunAuth
        self._peer_id = ""
        self._queue: ComputeQueue | None = None

    def open(self, auth: Any, peer_id: str, queue: ComputeQueue) -> None:
        """Start admitting: ``auth`` checks join proofs (a public run's lets everyone in)."""
        self._auth, self._peer_id, self._queue = auth, peer_id, queue

    def gate(self, name: str, sender: str, header: dict[str, Any]) -> None:
        """Runs on every request's header before its payload is read: penalties, lists, join proof."""
        try:
            self._penalties.check(sender)
            self._auth.check_request(name, sender, self._peer_id, header)
        except AuthError:
            self._counters["refused_auth"] += 1
            raise

    def count_refusal(self, error: RequestError) -> None:
        self._counters["refused"] += 1

    def penalize(self, sender: str, error: Exception) -> None:
        """One faulty or malicious peer must not poison the stage: ignore it for a while."""
        self._penalties.penalize(sender)
        self._counters["penalized"] += 1
        logger.warning("ignoring %s for %.0f s: %s", sender, self._penalty_s, error)

    def submit(self, kind: str, sender: str, fn: Callable[[float], None]) -> int:
        """Queue ``fn`` under the sender's cap (``SenderLimiter``) and the queue's global cap; the
        queue length after it (what the ack reports)."""
        assert self._queue is not None, "admission is not open yet"
        self._limiter.acquire(sender)

        def task(waited: float) -> None:
            try:
                fn(waited)
            finally:
                self._limiter.release(sender)

        try:
            return self._queue.submit(kind, task)  # type: ignore[arg-type]
        except RequestError:
            self._limiter.release(sender)
            raise


class SenderLimiter:
    """Caps the requests one sender has queued here, so a flood from one peer slows only that peer."""

    def __init__(self, per_sender: int):
        if per_sender < 1:
            raise ConfigError(f"per-sender queue cap {per_sender} must be >= 1")
        self.per_sender = per_sender
        self._held: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()  # acquired on the event loop, released by the compute worker
        self.refused = 0

    def acquire(self, peer_id: str) -> None:
        with self._lock:
            if self._held[peer_id] >= self.per_sender:
                self.refused += 1
                raise RequestError(
                    f"peer {peer_id} already has {self.per_sender} requests queued here (the per-sender "
                    "cap); wait for their acks to drain or route to another peer"
                )
            self._held[peer_id] += 1

    def release(self, peer_id: str) -> None:
        with self._lock:
            self._held[peer_id] -= 1
            if self._held[peer_id] <= 0:
                del self._held[peer_id]

    def held(self, peer_id: str) -> int:
        return self._held.get(peer_id, 0)
