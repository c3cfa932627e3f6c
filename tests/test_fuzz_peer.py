"""Hostile input: thousands of malformed requests at a live peer of a private run, plus handler-level fuzz.

The live part starts one stage peer (stage 1 of 3, so it takes activation payloads) and a driver node
that holds the run's secret, then sends malformed requests over several concurrent streams: random
bytes, wrong protocol tags, truncated and oversized payloads, wrong shapes, wrong spec hash, NaN/Inf
and absurd tensors, unknown codecs, bad or missing join proofs, stale timestamps, replays, and random
mutations of a valid header. Every request must get a clear refusal; afterwards the peer still
serves, and its parameters, optimizer state, version and stash are bit-identical. Finally a NaN
gradient from the route's next peer gets that peer ignored (penalty box).

The hypothesis part drives the same parsers without the network.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compression import get_codec
from peer import StagePeer
from swarm.dht.auth import AuthError, RunAuth, generate_secret
from swarm.errors import RequestError
from swarm.wire.protocol import (
    BACKWARD,
    FORWARD,
    INFO,
    MAX_HEADER_BYTES,
    PROTOCOL_TAG,
    BackwardHeader,
    ForwardHeader,
    Message,
    Report,
    peer_id_from_str,
    read_message,
    to_parts,
)
from tests.helpers import Node, batch, peer_config, private_spec

MAX_PAYLOAD = 64 << 10  # the peer's cap: an oversized payload is cheap to declare


def snapshot(peer: StagePeer) -> tuple:
    meta, tensors = peer.compute.export_state()
    return (
        peer.version,
        sorted(peer.compute.stash._entries),
        len(peer.compute.stash),
        msgpack.packb(meta, default=str),
        [t.clone() for t in tensors],
    )


def assert_same(a: tuple, b: tuple) -> None:
    assert a[:4] == b[:4]
    assert len(a[4]) == len(b[4])
    for x, y in zip(a[4], b[4], strict=True):
        assert torch.equal(x, y)  # bit-identical


async def raw_call(p2p, peer: str, name: str, parts) -> dict:
    """Send pre-built parts (possibly malformed) and return the decoded reply."""

    async def gen():
        for p in parts:
            yield p

    stream = await p2p.iterate_protobuf_handler(peer_id_from_str(peer), name, gen(), type(_reply_type()))
    try:
        reply = await asyncio.wait_for(stream.__anext__(), timeout=15)
    finally:
        await stream.aclose()
    return msgpack.unpackb(reply.metadata, raw=False)


def _reply_type():
    from hivemind.proto import runtime_pb2

    return runtime_pb2.ExpertResponse()


# ------------------------------------------------------------------------------- the live peer


@pytest.mark.slow
def test_live_peer_survives_thousands_of_malformed_requests():
    secret = generate_secret()
    spec = private_spec("fuzz3", secret)
    rng = random.Random(1234)
    n_random = 1400

    async def main():
        from hivemind.proto import runtime_pb2

        node = Node(spec, secret, publish=True)
        peer: StagePeer | None = None
        try:
            await node.start()
            peer = StagePeer(peer_config(node, 1, secret=secret, max_payload_bytes=MAX_PAYLOAD))
            await peer.start()
            target = peer.peer_id
            route = [node.peer_id, target, node.peer_id]
            tokens, targets = batch(0, spec)
            act = get_codec("none")
            good = act.encode(torch.zeros(2, 16, 32))
            base = node.header(route, tokens, targets, stage=1).to_wire()
            before = snapshot(peer)
            refused_before = peer.counters["refused"]

            def signed(header: dict, payload: bytes, *, name=FORWARD, auth=node.auth, sender=None) -> list:
                h = dict(header) | {
                    "payload_bytes": len(payload),
                    "payload_sha256": hashlib.sha256(payload).digest(),
                }
                h = auth.sign_request(name, sender or node.peer_id, target, h)
                return to_parts(Message(h, payload))

            def nan_like(value: float) -> bytes:
                return act.encode(torch.full((2, 16, 32), value))

            unknown_codec = bytearray(good)
            unknown_codec[4:8] = b"\xff\xfe\xfd\xfc"  # inside the codec header: name/version bytes
            stale = RunAuth(spec.run_id, secret=secret, clock=lambda: time.time() - 3600)
            wrong = RunAuth(spec.run_id, secret=generate_secret())
            cases: list[tuple[str, str, list, str]] = []  # (kind, handler, parts, expected error regex)

            def add(kind, parts, pattern, name=FORWARD):
                cases.append((kind, name, parts, pattern))

            for i in range(60):
                junk = rng.randbytes(rng.randrange(0, 300))
                add("random-metadata", [runtime_pb2.ExpertRequest(uid=PROTOCOL_TAG, metadata=junk)], r".")
                add("wrong-tag", [runtime_pb2.ExpertRequest(uid="other/9", metadata=junk)], "protocol tag")
                add(
                    "not-a-map",
                    [runtime_pb2.ExpertRequest(uid=PROTOCOL_TAG, metadata=msgpack.packb([1, 2]))],
                    "map",
                )
                add("unsigned", to_parts(Message(base, good)), "no join proof")
                add("wrong-secret", signed(base, good, auth=wrong), "invalid")
                add("stale", signed(base, good, auth=stale), "outside")
                add("spec-hash", signed(base | {"spec_hash": "0" * 16}, good), "spec")
                add("run-id", signed(base | {"run_id": "other"}, good), "run")
                add("stage", signed(base | {"stage": 2}, good), "stage")
                add("shape", signed(base, act.encode(torch.zeros(2, 16, 31))), "shape")
                add("nan", signed(base, nan_like(float("nan"))), "NaN")
                add("inf", signed(base, nan_like(float("inf"))), "NaN or Inf")
                add("absurd", signed(base, nan_like(1e9)), "absurd")
                add("unknown-codec", signed(base, bytes(unknown_codec)), "decoded")
                add("garbage-payload", signed(base, rng.randbytes(200)), "decoded")
                add("tokens", signed(base | {"tokens": b"\x7f" * len(base["tokens"])}, good), "vocabulary")
                add(
                    "route",
                    signed(base | {"route": [node.peer_id, node.peer_id, node.peer_id]}, good),
                    "route",
                )
                add(
                    "backward-unknown",
                    signed(
                        BackwardHeader(
                            run_id=spec.run_id, spec_hash=spec.spec_hash, mb_id=f"x{i}", stage=1
                        ).to_wire(),
                        good,
                        name=BACKWARD,
                    ),
                    "no stashed forward",
                    name=BACKWARD,
                )
                # oversized: declared above the cap, refused from the header before any payload is read
                big = signed(base, b"\0" * (MAX_PAYLOAD + 1))
                add("oversized", big[:1], "cap")
                # truncated: the header (and its proof) declare more bytes than are sent
                full = signed(base, good)
                cut = runtime_pb2.ExpertRequest()
                cut.CopyFrom(full[0])
                cut.tensors[0].buffer = full[0].tensors[0].buffer[: len(good) // 2]
                add("truncated", [cut], "truncated")
                # tampered: the payload differs from the signed digest
                tampered = runtime_pb2.ExpertRequest()
                tampered.CopyFrom(signed(base, good)[0])
                tampered.tensors[0].buffer = act.encode(torch.ones(2, 16, 32))
                add("tampered", [tampered], "payload_sha256")
            # replays: a signed request (refused for its shape) sent again verbatim
            replay_parts = [signed(base, act.encode(torch.zeros(2, 16, 31))) for _ in range(60)]
            # random mutations of one header field, re-signed (so they reach the deep checks)
            values = [None, -1, 0, 2**40, 1.5, float("nan"), "", "x" * 300, b"\0", [], {}, True, [1, "a"]]
            for _ in range(n_random):
                h = dict(base)
                # every listed value is invalid for these fields (sent_at, stats, the optional integers
                # counted_from and window (-1, 0 and 2**40 are valid there) and unknown keys legitimately
                # accept some of them, so they are not mutated here)
                key = rng.choice([k for k in h if k not in ("sent_at", "stats", "counted_from", "window")])
                h[key] = rng.choice(values)
                add("mutated", signed(h, good), r".")

            results: list[tuple[str, str, dict]] = []

            async def worker(items):
                for kind, name, parts, pattern in items:
                    results.append((kind, pattern, await raw_call(node.p2p, target, name, parts)))

            t0 = time.monotonic()
            shards = [cases[i::6] for i in range(6)]
            await asyncio.gather(*(worker(s) for s in shards))
            for parts in replay_parts:  # first delivery refused for its shape, second as a replay
                results.append(("replay-first", "shape", await raw_call(node.p2p, target, FORWARD, parts)))
                results.append(("replay", "replay", await raw_call(node.p2p, target, FORWARD, parts)))
            elapsed = time.monotonic() - t0

            import re

            for kind, pattern, reply in results:
                assert reply.get("ok") is False, (kind, reply)
                assert isinstance(reply.get("error"), str) and len(reply["error"]) > 10, (kind, reply)
                assert re.search(pattern, reply["error"]), (kind, pattern, reply["error"])
            n = len(results)
            print(f"{n} malformed requests refused in {elapsed:.1f} s")
            assert n >= 2500
            # still serving, and nothing changed: weights, optimizer slots, version, stash
            info = await node.call(target, INFO, {})
            assert info["stage"] == 1 and info["state"] == "online"
            assert_same(before, snapshot(peer))
            assert peer.counters["refused"] - refused_before == n
            assert peer.counters["refused_auth"] >= 60 * 3 + 60  # unsigned, wrong secret, stale, replays

            # a NaN gradient from the route's next peer is refused, and that peer is then ignored
            h = node.header(route, tokens, targets, stage=1)
            await node.call(target, FORWARD, h.to_wire(), good)
            fwd = await asyncio.wait_for(node.forwards.get(), timeout=20)  # we are stage 2 of the route
            assert fwd.mb_id == h.mb_id and fwd.stage == 2
            bwd = BackwardHeader(
                run_id=spec.run_id, spec_hash=spec.spec_hash, mb_id=h.mb_id, stage=1
            ).to_wire()
            with pytest.raises(RequestError, match="NaN"):
                await node.call(target, BACKWARD, bwd, nan_like(float("nan")))
            assert peer.counters["penalized"] == 1
            with pytest.raises(RequestError, match="ignored"):
                await node.call(target, INFO, {})
            assert peer.version == before[0]  # the poisoned backward changed no weights
        finally:
            if peer is not None:
                await peer.shutdown()
            await node.shutdown()

    asyncio.run(main())


# ------------------------------------------------------------------- without the network (fast)

_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.text(max_size=40),
    st.binary(max_size=64),
)
_values = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_FIELDS = [
    "run_id",
    "spec_hash",
    "mb_id",
    "stage",
    "route",
    "trainer",
    "mode",
    "batch",
    "seq",
    "tokens",
    "targets",
    "sent_at",
    "stats",
    "auth",
    "payload_sha256",
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=st.dictionaries(st.sampled_from(_FIELDS) | st.text(max_size=8), _values, max_size=16))
def test_header_parsers_only_raise_request_errors(header):
    for parse in (ForwardHeader.from_wire, BackwardHeader.from_wire, Report.from_wire):
        try:
            parse(header)
        except RequestError:
            pass
    auth = RunAuth("r", secret=b"k" * 32)
    with pytest.raises(AuthError):
        auth.check_request(FORWARD, "A", "B", header)  # random headers never carry a valid proof


@settings(max_examples=200, deadline=None)
@given(
    metadata=st.binary(max_size=512) | _values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
    chunks=st.lists(st.binary(max_size=64), max_size=4),
    declared=st.integers(-5, 300) | st.none(),
)
def test_read_message_only_raises_request_errors(metadata, chunks, declared):
    from hivemind.proto import runtime_pb2

    if declared is not None and len(metadata) < MAX_HEADER_BYTES:
        metadata = msgpack.packb({"payload_bytes": declared, "payload_sha256": b"x"}, use_bin_type=True)
    parts = [runtime_pb2.ExpertRequest(uid=PROTOCOL_TAG, metadata=metadata)]
    parts += [runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor(buffer=c)]) for c in chunks]

    async def gen():
        for p in parts:
            yield p

    try:
        asyncio.run(read_message(gen(), max_payload_bytes=256))
    except RequestError:
        pass
