"""Smoke tests of the links benchmark (benchmarks/netlab.py, pipelining_baseline.py, single_process.py,
links.py) so that it cannot rot: tiny models, seconds each, no timed assertions.

The network-lab tests need root and working ``ip netns``/``tc``; elsewhere they are skipped with the
reason ``benchmarks.netlab.lab_unavailable_reason()`` gives.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.netlab import (
    PREFIX,
    LabError,
    LoopbackLab,
    NetLab,
    clean_stale,
    format_rate,
    lab_unavailable_reason,
    measure_transfer,
    our_namespaces,
    parse_rate,
)
from swarm.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
_REASON = lab_unavailable_reason(probe=True)
needs_lab = pytest.mark.skipif(_REASON is not None, reason=f"network lab unavailable: {_REASON}")

TINY = {
    "run_id": "bench-smoke",
    "seed": 0,
    "model": {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
    "stages": 2,
    "codecs": {"activations": "none", "gradients": "none"},
    "optimizer": {"name": "adamw", "lr": 1e-3, "clip_norm": 1.0, "mode": "sync"},
    "micro_batch_size": 2,
}


# ------------------------------------------------------------------------------------- pure parts


def test_parse_rate_units_and_none():
    assert parse_rate("none") is None
    assert parse_rate("20mbit") == 20e6
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("1.5mbit") == 1.5e6
    assert format_rate("20Mbit") == "20mbit"
    assert format_rate("1000mbit") == "1gbit"


@pytest.mark.parametrize("bad", ["20", "fast", "-5mbit", "0mbit", "20mbps", ""])
def test_parse_rate_rejects_with_the_rule(bad):
    with pytest.raises(ConfigError, match="kbit, mbit or gbit"):
        parse_rate(bad)


def test_lab_node_names_are_checked():
    with pytest.raises(ConfigError, match="repeat"):
        LoopbackLab(["a", "a"])
    with pytest.raises(ConfigError, match="invalid"):
        LoopbackLab(["Bad Name"])
    with pytest.raises(ConfigError, match="not in this lab"):
        LoopbackLab(["a"]).address("b")


def test_loopback_lab_refuses_rates_it_cannot_enforce():
    lab = LoopbackLab(["a", "b"])
    lab.set_rate("none")  # allowed: nothing to enforce
    with pytest.raises(LabError, match="loopback"):
        lab.set_rate("20mbit")
    assert lab.address("b") == "127.0.0.1" and lab.tx_bytes("a") is None


# ---------------------------------------------------------------------------------- network lab


def _ours(tag: str) -> list[str]:
    return [n for n in our_namespaces() if n.startswith(tag)]


@needs_lab
@pytest.mark.integration
def test_netlab_rate_limits_and_tears_down():
    nbytes = 256 * 1024
    with NetLab(["a", "b"]) as lab:
        tag = lab.tag
        assert len(_ours(tag)) == 3  # two nodes and the hub
        free_s = measure_transfer(lab, "a", "b", nbytes)
        lab.set_rate("1mbit", ["a"])
        before = lab.tx_bytes("a")
        shaped_s = measure_transfer(lab, "a", "b", nbytes)
        sent = lab.tx_bytes("a") - before
        qdisc = subprocess.run(
            ["tc", "-n", lab.ns("a"), "qdisc", "show", "dev", "eth0"], capture_output=True, text=True
        ).stdout
    assert "tbf" in qdisc and "1Mbit" in qdisc
    # The shaper's own bound (not a timing guess): beyond its 64 KiB bucket, 1 Mbit/s cannot be beaten.
    assert shaped_s >= (nbytes - 64 * 1024) * 8 / 1e6 * 0.9
    assert shaped_s > free_s
    assert sent >= nbytes  # the counters saw the payload (plus TCP/IP headers)
    assert _ours(tag) == []


@needs_lab
@pytest.mark.integration
def test_netlab_sigterm_tears_down_and_stale_labs_are_cleaned():
    script = (
        "import time\nfrom benchmarks.netlab import NetLab\n"
        "lab = NetLab(['a', 'b'], rate='20mbit')\n"
        "lab.spawn('a', ['sleep', '600'])\n"
        "print(lab.tag, flush=True)\ntime.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        tag = proc.stdout.readline().strip()
        assert tag.startswith(PREFIX) and len(_ours(tag)) == 3
        proc.terminate()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _ours(tag) == []

    # A lab whose owner died without cleaning up (SIGKILL): clean_stale removes it, and only it.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{PREFIX}{dead.pid}-beef-x"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    with NetLab(["a"]) as live:
        removed = clean_stale()
        assert stale in removed and _ours(live.tag) != []
    assert stale not in our_namespaces()


# ------------------------------------------------------------------------------------- baselines


@pytest.fixture()
def tiny_spec(tmp_path):
    from swarm.run.spec import RunSpec

    path = tmp_path / "tiny.json"
    path.write_bytes(RunSpec.from_dict(TINY).canonical_bytes())
    return str(path)


@pytest.mark.slow
def test_pipelining_schedules_and_single_process_train_the_same_model(tiny_spec, tmp_path):
    from benchmarks.pipelining_baseline import PipeConfig, run_pipelining
    from benchmarks.single_process import SingleConfig, run_single

    common = {"spec_path": tiny_spec, "steps": 2, "warmup_steps": 1, "data_bytes": 100_000, "timeout_s": 120}
    with LoopbackLab(["s0", "s1"]) as lab:
        runs = {
            s: run_pipelining(lab, PipeConfig(schedule=s, n_micro=3, **common), ["s0", "s1"], tmp_path / s)
            for s in ("gpipe", "1f1b")
        }
    single = run_single(SingleConfig(accumulate=3, threads=1, **common), tmp_path / "single")
    for res in (*runs.values(), single):
        assert res["tokens_per_step"] == 3 * 2 * 16
        assert res["tokens_per_s"] > 0
        assert all(math.isfinite(x["loss"]) for x in res["losses"])
        assert res["peak_rss_mb"]
    # Same weights, same micro-batches: the first step's loss is the same model's loss on the same data,
    # and after one identical AdamW step the second one agrees too (up to summation order).
    for res in runs.values():
        for a, b in zip(res["losses"], single["losses"], strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert runs["gpipe"]["payload_bytes_per_token"] == 2 * 1 * 32 * 4
    assert len(runs["1f1b"]["peak_rss_mb"]) == 2
    for res in runs.values():  # one step after warm-up: its median and its mean are the same step
        assert res["tokens_per_s_overall"] == pytest.approx(res["tokens_per_s"])


@pytest.mark.slow
@needs_lab
def test_pipelining_runs_inside_the_lab(tiny_spec, tmp_path):
    from benchmarks.netlab import open_lab
    from benchmarks.pipelining_baseline import PipeConfig, run_pipelining

    cfg = PipeConfig(
        spec_path=tiny_spec,
        schedule="1f1b",
        n_micro=2,
        steps=2,
        warmup_steps=1,
        data_bytes=100_000,
        timeout_s=120,
    )
    with open_lab(["s0", "s1"], loopback=False, rate="100mbit") as lab:
        res = run_pipelining(lab, cfg, ["s0", "s1"], tmp_path)
        tag = lab.tag
    # Every activation and gradient crossed a shaped link: the counters saw at least the fp32 payload.
    assert res["wire_bytes_per_token"] >= res["payload_bytes_per_token"]
    assert _ours(tag) == []


def test_baseline_configs_name_the_rule():
    from benchmarks.pipelining_baseline import PipeConfig
    from benchmarks.single_process import SingleConfig

    with pytest.raises(ConfigError, match="warmup_steps"):
        PipeConfig(spec_path="x", steps=2, warmup_steps=2)
    with pytest.raises(ConfigError, match="gpipe or 1f1b"):
        PipeConfig(spec_path="x", schedule="zb")
    with pytest.raises(ConfigError, match="accumulate"):
        SingleConfig(spec_path="x", accumulate=0)


# ------------------------------------------------------------------------------ links benchmark


def test_links_plan_covers_the_issue_matrix():
    from benchmarks.links import ALL_CODECS, LinksConfig, plan

    cfg = LinksConfig(rates=("none", "100mbit", "20mbit", "5mbit"))
    jobs = plan(cfg)
    names = [j.name for j in jobs]
    assert len(names) == len(set(names))  # one run per (kind, rate, codec, mode, schedule, subspace)
    conv = [j for j in jobs if "convergence" in j.purposes]
    modes = ("sync", "async")
    assert {(j.codec, j.subspace, j.mode) for j in conv} == {
        (c, None, m) for c in ALL_CODECS for m in modes
    } | {("blockwise8", r, m) for r in (32, 100) for m in modes}
    assert all(j.rate == "none" and j.micro_batches == cfg.convergence_mb for j in conv)
    for rate in ("none", "100mbit", "20mbit", "5mbit"):
        for schedule in ("gpipe", "1f1b"):
            assert f"pipelining {schedule} @ {rate}" in names
        assert f"swarm blockwise8 async @ {rate}" in names
        assert f"swarm subspace d/32 + blockwise8 async @ {rate}" in names
        assert f"swarm subspace d/100 + blockwise8 async @ {rate}" in names
    # Every codec in both modes at the unshaped and the sweep rates; at 5mbit the default codec, the
    # subspace models and their uncompressed reference.
    for rate in ("none", "100mbit", "20mbit"):
        assert {
            (j.codec, j.mode) for j in jobs if j.rate == rate and j.kind == "swarm" and not j.subspace
        } == {(c, m) for c in ALL_CODECS for m in modes}
    assert {j.name for j in jobs if j.rate == "5mbit" and j.kind == "swarm"} == {
        "swarm blockwise8 async @ 5mbit",
        "swarm none async @ 5mbit",
        "swarm subspace d/32 + blockwise8 async @ 5mbit",
        "swarm subspace d/100 + blockwise8 async @ 5mbit",
    }
    assert "single process, 1 thread(s)" in names


def test_links_config_rules():
    from benchmarks.links import LinksConfig

    with pytest.raises(ConfigError, match="multiple of accumulate"):
        LinksConfig(throughput_mb=10, accumulate=4)
    with pytest.raises(ConfigError, match="loopback"):
        LinksConfig(loopback=True, rates=("none", "20mbit"))
    with pytest.raises(ConfigError, match="kbit, mbit or gbit"):
        LinksConfig(rates=("fast",))
    with pytest.raises(ConfigError, match="subspace ratio 0"):
        LinksConfig(subspace_ratios=(0,))


def test_swarm_figures_windows_and_target():
    from benchmarks.links import swarm_figures, tokens_to_target

    # 1 micro-batch = 10 tokens, one step record per micro-batch, 2 s each; warm-up 2, window 2.
    records = [
        {"type": "step", "tokens": 10 * i, "time": 2.0 * i, "loss": 5.0 - 0.1 * i} for i in range(1, 9)
    ]
    records.append({"type": "eval", "eval_loss": 4.4})
    fig = swarm_figures(
        records, {"micro_batches": {"completed": 8}}, tokens_per_mb=10, warmup_mb=2, window_mb=2
    )
    assert fig["window_rates"] == [5.0, 5.0, 5.0]  # 20 tokens per 4 s
    assert fig["tokens_per_s"] == 5.0 and fig["eval_loss"] == 4.4 and fig["tokens"] == 80
    assert fig["tokens_per_s_overall"] == 5.0  # 60 tokens after warm-up in 12 s
    slow = [dict(r) for r in records]
    slow[7]["time"] += 4.0  # the window ending at 8 micro-batches took 8 s instead of 4
    fig = swarm_figures(slow, {}, tokens_per_mb=10, warmup_mb=2, window_mb=2)
    assert fig["window_rates"] == [5.0, 5.0, 2.5]
    assert fig["tokens_per_s"] == 5.0 and fig["tokens_per_s_overall"] == 60 / 16  # the median hides it
    assert tokens_to_target(fig["losses"], 4.45) == 70  # 3-step means: 4.5 at 60 tokens, 4.4 at 70
    assert tokens_to_target(fig["losses"], 1.0) is None


def test_markdown_section_replaces_only_its_own(tmp_path):
    from benchmarks.links import SECTION, write_markdown

    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n## Codecs\n\nkeep me\n\n## Links\n\nold\n\n## Other\n\nkeep too\n")
    write_markdown(f"{SECTION}\n\nnew\n", md)
    text = md.read_text()
    assert "keep me" in text and "keep too" in text and "new" in text and "old" not in text
    assert text.index("## Codecs") < text.index("## Links") < text.index("## Other")


@pytest.mark.slow
def test_links_benchmark_smoke(tiny_spec, tmp_path):
    """The whole benchmark on a tiny model: the swarm (bootstrap, peers, trainer as processes), both
    baselines, analysis, plots and the markdown section. Inside the lab (shaped) when it can run here."""
    from benchmarks.links import Job, LinksConfig, markdown_section, run_all

    shaped = _REASON is None
    rate = "20mbit" if shaped else "none"
    cfg = LinksConfig(
        spec_path=tiny_spec,
        rates=("none", rate) if shaped else ("none",),
        sweep_rates=(rate,),
        accumulate=2,
        throughput_mb=8,
        warmup_mb=2,
        convergence_mb=8,
        pipe_n_micro=2,
        max_inflight=4,
        loopback=not shaped,
        data_bytes=100_000,
        start_timeout_s=120,
        run_timeout_s=120,
    )
    jobs = [
        Job("swarm", rate, "blockwise8", "async", micro_batches=8, purposes=("throughput",)),
        Job("swarm", rate, "blockwise8", "async", micro_batches=8, purposes=("throughput",), subspace=4),
        Job("pipelining", rate, schedule="1f1b", micro_batches=8, purposes=("throughput",)),
        Job("single", micro_batches=8, purposes=("throughput",), threads=1),
    ]
    report = run_all(cfg, jobs, name="links_smoke", command="test", results_dir=tmp_path, say=lambda _: None)
    results = {r["kind"]: r for r in report["results"] if not r.get("subspace")}
    sub = next(r for r in report["results"] if r.get("subspace"))
    assert not any(r.get("error") for r in results.values()), [r.get("error") for r in results.values()]
    swarm = results["swarm"]
    assert swarm["completed"] == 8 and swarm["dropped"] == 0
    assert swarm["tokens_per_s"] > 0 and swarm["eval_loss"] is not None
    # blockwise8 sends ~4x less than fp32 (2 * (stages - 1) * d_model * 4 bytes per token uncompressed).
    assert swarm["payload_bytes_per_token"] < swarm["uncompressed_bytes_per_token"] / 3
    assert set(swarm["peak_rss_mb"]) == {"peer0", "peer1", "trainer"}
    assert all(v["main"] > 0 for v in swarm["peak_rss_mb"].values())
    if shaped:
        assert swarm["wire_bytes_per_token"] >= swarm["payload_bytes_per_token"]
        assert (
            results["pipelining"]["wire_bytes_per_token"] >= results["pipelining"]["payload_bytes_per_token"]
        )
    # The subspace model sends k = d_model / 4 coefficients per token instead of d_model numbers.
    assert (
        not sub.get("error")
        and sub["completed"] == 8
        and sub["subspace_rank"] == TINY["model"]["d_model"] // 4
    )
    assert sub["payload_bytes_per_token"] < swarm["payload_bytes_per_token"] / 2.5
    ratio = report["analysis"]["targets"][f"swarm_blockwise8_vs_1f1b@{rate}"]
    assert ratio is not None and ratio > 0
    assert (tmp_path / "links_smoke.json").exists() and len(report["plots"]) == 3
    text = markdown_section(report)
    assert (
        text.startswith("## Links")
        and "pipelining 1f1b" in text
        and "| single process, 1 thread(s) |" in text
        and "swarm subspace d/4 + blockwise8 async" in text
    )
    assert not [n for n in our_namespaces() if n.startswith(report.get("lab", "none"))]


def test_analyse_ratios_from_one_run():
    from benchmarks.links import LinksConfig, analyse

    cfg = LinksConfig(rates=("none", "100mbit", "20mbit"), codecs=("none", "blockwise8"), convergence_mb=4)
    losses = [{"tokens": 100 * i, "wall_s": float(i), "loss": 5.0 - 0.5 * i} for i in range(1, 5)]

    def swarm(rate, codec, mode, tps, peak, eval_loss, mb=4):
        return {
            "kind": "swarm",
            "rate": rate,
            "codec": codec,
            "mode": mode,
            "tokens_per_s": tps,
            "micro_batches": mb,
            "losses": losses,
            "eval_loss": eval_loss,
            "peak_rss_mb": {"peer0": {"main": peak, "tree": 2 * peak}, "trainer": {"main": 1.0, "tree": 1.0}},
        }

    results = [
        swarm("none", "blockwise8", "async", 90.0, 150.0, 3.03),
        swarm("none", "blockwise8", "sync", 50.0, 100.0, 3.0),
        swarm("none", "none", "sync", 40.0, 100.0, 3.0),
        swarm("100mbit", "blockwise8", "async", 81.0, 150.0, None, mb=8),
        swarm("20mbit", "blockwise8", "async", 60.0, 150.0, None, mb=8),
        {
            "kind": "pipelining",
            "schedule": "1f1b",
            "rate": "none",
            "tokens_per_s": 100.0,
            "peak_rss_mb": [75.0, 80.0],
        },
        {
            "kind": "pipelining",
            "schedule": "1f1b",
            "rate": "20mbit",
            "tokens_per_s": 20.0,
            "peak_rss_mb": [75.0],
        },
        {"kind": "swarm", "rate": "20mbit", "codec": "fp16", "mode": "async", "error": "boom"},
    ]
    a = analyse(cfg, results)["targets"]
    assert a["target_3x_1f1b_at_20mbit"] == pytest.approx(3.0)
    assert a["target_0.9_own_at_100mbit"] == pytest.approx(0.9)
    assert a["target_0.9_pipelining_unshaped"] == pytest.approx(0.9)
    assert a["memory_async_vs_sync_peer"] == pytest.approx(1.5)
    assert a["memory_async_peer_vs_pipelining_rank"] == pytest.approx(150.0 / 80.0)
    assert a["convergence_blockwise8_sync_within_1pct"] == pytest.approx(1.0)
    assert a["convergence_blockwise8_async_vs_sync_blockwise8"] == pytest.approx(1.01)
    assert a["convergence_async_vs_sync_none"] is None  # that run is missing: no ratio, not a guess


# ------------------------------------------------------------------------------ pipeline bubbles


def test_bubble_theory_and_config_rules():
    from benchmarks.bubbles import BubblesConfig, bubble_fraction

    assert bubble_fraction(2, 2) == pytest.approx(1 / 3)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ConfigError, match="multiple of M"):
        BubblesConfig(n_micro=(3,), micro_batches=8)
    with pytest.raises(ConfigError, match="not among"):
        BubblesConfig(systems=("zero bubble",))


def test_busy_stage_holds_forward_and_backward_for_their_emulated_time():
    import time

    import torch

    from benchmarks.busy import BusyStage

    stage = BusyStage(torch.nn.Linear(4, 4), emulate_s=(0.05, 0.1))
    x = torch.randn(2, 4, requires_grad=True)
    t0 = time.perf_counter()
    out = stage(x)
    t1 = time.perf_counter()
    out.sum().backward()
    t2 = time.perf_counter()
    assert t1 - t0 >= 0.05 and t2 - t1 >= 0.1
    assert 0.15 <= stage.busy_s <= t2 - t0
    assert x.grad is not None and stage.inner.weight.grad is not None


def test_bubbles_report_reads_its_numbers():
    from benchmarks.bubbles import BubblesConfig, derived, markdown_section
    from benchmarks.report import machine_info

    cfg = BubblesConfig(stages=(2,), n_micro=(4,), micro_batches=8, emulate_ms=(10.0, 20.0))
    results = []
    for system, tps, util in (("1f1b", 800.0, [0.8, 0.79]), ("swarm async", 1000.0, [0.95, 0.9])):
        res = {"stages": 2, "n_micro": 4, "system": system, "tokens_per_s": tps, "utilisation": util}
        res.update(derived(cfg, res, tokens_per_mb=32))
        results.append(res)
    results.append({"stages": 2, "n_micro": 4, "system": "gpipe", "error": "boom", "utilisation": None})
    results[-1].update(derived(cfg, results[-1], tokens_per_mb=32))
    assert results[0]["ideal_tokens_per_s"] == pytest.approx(32 / 0.03)
    assert results[0]["efficiency"] == pytest.approx(800 * 0.03 / 32)
    assert results[0]["theory_efficiency"] == pytest.approx(0.8)
    assert results[1]["theory_efficiency"] == 1.0  # async: no bubble once the pipeline is full
    from dataclasses import asdict

    report = {
        "config": asdict(cfg),
        "machine": machine_info(),
        "started": "now",
        "command": "test",
        "tokens_per_mb": 32,
        "results": results,
    }
    text = markdown_section(report)
    assert text.startswith("## Pipeline bubbles\n")
    assert "| 2 | 4 | 0.20 | 0.80 | failed | 0.75 | - | 0.94 |" in text
    assert "| 2 | 4 | failed | 0.80 / 0.79 | - | 0.95 / 0.90 |" in text
    assert "Swarm async / 1F1B tokens/s: 1.25-1.25" in text


@pytest.mark.slow
def test_bubbles_benchmark_smoke(tmp_path):
    """1F1B and the async swarm (peers as processes) at S = 2, M = 2 with emulated compute: both measure
    tokens/s and a utilisation per stage, and the JSON is written."""
    from benchmarks.bubbles import quick_config, run_all

    # 12 micro-batches: the swarm's steady window (after the first step) then spans 10 completions; over
    # 2 it could end on a burst of in-flight completions faster than a stage goes (it read 1.33 once)
    cfg = quick_config(n_micro=(2,), micro_batches=12, systems=("1f1b", "swarm async"))
    report = run_all(cfg, name="bubbles_smoke", results_dir=tmp_path, say=lambda _: None)
    assert [r.get("error") for r in report["results"]] == [None, None]
    for r in report["results"]:
        assert 0 < r["efficiency"] < 1.2
        assert len(r["utilisation"]) == 2 and all(0 < u <= 1.05 for u in r["utilisation"])
    assert (tmp_path / "bubbles_smoke.json").exists()


# ------------------------------------------------------------------------------------- GPU check


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA: nothing to skip")
def test_gpu_check_skips_cleanly_without_cuda(capsys):
    from benchmarks.gpu_check import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gpu_check: skipped: no CUDA device") and out.count("\n") == 1


def test_gpu_check_spec_is_a_4_stage_model_of_100m_parameters():
    from benchmarks.gpu_check import check_spec

    spec = check_spec(tiny=False)
    assert spec.num_stages == 4 and spec.n_params() >= 100e6 and spec.autocast == "auto"


@pytest.mark.slow
def test_gpu_check_dry_path_on_cpu(tmp_path):
    """The whole check on the CPU with the tiny model: every part runs, the numerics agree (CPU vs CPU:
    exactly), the JSON and the markdown section are produced (not written to BENCHMARKS.md)."""
    from benchmarks.gpu_check import main

    out = tmp_path / "dry.json"
    argv = ["--device", "cpu", "--tiny", "--out", str(out), "--micro-batches", "8", "--pipe-steps", "2"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["numerics"]["ok"] and set(report["numerics"]["groups"]) == {
        "loss",
        "activations",
        "input_grads",
        "param_grads",
    }
    assert report["numerics"]["groups"]["param_grads"]["tensors"] > 4
    assert report["swarm"]["tokens_per_s"] > 0 and report["pipelining"]["tokens_per_s"] > 0
    assert report["swarm_vs_pipelining"] > 0


SS_TWO_TO_ONE = """ESTAB 0 0 10.77.0.2:40001 10.77.0.3:51234
\t cubic wscale:7,7 rto:204 bytes_sent:9000 bytes_acked:9000 bytes_received:100
ESTAB 0 0 10.77.0.2:51240 10.77.0.3:40002
\t cubic wscale:7,7 rto:204 bytes_sent:500 bytes_acked:500
ESTAB 0 0 10.77.0.2:40001 127.0.0.1:40100
\t cubic bytes_sent:7
"""


def test_tcp_pair_bytes_count_each_connection_and_never_go_negative():
    """ss output is read per connection; a duplicate connection libp2p closes between two readings does
    not pull its pair's figure below what the open connections sent (it made the smoke test read {})."""
    from benchmarks.control_plane import pair_bytes, parse_ss

    where = {"10.77.0.3": "s1"}
    conns = parse_ss(SS_TWO_TO_ONE, where)
    assert conns == [
        ("s1", "10.77.0.2:40001 10.77.0.3:51234", 9000),
        ("s1", "10.77.0.2:51240 10.77.0.3:40002", 500),
    ]
    start = {"s0": {"s1": {c: b for _, c, b in conns}}}
    # the bigger connection closed; the other sent 1000 more; a new one opened and sent 300
    end = {"s0": {"s1": {"10.77.0.2:51240 10.77.0.3:40002": 1500, "10.77.0.2:40001 10.77.0.3:60000": 300}}}
    assert pair_bytes(start, end, tokens=100) == {"s0->s1": 13.0}
    assert pair_bytes(end, end, tokens=100) == {}


