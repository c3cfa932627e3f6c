"""Membership, bootstrap and status with real hivemind DHT nodes on loopback.

The slow tests start a bootstrap (the code path of ``swarm init``), several peers with their own
DHTs, and a rogue node that writes garbage, and check what readers see. Every DHT is shut down in
``finally``; conftest fails the module if any hivemind process is left behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from swarm.dht.records import PeerRecord, RunEntry, peer_id_of_subkey, stage_key
from swarm.errors import ConfigError
from swarm.tools.status import RunStatus, StageStatus, render_run_status, render_runs, status_line
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.yaml"
HASH = "0123456789abcdef"


def _rec(
    peer_id: str, stage: int, throughput: float, state: str = "online", spec_hash: str = HASH
) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id,
        run_id="tiny",
        stage=stage,
        state=state,
        throughput=throughput,
        queue=1,
        version=4,
        codecs=("blockwise8",),
        spec_hash=spec_hash,
    )


# ------------------------------------------------------------------------ rendering (no network)


def test_status_rendering_marks_uncovered_stages_and_shows_progress():
    peer = "QmdDEBCqdTqHy8ctvoMfjcqS2LBvDTDqonkTphz3AsUMH9"
    status = RunStatus(
        run_id="tiny",
        spec_hash=HASH,
        stages=(
            StageStatus(stage=0, layers=(0, 2), peers=(_rec(peer, 0, 12.5),)),
            StageStatus(stage=1, layers=(2, 4), peers=(_rec(peer, 1, 3.0, "leaving"),)),
            StageStatus(stage=2, layers=(4, 6), peers=()),
        ),
        progress={
            "trainers": {"t1": {"tokens": 2048, "steps": 2, "loss": 4.25, "tokens_per_s": 100.0}},
            "tokens": 2048,
            "steps": 2,
            "tokens_per_s": 100.0,
            "loss": 4.25,
        },
        rejected=2,
    )
    assert status.uncovered == [1, 2] and status.num_peers == 1
    table = render_run_status(status)
    assert "UNCOVERED" in table and "leaving" in table and "12.5" in table and "2.05K tokens" in table
    assert "stages without peers: 1, 2" in table and "2 invalid records" in table
    line = status_line(status)
    assert "1/3 stages covered" in line and "uncovered: 1, 2" in line and "loss 4.2500" in line
    data = json.loads(json.dumps(status.to_json()))
    assert data["uncovered_stages"] == [1, 2] and data["stages"][0]["peers"][0]["throughput"] == 12.5
    entry = RunEntry(
        run_id="tiny",
        spec_hash=HASH,
        num_stages=3,
        n_params=869504,
        n_layers=6,
        d_model=128,
        peers=1,
        owner=peer,
    )
    assert "870K" in render_runs([entry]) and "swarm init" in render_runs([])


# ---------------------------------------------------------------------------- real DHT nodes


@pytest.mark.slow
def test_swarm_membership_end_to_end():
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from swarm.dht.membership import Membership
    from swarm.dht.network import DHTConfig, start_dht
    from swarm.dht.placement import choose_stage
    from swarm.run.spec import RunSpec
    from swarm.tools.bootstrap import Bootstrap, BootstrapConfig
    from swarm.tools.status import gather_run_status

    spec = RunSpec.from_yaml(TINY)
    boot = Bootstrap(BootstrapConfig(spec=spec, status_interval_s=0.5, refresh_interval_s=0.5))
    dhts: list = []
    stop_c = threading.Event()
    refresher = None
    try:
        boot.start()
        initial = tuple(boot.maddrs)
        assert all(m.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in m for m in initial)

        # Three peers, each with its own DHT, fetch the signed spec and announce themselves.
        peers = []
        for _ in range(3):
            dht = start_dht(DHTConfig(initial_peers=initial))
            dhts.append(dht)
            m = Membership(dht, spec.run_id)
            assert m.fetch_spec(timeout_s=5).spec_hash == spec.spec_hash
            peers.append(m)
        a, b, c = peers
        rng = __import__("random").Random(0)
        assert choose_stage(a.all_stage_records(), my_throughput=10.0, rng=rng) in (0, 1)
        rec_a, rec_b = (
            _rec(a.peer_id, 0, 10.0, spec_hash=spec.spec_hash),
            _rec(b.peer_id, 1, 20.0, spec_hash=spec.spec_hash),
        )
        rec_c = _rec(c.peer_id, 0, 5.0, spec_hash=spec.spec_hash)
        assert a.announce(rec_a) and b.announce(rec_b) and c.announce(rec_c, expiration_s=3.0)

        def refresh_c() -> None:  # like a real peer's announce loop, with a short expiration
            while not stop_c.wait(0.5):
                c.announce(rec_c, expiration_s=3.0)

        refresher = threading.Thread(target=refresh_c, daemon=True)
        refresher.start()
        with pytest.raises(ConfigError, match="not this node"):
            a.announce(rec_b)
        assert c.publish_progress("trainer-1", tokens=4096, steps=4, loss=5.5, tokens_per_s=1000.0)
        assert b.publish_progress("trainer-2", tokens=1024, steps=1, loss=None)

        # A status reader (a client, like `swarm status`) sees all of them and the trainers.
        reader_dht = start_dht(DHTConfig(initial_peers=initial, client_mode=True))
        dhts.append(reader_dht)
        reader = Membership(reader_dht, None)
        runs = reader.list_runs()
        assert [(e.run_id, e.spec_hash, e.owner) for e in runs] == [
            (spec.run_id, spec.spec_hash, boot.membership.peer_id)
        ]
        view = reader.for_run(spec.run_id)
        status = gather_run_status(view, spec_timeout_s=5)
        assert {p.peer_id for p in status.stages[0].peers} == {a.peer_id, c.peer_id}
        assert [p.peer_id for p in status.stages[1].peers] == [b.peer_id]
        assert status.uncovered == [] and status.stages[1].throughput == 20.0
        assert status.progress["tokens"] == 5120 and status.progress["loss"] == 5.5
        assert set(status.progress["trainers"]) == {"trainer-1", "trainer-2"}
        # The bootstrap's own status line and registry refresh see the peers too.
        assert "2/2 stages covered, 3 peers" in boot.status()
        boot.refresh()
        assert reader.list_runs()[0].peers == 3

        # Forgery: b claims a's peer id under its own subkey (dropped by readers) or writes under
        # a's subkey (refused by every node's signature check).
        rejected_before = view.rejected
        forged = dataclasses.replace(rec_a, stage=1)
        assert b.dht.store(
            stage_key(spec.run_id, 1), forged.to_wire(), get_dht_time() + 20, subkey=b._signer.marker
        )
        assert not b.dht.store(
            stage_key(spec.run_id, 0),
            {**rec_a.to_wire(), "throughput": 999.0},
            get_dht_time() + 30,
            subkey=a._signer.marker,
        )
        # A rogue node without our schema writes malformed values and a record of another spec.
        key = RSAPrivateKey()
        rogue_validator = RSASignatureValidator(key)
        rogue = hivemind.DHT(
            initial_peers=list(initial),
            start=True,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            record_validators=[rogue_validator],
        )
        dhts.append(rogue)
        marker = rogue_validator.local_public_key
        rogue_id = peer_id_of_subkey(marker)
        other_spec = dataclasses.replace(rec_a, peer_id=rogue_id, spec_hash="feedfacefeedface").to_wire()
        rogue.store(stage_key(spec.run_id, 0), other_spec, get_dht_time() + 10, subkey=marker)
        for garbage in (
            {**other_spec, "spec_hash": spec.spec_hash, "throughput": float("nan")},
            {**other_spec, "spec_hash": spec.spec_hash, "stage": "zero"},
            "garbage",
        ):
            rogue.store(stage_key(spec.run_id, 1), garbage, get_dht_time() + 10, subkey=marker)
        rogue.store(stage_key(spec.run_id, 1), {"v": 1}, get_dht_time() + 10, subkey=b"unsigned")

        records = view.all_stage_records()
        assert set(records[0]) == {a.peer_id, c.peer_id} and records[0][a.peer_id].throughput == 10.0
        assert set(records[1]) == set(), "b's own record was replaced by its forgery, which is dropped"
        assert view.rejected >= rejected_before + 2  # the forgery and the other spec hash at least
        # Later expiration wins per subkey: b's next refresh must outlive its own forgery.
        assert b.announce(rec_b, expiration_s=30.0)
        assert set(view.stage_records(1)) == {b.peer_id}

        # A peer that leaves says so; one that dies (DHT shut down) vanishes when its record expires.
        a.announce_leaving(rec_a)
        assert view.stage_records(0)[a.peer_id].state == "leaving"
        stop_c.set()
        refresher.join()
        c.dht.shutdown()
        wait_until(
            lambda: c.peer_id not in view.stage_records(0), 30, "the dead peer's record (3 s) to expire"
        )
        assert gather_run_status(view).uncovered == [0]  # only a leaving peer is left on stage 0

        # Another owner cannot start a different run under the same id in this swarm.
        rival = dataclasses.replace(spec, seed=spec.seed + 1)
        with pytest.raises(ConfigError, match="already used"):
            Bootstrap(BootstrapConfig(spec=rival, dht=DHTConfig(initial_peers=initial))).start()
        # A plain bootstrap joining the same swarm lists the run.
        with Bootstrap(BootstrapConfig(dht=DHTConfig(initial_peers=initial))) as plain:
            assert f"({spec.run_id})" in plain.status() and plain.refresh() is None
    finally:
        stop_c.set()
        if refresher is not None:
            refresher.join()
        for dht in dhts:
            dht.shutdown()
        boot.close()


@pytest.mark.slow
def test_swarm_init_then_status_and_runs_from_a_shell(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HIVEMIND_LOGLEVEL": "ERROR"}
    cli = [sys.executable, "-m", "swarm.cli"]
    init = subprocess.Popen(
        [*cli, "init", str(TINY), "--status-interval-s", "1", "--identity", str(tmp_path / "boot.key")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        lines = []
        deadline = time.monotonic() + 30
        address = None
        while address is None:
            assert time.monotonic() < deadline, f"no address printed: {lines}"
            line = init.stdout.readline()
            assert line, f"swarm init exited: {lines} {init.stderr.read()}"
            lines.append(line)
            if line.startswith("initial peers: "):
                address = line.split()[2]
        assert address.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in address
        status = subprocess.run(
            [*cli, "status", "--initial-peers", address, "--run", "tiny", "--json"],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        [run] = json.loads(status.stdout)["runs"]
        assert run["run_id"] == "tiny" and run["uncovered_stages"] == [0, 1] and run["spec_found"]
        runs = subprocess.run(
            [*cli, "runs", "--initial-peers", address],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=60,
        )
        assert runs.returncode == 0 and "tiny" in runs.stdout, runs.stderr
        bad = subprocess.run(
            [*cli, "runs", "--initial-peers", "/ip4/127.0.0.1/tcp/1"],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=60,
        )
        assert bad.returncode == 1 and "/p2p/" in bad.stderr
        while not (line := init.stdout.readline()).startswith("run tiny:"):  # the periodic status line
            assert line, f"swarm init exited: {init.stderr.read()}"
        assert line.startswith("run tiny: 0/2 stages covered"), line
        init.send_signal(signal.SIGTERM)
        out, err = init.communicate(timeout=20)
        assert init.returncode == 0, err
        assert "bootstrap node stopped" in out
    finally:
        if init.poll() is None:
            init.terminate()
            init.wait(timeout=20)
