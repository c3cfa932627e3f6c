"""Finding the peers that died with our micro-batches, and the micro-batches nobody holds any more.

Failure detection (note "failure detection"; the pure logic is swarm/client/liveness.py)
--------------------------------------------------------------------------------
A peer that dies takes the micro-batches it held with it, and nobody reports that. So: every report,
acknowledgement and probe answer counts as having heard from its peer, and a completed micro-batch as
having heard from every peer of its route (note "heard through a completion" in swarm/client/liveness.py);
a peer that holds micro-batches
of ours and was silent for ``liveness.silence_s`` (1 s), or whose record left its stage or says
``leaving`` at a refresh, is probed with ``INFO``; a refused connection (or repeated probe timeouts)
closes every attempt through it at once, and the peer is kept out of routes for
``liveness.dead_hold_s`` (its record outlives it by up to its TTL). Past an attempt's adaptive check
time (the retransmit timeout of completed micro-batches' round trips), the route's peers are asked
whether they still hold it; if none does in two rounds, it is re-sent. The hard deadline (note
"deadline" in swarm/client/routing.py) only remains for peers that answer but never finish.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from swarm.client.liveness import HoldCheck, Liveness, LivenessConfig, RttEstimator, hold_verdict, next_check
from swarm.errors import Failure, PeerFailure, RequestError
from swarm.train.events import Probed
from swarm.wire.protocol import MAX_LISTED_IDS

if TYPE_CHECKING:
    from swarm.client.link import SwarmLink
    from swarm.train.accounting import Attempt, Ledger
    from swarm.train.events import Inbox, Tasks
    from swarm.train.failures import Failures

__all__ = ["Prober"]


class Prober:
    """Liveness of the peers holding our micro-batches, and the holding checks of acknowledged attempts.
    Probes run as tasks that post a :class:`~swarm.train.events.Probed`; the loop hands it to
    :meth:`answered`."""

    def __init__(
        self,
        config: LivenessConfig,
        *,
        ledger: Ledger,
        failures: Failures,
        checks: dict[str, HoldCheck],
        link: SwarmLink,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.failures = failures
        self.checks = checks  # mb_id of an acknowledged attempt -> its holding check
        self.link = link
        self.clock = clock
        self.enabled = hasattr(link, "probe")  # a link that cannot probe relies on deadlines alone
        self.liveness = Liveness(config)
        self.rtt = RttEstimator(
            initial_s=config.initial_rto_s, min_s=config.min_rto_s, max_s=config.max_rto_s
        )
        self.next_tick = clock() + config.probe_every_s

    def heard(self, peer: str) -> None:
        """Anything from ``peer`` (the link's ``on_heard``): it is alive now."""
        self.liveness.heard(peer, self.clock())

    def sent(self, route: tuple[str, ...], now: float) -> None:
        for pid in route:
            self.liveness.track(pid, now)

    def acked(self, attempt: Attempt, at: float) -> None:
        """Stage 0 took the attempt: from now on it may be checked for (note "failure detection")."""
        self.liveness.heard(attempt.route[0], at)
        if attempt.state == "inflight":  # the adaptive check time
            self.checks[attempt.mb_id] = HoldCheck(check_at=attempt.started + self.rtt.rto_s)

    def completed(self, attempt: Attempt, *, train: bool, round_trip_s: float, at: float) -> None:
        """An attempt completed: every peer of its route was alive after it started (note "heard through
        a completion"), and its round trip feeds the check time."""
        self.checks.pop(attempt.mb_id, None)
        for pid in set(attempt.route):
            self.liveness.heard(pid, at)
        if train:
            self.rtt.observe(round_trip_s)

    def flag(self, peers: list[str], now: float) -> None:
        """Peers whose record left their stage or says leaving: probe them."""
        for pid in peers:
            self.liveness.flag(pid, now)

    def tick(self, now: float, tasks: Tasks, inbox: Inbox) -> None:
        """Start the holding checks that are due and probe the peers that need it."""
        self.next_tick = now + self.config.probe_every_s
        holding: dict[str, list[str]] = defaultdict(list)
        forced: set[str] = set()
        for a in self.ledger.inflight_attempts():
            if not a.acked:
                continue  # the FORWARD call itself is still out (call_timeout_s covers it)
            for pid in set(a.route):
                holding[pid].append(a.mb_id)
            check = self.checks.get(a.mb_id)
            if check is not None and check.since is None and now >= check.check_at:
                check.since, check.answers = now, {}
                forced.update(a.route)
        for pid in self.liveness.due(holding, now, forced=forced):
            self.liveness.probe_sent(pid, now)
            tasks.spawn(self._probe(pid, holding.get(pid, [])[:MAX_LISTED_IDS], now, inbox))
        self.liveness.forget(holding)

    async def _probe(self, peer: str, mb_ids: list[str], sent: float, inbox: Inbox) -> None:
        try:
            reply: dict[str, Any] | None = await self.link.probe(
                peer, mb_ids, timeout_s=self.config.probe_timeout_s
            )
        except PeerFailure as e:
            inbox.put(Probed(peer, mb_ids, sent, self.clock(), error=e))
            return
        except RequestError:  # it answered (a refusal): alive, holdings unknown
            reply = None
        inbox.put(Probed(peer, mb_ids, sent, self.clock(), reply=reply))

    def answered(self, ev: Probed) -> None:
        """A probe came back: a dead peer closes its attempts; an answer advances the holding checks."""
        live, peer, now = self.config, ev.peer, ev.at
        if ev.error is not None:
            if ev.error.reason == "timeout":
                if self.liveness.probe_timed_out(peer, now):
                    self.failures.peer_dead(
                        peer, Failure.TIMEOUT, f"{live.max_misses} probes timed out: {ev.error}"
                    )
            else:
                self.liveness.probe_failed(peer, now)
                self.failures.peer_dead(peer, Failure.UNREACHABLE, f"probe failed: {ev.error}")
            return
        self.liveness.probe_answered(peer, now)
        held = ev.reply.get("held") if ev.reply is not None else None
        known = set(held) if isinstance(held, list) else None  # None: an older peer, counts as holding
        for mb_id in ev.mb_ids:
            attempt = self.ledger.attempts.get(mb_id)
            check = self.checks.get(mb_id)
            if attempt is None or attempt.state != "inflight" or check is None:
                continue
            if check.since is None or ev.sent < check.since:
                continue  # no round in progress, or this probe left before the round started
            check.answers[peer] = known is None or mb_id in known
            verdict = hold_verdict(attempt.route, check.answers)
            if verdict != "pending" and next_check(
                check, verdict, now=now, rto_s=self.rtt.rto_s, config=live
            ):
                self.failures.fail(
                    attempt,
                    reason=Failure.LOST,
                    stage=None,
                    peer=None,
                    detail=f"no peer of its route holds it ({live.quiet_rounds} checks)",
                )
