"""Helpers shared by the test modules: waiting on conditions, and the loopback swarm parts several use.

One module, so that test modules never import each other (a test module's helpers are its own).

- Waiting: ``wait_until`` (threads, processes) and ``until`` (coroutines) poll a condition with a
  deadline instead of sleeping a fixed time and hoping it held; ``time_limit`` bounds a block of
  awaits (``asyncio.timeout`` is 3.11+, and the project supports 3.10).
- Stage peers on loopback: ``tiny_spec``/``spec_for`` (small runs), ``Driver`` (a minimal trainer:
  bootstrap DHT, spec publisher, report sink, micro-batch sender), ``peer_config`` (fast peer
  settings), ``start_peers``/``stop_all``, ``batch`` (a seeded micro-batch), ``train``.
- Private runs: ``private_spec`` and ``Node`` (a driver that holds, or lacks, the run's secret).
- ``make_owner``: an RSA owner key and its marker, for signed DHT records.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from peer import PeerConfig, StagePeer
from swarm.dht import records as R
from swarm.dht.auth import RunAuth, secret_check
from swarm.dht.membership import Membership
from swarm.dht.network import DHTConfig, start_dht, visible_maddrs
from swarm.run.spec import RunSpec
from swarm.wire.protocol import FORWARD, REPORT, ForwardHeader, Message, Report, call, pack_tokens, serve

# ------------------------------------------------------------------------------------- waiting

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """``predicate()``'s first true value; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
    return value


async def until(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.1) -> T:
    """``wait_until`` for coroutines: the event loop keeps running while the condition is polled."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(interval_s)
    return value


@contextlib.asynccontextmanager
async def time_limit(seconds: float) -> AsyncIterator[None]:
    """``async with time_limit(s):`` raises TimeoutError when the block takes longer than ``s``.

    What ``asyncio.timeout`` does on 3.11+: the block's task is cancelled at the deadline and the
    cancellation turned into TimeoutError (a cancellation from elsewhere passes through).
    """
    task = asyncio.current_task()
    assert task is not None, "time_limit needs a running task"
    fired = False

    def expire() -> None:
        nonlocal fired
        fired = True
        task.cancel()

    handle = asyncio.get_running_loop().call_later(seconds, expire)
    try:
        yield
    except asyncio.CancelledError:
        if fired:
            if hasattr(task, "uncancel"):  # 3.11+: this cancellation is handled, as asyncio.timeout does
                task.uncancel()
            raise TimeoutError(f"not done within {seconds} s") from None
        raise
    finally:
        handle.cancel()


# --------------------------------------------------------------------- stage peers on loopback


def online_record(peer_id: str, stage: int = 1, **kw) -> R.PeerRecord:
    """An online stage peer's record of run "r" with everyday values; ``kw`` replaces any field."""
    base = dict(
        peer_id=peer_id,
        run_id="r",
        stage=stage,
        state="online",
        throughput=1000.0,
        queue=0,
        version=3,
        codecs=("blockwise8",),
        spec_hash="a" * 16,
    )
    return R.PeerRecord(**(base | kw))


def tiny_spec(run_id: str, stages: int = 3, subspace: dict | None = None, **optimizer) -> RunSpec:
    opt = {"name": "adamw", "lr": 1e-2, "mode": "sync", "accumulate": 1, "clip_norm": 1.0} | optimizer
    model = {"vocab_size": 64, "d_model": 32, "n_layers": 3, "n_heads": 2, "seq_len": 16}
    return RunSpec.from_dict(
        {
            "run_id": run_id,
            "model": model if subspace is None else model | {"subspace": subspace},
            "stages": stages,
            "codecs": {"activations": "none", "gradients": "none"},
            "optimizer": opt,
            "averaging": {},
            "micro_batch_size": 2,
            "stash_ttl_s": 30,
        }
    )


