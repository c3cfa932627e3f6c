"""The peer's timeline (peer/timeline.py) and its analysis (benchmarks/timeline_analysis.py)."""

from __future__ import annotations

import json

import pytest

from benchmarks.timeline_analysis import Pass, build_passes, cores, hops, stage_table, steady_window
from peer.timeline import EVENTS, Timeline


def _events(stage: int, mb: str, kind: str, **times: float) -> list[dict]:
    return [{"t": t, "mb": mb, "pass": kind, "event": e, "stage": stage} for e, t in times.items()]


def test_timeline_records_and_writes_json_lines(tmp_path):
    tl = Timeline(max_events=3)
    tl.stage = 2
    tl.mark("a", "forward", "arrived", at=1.0)
    tl.mark("a", "forward", "queued", at=1.5)
    tl.mark("a", "forward", "started", at=2.0)
    tl.mark("a", "forward", "ended", at=3.0)  # bounded: the oldest event goes
    assert len(tl) == 3
    n = tl.write(tmp_path / "t" / "peer2.jsonl", peer="P")
    lines = (tmp_path / "t" / "peer2.jsonl").read_text().splitlines()
    assert n == 3 and json.loads(lines[0]) == {"peer": "P", "stage": 2, "events": 3}
    assert [json.loads(x)["event"] for x in lines[1:]] == ["queued", "started", "ended"]
    assert all(json.loads(x)["event"] in EVENTS for x in lines[1:])
    with pytest.raises(ValueError, match="max_events"):
        Timeline(max_events=0)


def test_build_passes_groups_events_and_keeps_the_first_time():
    ev = _events(0, "m", "forward", queued=1.0, started=2.0, ended=3.0) + _events(
        0, "m", "forward", ended=9.0
    )
    (p,) = build_passes(ev)
    assert (p.stage, p.mb, p.kind, p.queued, p.started, p.ended, p.arrived) == (
        0,
        "m",
        "forward",
        1.0,
        2.0,
        3.0,
        None,
    )
    assert p.ran and p.ready == 1.0


def test_stage_idle_is_split_by_cause():
    # one stage: a task 0-1; the next forward arrives at 2, is queued at 2.5, starts at 3, ends at 4;
    # then a backward is queued at 3.5 (behind the forward) and starts at 4.2 (hand-off 0.2), ends 5.
    passes = [
        Pass(1, "a", "forward", arrived=-0.1, queued=0.0, started=0.0, ended=1.0),
        Pass(1, "b", "forward", arrived=2.0, queued=2.5, started=3.0, ended=4.0),
        Pass(1, "a", "backward", arrived=3.4, queued=3.5, started=4.2, ended=5.0),
    ]
    row = stage_table(passes, (0.0, 5.0))[1]
    assert row["busy"] == pytest.approx((1 + 1 + 0.8) / 5)
    assert row["waiting for activations"] == pytest.approx(1.0 / 5)
    assert row["receiving (validate, decode)"] == pytest.approx(0.5 / 5)
    assert row["worker hand-off"] == pytest.approx((0.5 + 0.2) / 5)
    assert row["idle"] == pytest.approx(1 - row["busy"])
    assert row["busy"] + sum(
        v for k, v in row.items() if k.startswith(("waiting", "receiving", "worker"))
    ) == pytest.approx(1.0)
    assert row["queued_behind_s"] == pytest.approx(0.5 / 3)  # the backward waited 3.5-4.0 behind b
    assert row["tasks"] == 3
    with pytest.raises(ValueError, match="empty"):
        stage_table(passes, (1.0, 1.0))


def test_stage_zero_waits_for_the_trainer_and_backwards_for_a_gradient():
    passes = [
        Pass(0, "a", "forward", queued=0.0, started=0.0, ended=1.0),
        Pass(0, "b", "forward", arrived=2.0, queued=2.0, started=2.0, ended=3.0),
        Pass(0, "a", "backward", arrived=4.0, queued=4.0, started=4.0, ended=5.0),
    ]
    row = stage_table(passes, (0.0, 5.0))[0]
    assert row["waiting for the trainer"] == pytest.approx(0.2)
    assert row["waiting for a gradient"] == pytest.approx(0.2)


