"""The pure parts of benchmarks/overhead.py: process roles, marginal CPU, thread kinds, the report."""

from __future__ import annotations

import pytest

from benchmarks.overhead import _group, classify, marginal, markdown_section, role_of, thread_kind


def test_roles_come_from_the_command_line_and_the_top_level_ancestor():
    py = "/venv/bin/python -m swarm.cli"
    assert role_of(f"{py} peer --initial-peers X --run r --stage 2 --throughput 1000", None) == "peer 2"
    assert role_of(f"{py} train --initial-peers X --run r --steps 4", None) == "trainer"
    assert role_of(f"{py} init spec.yaml --host-maddrs /ip4/127.0.0.1/tcp/0", None) == "bootstrap"
    assert (
        role_of("/venv/bin/python -m benchmarks.pipelining_baseline --worker c.json --rank 3", None)
        == "rank 3"
    )
    assert role_of("/venv/lib/hivemind_cli/p2pd -listen ...", "peer 1") == "peer 1 / p2pd"
    assert role_of(f"{py} peer --stage 1", "peer 1") == "peer 1 / children"  # a forked DHT process
    assert role_of("sleep 10", None) == "other"


def test_thread_kinds():
    assert thread_kind("stage-compute") == "compute"
    assert thread_kind("MainThread") == "event loop"
    assert thread_kind("asyncio_3") == "executor"
    assert thread_kind("replica-rounds-0") == "rounds"
    assert thread_kind("Thread-2 (_background_thread_fetch_current_state)") == "other threads"
    assert thread_kind(None) == "threads"


def test_marginal_cpu_is_the_difference_over_the_difference_in_tokens():
    short = {"tokens": 1000, "cpu_s": {"peer 0: compute": 5.0, "peer 0 / p2pd": 1.0}}
    long = {"tokens": 3000, "cpu_s": {"peer 0: compute": 9.0, "peer 0 / p2pd": 1.5, "trainer: threads": 0.2}}
    m = marginal(short, long)
    assert m["tokens"] == 2000
    assert m["cpu_s_per_ktok"] == pytest.approx(
        {"peer 0: compute": 2.0, "peer 0 / p2pd": 0.25, "trainer: threads": 0.1}
    )
    assert m["total"] == pytest.approx(2.35)
    with pytest.raises(ValueError, match="not more than the short"):
        marginal(long, short)


def test_a_process_whose_threads_one_run_did_not_name_is_compared_as_a_whole():
    short = {"tokens": 1000, "cpu_s": {"rank 0: threads": 3.0, "rank 1: event loop": 2.0}}
    long = {
        "tokens": 2000,
        "cpu_s": {"rank 0: event loop": 4.0, "rank 0: threads": 0.5, "rank 1: event loop": 3.0},
    }
    m = marginal(short, long)
    assert m["cpu_s_per_ktok"] == pytest.approx({"rank 0: all threads": 1.5, "rank 1: event loop": 1.0})


def test_rows_of_peers_and_ranks_are_summed_by_kind():
    per = {
        "peer 0: compute": 1.0,
        "peer 1: compute": 2.0,
        "peer 1 / p2pd": 0.5,
        "rank 0: threads": 4.0,
        "trainer: executor": 0.1,
    }
    assert _group(per) == {
        "stage peers: compute": 3.0,
        "stage peers / p2pd": 0.5,
        "ranks: threads": 4.0,
        "trainer: executor": 0.1,
    }


def test_compute_samples_are_sorted_into_kinds_of_work():
    assert (
        classify(["_worker (peer/runtime.py:182)", "StageModule.backward (peer/stage_math.py:194)"])
        == "backward"
    )
    assert classify(["StageOptimizer.step (swarm/run/optimizer.py:256)"]) == "optimizer step"
    assert classify(["Blockwise8Codec._encode (compression/quantization.py:174)"]) == "codec encode/decode"
    assert classify(["Block.forward (swarm/run/model.py:231)"]) == "forward"
    assert classify(["Condition.wait (threading.py:331)"]) == "other"


def test_the_report_has_one_row_per_kind_and_the_totals():
    def run(per):
        return {"marginal": {"cpu_s_per_ktok": per, "total": sum(per.values()), "tokens": 1000}}

    report = {
        "config": {"short_mb": 8, "long_mb": 24, "quick": True, "codec": "blockwise8", "mode": "async"},
        "machine": {"cpu_count": 2, "load_start": "1.0 1.0 1.0"},
        "runs": {
            "swarm": run({"peer 0: compute": 2.0, "peer 0 / p2pd": 0.4, "trainer: threads": 0.1}),
            "pipelining": run({"rank 0: threads": 1.8}),
        },
    }
    text = markdown_section(report)
    assert text.startswith("## Where the cycles go\n")
    assert "| stage peers: compute | 2.000 | - |" in text
    assert "| ranks: threads | - | 1.800 |" in text
    assert "| **all** | **2.500** | **1.800** |" in text
    assert "1.25x its compute threads' CPU" in text
