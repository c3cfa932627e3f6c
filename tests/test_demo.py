"""``swarm demo`` end to end, as a user runs it: a subprocess that must train, write OUT/ and leave
no process behind, also when interrupted."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.tools.demo import DEFAULT_DEMO_SPEC, demo_spec
from swarm.train.metrics import read_metrics
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def live_in_groups(groups: set[int]) -> list[str]:
    """Live (non-zombie) processes whose process group is in ``groups``, described."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
            fields = tail.split()
            if int(fields[2]) in groups and fields[0] not in ("Z", "X"):
                found.append(f"{entry} {head.split('(', 1)[1]}")
        except (OSError, ValueError, IndexError):
            continue
    return found


def wait_gone(groups: set[int], timeout_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := live_in_groups(groups)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def start_demo(out: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, HIVEMIND_LOGLEVEL="WARNING", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "swarm.cli", "demo", "--out", str(out), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group: everything it leaves behind is findable
    )


def test_demo_with_chaos_trains_writes_out_and_leaves_nothing(tmp_path):
    out = tmp_path / "demo"
    proc = start_demo(out, "--steps", "18", "--chaos")
    try:
        output, _ = proc.communicate(timeout=480)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    assert "chaos: killed peer" in output and "loss" in output, output[-3000:]
    steps = read_metrics(out / "metrics.jsonl", "step")
    assert len(steps) == 18
    first = sum(r["loss"] for r in steps[:5]) / 5
    last = sum(r["loss"] for r in steps[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    status = json.loads((out / "status.json").read_text())
    assert status["run_id"] == "demo" and status["num_stages"] == 2
    summary = json.loads((out / "summary.json").read_text())
    mb = summary["micro_batches"]
    assert (
        mb["completed"] == 72 and mb["opened"] == mb["completed"] + mb["dropped"]
    )  # 18 steps x accumulate 4
    demo = summary["demo"]
    assert len(demo["chaos"]) == 1 and sum(p["killed"] for p in demo["peers"]) == 1
    assert len(demo["peers"]) == 5  # 2 x 2 and the fresh one
    ref = summary["reference"]  # the same model trained in one process on the same micro-batches
    assert ref["micro_batches"] == 72 and 0 < ref["ratio"] < 2, ref
    assert "vs one process" in output
    assert len(list((out / "logs").glob("peer-*.log"))) == 5
    groups = {proc.pid} | {p["pid"] for p in demo["peers"]}
    assert wait_gone(groups) == [], "processes left behind (peers, DHT children or p2pd)"


def test_demo_interrupted_by_sigint_cleans_up(tmp_path):
    out = tmp_path / "demo"
    proc = start_demo(out, "--steps", "100000", "--peers-per-stage", "1")
    lines = []
    peer_pids: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        for line in proc.stdout:  # wait until training is under way (the first progress line)
            lines.append(line)
            if "tok/s" in line or time.monotonic() > deadline:
                break
        metrics = out / "metrics.jsonl"
        wait_until(
            lambda: metrics.exists() and read_metrics(metrics, "event"), 60, "the trainer's first event"
        )
        peer_pids = {int(p.split("(pid ")[1].split(",")[0]) for p in lines if "(pid " in p}
        assert len(peer_pids) == 2, "".join(lines)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for pid in peer_pids:  # each peer leads a process group of its own: a killed demo orphans them
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert wait_gone({proc.pid} | peer_pids) == [], "processes left behind after Ctrl-C"
    assert read_metrics(out / "metrics.jsonl", "event")  # the trainer started writing before the interrupt


def test_demo_spec_without_the_examples_file_and_overrides(tmp_path, monkeypatch):
    """An installed package has no examples/: the built-in spec is used, --stages/--codec apply."""
    monkeypatch.setattr("swarm.tools.demo._repo_example", lambda: None)
    spec = demo_spec(stages=4, codec="int8")
    assert spec.num_stages == 4 and spec.codecs.activations == spec.codecs.gradients == "int8"
    assert spec.model.d_model == DEFAULT_DEMO_SPEC["model"]["d_model"]
    # the built-in spec and examples/demo.yaml describe the same run
    monkeypatch.undo()
    assert demo_spec().spec_hash == demo_spec(spec_path=None).spec_hash
    from swarm.run.spec import RunSpec

    assert (
        RunSpec.from_dict(DEFAULT_DEMO_SPEC).spec_hash
        == RunSpec.from_yaml(REPO / "examples/demo.yaml").spec_hash
    )
