"""Smoke tests of the time-to-target benchmark (benchmarks/time_to_target.py, time_to_target_report.py,
pipe_heldout.py): the pure parts on made-up records, and the whole path on a tiny model (in the network
lab at 20mbit when it can run here, else on loopback). They check the report's shape, never speeds."""

from __future__ import annotations

import pytest

from benchmarks.netlab import lab_unavailable_reason
from swarm.errors import ConfigError

TINY = {
    "run_id": "ttt-smoke",
    "seed": 0,
    "model": {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
    "stages": 2,
    "codecs": {"activations": "none", "gradients": "none"},
    "optimizer": {"name": "adamw", "lr": 1e-3, "clip_norm": 1.0, "mode": "sync"},
    "micro_batch_size": 2,
}


def test_parse_swarm_configurations_and_their_rules():
    from benchmarks.time_to_target import SwarmSetup, parse_swarm

    assert parse_swarm("blockwise8:async") == SwarmSetup("blockwise8", "async", None)
    assert parse_swarm("ss32+blockwise8:sync") == SwarmSetup("blockwise8", "sync", 32)
    assert parse_swarm("ss32+blockwise8:sync").label == "subspace d/32 + blockwise8 sync"
    for bad in ("blockwise8", "blockwise8:fast", "nocodec:async", "ssx+blockwise8:async", "ss0+none:sync"):
        with pytest.raises(ConfigError, match="CODEC:MODE"):
            parse_swarm(bad)


def test_config_rules_and_plan_order():
    from benchmarks.time_to_target import TargetConfig, plan

    with pytest.raises(ConfigError, match="multiple of accumulate"):
        TargetConfig(target_mb=10, accumulate=4)
    with pytest.raises(ConfigError, match="--loopback"):
        TargetConfig(loopback=True, rates=("20mbit",))
    with pytest.raises(ConfigError, match="max_factor"):
        TargetConfig(max_factor=0.5)
    cfg = TargetConfig(rates=("100mbit", "20mbit"), swarms=("blockwise8:async", "ss32+blockwise8:async"))
    jobs = plan(cfg)
    assert [j.kind for j in jobs] == ["single"] + ["pipelining", "swarm", "swarm"] * 2
    assert jobs[0].micro_batches == cfg.target_mb
    assert {j.micro_batches for j in jobs[1:]} == {cfg.cap_steps * cfg.accumulate}
    assert [j.rate for j in jobs[1:]] == ["100mbit"] * 3 + ["20mbit"] * 3
    assert jobs[2].subspace is None and jobs[3].subspace == 32


def test_pipelining_target_needs_evaluations():
    from benchmarks.pipelining_baseline import PipeConfig

    with pytest.raises(ConfigError, match="eval_every"):
        PipeConfig(spec_path="x", target_loss=3.0)


def test_swarm_stop_on_an_evaluation_or_the_time_cap():
    from benchmarks.time_to_target import swarm_stop

    stop = swarm_stop(3.0, max_train_s=100.0)
    step = {
        "type": "step",
        "step": 1,
        "time": 12.0,
        "tokens": 1000,
        "tokens_per_s": 500.0,
    }  # first send at 10 s
    assert not stop([step, {"type": "eval", "eval_loss": 3.2}])
    assert stop([step, {"type": "eval", "eval_loss": 2.99}])
    assert not stop([step, {"type": "eval", "eval_loss": None}])
    assert stop([step, {**step, "step": 9, "time": 110.0}])  # 100 s after the first send
    assert not stop([step, {**step, "step": 9, "time": 109.0}])


def _report(pipe_losses, swarm_evals, target=3.0):
    return {
        "target_loss": target,
        "results": [
            {"kind": "single", "eval_loss": target},
            {"kind": "pipelining", "rate": "20mbit", "losses": pipe_losses, "tokens_per_s": 100.0},
            {
                "kind": "swarm",
                "rate": "20mbit",
                "codec": "blockwise8",
                "mode": "async",
                "first_send_s": 5.0,
                "evals": swarm_evals,
            },
        ],
    }


def test_analyse_times_tokens_and_the_ratio():
    from benchmarks.time_to_target import TargetConfig
    from benchmarks.time_to_target_report import analyse, curve

    pipe = [
        {"tokens": 100, "wall_s": 12.0, "train_s": 10.0, "loss": 4.0, "eval_loss": 3.5, "eval_s": 2.0},
        {"tokens": 200, "wall_s": 24.0, "train_s": 20.0, "loss": 3.5},  # no evaluation at this step
        {"tokens": 300, "wall_s": 36.0, "train_s": 30.0, "loss": 3.1, "eval_loss": 3.002, "eval_s": 2.0},
    ]
    swarm = [
        {"step": 1, "tokens": 100, "wall_s": 8.0, "eval_loss": 3.4},
        {"step": 2, "tokens": 400, "wall_s": 15.0, "eval_loss": 2.9},
    ]
    report = _report(pipe, swarm)
    assert [p["s"] for p in curve(report["results"][1])] == [10.0, 30.0]
    assert [p["s"] for p in curve(report["results"][2])] == [3.0, 10.0]  # minus the first send
    a = analyse(TargetConfig(tolerance=1e-3), report)
    pipe_run, swarm_run = a["runs"]
    assert pipe_run["reached"] and pipe_run["s_to_target"] == 30.0 and pipe_run["tokens_to_target"] == 300
    assert pipe_run["s_to_target_with_evals"] == 38.0
    assert swarm_run["s_to_target"] == 10.0 and swarm_run["tokens_to_target"] == 400
    assert a["per_rate"]["20mbit"]["ratio_1f1b_over_best_swarm"] == pytest.approx(3.0)
    assert a["summary"]["met"] is True
    # 1F1B that never reaches the target: no ratio, a lower bound from the time it trained
    a = analyse(TargetConfig(tolerance=0.0), report)
    assert not a["runs"][0]["reached"] and a["per_rate"]["20mbit"]["ratio_1f1b_over_best_swarm"] is None
    assert a["per_rate"]["20mbit"]["ratio_at_least"] == pytest.approx(3.0)


def test_a_sync_swarms_paused_evaluations_leave_its_clock():
    """Rounds that training waited for (``paused``) are taken out of a swarm's clock, as 1F1B's are;
    overlapping ones (async) stay in."""
    from benchmarks.time_to_target_report import curve

    swarm = [
        {"step": 1, "tokens": 100, "wall_s": 8.0, "eval_loss": 3.4, "eval_s": 1.0, "paused": True},
        {"step": 2, "tokens": 200, "wall_s": 15.0, "eval_loss": 2.9, "eval_s": 1.5, "paused": True},
    ]
    pts = curve(_report([], swarm)["results"][2])
    assert [p["s"] for p in pts] == [2.0, 7.5]  # minus the first send (5 s) and the rounds so far
    assert [p["s_with_evals"] for p in pts] == [3.0, 10.0]
    overlapping = [dict(e, paused=False) for e in swarm]
    assert [p["s"] for p in curve(_report([], overlapping)["results"][2])] == [3.0, 10.0]


@pytest.mark.slow
def test_time_to_target_benchmark_smoke(tmp_path):
    """The whole benchmark on a tiny model: reference, 1F1B and two swarm configurations, each stopped
    at the target; the analysis, the plot and the markdown section."""
    from benchmarks.time_to_target import TargetConfig, plan, run_all
    from benchmarks.time_to_target_report import SECTION, markdown_section
    from swarm.run.spec import RunSpec

    spec = tmp_path / "tiny.json"
    spec.write_bytes(RunSpec.from_dict(TINY).canonical_bytes())
    shaped = lab_unavailable_reason(probe=True) is None
    cfg = TargetConfig(
        spec_path=str(spec),
        rates=("20mbit",) if shaped else ("none",),
        swarms=("blockwise8:async", "ss4+blockwise8:sync"),
        accumulate=2,
        target_mb=8,
        eval_every=1,
        eval_batches=2,
        max_train_s=60,
        loopback=not shaped,
        data_bytes=100_000,
        start_timeout_s=120,
        run_timeout_s=180,
    )
    report = run_all(
        cfg, plan(cfg), name="ttt_smoke", command="test", results_dir=tmp_path, say=lambda _: None
    )
    assert not [r["error"] for r in report["results"] if r.get("error")]
    a = report["analysis"]
    assert a["target_loss"] == report["results"][0]["eval_loss"] > 0
    assert [x["kind"] for x in a["runs"]] == ["pipelining", "swarm", "swarm"]
    for x in a["runs"]:
        assert x["evaluations"] >= 1 and x["best_loss"] is not None
        if x["reached"]:
            assert x["best_loss"] <= a["goal_loss"] and x["s_to_target"] >= 0 and x["tokens_to_target"] > 0
        else:  # stopped at a cap: it trained that long
            assert (
                x["tokens_trained"] >= cfg.cap_steps * cfg.accumulate * 32 or x["clock_s"] >= cfg.max_train_s
            )
    pipe = a["runs"][0]
    # 1F1B is the reference's training in another order: it reaches the target at N (or one evaluation later)
    assert pipe["reached"] and pipe["tokens_to_target"] <= report["target_tokens"] + 2 * 32
    swarm_runs = [r for r in report["results"] if r.get("kind") == "swarm"]
    assert all(r["stopped_early"] or r["evals"] for r in swarm_runs)
    rate = cfg.rates[0]
    assert set(a["per_rate"]) == {rate}
    assert (tmp_path / "ttt_smoke.png").exists() and (tmp_path / "ttt_smoke.json").exists()
    section = markdown_section(report)
    assert section.startswith(SECTION) and "1F1B s / swarm s" in section


def test_swarm_figures_keep_evaluations_and_the_first_send(tmp_path):
    from benchmarks.links import read_records, swarm_figures

    records = [
        {"type": "event", "event": "start", "time": 0.0},
        {
            "type": "step",
            "step": 1,
            "tokens": 100,
            "time": 7.0,
            "tokens_per_s": 50.0,
            "loss": 5.0,
        },  # sent at 5 s
        {"type": "eval", "step": 1, "tokens": 100, "time": 8.0, "eval_loss": 4.5},
        {"type": "step", "step": 2, "tokens": 200, "time": 9.0, "tokens_per_s": 50.0, "loss": 4.0},
    ]
    fig = swarm_figures(records, {}, tokens_per_mb=50, warmup_mb=0, window_mb=2)
    assert fig["first_send_s"] == 5.0
    assert fig["evals"] == [
        {"step": 1, "tokens": 100, "wall_s": 8.0, "eval_loss": 4.5, "eval_s": None, "paused": False}
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"type": "step", "step": 1}\n{"type": "st')  # a line still being written
    assert read_records(path) == [{"type": "step", "step": 1}]
    assert read_records(tmp_path / "missing.jsonl") == []
