"""The in-flight pacer (swarm/train/pacing.py, note "pacing"): pure logic, driven by a simulated pipeline."""

from __future__ import annotations

import pytest

from swarm.train.pacing import InflightPacer, PacingConfig


def _pipeline(pacer: InflightPacer, *, servers: int, service_s: float, latency_s: float, n: int) -> list[int]:
    """A closed loop: ``target`` micro-batches circulate through ``servers`` parallel servers of
    ``service_s`` each (a swarm that can work on ``servers`` at once) plus ``latency_s`` of links.
    Round trip = latency + service + queueing; returns the target after every completion."""
    targets = []
    now = 0.0
    busy_until = [0.0] * servers
    inflight: list[tuple[float, float, int]] = []  # (done at, sent at, inflight at send)
    sent = 0
    while sent < n:
        while len(inflight) < pacer.target:
            i = min(range(servers), key=busy_until.__getitem__)
            start = max(now + latency_s / 2, busy_until[i])
            busy_until[i] = start + service_s
            inflight.append((busy_until[i] + latency_s / 2, now, len(inflight) + 1))
            sent += 1
        pacer.track(now, len(inflight))
        inflight.sort()
        done, at, _ = inflight.pop(0)
        now = done
        pacer.track(now, len(inflight))
        pacer.observe(now, now - at)
        targets.append(pacer.target)
    return targets


def test_a_swarm_that_can_serve_one_at_a_time_keeps_the_floor():
    pacer = InflightPacer(floor=1, ceiling=8)
    targets = _pipeline(pacer, servers=1, service_s=0.1, latency_s=0.0, n=400)
    assert max(targets[100:]) <= 2  # more would only queue
    assert pacer.queued is not None


def test_the_target_grows_to_what_latency_and_parallel_servers_need():
    # 4 servers and links as slow as the compute: about 4 x (0.1 + 0.1) / 0.1 = 8 needed; ceiling 6
    pacer = InflightPacer(floor=2, ceiling=6)
    targets = _pipeline(pacer, servers=4, service_s=0.1, latency_s=0.1, n=600)
    assert targets[-1] == 6
    pacer = InflightPacer(floor=2, ceiling=16)
    targets = _pipeline(pacer, servers=4, service_s=0.1, latency_s=0.1, n=1500)
    assert 6 <= sum(targets[-200:]) / 200 <= 11


def test_the_target_shrinks_when_queues_build_up():
    pacer = InflightPacer(floor=1, ceiling=8)
    pacer.target = 8  # e.g. a swarm that lost its replicas
    targets = _pipeline(pacer, servers=1, service_s=0.1, latency_s=0.0, n=600)
    assert targets[-1] <= 2
    assert pacer.changes >= 6


def test_bounds_and_bad_input():
    pacer = InflightPacer(floor=5, ceiling=3)
    assert pacer.floor == pacer.target == 3  # the floor never exceeds the ceiling
    assert pacer.observe(1.0, 0.0) is False  # a zero round trip is ignored
    assert pacer.base_s == 0.0
    with pytest.raises(ValueError, match="ceiling"):
        InflightPacer(floor=1, ceiling=0)
    with pytest.raises(ValueError, match="low"):
        PacingConfig(low=2.0, high=1.0)


def test_the_base_round_trip_is_forgotten_after_its_window():
    pacer = InflightPacer(floor=1, ceiling=4, config=PacingConfig(base_window_s=10.0))
    pacer.observe(0.0, 0.1)
    pacer.observe(5.0, 0.5)
    assert pacer.base_s == 0.1
    pacer.observe(11.0, 0.4)  # 0.1 is older than 10 s now
    assert pacer.base_s == 0.4


def test_a_target_that_does_not_hold_the_count_down_does_not_grow():
    # e.g. a staleness cap keeps 2 in flight although the target is 3: no queues, but no growth either
    pacer = InflightPacer(floor=3, ceiling=8)
    for i in range(100):
        pacer.track(float(i), 2)
        pacer.observe(float(i), 0.1)
    assert pacer.target == 3 and pacer.queued == 0.0
