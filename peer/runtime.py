"""The compute runtime: one worker thread fed by a bounded, observable queue.

Why one thread: the asyncio loop owns the network and must never block on a matmul; a single worker
keeps the stage's weights, stash and optimizer single-writer (no races between a backward and a
step), and on a GPU one stream of kernels is what the device runs anyway.

Backpressure: the queue holds at most ``max_queue`` tasks; :meth:`ComputeQueue.submit` refuses
with ``RequestError("busy, queue full ...")`` instead of growing, so the sender learns at once and
routes elsewhere. The queue length is what the peer announces as its load.

Gating (sync mode): each task has a kind, ``"forward"`` or ``"backward"``. Backwards always run
first (they free stash memory and complete micro-batches). A forward runs only when the
``forward_gate`` predicate allows it; in ``sync`` mode the peer closes the gate while a step is due
but micro-batches of the current step still await their backward. Whoever changes what the gate
reads calls :meth:`ComputeQueue.notify`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from swarm.errors import Failure, RequestError

__all__ = ["ComputeQueue", "QueueStats", "TaskKind"]

logger = logging.getLogger(__name__)

TaskKind = Literal["forward", "backward"]


@dataclass
class QueueStats:
    """Observable figures of the queue (read them from any thread; they are plain numbers)."""

    length: int = 0
    peak: int = 0
    submitted: int = 0
    completed: int = 0
    refused: int = 0  # submits refused because the queue was full
    failed: int = 0  # tasks that raised (a bug or a bad input caught late; logged)
    total_wait_s: float = 0.0  # time tasks spent queued before the worker took them
    max_wait_s: float = 0.0
    busy_s: float = 0.0  # time the worker spent running tasks
    gated_s: float = 0.0  # time forwards waited on a closed gate while the worker had nothing else
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        d = {k: float(v) for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d


@dataclass
class _Task:
    kind: TaskKind
    fn: Callable[[float], None]  # called with the seconds the task waited in the queue
    enqueued_at: float


class ComputeQueue:
    """A bounded two-lane queue (backward lane first) served by one worker thread."""

    def __init__(
        self,
        max_queue: int,
        *,
        forward_gate: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
        name: str = "stage-compute",
    ):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self.forward_gate = forward_gate
        self.clock = clock
        self.stats = QueueStats()
        self._forward: deque[_Task] = deque()
        self._backward: deque[_Task] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._running = False  # a task is executing now
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._started = False

    # ---- producer side (the asyncio loop) ------------------------------------------------------

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def submit(self, kind: TaskKind, fn: Callable[[float], None]) -> int:
        """Queue ``fn`` and return the queue length after it; refuse when full or closed."""
        with self._cond:
            if self._closed:
                raise RequestError("this peer is shutting down and takes no new work; pick another peer")
            n = len(self._forward) + len(self._backward)
            if n >= self.max_queue:
                self.stats.refused += 1
                raise RequestError(
                    f"busy, queue full: {n} tasks queued (max_queue={self.max_queue}); retry later or "
                    "route to another peer of this stage",
                    failure=Failure.BUSY,
                )
            task = _Task(kind, fn, self.clock())
            (self._backward if kind == "backward" else self._forward).append(task)
            self.stats.submitted += 1
            self.stats.length = n + 1
            self.stats.peak = max(self.stats.peak, n + 1)
            self._cond.notify_all()
            return n + 1

    def notify(self) -> None:
        """Wake the worker: something the forward gate reads has changed."""
        with self._cond:
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._forward) + len(self._backward)

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing running."""
        with self._cond:
            return not self._forward and not self._backward and not self._running

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until :attr:`idle` (True) or ``timeout_s`` passed (False). Not for the event loop."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._forward or self._backward or self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
            return True

    def close(self, *, timeout_s: float = 10.0) -> None:
        """Refuse new work, let queued tasks finish (up to ``timeout_s``), stop the worker."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._started:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning(
                    "compute worker still busy after %.1f s at shutdown; leaving it (daemon)", timeout_s
                )

    # ---- consumer side (the worker thread) ------------------------------------------------------

    def _next(self) -> _Task | None:
        """Pop the next runnable task, or None when closed and drained. Caller holds the lock."""
        gated_since: float | None = None
        while True:
            if self._backward:
                task = self._backward.popleft()
                break
            if self._forward and (self._closed or self.forward_gate()):
                task = self._forward.popleft()
                break
            if self._closed and not self._forward:
                return None
            if self._forward and gated_since is None:
                gated_since = self.clock()
            self._cond.wait(0.05)
        if gated_since is not None:
            self.stats.gated_s += self.clock() - gated_since
        self.stats.length = len(self._forward) + len(self._backward)
        return task

    def _work(self) -> None:
        while True:
            with self._cond:
                task = self._next()
                if task is None:
                    return
                self._running = True
            waited = self.clock() - task.enqueued_at
            t0 = self.clock()
            try:
                task.fn(waited)
            except Exception:  # noqa: BLE001 -- a task's failure must not kill the only worker
                self.stats.failed += 1
                logger.exception("compute task (%s) failed", task.kind)
            finally:
                busy = self.clock() - t0
                with self._cond:
                    self._running = False
                    self.stats.completed += 1
                    self.stats.total_wait_s += waited
                    self.stats.max_wait_s = max(self.stats.max_wait_s, waited)
                    self.stats.busy_s += busy
                    self._cond.notify_all()
