"""A stage peer's side of failure detection, on loopback with real hivemind peers: INFO probes
list what the peer holds, CANCEL drops a trainer's micro-batches, and a trainer that vanished has
its stash entries dropped long before their TTL (note "trainers that vanish" in peer/trainers.py).

The next hop of the route is a fake stage 1 (the test's own P2P) that acknowledges FORWARD and
never sends the backward, so stage 0 keeps the micro-batch in its stash until something drops it.
"""

from __future__ import annotations

import asyncio

import pytest

from peer import StagePeer
from swarm.dht.network import DHTConfig, start_dht
from swarm.run.spec import RunSpec
from swarm.wire.protocol import CANCEL, FORWARD, INFO, Message, call, serve
from tests.helpers import Driver, batch, peer_config, start_peers, stop_all, tiny_spec, until

pytestmark = pytest.mark.slow


def spec_for(run_id: str) -> RunSpec:
    return RunSpec.from_dict(tiny_spec(run_id, stages=2, mode="async").to_dict() | {"stash_ttl_s": 600})


async def fake_next_hop(driver: Driver) -> list[dict]:
    """Serve FORWARD on the driver: acknowledge and keep the headers (the backward never comes)."""
    got: list[dict] = []

    async def on_forward(message: Message, remote) -> dict:
        got.append(message.header)
        return {"queue": 0}

    await serve(driver.p2p, FORWARD, on_forward)
    return got


async def second_node(driver: Driver, spec: RunSpec) -> Driver:
    """Another node (its own DHT and peer id) joined to the driver's: a second trainer."""
    node = Driver(spec)
    node.dht = await asyncio.to_thread(start_dht, DHTConfig(initial_peers=driver.maddrs()))
    node.p2p = await node.dht.replicate_p2p()
    return node


async def stashed_at(peer: StagePeer, mb: str, timeout_s: float = 30) -> None:
    await until(lambda: mb in peer.compute.stash, timeout_s, f"{mb} stashed", interval_s=0.02)


def test_info_lists_what_a_peer_holds_and_cancel_drops_only_the_owners_micro_batches():
    spec = spec_for("live-cancel")

    async def main():
        driver = Driver(spec)
        stranger = Driver(spec)
        peers: list[StagePeer] = []
        try:
            await driver.start()
            stranger = await second_node(driver, spec)
            hop = await fake_next_hop(driver)
            await start_peers(driver, [peer_config(driver, 0)], peers)
            stage0 = peers[0]
            tokens, targets = batch(0, spec)
            mb = await driver.send([stage0.peer_id, driver.peer_id], tokens, targets)
            await stashed_at(stage0, mb)
            await until(lambda: hop, 30, "the forward to the next hop", interval_s=0.02)
            # the hop was acknowledged: nothing active is left here
            await until(lambda: not stage0.stats()["held"], 30, "no held micro-batch", interval_s=0.02)
            info = await call(
                driver.p2p, stage0.peer_id, INFO, Message({"mb_ids": [mb, "other"]}), timeout_s=5
            )
            assert info["stage"] == 0 and info["held"] == [] and info["stashed"] == [mb]
            plain = await call(driver.p2p, stage0.peer_id, INFO, Message({}), timeout_s=5)
            assert "held" not in plain  # an INFO without ids is the old reply

            # a peer that is not the micro-batch's trainer cannot cancel it
            other = await call(
                stranger.p2p,
                stage0.peer_id,
                CANCEL,
                Message({"run_id": spec.run_id, "mb_ids": [mb]}),
                timeout_s=5,
            )
            assert other["dropped"] == 0 and mb in stage0.compute.stash
            mine = await call(
                driver.p2p,
                stage0.peer_id,
                CANCEL,
                Message({"run_id": spec.run_id, "mb_ids": [mb]}),
                timeout_s=5,
            )
            assert mine["dropped"] == 1 and mb not in stage0.compute.stash
            stats = stage0.stats()
            assert stats["cancelled"] == 1 and stats["stash_expired"] == 0
        finally:
            await stop_all(peers, driver)
            await stranger.shutdown()

    asyncio.run(main())


def test_stash_entries_of_a_trainer_that_vanished_are_dropped_without_waiting_for_the_ttl():
    spec = spec_for("live-gone")

    async def main():
        driver = Driver(spec)  # bootstrap and fake stage 1
        trainer = Driver(spec)  # the trainer that will vanish
        peers: list[StagePeer] = []
        try:
            await driver.start()
            await fake_next_hop(driver)
            trainer = await second_node(driver, spec)
            await start_peers(driver, [peer_config(driver, 0)], peers)
            stage0 = peers[0]
            tokens, targets = batch(0, spec)
            mb = await trainer.send([stage0.peer_id, driver.peer_id], tokens, targets)
            await stashed_at(stage0, mb)
            await trainer.p2p.shutdown()
            await trainer.shutdown()  # gone without a word: only a probe can tell
            trainer.dht = None
            await until(lambda: mb not in stage0.compute.stash, 60, "the stash entry dropped")  # TTL is 600 s
            # the drop runs in a worker thread and is counted when it returns: the entry can leave the
            # stash a moment before the counter moves
            await until(lambda: stage0.stats()["trainer_gone"] >= 1, 10, "the drop counted", interval_s=0.02)
            stats = stage0.stats()
            assert stats["trainer_gone"] == 1 and stats["stash_expired"] == 0
        finally:
            await stop_all(peers, driver)
            await trainer.shutdown()

    asyncio.run(main())
