"""Failure detection logic (swarm/client/liveness.py) and the served-throughput average (peer/throughput.py):
pure, no sockets, no sleeping (times are passed in)."""

from __future__ import annotations

import math

import pytest

from peer.throughput import ServedRate
from swarm.client.liveness import HoldCheck, Liveness, LivenessConfig, RttEstimator, hold_verdict, next_check
from swarm.errors import ConfigError


def test_rto_starts_at_the_initial_value_then_follows_round_trips_within_bounds():
    est = RttEstimator(initial_s=3.0, min_s=1.0, max_s=60.0)
    assert est.rto_s == 3.0
    est.observe(2.0)
    assert est.rto_s == pytest.approx(2.0 + 4 * 1.0)  # first sample: srtt = r, rttvar = r / 2
    for _ in range(200):
        est.observe(0.1)
    assert est.rto_s == 1.0  # steady 0.1 s trips: clamped at min_s
    for _ in range(200):
        est.observe(500.0)
    assert est.rto_s == 60.0
    est.observe(math.nan)  # ignored
    assert est.samples == 401


def test_a_jittery_round_trip_gets_a_wider_timeout_than_a_steady_one():
    steady, jittery = (RttEstimator(initial_s=1, min_s=0.01, max_s=100) for _ in range(2))
    for i in range(100):
        steady.observe(1.0)
        jittery.observe(0.5 if i % 2 else 1.5)
    assert jittery.rto_s > steady.rto_s + 1.0


def test_only_silent_or_flagged_holders_are_probed_and_never_twice_at_once():
    live = Liveness(LivenessConfig(silence_s=1.0))
    live.track("a", 0.0)
    live.track("b", 0.0)
    assert live.due(["a", "b"], 0.5) == []
    live.heard("b", 0.8)
    assert live.due(["a", "b"], 1.2) == ["a"]  # b was heard 0.4 s ago
    live.probe_sent("a", 1.2)
    assert live.due(["a", "b"], 5.0) == ["b"]  # a's probe is still out
    live.probe_answered("a", 5.1)
    assert live.due(["a", "b"], 5.5) == ["b"]
    live.flag("a", 5.5)  # its record left the stage: probe now, silent or not
    assert live.due(["a"], 5.6) == ["a"]
    assert live.due([], 5.6, forced=["c"]) == ["c"]  # a holding check asks c


def test_probe_timeouts_count_as_dead_only_in_a_row():
    live = Liveness(LivenessConfig(max_misses=2))
    live.probe_sent("a", 0.0)
    assert live.probe_timed_out("a", 2.0) is False
    live.heard("a", 2.5)  # a report in between: the misses start again
    live.probe_sent("a", 3.0)
    assert live.probe_timed_out("a", 5.0) is False
    live.probe_sent("a", 5.0)
    assert live.probe_timed_out("a", 7.0) is True
    live.probe_sent("b", 0.0)
    live.probe_failed("b", 0.1)  # a refused connection: dead at once
    assert live.dead_found == 2


def test_forget_keeps_peers_with_a_probe_out():
    live = Liveness()
    live.probe_sent("a", 0.0)
    live.track("b", 0.0)
    live.forget([])
    assert live.due([], 10.0, forced=["a", "b"]) == ["b"]  # a's probe is still out: still known


def test_hold_verdict_waits_for_every_route_peer():
    assert hold_verdict(("a", "b"), {"a": False}) == "pending"
    assert hold_verdict(("a", "b"), {"a": False, "b": True}) == "alive"
    assert hold_verdict(("a", "b"), {"a": False, "b": False}) == "quiet"


def test_alive_backs_off_and_two_quiet_rounds_in_a_row_mean_lost():
    cfg = LivenessConfig(max_backoff=8, quiet_rounds=2, recheck_s=0.5)
    check = HoldCheck(check_at=1.0, since=1.0, answers={"a": True})
    assert next_check(check, "alive", now=1.1, rto_s=2.0, config=cfg) is False
    assert check.check_at == pytest.approx(1.1 + 4.0) and check.since is None and check.answers == {}
    for _ in range(5):
        next_check(check, "alive", now=10.0, rto_s=2.0, config=cfg)
    assert check.check_at == pytest.approx(10.0 + 16.0)  # capped at max_backoff timeouts
    assert next_check(check, "quiet", now=30.0, rto_s=2.0, config=cfg) is False  # one quiet round
    assert check.check_at == pytest.approx(30.5)
    assert next_check(check, "alive", now=31.0, rto_s=2.0, config=cfg) is False  # found again: reset
    assert next_check(check, "quiet", now=40.0, rto_s=2.0, config=cfg) is False
    assert next_check(check, "quiet", now=40.6, rto_s=2.0, config=cfg) is True


