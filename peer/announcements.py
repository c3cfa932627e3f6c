"""When a stage peer stores its record in the DHT again (pure logic; the loop is in peer/loops.py).

Why not every round: a DHT store is not one small message. hivemind looks up the nodes nearest the
key and stores the signed value on several of them, and the stage list a peer reads back each round
is answered by every node that holds it; measured in the network lab (benchmarks/control_plane.py)
the announce rounds of 4 idle peers cost ~23 KB/s, more than the whole activation payload of a
subspace-compressed run. Most rounds change nothing anyone reads.

The rule (note "announce on change"): the announce loop still ticks every ``announce_period_s`` (it
folds the throughput, looks at rebalancing). A tick stores the record

- at once when something others act on changed: ``state``, ``stage``, the codecs, the spec hash, the
  software version, or the throughput by more than ``throughput_factor`` either way (trainers weight
  routes by it);
- otherwise only when the last store is ``refresh_ticks`` ticks old: the record must not expire.

``version`` and ``queue`` ride along with the next store: trainers learn a peer's queue from every
acknowledgement, replicas and keepers compare versions against their own state, and the monitor
shows them up to one refresh late. A record lives ``3 x refresh`` (two lost refreshes tolerated, as
before); a dead peer's record therefore outlives it by up to that much, which trainers and replicas
do not wait for: they probe peers with ``INFO`` and a dead peer's connection fails at once (note
"liveness probes" in swarm/client/liveness.py). Changes of state (joining, online, leaving) are
stored by their callers at once, with the same lifetime (a ``leaving`` record must not expire before
the ``online`` one it replaces: the later expiration wins for a subkey).

Reads for rebalancing (note "lone reads"): a rebalancing peer reads every stage's list, one DHT read of
``S`` keys answered by the nodes nearest each. A peer that is the only active peer of its stage never
moves (``swarm.dht.placement.should_move`` keeps a stage's last peer), so while its last read showed it
alone and it counts one replica it reads only every ``refresh_ticks`` ticks (:class:`MoveReads`). It
learns of a stage-mate sooner than that from its replica count: a joiner downloads its state from this
peer (a hint, note "replica recount" in peer/recount.py), and from then on the peer counts two and
reads on every tick. In a swarm of one peer per stage this removes two of every three such reads; where
a stage has several peers, those peers read as before, so a stage left empty is still covered within
a tick by a mover from a fuller one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AnnounceRule",
    "EveryNth",
    "MoveReads",
    "DONOR_PRIORITY_EVERY_STORES",
    "MATERIAL_FIELDS",
    "REFRESH_TICKS",
]

REFRESH_TICKS = 3
"""Ticks of the announce loop between two stores of an unchanged record."""
DONOR_PRIORITY_EVERY_STORES = 2
"""A store of the record also refreshes the donor priority (the stage version, which joiners use to pick
the most advanced donor) on the first and then every this many-th store. hivemind declares a changed
priority at once, a DHT store of its own (~5 finds and 2 stores in a swarm of a few nodes); while a stage
trains its version changes between any two stores, so every record store also cost a declaration.
Trades: a donor's declared priority lags its version by up to two refreshes (30 s) instead of one; live
replicas of a stage are within a few versions of each other and a keeper's priority is below every live
peer's (``swarm.dht.snapshots.keeper_priority``), so a joiner still downloads from a live replica, at
worst from one a few versions behind the newest, and catches up with its rounds or steps."""
MATERIAL_FIELDS = ("peer_id", "run_id", "stage", "state", "codecs", "spec_hash", "software")
"""Record fields whose change is stored at once."""


@dataclass
class AnnounceRule:
    """Remembers the last stored record and says whether a tick must store the current one."""

    period_s: float
    refresh_ticks: int = REFRESH_TICKS
    throughput_factor: float = 1.5
    last: Any = field(default=None, repr=False)
    last_at: float = -math.inf

    def __post_init__(self) -> None:
        if not (math.isfinite(self.period_s) and self.period_s > 0):
            raise ValueError(f"announce period {self.period_s!r} s must be a positive number of seconds")
        if self.refresh_ticks < 1:
            raise ValueError(f"refresh_ticks = {self.refresh_ticks} must be at least 1")
        if not self.throughput_factor > 1:
            raise ValueError(f"throughput_factor = {self.throughput_factor} must be above 1")

    @property
    def refresh_s(self) -> float:
        return self.period_s * self.refresh_ticks

    @property
    def expiration_s(self) -> float:
        """The lifetime every store of this peer's record gets."""
        return 3 * self.refresh_s

    def reason(self, record: Any, now: float) -> str | None:
        """Why ``record`` must be stored at ``now`` ("first", "changed: state", "throughput",
        "refresh"), or None when the stored one still says all that matters."""
        if self.last is None:
            return "first"
        for name in MATERIAL_FIELDS:
            if getattr(record, name) != getattr(self.last, name):
                return f"changed: {name}"
        if _moved(self.last.throughput, record.throughput, self.throughput_factor):
            return "throughput"
        # a tick is jittered (0.8..1.2 periods): refresh on the tick that would otherwise come too late
        if now - self.last_at >= self.refresh_s - 0.5 * self.period_s:
            return "refresh"
        return None

    def stored(self, record: Any, now: float) -> None:
        self.last, self.last_at = record, now


def _moved(old: float, new: float, factor: float) -> bool:
    if old <= 0 or new <= 0:
        return (old <= 0) != (new <= 0)
    return not 1 / factor <= new / old <= factor


@dataclass
class MoveReads:
    """Which announce ticks read the stage lists for rebalancing (note "lone reads")."""

    refresh_ticks: int = REFRESH_TICKS
    alone: bool = False
    skipped: int = 0

    def due(self, replicas: int) -> bool:
        """Whether this tick reads; a tick that does not is counted."""
        if not self.alone or replicas > 1 or self.skipped + 1 >= self.refresh_ticks:
            return True
        self.skipped += 1
        return False

    def read(self, alone: bool) -> None:
        """A read was made; ``alone``: it showed this peer as its stage's only active peer."""
        self.alone, self.skipped = alone, 0


@dataclass
class EveryNth:
    """Says yes on the first call and then on every ``n``-th one (a duty done with every few stores)."""

    n: int
    calls: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n = {self.n} must be at least 1")

    def due(self) -> bool:
        due = self.calls % self.n == 0
        self.calls += 1
        return due
