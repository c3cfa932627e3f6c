"""The data-plane protocol: typed headers (pure) and a real loopback round trip between two P2P nodes."""

import asyncio

import pytest
import torch
from hivemind.p2p import P2P

from swarm.errors import Failure, PeerFailure, RequestError
from swarm.wire.protocol import (
    PART_BYTES,
    BackwardHeader,
    ForwardHeader,
    Message,
    Report,
    call,
    pack_ids,
    pack_tokens,
    read_message,
    serve,
    to_parts,
    token_width,
    unpack_tokens,
)


def _fwd(**over):
    tokens = torch.randint(0, 256, (2, 8))
    h = ForwardHeader(
        run_id="r",
        spec_hash="abcd",
        mb_id="t:1:0",
        stage=0,
        route=("a", "b"),
        trainer="t",
        mode="train",
        batch=2,
        seq=8,
        tokens=pack_tokens(tokens),
        targets=pack_tokens(tokens),
    )
    d = h.to_wire()
    d.update(over)
    return h, d


def test_forward_header_round_trip():
    h, d = _fwd()
    assert ForwardHeader.from_wire(d) == h
    assert "shifted" not in d  # an unshifted header is what it was before the field existed


def _shifted_header(tokens, targets, vocab=256, mode="train"):
    ids, target_ids, shifted = pack_ids(tokens, targets, vocab)
    h = ForwardHeader(
        run_id="r",
        spec_hash="abcd",
        mb_id="t:1:0",
        stage=0,
        route=("a", "b"),
        trainer="t",
        mode=mode,
        batch=tokens.shape[0],
        seq=tokens.shape[1],
        tokens=ids,
        targets=target_ids,
        shifted=shifted,
    )
    return ForwardHeader.from_wire(h.to_wire())


@pytest.mark.parametrize("vocab", [256, 50000, 100000])
def test_shifted_window_carries_tokens_and_targets_in_seq_plus_one_ids(vocab):
    win = torch.randint(0, vocab, (2, 9))
    tokens, targets = win[:, :-1], win[:, 1:]
    h = _shifted_header(tokens, targets, vocab)
    assert h.shifted and h.targets == b""
    assert len(h.tokens) == 2 * 9 * token_width(vocab)  # against 2 * 2 * 8 ids apart
    got_tokens, got_targets = h.token_ids(vocab)
    assert torch.equal(got_tokens, tokens) and torch.equal(got_targets, targets)


def test_targets_that_are_not_shifted_tokens_travel_apart():
    tokens = torch.randint(0, 256, (2, 8))
    targets = torch.randint(0, 256, (2, 8))
    targets[0, 0] = (tokens[0, 1] + 1) % 256  # certainly not a shift
    h = _shifted_header(tokens, targets)
    assert not h.shifted and len(h.targets) == 16
    got_tokens, got_targets = h.token_ids(256)
    assert torch.equal(got_tokens, tokens) and torch.equal(got_targets, targets)
    h = _shifted_header(tokens, None, mode="generate")
    assert not h.shifted and h.token_ids(256)[1] is None


@pytest.mark.parametrize(
    "over, match",
    [
        ({"targets": b"x" * 16}, "must be empty"),
        ({"mode": "generate"}, "must be empty"),
        ({"tokens": b"x" * 16}, r"batch\*\(seq\+1\)"),
        ({"shifted": 1}, "must be a bool"),
    ],
)
def test_shifted_header_refuses_what_does_not_fit(over, match):
    win = torch.randint(0, 256, (2, 9))
    ids, _, _ = pack_ids(win[:, :-1], win[:, 1:], 256)
    _, d = _fwd(tokens=ids, targets=b"", shifted=True)
    d.update(over)
    with pytest.raises(RequestError, match=match):
        ForwardHeader.from_wire(d)


@pytest.mark.parametrize(
    "over",
    [
        {"batch": 3},
        {"stage": 2},
        {"mode": "steal"},
        {"route": []},
        {"tokens": b"x"},
        {"run_id": ""},
        {"batch": True},
        {"sent_at": float("nan")},
    ],
)
def test_forward_header_rejects(over):
    _, d = _fwd(**over)
    with pytest.raises(RequestError):
        ForwardHeader.from_wire(d)


def test_tokens_out_of_vocab_refused():
    data = pack_tokens(torch.tensor([[0, 300]]))
    with pytest.raises(RequestError, match="vocabulary"):
        unpack_tokens(data, 1, 2, 256)
    assert unpack_tokens(data, 1, 2, 301).tolist() == [[0, 300]]
    with pytest.raises(RequestError, match=r"\[0, 256\)"):  # never wrapped into a narrower width
        pack_tokens(torch.tensor([[0, 300]]), 256)