@pytest.mark.slow
@needs_lab
def test_control_plane_benchmark_smoke(tiny_spec):
    """The control-plane measurement (benchmarks/control_plane.py) on a tiny model in the lab: wire bytes
    from the link counters, the processes' own traffic counters, per-connection TCP bytes, idle traffic."""
    from benchmarks.control_plane import markdown_section, run
    from benchmarks.links import LinksConfig

    cfg = LinksConfig(
        spec_path=tiny_spec,
        accumulate=2,
        throughput_mb=4,
        warmup_mb=2,
        data_bytes=100_000,
        start_timeout_s=120,
        run_timeout_s=120,
    )
    runs = run(rates=["none"], micro_batches=[4], idle_s=2.0, cfg=cfg, subspaces=(None,), say=lambda _: None)
    [r] = runs
    b = r["breakdown"]
    assert b["wire"] >= b["payload"] > 0
    assert b["serialised"]["FORWARD headers"] > 0 and b["serialised"]["REPORTs to the trainer"] > 0
    # every process's counters arrived: each peer and the trainer sent FORWARDs (the last stage none)
    assert sum(1 for t in r["traffic"] if t.get("forward", {}).get("count")) == TINY["stages"]
    assert b["messages_per_1k_tokens"]["report"] > 0 and b["dht_stores_per_1k_tokens"] > 0
    assert b["tcp_by_pair"] and b["tcp_total"] <= b["wire"]  # TCP payload: no IP/TCP headers
    assert b["idle_bytes_per_s_by_node"] and b["keeper_snapshots"] == 0
    assert "| **non-payload / payload** |" in markdown_section({"variants": {"smoke": {"runs": runs}}})


