"""Placement policy (swarm/dht/placement.py) on hand-built records: no DHT, no clock."""

from __future__ import annotations

import random

import pytest

from swarm.dht.placement import choose_stage, objective, should_move, stage_throughputs
from swarm.dht.records import PeerRecord
from swarm.errors import ConfigError

SPEC_HASH = "0123456789abcdef"


def pid(name: str) -> str:
    """A valid base58 peer id whose order follows ``name``."""
    return "Qm" + name.ljust(30, "z")


def rec(name: str, stage: int, throughput: float, state: str = "online") -> PeerRecord:
    return PeerRecord(
        peer_id=pid(name),
        run_id="run",
        stage=stage,
        state=state,
        throughput=float(throughput),
        queue=0,
        version=0,
        codecs=("fp16",),
        spec_hash=SPEC_HASH,
    )


def view(*stages: list[tuple[str, float]] | list[tuple[str, float, str]]) -> list[dict[str, PeerRecord]]:
    out = []
    for stage, peers in enumerate(stages):
        out.append({pid(p[0]): rec(p[0], stage, *p[1:]) for p in peers})
    return out


def test_choose_stage_fills_uncovered_stages_first():
    records = view([("A", 100.0)], [], [("B", 1.0)], [])
    picks = {choose_stage(records, my_throughput=5.0, rng=random.Random(seed)) for seed in range(40)}
    assert picks == {1, 3}  # both uncovered stages, chosen at random


def test_choose_stage_takes_the_weakest_stage_and_ignores_leaving_peers():
    records = view([("A", 10.0), ("B", 10.0)], [("C", 15.0)], [("D", 50.0), ("E", 40.0, "leaving")])
    assert stage_throughputs(records) == [20.0, 15.0, 50.0]
    assert choose_stage(records, my_throughput=1.0, rng=random.Random(0)) == 1
    records[2] = {pid("E"): rec("E", 2, 40.0, "leaving")}  # only a leaving peer: uncovered
    assert choose_stage(records, my_throughput=1.0, rng=random.Random(0)) == 2


def test_choose_stage_rejects_bad_input():
    with pytest.raises(ConfigError, match="my_throughput"):
        choose_stage(view([]), my_throughput=float("nan"), rng=random.Random(0))
    with pytest.raises(ConfigError, match="at least one stage"):
        choose_stage([], my_throughput=1.0, rng=random.Random(0))


def test_move_covers_an_uncovered_stage_but_never_empties_one():
    records = view([("A", 10.0), ("B", 30.0)], [])
    # Both could cover stage 1; the designated mover is the slowest (A), B stays.
    assert should_move(records, pid("A"), rng=random.Random(0)) == 1
    assert should_move(records, pid("B"), rng=random.Random(0)) is None
    alone = view([("A", 10.0)], [])
    assert should_move(alone, pid("A"), rng=random.Random(0)) is None  # would empty stage 0


def test_move_balances_unequal_speeds_then_stops():
    records = view([("A", 100.0), ("B", 100.0), ("C", 100.0)], [("D", 10.0)])
    movers = [p for p in "ABC" if should_move(records, pid(p), rng=random.Random(0)) is not None]
    assert movers == ["A"]  # one peer per stage moves: equal speeds, smallest id
    records = view([("B", 100.0), ("C", 100.0)], [("D", 10.0), ("A", 100.0)])
    assert objective(records) == (0, (110.0, 200.0))
    for p in "ABCD":  # moving back would drop the bottleneck from 110 to 100: nobody moves
        assert should_move(records, pid(p), rng=random.Random(0)) is None


def test_hysteresis_margin():
    # Bottleneck 100 -> 115 if A moves: 15 % is below the 20 % margin.
    records = view([("A", 15.0), ("B", 200.0)], [("C", 100.0)])
    assert should_move(records, pid("A"), rng=random.Random(0)) is None
    assert should_move(records, pid("A"), margin=0.1, rng=random.Random(0)) == 1


def test_leaving_and_doubly_listed_peers():
    # A peer seen active in two stages (mid-move) does not act on that view.
    records = view([("A", 10.0), ("B", 10.0)], [("A", 10.0)], [])
    assert should_move(records, pid("A"), rng=random.Random(0)) is None
    # A leaving record does not count as coverage, and a leaving peer never moves.
    records = view([("A", 10.0), ("B", 10.0, "leaving")], [("C", 1.0)])
    assert should_move(records, pid("A"), rng=random.Random(0)) is None
    assert should_move(records, pid("B"), rng=random.Random(0)) is None
    assert should_move(records, pid("Z"), rng=random.Random(0)) is None  # unknown peer


