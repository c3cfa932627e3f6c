"""Closing broken attempts: what each failure code does to the peer it names, the release of the route's
other peers (and their CANCEL), and the retry or drop of the micro-batch.

Failures (note "failure classes", at ``REACTIONS``)
---------------------------------------------------
Every failure arrives with its code (``swarm.errors.Failure``: in a refusal, a ``failed`` report or a
``PeerFailure``; note "failure codes" in swarm/wire/protocol.py), and ``REACTIONS`` says what each
does to the peer it names: ``unreachable``, ``timeout`` and ``error`` back off from it (exponential,
routing.Router.on_failure); ``busy`` pauses it briefly; staleness refusals (``version_evicted``,
``stash_expired``) and ``refused`` name no culprit. A peer found
unreachable closes every other attempt routed through it at once (they could only time out), and a
stage-0 peer that never acknowledged a micro-batch before its deadline is the one blamed for it.
Every attempt the trainer closes is cancelled at the peers of its route (``CANCEL``), so none of them
keeps its stash entry until the TTL (in sync mode a stage cannot step while one waits).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swarm.errors import Failure

if TYPE_CHECKING:
    from swarm.client.link import SwarmLink
    from swarm.client.liveness import HoldCheck
    from swarm.client.routing import Router
    from swarm.train.accounting import Attempt, Ledger, MicroBatch
    from swarm.train.events import Tasks
    from swarm.train.routes import Routes

__all__ = ["Reaction", "REACTIONS", "Failures"]


@dataclass(frozen=True)
class Reaction:
    """What a failure does to the peer it names (note "failure classes")."""

    backoff: bool = False  # the peer is suspect: exponential backoff (routing.Router.on_failure)
    pause: bool = False  # its queue is full: a short pause, no failure counted (routing.Router.on_busy)
    dead: bool = False  # most likely dead: no CANCEL to it, and every other attempt through it closes now
    names_stage: bool = True  # with no peer named, the failed stage's peer of the route is the one


# Note "failure classes": the reaction to each failure code.
#   version_evicted, stash_expired, refused: about this micro-batch (staleness, a peer joining or
#     leaving), not the peer's health: no backoff, the retry avoids it.
#   lost: no peer of its route holds it any more (note "failure detection"): names nobody.
#   timeout: a silence names nobody unless the caller names the peer (no acknowledgement).
REACTIONS: dict[Failure, Reaction] = {
    Failure.UNREACHABLE: Reaction(backoff=True, dead=True),
    Failure.TIMEOUT: Reaction(backoff=True, names_stage=False),
    Failure.ERROR: Reaction(backoff=True),
    Failure.BUSY: Reaction(pause=True),
    Failure.REFUSED: Reaction(),
    Failure.VERSION_EVICTED: Reaction(),
    Failure.STASH_EXPIRED: Reaction(),
    Failure.LOST: Reaction(),
}


class Failures:
    """Closes the attempts that broke. ``checks`` is the holding checks' table (shared with
    swarm/train/probing.py); ``on_drop`` records a micro-batch that ran out of attempts."""

    def __init__(
        self,
        *,
        ledger: Ledger,
        router: Router,
        routes: Routes,
        checks: dict[str, HoldCheck],
        event: Callable[..., None],
        clock: Callable[[], float],
        on_drop: Callable[[MicroBatch], None],
    ) -> None:
        self.ledger = ledger
        self.router = router
        self.routes = routes
        self.checks = checks
        self.event = event
        self.clock = clock
        self.on_drop = on_drop
        self.cancels: dict[str, list[str]] = defaultdict(list)  # peer -> closed attempts to cancel there
        self.detected: list[dict[str, Any]] = []  # peers found dead: when and how (benchmarks read it)

    def fail(
        self,
        attempt: Attempt,
        *,
        reason: Failure,
        stage: int | None,
        peer: str | None,
        detail: str = "",
        cascade: bool = False,
    ) -> None:
        """Close a broken attempt: act on the peer it names (note "failure classes"), release the
        others, then retry or drop the micro-batch.

        An ``unreachable`` peer is most likely dead, and every other attempt whose route holds it
        would only find out at its deadline (its gradients must come back through that peer), so
        those are closed at once too (``cascade``: they count no second failure against the peer).
        """
        react = REACTIONS[reason]
        blamed = peer if peer in attempt.route else None
        if blamed is None and stage is not None and 0 <= stage < len(attempt.route) and react.names_stage:
            blamed = attempt.route[stage]
        decision = self.ledger.fail(attempt.mb_id, reason=reason.value, stage=stage, peer=blamed)
        if decision == "stale":
            return
        self.checks.pop(attempt.mb_id, None)
        self._release(attempt, react, blamed, cascade=cascade)
        mb = self.ledger.micro_batches[attempt.index]
        # a timeout names nobody: prefer other peers for the whole route next time
        mb.data["avoid"].update([blamed] if blamed else attempt.route)
        self.event(
            "attempt_failed",
            mb_id=attempt.mb_id,
            reason=reason.value,
            stage=stage,
            peer=blamed,
            decision=decision,
            detail=detail[:200],
        )
        if decision == "dropped":
            self.on_drop(mb)
        if react.dead and blamed is not None and not cascade:
            for other in self.ledger.inflight_attempts():
                if blamed in other.route:
                    self.fail(
                        other,
                        reason=reason,
                        stage=other.route.index(blamed),
                        peer=blamed,
                        detail=f"its route holds {blamed}, which just failed as unreachable",
                        cascade=True,
                    )

    def _release(self, attempt: Attempt, react: Reaction, blamed: str | None, *, cascade: bool) -> None:
        """The route's peers: CANCEL to all but a dead one, backoff or pause for the blamed one."""
        for pid in set(attempt.route):  # the route's other peers drop what they hold of it (CANCEL)
            if not (pid == blamed and react.dead) and pid not in self.routes.dead:
                self.cancels[pid].append(attempt.mb_id)
        for pid in attempt.route:
            if pid == blamed and react.backoff and not cascade:
                self.router.on_failure(pid)
            elif pid == blamed and react.pause:
                self.router.on_busy(pid)
            else:
                self.router.release(pid)

    def expire(self, now: float) -> None:
        """Fail attempts past their deadline. One whose stage-0 peer never even acknowledged it
        names that peer (it is hanging or gone); otherwise the silence names nobody."""
        for attempt in self.ledger.expired(now):
            if attempt.acked:
                self.fail(attempt, reason=Failure.TIMEOUT, stage=None, peer=None)
            else:
                self.fail(
                    attempt,
                    reason=Failure.TIMEOUT,
                    stage=0,
                    peer=attempt.route[0],
                    detail="no acknowledgement",
                )

    def peer_dead(self, peer: str, reason: Failure, detail: str) -> None:
        """``peer`` is gone: close every attempt through it at once and keep it out of routes."""
        now = self.clock()
        self.routes.found_dead(peer, now)
        through = [a for a in self.ledger.inflight_attempts() if peer in a.route]
        self.detected.append({"peer": peer, "time": now, "reason": reason.value, "attempts": len(through)})
        self.event("peer_dead", peer=peer, reason=reason.value, attempts=len(through), detail=detail[:200])
        if not through:
            self.router.on_failure(peer, in_flight=False)
        for i, attempt in enumerate(through):
            if attempt.state == "inflight":  # the first one's cascade may have closed the others
                self.fail(
                    attempt,
                    reason=reason,
                    stage=attempt.route.index(peer),
                    peer=peer,
                    detail=detail,
                    cascade=i > 0,
                )

    def flush_cancels(self, link: SwarmLink, tasks: Tasks) -> None:
        """Send the CANCELs the closed attempts left (a link without ``cancel`` forgets them)."""
        if not self.cancels or not hasattr(link, "cancel"):
            self.cancels.clear()
            return
        for pid, ids in self.cancels.items():
            tasks.spawn(link.cancel(pid, ids))
        self.cancels = defaultdict(list)

    async def cancel_inflight(self, link: SwarmLink) -> None:
        """At the end: cancel what is still in flight, so peers drop it at once (best effort)."""
        if not hasattr(link, "cancel"):
            return
        by_peer: dict[str, list[str]] = defaultdict(list)
        for a in self.ledger.inflight_attempts():
            for pid in set(a.route):
                by_peer[pid].append(a.mb_id)
        for pid, ids in self.cancels.items():
            by_peer[pid].extend(ids)
        self.cancels.clear()
        await asyncio.gather(*(link.cancel(p, ids, timeout_s=2.0) for p, ids in by_peer.items()))
