"""Which trainers still wait for their micro-batches here (note "trainers that vanish").

A trainer that cancels micro-batches, or cannot be reached by a report or by the INFO probe of a
peer whose stash holds its micro-batches (probed after ``TRAINER_QUIET_S`` without news), gets them
dropped here at once: stash entries, queued tasks, sends not yet made. Nothing waits for the stash
TTL. Every request or answer from a trainer counts as news.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

from peer.compute import StageCompute
from swarm.errors import PeerFailure, RequestError
from swarm.wire.protocol import ForwardHeader

__all__ = ["TRAINER_QUIET_S", "TrainerWatch", "no_handler"]

logger = logging.getLogger(__name__)

# note "trainers that vanish": a trainer whose stash entries wait this long without news is probed
TRAINER_QUIET_S = 5.0
_GONE_TRAINERS = 256  # trainers remembered as gone (their late micro-batches are dropped)
_CANCELLED = 8192  # cancelled (trainer, mb_id) pairs remembered
_FORGET_S = 60.0  # trainers quiet this long are no longer tracked


def no_handler(text: str) -> bool:
    """A call failed because the remote serves no such protocol (it is alive, just older)."""
    text = text.lower()
    return "protocol not supported" in text or "protocols not supported" in text


class TrainerWatch:
    """The trainers a peer has heard of, and which of them are gone or cancelled what.

    ``compute()``: the stage the peer serves now (or None); ``ping(trainer)``: an INFO call that
    raises ``PeerFailure``/``RequestError`` like ``swarm.wire.protocol.call``; ``spawn(name, coro)``:
    the peer's task owner (peer/tasks.py)."""

    def __init__(
        self,
        *,
        compute: Callable[[], StageCompute | None],
        ping: Callable[[str], Awaitable[Any]],
        spawn: Callable[[str, Coroutine[Any, Any, Any]], None],
        counters: dict[str, int],
    ):
        self._compute = compute
        self._ping = ping
        self._spawn = spawn
        self._counters = counters  # the peer's: trainer_gone
        self._cancelled: OrderedDict[tuple[str, str], None] = OrderedDict()  # (trainer, mb_id)
        self._gone: OrderedDict[str, float] = OrderedDict()  # trainer -> when it was found unreachable
        self._heard: dict[str, float] = {}  # trainer -> last sign of life (monotonic)
        self._probing: set[str] = set()

    def abandoned(self, trainer: str, mb_id: str) -> bool:
        """Nobody waits for this micro-batch any more: drop it rather than compute or send it."""
        return trainer in self._gone or (trainer, mb_id) in self._cancelled

    def heard(self, trainer: str) -> None:
        self._heard[trainer] = time.monotonic()

    def back(self, trainer: str) -> None:
        """The trainer itself sent a request: alive, whatever was concluded before."""
        self.heard(trainer)
        self._gone.pop(trainer, None)

    def cancel(self, trainer: str, ids: Iterable[str]) -> None:
        self.heard(trainer)
        for mb_id in ids:
            self._cancelled[(trainer, mb_id)] = None
        while len(self._cancelled) > _CANCELLED:
            self._cancelled.popitem(last=False)

    def call_failed(self, trainer: str, error: PeerFailure | RequestError) -> None:
        """A report to ``trainer`` was not delivered: an unreachable trainer is gone."""
        if isinstance(error, PeerFailure) and error.reason == "unreachable" and not no_handler(str(error)):
            self.unreachable(trainer)

    def unreachable(self, trainer: str) -> None:
        if trainer in self._gone:
            return
        self._gone[trainer] = time.monotonic()
        while len(self._gone) > _GONE_TRAINERS:
            self._gone.popitem(last=False)
        self._heard.pop(trainer, None)
        logger.info("trainer %s cannot be reached; dropping its micro-batches", trainer)
        self._spawn(f"drop trainer {trainer}", self._drop(trainer))

    async def _drop(self, trainer: str) -> None:
        compute = self._compute()
        if compute is None:
            return
        with compute.lock:
            ids = [e.mb_id for e in compute.stash if getattr(e.context, "trainer", None) == trainer]
        dropped = await asyncio.to_thread(lambda: sum(compute.drop(i) is not None for i in ids))
        self._counters["trainer_gone"] += dropped
        logger.info("trainer %s: dropped %d stashed micro-batch(es) of it", trainer, dropped)

    def check(self) -> None:
        """Probe the trainers whose stash entries here have waited ``TRAINER_QUIET_S`` without news."""
        compute = self._compute()
        if compute is None:
            return
        now = time.monotonic()
        for trainer in list(self._heard):  # bounded: forget trainers quiet for a minute
            if now - self._heard[trainer] > _FORGET_S:
                del self._heard[trainer]
        with compute.lock:
            entries = list(compute.stash)
        stash_now = compute.stash.clock()
        quiet = {
            e.context.trainer
            for e in entries
            if isinstance(e.context, ForwardHeader)
            and stash_now - e.created_at >= TRAINER_QUIET_S
            and now - self._heard.get(e.context.trainer, -1e18) >= TRAINER_QUIET_S
        }
        for trainer in sorted(quiet - self._probing - set(self._gone)):
            self._probing.add(trainer)
            self._spawn(f"probe trainer {trainer}", self._probe(trainer))

    async def _probe(self, trainer: str) -> None:
        try:
            await self._ping(trainer)
            self.heard(trainer)
        except RequestError:  # it answered (with a refusal): alive
            self.heard(trainer)
        except PeerFailure as e:
            if e.reason == "unreachable" and not no_handler(str(e)):
                self.unreachable(trainer)
            elif e.reason == "unreachable":  # an older trainer without INFO: alive
                self.heard(trainer)
        finally:
            self._probing.discard(trainer)