def test_ties_between_targets_use_rng_and_ties_between_movers_use_peer_id():
    records = view([("B", 50.0), ("A", 50.0), ("C", 50.0)], [("D", 10.0)], [("E", 10.0)])
    targets = {should_move(records, pid("A"), rng=random.Random(s)) for s in range(40)}
    assert targets == {1, 2}
    assert should_move(records, pid("B"), rng=random.Random(0)) is None
    assert should_move(records, pid("C"), rng=random.Random(0)) is None


def test_margin_must_be_sane():
    with pytest.raises(ConfigError, match="margin"):
        should_move(view([("A", 1.0)]), pid("A"), margin=-1.0, rng=random.Random(0))


def _simulate(speeds: dict[str, float], num_stages: int, seed: int) -> tuple[list[dict], int]:
    """Peers join one by one with choose_stage, then every peer checks should_move in random order,
    round after round, moving at once; returns the final view and the number of moves."""
    rng = random.Random(seed)
    stages: list[dict[str, PeerRecord]] = [{} for _ in range(num_stages)]
    for name, speed in speeds.items():
        s = choose_stage(stages, my_throughput=speed, rng=rng)
        stages[s][pid(name)] = rec(name, s, speed)
    # Perturb: the fastest peers all crowd into stage 0 (e.g. after a restart), leaving others thin.
    for name in sorted(speeds, key=speeds.get)[-len(speeds) // 2 :]:
        for s in range(num_stages):
            stages[s].pop(pid(name), None)
        stages[0][pid(name)] = rec(name, 0, speeds[name])
    for s in range(1, num_stages):  # keep every stage covered by moving someone back if needed
        if not stages[s]:
            donor = min(stages[0], key=lambda p: (stages[0][p].throughput, p))
            stages[s][donor] = rec(donor[2:].rstrip("z"), s, stages[0].pop(donor).throughput)
    moves, last = 0, objective(stages)
    for _round in range(200):
        moved = False
        order = list(speeds)
        rng.shuffle(order)
        for name in order:
            target = should_move(stages, pid(name), rng=rng)
            if target is None:
                continue
            source = next(s for s, recs in enumerate(stages) if pid(name) in recs)
            stages[target][pid(name)] = rec(name, target, stages[source].pop(pid(name)).throughput)
            now = objective(stages)
            assert now > last, "every move must strictly raise the objective"
            last, moves, moved = now, moves + 1, True
        if not moved:
            return stages, moves
    raise AssertionError("placement did not reach a fixed point in 200 rounds (flapping)")


@pytest.mark.parametrize("seed", range(6))
def test_repeated_checks_reach_a_fixed_point(seed):
    rng = random.Random(100 + seed)
    num_stages = rng.randint(2, 5)
    speeds = {
        "P" + "abcdefghijkm"[i]: rng.choice([5.0, 10.0, 20.0, 80.0]) * rng.uniform(0.5, 1.5)
        for i in range(12)
    }
    stages, moves = _simulate(speeds, num_stages, seed)
    assert all(stages), "no stage may end up empty"
    assert sum(len(s) for s in stages) == len(speeds)
    # At the fixed point no peer wants to move, whatever the tie-break.
    for name in speeds:
        assert should_move(stages, pid(name), rng=random.Random(7)) is None
    # Balanced within what one move can fix: the bottleneck is at least the margin-limited optimum
    # of moving any single peer.
    totals = stage_throughputs(stages)
    assert min(totals) > 0 and moves < 100


def test_has_stage_mates_is_the_precondition_of_any_move():
    from swarm.dht.placement import has_stage_mates

    alone = [{pid("a"): rec("a", 0, 1.0)}, {pid("b"): rec("b", 1, 1.0), pid("c"): rec("c", 1, 1.0)}]
    assert not has_stage_mates(alone, pid("a"))
    assert has_stage_mates(alone, pid("b"))
    assert not has_stage_mates(alone, pid("d"))  # not in any stage
    rng = random.Random(5)
    for _ in range(300):  # no peer should_move moves lacks a stage-mate
        stages = [
            {
                pid("abc"[s] + "xyz"[i]): rec("abc"[s] + "xyz"[i], s, rng.choice([0.5, 1.0, 4.0]))
                for i in range(rng.randint(0, 3))
            }
            for s in range(3)
        ]
        for recs in stages:
            for me in recs:
                if should_move(stages, me, margin=0.2, rng=random.Random(1)) is not None:
                    assert has_stage_mates(stages, me)