@pytest.mark.slow
@needs_lab
def test_stream_cost_benchmark_smoke():
    """One message's wire cost (benchmarks/stream_cost.py): two lab nodes, a few calls of each shape."""
    from benchmarks.stream_cost import SHAPES, run

    own = run(calls=8, concurrency=2, channels="off", settle_s=0.3)
    shared = run(calls=8, concurrency=2, channels="on", settle_s=0.3)
    assert [r["shape"] for r in own] == [r["shape"] for r in shared] == list(SHAPES)
    for a, b in zip(own, shared, strict=True):
        # a stream of its own is several packets with more bytes than we serialised; on the channel
        # (the small lane, or the bulk lane for the activation) the same message costs fewer of both
        assert a["packets_per_call"] > 4 and a["wire_bytes_per_call"] > a["serialised_bytes_per_call"]
        assert (a["channels"], b["channels"]) == ("off", "on")
        assert b["wire_bytes_per_call"] < a["wire_bytes_per_call"]
        # the calls' CPU less an idle window's: below zero by a clock tick at most (a daemon's own work)
        tick_ms_per_call = 1000 / os.sysconf("SC_CLK_TCK") / 8
        assert (
            a["python_cpu_ms_per_call"] >= -tick_ms_per_call
            and a["p2pd_cpu_ms_per_call"] >= -tick_ms_per_call
        )
    # CPU comes in clock ticks (10 ms): a few calls of one shape may read 0, all of them together not
    assert sum(r["python_cpu_ms_per_call"] + r["p2pd_cpu_ms_per_call"] for r in own) > 0


