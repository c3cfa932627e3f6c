"""``TaskOwner``: the one owner of a peer's background tasks, so that none of them dies unnoticed.

A background loop that raised used to end quietly (asyncio logs "Task exception was never retrieved"
at best, when the task is collected) while the peer kept announcing itself online: stashes that never
expire, an averager that never learns of new peers, checkpoints that stop. Every loop the peer runs
is therefore started here, with a ``Supervision`` that says what a crash means for it:

- ``restart``: the crash is logged (ERROR, with its traceback, naming the task) and the loop starts
  again after a backoff (``backoff_s``, doubling); after ``max_restarts`` crashes in a row (a loop
  that ran ``healthy_s`` without crashing starts counting anew) the owner gives up as below;
- no restart: the owner calls ``on_fatal(name, error)`` at once, which stops the peer cleanly
  (announce leaving, drain, shut down) and says why.

One-shot tasks (``spawn``) are not restarted; a crash is logged at ERROR with its name. A loop
that returns on its own (e.g. replica rounds that were stopped) just ends. ``close`` cancels
everything the owner holds; the ``on_fatal`` call itself is not among them, since it is what closes
the owner.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

__all__ = ["Supervision", "TaskOwner"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Supervision:
    """What a crash of one background loop means (see the module docstring)."""

    restart: bool
    max_restarts: int = 3
    backoff_s: float = 1.0
    healthy_s: float = 60.0


class TaskOwner:
    """Starts, supervises and cancels a peer's background tasks (all on one event loop)."""

    def __init__(
        self,
        on_fatal: Callable[[str, BaseException], Awaitable[None]],
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._on_fatal = on_fatal
        self._clock = clock
        self._tasks: set[asyncio.Task] = set()
        self._fatal: asyncio.Task | None = None
        self.crashed: str | None = None  # the loop that stopped the peer, once one did

    def __len__(self) -> int:
        return len(self._tasks)

    def loop(self, name: str, factory: Callable[[], Coroutine[Any, Any, Any]], how: Supervision) -> None:
        """Run ``factory()`` as background loop ``name``; a crash is handled as ``how`` says
        (``factory`` is called again for each restart)."""
        self._track(asyncio.create_task(self._supervise(name, factory, how), name=name))

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a one-shot task; a crash is logged with ``name``, nothing else."""
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(_log_crash)
        self._track(task)

    async def close(self) -> None:
        """Cancel every task and wait until they ended. Tasks started meanwhile are cancelled too."""
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._tasks.difference_update(tasks)

    def _track(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _supervise(
        self, name: str, factory: Callable[[], Coroutine[Any, Any, Any]], how: Supervision
    ) -> None:
        crashes = 0
        while True:
            started = self._clock()
            try:
                await factory()
                return
            except Exception as e:
                if self._clock() - started >= how.healthy_s:
                    crashes = 0
                if how.restart and crashes < how.max_restarts:
                    delay = how.backoff_s * 2**crashes
                    crashes += 1
                    logger.error(
                        "background task %r crashed; restarting it in %.1f s (restart %d of %d)",
                        name,
                        delay,
                        crashes,
                        how.max_restarts,
                        exc_info=e,
                    )
                    await asyncio.sleep(delay)
                    continue
                why = f"after {crashes} restart(s)" if how.restart else "(it is not restarted)"
                logger.error("background task %r crashed %s; stopping the peer", name, why, exc_info=e)
                self._stop(name, e)
                return

    def _stop(self, name: str, error: BaseException) -> None:
        if self._fatal is not None:  # another loop stops the peer already
            return
        self.crashed = name
        self._fatal = asyncio.create_task(self._stop_peer(name, error), name=f"stop after {name}")

    async def _stop_peer(self, name: str, error: BaseException) -> None:
        try:
            await self._on_fatal(name, error)
        except Exception:
            logger.exception("stopping the peer after background task %r crashed failed too", name)


def _log_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("background task %r crashed", task.get_name(), exc_info=task.exception())
