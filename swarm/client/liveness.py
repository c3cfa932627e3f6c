"""Failure detection for a trainer: which peers to probe, when a micro-batch is lost (pure logic).

A micro-batch in flight sits somewhere on its route: queued or computing on a peer, being sent from
one peer to the next (the sender keeps it until the next hop acknowledges), or waiting in a peer's
stash for its backward. When a peer dies, what it held is gone, and waiting for a deadline would
stall the run for as long as the deadline's margin. This module decides, from what the trainer
hears, when to look and what an answer means; ``swarm/train/probing.py`` does the sending.

Liveness (note "liveness probes")
---------------------------------
Every report from a peer, every acknowledgement and every probe answer counts as *heard*, and so does a
completed micro-batch for every peer of its route (note "heard through a completion": its ``done`` or
``result`` report means the forward, and for training the backward, passed through each of them after
the attempt started; the middle stages never report, so without it every one of them was probed after
each ``silence_s`` while it held our micro-batches: 30 of the trainer's 41 probes in a 24-micro-batch run
of benchmarks/control_plane.py). A peer that holds some of this trainer's micro-batches and was not
heard from for ``silence_s`` (or that the DHT view flags: its record left the stage's set or says ``leaving``) is probed with an ``INFO``
call (swarm/wire/protocol.py), which its event loop answers even while its compute thread is busy. A
refused connection (a SIGKILLed peer: its libp2p connection is gone) fails the probe at once; the
trainer then closes every attempt routed through that peer and re-sends them. A probe that times
out ``max_misses`` times in a row counts the same (a hung or unreachable peer).

Holding checks (note "holding checks")
--------------------------------------
Each attempt also has a *check time*, an adaptive deadline: its start plus the trainer's retransmit
timeout (:class:`RttEstimator`: smoothed round trip + 4 deviations of completed micro-batches, as
TCP does). Past it, the trainer does not give up: it asks every peer of the route which of the
attempt's micro-batches it holds *actively* (queued, computing or sending; a stash entry waiting
for a backward does not count, the backward may never come). If one does, the micro-batch is alive
and the next check backs off (x2 per check, at most ``max_backoff`` times the timeout). If no peer
of the route holds it in two rounds in a row (two rounds, because an answer taken while a hop hands
it over can miss it), it is lost: the attempt is closed and re-sent, long before its hard deadline
(swarm/client/routing.py, note "deadline"), which only remains for peers that answer but never finish.
A peer that answers without a holding list (an older version) counts as holding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from swarm.errors import ConfigError

__all__ = [
    "LivenessConfig",
    "RttEstimator",
    "Liveness",
    "HoldCheck",
    "hold_verdict",
    "next_check",
]


@dataclass(frozen=True, kw_only=True)
class LivenessConfig:
    """Knobs of failure detection (note "liveness probes", note "holding checks")."""

    silence_s: float = 1.0
    """A peer holding our micro-batches that was not heard from for this long is probed."""
    probe_every_s: float = 0.25
    """How often the trainer looks for peers to probe and attempts to check."""
    dead_hold_s: float = 45.0
    """A peer found dead is kept out of routes this long: its DHT record outlives it by up to its TTL, 45 s
    for a stage peer's record (3 refreshes of 15 s, note "announce on change" in peer/announcements.py);
    with 15 s here a SIGKILLed peer was routed to, and failed, again and again until its record expired."""
    probe_timeout_s: float = 2.0
    """Timeout of one probe; ``max_misses`` timeouts in a row count as a dead peer."""
    max_misses: int = 2
    """Probe timeouts in a row after which a peer counts as dead."""
    initial_rto_s: float = 3.0
    """Check time of attempts before any micro-batch completed (no round trip measured yet)."""
    min_rto_s: float = 1.0
    """Lower bound of the adaptive check time."""
    max_rto_s: float = 120.0
    """Upper bound of the adaptive check time."""
    max_backoff: int = 8
    """A micro-batch found alive is checked again after at most this many timeouts."""
    quiet_rounds: int = 2
    """Holding checks in a row in which no route peer holds a micro-batch before it counts as lost."""
    recheck_s: float = 0.5
    """Delay before the confirming round of a holding check."""

    def __post_init__(self) -> None:
        for name in (
            "silence_s",
            "probe_every_s",
            "dead_hold_s",
            "probe_timeout_s",
            "initial_rto_s",
            "min_rto_s",
            "max_rto_s",
            "recheck_s",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ConfigError(f"liveness {name} = {v!r} must be a positive number of seconds")
        if self.max_rto_s < self.min_rto_s:
            raise ConfigError(
                f"liveness max_rto_s = {self.max_rto_s} is below min_rto_s = {self.min_rto_s}; raise max_rto_s"
            )
        for name in ("max_misses", "max_backoff", "quiet_rounds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"liveness {name} = {v!r} must be an integer >= 1")


class RttEstimator:
    """Smoothed round trip time and its deviation (Jacobson/Karels, RFC 6298) -> a timeout.

    ``observe(seconds)`` takes the duration of one completed micro-batch; :attr:`rto_s` is
    ``srtt + 4 * rttvar`` clamped to ``[min_s, max_s]``, or ``initial_s`` before any sample.
    """

    def __init__(
        self, *, initial_s: float, min_s: float, max_s: float, alpha: float = 0.125, beta: float = 0.25
    ):
        self.initial_s, self.min_s, self.max_s = initial_s, min_s, max_s
        self.alpha, self.beta = alpha, beta
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.samples = 0

    def observe(self, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        if self.srtt is None:
            self.srtt, self.rttvar = seconds, seconds / 2
        else:
            self.rttvar = (1 - self.beta) * self.rttvar + self.beta * abs(self.srtt - seconds)
            self.srtt = (1 - self.alpha) * self.srtt + self.alpha * seconds
        self.samples += 1

    @property
    def rto_s(self) -> float:
        if self.srtt is None:
            return self.initial_s
        return min(self.max_s, max(self.min_s, self.srtt + 4 * self.rttvar))


@dataclass
class _Watch:
    last_heard: float
    probing: bool = False
    misses: int = 0
    flagged: bool = False


class Liveness:
    """What this trainer heard from each peer, and which peers to probe (note "liveness probes").

    Times are passed in (``now``), so tests need no clock. The owner calls :meth:`heard` on every
    sign of life, :meth:`due` to pick the peers to probe, :meth:`probe_sent` before each probe and
    exactly one of :meth:`probe_answered` / :meth:`probe_timed_out` / :meth:`probe_failed` after it.
    """

    def __init__(self, config: LivenessConfig = LivenessConfig()):
        self.config = config
        self._peers: dict[str, _Watch] = {}
        self.probes = 0
        self.dead_found = 0

    def _watch(self, peer: str, now: float) -> _Watch:
        w = self._peers.get(peer)
        if w is None:
            w = self._peers[peer] = _Watch(last_heard=now)
        return w

    def track(self, peer: str, now: float) -> None:
        """A micro-batch was just handed to a route through ``peer``: start its silence clock if new."""
        self._watch(peer, now)

    def heard(self, peer: str, now: float) -> None:
        w = self._watch(peer, now)
        w.last_heard = max(w.last_heard, now)
        w.misses = 0

    def flag(self, peer: str, now: float) -> None:
        """The DHT view says ``peer`` left (record gone or ``leaving``): probe it at the next chance."""
        self._watch(peer, now).flagged = True

    def due(self, holding: Iterable[str], now: float, *, forced: Iterable[str] = ()) -> list[str]:
        """Peers to probe now: of those ``holding`` micro-batches of ours, the silent and the flagged
        ones, plus ``forced`` (holding checks); never one whose probe is still out. Sorted."""
        out = set()
        for peer in holding:
            w = self._watch(peer, now)
            if not w.probing and (w.flagged or now - w.last_heard >= self.config.silence_s):
                out.add(peer)
        for peer in forced:
            if not self._watch(peer, now).probing:
                out.add(peer)
        return sorted(out)

    def probe_sent(self, peer: str, now: float) -> None:
        w = self._watch(peer, now)
        w.probing = True
        w.flagged = False
        self.probes += 1

    def probe_answered(self, peer: str, now: float) -> None:
        w = self._watch(peer, now)
        w.probing = False
        self.heard(peer, now)

    def probe_timed_out(self, peer: str, now: float) -> bool:
        """True when ``peer`` now counts as dead (``max_misses`` timeouts in a row)."""
        w = self._watch(peer, now)
        w.probing = False
        w.misses += 1
        if w.misses >= self.config.max_misses:
            w.misses = 0
            self.dead_found += 1
            return True
        return False

    def probe_failed(self, peer: str, now: float) -> None:
        """The probe could not reach ``peer`` (refused or reset): it counts as dead at once."""
        w = self._watch(peer, now)
        w.probing = False
        w.misses = 0
        self.dead_found += 1

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the watches of peers not in ``keep`` that have no probe out (bounded memory)."""
        keep = set(keep)
        for peer in [p for p, w in self._peers.items() if p not in keep and not w.probing]:
            del self._peers[peer]


