"""Pure rules that decide how soon a failover settles: when a stage peer counts its replicas again
(peer/recount.py, note "replica recount") and how long the trainer keeps a peer found dead out of its
routes (swarm/train/routes.py, note "dead hold")."""

from __future__ import annotations

import math

import pytest

from peer.recount import LONE_COUNT_EVERY_STORES, MEMBER_CHECK_S, RECOUNT_DELAYS_S, Recount, member_check_due
from swarm.client.liveness import LivenessConfig
from swarm.dht.records import PeerRecord
from swarm.train.config import TrainerConfig
from swarm.train.routes import Routes
from tests.helpers import online_record, tiny_spec

A = "QmYaXWzrw9Jz2WeMeFun9F5yreTfrWkTLuUqWx4BmxK6FT"
B = "QmNyLS3uJCGxvsjzhHvUNgkrGX6Mbiv1SVNAgC7GCjiqQe"
GONE = "QmXrs7SrUVe51xAzyWw9pkM3DXfNAs99dquaHzbRdWLfGT"


def record(pid: str, stage: int, **kw) -> PeerRecord:
    return online_record(pid, stage, **kw)


# ------------------------------------------------------------------------------ replica recount


def test_ticks_count_when_stored_or_replicated():
    assert Recount().on_tick(stored=True, replicas=1)  # the first store of a lone replica counts
    assert Recount().on_tick(stored=False, replicas=2)  # a dead replica must be found
    assert not Recount().on_tick(stored=False, replicas=1)  # a lone replica waits for a store or a hint


def test_a_lone_replica_counts_on_every_few_stores_and_a_replicated_one_on_every_tick():
    r = Recount(lone_every=3)
    alone = [r.on_tick(stored=True, replicas=1) for _ in range(7)]
    assert alone == [True, False, False, True, False, False, True]
    assert not r.on_tick(stored=False, replicas=1)  # a tick without a store never counts alone
    assert all(r.on_tick(stored=s, replicas=2) for s in (False, True, False))
    # alone again (a stage-mate left): its first store counts at once, then every third
    assert [r.on_tick(stored=True, replicas=1) for _ in range(4)] == [True, False, False, True]
    assert LONE_COUNT_EVERY_STORES == 3  # 45 s with the default 15 s refresh (peer/recount.py)
    with pytest.raises(ValueError):
        Recount(lone_every=0)


def test_a_hint_schedules_counts_until_the_delays_are_used_up():
    r = Recount()
    assert r.next_at() is None
    assert r.hint(100.0)  # nothing pending: the caller starts the counting task
    due, at = [], 100.0
    for d in RECOUNT_DELAYS_S:
        at += d
        due.append(at)
    seen = []
    while (t := r.next_at()) is not None:
        seen.append(t)
        r.counted(t, changed=False)
    assert seen == pytest.approx(due)
    assert seen[0] == pytest.approx(100.5) and seen[-1] == pytest.approx(107.5)


def test_a_changed_count_ends_the_counts():
    r = Recount()
    r.hint(0.0)
    r.counted(0.5, changed=True)  # the joiner went online: counted two
    assert r.next_at() is None


def test_a_hint_while_counts_are_pending_keeps_their_schedule():
    r = Recount(delays_s=(1.0, 2.0))
    assert r.hint(0.0)
    r.counted(1.0, changed=False)
    assert not r.hint(1.5)  # hints in a burst (an INFO, then the download) do not postpone the counts
    assert r.next_at() == pytest.approx(3.0)
    r.counted(3.0, changed=False)
    assert r.next_at() is None and r.hint(9.0)  # done: the next hint schedules anew
    r.clear()
    assert r.next_at() is None and r.hint(10.0)


def test_a_late_count_drops_every_count_already_due():
    r = Recount(delays_s=(1.0, 1.0, 1.0))
    r.hint(0.0)
    r.counted(2.5, changed=False)  # the event loop was busy: counts at 1 and 2 are covered by this one
    assert r.next_at() == pytest.approx(3.0)


@pytest.mark.parametrize("delays", [(), (0.5, 0.0), (float("nan"),), (-1.0,)])
def test_recount_refuses_bad_delays(delays):
    with pytest.raises(ValueError, match="recount delays"):
        Recount(delays_s=delays)


# ------------------------------------------------------------------------------------ dead hold


def make_routes(hold_s: float = 45.0) -> Routes:
    config = TrainerConfig(
        initial_peers=("/ip4/127.0.0.1/tcp/1/p2p/" + A,),
        run_id="r",
        liveness=LivenessConfig(dead_hold_s=hold_s),
    )
    routes = Routes(
        config, tiny_spec("r", stages=2), lockstep=False, say=lambda _: None, event=lambda *a, **k: None
    )
    routes.update([{A: record(A, 0)}, {B: record(B, 1)}])
    return routes


def test_the_default_hold_covers_a_dead_peers_record_lifetime():
    assert LivenessConfig().dead_hold_s >= 45.0  # 3 refreshes of 15 s (peer/announcements.py)


def test_a_dead_peer_stays_out_while_its_record_is_unchanged():
    routes = make_routes()
    routes.found_dead(B, 10.0)
    routes.update([{A: record(A, 0)}, {B: record(B, 1)}])  # the same record, read again
    assert B not in routes.routable(40.0)[1]
    assert B in routes.routable(55.0)[1]  # past the hold: the record may be a live peer's again
    assert B not in routes.dead


def test_a_dead_peer_whose_record_changes_is_routable_again():
    routes = make_routes()
    routes.found_dead(B, 10.0)
    assert B not in routes.routable(11.0)[1]
    restarted = record(B, 1, state="online", version=7)  # same identity, stored again by a live peer
    routes.update([{A: record(A, 0)}, {B: restarted}])
    assert routes.routable(12.0)[1] == {B: restarted}
    assert not routes.dead


def test_a_peer_found_dead_without_a_record_is_held_for_the_hold():
    routes = make_routes(hold_s=5.0)
    routes.found_dead(GONE, 0.0)
    routes.update([{A: record(A, 0)}, {B: record(B, 1), GONE: record(GONE, 1)}])
    assert GONE not in routes.routable(4.0)[1]
    assert GONE in routes.routable(5.0)[1]


# ---------------------------------------------------------------------------------- lost member


def test_a_round_counts_its_members_only_when_slow_and_not_too_often():
    assert not member_check_due(1.0, math.inf, None)  # a normal wait: no DHT read
    assert member_check_due(MEMBER_CHECK_S, math.inf, None)
    assert not member_check_due(5.0, 1.0, None)  # counted a second ago
    assert member_check_due(5.0, MEMBER_CHECK_S, None)
    assert not member_check_due(5.0, math.inf, 2.0)  # rounds usually take 2 s: 6 s is slow
    assert member_check_due(6.0, math.inf, 2.0)