class Driver:
    """A minimal trainer: bootstrap DHT, spec publisher, report sink, and micro-batch sender."""

    _ids = itertools.count()

    def __init__(self, spec: RunSpec):
        self.spec = spec
        self.reports: asyncio.Queue[tuple[Report, bytes]] = asyncio.Queue()
        self.dht = None
        self.p2p = None

    async def start(self) -> None:
        self.dht = await asyncio.to_thread(start_dht, DHTConfig())
        self.membership = Membership(self.dht, self.spec.run_id)
        await asyncio.to_thread(self.membership.publish_spec, self.spec)
        self.p2p = await self.dht.replicate_p2p()

        async def on_report(message: Message, remote) -> dict:
            await self.reports.put((Report.from_wire(message.header), message.payload))
            return {}

        await serve(self.p2p, REPORT, on_report)

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    def maddrs(self) -> tuple[str, ...]:
        return tuple(visible_maddrs(self.dht))

    async def shutdown(self) -> None:
        if self.dht is not None:
            await asyncio.to_thread(self.dht.shutdown)

    def header(self, route, tokens, targets, mode="train", one_report=False) -> ForwardHeader:
        return ForwardHeader(
            run_id=self.spec.run_id,
            spec_hash=self.spec.spec_hash,
            mb_id=f"drv:{next(self._ids)}",
            stage=0,
            route=tuple(route),
            trainer=self.peer_id,
            mode=mode,
            batch=tokens.shape[0],
            seq=tokens.shape[1],
            tokens=pack_tokens(tokens),
            targets=b"" if targets is None else pack_tokens(targets),
            one_report=one_report,
        )

    async def send(self, route, tokens, targets, mode="train", one_report=False) -> str:
        h = self.header(route, tokens, targets, mode, one_report)
        await call(self.p2p, route[0], FORWARD, Message(h.to_wire()), timeout_s=10)
        return h.mb_id

    async def wait_reports(
        self, mb_id: str, kinds: set[str], timeout_s: float = 20
    ) -> dict[str, tuple[Report, bytes]]:
        return (await self.wait_all_reports([mb_id], kinds, timeout_s))[mb_id]

    async def wait_all_reports(
        self, mb_ids: list[str], kinds: set[str], timeout_s: float = 20
    ) -> dict[str, dict[str, tuple[Report, bytes]]]:
        """The reports of ``kinds`` for every micro-batch of ``mb_ids``, by id and kind (others are dropped)."""
        got: dict[str, dict[str, tuple[Report, bytes]]] = {mb: {} for mb in mb_ids}
        async with time_limit(timeout_s):
            while not all(kinds <= set(g) for g in got.values()):
                report, payload = await self.reports.get()
                assert report.kind != "failed", report.reason
                if report.mb_id in got:
                    got[report.mb_id][report.kind] = (report, payload)
        return got


def peer_config(driver: Driver, stage, **kw) -> PeerConfig:
    base = dict(
        initial_peers=driver.maddrs(),
        run_id=driver.spec.run_id,
        stage=stage,
        device="cpu",
        throughput=1000.0,
        announce_period_s=0.5,
        spec_timeout_s=10,
        request_timeout_s=10,
        state_timeout_s=10,
        averaging_matchmaking_s=1.0,
        drain_timeout_s=5,
    )
    return PeerConfig(**(base | kw))


async def start_peers(driver: Driver, configs: list[PeerConfig], peers: list[StagePeer]) -> None:
    for cfg in configs:
        p = StagePeer(cfg)
        peers.append(p)  # appended before start so `finally` shuts it down even if start fails
        await p.start()


async def stop_all(peers: list[StagePeer], driver: Driver) -> None:
    for p in reversed(peers):
        await p.shutdown()
    await driver.shutdown()


def batch(seed: int, spec: RunSpec):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(
        0, spec.model.vocab_size, (spec.micro_batch_size, spec.model.seq_len + 1), generator=g
    )
    return data[:, :-1], data[:, 1:]


def spec_for(run_id: str, stages: int, accumulate: int = 1) -> RunSpec:
    return RunSpec.from_dict(
        {
            "run_id": run_id,
            "model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
            "stages": stages,
            "codecs": {"activations": "none", "gradients": "none"},
            "optimizer": {"name": "adamw", "lr": 1e-2, "mode": "async", "accumulate": accumulate},
            "averaging": {"timeout_s": 8},
            "micro_batch_size": 2,
        }
    )


async def train(driver: Driver, route: list[str], seeds) -> None:
    for seed in seeds:
        tokens, targets = batch(seed, driver.spec)
        mb = await driver.send(route, tokens, targets)
        await driver.wait_reports(mb, {"loss", "done"})


