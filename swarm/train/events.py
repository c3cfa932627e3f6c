"""What wakes the trainer's loop: the events callbacks and tasks record, and the owner of those tasks.

A report callback, a finished FORWARD call, a probe answer or a re-read of the stage records only
appends an event to the :class:`Inbox` and wakes the loop; the loop (swarm/train/loop.py) alone reacts
to them, in arrival order, so no trainer state changes under a callback. Each event carries the clock
reading of its arrival, which is what round trips and liveness are measured with.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarm.dht.records import PeerRecord
    from swarm.errors import Failure, PeerFailure
    from swarm.train.accounting import Attempt
    from swarm.wire.protocol import Report

__all__ = ["Reported", "Acked", "SendFailed", "Probed", "Refreshed", "Event", "Inbox", "Tasks"]


@dataclass(frozen=True)
class Reported:
    """A peer's ``REPORT`` (``loss``, ``done``, ``result`` or ``failed``)."""

    report: Report
    payload: bytes
    at: float


@dataclass(frozen=True)
class Acked:
    """The stage-0 peer accepted an attempt's FORWARD."""

    attempt: Attempt
    at: float


@dataclass(frozen=True)
class SendFailed:
    """The FORWARD of an attempt failed or was refused at stage 0."""

    attempt: Attempt
    failure: Failure
    detail: str


@dataclass(frozen=True)
class Probed:
    """A probe's outcome: ``reply`` (None after a refusal: alive, holdings unknown) or ``error``."""

    peer: str
    mb_ids: list[str]
    sent: float
    at: float
    reply: dict[str, Any] | None = None
    error: PeerFailure | None = None


@dataclass(frozen=True)
class Refreshed:
    """The stage peers' records, read again from the DHT."""

    stages: list[dict[str, PeerRecord]]


Event = Reported | Acked | SendFailed | Probed | Refreshed


class Inbox:
    """Events in arrival order, and the ``wake`` the loop sleeps on."""

    def __init__(self) -> None:
        self._events: deque[Event] = deque()
        self.wake = asyncio.Event()

    def put(self, event: Event) -> None:
        self._events.append(event)
        self.wake.set()

    def take(self) -> Event | None:
        return self._events.popleft() if self._events else None


class Tasks:
    """Owner of background tasks: each is cancelled and awaited in :meth:`close` (structured enough
    for Python 3.10, which has no ``asyncio.TaskGroup``). A task that crashes stops the owner's run."""

    def __init__(self, wake: asyncio.Event) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.error: BaseException | None = None
        self.wake = wake

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()
            self.wake.set()

    async def close(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