@dataclass
class HoldCheck:
    """The holding check of one attempt (note "holding checks"); owned by the trainer per attempt."""

    check_at: float
    """When the next round starts (the attempt's adaptive deadline)."""
    since: float | None = None
    """Start of the round in progress (None = no round in progress)."""
    answers: dict[str, bool] = field(default_factory=dict)
    """Route peer -> holds the micro-batch actively, from probes sent at or after ``since``."""
    checks: int = 0
    """Rounds that found the micro-batch alive (the backoff exponent)."""
    quiet: int = 0
    """Rounds in a row that found no holder."""


def hold_verdict(route: Sequence[str], answers: Mapping[str, bool]) -> str:
    """``"pending"`` (a route peer has not answered this round), ``"alive"`` (one holds it) or
    ``"quiet"`` (every route peer answered and none holds it)."""
    if any(peer not in answers for peer in route):
        return "pending"
    return "alive" if any(answers[peer] for peer in route) else "quiet"


def next_check(check: HoldCheck, verdict: str, *, now: float, rto_s: float, config: LivenessConfig) -> bool:
    """Close the round of ``check`` with ``verdict`` (``alive`` or ``quiet``) and schedule the next
    one; True means the micro-batch is lost (``quiet_rounds`` quiet rounds in a row)."""
    check.since = None
    check.answers = {}
    if verdict == "alive":
        check.quiet = 0
        check.checks += 1
        check.check_at = now + rto_s * min(2**check.checks, config.max_backoff)
        return False
    check.quiet += 1
    if check.quiet >= config.quiet_rounds:
        return True
    check.check_at = now + config.recheck_s
    return False
