"""The convergence benchmark (benchmarks/convergence.py): its plan, rules and analysis on hand-built
records, and (slow) one tiny run end to end: a one-process reference and a real loopback swarm, the
exported model evaluated on the same held-out windows, the JSON, the plot and the markdown section."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest

from benchmarks.convergence import (
    ConvergenceConfig,
    Job,
    analyse,
    bin_curve,
    configurations,
    held_out_fraction,
    job_spec,
    markdown_section,
    parse_override,
    plan,
    resolve_corpus,
    target_for,
)
from swarm.errors import ConfigError

TINY = {
    "run_id": "conv-smoke",
    "seed": 0,
    "model": {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
    "stages": 2,
    "codecs": {"activations": "none", "gradients": "none"},
    "optimizer": {"name": "adamw", "lr": 3e-3, "clip_norm": 1.0, "accumulate": 2, "mode": "sync"},
    "micro_batch_size": 2,
}


# ------------------------------------------------------------------------------------------- plan


def test_plan_covers_the_issue_matrix():
    cfg = ConvergenceConfig()
    jobs = plan(cfg)
    assert len({j.key for j in jobs}) == len(jobs) == 2 * 3 * 18
    confs = {j.config for j in jobs}
    swarms = {f"p{p}-{m}-{c}" for p in (1, 2, 4) for m in ("sync", "async") for c in ("none", "blockwise8")}
    assert confs == swarms | {
        "ref-stage",
        "ref-adamw",
        "ref-stage-ss32",
        "p1-sync-blockwise8-ss32",
        "p1-async-blockwise8-ss32",
        "p2-async-blockwise8-churn",
    }
    # per corpus and seed, the references run first, so that a partial run has its ratios early
    group = [j for j in jobs if j.corpus == "pydoc" and j.seed == 1]
    assert [j.kind for j in group[:3]] == ["reference"] * 3 and all(j.kind == "swarm" for j in group[3:])
    assert {j.corpus for j in jobs} == {"stdlib", "pydoc"} and {j.seed for j in jobs} == {0, 1, 2}


def test_plan_selection_brings_its_reference():
    cfg = ConvergenceConfig(seeds=(0,), corpora=("stdlib",))
    assert [j.config for j in plan(cfg, ["p1-*-ss32"])] == [
        "ref-stage-ss32",
        "p1-sync-blockwise8-ss32",
        "p1-async-blockwise8-ss32",
    ]
    assert [j.config for j in plan(cfg, ["p2-async-none"])] == ["ref-stage", "p2-async-none"]
    with pytest.raises(ConfigError, match="matches no configuration; they are: ref-stage"):
        plan(cfg, ["p3-*"])


def test_other_codecs_make_their_own_configurations():
    cfg = ConvergenceConfig(seeds=(0,), corpora=("stdlib",), codecs=("blockwise4", "lowrank"))
    assert [j.config for j in plan(cfg, ["p1-sync-lowrank", "p1-sync-blockwise4"])] == [
        "ref-stage",
        "p1-sync-blockwise4",
        "p1-sync-lowrank",
    ]
    spec = job_spec(cfg, plan(cfg, ["p1-sync-lowrank"])[1])
    assert spec.codecs.activations == "lowrank" and spec.codecs.gradients == "lowrank"


def test_targets_follow_the_layout():
    assert target_for(Job("swarm", peers=1, mode="sync", codec="none")) == 1.01
    assert target_for(Job("swarm", peers=1, mode="async", codec="blockwise8", subspace=32)) == 1.02
    assert target_for(Job("swarm", peers=4, mode="sync", codec="none")) == 1.02
    assert target_for(Job("swarm", peers=2, mode="async", codec="none")) == 1.03
    assert target_for(Job("swarm", peers=2, mode="async", codec="blockwise8", churn=True)) == 1.04
    assert target_for(Job("reference", optimizer="stage")) is None


def test_job_specs_change_only_seed_codec_mode_and_model():
    cfg = ConvergenceConfig(overrides={"optimizer.accumulate": 2, "optimizer.lr": 2e-3})
    ref = job_spec(cfg, Job("reference", seed=2, optimizer="stage"))
    sw = job_spec(cfg, Job("swarm", seed=2, peers=2, mode="async", codec="blockwise8", subspace=32))
    assert ref.seed == sw.seed == 2 and ref.optimizer.lr == sw.optimizer.lr == 2e-3
    assert sw.codecs.activations == sw.codecs.gradients == "blockwise8" and sw.optimizer.mode == "async"
    assert ref.model.subspace_rank is None and sw.model.subspace_rank == sw.model.d_model // 32
    assert ref.optimizer.name == sw.optimizer.name  # whatever the spec file says
    with pytest.raises(ConfigError, match="multiple of optimizer.accumulate = 2"):
        job_spec(ConvergenceConfig(micro_batches=601), Job("reference", optimizer="stage"))
    with pytest.raises(ConfigError, match="not a section"):
        job_spec(ConvergenceConfig(overrides={"optimiser.lr": 1.0}), Job("reference", optimizer="stage"))
    assert parse_override("optimizer.lr=2e-3") == ("optimizer.lr", 2e-3)
    assert parse_override("optimizer.clip_norm=null") == ("optimizer.clip_norm", None)
    with pytest.raises(ConfigError, match="KEY|dotted"):
        parse_override("lr")


def test_config_rules_name_the_value():
    with pytest.raises(ConfigError, match="churn_peers = 1"):
        ConvergenceConfig(churn_peers=1)
    with pytest.raises(ConfigError, match="mode 'lockstep'"):
        ConvergenceConfig(modes=("lockstep",))
    assert "p2-async-blockwise8-churn" not in {
        j.config for j in configurations(ConvergenceConfig(churn_every_s=None))
    }


# ------------------------------------------------------------------------------------------ corpora


def test_held_out_fraction_holds_the_eval_windows():
    # 64 micro-batches of 8 x 128: 512 windows of 129 tokens need ~66k held-out tokens
    assert held_out_fraction(4_194_304, eval_tokens=65536, batch=8, seq_len=128) == 0.05
    frac = held_out_fraction(757_011, eval_tokens=65536, batch=8, seq_len=128)
    assert 0.05 < frac < 0.1 and int(757_011 * frac) >= 513 * 129
    with pytest.raises(ConfigError, match="cannot hold 65536 held-out tokens"):
        held_out_fraction(100_000, eval_tokens=65536, batch=8, seq_len=128)


def test_corpora_resolve_or_say_what_to_do(tmp_path):
    cfg = ConvergenceConfig(corpus_paths={"mine": str(tmp_path)})
    assert resolve_corpus(cfg, "stdlib").source is None
    assert resolve_corpus(cfg, "mine").source == str(tmp_path)
    with pytest.raises(ConfigError, match="--corpus books=PATH"):
        resolve_corpus(cfg, "books")
    with pytest.raises(ConfigError, match="no such file"):
        resolve_corpus(ConvergenceConfig(corpus_paths={"x": str(tmp_path / "nope")}), "x")
    pydoc = resolve_corpus(cfg, "pydoc")  # part of CPython's standard library
    assert pydoc.source.endswith("topics.py")


# ----------------------------------------------------------------------------------------- analysis


def _record(job: Job, eval_loss: float | None, **kw) -> dict:
    rec = {"key": job.key, "config": job.config, "job": asdict(job), "eval_loss": eval_loss, "wall_s": 10.0}
    rec.update(kw)
    return rec


def test_analyse_ratio_mean_and_spread_per_corpus():
    ref_losses = {0: 2.0, 1: 2.2, 2: 2.4}
    results = []
    for seed, loss in ref_losses.items():
        results.append(_record(Job("reference", seed=seed, optimizer="stage"), loss))
        sync = Job("swarm", seed=seed, peers=1, mode="sync", codec="none")
        results.append(_record(sync, loss * (1.0, 1.01, 1.02)[seed], tokens_per_s=100.0 + seed))
        asyn = Job("swarm", seed=seed, peers=2, mode="async", codec="none")
        results.append(_record(asyn, loss * 1.05))
    # a run on another corpus whose reference is missing: no ratio, no verdict
    results.append(_record(Job("swarm", corpus="pydoc", peers=1, mode="sync", codec="none"), 3.0))
    results.append({"key": "p4-sync-none/stdlib/seed0", "config": "p4-sync-none", "job": {}, "error": "boom"})
    a = analyse(results)
    rows = {(r["config"], r["corpus"]): r for r in a["rows"]}
    sync = rows[("p1-sync-none", "stdlib")]
    assert sync["ratio_seeds"] == 3 and sync["seeds"] == [0, 1, 2]
    assert sync["ratio_mean"] == pytest.approx(1.01)
    assert (sync["ratio_min"], sync["ratio_max"]) == (pytest.approx(1.0), pytest.approx(1.02))
    assert sync["ratio_sd"] == pytest.approx(0.01)
    assert (
        sync["target"] == 1.01 and sync["met"] is True and sync["tokens_per_s_mean"] == pytest.approx(101.0)
    )
    asyn = rows[("p2-async-none", "stdlib")]
    assert asyn["ratio_mean"] == pytest.approx(1.05) and asyn["target"] == 1.03 and asyn["met"] is False
    assert rows[("ref-stage", "stdlib")]["ratio_mean"] is None  # its own reference
    orphan = rows[("p1-sync-none", "pydoc")]
    assert orphan["ratio_mean"] is None and orphan["met"] is None
    assert (a["met"], a["missed"]) == (1, 1) and a["failed"] == [
        {"key": "p4-sync-none/stdlib/seed0", "error": "boom"}
    ]
    # rows: corpus, then the matrix order (references first)
    assert [r["config"] for r in a["rows"] if r["corpus"] == "stdlib"] == [
        "ref-stage",
        "p1-sync-none",
        "p2-async-none",
    ]


def test_markdown_section_states_ratios_and_verdicts():
    results = [
        _record(Job("reference", optimizer="stage"), 2.0, tokens_per_s=9000.0),
        _record(Job("swarm", peers=2, mode="async", codec="blockwise8"), 2.1, tokens_per_s=1234.0),
    ]
    report = {
        "name": "convergence",
        "command": "python -m benchmarks.convergence",
        "config": asdict(ConvergenceConfig()),
        "machine": {
            "cpu": "cpu",
            "cpu_count": 2,
            "memory_gib": 8,
            "torch": "2",
            "hivemind": "1",
            "python": "3",
            "load_start": "0",
        },
        "n_params": 900_000,
        "num_stages": 2,
        "micro_batch": "8x128",
        "tokens_per_mb": 1024,
        "optimizer": {"name": "adamw"},
        "corpora": {
            "stdlib": {"name": "stdlib", "about": "stdlib", "tokens": 4e6, "held_out_tokens": 200_000}
        },
        "results": results,
        "analysis": analyse(results),
        "plots": ["benchmarks/results/convergence_loss_tokens.png"],
        "reading": "It is what it is.",
    }
    text = markdown_section(report)
    assert text.startswith("## Convergence\n")
    # one seed, one corpus: never to be read as the benchmark itself
    assert "**Not the full protocol** (1 seed(s) instead of 3; 1 corpus instead of 2)" in text
    assert (
        "| p2-async-blockwise8 | stdlib | 1 | 2.1000 | 1.0500 | - | 1.03 | **missed** (1 seed) | 1234, - |"
        in text
    )
    assert "2 stages x 2 peers async layout" in text and "1234 tokens/s (stdlib)" in text
    assert "![loss vs tokens](benchmarks/results/convergence_loss_tokens.png)" in text
    assert text.rstrip().endswith("It is what it is.")


def test_bin_curve_keeps_means_of_equal_parts():
    pts = [{"tokens": 10 * i, "wall_s": float(i), "loss": float(i)} for i in range(1, 11)]
    assert bin_curve(pts, max_points=20) == pts
    binned = bin_curve(pts, max_points=5)
    assert [p["tokens"] for p in binned] == [20, 40, 60, 80, 100]
    assert [p["loss"] for p in binned] == [1.5, 3.5, 5.5, 7.5, 9.5]


# -------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_convergence_benchmark_end_to_end(tmp_path):
    """A reference and a one-peer-per-stage sync swarm on a tiny model: in sync mode without a codec the
    swarm computes exactly what one process computes, so the exported model's held-out loss matches."""
    from benchmarks.convergence import run_matrix
    from swarm.run.spec import RunSpec

    spec_path = tmp_path / "tiny.json"
    spec_path.write_bytes(RunSpec.from_dict(TINY).canonical_bytes())
    cfg = ConvergenceConfig(
        spec_path=str(spec_path),
        overrides={},
        micro_batches=16,
        eval_tokens=256,
        seeds=(0,),
        corpora=("stdlib",),
        data_bytes=100_000,
        throughput_warmup_mb=4,
        throughput_window_mb=4,
        start_timeout_s=120,
        run_timeout_s=240,
    )
    jobs = plan(cfg, ["p1-sync-none"])
    lines: list[str] = []
    report = run_matrix(cfg, jobs, name="conv_smoke", command="test", say=lines.append, results_dir=tmp_path)
    assert [r.get("error") for r in report["results"]] == [None, None], lines
    ref, swarm = report["results"]
    for r in (ref, swarm):
        assert r["tokens"] == 16 * 2 * 16 and r["held_out_tokens"] == 256
        assert math.isfinite(r["eval_loss"]) and 0 < r["eval_loss"] < math.log(256) + 1
        assert r["losses"] and r["wall_s"] > 0
    assert swarm["completed"] == 16 and swarm["dropped"] == 0 and swarm["tokens_per_s"] > 0
    assert [s["step_count"] for s in swarm["export"]["stages"]] == [8, 8]
    assert swarm["leftover_pids"] == [] and swarm["peers_killed"] == 0
    # each stage peer's stop line was found; one peer per stage steps alone: no rounds
    assert {s: [c["rounds"] for c in peers] for s, peers in swarm["rounds"].items()} == {"0": [0], "1": [0]}
    [row] = [r for r in report["analysis"]["rows"] if r["config"] == "p1-sync-none"]
    assert row["ratio_mean"] == pytest.approx(1.0, abs=1e-3) and row["met"] is True
    stored = json.loads((tmp_path / "conv_smoke.json").read_text())
    assert [r["key"] for r in stored["results"]] == ["ref-stage/stdlib/seed0", "p1-sync-none/stdlib/seed0"]
    assert (tmp_path / "conv_smoke_loss_tokens.png").stat().st_size > 0
    assert "| p1-sync-none | stdlib | 1 |" in markdown_section(report)
    assert any("held-out" in line for line in lines)
    # another protocol does not mix into the same file
    with pytest.raises(ConfigError, match="another protocol"):
        run_matrix(
            ConvergenceConfig(**{**cfg.__dict__, "micro_batches": 32}),
            [],
            name="conv_smoke",
            command="test",
            say=lines.append,
            results_dir=tmp_path,
        )
