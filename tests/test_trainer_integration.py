"""The trainer with real stage peers on loopback: a 2 stages x 2 peers swarm of `swarm peer` processes.

One swarm (bootstrap in this process, peers as subprocesses via ``swarm.tools.demo.Demo``) serves the
whole module; the tests run in file order and the last one kills a peer. A tiny model keeps the
module well under a minute or two on 2 cores.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from swarm.run.spec import RunSpec
from swarm.tools.demo import Demo, DemoConfig
from swarm.tools.generation import GenerateConfig, generate
from swarm.train.metrics import read_metrics
from swarm.train.trainer import Trainer, TrainerConfig

pytestmark = pytest.mark.slow

TINY = {
    "run_id": "trainer-it",
    "model": {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
    "stages": 2,
    "codecs": {"activations": "blockwise8", "gradients": "blockwise8"},
    "optimizer": {"lr": 1e-2},
    "averaging": {},
    "micro_batch_size": 4,
}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    out = tmp_path_factory.mktemp("swarm")
    demo = Demo(
        DemoConfig(
            spec=RunSpec.from_dict(TINY),
            peers_per_stage=2,
            out_dir=str(out),
            peer_args=("--throughput", "20000"),  # declared: skips the start-up measurement
            torch_threads=1,
            quiet=True,
        )
    )
    try:
        demo.start()
        yield demo
    finally:
        demo.shutdown()
        assert demo.leftovers() == [], "peer process groups left behind"


def trainer_for(swarm: Demo, tmp_path, **kw) -> Trainer:
    cfg = dict(
        initial_peers=(swarm.maddr,),
        run_id=swarm.spec.run_id,
        out_dir=str(tmp_path),
        max_inflight=4,
        quiet=True,
        refresh_every_s=0.5,
    )
    cfg.update(kw)
    return Trainer(TrainerConfig(**cfg))


def stage_peers(swarm: Demo, stage: int) -> list[str]:
    return [p.peer_id for p in swarm.peers if p.stage == stage and not p.killed]


def test_two_stages_two_peers_loss_falls_and_everything_is_accounted(swarm, tmp_path):
    summary = trainer_for(swarm, tmp_path, steps=40, eval_every=20).train()
    mb = summary["micro_batches"]
    assert mb["completed"] == 40 and mb["opened"] == mb["completed"] + mb["dropped"]
    assert mb["inflight"] == 0 and mb["pending"] == 0
    assert summary["loss_last"] < summary["loss_first"] - 0.5, summary
    for stage in (0, 1):
        served = summary["peers_by_stage"][str(stage)]
        assert set(stage_peers(swarm, stage)) <= set(served) and all(n > 0 for n in served.values()), served
    assert summary["bytes_per_token"] and summary["compression_ratio"] > 3  # blockwise8 vs fp32
    for name in ("metrics.jsonl", "loss.png", "summary.json"):
        assert (tmp_path / name).stat().st_size > 0
    evals = read_metrics(tmp_path / "metrics.jsonl", "eval")  # held-out loss, forward only through the swarm
    assert [e["step"] for e in evals] == [20, 40] and all(e["eval_loss"] for e in evals)
    assert evals[-1]["eval_loss"] < 5.0


def test_two_trainers_feed_one_run_and_share_progress(swarm, tmp_path):
    trainers = [
        trainer_for(swarm, tmp_path / name, steps=12, seed=i, trainer_id=name, max_inflight=2)
        for i, name in enumerate(("alice", "bob"))
    ]

    async def both():
        return await asyncio.gather(*(t.run() for t in trainers))

    summaries = asyncio.run(both())
    assert [s["micro_batches"]["completed"] for s in summaries] == [12, 12]
    progress = swarm.boot.membership.progress()  # what `swarm status` shows
    tokens = 12 * swarm.spec.tokens_per_micro_batch
    assert {k: v["tokens"] for k, v in progress["trainers"].items() if k in ("alice", "bob")} == {
        "alice": tokens,
        "bob": tokens,
    }
    assert progress["tokens"] >= 2 * tokens


def test_straggler_receives_clearly_fewer_micro_batches(swarm, tmp_path):
    slow = swarm.add_peer(1, extra_args=("--slowdown", "0.2"), name="slow")  # 0.2 s extra per micro-batch
    summary = trainer_for(swarm, tmp_path, steps=30).train()
    served = summary["peers_by_stage"]["1"]
    fast = [served.get(p, 0) for p in stage_peers(swarm, 1) if p != slow.peer_id]
    assert len(fast) == 2 and all(n > 0 for n in fast), served
    assert served.get(slow.peer_id, 0) * 3 < min(fast), served


def test_generate_samples_through_the_swarm(swarm):
    cfg = GenerateConfig(
        initial_peers=(swarm.maddr,),
        run_id=swarm.spec.run_id,
        prompt="def ",
        max_new_tokens=6,
        temperature=0.0,
    )
    pieces: list[str] = []
    text = generate(cfg, on_text=pieces.append)
    assert text and "".join(pieces) == text
    assert generate(cfg) == text  # greedy sampling of unchanged weights is deterministic


def test_kill_9_peer_with_micro_batches_in_flight(swarm, tmp_path):
    victim = next(p for p in swarm.peers if p.stage == 0 and not p.killed)
    trainer = trainer_for(swarm, tmp_path, steps=40)
    killed_with_inflight = []

    async def main():
        run = asyncio.get_running_loop().create_task(trainer.run())
        try:
            while True:  # wait until the victim holds some of our micro-batches, then SIGKILL its group
                router = getattr(trainer, "router", None)
                st = router.stats.get(victim.peer_id) if router else None
                if st is not None and st.inflight > 0 and trainer.step >= 5:
                    killed_with_inflight.append(st.inflight)
                    os.killpg(victim.pid, signal.SIGKILL)
                    victim.killed = True
                    break
                if run.done():
                    break
                await asyncio.sleep(0.01)
            return await asyncio.wait_for(run, timeout=120)
        finally:
            if not run.done():
                run.cancel()

    summary = asyncio.run(main())
    victim.popen.wait(timeout=10)
    assert killed_with_inflight and killed_with_inflight[0] > 0
    mb = summary["micro_batches"]
    assert mb["completed"] == 40, mb
    assert mb["opened"] == mb["completed"] + mb["dropped"] and mb["inflight"] == 0 and mb["pending"] == 0
    assert mb["failed_attempts"] >= 1 and mb["retries"] >= 1, mb
    assert set(mb["failures_by_reason"]) <= {"unreachable", "timeout", "refused", "version_evicted"}, mb
    stage0 = summary["peers_by_stage"]["0"]
    survivor = next(p.peer_id for p in swarm.peers if p.stage == 0 and not p.killed)
    assert stage0[survivor] > stage0.get(victim.peer_id, 0)
