"""Channels: many small data-plane messages to one peer over one long-lived libp2p stream.

Why (note "channels"): a message on a stream of its own pays for opening and closing that stream (a
yamux stream through both p2pd daemons, multistream-select of the protocol name, both closes): ~1.3 KB
and 13 packets on the wire beyond its header and payload (``python -m benchmarks.stream_cost``). For a
micro-batch of a subspace model, whose payload per hop is ~8 KB, those fixed costs were most of the
control plane's bytes. A channel opens one stream per (sender, receiver) pair, once, and sends every
small message on it; each message then costs its frame and its reply.

What travels on a channel. The sender writes single-part messages (``protocol.to_parts`` of a message
that fits one part) on one of two lanes, each its own long-lived stream to the peer: the *small* lane
takes parts of at most :data:`CHANNEL_MAX_BYTES` (probes, reports, the forwards and gradients of subspace
models), the *bulk* lane parts up to :data:`BULK_MAX_BYTES` (a micro-batch's activations or gradients),
so a megabyte of activations never holds a probe or a report up behind it. Messages of several parts
keep a stream of their own. The part's ``uid`` is
``"<protocol tag>|<kind>|<cid>"``: ``kind`` is the protocol name's last dotted part (``forward``,
``report``, ...), ``cid`` the sender's number for the message. The receiver hands the part to the
handler ``protocol.serve`` registered for that kind, concurrently with the other messages, and writes
each reply as it is ready, wrapped as ``msgpack([cid, reply metadata])``; ``[cid, None]`` means the
receiver serves no such kind (the sender reports it like a missing protocol: ``unreachable``). Replies
come in any order; the sender matches them by ``cid``.

Why a bulk lane (note "bulk lane"): a stream of its own per activation costs both daemons and both
Python processes the stream's opening and closing on every hop. ``python -m benchmarks.stream_cost
--concurrency 4 --channels on`` (then ``small``, ``off``) measures it in the network lab: for a 256 KiB
activation, the two Python processes spent 0.80 ms and the two daemons 1.05 ms of CPU per message on
the bulk lane, against 1.3-1.7 ms and 1.65-1.8 ms on a stream of its own. With every stage of a
pipeline sharing a machine's cores, that CPU comes out of the compute. On one stream the bulk messages
to a peer go in order (they share the one connection's bandwidth either way) and under that stream's
flow-control window.

Failures. A channel that breaks (the remote daemon closed it, a frame that does not parse) fails every
message waiting on it with ``PeerFailure`` ``unreachable``, as a broken stream would, and the next
message opens a new one. A message that times out closes its channel when nothing came back on it
since the message was sent and no other message waits on it (the stream may be dead without the
daemon having noticed). While others wait, their own timeouts decide: a receiver whose loop stalled
for a moment answers them late, and a short probe's timeout must not fail a forward that would have
been acknowledged within its own. A reply to a message whose caller gave up is dropped. A peer that
does not serve channels (older versions) or cannot be reached is sent messages on streams of their own
for :data:`RETRY_S` before a channel is tried again.

``SWARMPIPE_CHANNELS=0`` in a sender's environment turns channels off there (every message on a stream
of its own, as before channels existed; the control-plane benchmark's "before" variant);
``SWARMPIPE_CHANNELS=small`` keeps the small lane only (activations on streams of their own, as before the
bulk lane).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

from swarm.errors import PeerFailure
from swarm.traffic import message_kind

__all__ = [
    "CHANNEL",
    "CHANNEL_MAX_BYTES",
    "BULK_MAX_BYTES",
    "RETRY_S",
    "channels_enabled",
    "lane_of",
    "register",
    "unregister",
    "request",
    "close_channels",
    "split_uid",
]

logger = logging.getLogger(__name__)

CHANNEL = "swarmpipe.channel"
CHANNEL_MAX_BYTES = 64 << 10
"""Largest serialised part sent on the small lane."""
BULK_MAX_BYTES = 2 << 20
"""Largest serialised part sent on the bulk lane (a protocol part holds at most 1 MiB of payload plus its
header); larger messages keep a stream of their own."""
SMALL, BULK = "small", "bulk"
RETRY_S = 30.0
"""How long a peer whose channel could not be opened is sent messages on streams of their own."""
_MAX_CID = (1 << 63) - 1

Responder = Callable[[runtime_pb2.ExpertRequest, P2PContext], Awaitable[runtime_pb2.ExpertResponse]]


def channels_enabled() -> bool:
    """Off only when ``SWARMPIPE_CHANNELS`` is ``0`` (or ``false``/``no``/``off``)."""
    return _setting() not in _OFF


_OFF = ("0", "false", "no", "off")


def _setting() -> str:
    return os.environ.get("SWARMPIPE_CHANNELS", "1").strip().lower()


def lane_of(parts: list[runtime_pb2.ExpertRequest]) -> str | None:
    """The lane a message (its parts) goes on: ``"small"``, ``"bulk"``, or None for a stream of its own
    (several parts, a part over :data:`BULK_MAX_BYTES`, or a lane turned off). Pure but for the
    environment switch."""
    setting = _setting()
    if setting in _OFF or len(parts) != 1:
        return None
    size = parts[0].ByteSize()
    if size <= CHANNEL_MAX_BYTES:
        return SMALL
    return BULK if size <= BULK_MAX_BYTES and setting != "small" else None


def split_uid(uid: str, tag: str) -> tuple[str, int] | None:
    """``"<tag>|<kind>|<cid>"`` -> ``(kind, cid)``; None for anything else (pure)."""
    pieces = uid.split("|")
    if len(pieces) != 3 or pieces[0] != tag or not pieces[1] or len(pieces[1]) > 64:
        return None
    if not pieces[2].isdigit() or len(pieces[2]) > 19:
        return None
    cid = int(pieces[2])
    return (pieces[1], cid) if cid <= _MAX_CID else None


# --------------------------------------------------------------------------------------- receiver


@dataclass
class _Served:
    """What one P2P serves on channels, and the channels it is serving."""

    tag: str
    responders: dict[str, Responder] = field(default_factory=dict)
    inbound: set[asyncio.Event] = field(default_factory=set)


_SERVED: weakref.WeakKeyDictionary[P2P, _Served] = weakref.WeakKeyDictionary()


async def register(p2p: P2P, kind: str, responder: Responder, *, tag: str) -> None:
    """Serve ``kind`` on channels: ``responder(part, context)`` answers one single-part message.

    The first registration on ``p2p`` adds the channel protocol's handler."""
    served = _SERVED.get(p2p)
    if served is None:
        served = _SERVED[p2p] = _Served(tag)
        await p2p.add_protobuf_handler(
            CHANNEL,
            lambda parts, context: _serve_channel(served, parts, context),
            runtime_pb2.ExpertRequest,
            stream_input=True,
            stream_output=True,
        )
    served.responders[kind] = responder