def test_hops_split_the_hand_off_to_the_loop_from_the_send():
    passes = [
        Pass(0, "a", "forward", started=0.0, ended=1.0, sending=1.1),
        Pass(1, "a", "forward", arrived=1.4, started=1.5, ended=2.0),  # the last stage: fwd+bwd
        Pass(1, "a", "backward", sending=2.0),  # its gradient's send
        Pass(0, "a", "backward", arrived=2.3, started=2.5, ended=3.0),
    ]
    h = hops(passes, (0.0, 10.0))
    assert h["0->1"]["to_loop_s"] == pytest.approx(0.1) and h["0->1"]["send_s"] == pytest.approx(0.3)
    assert h["1->0"]["hop_s"] == pytest.approx(0.3)


def test_cores_attribute_idle_cores_to_where_work_was():
    # two stages, two cores, 0..6 s. Stage 0 runs x 0-3, q 3-5 (queued since 1), y's backward 5-6
    # (queued since 3); stage 1 (the last) runs y 0-1, whose gradient is in transit 1-3.
    passes = [
        Pass(0, "x", "forward", queued=0.0, started=0.0, ended=3.0),
        Pass(1, "y", "forward", queued=0.0, started=0.0, ended=1.0),
        Pass(0, "q", "forward", queued=1.0, started=3.0, ended=5.0),
        Pass(0, "y", "backward", arrived=3.0, queued=3.0, started=5.0, ended=6.0),
    ]
    c = cores(passes, (0.0, 6.0), n_cores=2, dt=0.01)
    assert c["core_idle_share"] == pytest.approx(5 / 6, abs=0.01)
    causes = c["idle_causes"]
    assert causes["both"] == pytest.approx(2 / 6, abs=0.01)  # 1-3: q waits behind x, y in transit
    assert causes["stacked"] == pytest.approx(2 / 6, abs=0.01)  # 3-5: y waits behind q
    assert causes["between stages"] == pytest.approx(0.0, abs=0.01)
    assert causes["too few in flight"] == pytest.approx(1 / 6, abs=0.01)  # 5-6: only y's backward
    assert c["busy_cores"] == pytest.approx(7 / 6, abs=0.01)
    assert c["running_hist"]["1"] == pytest.approx(5 / 6, abs=0.01)
    assert c["running_hist"]["2"] == pytest.approx(1 / 6, abs=0.01)


def test_steady_window_skips_start_and_drain():
    passes = [Pass(0, f"m{i}", "forward", started=float(i), ended=i + 0.5) for i in range(20)]
    assert steady_window(passes, skip_first=3, skip_last=2) == (3.0, 17.0)
    with pytest.raises(ValueError, match="run more micro-batches"):
        steady_window(passes[:5], skip_first=3, skip_last=2)


def test_cpu_times_give_each_task_its_share_of_a_core():
    ev = _events(1, "m", "forward", queued=0.0, started=1.0, ended=3.0)
    ev[1]["cpu"], ev[2]["cpu"] = 10.0, 11.0  # 1 CPU second in 2 wall seconds
    (p,) = build_passes(ev)
    assert p.cpu_s == pytest.approx(1.0) and p.core_share == pytest.approx(0.5)
    assert stage_table([p], (0.0, 4.0))[1]["core_share"] == pytest.approx(0.5)
    assert cores([p], (0.0, 4.0), n_cores=2)["compute_cpu_cores"] == pytest.approx(0.25)
    tl = Timeline()
    tl.mark("m", "forward", "started", at=1.0, cpu=10.0)
    tl.mark("m", "forward", "queued", at=0.5)
    assert [r.get("cpu") for r in tl.records()] == [10.0, None]


