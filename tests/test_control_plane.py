"""The control plane's pure parts: traffic counters (swarm/traffic.py), the announce-on-change rule
(peer/announcements.py), the trainer's refresh backoff (swarm/train/background.py) and the breakdown of
the control-plane benchmark (benchmarks/control_plane.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks.control_plane import breakdown, markdown_section, peer_traffic
from peer.announcements import MATERIAL_FIELDS, AnnounceRule
from swarm.dht.records import PeerRecord
from swarm.traffic import Traffic, from_stats, message_kind, per_token, record_kind
from swarm.train.background import REFRESH_MAX_FACTOR, next_refresh_s, records_view
from tests.helpers import online_record

PID = "QmYaXWzrw9Jz2WeMeFun9F5yreTfrWkTLuUqWx4BmxK6FT"


def record(**kw) -> PeerRecord:
    return online_record(PID, **kw)


# ------------------------------------------------------------------------------------ traffic


def test_traffic_counts_by_kind_and_round_trips_through_stats():
    t = Traffic()
    t.add("forward", header=100, payload=1000)
    t.add("forward", header=50)
    t.add("dht_store.stage", header=10, payload=200)
    snap = t.snapshot()
    assert snap["forward"] == {"count": 2, "header": 150, "payload": 1000}
    stats = t.as_stats()
    assert stats["traffic.dht_store.stage.payload"] == 200.0
    # kinds with dots survive the flat stats a peer logs; other stats are ignored
    assert from_stats({**stats, "forwards": 7.0, "traffic.bad": 1.0}) == snap
    t.reset()
    assert t.snapshot() == {}


def test_traffic_refuses_negative_bytes():
    with pytest.raises(ValueError, match="must be >= 0"):
        Traffic().add("forward", header=-1)


def test_kind_names():
    assert message_kind("swarmpipe.stage.forward") == "forward"
    assert message_kind("swarmpipe.trainer.report") == "report"
    assert record_kind("swarmpipe_links-x_stage_3") == "stage"
    assert record_kind("swarmpipe_my_run_progress") == "progress"


def test_per_token_sums_processes():
    a = {"forward": {"count": 2, "header": 100, "payload": 1000}}
    b = {
        "forward": {"count": 2, "header": 300, "payload": 0},
        "report": {"count": 1, "header": 50, "payload": 0},
    }
    pt = per_token([a, b], 100)
    assert pt["forward"] == {"count": 0.04, "header": 4.0, "payload": 10.0}
    assert pt["report"]["header"] == 0.5
    with pytest.raises(ValueError, match="tokens = 0"):
        per_token([a], 0)


# ---------------------------------------------------------------------------- announce rule


def test_first_tick_stores_then_only_on_refresh():
    rule = AnnounceRule(period_s=5.0)
    r = record()
    assert rule.reason(r, 0.0) == "first"
    rule.stored(r, 0.0)
    # version and queue change every step: they ride along with the next refresh
    busy = dataclasses.replace(r, version=9, queue=4, throughput=1200.0)
    assert rule.reason(busy, 5.0) is None
    assert rule.reason(busy, 10.0) is None
    assert rule.reason(busy, 12.5) == "refresh"  # 3 ticks of 5 s, ticks jittered by +-20%
    assert rule.expiration_s == 45.0  # 3 refreshes: two lost ones tolerated


@pytest.mark.parametrize(
    "change",
    [
        {"state": "leaving"},
        {"stage": 2},
        {"codecs": ("fp16",)},
        {"spec_hash": "b" * 16},
        {"software": "0.0.1"},
    ],
)
def test_a_material_change_is_stored_at_once(change):
    rule = AnnounceRule(period_s=5.0)
    rule.stored(record(), 0.0)
    reason = rule.reason(record(**change), 0.1)
    assert reason == f"changed: {next(iter(change))}"
    assert next(iter(change)) in MATERIAL_FIELDS


def test_throughput_is_stored_when_it_moves_by_the_factor():
    rule = AnnounceRule(period_s=5.0, throughput_factor=1.5)
    rule.stored(record(throughput=1000.0), 0.0)
    assert rule.reason(record(throughput=1400.0), 1.0) is None
    assert rule.reason(record(throughput=1600.0), 1.0) == "throughput"
    assert rule.reason(record(throughput=600.0), 1.0) == "throughput"
    rule.stored(record(throughput=0.0), 0.0)
    assert rule.reason(record(throughput=0.0), 1.0) is None
    assert rule.reason(record(throughput=5.0), 1.0) == "throughput"


@pytest.mark.parametrize(
    "kw", [{"period_s": 0.0}, {"period_s": float("nan")}, {"refresh_ticks": 0}, {"throughput_factor": 1.0}]
)
def test_announce_rule_refuses_bad_settings(kw):
    with pytest.raises(ValueError):
        AnnounceRule(**({"period_s": 5.0} | kw))


# ---------------------------------------------------------------------------- refresh backoff


def test_refresh_backs_off_while_nothing_changes():
    p = 2.0
    p = next_refresh_s(p, 2.0, changed=False, complete=True)
    assert p == 4.0
    p = next_refresh_s(p, 2.0, changed=False, complete=True)
    p = next_refresh_s(p, 2.0, changed=False, complete=True)
    assert p == 2.0 * REFRESH_MAX_FACTOR
    assert next_refresh_s(p, 2.0, changed=True, complete=True) == 2.0
    assert next_refresh_s(p, 2.0, changed=False, complete=False) == 2.0  # a stage waits for a joiner


def test_records_view_sees_peers_and_states_only():
    a = [{PID: record()}, {}]
    assert records_view(a) == records_view([{PID: record(version=99, queue=5)}, {}])
    assert records_view(a) != records_view([{PID: record(state="leaving")}, {}])


# ---------------------------------------------------------------------------- benchmark logic


def test_peer_traffic_reads_the_last_stopping_line():
    stats = {"forwards": 3.0, "traffic.forward.count": 3.0, "traffic.forward.header": 900.0}
    log = "noise\npeer X stopping: stash 0, version 2, counters " + json.dumps(stats) + "\nmore\n"
    assert peer_traffic(log) == {"forward": {"count": 3, "header": 900, "payload": 0}}


def _result(**kw):
    base = {
        "payload_bytes_per_token": 100.0,
        "wire_bytes_per_token": 160.0,
        "idle_tx_bytes_per_s_by_node": {"a": 10.0, "b": 10.0},
        "measured_s": 10.0,
        "keeper_snapshot_bytes": 0,
        "tokens": 1000,
    }
    return base | kw


def test_breakdown_adds_up():
    traffic = [
        {
            "forward": {"count": 4, "header": 8000, "payload": 60000},
            "report": {"count": 2, "header": 1000, "payload": 0},
        },
        {
            "backward": {"count": 3, "header": 1000, "payload": 40000},
            "dht_store.stage": {"count": 2, "header": 0, "payload": 500},
        },
    ]
    b = breakdown(_result(), traffic, tokens=1000)
    assert b["serialised"]["payload (activations, gradients)"] == 100.0
    assert b["serialised"]["FORWARD headers"] == 8.0
    assert b["serialised_control"] == 10.0
    assert b["background_wire"] == 0.2  # 20 B/s x 10 s / 1000 tokens
    assert b["framing_and_rest"] == pytest.approx(160 - 100 - 10 - 0.2)
    assert b["ratio"] == pytest.approx(0.6)
    assert b["dht_stored_values"] == {"stage": 0.5}
    text = markdown_section(
        {
            "variants": {
                "after": {
                    "runs": [{"label": "blockwise8", "rate": "none", "tokens_per_s": 1.0, "breakdown": b}]
                }
            }
        }
    )
    assert "| **non-payload / payload** | 0.600 |" in text and "**no**" in text


def test_runs_of_several_lengths_fold_by_rate_length_and_model_and_group_into_tables():
    from benchmarks.control_plane import _fold

    b = breakdown(_result(), [{"forward": {"count": 4, "header": 800, "payload": 60000}}], tokens=1000)
    run = {"label": "blockwise8", "rate": "none", "tokens_per_s": 1.0, "breakdown": b}
    report = {"variants": {"before": {"runs": [run]}}}  # an older run without a length: 24
    _fold(report, "main", {"table": "Fewer streams", "runs": [run | {"micro_batches": 24}]})
    _fold(report, "main", {"table": "Fewer streams", "runs": [run | {"micro_batches": 128}]})
    _fold(
        report,
        "main",
        {"table": "Fewer streams", "runs": [run | {"micro_batches": 128, "tokens_per_s": 2.0}]},
    )
    assert [(r["micro_batches"], r["tokens_per_s"]) for r in report["variants"]["main"]["runs"]] == [
        (24, 1.0),
        (128, 2.0),
    ]
    streams = {
        "runs": [
            {
                "shape": "INFO",
                "concurrency": 1,
                "serialised_bytes_per_call": 41,
                "wire_bytes_per_call": 1349.0,
                "packets_per_call": 13.1,
                "fixed_bytes_per_call": 1308.0,
            },
            {
                "shape": "INFO",
                "concurrency": 1,
                "channels": True,
                "serialised_bytes_per_call": 41,
                "wire_bytes_per_call": 414.0,
                "packets_per_call": 3.8,
                "fixed_bytes_per_call": 373.0,
            },
        ]
    }
    text = markdown_section(report, streams)
    assert "| INFO | stream of its own | 1 | 41 | 1349 | 13.1 | 1308 |" in text
    assert "| INFO | channel | 1 | 41 | 414 | 3.8 | 373 |" in text
    assert "**Fewer streams**" in text and "blockwise8 @ none, 128 mb, main" in text
    assert "| FORWARD messages per micro-batch | 2.05 |" in text  # 4 per 1,000 tokens, 512 per micro-batch


def test_a_lone_peer_reads_the_stage_lists_every_refresh_ticks_and_a_peer_with_mates_every_tick():
    from peer.announcements import MoveReads

    reads = MoveReads(refresh_ticks=3)
    assert reads.due(replicas=1)  # nothing read yet: read
    reads.read(alone=True)
    ticks = []
    for _ in range(6):  # alone: two ticks skipped, the third reads
        ticks.append(reads.due(replicas=1))
        if ticks[-1]:
            reads.read(alone=True)
    assert ticks == [False, False, True, False, False, True]
    reads.read(alone=True)
    assert not reads.due(replicas=1)
    assert reads.due(replicas=2)  # a stage-mate counted (a joiner downloaded from us): read now
    reads.read(alone=False)
    assert all(reads.due(replicas=1) for _ in range(4))  # not alone: every tick


def test_the_donor_priority_rides_on_every_other_store():
    from peer.announcements import DONOR_PRIORITY_EVERY_STORES, EveryNth

    every = EveryNth(DONOR_PRIORITY_EVERY_STORES)
    assert [every.due() for _ in range(5)] == [True, False, True, False, True]  # the first store at once
    assert [EveryNth(1).due() for _ in range(3)] == [True] * 3
    with pytest.raises(ValueError):
        EveryNth(0)


def test_the_dht_stores_each_value_on_fewer_nodes_than_hiveminds_default():
    from swarm.dht.network import DHT_CACHE_NEAREST, DHT_NUM_REPLICAS, DHT_STORE_BEAM

    # hivemind's default 5; every record of ours is refreshed (note "idle control plane")
    assert 2 <= DHT_NUM_REPLICAS < 5
    assert DHT_STORE_BEAM >= DHT_NUM_REPLICAS  # a store's walk must reach as many nodes as it stores on
    assert DHT_CACHE_NEAREST == 0  # every read of ours asks for the latest value: caches serve none


def test_dht_rpc_counts_are_summed_per_role_and_per_operation():
    from benchmarks.dht_rpcs import diff, distinct_peers, summarize

    before = {1: {"role": "peer 0", "counts": {"call_find|store k": 5, "op store|store k": 1}}}
    after = {
        1: {
            "role": "peer 0",
            "counts": {"call_find|store k": 15, "call_store|store k": 4, "op store|store k": 3},
            "targets": {"store k": [3, 15]},
        },
        2: {"role": "init", "counts": {"call_find|get s": 6}, "targets": {"get s": [1, 5]}},
    }
    per_role = diff(before, after)
    assert per_role["peer 0"] == {"call_find|store k": 10, "call_store|store k": 4, "op store|store k": 2}
    report = summarize(per_role, seconds=30.0)
    assert report["rpcs_per_min"] == {"call_find": 32.0, "call_store": 8.0, "op store": 4.0}
    assert report["rpcs_per_min_by_operation"] == {"store k": 28.0, "get s": 12.0}  # RPCs only, not ops
    assert distinct_peers(after)["store k"] == {"operations": 3, "distinct_nodes_each": 5.0}
