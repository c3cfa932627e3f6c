"""The async replay benchmark (benchmarks/async_replay.py): its schedules as data, and a tiny end-to-end run."""

from __future__ import annotations

import json

import pytest

from benchmarks.async_replay import (
    Action,
    OptimizerChoice,
    main,
    merge_reports,
    simulated_schedule,
    staleness_profile,
    steady_schedule,
    sync_schedule,
    trainer_inflight,
)
from swarm.errors import ConfigError
from swarm.run.spec import OptimizerConfig

TINY = {
    "run_id": "replay-smoke",
    "seed": 0,
    "model": {"vocab_size": 256, "d_model": 32, "n_layers": 3, "n_heads": 2, "seq_len": 16},
    "stages": 3,
    "codecs": {"activations": "none", "gradients": "none"},
    "optimizer": {"name": "adamw", "lr": 3e-3},
    "micro_batch_size": 2,
}


def _check_valid(schedule: list[Action], num_stages: int, n: int) -> None:
    """Each micro-batch passes every stage once each way, and no action runs before its input exists."""
    last = num_stages - 1
    done: set[tuple[int, str, int]] = set()
    for a in schedule:
        if a.kind in ("F", "L"):
            assert a.kind == ("L" if a.stage == last else "F"), a
            assert a.stage == 0 or (a.stage - 1, "F", a.mb) in done, a
        else:
            assert a.stage < last and (a.stage + 1, "L" if a.stage + 1 == last else "B", a.mb) in done, a
        key = (a.stage, a.kind, a.mb)
        assert key not in done, a
        done.add(key)
    assert len(done) == n * (2 * num_stages - 1)


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_schedules_are_valid_and_print_as_actions(num_stages):
    for schedule in (
        steady_schedule(num_stages, 9, inflight=3),
        sync_schedule(num_stages, 9, window=2),
        simulated_schedule(num_stages, 9, inflight=3),
        simulated_schedule(num_stages, 9, inflight=2, latency=2.0, recompute=False),
    ):
        _check_valid(schedule, num_stages, 9)
    assert (
        " ".join(map(str, steady_schedule(2, 4, inflight=2)))
        == "0F0 1L0 0F1 1L1 0B0 0F2 1L2 0B1 0F3 1L3 0B2 0B3"
    )


def test_steady_staleness_is_the_caps_worst_case_and_sync_has_none():
    # (inflight - 1) other backwards between a micro-batch's forward and backward at every stage but the last
    assert staleness_profile(steady_schedule(3, 2001, inflight=3), 3, 2) == pytest.approx([1, 1, 0], abs=2e-3)
    assert staleness_profile(steady_schedule(2, 1000, inflight=3), 2, 1) == pytest.approx([2, 0], abs=3e-3)
    assert staleness_profile(sync_schedule(3, 100, window=2), 3, 2) == [0, 0, 0]
    # the simulated trainer (backwards first, refill on stage 0's report) stays under the cap
    sim = staleness_profile(simulated_schedule(2, 600, inflight=3), 2, 2)
    assert 0 < sim[0] <= 1 and sim[1] == 0


def test_simulated_schedule_keeps_at_most_inflight_micro_batches_open():
    open_: set[int] = set()
    for a in simulated_schedule(3, 50, inflight=3, latency=1.0):
        if a.stage == 0 and a.kind == "F":
            open_.add(a.mb)
            assert len(open_) <= 3
        if a.stage == 0 and a.kind == "B":
            open_.remove(a.mb)


def test_trainer_inflight_follows_the_staleness_cap():
    assert trainer_inflight(OptimizerConfig(accumulate=2, max_versions=3), 2) == 3
    assert trainer_inflight(OptimizerConfig(accumulate=1, max_versions=3), 4) == 2
    assert trainer_inflight(OptimizerConfig(accumulate=4, max_versions=8), 2) == 8  # max_inflight
    assert trainer_inflight(OptimizerConfig(accumulate=1), 1) == 8


def test_optimizer_choice_parses_overrides_and_names_the_rule():
    c = OptimizerChoice.parse("muon:muon_lr=0.02,warmup_steps=5")
    assert (c.name, c.overrides) == ("muon", {"muon_lr": 0.02, "warmup_steps": 5})
    with pytest.raises(ConfigError, match="key=value"):
        OptimizerChoice.parse("muon:0.02")