def test_the_markdown_block_shows_runs_stages_and_hops():
    from benchmarks.timeline import markdown_block

    stage = {"busy": 0.8, "core_share": 0.9, "waiting for activations": 0.1, "queued_behind_s": 0.02}
    swarm = {
        "tokens_per_s": 900.0,
        "stages": {"0": stage, "1": stage},
        "hops": {"0->1": {"to_loop_s": 0.001, "send_s": 0.004, "hop_s": 0.005, "n": 3}},
        "cores": {
            "busy_cores": 1.8,
            "compute_cpu_cores": 1.7,
            "core_idle_share": 0.2,
            "idle_causes": {"stacked": 0.1, "between stages": 0.05, "both": 0.05, "too few in flight": 0.0},
        },
    }
    run = {
        "swarm": swarm,
        "pipelining": {"tokens_per_s": 1000.0, "busy_cores": 1.95},
        "load_start": [2.0, 1, 1],
    }
    text = markdown_block({"before": {"runs": [run, run]}}, reading="**Reading.**")
    assert (
        "| before (2 runs) | 900 | 1000 | 0.90 | 1.80 | 1.70 | 1.95 | 20% | 10% / 5% / 5% / 0% | 2.0, 2.0 |"
        in text
    )
    assert "| before | 1 | 80% | 90% | 10% | 0% | 0% | 0% | 20 |" in text
    assert "| before | 1.0 + 4.0 |" in text and text.rstrip().endswith("**Reading.**")


def test_steal_share_is_the_stolen_part_of_the_ticks_between_readings():
    from benchmarks.timeline import steal_share

    assert steal_share((10, 1000), (40, 1300)) == pytest.approx(0.1)
    assert steal_share((5, 100), (5, 100)) is None  # no ticks passed: no share


def test_timeline_refuses_to_run_neither_side(capsys):
    from benchmarks.timeline import main

    with pytest.raises(SystemExit) as e:
        main(["--no-swarm", "--no-pipelining"])
    assert e.value.code == 2
    assert "--no-swarm with --no-pipelining leaves nothing to run" in capsys.readouterr().err


@pytest.mark.slow
def test_timeline_benchmark_smoke(tmp_path):
    """A tiny swarm with timelines and a tiny 1F1B on loopback: the analysis and the chart come out."""
    from benchmarks.links import LinksConfig
    from benchmarks.timeline import gantt, run_once
    from swarm.run.spec import RunSpec
    from tests.test_bench_smoke import TINY

    spec = tmp_path / "tiny.json"
    spec.write_bytes(RunSpec.from_dict(TINY).canonical_bytes())
    cfg = LinksConfig(
        spec_path=str(spec),
        rates=("none",),
        accumulate=2,
        throughput_mb=24,
        warmup_mb=2,
        pipe_n_micro=2,
        max_inflight=4,
        loopback=True,
        data_bytes=100_000,
        start_timeout_s=120,
        run_timeout_s=120,
    )
    r = run_once(cfg, tmp_path / "work", swarm=True, pipelining=True, mb=24, pipelining_first=True)
    assert r["order"] == "1f1b first"
    passes = r.pop("_passes")
    s = r["swarm"]
    assert s["tokens_per_s"] > 0 and set(s["stages"]) == {"0", "1"}
    assert all(0 < row["busy"] <= 1 for row in s["stages"].values())
    assert 0 < s["cores"]["busy_cores"] <= 2 and s["cores"]["compute_cpu_cores"] > 0
    assert set(s["hops"]) == {"0->1", "1->0"}
    assert r["pipelining"]["tokens_per_s"] > 0 and r["pipelining"]["busy_cores"] > 0
    for side in (s, r["pipelining"]):  # /proc/stat's steal share over each side's own run
        assert side["steal"] is None or 0.0 <= side["steal"] < 1.0
    gantt(passes, tuple(s["window"]), tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 1000
