"""Channels: small messages to one peer share one long-lived stream (swarm/wire/channel.py)."""

import asyncio

import pytest
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from swarm.errors import Failure, PeerFailure, RequestError
from swarm.wire import channel
from swarm.wire.protocol import PART_BYTES, PROTOCOL_TAG, Message, call, serve, to_parts, unserve


def test_split_uid_takes_only_well_formed_frames():
    assert channel.split_uid(f"{PROTOCOL_TAG}|forward|17", PROTOCOL_TAG) == ("forward", 17)
    for bad in (
        PROTOCOL_TAG,
        f"{PROTOCOL_TAG}|forward",
        "other/1|forward|1",
        f"{PROTOCOL_TAG}||1",
        f"{PROTOCOL_TAG}|forward|-1",
        f"{PROTOCOL_TAG}|forward|x",
        f"{PROTOCOL_TAG}|forward|{1 << 64}",
        f"{PROTOCOL_TAG}|forward|1|2",
        f"{PROTOCOL_TAG}|{'k' * 65}|1",
    ):
        assert channel.split_uid(bad, PROTOCOL_TAG) is None, bad


def test_small_messages_take_the_small_lane_one_part_payloads_the_bulk_lane_the_rest_streams():
    assert channel.lane_of(to_parts(Message({"n": 1}, b"x" * 8192))) == channel.SMALL
    assert channel.lane_of(to_parts(Message({"n": 1}, b"x" * channel.CHANNEL_MAX_BYTES))) == channel.BULK
    assert channel.lane_of(to_parts(Message({"n": 1}, b"x" * PART_BYTES))) == channel.BULK
    assert channel.lane_of(to_parts(Message({"n": 1}, b"x" * (PART_BYTES + 1)))) is None  # two parts
    assert channel.lane_of(to_parts(Message({}, b"x" * 10), part_bytes=4)) is None


def test_channels_can_be_turned_off_or_kept_to_the_small_lane(monkeypatch):
    small, big = to_parts(Message({}, b"x" * 10)), to_parts(Message({}, b"x" * 300_000))
    assert channel.channels_enabled()
    monkeypatch.setenv("SWARMPIPE_CHANNELS", "small")
    assert channel.channels_enabled()
    assert (channel.lane_of(small), channel.lane_of(big)) == (channel.SMALL, None)
    monkeypatch.setenv("SWARMPIPE_CHANNELS", "0")
    assert not channel.channels_enabled()
    assert (channel.lane_of(small), channel.lane_of(big)) == (None, None)


def _channels(client):
    pool = channel._POOLS.get(client)
    return {} if pool is None else dict(pool._channels)


async def _pair():
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(
        initial_peers=await server.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"]
    )
    return server, client


async def _close(*p2ps):
    for p2p in p2ps:
        channel.close_channels(p2p)
        await p2p.shutdown()


@pytest.mark.integration
def test_many_calls_share_one_stream_and_replies_find_their_callers():
    async def main():
        server, client = await _pair()
        try:
            remotes = set()

            async def handler(message, remote):
                remotes.add(remote)
                n = message.header["n"]
                if message.header.get("refuse"):
                    raise RequestError("refused on purpose", failure=Failure.BUSY)
                await asyncio.sleep(0.2 if n % 2 else 0.0)  # odd replies come back after even ones
                return {"echo": n, "size": len(message.payload)}

            await serve(server, "test.echo", handler, max_payload_bytes=2 << 20)
            replies = await asyncio.gather(
                *(
                    call(client, server.peer_id, "test.echo", Message({"n": n}, b"p" * n), timeout_s=20)
                    for n in range(40)
                )
            )
            assert [r["echo"] for r in replies] == list(range(40))
            assert [r["size"] for r in replies] == list(range(40))
            assert remotes == {client.peer_id}  # the handler sees who sent each message
            only = _channels(client)[(server.peer_id, channel.SMALL)]
            with pytest.raises(RequestError, match="refused on purpose") as refused:
                await call(
                    client, server.peer_id, "test.echo", Message({"n": 1, "refuse": True}), timeout_s=20
                )
            assert refused.value.failure is Failure.BUSY
            # a one-part payload takes the bulk lane, a channel of its own beside the small one
            big = await call(
                client, server.peer_id, "test.echo", Message({"n": 2}, b"q" * (200 << 10)), timeout_s=20
            )
            assert big["size"] == 200 << 10
            bulk = _channels(client)[(server.peer_id, channel.BULK)]
            assert bulk is not only and not only.closed
            # a message of several parts takes a stream of its own; both channels stay
            huge = await call(
                client, server.peer_id, "test.echo", Message({"n": 2}, b"h" * (PART_BYTES + 1)), timeout_s=20
            )
            assert huge["size"] == PART_BYTES + 1
            assert _channels(client) == {
                (server.peer_id, channel.SMALL): only,
                (server.peer_id, channel.BULK): bulk,
            }
            # a kind the receiver does not serve fails like a missing protocol
            with pytest.raises(PeerFailure) as unserved:
                await call(client, server.peer_id, "test.nothing", Message({"n": 3}), timeout_s=20)
            assert unserved.value.failure is Failure.UNREACHABLE
            await unserve(server, "test.echo")
            with pytest.raises(PeerFailure):
                await call(client, server.peer_id, "test.echo", Message({"n": 4}), timeout_s=20)
        finally:
            await _close(client, server)

    asyncio.run(main())


