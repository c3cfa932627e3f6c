"""A private run on loopback: insiders train and share state; outsiders are refused on both planes.

Insiders: a trainer-like node that publishes the spec (it holds the secret), one peer per stage,
and a second stage-0 peer that joins later and downloads the state. Outsiders: a node without the
secret and one with a wrong secret. They try to appear in the stage lists (DHT records without or
with a forged proof), to call FORWARD / BACKWARD / INFO on the peers and REPORT on the trainer, and
to download a stage's weights through hivemind's averager; every attempt is refused and changes
nothing. A peer started without (or with a wrong) secret refuses to start with a clear message.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from compression import get_codec
from peer import StagePeer
from peer.averaging import StageAverager
from swarm.dht.auth import RunAuth, generate_secret
from swarm.dht.network import DHTConfig
from swarm.dht.records import PeerRecord
from swarm.errors import ConfigError, RequestError
from swarm.tools.export import ExportConfig, export_run, load_model
from swarm.tools.generation import GenerateConfig, generate_async
from swarm.tools.status import gather_run_status
from swarm.wire.protocol import BACKWARD, FORWARD, INFO, REPORT, BackwardHeader, Report
from tests.helpers import Node, batch, peer_config, private_spec, time_limit

pytestmark = pytest.mark.slow


async def train(node: Node, route: list[str], n: int, seed: int = 0) -> list[float]:
    """Send ``n`` micro-batches through ``route`` and wait for their loss and done reports."""
    losses: dict[str, float] = {}
    done: set[str] = set()
    sent = []
    for i in range(n):
        tokens, targets = batch(seed + i, node.spec)
        h = node.header(route, tokens, targets)
        await node.call(route[0], FORWARD, h.to_wire())
        sent.append(h.mb_id)
    async with time_limit(60):
        while len(done) < n or len(losses) < n:
            r: Report = await node.reports.get()
            assert r.kind != "failed", r.reason
            if r.kind == "loss":
                losses[r.mb_id] = r.loss
            elif r.kind == "done":
                done.add(r.mb_id)
    assert done == set(sent)
    return [losses[m] for m in sent]


def test_outsiders_are_refused_and_insiders_train():
    secret = generate_secret()
    spec = private_spec("priv2", secret, stages=2)

    async def main():
        insider = Node(spec, secret, publish=True)
        outsider: Node | None = None
        forger: Node | None = None
        peers: list[StagePeer] = []
        spy: StageAverager | None = None
        try:
            await insider.start()
            # a peer without the secret, or with a wrong one, does not start
            for bad, pattern in ((None, "is private"), (generate_secret(), "does not match")):
                p = StagePeer(peer_config(insider, 0, secret=bad))
                with pytest.raises(ConfigError, match=pattern):
                    await p.start()
            for stage in (0, 1):
                p = StagePeer(peer_config(insider, stage, secret=secret))
                peers.append(p)
                await p.start()
            route = [p.peer_id for p in peers]
            losses = await train(insider, route, 4)
            assert all(p.version == 4 for p in peers) and all(torch.isfinite(torch.tensor(losses)))

            outsider = Node(spec, None, initial_peers=insider.maddrs())
            forger = Node(spec, None, initial_peers=insider.maddrs())
            await outsider.start()
            await forger.start()
            forger.membership.set_auth(RunAuth(spec.run_id, secret=generate_secret()))  # forged proofs

            # --- DHT: records without a valid proof never reach a stage list
            for node in (outsider, forger):
                record = PeerRecord(
                    peer_id=node.membership.peer_id,
                    run_id=spec.run_id,
                    stage=0,
                    state="online",
                    throughput=1e9,  # the most attractive peer of the run, if anyone believed it
                    queue=0,
                    version=100,
                    codecs=("none",),
                    spec_hash=spec.spec_hash,
                )
                assert await asyncio.to_thread(node.membership.announce, record, 60.0)
            raw = insider.membership.for_run(spec.run_id)  # a view without access rules
            raw.spec, raw.spec_hash = spec, spec.spec_hash
            async with time_limit(20):
                while len(await asyncio.to_thread(raw.stage_records, 0)) < 3:
                    await asyncio.sleep(0.2)
            rejected = insider.membership.rejected
            for view in (insider.membership, peers[0]._membership, peers[1]._membership):
                stage0 = await asyncio.to_thread(view.stage_records, 0)
                assert set(stage0) == {route[0]}
            assert insider.membership.rejected >= rejected + 2
            reasons = " ".join(insider.membership.rejected_reasons)
            assert "carries no join proof" in reasons and "not made with this run's secret" in reasons

            # --- `swarm status`: with the secret only insiders are listed; without, all with a note
            def status_of(key):
                return gather_run_status(insider.membership.for_run(spec.run_id), secret=key)

            checked = await asyncio.to_thread(status_of, secret)
            assert {r.peer_id for r in checked.stages[0].peers} == {route[0]} and not checked.notes
            unchecked = await asyncio.to_thread(status_of, None)
            assert len(unchecked.stages[0].peers) == 3
            assert any("private" in n and "--secret-file" in n for n in unchecked.notes)
            with pytest.raises(ConfigError, match="does not match"):
                await asyncio.to_thread(status_of, generate_secret())

            # --- RPC: every handler refuses, before decoding anything
            tokens, targets = batch(99, spec)
            good = get_codec("none").encode(torch.zeros(2, 16, 32))
            bwd = BackwardHeader(run_id=spec.run_id, spec_hash=spec.spec_hash, mb_id="x", stage=0).to_wire()
            report = Report(run_id=spec.run_id, mb_id="x", kind="done", stage=0, peer=route[0]).to_wire()
            before = [(p.version, p.counters["refused_auth"]) for p in peers]
            for node, pattern in ((outsider, "no join proof"), (forger, "no join proof")):
                h = node.header(route, tokens, targets)
                attempts = [
                    (route[0], FORWARD, h.to_wire(), b""),  # would get activations computed for it
                    (route[1], FORWARD, node.header(route, tokens, targets, stage=1).to_wire(), good),
                    (route[0], BACKWARD, bwd, good),  # would push gradients
                    (route[0], INFO, {}, b""),
                    (route[1], INFO, {}, b""),
                    (insider.peer_id, REPORT, report, b""),  # would fake progress at the trainer
                ]
                for target, name, header, payload in attempts:
                    with pytest.raises(RequestError, match=pattern):
                        await node.call(target, name, header, payload)
            # the forger signs with its wrong secret: refused as an invalid proof
            forger.auth = RunAuth(spec.run_id, secret=generate_secret())
            for target, name, header in ((route[0], INFO, {}), (route[1], BACKWARD, bwd)):
                with pytest.raises(RequestError, match="invalid"):
                    await forger.call(target, name, header, good)
            after = [(p.version, p.counters["refused_auth"]) for p in peers]
            assert [a[0] for a in after] == [b[0] for b in before]  # nothing changed
            assert after[0][1] - before[0][1] == 2 * 3 + 1 and after[1][1] - before[1][1] == 2 * 2 + 1

            # --- state download: an insider joiner gets the weights, an outsider gets nothing
            joiner = StagePeer(peer_config(insider, 0, secret=secret))
            peers.append(joiner)
            await joiner.start()
            assert joiner.loaded_from == "peer" and joiner.version == peers[0].version
            _, donor_state = peers[0].compute.export_state()
            spy = StageAverager.create(
                outsider.dht,
                run_id=spec.run_id,
                spec_hash=spec.spec_hash,
                stage=0,
                shapes=donor_state,
                grad_shapes=[],
                state_fn=lambda: ({}, donor_state),
            )
            await asyncio.to_thread(spy.wait_ready, 30.0)
            assert await asyncio.to_thread(spy.load_state, 10.0) is None

            # insiders keep training, now through either stage-0 peer
            losses2 = await train(insider, [joiner.peer_id, route[1]], 3, seed=10)
            assert all(torch.isfinite(torch.tensor(losses2)))
        finally:
            if spy is not None:
                await asyncio.to_thread(spy.shutdown)
            for p in reversed(peers):
                await p.shutdown()
            for node in (forger, outsider, insider):
                if node is not None:
                    await node.shutdown()

    asyncio.run(main())


def test_the_trainer_trains_a_private_run_with_its_secret(tmp_path):
    from swarm.train.trainer import Trainer, TrainerConfig

    secret = generate_secret()
    model = {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32}  # byte tokens
    spec = private_spec("priv-trainer", secret, stages=2, model=model)

    async def main():
        owner = Node(spec, secret, publish=True)
        peers: list[StagePeer] = []
        try:
            await owner.start()
            for stage in (0, 1):
                p = StagePeer(peer_config(owner, stage, secret=secret))
                peers.append(p)
                await p.start()

            def trainer(key: bytes | None) -> Trainer:
                cfg = TrainerConfig(
                    initial_peers=owner.maddrs(),
                    run_id=spec.run_id,
                    steps=12,
                    max_inflight=4,
                    out_dir=str(tmp_path),
                    quiet=True,
                    refresh_every_s=0.5,
                    spec_timeout_s=10,
                    secret=key,
                )
                return Trainer(cfg)

            with pytest.raises(ConfigError, match="is private"):
                await trainer(None).run()
            summary = await trainer(secret).run()
            mb = summary["micro_batches"]
            assert mb["completed"] == 12 and mb["dropped"] == 0, mb
            assert all(p.version >= 12 for p in peers)
            assert all(p.counters["refused_auth"] == 0 for p in peers)
            # the trainer's progress record carries its proof: the owner (checking proofs) sees it
            progress = await asyncio.to_thread(owner.membership.progress)
            assert progress["steps"] >= 12, progress

            # `swarm generate` goes through the same signed requests
            def gen(key: bytes | None) -> GenerateConfig:
                return GenerateConfig(
                    initial_peers=owner.maddrs(),
                    run_id=spec.run_id,
                    prompt="ab",
                    max_new_tokens=3,
                    temperature=0,
                    spec_timeout_s=10,
                    secret=key,
                )

            with pytest.raises(ConfigError, match="is private"):
                await generate_async(gen(None))
            text = await generate_async(gen(secret))
            assert isinstance(text, str) and text  # 3 sampled bytes, decoded
            assert all(p.counters["refused_auth"] == 0 for p in peers)

            # `swarm export`: peers share state only with listed ids; the exporter lists itself as
            # "reading" while it downloads (never routed to), and needs the secret to do so
            def export(key: bytes | None, name: str):
                cfg = ExportConfig(
                    dht=DHTConfig(initial_peers=tuple(owner.maddrs()), client_mode=True),
                    run_id=spec.run_id,
                    out_dir=str(tmp_path / name),
                    spec_timeout_s=10,
                    state_timeout_s=30,
                    max_step_lag=100,
                    secret=key,
                )
                return export_run(cfg)

            with pytest.raises(ConfigError, match="is private"):
                await asyncio.to_thread(export, None, "refused")
            assert not (tmp_path / "refused").exists()
            result = await asyncio.to_thread(export, secret, "exported")
            assert [s.version for s in result.stages] == [p.version for p in peers]
            model = load_model(tmp_path / "exported")
            assert sum(t.numel() for t in model.state_dict().values()) > 0
        finally:
            for p in reversed(peers):
                await p.shutdown()
            await owner.shutdown()

    asyncio.run(main())
