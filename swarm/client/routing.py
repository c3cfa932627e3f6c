"""Routing: which peer of each stage carries the next micro-batch (stochastic wiring).

(Over 400 lines on purpose: one routing policy, its config and the observations it weighs;
``Router`` only holds that state.)

The policy is a pure function, :func:`choose_route`, over the stage peers' DHT records plus what this
trainer observed about them (:class:`PeerStats`); :class:`Router` is the thin stateful owner of those
observations, with the clock and the random generator injected so tests need no sleeping.

Policy (note "stochastic wiring")
---------------------------------
For each stage, every usable peer gets the weight ``throughput / (1 + queue)``, and peers receive
micro-batches in proportion to their weights. :class:`Router` picks them by *smooth weighted
round-robin* (note "balanced shares"); :func:`choose_route` without ``credits`` draws one at random
with probability proportional to its weight, as SWARM's stochastic wiring does.

- ``throughput`` (tokens/s) starts at what the peer announced in its record and then follows an
  exponential moving average of the service rate this trainer measured from the peer's own report
  stats (:meth:`Router.on_success`: tokens / (forward + backward compute seconds)). While the peer
  also announces a figure, the lower of the two counts: the per-hop compute time misses costs only
  the peer sees (an emulated straggler delay, contention outside the timed region), and the
  announced figure misses slowdowns since it was measured. A peer announcing 0 (not measured yet)
  gets the median of its stage-mates, so a newcomer is tried instead of starved. A peer 4x slower
  thus receives about 4x fewer micro-batches while queues are empty.
- ``queue`` is the longer of the queue the peer announced and the micro-batches this trainer has in
  flight through it, so a peer that is falling behind gets less new work (backpressure reaches the
  router, not memory).
- A peer that failed is skipped until its backoff ends: ``backoff_base_s * 2**(failures - 1)``
  capped at ``backoff_max_s``; consecutive failures double it, one success resets it.
- ``avoid`` (the peers of a route that just broke for an unknown reason) is soft: those peers are
  skipped unless they are the only ones left in their stage.

Staleness cap (note "staleness cap"): a peer keeps ``optimizer.max_versions`` weight versions and its
stage steps once per ``accumulate`` micro-batches of the *whole stage* (all replicas together,
peer/replicas.py), so a micro-batch whose forward and backward are separated by too many of the
stage's other micro-batches is refused ("version evicted") and must be re-sent. Backwards may come
back out of order, so one version is kept as headroom: at most ``(max_versions - 2) * accumulate + 1``
micro-batches in flight through a stage, shared among its online replicas (:func:`staleness_caps`).
The trainer passes these as ``max_per_peer``: a peer of stage i already holding that many of this
trainer's micro-batches is skipped, and a stage whose peers are all at the cap raises
:class:`NoPeersError` with ``reason="saturated"`` (the trainer simply waits for completions). The
last stage runs its backward right after its forward and needs no cap; sync mode needs none either.

Balanced shares (note "balanced shares"): the replicas of a stage step together once the stage has
``accumulate`` micro-batches, each replica after its own share (peer/replicas.py), so a replica that
got fewer than its share lately makes its partners wait (or the stage step is cut short). Random
draws hand out runs of several micro-batches to one replica; the smooth weighted round-robin (as
nginx balances upstreams) gives each usable peer a credit that grows by its normalised weight at
every choice and sends the micro-batch to the peer with the most credit, which then pays 1. Over
any window the counts stay within about one micro-batch of the weights' proportions, and a peer
with a higher weight still gets proportionally more.

Only records in state ``online`` are used: a ``joining`` peer is still loading weights and a
``leaving`` one is about to go. A stage with no usable peer raises :class:`NoPeersError` naming the
stage, so the trainer can print what would fill it and wait.

Deadlines (note "deadline")
---------------------------
A micro-batch's deadline scales with its size and the observed speed of its route:
``base_s + slack * sum_over_route((1 + queue) * tokens / throughput) + bytes / min_bandwidth``.
Passing it counts as a failure of the route.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from swarm.errors import ConfigError, StageUnavailableError

__all__ = [
    "RoutingConfig",
    "PeerInfo",
    "PeerStats",
    "NoPeersError",
    "peer_weight",
    "choose_route",
    "route_deadline_s",
    "staleness_caps",
    "Router",
]


class PeerInfo(Protocol):
    """What routing reads from a stage peer's record (``swarm.dht.records.PeerRecord`` satisfies it)."""

    peer_id: str
    state: str
    throughput: float
    queue: int