def unregister(p2p: P2P, kind: str) -> None:
    """Stop serving ``kind`` on channels (messages of that kind are then answered as not served)."""
    served = _SERVED.get(p2p)
    if served is not None:
        served.responders.pop(kind, None)


def _envelope(cid: int, metadata: bytes | None) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=msgpack.packb([cid, metadata], use_bin_type=True))


async def _serve_channel(served: _Served, parts: Any, context: P2PContext) -> Any:
    """One inbound channel: answer each message as its handler finishes, until the sender closes."""
    replies: asyncio.Queue[runtime_pb2.ExpertResponse | None] = asyncio.Queue()
    running: set[asyncio.Task] = set()
    stop = asyncio.Event()
    served.inbound.add(stop)

    async def answer(kind: str, cid: int, part: runtime_pb2.ExpertRequest) -> None:
        responder = served.responders.get(kind)
        if responder is None:
            replies.put_nowait(_envelope(cid, None))
            return
        part.uid = served.tag
        try:
            reply = await responder(part, context)
        except Exception:  # the responder turns refusals into replies; anything else is a bug there
            logger.exception("channel handler for %r from %s failed", kind, context.remote_id)
            reply = runtime_pb2.ExpertResponse(
                metadata=msgpack.packb({"ok": False, "error": "handler failed", "failure": "error"})
            )
        replies.put_nowait(_envelope(cid, reply.metadata))

    async def receive() -> None:
        try:
            async for part in parts:
                parsed = split_uid(part.uid, served.tag)
                if parsed is None:  # not a channel frame: the sender speaks something else; no linger
                    stop.set()
                    logger.debug(
                        "channel from %s: unparseable frame %r, closing", context.remote_id, part.uid[:80]
                    )
                    return
                task = asyncio.ensure_future(answer(*parsed, part))
                running.add(task)
                task.add_done_callback(running.discard)
        finally:
            if running:
                await asyncio.wait(set(running))
            replies.put_nowait(None)

    receiver = asyncio.ensure_future(receive())
    closer = asyncio.ensure_future(stop.wait())
    getter: asyncio.Future | None = None
    try:
        while True:
            getter = asyncio.ensure_future(replies.get())
            await asyncio.wait({getter, closer}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                return
            reply = getter.result()
            if reply is None:
                break
            yield reply
        # Linger (note "reply before close" in protocol.py): the sender closes its end once it has
        # every reply, which ends this wait.
        await asyncio.wait({closer}, timeout=10.0)
    finally:
        served.inbound.discard(stop)
        closer.cancel()
        if getter is not None:
            getter.cancel()
        receiver.cancel()  # its handlers run on (they are not cancelled mid-way); their replies are dropped


# ----------------------------------------------------------------------------------------- sender


class _Channel:
    """The sending end of one channel (one lane) to one peer."""

    def __init__(
        self,
        pool: _Pool,
        peer_id: PeerID,
        lane: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ):
        self.pool = pool
        self.peer_id = peer_id
        self.lane = lane
        self._reader = reader
        self._writer = writer
        self._pending: dict[int, asyncio.Future] = {}
        self._next_cid = 0
        self._lock = asyncio.Lock()
        self.last_heard = time.monotonic()
        self.closed = False
        self._reading = asyncio.ensure_future(self._read())

    async def request(
        self, name: str, part: runtime_pb2.ExpertRequest, tag: str
    ) -> runtime_pb2.ExpertResponse:
        if self.closed:
            raise PeerFailure(
                f"{name} to {self.peer_id}: the stream closed without a reply",
                peer=str(self.peer_id),
                reason="unreachable",
            )
        cid = self._next_cid
        self._next_cid += 1
        future = asyncio.get_running_loop().create_future()
        self._pending[cid] = future
        part.uid = f"{tag}|{message_kind(name)}|{cid}"
        sent = time.monotonic()
        try:
            async with (
                self._lock
            ):  # every frame is written whole before the next (writes never await mid-frame)
                await P2P.send_protobuf(part, self._writer)
            metadata = await future
        except (ConnectionError, OSError) as e:
            self.close()
            raise PeerFailure(
                f"{name} to {self.peer_id} failed: {e}", peer=str(self.peer_id), reason="unreachable"
            ) from None
        except asyncio.CancelledError:  # the caller's timeout: see "Failures" in the module docstring
            if self.last_heard < sent and list(self._pending) == [cid]:
                self.close()
            raise
        finally:
            self._pending.pop(cid, None)
        if metadata is None:
            raise PeerFailure(
                f"{name} to {self.peer_id} failed: the peer does not serve {name}",
                peer=str(self.peer_id),
                reason="unreachable",
            )
        return runtime_pb2.ExpertResponse(metadata=metadata)

    async def _read(self) -> None:
        try:
            while True:
                response, error = await P2P.receive_protobuf(runtime_pb2.ExpertResponse, self._reader)
                if error is not None:
                    logger.debug("channel to %s: the receiver failed: %s", self.peer_id, error.message)
                    return
                cid, metadata = msgpack.unpackb(response.metadata, raw=False)
                if not isinstance(cid, int) or not (metadata is None or isinstance(metadata, bytes)):
                    logger.debug("channel to %s: malformed reply envelope", self.peer_id)
                    return
                self.last_heard = time.monotonic()
                future = self._pending.get(cid)
                if future is not None and not future.done():
                    future.set_result(metadata)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # EOF, a reset, garbage: the channel is over either way
            logger.debug("channel to %s closed: %s", self.peer_id, type(e).__name__)
        finally:
            self._fail_pending()

    def _fail_pending(self) -> None:
        self.closed = True
        self.pool.forget(self)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(
                    PeerFailure(
                        f"channel to {self.peer_id}: the stream closed without a reply",
                        peer=str(self.peer_id),
                        reason="unreachable",
                    )
                )
        self._pending.clear()

    def close(self) -> None:
        """Close the stream; waiting messages fail as ``unreachable``."""
        if not self.closed:
            self._fail_pending()
        self._reading.cancel()
        with contextlib.suppress(Exception):
            self._writer.close()


class _Pool:
    """One P2P's channels, by peer and lane."""

    def __init__(self, p2p: P2P):
        self._p2p = weakref.ref(p2p)
        self._channels: dict[tuple[PeerID, str], _Channel] = {}
        self._opening: dict[tuple[PeerID, str], asyncio.Future] = {}
        self._refused_until: dict[PeerID, float] = {}

    def forget(self, channel: _Channel) -> None:
        key = (channel.peer_id, channel.lane)
        if self._channels.get(key) is channel:
            del self._channels[key]

    async def channel(self, peer_id: PeerID, lane: str = SMALL) -> _Channel | None:
        """The open channel on ``lane`` to ``peer_id``, opened if needed; None when the peer gets streams
        of their own."""
        key = (peer_id, lane)
        channel = self._channels.get(key)
        if channel is not None and not channel.closed:
            return channel
        if time.monotonic() < self._refused_until.get(peer_id, 0.0):
            return None
        opening = self._opening.get(key)
        if opening is None:
            opening = self._opening[key] = asyncio.ensure_future(self._open(peer_id, lane))
            opening.add_done_callback(lambda _: self._opening.pop(key, None))
        return await asyncio.shield(opening)

    async def _open(self, peer_id: PeerID, lane: str) -> _Channel | None:
        p2p = self._p2p()
        if p2p is None:
            return None
        try:
            _, reader, writer = await p2p.call_binary_stream_handler(peer_id, CHANNEL)
        except Exception as e:  # an older peer (no such protocol), or one we cannot reach right now
            logger.debug("no channel to %s (%s): streams of their own for %.0f s", peer_id, e, RETRY_S)
            self._refused_until[peer_id] = time.monotonic() + RETRY_S
            return None
        channel = self._channels[(peer_id, lane)] = _Channel(self, peer_id, lane, reader, writer)
        return channel

    def close(self) -> None:
        for channel in list(self._channels.values()):
            channel.close()
        self._channels.clear()


_POOLS: weakref.WeakKeyDictionary[P2P, _Pool] = weakref.WeakKeyDictionary()


async def request(
    p2p: P2P, peer_id: PeerID, name: str, part: runtime_pb2.ExpertRequest, *, tag: str, lane: str = SMALL
) -> runtime_pb2.ExpertResponse | None:
    """Send one single-part message on the channel (``lane``, see :func:`lane_of`) to ``peer_id`` and
    return its reply; None when this peer gets messages on streams of their own (channels off, or none
    could be opened)."""
    if not channels_enabled():
        return None
    pool = _POOLS.get(p2p)
    if pool is None:
        pool = _POOLS[p2p] = _Pool(p2p)
    channel = await pool.channel(peer_id, lane)
    if channel is None:
        return None
    return await channel.request(name, part, tag)


def close_channels(p2p: P2P) -> None:
    """Close ``p2p``'s channels: those it opened (waiting messages fail as ``unreachable``) and those it
    serves (each sees its stream end). Call before the P2P shuts down."""
    pool = _POOLS.pop(p2p, None)
    if pool is not None:
        pool.close()
    served = _SERVED.get(p2p)
    if served is not None:
        for stop in list(served.inbound):
            stop.set()