@pytest.mark.integration
def test_replay_end_to_end_on_a_tiny_run(tmp_path, capsys):
    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps(TINY))
    out = tmp_path / "r.json"
    argv = ["--spec", str(spec), "--micro-batches", "8", "--seeds", "0", "1", "--eval-batches", "2"]
    argv += ["--data-bytes", "200000", "--no-markdown", "--out", str(out), "--log-every", "4"]
    argv += ["--optimizer", "torch-adamw", "--optimizer", "adamw", "--optimizer", "muon:muon_lr=0.01"]
    argv += ["--modes", "single", "sync", "async", "--skip", "single adamw"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    rows = report["summary"]["rows"]
    muon = "muon:muon_lr=0.01"
    assert set(rows) == {
        "single torch-adamw",
        f"single {muon}",
        *(f"{m} {o}" for m in ("sync", "async") for o in ("adamw", muon)),
    }
    for seed in ("0", "1"):
        # the same math twice: in one process (torch's AdamW; the stage optimizers) and as a sync swarm
        for pair in (("single torch-adamw", "sync adamw"), (f"single {muon}", f"sync {muon}")):
            losses = [report["runs"][label][seed]["evals"][-1]["loss"] for label in pair]
            assert abs(losses[0] - losses[1]) < 1e-4, (pair, losses)
        for opt in ("adamw", muon):
            run = report["runs"][f"async {opt}"][seed]
            assert run["steps"] == [4, 4, 4] and run["staleness_mean"][-1] == 0
            assert 0 < run["staleness_mean"][0] <= 1  # 3 in flight, accumulate 2: stale by one version
    assert set(report["summary"]["async_over_sync"]) == {"async adamw", f"async {muon}"}
    printed = capsys.readouterr().out
    assert "| run | held-out loss: mean" in printed and "async adamw / sync adamw <= 1.02" in printed


def test_replay_simulated_mode_reports_its_staleness(tmp_path):
    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps({**TINY, "stages": 2, "model": {**TINY["model"], "n_layers": 2}}))
    out = tmp_path / "r.json"
    argv = [
        "--spec",
        str(spec),
        "--micro-batches",
        "8",
        "--seeds",
        "0",
        "--eval-batches",
        "1",
        "--no-markdown",
    ]
    argv += [
        "--data-bytes",
        "200000",
        "--out",
        str(out),
        "--optimizer",
        "muon",
        "--modes",
        "sync",
        "async-sim",
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    run = report["runs"]["async-sim muon"]["0"]
    assert 0 < run["staleness_mean"][0] < 1 and run["inflight"] == 3
    assert "async-sim" in report["config"]["async_staleness"]
    assert "async-sim muon" in report["summary"]["async_over_sync"]


def test_merge_reports_joins_seeds_and_recomputes_the_ratios():
    def report(seed: str, sync: float, asyn: float, ref: float) -> dict:
        runs = {
            "single torch-adamw": {seed: {"evals": [{"loss": ref}]}},
            "sync muon": {seed: {"evals": [{"loss": sync}]}},
            "async muon": {seed: {"evals": [{"loss": asyn}]}},
        }
        config = {"spec": "x", "micro_batches": 4, "accumulate": 2, "warmup_steps": 0, "eval_tokens": 8}
        config |= {"wire_codecs": False, "references": ["single torch-adamw"], "optimizers": ["muon"]}
        return {"command": f"seed {seed}", "config": config, "runs": runs, "summary": {"default": "adamw"}}

    merged = merge_reports([report("0", 1.0, 1.01, 2.0), report("1", 1.0, 1.05, 2.0)])
    assert merged["summary"]["seeds"] == ["0", "1"]
    ratio = merged["summary"]["async_over_sync"]["async muon"]
    assert ratio["per_seed"] == pytest.approx([1.01, 1.05]) and ratio["mean"] == pytest.approx(1.03)
    assert merged["summary"]["rows"]["sync muon"]["vs single torch-adamw"]["mean"] == pytest.approx(0.5)
    assert not merged["summary"]["checks"]["async muon / sync muon <= 1.02"]["met"]
    other = report("2", 1.0, 1.0, 2.0)
    other["config"]["micro_batches"] = 8
    with pytest.raises(ConfigError, match="different setups"):
        merge_reports([report("0", 1.0, 1.0, 2.0), other])
