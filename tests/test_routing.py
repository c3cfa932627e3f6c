"""Routing policy: stochastic wiring by throughput and queue, backoff after failures, deadlines."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from swarm.client.routing import (
    NoPeersError,
    PeerStats,
    Router,
    RoutingConfig,
    choose_route,
    peer_weight,
    route_deadline_s,
)
from swarm.dht.records import PeerRecord
from swarm.errors import ConfigError, StageUnavailableError

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def pid(name: str) -> str:
    """A syntactically valid base58 peer id derived from a short name."""
    body = "".join(_B58[ord(c) % 58] for c in name)
    return ("Qm" + body + "1" * 44)[:46]


def rec(name: str, stage: int = 0, *, throughput: float = 1000.0, queue: int = 0, state: str = "online"):
    return PeerRecord(
        peer_id=pid(name),
        run_id="t",
        stage=stage,
        state=state,
        throughput=throughput,
        queue=queue,
        version=0,
        codecs=("blockwise8",),
        spec_hash="0123456789abcdef",
    )


def stage_of(*records: PeerRecord) -> dict[str, PeerRecord]:
    return {r.peer_id: r for r in records}


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_slower_peer_gets_proportionally_fewer_micro_batches():
    stages = [stage_of(rec("fast", throughput=4000.0), rec("slow", throughput=1000.0))]
    rng = random.Random(0)
    counts = Counter(choose_route(stages, {}, now=0.0, rng=rng)[0] for _ in range(10_000))
    ratio = counts[pid("fast")] / counts[pid("slow")]
    assert 3.6 < ratio < 4.4, counts


def test_measured_throughput_below_the_announced_one_counts():
    """Both announce the same speed; the trainer measured one 4x slower, so it gets ~4x less."""
    clock = FakeClock()
    router = Router(clock=clock, rng=random.Random(1), config=RoutingConfig(ema_alpha=1.0))
    stages = [stage_of(rec("a", throughput=1e6), rec("b", throughput=1e6))]
    router.observe_speed(pid("a"), 4000.0)
    router.observe_speed(pid("b"), 1000.0)
    counts = Counter()
    for _ in range(8000):
        route = router.route(stages)
        counts[route[0]] += 1
        router.on_success(route[0])  # completes at once: queues stay empty
    ratio = counts[pid("a")] / counts[pid("b")]
    assert 3.6 < ratio < 4.4, counts


def test_announced_throughput_below_the_measured_one_counts():
    """A peer that announces it is slow (e.g. an emulated straggler) is believed."""
    stats = {pid("slow"): PeerStats(throughput=5000.0), pid("fast"): PeerStats(throughput=5000.0)}
    stages = [stage_of(rec("slow", throughput=1000.0), rec("fast", throughput=4000.0))]
    rng = random.Random(5)
    counts = Counter(choose_route(stages, stats, now=0.0, rng=rng)[0] for _ in range(8000))
    assert 3.6 < counts[pid("fast")] / counts[pid("slow")] < 4.4


def test_ema_moves_towards_new_measurements():
    router = Router(clock=FakeClock(), rng=random.Random(0), config=RoutingConfig(ema_alpha=0.5))
    router.observe_speed("p", 1000.0)
    router.observe_speed("p", 3000.0)
    assert router.stats["p"].throughput == pytest.approx(2000.0)
    router.on_success("p", n_tokens=1000, service_s=0.25)  # 4000 tokens/s
    assert router.stats["p"].throughput == pytest.approx(3000.0)
    router.observe_speed("p", float("nan"))  # garbage never poisons the EMA
    assert router.stats["p"].throughput == pytest.approx(3000.0)


def test_queue_length_reduces_weight():
    r_idle, r_busy = rec("idle", queue=0), rec("busy", queue=3)
    assert peer_weight(r_idle, None, fallback_throughput=1.0) == pytest.approx(1000.0)
    assert peer_weight(r_busy, None, fallback_throughput=1.0) == pytest.approx(250.0)
    # the trainer's own in-flight count counts when it exceeds the announced queue
    assert peer_weight(r_idle, PeerStats(inflight=4), fallback_throughput=1.0) == pytest.approx(200.0)


def test_failed_peer_gets_nothing_during_backoff_then_returns():
    clock = FakeClock()
    cfg = RoutingConfig(backoff_base_s=2.0, backoff_max_s=60.0)
    router = Router(cfg, clock=clock, rng=random.Random(2))
    stages = [stage_of(rec("good"), rec("bad"))]
    until = router.on_failure(pid("bad"), in_flight=False)
    assert until == pytest.approx(clock.t + 2.0)
    for _ in range(500):
        clock.t += 0.003  # 1.5 s in total, inside the 2 s backoff
        route = router.route(stages)
        assert route[0] == pid("good")
        router.on_success(route[0])
    clock.t = until + 0.01
    seen = set()
    for _ in range(200):
        route = router.route(stages)
        seen.add(route[0])
        router.release(route[0])
    assert pid("bad") in seen


def test_backoff_doubles_per_consecutive_failure_and_resets_on_success():
    clock = FakeClock()
    router = Router(RoutingConfig(backoff_base_s=1.0, backoff_max_s=5.0), clock=clock, rng=random.Random(0))
    spans = [router.on_failure("p", in_flight=False) - clock.t for _ in range(5)]
    assert spans == pytest.approx([1.0, 2.0, 4.0, 5.0, 5.0])
    router.on_success("p")
    assert router.on_failure("p", in_flight=False) - clock.t == pytest.approx(1.0)


def test_all_peers_backing_off_raises_with_retry_time():
    clock = FakeClock()
    router = Router(clock=clock, rng=random.Random(0))
    stages = [stage_of(rec("a")), stage_of(rec("b", 1), rec("c", 1))]
    router.on_failure(pid("b"), in_flight=False)
    until = router.on_failure(pid("c"), in_flight=False)
    with pytest.raises(NoPeersError) as info:
        router.route(stages)
    assert info.value.stage == 1 and info.value.reason == "backoff"
    assert info.value.retry_at == pytest.approx(until)
    assert isinstance(info.value, StageUnavailableError)
    assert router.stats.get(pid("a"), PeerStats()).inflight == 0  # a refused route counts nothing


def test_empty_stage_and_non_online_peers_are_unavailable():
    stages = [stage_of(rec("a")), stage_of(rec("j", 1, state="joining"), rec("l", 1, state="leaving"))]
    with pytest.raises(NoPeersError) as info:
        choose_route(stages, {}, now=0.0, rng=random.Random(0))
    assert info.value.stage == 1 and info.value.reason == "empty" and info.value.retry_at is None
    with pytest.raises(NoPeersError, match="stage 0"):
        choose_route([{}], {}, now=0.0, rng=random.Random(0))


def test_avoid_is_soft():
    stages = [stage_of(rec("a"), rec("b")), stage_of(rec("only", 1))]
    avoid = frozenset({pid("a"), pid("only")})
    for seed in range(50):
        route = choose_route(stages, {}, now=0.0, rng=random.Random(seed), avoid=avoid)
        assert route == (pid("b"), pid("only"))


def test_unmeasured_newcomer_gets_stage_median():
    stages = [stage_of(rec("old", throughput=2000.0), rec("new", throughput=0.0))]
    rng = random.Random(3)
    counts = Counter(choose_route(stages, {}, now=0.0, rng=rng)[0] for _ in range(4000))
    assert 0.8 < counts[pid("new")] / counts[pid("old")] < 1.25


def test_route_counts_inflight_and_outcomes_release_it():
    router = Router(clock=FakeClock(), rng=random.Random(0))
    stages = [stage_of(rec("a")), stage_of(rec("b", 1))]
    route = router.route(stages)
    assert [router.stats[p].inflight for p in route] == [1, 1]
    router.on_success(route[0])
    router.on_failure(route[1])
    assert [router.stats[p].inflight for p in route] == [0, 0]
    assert router.stats[route[1]].failed == 1 and router.stats[route[0]].succeeded == 1


def test_deadline_scales_with_size_queue_and_speed():
    cfg = RoutingConfig(deadline_base_s=5.0, deadline_slack=2.0, min_bandwidth_bytes_s=1e6)
    stages = [stage_of(rec("a", throughput=1000.0)), stage_of(rec("b", 1, throughput=500.0, queue=1))]
    route = (pid("a"), pid("b"))
    d = route_deadline_s(route, stages, {}, n_tokens=100, wire_bytes=2e6, config=cfg)
    # 5 + 2 * (100/1000 + 2 * 100/500) + 2e6 / 1e6
    assert d == pytest.approx(5.0 + 2.0 * 0.5 + 2.0)
    bigger = route_deadline_s(route, stages, {}, n_tokens=1000, wire_bytes=2e6, config=cfg)
    assert bigger > d
    slow_stats = {pid("a"): PeerStats(throughput=10.0)}
    assert route_deadline_s(route, stages, slow_stats, n_tokens=100, wire_bytes=2e6, config=cfg) > bigger


def test_config_is_checked():
    with pytest.raises(ConfigError, match="ema_alpha"):
        RoutingConfig(ema_alpha=0.0)
    with pytest.raises(ConfigError, match="backoff_max_s"):
        RoutingConfig(backoff_base_s=10.0, backoff_max_s=1.0)


def test_busy_peer_is_skipped_briefly_without_a_failure():
    clock = FakeClock()
    router = Router(RoutingConfig(busy_backoff_s=0.5), clock=clock, rng=random.Random(0))
    stages = [stage_of(rec("busy"), rec("free"))]
    router.stats[pid("busy")] = PeerStats(inflight=1)
    router.on_busy(pid("busy"))
    st = router.stats[pid("busy")]
    assert st.failures == 0 and st.inflight == 0 and st.backoff_until == pytest.approx(clock.t + 0.5)
    assert all(router.route(stages)[0] == pid("free") for _ in range(50))


def test_staleness_cap_skips_full_peers_and_saturates():
    router = Router(clock=FakeClock(), rng=random.Random(0))
    stages = [stage_of(rec("a"), rec("b")), stage_of(rec("z", 1))]
    caps = [2, None]  # the last stage has no cap
    routes = [router.route(stages, max_per_peer=caps) for _ in range(4)]
    assert sorted(r[0] for r in routes) == sorted([pid("a"), pid("a"), pid("b"), pid("b")])
    assert router.stats[pid("z")].inflight == 4
    with pytest.raises(NoPeersError) as info:
        router.route(stages, max_per_peer=caps)
    assert info.value.reason == "saturated" and info.value.stage == 0
    router.on_success(pid("a"))
    assert router.route(stages, max_per_peer=caps)[0] == pid("a")


def test_staleness_caps_share_a_stage_budget_among_its_replicas():
    from swarm.client.routing import staleness_caps

    def stage(n, state="online"):
        return {f"p{i}": rec(f"p{i}", state=state) for i in range(n)}

    stages = [stage(1), stage(2), stage(4), stage(1)]
    # (max_versions - 2) * accumulate + 1 = 9 micro-batches per stage, split among its online replicas
    assert staleness_caps(stages, accumulate=4, max_versions=4, sync=False) == [9, 5, 3, None]
    assert staleness_caps(stages, accumulate=4, max_versions=4, sync=True) == [None] * 4
    assert staleness_caps([stage(2, "joining"), stage(1)], accumulate=1, max_versions=3, sync=False) == [
        2,
        None,
    ]


def test_the_router_hands_replicas_balanced_shares_in_proportion_to_their_weights():
    # note "balanced shares": every window of choices is within one micro-batch of the proportions
    stages = [stage_of(rec("a"), rec("b")), stage_of(rec("c", 1, throughput=3000.0), rec("d", 1))]
    router = Router(clock=FakeClock(), rng=random.Random(0))
    routes = []
    for _ in range(400):
        route = router.route(stages)
        routes.append(route)
        for p in route:
            router.release(p)  # nothing stays in flight: the weights stay the announced ones
    firsts = [r[0] for r in routes]
    for start in range(0, 400, 7):
        window = Counter(firsts[start : start + 8])
        assert abs(window[pid("a")] - window[pid("b")]) <= 1, window
    seconds = Counter(r[1] for r in routes)
    assert 2.8 < seconds[pid("c")] / seconds[pid("d")] < 3.2, seconds


def test_round_robin_credit_is_bounded_for_a_peer_that_was_away():
    credits: dict[str, float] = {}
    stages = [stage_of(rec("a"), rec("b"))]
    for _ in range(50):  # b backs off (only a is a candidate): b must not hoard credit meanwhile
        choose_route([stage_of(rec("a"))], {}, now=0.0, rng=random.Random(0), credits=credits)
    picks = Counter(
        choose_route(stages, {}, now=0.0, rng=random.Random(0), credits=credits)[0] for _ in range(10)
    )
    assert picks[pid("a")] == picks[pid("b")] == 5