@pytest.mark.integration
def test_a_small_message_is_not_held_behind_a_slow_bulk_one():
    async def main():
        server, client = await _pair()
        try:
            release = asyncio.Event()

            async def handler(message, remote):
                if message.payload:
                    await release.wait()  # the receiver is slow with bulk messages
                return {"size": len(message.payload)}

            await serve(server, "test.lanes", handler, max_payload_bytes=1 << 20)
            bulk = asyncio.ensure_future(
                call(client, server.peer_id, "test.lanes", Message({}, b"b" * (300 << 10)), timeout_s=30)
            )
            small = await call(client, server.peer_id, "test.lanes", Message({}), timeout_s=30)
            assert small["size"] == 0 and not bulk.done()
            release.set()
            assert (await bulk)["size"] == 300 << 10
            assert set(_channels(client)) == {(server.peer_id, channel.SMALL), (server.peer_id, channel.BULK)}
        finally:
            await _close(client, server)

    asyncio.run(main())


@pytest.mark.integration
def test_a_receiver_that_goes_away_fails_waiting_calls_at_once():
    async def main():
        server, client = await _pair()
        try:
            started = asyncio.Event()

            async def handler(message, remote):
                if message.header.get("hang"):
                    started.set()
                    await asyncio.sleep(3600)
                return {}

            await serve(server, "test.hang", handler)
            await call(client, server.peer_id, "test.hang", Message({}), timeout_s=20)
            waiting = asyncio.ensure_future(
                call(client, server.peer_id, "test.hang", Message({"hang": True}), timeout_s=60)
            )
            await asyncio.wait_for(started.wait(), 20)
            t0 = asyncio.get_running_loop().time()
            channel.close_channels(server)
            await server.shutdown()
            with pytest.raises(PeerFailure) as gone:
                await waiting
            assert gone.value.failure is Failure.UNREACHABLE
            assert asyncio.get_running_loop().time() - t0 < 30  # not the call's 60 s timeout
            assert _channels(client) == {}
        finally:
            await _close(client, server)

    asyncio.run(main())


@pytest.mark.integration
def test_a_timeout_on_a_silent_channel_closes_it_and_the_next_call_opens_a_new_one():
    async def main():
        server, client = await _pair()
        try:

            async def handler(message, remote):
                if message.header.get("hang"):
                    await asyncio.sleep(3600)
                return {"ok_n": message.header["n"]}

            await serve(server, "test.slow", handler)
            await call(client, server.peer_id, "test.slow", Message({"n": 0}), timeout_s=20)
            (first,) = _channels(client).values()
            with pytest.raises(PeerFailure) as late:
                await call(client, server.peer_id, "test.slow", Message({"n": 1, "hang": True}), timeout_s=1)
            assert late.value.failure is Failure.TIMEOUT
            assert first.closed
            assert (await call(client, server.peer_id, "test.slow", Message({"n": 2}), timeout_s=20))[
                "ok_n"
            ] == 2
            (second,) = _channels(client).values()
            assert second is not first
        finally:
            await _close(client, server)

    asyncio.run(main())


@pytest.mark.integration
def test_a_peer_without_channels_gets_streams_of_their_own(monkeypatch):
    async def main():
        server, client = await _pair()
        try:

            async def handler(message, remote):
                return {"n": message.header["n"]}

            async def no_channel(*args, **kwargs):  # what a peer older than channels serves
                return None

            monkeypatch.setattr(channel, "register", no_channel)
            await serve(server, "test.old", handler)
            for n in range(3):
                assert (await call(client, server.peer_id, "test.old", Message({"n": n}), timeout_s=20))[
                    "n"
                ] == n
            assert _channels(client) == {}
            assert channel._POOLS[client]._refused_until[server.peer_id] > 0  # tried once, then not again
        finally:
            await _close(client, server)

    asyncio.run(main())


@pytest.mark.integration
def test_garbage_on_a_channel_closes_only_that_channel():
    async def main():
        server, client = await _pair()
        try:

            async def handler(message, remote):
                return {"n": message.header["n"]}

            await serve(server, "test.echo", handler)
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, channel.CHANNEL)
            await P2P.send_protobuf(runtime_pb2.ExpertRequest(uid="not a channel frame"), writer)
            with pytest.raises(asyncio.IncompleteReadError):
                await asyncio.wait_for(P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader), 20)
            writer.close()
            assert (await call(client, server.peer_id, "test.echo", Message({"n": 5}), timeout_s=20))[
                "n"
            ] == 5
        finally:
            await _close(client, server)

    asyncio.run(main())


@pytest.mark.integration
def test_a_short_timeout_does_not_fail_the_other_messages_waiting_on_the_channel():
    async def main():
        server, client = await _pair()
        try:
            release = asyncio.Event()

            async def handler(message, remote):
                await release.wait()  # a receiver that answers nothing for a while
                return {"n": message.header["n"]}

            await serve(server, "test.stall", handler)
            patient = asyncio.ensure_future(
                call(client, server.peer_id, "test.stall", Message({"n": 1}), timeout_s=30)
            )
            await asyncio.sleep(0.2)
            with pytest.raises(PeerFailure) as short:
                await call(client, server.peer_id, "test.stall", Message({"n": 2}), timeout_s=0.5)
            assert short.value.failure is Failure.TIMEOUT
            (open_channel,) = _channels(client).values()
            assert not open_channel.closed  # another message still waits on it
            release.set()
            assert (await patient)["n"] == 1
        finally:
            await _close(client, server)

    asyncio.run(main())
