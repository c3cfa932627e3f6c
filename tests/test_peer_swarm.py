"""Several peers per stage on loopback: averaging, state download for a joining peer, rebalancing.

Reuses the driver of ``test_peer_pipeline`` (bootstrap DHT + report sink + micro-batch sender).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from peer import StagePeer
from swarm.spec import RunSpec
from tests.test_peer_pipeline import Driver, _batch, peer_config, start_peers, stop_all

pytestmark = pytest.mark.slow


def spec_for(run_id: str, stages: int, every_steps: int) -> RunSpec:
    return RunSpec.from_dict(
        {
            "run_id": run_id,
            "model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
            "stages": stages,
            "codecs": {"activations": "none", "gradients": "none"},
            "optimizer": {"name": "adamw", "lr": 1e-2, "mode": "async", "accumulate": 1},
            "averaging": {"every_steps": every_steps, "timeout_s": 8},
            "micro_batch_size": 2,
        }
    )


def distance(a: StagePeer, b: StagePeer) -> float:
    pa, pb = a.compute.params(), b.compute.params()
    return float(torch.sqrt(sum(((pa[n] - pb[n]) ** 2).sum() for n in pa)))


async def train(driver: Driver, route: list[str], seeds) -> None:
    for seed in seeds:
        tokens, targets = _batch(seed, driver.spec)
        mb = await driver.send(route, tokens, targets)
        await driver.wait_reports(mb, {"loss", "done"})


async def until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.1)


def test_same_stage_peers_average_and_a_joiner_downloads_the_state():
    spec = spec_for("avg1", stages=1, every_steps=2)

    async def main():
        driver = Driver(spec)
        peers: list[StagePeer] = []
        try:
            await driver.start()
            await start_peers(driver, [peer_config(driver, 0), peer_config(driver, 0)], peers)
            a, b = peers
            assert a.loaded_from == "seed" and b.loaded_from in ("seed", "peer")
            # different data on each replica: their weights drift apart
            await train(driver, [a.peer_id], [1, 2])
            await train(driver, [b.peer_id], [3, 4])
            apart = distance(a, b)
            assert apart > 1e-3
            # the announce loop starts a background round once every_steps local steps passed
            await until(
                lambda: a.counters["averaging_rounds"] >= 1 and b.counters["averaging_rounds"] >= 1,
                30,
                "averaging",
            )
            assert distance(a, b) < 1e-3 * apart  # no training since: both hold the average
            for pa, pb in zip(
                a.compute.optimizer.state_tensors(), b.compute.optimizer.state_tensors(), strict=True
            ):
                torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-6)  # moments averaged too

            # a third peer of the stage downloads the current state instead of starting from the seed
            await start_peers(driver, [peer_config(driver, 0)], peers)
            c = peers[2]
            assert c.loaded_from == "peer"
            # the donor is whichever replica answered first: c holds exactly its version and weights
            donor = min((p for p in (a, b) if p.version == c.version), key=lambda p: distance(c, p))
            assert distance(c, donor) == 0.0
            assert c.compute.optimizer.step_count == donor.compute.optimizer.step_count
            version = c.version
            await train(driver, [c.peer_id], [5])  # and it trains from there
            assert c.version == version + 1
        finally:
            await stop_all(peers, driver)

    asyncio.run(main())


def test_a_moved_peer_serves_its_new_stage_with_current_weights():
    spec = spec_for("move2", stages=2, every_steps=0)

    async def main():
        driver = Driver(spec)
        peers: list[StagePeer] = []
        try:
            await driver.start()
            # stage 0 is weak (1 tok/s), stage 1 strong: moving the slower stage-1 peer to stage 0 helps
            await start_peers(
                driver,
                [peer_config(driver, 0, throughput=1.0), peer_config(driver, 1, throughput=12.0)],
                peers,
            )
            a, b = peers
            await train(driver, [a.peer_id, b.peer_id], [1, 2])
            assert a.version == 2
            await start_peers(driver, [peer_config(driver, 1, throughput=10.0, rebalance=True)], peers)
            c = peers[2]
            await until(lambda: c.state == "online" and c.stage == 0, 20, "the rebalancing move")
            assert c.counters["moves"] == 1 and c.loaded_from == "peer"
            assert c.version == a.version and distance(c, a) == 0.0
            await train(driver, [c.peer_id, b.peer_id], [3])  # it serves stage 0 now
            assert c.version == 3
            # --stage auto: a joiner claims the weakest stage (0: 1 + 10 tok/s vs 12) with its state
            await start_peers(driver, [peer_config(driver, "auto", throughput=10.0)], peers)
            d = peers[3]
            assert d.stage == 0 and d.loaded_from == "peer"
            assert min(distance(d, p) for p in (a, c) if p.version == d.version) == 0.0
        finally:
            await stop_all(peers, driver)

    asyncio.run(main())
