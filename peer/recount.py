"""When a stage peer counts its stage's live replicas again (pure logic; the peer's side is in
peer/loops.py, note "replica recount").

A replica's count of its stage's online replicas decides whether it steps alone or in gradient rounds
(peer/replicas.py), and two replicas that disagree waste rounds: the one that counts two looks for a
group the other never joins ("could not find a group", a round timeout each), until it steps alone
and both catch up by download. Counting is a DHT read of the stage's records and an ``INFO`` call
to each other replica, so the announce loop does not count on every tick (note "announce on change",
peer/announcements.py):

- on every tick while more than one replica is counted (a replica that died must be found: this peer's
  rounds with it would fail), and, while it counts itself alone, on every ``LONE_COUNT_EVERY_STORES``-th
  tick that stores the record (a safety net: the hints below find a joiner at once);
- after a *hint* that the stage changed: this peer served its state to another peer (a joiner
  downloads from a live replica before it goes online; a lagging replica catches up the same way), or,
  while it counts itself alone, a stage-mate counted it (the ``INFO`` call of ``_live_replicas``,
  peer/handlers.py): two peers that join a stage at the same moment both start from the seed, and the
  one that counted first saw itself alone.
  A lone replica is the only donor a joiner of its stage can find, so without the hint it would learn
  of the joiner only on its next counting store (up to 45 s later), while the joiner already counted
  two. After a hint the peer counts again ``delays_s`` apart (the joiner goes online
  a moment after its download) until the count changes or the delays are used up. A keeper's snapshot
  download (at most every 180 s by default, swarm/tools/keeper.py) hints too and costs those few counts;
  a run without downloads (every stage served by one peer from the start) counts no more than before;
- while a gradient round waits for its all-reduce well past its usual length (note "lost member",
  ``member_check_due``): a member SIGKILLed mid-round otherwise holds the round, and with it the
  stage's step and every forward that waits for it, until hivemind's chunk timeout (10 s), even when
  this peer's announce tick already counted one replica less. When the tick counted fewer replicas than
  the round's group, or the round is slow, the round counts them itself (at most every
  ``MEMBER_CHECK_S``) and is given up when that count confirms fewer (peer/replicas.py); the replica then
  steps alone with its gradients. One low count alone (an ``INFO`` that timed out under load) does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["LONE_COUNT_EVERY_STORES", "MEMBER_CHECK_S", "RECOUNT_DELAYS_S", "Recount", "member_check_due"]

RECOUNT_DELAYS_S = (0.5, 1.0, 2.0, 4.0)
"""Gaps between the counts after a hint: the first half a second after it, the last 7.5 s after it."""
LONE_COUNT_EVERY_STORES = 3
"""A replica that counts itself alone counts again on the first and then every this many-th store of its
record (every 45 s with the default 15 s refresh), instead of on every store (note "idle control
plane", swarm/dht/network.py: each count is a DHT read, ~5 RPC streams in a swarm of a few nodes, and a
lone peers' counts were a fifth of an idle swarm's DHT RPCs). A joiner of its stage reaches it through
the hints (its ``INFO`` count, its state download) and makes it count within a second; what this trades
is only the case the hints miss: a stage-mate that neither downloaded from this peer nor counted it is
found up to 45 s after it went online instead of up to 15 s."""
MEMBER_CHECK_S = 2.0
"""A round slower than this (and than 3 usual rounds) counts its stage's replicas, and again this often."""


def member_check_due(waited_s: float, since_check_s: float, round_s_ema: float | None) -> bool:
    """Whether a round that has waited ``waited_s`` for its all-reduce counts the stage's live replicas
    now (note "lost member"): once it runs longer than ``max(MEMBER_CHECK_S, 3 x its usual length)``,
    at most every ``MEMBER_CHECK_S`` (``since_check_s`` since the last count)."""
    slow = max(MEMBER_CHECK_S, 3.0 * (round_s_ema or 0.0))
    return waited_s >= slow and since_check_s >= MEMBER_CHECK_S


@dataclass
class Recount:
    """Which ticks count the replicas, and the counts due after a hint (times are ``time.monotonic()``)."""

    delays_s: tuple[float, ...] = RECOUNT_DELAYS_S
    lone_every: int = LONE_COUNT_EVERY_STORES
    _due: list[float] = field(default_factory=list, repr=False)
    _lone_stores: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if not self.delays_s or not all(math.isfinite(d) and d > 0 for d in self.delays_s):
            raise ValueError(f"recount delays {self.delays_s!r} must be positive numbers of seconds")
        if self.lone_every < 1:
            raise ValueError(f"lone_every = {self.lone_every} must be at least 1")

    def on_tick(self, *, stored: bool, replicas: int) -> bool:
        """Whether an announce tick counts the replicas: while more than one replica is counted, every
        tick; while alone, the first tick that stores the record and then every ``lone_every``-th one."""
        if replicas > 1:
            self._lone_stores = 0  # alone again later: the first store counts at once
            return True
        if not stored:
            return False
        due = self._lone_stores % self.lone_every == 0
        self._lone_stores += 1
        return due

    def hint(self, now: float) -> bool:
        """The stage probably changed at ``now``: schedule the counts after it, unless some are pending
        (hints come in bursts: a joiner's INFO and its download; hints arriving faster than the first
        delay must not keep postponing the counts). True when it scheduled them: the caller starts the
        task that makes them."""
        if self._due:
            return False
        at = now
        for delay in self.delays_s:
            at += delay
            self._due.append(at)
        return True

    def next_at(self) -> float | None:
        """When the next count after a hint is due, or None when none is pending."""
        return self._due[0] if self._due else None

    def counted(self, now: float, *, changed: bool) -> None:
        """A count was made at ``now``: a changed count ends the hint's counts, otherwise the ones due
        by ``now`` are done."""
        if changed:
            self._due.clear()
        else:
            self._due = [t for t in self._due if t > now]

    def clear(self) -> None:
        """Drop the pending counts (the peer left its stage or stopped being online)."""
        self._due.clear()