async def train_at_once(driver: Driver, sends: list[tuple[list[str], int]], timeout_s: float = 30) -> None:
    """Send every ``(route, seed)`` micro-batch first, then wait until each one reported ``loss`` and
    ``done`` (``train`` sends the next only after the previous one completed)."""
    mb_ids = [await driver.send(route, *batch(seed, driver.spec)) for route, seed in sends]
    await driver.wait_all_reports(mb_ids, {"loss", "done"}, timeout_s)


# ------------------------------------------------------------------------------ private runs


def private_spec(run_id: str, secret: bytes | None, stages: int = 3, **over) -> RunSpec:
    d = {
        "run_id": run_id,
        "model": {"vocab_size": 64, "d_model": 32, "n_layers": 3, "n_heads": 2, "seq_len": 16},
        "stages": stages,
        "codecs": {"activations": "none", "gradients": "none"},
        "optimizer": {
            "name": "adamw",
            "lr": 1e-2,
            "mode": "async",
            "accumulate": 1,
            "clip_norm": 1.0,
            "max_versions": 16,
        },
        "averaging": {},
        "micro_batch_size": 2,
        "stash_ttl_s": 30,
    } | over
    if secret is not None:
        d["access"] = {"private": True, "secret_check": secret_check(secret, run_id)}
    return RunSpec.from_dict(d)


class Node:
    """A driver / trainer-like node: its own DHT, P2P, handlers for REPORT (and FORWARD, to act as a
    later stage), and the run's auth if it holds a secret (``secret=None`` makes an outsider)."""

    def __init__(self, spec: RunSpec, secret: bytes | None, *, initial_peers=(), publish=False):
        self.spec, self.secret, self.initial_peers, self.publish = spec, secret, tuple(initial_peers), publish
        self.auth = RunAuth(spec.run_id, secret=secret)  # an outsider's auth has no secret: no proofs
        self.reports: asyncio.Queue = asyncio.Queue()
        self.forwards: asyncio.Queue = asyncio.Queue()
        self.dht = None
        self.p2p = None

    async def start(self) -> None:
        self.dht = await asyncio.to_thread(start_dht, DHTConfig(initial_peers=self.initial_peers))
        self.membership = Membership(self.dht, self.spec.run_id)
        if self.publish:
            await asyncio.to_thread(self.membership.publish_spec, self.spec)
        else:
            self.membership.spec, self.membership.spec_hash = self.spec, self.spec.spec_hash
        self.membership.set_auth(self.auth)
        self.p2p = await self.dht.replicate_p2p()

        async def on_report(message: Message, remote) -> dict:
            await self.reports.put(Report.from_wire(message.header))
            return {}

        async def on_forward(message: Message, remote) -> dict:
            await self.forwards.put(ForwardHeader.from_wire(message.header))
            return {"queue": 0}

        gate = self.auth.gate(self.peer_id)
        await serve(self.p2p, REPORT, on_report, gate=gate)
        await serve(self.p2p, FORWARD, on_forward, gate=gate)

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    def maddrs(self) -> tuple[str, ...]:
        return tuple(visible_maddrs(self.dht))

    async def shutdown(self) -> None:
        if self.p2p is not None:
            await self.p2p.shutdown()  # removes its handler socket file
        if self.dht is not None:
            await asyncio.to_thread(self.dht.shutdown)

    def header(self, route, tokens, targets, stage=0, mb_id=None) -> ForwardHeader:
        return ForwardHeader(
            run_id=self.spec.run_id,
            spec_hash=self.spec.spec_hash,
            mb_id=mb_id or f"mb{random.getrandbits(48)}",
            stage=stage,
            route=tuple(route),
            trainer=self.peer_id,
            mode="train",
            batch=tokens.shape[0],
            seq=tokens.shape[1],
            tokens=pack_tokens(tokens),
            targets=pack_tokens(targets),
        )

    async def call(self, peer: str, name: str, header: dict, payload: bytes = b"", timeout_s: float = 10):
        return await call(self.p2p, peer, name, Message(header, payload), timeout_s=timeout_s, auth=self.auth)


# ------------------------------------------------------------------------------ signed records


def make_owner() -> tuple[rsa.RSAPrivateKey, bytes, str]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ssh = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    marker = b"[owner:" + ssh + b"]"
    return key, marker, R.peer_id_from_ssh_public_key(ssh)
