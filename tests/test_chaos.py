"""Chaos: peers are SIGKILLed and replaced at random while a trainer runs; training carries on.

Two swarms of 2 stages x 2 ``swarm peer`` processes (``swarm.tools.demo.Demo``) train the same spec on the
same data for the same number of micro-batches: one without faults, one where every few seconds a
random peer (of a stage that still has a live stage-mate, so the stage stays served) is killed with
SIGKILL (its whole process group) and a fresh peer is started for its stage; the fresh peer
downloads the stage's state from the survivor. Checks: every micro-batch is accounted for
(completed or dropped with a reason, none in flight at the end), every stage is served at the end,
the held-out loss after training is close to the fault-free run's, and no process is left behind.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from swarm.dht import processes
from swarm.run.spec import RunSpec
from swarm.tools.demo import Demo, DemoConfig
from swarm.train.metrics import read_metrics
from swarm.train.trainer import Trainer, TrainerConfig
from tests.helpers import until

pytestmark = pytest.mark.slow

ACCUMULATE = 4  # a stage step combines 2 micro-batches of each of its 2 replicas (peer/replicas.py)
STEPS = 200  # trainer steps: STEPS * ACCUMULATE = 800 micro-batches
# Measured on the 2-core dev machine, held-out loss chaos - clean: -0.03 (3 kills, 1000 steps),
# -0.12 (4 kills, 1000 steps) and -0.10 (2 kills, 800 steps, load average 15), from ~5.5 at the
# start. The fault-free async swarm itself varies by ~0.1 between runs; 0.3 nats leaves room.
LOSS_MARGIN = 0.3

SPEC = {
    "run_id": "chaos",
    "model": {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
    "stages": 2,
    "codecs": {"activations": "blockwise8", "gradients": "blockwise8"},
    "optimizer": {"lr": 1e-2, "max_versions": 16, "accumulate": ACCUMULATE},
    "averaging": {},
    "micro_batch_size": 4,
}


def make_demo(out) -> Demo:
    return Demo(
        DemoConfig(
            spec=RunSpec.from_dict(SPEC),
            peers_per_stage=2,
            out_dir=str(out),
            peer_args=("--throughput", "20000", "--announce-period", "1"),
            torch_threads=1,
            quiet=True,
        )
    )


def make_trainer(demo: Demo, out) -> Trainer:
    return Trainer(
        TrainerConfig(
            initial_peers=(demo.maddr,),
            run_id=demo.spec.run_id,
            steps=STEPS,
            out_dir=str(out),
            max_inflight=4,
            eval_every=STEPS,
            eval_batches=4,
            seed=0,
            quiet=True,
            refresh_every_s=0.5,
            max_attempts=8,
        )
    )


def final_eval(out) -> float:
    evals = read_metrics(out / "metrics.jsonl", "eval")
    assert evals and evals[-1]["step"] == STEPS, evals
    return evals[-1]["eval_loss"]


def remove_stale_sockets() -> int:
    """Remove this session's hivemind socket files that nobody listens on any more.

    A SIGKILLed process cannot remove its own sockets (tests/conftest.py fails a module that leaves
    any), so after each kill the test cleans up what the victim left; live peers keep theirs.
    """
    return len(processes.remove_stale_sockets(os.environ["SWARMPIPE_SOCKET_PREFIX"]))


def live(demo: Demo, stage: int) -> list:
    return [p for p in demo.peers if p.stage == stage and not p.killed and p.popen.poll() is None]


def test_random_sigkills_and_replacements_do_not_derail_training(tmp_path):
    rng = random.Random(7)
    kills: list[dict] = []
    fresh: list[asyncio.Task] = []
    stale: list[int] = []

    # the fault-free reference
    clean = make_demo(tmp_path / "clean")
    try:
        clean.start()
        ref_summary = make_trainer(clean, tmp_path / "clean-train").train()
    finally:
        clean.shutdown()
    assert clean.leftovers() == []
    assert ref_summary["micro_batches"]["completed"] == STEPS * ACCUMULATE
    ref_loss = final_eval(tmp_path / "clean-train")

    demo = make_demo(tmp_path / "chaos")
    try:
        demo.start()
        trainer = make_trainer(demo, tmp_path / "chaos-train")

        # Kills are scheduled by training progress, not wall time, so the test does the same thing on a
        # loaded and on an idle machine: one kill at each of these steps, on a random stage that still
        # has two live peers (so it stays served), waiting while no stage has (a replacement is starting).
        kill_at = [int(STEPS * f) for f in (0.15, 0.35, 0.55, 0.75)]

        async def chaos(run: asyncio.Task) -> None:
            while kill_at and not run.done():
                await asyncio.sleep(0.1)
                if getattr(trainer, "step", 0) < kill_at[0]:
                    continue
                stages = [s for s in range(2) if len([p for p in live(demo, s) if p.peer_id]) >= 2]
                if not stages:
                    continue
                kill_at.pop(0)
                victim = rng.choice([p for p in live(demo, rng.choice(stages)) if p.peer_id])
                os.killpg(victim.pid, signal.SIGKILL)
                victim.killed = True
                await asyncio.to_thread(victim.popen.wait)
                # the group's DHT child and p2pd die with it; their socket files are stale once they are gone
                await until(
                    lambda g=victim.pid: not processes.alive_in_groups([g]), 30, "the victim's group to die"
                )
                stale.append(remove_stale_sockets())
                kills.append(
                    {"stage": victim.stage, "peer": victim.peer_id, "step": getattr(trainer, "step", 0)}
                )
                # the replacement starts at once and comes online in the background
                fresh.append(
                    asyncio.create_task(asyncio.to_thread(demo.add_peer, victim.stage, name=f"f{len(kills)}"))
                )

        async def main() -> dict:
            run = asyncio.get_running_loop().create_task(trainer.run())
            monkey = asyncio.get_running_loop().create_task(chaos(run))
            try:
                return await asyncio.wait_for(asyncio.shield(run), timeout=300)
            finally:
                monkey.cancel()
                [outcome] = await asyncio.gather(monkey, return_exceptions=True)
                if isinstance(outcome, Exception):  # a broken chaos loop must not pass silently
                    raise outcome
                if not run.done():
                    run.cancel()
                await asyncio.gather(*fresh)  # every replacement came online (raises if one did not)

        t0 = time.monotonic()
        summary = asyncio.run(main())
        wall = time.monotonic() - t0
        mb = summary["micro_batches"]
        print(
            f"chaos: {len(kills)} kills {kills}, {wall:.0f} s, micro-batches {mb}, stale sockets removed {stale}"
        )
        # a stage is only hit while it has two live peers and a replacement needs seconds to come
        # online, so of the four scheduled kills at least the first two (one per stage if needed) happen
        assert len(kills) >= 2, kills
        # every micro-batch is accounted for
        assert mb["completed"] == STEPS * ACCUMULATE, mb
        assert (
            mb["opened"] == mb["completed"] + mb["dropped"] and mb["inflight"] == 0 and mb["pending"] == 0
        ), mb
        assert mb["failed_attempts"] >= 1, mb  # the kills did hit micro-batches in flight
        # every stage is served at the end (the survivors plus the fresh peers)
        records = demo.boot.membership.all_stage_records(2)
        for stage in (0, 1):
            online = {pid for pid, r in records[stage].items() if r.state == "online"}
            assert online & {p.peer_id for p in live(demo, stage)}, (stage, records[stage])
        chaos_loss = final_eval(tmp_path / "chaos-train")
        print(
            f"held-out loss: clean {ref_loss:.3f}, chaos {chaos_loss:.3f}, diff {chaos_loss - ref_loss:+.3f}"
        )
        assert abs(chaos_loss - ref_loss) < LOSS_MARGIN, (ref_loss, chaos_loss)
    finally:
        demo.shutdown()
        remove_stale_sockets()  # a peer still starting at shutdown is SIGKILLed after the grace period
    assert demo.leftovers() == []