@pytest.mark.parametrize(
    "kw", [{"silence_s": 0}, {"probe_timeout_s": -1}, {"max_misses": 0}, {"min_rto_s": 5, "max_rto_s": 1}]
)
def test_bad_liveness_values_are_refused_with_the_field_name(kw):
    with pytest.raises(ConfigError, match=next(iter(kw))):
        LivenessConfig(**kw)


# ---- served throughput (note "served throughput" in peer/throughput.py) -------------------------


def test_served_rate_corrects_a_busy_start_within_a_minute():
    rate = ServedRate(222.0, now=0.0)  # measured while the machine was busy
    for t in range(5, 65, 5):  # a minute of announce periods, serving 1700 tokens/s
        for _ in range(10):
            rate.add(512, 512 / 1700.0)
        rate.fold(float(t))
    assert rate.value == pytest.approx(1700.0, rel=0.05)
    assert rate.samples == 120


def test_served_rate_keeps_its_value_while_idle_or_with_too_little_work():
    rate = ServedRate(1000.0, now=0.0, min_busy_s=0.2)
    assert rate.fold(100.0) == 1000.0  # idle
    rate.add(100, 0.05)  # 50 ms of work: too little to trust
    assert rate.fold(105.0) == 1000.0
    rate.add(100, 0.2)
    rate.add(0, 1.0)  # ignored
    rate.add(10, math.inf)  # ignored
    value = rate.fold(110.0)  # 200 tokens / 0.25 s = 800 tokens/s, weighed by the 10 s window
    assert value == pytest.approx(1000.0 + (800.0 - 1000.0) * (1 - math.exp(-10.0 / 15.0)))


def test_an_idle_gap_does_not_let_one_window_replace_the_average():
    rate = ServedRate(1000.0, now=0.0)
    rate.fold(600.0)  # ten idle minutes
    rate.add(1000, 2.0)  # then one window at 500 tokens/s
    value = rate.fold(605.0)
    assert 800.0 < value < 1000.0  # weighed by its 5 s window, not by the idle 10 minutes


def test_served_rate_refuses_a_bad_seed():
    with pytest.raises(ValueError, match="seed"):
        ServedRate(0.0, now=0.0)


def test_the_cache_keeps_every_stage_written_by_concurrent_peers(tmp_path):
    import threading

    from peer.throughput import _read_cache, _write_cache

    threads = [
        threading.Thread(target=_write_cache, args=(tmp_path, f"k{i}", float(i + 1))) for i in range(16)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _read_cache(tmp_path / "throughput.json") == {f"k{i}": float(i + 1) for i in range(16)}


def test_a_completed_micro_batch_counts_as_hearing_every_peer_of_its_route():
    """Note "heard through a completion": the middle stages never report, so a completion must keep them
    from being probed; a peer of no completed route is still probed once it was silent."""
    from swarm.train.accounting import Ledger
    from swarm.train.probing import Prober

    ledger = Ledger(tag="t", max_attempts=2)
    now = [0.0]
    prober = Prober(
        LivenessConfig(silence_s=1.0),
        ledger=ledger,
        failures=None,
        checks={},
        link=None,
        clock=lambda: now[0],
    )
    route = ("s0", "s1", "s2")
    attempt = ledger.start_attempt(ledger.open("train", 8).index, route, now=0.0, timeout_s=60.0)
    prober.sent(route, 0.0)
    prober.sent(("s0", "x1", "s2"), 0.0)
    prober.completed(attempt, train=True, round_trip_s=0.9, at=0.9)
    assert prober.liveness.due(["s0", "s1", "s2", "x1"], 1.5) == ["x1"]
    assert prober.liveness.due(["s0", "s1", "s2", "x1"], 2.0) == ["s0", "s1", "s2", "x1"]
    assert prober.rtt.samples == 1
