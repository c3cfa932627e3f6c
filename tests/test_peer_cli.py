"""``swarm peer`` as a subprocess: the online line, serving, SIGTERM with a final checkpoint and no
leftover processes; then a peer resuming from that checkpoint."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from peer import StagePeer
from peer.checkpoint import load_checkpoint
from swarm.wire.protocol import INFO, Message, call
from tests.helpers import Driver, batch, peer_config, spec_for

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def _start_cli_peer(driver: Driver, ckpt_dir: str) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable, "-m", "swarm.cli", "peer",
        "--initial-peers", *driver.maddrs(),
        "--run", driver.spec.run_id,
        "--stage", "0",
        "--device", "cpu",
        "--throughput", "100",
        "--announce-period", "0.5",
        "--checkpoint-dir", ckpt_dir,
    ]  # fmt: skip
    env = dict(os.environ, HIVEMIND_LOGLEVEL="WARNING", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout=60)
    assert line.startswith("peer ") and f"serving stage 0 of run {driver.spec.run_id}" in line, line
    return proc, line.split()[1]


def _stop(proc: subprocess.Popen) -> list[psutil.Process]:
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "the peer should run a DHT process and a p2pd daemon"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    return children


def _gone(procs: list[psutil.Process], timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
            return True
        time.sleep(0.1)
    return False


def test_cli_peer_serves_stops_cleanly_and_resumes(tmp_path):
    spec = spec_for("cli1", stages=1)
    ckpt = str(tmp_path / "ckpt")

    async def main():
        driver = Driver(spec)
        procs: list[subprocess.Popen] = []
        peers: list[StagePeer] = []
        try:
            await driver.start()
            proc, peer_id = await _start_cli_peer(driver, ckpt)
            procs.append(proc)
            tokens, targets = batch(0, spec)
            mb = await driver.send([peer_id], tokens, targets)
            await driver.wait_reports(mb, {"loss", "done"})
            children = await asyncio.to_thread(_stop, proc)
            assert await asyncio.to_thread(_gone, children), "DHT/p2pd/averager processes left behind"
            saved = load_checkpoint(ckpt, spec_hash=spec.spec_hash)
            assert saved is not None and saved.version == 1 and saved.stage == 0

            # resume (in-process, to save a second interpreter start): the saved state, not the seed
            resumed = StagePeer(peer_config(driver, 0, checkpoint_dir=ckpt))
            peers.append(resumed)
            await resumed.start()
            assert resumed.loaded_from == "checkpoint" and resumed.version == 1
            info = await call(driver.p2p, resumed.peer_id, INFO, Message({}), timeout_s=10)
            assert info["version"] == 1 and info["stage"] == 0 and info["state"] == "online"
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for p in peers:
                await p.shutdown()
            await driver.shutdown()

    asyncio.run(main())