@dataclass(frozen=True, kw_only=True)
class RoutingConfig:
    """Knobs of the routing policy; the defaults suit loopback tests and small swarms alike."""

    ema_alpha: float = 0.3
    """Weight of one new speed measurement in the throughput EMA (0..1]; lower = steadier, slower to react."""
    backoff_base_s: float = 2.0
    """Seconds a peer is skipped after its first failure; doubled per consecutive failure."""
    backoff_max_s: float = 60.0
    """Upper bound of one backoff, so a peer that recovers is tried again within this time."""
    default_throughput: float = 1000.0
    """tokens/s assumed for a peer of a stage where nobody announced a measurement yet."""
    deadline_base_s: float = 10.0
    """Fixed part of every deadline (connection setup, scheduling jitter); raise it on slow networks."""
    deadline_slack: float = 4.0
    """Multiplier on the estimated compute time of a route; raise it if healthy routes time out."""
    min_bandwidth_bytes_s: float = 1e6
    """Slowest link speed (bytes/s) a deadline allows for; lower it for peers on very slow links."""
    busy_backoff_s: float = 0.5
    """Seconds a peer that refused work with a full queue is skipped (no failure is counted)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ConfigError(f"routing ema_alpha = {self.ema_alpha} must lie in (0, 1]; use e.g. 0.3")
        for name in (
            "backoff_base_s",
            "backoff_max_s",
            "default_throughput",
            "deadline_slack",
            "busy_backoff_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"routing {name} = {value} must be a positive finite number")
        if self.backoff_max_s < self.backoff_base_s:
            raise ConfigError(
                f"routing backoff_max_s = {self.backoff_max_s} is below backoff_base_s = "
                f"{self.backoff_base_s}; raise backoff_max_s"
            )
        if not (math.isfinite(self.deadline_base_s) and self.deadline_base_s >= 0):
            raise ConfigError(f"routing deadline_base_s = {self.deadline_base_s} must be >= 0")
        if not (math.isfinite(self.min_bandwidth_bytes_s) and self.min_bandwidth_bytes_s > 0):
            raise ConfigError(f"routing min_bandwidth_bytes_s = {self.min_bandwidth_bytes_s} must be > 0")


@dataclass
class PeerStats:
    """What this trainer observed about one peer (mutable; owned by a :class:`Router`)."""

    throughput: float | None = None  # EMA of measured tokens/s; None until the first measurement
    inflight: int = 0  # micro-batches this trainer has in flight through the peer
    failures: int = 0  # consecutive failures; reset by a success
    backoff_until: float = 0.0  # clock time before which the peer is skipped
    routed: int = 0  # micro-batches ever routed through the peer
    succeeded: int = 0
    failed: int = 0


class NoPeersError(StageUnavailableError):
    """Stage ``stage`` has no usable peer: none announced (``reason="empty"``) or all are backing off.

    ``retry_at`` is the clock time at which the earliest backoff ends (None when the stage is empty).
    """

    def __init__(self, message: str, *, stage: int, reason: str, retry_at: float | None = None):
        super().__init__(message)
        self.stage = stage
        self.reason = reason
        self.retry_at = retry_at


def _stage_fallback_throughput(records: Mapping[str, PeerInfo], config: RoutingConfig) -> float:
    known = [r.throughput for r in records.values() if r.throughput > 0 and math.isfinite(r.throughput)]
    return statistics.median(known) if known else config.default_throughput


def _speed(record: PeerInfo, stats: PeerStats | None, fallback: float) -> float:
    announced = record.throughput if record.throughput > 0 and math.isfinite(record.throughput) else None
    measured = stats.throughput if stats is not None else None
    if measured is not None and announced is not None:
        return min(measured, announced)  # see note "stochastic wiring": costs only the peer can see
    if measured is not None:
        return measured
    return announced if announced is not None else fallback


def peer_weight(record: PeerInfo, stats: PeerStats | None, *, fallback_throughput: float) -> float:
    """Routing weight of one peer: ``throughput / (1 + queue)`` (see note "stochastic wiring")."""
    queue = max(int(record.queue), stats.inflight if stats is not None else 0)
    return _speed(record, stats, fallback_throughput) / (1.0 + max(queue, 0))


def choose_route(
    stages: Sequence[Mapping[str, PeerInfo]],
    stats: Mapping[str, PeerStats],
    *,
    now: float,
    rng: random.Random,
    config: RoutingConfig = RoutingConfig(),
    avoid: frozenset[str] = frozenset(),
    max_per_peer: Sequence[int | None] | None = None,
    credits: dict[str, float] | None = None,
) -> tuple[str, ...]:
    """Draw one peer id per stage (index = stage), weighted as in note "stochastic wiring".

    With ``credits`` (peer id -> credit, kept by the caller between calls) the choice is the smooth
    weighted round-robin of note "balanced shares" instead of a random draw, and ``credits`` is
    updated; without it the function is pure.

    ``stages[i]`` maps peer id -> record of the peers serving stage i. ``max_per_peer[i]`` caps the
    micro-batches this trainer keeps in flight through one peer of stage i (note "staleness cap");
    None = no cap. Raises :class:`NoPeersError` for the first stage with no usable peer. Pure: reads
    its arguments, changes nothing.
    """
    route = []
    for stage, records in enumerate(stages):
        cap = max_per_peer[stage] if max_per_peer is not None and stage < len(max_per_peer) else None
        online = {pid: r for pid, r in records.items() if r.state == "online"}
        if not online:
            raise NoPeersError(
                f"stage {stage} has no online peer", stage=stage, reason="empty", retry_at=None
            )
        ready = {pid: r for pid, r in online.items() if pid not in stats or stats[pid].backoff_until <= now}
        if not ready:
            retry_at = min(stats[pid].backoff_until for pid in online)
            raise NoPeersError(
                f"every peer of stage {stage} failed recently and is backing off for "
                f"{retry_at - now:.1f} s more",
                stage=stage,
                reason="backoff",
                retry_at=retry_at,
            )
        if cap is not None:
            ready = {pid: r for pid, r in ready.items() if pid not in stats or stats[pid].inflight < cap}
            if not ready:
                raise NoPeersError(
                    f"every usable peer of stage {stage} already has {cap} of this trainer's micro-batches "
                    "in flight",
                    stage=stage,
                    reason="saturated",
                )
        preferred = {pid: r for pid, r in ready.items() if pid not in avoid} or ready
        fallback = _stage_fallback_throughput(online, config)
        ids = sorted(preferred)  # sorted: the draw depends only on rng, not on dict order
        weights = [peer_weight(preferred[pid], stats.get(pid), fallback_throughput=fallback) for pid in ids]
        if not any(w > 0 for w in weights):
            weights = [1.0] * len(ids)
        if credits is None:
            route.append(rng.choices(ids, weights=weights, k=1)[0])
        else:
            route.append(_round_robin(ids, weights, credits))
    return tuple(route)


def _round_robin(ids: list[str], weights: list[float], credits: dict[str, float]) -> str:
    """Smooth weighted round-robin over ``ids`` (note "balanced shares"); updates ``credits``."""
    total = sum(weights)
    for pid, w in zip(ids, weights, strict=True):
        # bounded: a peer skipped for a while (backoff, cap) returns without a hoard of credit
        credits[pid] = max(-1.0, min(1.0, credits.get(pid, 0.0) + w / total))
    chosen = max(ids, key=lambda pid: (credits[pid], pid))
    credits[chosen] -= 1.0
    return chosen


def route_deadline_s(
    route: Sequence[str],
    stages: Sequence[Mapping[str, PeerInfo]],
    stats: Mapping[str, PeerStats],
    *,
    n_tokens: int,
    wire_bytes: float,
    config: RoutingConfig = RoutingConfig(),
) -> float:
    """Seconds a micro-batch of ``n_tokens`` may take on ``route`` (see note "deadline").

    ``wire_bytes`` is the estimate of all bytes its activations and gradients put on the links.
    """
    compute_s = 0.0
    for stage, pid in enumerate(route):
        records = stages[stage] if stage < len(stages) else {}
        fallback = _stage_fallback_throughput(records, config) if records else config.default_throughput
        record = records.get(pid)
        st = stats.get(pid)
        if record is not None:
            speed = _speed(record, st, fallback)
            queue = max(int(record.queue), st.inflight if st else 0)
        else:
            speed = st.throughput if st and st.throughput else fallback
            queue = st.inflight if st else 0
        compute_s += (1 + queue) * n_tokens / max(speed, 1e-9)
    return (
        config.deadline_base_s + config.deadline_slack * compute_s + wire_bytes / config.min_bandwidth_bytes_s
    )


def staleness_caps(
    stages: Sequence[Mapping[str, PeerInfo]], *, accumulate: int, max_versions: int, sync: bool
) -> list[int | None]:
    """Per stage, the micro-batches one trainer may keep in flight through one of its peers (note
    "staleness cap"); None = no cap (the last stage, sync mode)."""
    if sync:
        return [None] * len(stages)
    per_stage = max(1, (max_versions - 2) * accumulate + 1)
    caps: list[int | None] = []
    for i, records in enumerate(stages):
        if i == len(stages) - 1:
            caps.append(None)
            continue
        replicas = max(1, sum(1 for r in records.values() if r.state == "online"))
        caps.append(max(1, math.ceil(per_stage / replicas)))
    return caps


class Router:
    """Owns this trainer's observations of peers and applies :func:`choose_route` to them.

    The trainer calls :meth:`route` before sending, then exactly one of :meth:`on_success` /
    :meth:`on_failure` per peer of the route (or :meth:`release` when the outcome says nothing
    about that peer), which keeps ``inflight`` counts exact.
    """

    def __init__(
        self,
        config: RoutingConfig = RoutingConfig(),
        *,
        clock: Callable[[], float],
        rng: random.Random,
    ):
        self.config = config
        self._clock = clock
        self._rng = rng
        self._credits: dict[str, float] = {}  # note "balanced shares"
        self.stats: dict[str, PeerStats] = {}

    def _st(self, peer: str) -> PeerStats:
        return self.stats.setdefault(peer, PeerStats())

    def route(
        self,
        stages: Sequence[Mapping[str, PeerInfo]],
        *,
        avoid: frozenset[str] = frozenset(),
        max_per_peer: Sequence[int | None] | None = None,
    ) -> tuple[str, ...]:
        """Pick a route and count it in flight on each of its peers; may raise :class:`NoPeersError`."""
        route = choose_route(
            stages,
            self.stats,
            now=self._clock(),
            rng=self._rng,
            config=self.config,
            avoid=avoid,
            max_per_peer=max_per_peer,
            credits=self._credits,
        )
        for pid in route:
            st = self._st(pid)
            st.inflight += 1
            st.routed += 1
        return route

    def deadline_s(
        self,
        route: Sequence[str],
        stages: Sequence[Mapping[str, PeerInfo]],
        *,
        n_tokens: int,
        wire_bytes: float,
    ) -> float:
        return route_deadline_s(
            route, stages, self.stats, n_tokens=n_tokens, wire_bytes=wire_bytes, config=self.config
        )

    def release(self, peer: str) -> None:
        """The micro-batch left ``peer`` with no verdict on it (e.g. another hop of the route failed)."""
        st = self._st(peer)
        st.inflight = max(0, st.inflight - 1)

    def on_success(self, peer: str, *, n_tokens: int | None = None, service_s: float | None = None) -> None:
        """``peer`` did its part; when given, ``n_tokens / service_s`` updates its throughput EMA."""
        st = self._st(peer)
        st.inflight = max(0, st.inflight - 1)
        st.failures = 0
        st.backoff_until = 0.0
        st.succeeded += 1
        if n_tokens and service_s and service_s > 0 and math.isfinite(service_s):
            self.observe_speed(peer, n_tokens / service_s)

    def observe_speed(self, peer: str, tokens_per_s: float) -> None:
        """Fold one measured speed (tokens/s) into the peer's EMA."""
        if not (math.isfinite(tokens_per_s) and tokens_per_s > 0):
            return
        st = self._st(peer)
        a = self.config.ema_alpha
        st.throughput = tokens_per_s if st.throughput is None else (1 - a) * st.throughput + a * tokens_per_s

    def on_failure(self, peer: str, *, in_flight: bool = True) -> float:
        """``peer`` failed: back off from it (doubling per consecutive failure). Returns the backoff end.

        ``in_flight=False`` when the failure is not about a micro-batch counted by :meth:`route`
        (e.g. a probe), so the in-flight count is left alone.
        """
        st = self._st(peer)
        if in_flight:
            st.inflight = max(0, st.inflight - 1)
        st.failures += 1
        st.failed += 1
        backoff = min(self.config.backoff_max_s, self.config.backoff_base_s * 2 ** (st.failures - 1))
        st.backoff_until = self._clock() + backoff
        return st.backoff_until

    def on_busy(self, peer: str) -> None:
        """``peer`` refused work because its queue is full: skip it briefly, count no failure."""
        st = self._st(peer)
        st.inflight = max(0, st.inflight - 1)
        st.backoff_until = max(st.backoff_until, self._clock() + self.config.busy_backoff_s)
