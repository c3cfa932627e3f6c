"""A stage outlives its peers: a keeper's snapshot brings back a stage that lost every replica, and
without one a peer refuses to start a trained run's stage from initial weights (swarm/tools/keeper.py).

Real hivemind peers on loopback (the driver of test_peer_pipeline: bootstrap DHT + micro-batch sender);
everything is shut down in ``finally``.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from peer import StagePeer
from swarm.dht.membership import Membership
from swarm.dht.network import DHTConfig, start_dht
from swarm.dht.snapshots import StageStateLost
from swarm.tools.keeper import Keeper, KeeperConfig
from tests.helpers import Driver, peer_config, spec_for, start_peers, train, until

pytestmark = pytest.mark.slow


def flat_state(peer: StagePeer) -> torch.Tensor:
    _, tensors = peer.compute.export_state()
    return torch.cat([t.reshape(-1).float() for t in tensors])


async def tick_until(keeper: Keeper, predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}: {keeper.status()}")
        await asyncio.to_thread(keeper.tick)
        await asyncio.sleep(0.2)


def test_a_stage_that_loses_every_replica_rolls_back_to_the_keepers_snapshot(tmp_path):
    spec = spec_for("keep1", stages=2, accumulate=1)

    async def main():
        driver = Driver(spec)
        peers: list[StagePeer] = []
        keeper = kdht = None
        try:
            await driver.start()
            await start_peers(driver, [peer_config(driver, 0), peer_config(driver, 1)], peers)
            a, b = peers
            await train(driver, [a.peer_id, b.peer_id], [1, 2, 3])
            await until(lambda: a.version == 3 and b.version == 3, 30, "three steps on both stages")

            # a keeper on its own DHT node (what `swarm keeper` runs) takes a snapshot of each stage
            kdht = await asyncio.to_thread(start_dht, DHTConfig(initial_peers=driver.maddrs()))
            kmem = Membership(kdht, spec.run_id)
            await asyncio.to_thread(kmem.fetch_spec, 10)
            # the first snapshot of a stage is taken at once, the next one only after interval_s (an hour)
            cfg = KeeperConfig(directory=str(tmp_path / "snapshots"), interval_s=3600, tick_s=0.5, keep=2)
            keeper = Keeper(kdht, kmem, spec, cfg)
            await asyncio.to_thread(keeper.start)
            await tick_until(
                keeper,
                lambda: all(s is not None and s.version == 3 for s in keeper.held),
                60,
                "snapshots of both stages at version 3",
            )
            assert keeper.store.versions(1) == [3]
            torch.testing.assert_close(keeper.held[1].flat, flat_state(b))
            at_snapshot = flat_state(b)
            [index] = await asyncio.to_thread(driver.membership.snapshot_indexes)
            assert index.keeper_id == keeper.peer_id and index.versions == (3, 3)

            # stage 1 trains on (the keeper sees it but takes no newer snapshot), then loses every replica
            await train(driver, [a.peer_id, b.peer_id], [4, 5])
            await until(lambda: b.version == 5, 30, "two more steps")
            await tick_until(keeper, lambda: keeper.seen[1] == 5, 30, "the keeper seeing version 5")
            assert keeper.held[1].version == 3
            await b.shutdown()

            # a new peer of stage 1 finds no live replica: it takes the keeper's snapshot, not the seed
            await start_peers(driver, [peer_config(driver, 1)], peers)
            c = peers[-1]
            assert c.loaded_from == "keeper" and c.version == 3
            torch.testing.assert_close(flat_state(c), at_snapshot)
            events = await asyncio.to_thread(driver.membership.events)
            [event] = [e for e in events if e.stage == 1]
            assert (event.kind, event.source, event.version, event.lost_from) == ("rollback", "keeper", 3, 5)
            assert event.peer_id == c.peer_id and "version 3" in event.describe()
            await train(driver, [a.peer_id, c.peer_id], [6])  # the pipeline trains on
            await until(lambda: c.version == 4, 30, "a step after the rollback")

            # without a keeper, the next peer of stage 1 refuses to start it from initial weights
            await asyncio.to_thread(keeper.close)
            keeper = None
            await c.shutdown()
            with pytest.raises(StageStateLost, match="--start-fresh"):
                await start_peers(driver, [peer_config(driver, 1)], peers)
            assert peers[-1].state == "stopped"
            # ... unless told to; that is reported too
            await start_peers(driver, [peer_config(driver, 1, start_fresh=True)], peers)
            d = peers[-1]
            assert d.loaded_from == "seed" and d.version == 0
            events = await asyncio.to_thread(driver.membership.events)
            fresh = [e for e in events if e.kind == "fresh"]
            assert [(e.stage, e.source, e.peer_id) for e in fresh] == [(1, "seed", d.peer_id)]
            assert fresh[0].lost_from == 5  # the most the keeper saw (c's record, at 4, may have expired)
        finally:
            for p in reversed(peers):
                await p.shutdown()
            if keeper is not None:
                await asyncio.to_thread(keeper.close)
            if kdht is not None:
                await asyncio.to_thread(kdht.shutdown)
            await driver.shutdown()

    asyncio.run(main())


def test_a_restarted_keeper_serves_its_snapshots_from_disk(tmp_path):
    """A keeper that restarts declares the snapshots on disk at once, before any replica is back."""
    spec = spec_for("keep2", stages=1, accumulate=1)

    async def main():
        driver = Driver(spec)
        peers: list[StagePeer] = []
        keeper = kdht = None
        cfg = KeeperConfig(directory=str(tmp_path / "snapshots"), interval_s=0.5, tick_s=0.5)
        try:
            await driver.start()
            await start_peers(driver, [peer_config(driver, 0)], peers)
            a = peers[0]
            await train(driver, [a.peer_id], [1, 2])
            await until(lambda: a.version == 2, 30, "two steps")
            kdht = await asyncio.to_thread(start_dht, DHTConfig(initial_peers=driver.maddrs()))
            kmem = Membership(kdht, spec.run_id)
            await asyncio.to_thread(kmem.fetch_spec, 10)
            keeper = Keeper(kdht, kmem, spec, cfg)
            await asyncio.to_thread(keeper.start)
            await tick_until(keeper, lambda: keeper.held[0] is not None, 60, "a snapshot of stage 0")
            await a.shutdown()
            await asyncio.to_thread(keeper.close)
            keeper = Keeper(kdht, kmem, spec, cfg)  # a new keeper over the same directory
            await asyncio.to_thread(keeper.start)
            assert keeper.held[0] is not None and keeper.held[0].version == 2
            await start_peers(driver, [peer_config(driver, 0)], peers)
            assert peers[-1].loaded_from == "keeper" and peers[-1].version == 2
        finally:
            for p in reversed(peers):
                await p.shutdown()
            if keeper is not None:
                await asyncio.to_thread(keeper.close)
            if kdht is not None:
                await asyncio.to_thread(kdht.shutdown)
            await driver.shutdown()

    asyncio.run(main())
