"""How many micro-batches an async trainer keeps in the swarm: just enough to keep it busy (pure logic).

Note "pacing"
-------------
Every micro-batch in flight beyond what the pipeline needs to stay busy only waits in a peer's queue,
and while it waits the stages it already passed keep stepping: its gradient arrives staler. Staleness
is what asynchronous training pays in quality (BENCHMARKS.md, "Async replay" and "Convergence",
held-out loss against one process: with one peer per stage 1.035-1.041 at 4 in flight, 1.003 paced;
two replicas per stage 1.128 at 4, 1.056 paced). How many are needed depends on things a trainer cannot know in
advance: the number of stages and replicas, compute per stage, link latency, other load on the
machines. So the trainer measures it, the way TCP Vegas sizes a congestion window:

- ``base_s``: the shortest round trip (send to the last stage's report) seen in the last
  ``base_window_s``: a micro-batch that waited nowhere.
- Over each batch of ``sample`` completions: ``mean_s``, their mean round trip, and ``inflight``,
  the time-averaged number in flight meanwhile (the trainer reports every change, :meth:`track`).
- By Little's law ``inflight * base_s / mean_s`` micro-batches are being served, so
  ``queued = inflight * (1 - base_s / mean_s)`` wait in queues. Fewer than ``low`` queued: the swarm
  could take one more (``target += 1``, but only when the target is what held the count down:
  a staleness cap or too few micro-batches left may hold it lower); more than ``high``: one fewer
  (``target -= 1``).

The target stays within ``[floor, ceiling]``: ``floor`` is the number of stages (a pipeline of ``S``
stages needs ``S`` micro-batches to keep every stage busy), ``ceiling`` the trainer's
``max_inflight`` (and the staleness caps apply on top, swarm/client/routing.py). It starts at ``floor`` and
grows while round trips do not lengthen: on a swarm with replicas or slow links (where more in flight
does pay) it climbs to what the links and replicas need, on a swarm whose peers share their compute
(this 2-core test machine) it stays near ``floor``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["InflightPacer", "PacingConfig"]


@dataclass(frozen=True, kw_only=True)
class PacingConfig:
    """Thresholds of the in-flight pacing (note "pacing")."""

    low: float = 0.4
    """Queued micro-batches below which the target grows by one."""
    high: float = 1.2
    """Queued micro-batches above which the target shrinks by one."""
    sample: int = 8
    """Completions per decision (at least the target: every micro-batch in flight is seen once)."""
    base_window_s: float = 60.0
    """How long the shortest round trip is remembered (a route or load change renews it)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.low < self.high:
            raise ValueError(
                f"pacing thresholds must satisfy 0 <= low < high, got low={self.low}, high={self.high}"
            )
        if self.sample < 1 or self.base_window_s <= 0:
            raise ValueError(f"pacing sample={self.sample} must be >= 1 and base_window_s > 0")


class InflightPacer:
    """The in-flight target of an async trainer (note "pacing"); feed it every completed training
    micro-batch with :meth:`observe`."""

    def __init__(self, *, floor: int, ceiling: int, config: PacingConfig | None = None):
        if ceiling < 1:
            raise ValueError(f"ceiling must be >= 1, got {ceiling}")
        self.config = config or PacingConfig()
        self.ceiling = ceiling
        self.floor = max(1, min(floor, ceiling))
        self.target = self.floor
        self._base: deque[tuple[float, float]] = deque()  # (time, round trip), increasing round trips
        self._trips: list[float] = []
        self._area = 0.0  # integral of the in-flight count over time since the last decision
        self._since: float | None = None  # start of that integral
        self._last: tuple[float, int] | None = None  # the last tracked (time, in-flight count)
        self.queued: float | None = None  # the last estimate
        self.changes = 0

    def track(self, now: float, inflight: int) -> None:
        """The number of training micro-batches in flight is ``inflight`` from ``now`` on."""
        if self._last is not None:
            at, n = self._last
            self._area += n * max(0.0, now - at)
        if self._since is None:
            self._since = now
        self._last = (now, inflight)

    def observe(self, now: float, round_trip_s: float) -> bool:
        """One training micro-batch completed ``round_trip_s`` after it was sent. True when the
        target changed."""
        if round_trip_s <= 0:
            return False
        self._remember_base(now, round_trip_s)
        self._trips.append(round_trip_s)
        if len(self._trips) < max(self.config.sample, self.target) or self._last is None:
            return False
        self.track(now, self._last[1])  # close the integral at now
        assert self._since is not None
        span = now - self._since
        if span <= 0:
            return False
        mean_s = sum(self._trips) / len(self._trips)
        inflight = self._area / span
        self._trips.clear()
        self._area, self._since = 0.0, now
        self.queued = inflight * max(0.0, 1.0 - self.base_s / mean_s)
        old = self.target
        if self.queued < self.config.low and inflight > self.target - 0.5:
            # (only when the target was what limited the in-flight count, not e.g. a staleness cap)
            self.target = min(self.ceiling, self.target + 1)
        elif self.queued > self.config.high:
            self.target = max(self.floor, self.target - 1)
        self.changes += self.target != old
        return self.target != old

    @property
    def base_s(self) -> float:
        """The shortest round trip in the window (0 before any)."""
        return self._base[0][1] if self._base else 0.0

    def _remember_base(self, now: float, trip: float) -> None:
        """A monotonic deque: the window's minimum in front, in O(1) amortised."""
        window = self.config.base_window_s
        while self._base and self._base[-1][1] >= trip:
            self._base.pop()
        self._base.append((now, trip))
        while self._base[0][0] < now - window:
            self._base.popleft()
