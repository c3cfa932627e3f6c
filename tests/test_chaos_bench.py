"""The chaos benchmark's figures (benchmarks/chaos.py) on hand-built records and logs; no swarm."""

from __future__ import annotations

import json

from benchmarks.chaos import (
    peer_log_figures,
    read_jsonl,
    render,
    replacement_phases,
    resend_latencies,
    stalls,
    with_monotonic,
)


def test_a_half_written_line_of_a_killed_trainer_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"type": "step", "step": 1, "time": 1.0}\n{"type": "step", "st\n{"type": "eval"}\n')
    assert [r["type"] for r in read_jsonl(path)] == ["step", "eval"]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_each_session_has_its_own_clock_base():
    records = [
        {"type": "event", "event": "bench_clock", "time": 0.0, "started": 100.0},
        {"type": "step", "step": 1, "time": 2.0},
        {"type": "step", "step": 2, "time": 5.0},
        # the resumed session continues record times from the last step (5.0), 20 s later
        {"type": "event", "event": "bench_clock", "time": 5.0, "started": 120.0},
        {"type": "step", "step": 3, "time": 6.0},
    ]
    out = with_monotonic(records)
    assert [r["mono"] for r in out] == [100.0, 102.0, 105.0, 125.0, 126.0]


def test_the_stall_across_a_trainer_kill_is_reported_apart():
    steps = [{"type": "step", "mono": t} for t in (0.0, 1.0, 4.0, 5.0, 30.0, 31.0)]
    assert stalls(steps) == (25.0, None)
    assert stalls(steps, skip=[10.0]) == (3.0, 25.0)
    assert stalls([]) == (0.0, None)


def test_resend_latency_counts_failures_naming_the_killed_peer_after_its_kill():
    kills = [{"mono": 10.0, "peer": "A"}]
    records = [
        {"type": "event", "event": "attempt_failed", "peer": "A", "mono": 10.5},
        {"type": "event", "event": "attempt_failed", "peer": "A", "mono": 9.0},  # before the kill
        {"type": "event", "event": "attempt_failed", "peer": "B", "mono": 11.0},
    ]
    assert resend_latencies(kills, records) == [0.5]


def test_peer_logs_give_the_drops_for_the_dead_trainer_and_the_stop_lines(tmp_path):
    import datetime

    killed = datetime.datetime(2026, 12, 1, 15, 0, 0).timestamp()
    counters = json.dumps({"expired": 1, "trainer_gone": 3})
    (tmp_path / "peer-s0-0.log").write_text(
        "2026-12-01 15:00:06,500 INFO peer.server: trainer T1 cannot be reached; dropping its micro-batches\n"
        "2026-12-01 15:00:06,600 INFO peer.server: trainer T1: dropped 3 stashed micro-batch(es) of it\n"
        "2026-12-01 15:00:07,000 INFO peer.server: trainer T0: dropped 5 stashed micro-batch(es) of it\n"
        f"2026-12-01 15:01:00,000 INFO peer.server: peer P stopping: stash 2, counters {counters}\n"
    )
    (tmp_path / "peer-s1-1-f1.log").write_text("no lines of interest\n")
    out = peer_log_figures(tmp_path, "T1", killed)
    assert out["dropped_for_dead_trainer"] == 3
    assert abs(out["drops"][0]["after_kill_s"] - 6.6) < 1e-6
    assert (out["peers_stopped"], out["stash_left_at_end"], out["stash_expired"]) == (1, 2, 1)


def test_render_reads_results_without_a_trainer_kill():
    layout = {
        "stages": 2,
        "peers_per_stage": 2,
        "steps": 10,
        "spec": {"optimizer": {"accumulate": 4}},
        "clean_stall_s": 1.0,
        "clean": {"eval_loss": 2.0},
        "chaos": {
            "kills": [{"what": "single"}],
            "longest_stall_s": 2.0,
            "resend_s": {"count": 0, "median": None, "max": None},
            "micro_batches": {"dropped": 0},
            "lost_stage_steps": 0,
            "lost_tokens": 0,
            "orphans": [],
            "leftovers": 0,
            "eval_loss": 2.02,
        },
    }
    text = render(
        {"steps": 10, "kill_every_s": 8, "snapshot_interval_s": 10, "machine": "m", "layouts": [layout]}
    )
    assert "| 2 x 2 | 1 (no wipe) |" in text and "+1.0%" in text and "Trainer kill" not in text


def test_a_replacement_log_tells_process_start_from_joining(tmp_path):
    import datetime

    log = tmp_path / "peer-s1-8-f1.log"
    log.write_text(
        "$ python -m swarm.cli peer --stage 1\n"
        "2026-12-01 15:00:20,000 INFO peer.server: DHT node up after 2.0 s\n"
        "2026-12-01 15:00:22,500 INFO peer.server: peer Q serving stage 1 of run chaos4\n"
        "peer Q serving stage 1 of run chaos4\n"
    )
    spawned = datetime.datetime(2026, 12, 1, 15, 0, 0).timestamp()
    entry = {"stage": 1, "log": str(log), "started": 5.0, "spawned_wall": spawned, "online_s": 23.0}
    out = replacement_phases(entry)
    assert abs(out["process_s"] - 18.0) < 1e-6 and abs(out["start_s"] - 4.5) < 1e-6
    assert "started" not in out and out["online_s"] == 23.0
    assert replacement_phases({"stage": 0, "error": "x"}) == {"stage": 0, "error": "x"}