@pytest.mark.integration
def test_round_cost_runs_rounds_of_two_averagers_and_writes_its_figures(tmp_path):
    from benchmarks import round_cost

    out = tmp_path / "round_cost.json"
    assert round_cost.main(["--sizes", "100", "--rounds", "2", "--ops", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (r,) = result["rounds"]
    assert r["values"] == 100 and r["completed"] == [2, 2]
    assert r["cpu_ms_per_round_both_members"] > 0
    # a couple of DHT stores and reads can take less CPU than one clock tick (10 ms) of /proc in all
    assert result["dht_store_cpu_ms"] >= 0 and result["dht_get_cpu_ms"] >= 0


def test_stage_cost_compares_the_peer_path_with_plain_torch(tmp_path):
    """benchmarks/stage_cost.py on a tiny model: every stage measured on both paths, a JSON report."""
    import yaml

    from benchmarks import stage_cost

    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump({**TINY, "optimizer": {**TINY["optimizer"], "mode": "async"}}))
    out = tmp_path / "stage_cost.json"
    args = [
        "--spec",
        str(spec),
        "--accumulate",
        "2",
        "--micro-batches",
        "4",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    assert stage_cost.main(args) == 0
    report = json.loads(out.read_text())
    assert [r["stage"] for r in report["stages"]] == [0, 1]
    for row in report["stages"]:
        assert row["peer_cpu_s"] > 0 and row["plain_cpu_s"] > 0 and row["plain_fused_cpu_s"] > 0
        assert math.isclose(row["ratio"], row["peer_cpu_s"] / row["plain_cpu_s"])
        assert math.isclose(row["ratio_fused"], row["peer_cpu_s"] / row["plain_fused_cpu_s"])
    with pytest.raises(SystemExit):
        stage_cost.main(["--spec", str(spec), "--accumulate", "3", "--micro-batches", "4", "--out", str(out)])


def test_state_export_measures_both_hand_overs_of_a_donor_state():
    """benchmarks/state_export.py on the tiny example: both ways hand over the whole state."""
    from benchmarks.state_export import run

    res = run("examples/tiny.yaml", 0, rounds=2)
    assert res["state_mb"] > 0 and set(res["medians"]) == {"separate", "shared"}
    for way in res["all"].values():
        assert len(way["donor_s"]) == 2 and all(s >= 0 for s in way["receiver_s"])


def test_peak_watcher_finds_every_descendant_from_one_process_table():
    from benchmarks.links import PeakWatcher, family

    # 1 -> 2 -> 4, 1 -> 3; 10 -> 11; 20 has no children; 30 is not a root
    parent_of = {2: 1, 3: 1, 4: 2, 11: 10, 31: 30}
    below = family([1, 10, 20], parent_of)
    assert sorted(below[1]) == [2, 3, 4] and below[10] == [11] and below[20] == []
    assert PeakWatcher().report_mb() == {}


@pytest.mark.integration
def test_peak_watcher_samples_a_live_child_from_the_real_process_table():
    import os

    from benchmarks.links import PeakWatcher

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        watcher = PeakWatcher()
        watcher.watch("me", os.getpid())
        assert child.pid in watcher.tree["me"] and watcher.main["me"] > 0
    finally:
        child.kill()
        child.wait()


@pytest.mark.integration
def test_state_download_benchmark_brings_the_state_back_by_both_paths():
    """benchmarks/state_download.py with a 1 MB state: hivemind's path and ours both deliver it whole
    (the benchmark checks the contents of every download)."""
    from benchmarks.state_download import run

    res = run(1.0, rounds=1)
    assert set(res["medians"]) == {"stream", "stock"}
    for m in res["medians"].values():
        assert m["wall_s"] > 0 and m["all_cpu_s"] > 0


def test_snapshot_write_benchmark_writes_both_ways_and_reads_every_store_back(tmp_path):
    """benchmarks/snapshot_write.py with 1 MB snapshots: both ways write a store of stages x rounds
    (the 4th round deleting the 1st) that reads back whole; no file is left behind."""
    from benchmarks.snapshot_write import machine_busy_s, run

    res = run(1.0, stages=2, rounds=4, repeats=2, directory=str(tmp_path))
    assert set(res["writes"]) == {"drop", "keep"}
    for way, rows in res["writes"].items():
        assert len(rows) == 2 * 4 * 2, way
        assert all(r["wall_s"] > 0 and r["cpu_s"] >= 0 for r in rows)
        assert len(res["cpu_s_per_store"][way]) == 2
    assert os.listdir(tmp_path) == []
    busy = machine_busy_s()
    assert busy is None or busy > 0
