"""``Outbox``: what a stage peer sends (the next hop's FORWARD/BACKWARD, REPORTs to trainers).

Sends run on the event loop, whichever thread asks (the worker thread hands them over with
``call_soon_threadsafe``), and are tracked until done, so shutdown can wait for them. A hop that
fails is counted, its stash entry dropped, and the trainer gets a ``failed`` report naming the
hop's stage and peer.

Note "holding": a micro-batch is *held* here from the moment its FORWARD or BACKWARD is queued until
the last message this peer sends about it (next hop acknowledged, report delivered) is done.
Answers to a trainer's INFO probe list the held ids (swarm/wire/protocol.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from peer.compute import StageCompute
from peer.config import PeerConfig
from peer.timeline import Timeline
from peer.trainers import TrainerWatch
from swarm.errors import Failure, PeerFailure, RequestError
from swarm.wire.protocol import (
    BACKWARD,
    FORWARD,
    REPORT,
    BackwardHeader,
    ForwardHeader,
    Message,
    Report,
    call,
)

__all__ = ["Outbox"]

logger = logging.getLogger(__name__)


class Outbox:
    """The peer's outgoing messages. ``loop()``, ``p2p()`` and ``auth()`` read the peer's current ones
    (``p2p()`` is None once the peer shut its network down: reports are then dropped)."""

    def __init__(
        self,
        config: PeerConfig,
        counters: dict[str, int],
        trainers: TrainerWatch,
        *,
        loop: Callable[[], asyncio.AbstractEventLoop | None],
        p2p: Callable[[], Any],
        auth: Callable[[], Any],
        timeline: Timeline | None = None,
    ):
        self._timeout_s = config.request_timeout_s
        self._counters = counters  # the peer's: failed_sends
        self._trainers = trainers
        self._loop, self._p2p, self._auth = loop, p2p, auth
        self._timeline = timeline  # note "timeline" (peer/timeline.py): sending / sent of each hop
        self._sends: set[asyncio.Future] = set()
        self._held: Counter[str] = Counter()  # note "holding": mb_id -> its queued tasks and unfinished sends
        self._held_lock = threading.Lock()

    @property
    def busy(self) -> bool:
        """Sends are still under way."""
        return bool(self._sends)

    async def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the sends under way."""
        if self._sends:
            await asyncio.wait(list(self._sends), timeout=timeout_s)

    # ---- holding ---------------------------------------------------------------------------------

    def hold(self, mb_id: str) -> None:
        with self._held_lock:
            self._held[mb_id] += 1

    def unhold(self, mb_id: str) -> None:
        with self._held_lock:
            left = self._held[mb_id] - 1
            if left > 0:
                self._held[mb_id] = left
            else:
                self._held.pop(mb_id, None)

    def held(self, ids: Iterable[str]) -> list[str]:
        with self._held_lock:
            return [i for i in ids if self._held.get(i)]

    def held_count(self) -> int:
        with self._held_lock:
            return len(self._held)

    # ---- sending ---------------------------------------------------------------------------------

    def send(self, coro: Coroutine[Any, Any, Any], *, hold: str | None = None) -> None:
        """Hand a coroutine from any thread to the event loop; it is tracked until done. ``hold``: the
        micro-batch it carries counts as held here until it is done (note "holding")."""
        loop = self._loop()
        assert loop is not None
        if hold is not None:
            self.hold(hold)

        def _schedule() -> None:
            fut = asyncio.ensure_future(coro)
            self._sends.add(fut)
            fut.add_done_callback(self._sends.discard)
            fut.add_done_callback(_log_crash)
            if hold is not None:
                fut.add_done_callback(lambda _: self.unhold(hold))

        if _running_loop() is loop:
            _schedule()
        else:
            try:
                loop.call_soon_threadsafe(_schedule)
            except RuntimeError:  # the loop is closed: we are shutting down
                coro.close()
                if hold is not None:
                    self.unhold(hold)

    async def _call(self, p2p: Any, peer: str, name: str, message: Message) -> None:
        """One request with this peer's timeout and (in a private run) its join proof."""
        await call(p2p, peer, name, message, timeout_s=self._timeout_s, auth=self._auth())

    async def deliver(
        self,
        name: str,
        peer: str,
        origin: ForwardHeader,
        header: ForwardHeader | BackwardHeader,
        payload: bytes,
        *,
        drop_from: StageCompute | None,
    ) -> None:
        """Send one hop of ``origin``'s micro-batch; on failure count it, drop its stash entry from
        ``drop_from`` (if given) and report it to the trainer, naming the hop's stage and peer."""
        if self._trainers.abandoned(origin.trainer, origin.mb_id):
            if drop_from is not None:
                drop_from.drop(origin.mb_id)
            return
        pass_ = "forward" if name == FORWARD else "backward"
        if self._timeline is not None:
            self._timeline.mark(origin.mb_id, pass_, "sending")
        try:
            await self._call(self._p2p(), peer, name, Message(header.to_wire(), payload))
            if self._timeline is not None:
                self._timeline.mark(origin.mb_id, pass_, "sent")
        except (PeerFailure, RequestError) as e:
            self._counters["failed_sends"] += 1
            if drop_from is not None:
                drop_from.drop(origin.mb_id)
            # a gradient that did not reach stage header.stage was already added by the sender's stage
            counted = header.stage + 1 if name == BACKWARD else -1
            report = failed_report(
                origin,
                stage=header.stage,
                peer=peer,
                reason=str(e),
                failure=e.failure or Failure.ERROR,
                counted_from=counted,
            )
            await self.report(origin.trainer, report)

    def report_failed(
        self,
        h: ForwardHeader,
        *,
        stage: int,
        peer: str,
        reason: str,
        failure: Failure,
        counted_from: int = -1,
    ) -> None:
        """Tell ``h``'s trainer that its micro-batch failed here (unless nobody waits for it)."""
        if self._trainers.abandoned(h.trainer, h.mb_id):
            return
        report = failed_report(
            h, stage=stage, peer=peer, reason=reason, failure=failure, counted_from=counted_from
        )
        self.send(self.report(h.trainer, report), hold=h.mb_id)

    async def report(self, trainer: str, report: Report, payload: bytes = b"") -> None:
        p2p = self._p2p()
        if p2p is None:
            return
        done = report.kind == "done" and self._timeline is not None  # stage 0's last hop (note "timeline")
        if done:
            self._timeline.mark(report.mb_id, "backward", "sending")
        try:
            await self._call(p2p, trainer, REPORT, Message(report.to_wire(), payload))
            if done:
                self._timeline.mark(report.mb_id, "backward", "sent")
        except (PeerFailure, RequestError) as e:
            logger.info(
                "report %s of %s to trainer %s was not delivered: %s", report.kind, report.mb_id, trainer, e
            )
            self._trainers.call_failed(trainer, e)  # note "trainers that vanish"
            return
        self._trainers.heard(trainer)


def failed_report(
    h: ForwardHeader,
    *,
    stage: int,
    peer: str,
    reason: str,
    failure: Failure,
    counted_from: int = -1,
) -> Report:
    """A ``failed`` report; ``counted_from``: in the backward phase, the first stage of those that
    already added this micro-batch's gradient (all later ones did too), so a retry skips them."""
    return Report(
        run_id=h.run_id,
        mb_id=h.mb_id,
        kind="failed",
        stage=stage,
        peer=peer,
        reason=reason[:2000],
        failure=failure,
        counted_from=counted_from if 0 <= counted_from < len(h.route) else -1,
    )


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _log_crash(fut: asyncio.Future) -> None:
    """A send raised something it does not handle (a bug): say so, with the traceback."""
    if not fut.cancelled() and fut.exception() is not None:
        logger.error("a send of this peer crashed", exc_info=fut.exception())