@pytest.mark.parametrize("vocab, width", [(2, 1), (256, 1), (257, 2), (65536, 2), (65537, 4), (None, 4)])
def test_tokens_take_the_narrowest_width_of_the_vocabulary(vocab, width):
    assert token_width(vocab) == width
    top = (vocab or 1 << 31) - 1
    ids = torch.tensor([[0, top, 1], [top // 2, 0, top]])
    data = pack_tokens(ids, vocab)
    assert len(data) == ids.numel() * width
    assert torch.equal(unpack_tokens(data, 2, 3, top + 1), ids)


def test_forward_header_accepts_each_width_and_refuses_mixed_widths():
    tokens = torch.randint(0, 256, (2, 8))
    for vocab in (256, 1000, None):
        _, d = _fwd(tokens=pack_tokens(tokens, vocab), targets=pack_tokens(tokens, vocab))
        assert ForwardHeader.from_wire(d).tokens == pack_tokens(tokens, vocab)
    _, d = _fwd(tokens=pack_tokens(tokens, 256), targets=pack_tokens(tokens))
    with pytest.raises(RequestError, match="width of 'tokens'"):
        ForwardHeader.from_wire(d)


def test_one_report_travels_as_a_flag_and_the_loss_down_the_backward_headers():
    """Note "one report": the flag and the backward's loss are absent on the wire unless used, so headers
    without them are byte for byte what older peers sent and read; a bad value is refused by name."""
    h, d = _fwd()
    assert "one_report" not in d and not ForwardHeader.from_wire(d).one_report
    h, d = _fwd(one_report=True)
    assert ForwardHeader.from_wire(d).one_report
    with pytest.raises(RequestError, match="'one_report' must be a bool"):
        ForwardHeader.from_wire(d | {"one_report": 1})
    b = BackwardHeader(run_id="r", spec_hash="abcd", mb_id="m", stage=1, stats={"fwd_bytes_0": 9.0})
    assert set(b.to_wire()) == {"run_id", "spec_hash", "mb_id", "stage", "sent_at", "stats"}
    assert BackwardHeader.from_wire(b.to_wire()).loss is None
    with_loss = BackwardHeader(run_id="r", spec_hash="abcd", mb_id="m", stage=1, loss=2.5, n_tokens=16)
    assert BackwardHeader.from_wire(with_loss.to_wire()) == with_loss
    with pytest.raises(RequestError, match="'loss' must be a number"):
        BackwardHeader.from_wire(with_loss.to_wire() | {"loss": "low"})
    with pytest.raises(RequestError, match="'n_tokens'"):
        BackwardHeader.from_wire(with_loss.to_wire() | {"n_tokens": -1})
    done = Report(run_id="r", mb_id="m", kind="done", stage=0, peer="p", loss=2.5, n_tokens=16)
    assert Report.from_wire(done.to_wire()) == done


def test_report_validation():
    r = Report(run_id="r", mb_id="m", kind="loss", stage=1, peer="p", loss=2.5, n_tokens=16, stats={"s": 1})
    assert Report.from_wire(r.to_wire()).loss == 2.5
    bad = r.to_wire() | {"kind": "boom"}
    with pytest.raises(RequestError):
        Report.from_wire(bad)


async def _collect(parts):
    for p in parts:
        yield p


def test_parts_split_and_reassemble():
    payload = bytes(range(256)) * (PART_BYTES // 100)
    parts = to_parts(Message({"a": 1}, payload))
    assert len(parts) == -(-len(payload) // PART_BYTES)
    msg = asyncio.run(read_message(_collect(parts)))
    assert msg.payload == payload and msg.header["a"] == 1


def test_read_message_checks_sizes():
    parts = to_parts(Message({"a": 1}, b"x" * 100))
    with pytest.raises(RequestError, match="cap"):
        asyncio.run(read_message(_collect(parts), max_payload_bytes=10))
    parts[0].metadata = parts[0].metadata.replace(b"payload_bytes", b"payload_bytez")
    with pytest.raises(RequestError, match="payload_bytes"):
        asyncio.run(read_message(_collect(parts)))
    truncated = to_parts(Message({}, b"y" * (PART_BYTES + 5)))[:1]
    with pytest.raises(RequestError, match="truncated"):
        asyncio.run(read_message(_collect(truncated)))
    garbage = to_parts(Message({}, b""))
    garbage[0].metadata = b"\xc1\xff\x00"
    with pytest.raises(RequestError, match="msgpack"):
        asyncio.run(read_message(_collect(garbage)))


@pytest.mark.integration
def test_loopback_round_trip_and_refusal():
    async def main():
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        client = await P2P.create(
            initial_peers=await server.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"]
        )
        try:
            seen = []

            async def handler(message, remote):
                if message.header.get("refuse"):
                    raise RequestError("refused on purpose")
                if message.header.get("busy"):
                    raise RequestError("full up, try later", failure=Failure.BUSY)
                seen.append((message.header["n"], len(message.payload), remote))
                return {"echo": message.header["n"], "size": len(message.payload)}

            await serve(server, "test.echo", handler, max_payload_bytes=8 << 20)
            big = b"z" * (3 * PART_BYTES + 17)  # above the 2 MiB point where unary would be unsafe
            reply = await call(client, server.peer_id, "test.echo", Message({"n": 7}, big), timeout_s=20)
            assert reply == {"ok": True, "echo": 7, "size": len(big)}
            assert seen[0][2] == client.peer_id
            with pytest.raises(RequestError, match="refused on purpose") as refused:
                await call(client, server.peer_id, "test.echo", Message({"refuse": True}), timeout_s=20)
            assert refused.value.failure is Failure.REFUSED  # the code travels; nobody reads the text
            with pytest.raises(RequestError, match="full up") as busy:
                await call(client, server.peer_id, "test.echo", Message({"busy": True}), timeout_s=20)
            assert busy.value.failure is Failure.BUSY
            with pytest.raises(RequestError, match="cap"):
                await call(
                    client, server.peer_id, "test.echo", Message({"n": 1}, b"q" * (9 << 20)), timeout_s=20
                )
            # the server still answers after refusals
            assert (await call(client, server.peer_id, "test.echo", Message({"n": 2}), timeout_s=20))[
                "echo"
            ] == 2
            await server.shutdown()
            with pytest.raises(PeerFailure) as gone:
                await call(client, server.peer_id, "test.echo", Message({"n": 3}), timeout_s=5)
            assert gone.value.failure in (Failure.UNREACHABLE, Failure.TIMEOUT)
        finally:
            await client.shutdown()
            await server.shutdown()

    asyncio.run(main())
