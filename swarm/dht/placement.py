"""Where a peer serves: pure functions over stage records (no DHT, no clock, no sockets).

A run is a pipeline, so its speed is the speed of its slowest stage. Both policies here measure a
placement by the same *objective*, compared lexicographically:

1. fewer uncovered stages (a stage with no ``joining``/``online`` peer stops the whole pipeline);
2. then the stage totals (tokens/s of its active peers) sorted ascending, compared element by
   element ("leximin"): first a larger bottleneck, then a larger second-slowest stage, and so on.
   Comparing only the bottleneck would freeze a swarm with two equally weak stages and one strong
   one: no single move raises the minimum, yet moving a peer into one weak stage is the first of
   two moves that do.

``choose_stage`` gives a joining peer the stage with the lowest total throughput (uncovered stages
first, random tie-break), which is exactly the stage where one more peer raises the objective most.

``should_move`` lets a serving peer move only when that improves the objective by a clear margin:
it covers an uncovered stage, or it raises the first stage total (in sorted order) that it
changes by more than ``margin`` (20 % by default) without lowering any before it. Each move strictly raises the objective, which is the same for every peer, so repeated
checks of all peers reach a fixed point instead of flapping (a move cannot be undone by a later
move). It never leaves a stage without peers, and within one stage only one peer is the mover per
view: the one whose move gives the best objective, then the slowest, then the smallest peer id, so
that peers of a donor stage which see the same records do not all leave at once. The loop that
calls it (in ``peer/``) adds random jitter between checks so peers rarely act on the same view.

Records of ``leaving`` peers are ignored: they are going away.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from swarm.dht.records import ACTIVE_STATES, PeerRecord
from swarm.errors import ConfigError

__all__ = ["RecordsByStage", "stage_throughputs", "objective", "choose_stage", "should_move"]

RecordsByStage = Sequence[Mapping[str, PeerRecord]]  # index = stage; peer id -> record
Objective = tuple[int, tuple[float, ...]]  # (-uncovered stages, sorted stage totals): larger is better

_TIE_REL = 1e-9  # totals closer than this (relative) count as equal, so float noise does not break ties


def _check_stages(records_by_stage: RecordsByStage) -> None:
    if len(records_by_stage) == 0:
        raise ConfigError(
            "records_by_stage is empty: a run has at least one stage (pass one mapping per stage)"
        )


def _active(records: Mapping[str, PeerRecord]) -> dict[str, PeerRecord]:
    return {pid: rec for pid, rec in records.items() if rec.state in ACTIVE_STATES}


def stage_throughputs(records_by_stage: RecordsByStage) -> list[float]:
    """Total throughput (tokens/s) of the joining/online peers of each stage."""
    return [math.fsum(r.throughput for r in _active(recs).values()) for recs in records_by_stage]


def _objective(totals: Sequence[float], counts: Sequence[int]) -> Objective:
    uncovered = sum(1 for c in counts if c == 0)
    return (-uncovered, tuple(sorted(totals)))


def objective(records_by_stage: RecordsByStage) -> Objective:
    """``(-uncovered stages, stage totals sorted ascending)``; larger (lexicographically) is better."""
    _check_stages(records_by_stage)
    counts = [len(_active(recs)) for recs in records_by_stage]
    return _objective(stage_throughputs(records_by_stage), counts)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _TIE_REL * max(abs(a), abs(b), 1.0)


def choose_stage(records_by_stage: RecordsByStage, *, my_throughput: float, rng: random.Random) -> int:
    """The stage a joining peer should claim: the one with the lowest total throughput.

    Uncovered stages have total 0 and so come first. Ties (within float noise) are broken with
    ``rng``, so peers joining at the same moment spread out. ``my_throughput`` does not change the
    choice (adding a peer to the weakest stage always raises the bottleneck most) but is checked,
    so a peer with a broken measurement fails here, before it claims anything.
    """
    _check_stages(records_by_stage)
    if not isinstance(my_throughput, int | float) or not math.isfinite(my_throughput) or my_throughput < 0:
        raise ConfigError(
            f"my_throughput={my_throughput!r} must be a finite number >= 0 (tokens/s); "
            "measure the stage first, or pass 0.0 if unknown"
        )
    totals = stage_throughputs(records_by_stage)
    lowest = min(totals)
    candidates = [stage for stage, total in enumerate(totals) if _close(total, lowest)]
    return candidates[0] if len(candidates) == 1 else rng.choice(candidates)


def _best_move(
    totals: list[float], counts: list[int], source: int, throughput: float, rng: random.Random
) -> tuple[Objective, int] | None:
    """Best (objective, target) for moving a peer of ``throughput`` off ``source``; None if none is allowed."""
    if counts[source] <= 1:
        return None  # never leave a stage empty
    best: Objective | None = None
    targets: list[int] = []
    for target in range(len(totals)):
        if target == source:
            continue
        new_totals, new_counts = list(totals), list(counts)
        new_totals[source] -= throughput
        new_totals[target] += throughput
        new_counts[source] -= 1
        new_counts[target] += 1
        candidate = _objective(new_totals, new_counts)
        if best is None or _better(candidate, best):
            best, targets = candidate, [target]
        elif not _better(best, candidate):
            targets.append(target)
    if best is None:
        return None
    return best, (targets[0] if len(targets) == 1 else rng.choice(targets))


def _first_difference(a: Objective, b: Objective) -> tuple[float, float] | None:
    """The first pair of sorted totals that differ beyond float noise, or None if all are equal."""
    for x, y in zip(a[1], b[1], strict=True):
        if not _close(x, y):
            return x, y
    return None


def _better(a: Objective, b: Objective) -> bool:
    """``a > b`` in the leximin order, with float noise treated as a tie."""
    if a[0] != b[0]:
        return a[0] > b[0]
    diff = _first_difference(a, b)
    return diff is not None and diff[0] > diff[1]


def _clearly_better(new: Objective, old: Objective, margin: float) -> bool:
    """``new`` beats ``old`` by the hysteresis margin (covering a stage always counts)."""
    if new[0] != old[0]:
        return new[0] > old[0]
    diff = _first_difference(new, old)
    return diff is not None and diff[0] > diff[1] * (1.0 + margin)


def has_stage_mates(records_by_stage: RecordsByStage, me: str) -> bool:
    """Whether ``me`` is active in exactly one stage and that stage has another active peer: the two
    conditions without which :func:`should_move` never moves ``me`` (pure)."""
    active = [_active(recs) for recs in records_by_stage]
    mine = [stage for stage, recs in enumerate(active) if me in recs]
    return len(mine) == 1 and len(active[mine[0]]) > 1


def should_move(
    records_by_stage: RecordsByStage, me: str, *, margin: float = 0.2, rng: random.Random
) -> int | None:
    """The stage peer ``me`` should move to now, or None to stay.

    Returns a stage only if (a) ``me`` is active in exactly one stage (a view where it appears in
    two is still settling after a move), (b) that stage keeps at least one other active peer,
    (c) the move covers an uncovered stage or raises the sorted stage totals by more than
    ``margin`` (relative, at the first total it changes; see the module docstring), and (d) ``me`` is the designated mover of its stage: among the peers of that stage
    whose move would qualify, the one with the best resulting objective, then the lowest
    throughput, then the smallest peer id. Equally good targets are broken with ``rng``.
    """
    _check_stages(records_by_stage)
    if not isinstance(margin, int | float) or not math.isfinite(margin) or margin < 0:
        raise ConfigError(f"margin={margin!r} must be a finite number >= 0 (relative improvement, e.g. 0.2)")
    active = [_active(recs) for recs in records_by_stage]
    mine = [stage for stage, recs in enumerate(active) if me in recs]
    if len(mine) != 1:
        return None
    source = mine[0]
    totals = [math.fsum(r.throughput for r in recs.values()) for recs in active]
    counts = [len(recs) for recs in active]
    current = _objective(totals, counts)

    # Rank every peer of my stage by what its move would give; only the top one moves.
    ranked: list[tuple[Objective, float, str]] = []
    for pid, rec in active[source].items():
        move = _best_move(totals, counts, source, rec.throughput, random.Random(0))
        if move is not None and _clearly_better(move[0], current, margin):
            ranked.append((move[0], rec.throughput, pid))
    if not ranked:
        return None
    top = ranked[0]
    for entry in ranked[1:]:
        if _better(entry[0], top[0]) or (
            not _better(top[0], entry[0]) and (entry[1], entry[2]) < (top[1], top[2])
        ):
            top = entry
    if top[2] != me:
        return None
    move = _best_move(totals, counts, source, active[source][me].throughput, rng)
    assert move is not None  # me was ranked, so a qualifying move exists
    return move[1]
