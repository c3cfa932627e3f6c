"""``SwarmLink``: this process's endpoint in a run, for processes that send micro-batches (trainers,
``swarm generate``).

It joins the DHT (``swarm.dht.network.start_dht``), fetches and checks the run's spec, and serves
``REPORT`` (what peers send back about a micro-batch) and ``INFO`` (peers probe a trainer before
dropping its stash entries) on a P2P replica; it sends ``FORWARD``, ``INFO`` probes and ``CANCEL``
with swarm/wire/protocol.py. What to do with a report is the owner's business (``on_report``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from swarm.errors import PeerFailure, RequestError

if TYPE_CHECKING:
    import hivemind
    import torch
    from hivemind.p2p import P2P

    from swarm.dht.membership import Membership
    from swarm.dht.records import PeerRecord
    from swarm.run.spec import RunSpec
    from swarm.wire.protocol import Message, Report

logger = logging.getLogger(__name__)

__all__ = ["SwarmLink"]


class SwarmLink:
    """This process's endpoint in a run: DHT node, ``Membership``, the spec and a P2P replica that
    serves ``REPORT``. Trainers and ``swarm generate`` use it; open with :meth:`open`, close in
    ``finally`` with :meth:`close`."""

    def __init__(self, dht: hivemind.DHT, membership: Membership, spec: RunSpec, p2p: P2P):
        self.dht = dht
        self.membership = membership
        self.spec = spec
        self.p2p = p2p
        self.peer_id: str = p2p.peer_id.to_base58()
        self.auth: Any = None  # swarm.dht.auth.RunAuth: signs our requests, checks reports (private runs)
        self.on_report: Callable[[Report, bytes], None] = lambda report, payload: None
        self.on_heard: Callable[[str], None] = lambda peer: None  # any message from a peer (liveness)
        self.handler_error: Exception | None = None  # first exception raised by on_report (a bug)

    @classmethod
    async def open(
        cls,
        *,
        initial_peers: tuple[str, ...],
        run_id: str,
        host_maddrs: tuple[str, ...] = (),
        spec_timeout_s: float = 60.0,
        secret: bytes | None = None,
    ) -> SwarmLink:
        from swarm.dht.auth import RunAuth
        from swarm.dht.membership import Membership
        from swarm.dht.network import DHTConfig, start_dht
        from swarm.wire.protocol import INFO, REPORT, serve

        cfg = DHTConfig(initial_peers=initial_peers, **({"host_maddrs": host_maddrs} if host_maddrs else {}))
        dht = await asyncio.to_thread(start_dht, cfg)
        try:
            membership = Membership(dht, run_id)
            spec = await asyncio.to_thread(membership.fetch_spec, spec_timeout_s)
            auth = RunAuth.from_spec(spec, secret)  # a private run needs the right secret
            membership.set_auth(auth)  # our progress carries a proof; outsiders' records are ignored
            p2p = await dht.replicate_p2p()
            link = cls(dht, membership, spec, p2p)
            link.auth = auth
            await serve(p2p, REPORT, link._handle_report, gate=auth.gate(link.peer_id))
            # peers probe a trainer before dropping its stash entries (note "trainers that vanish")
            await serve(p2p, INFO, link._handle_info, gate=auth.gate(link.peer_id))
            return link
        except BaseException:
            dht.shutdown()
            raise

    async def _handle_report(self, message: Message, remote: Any) -> dict[str, Any]:
        from swarm.wire.protocol import Report

        report = Report.from_wire(message.header)  # RequestError -> an {"ok": False} reply
        if report.run_id != self.spec.run_id:
            raise RequestError(
                f"report for run {report.run_id!r} reached a trainer of run {self.spec.run_id!r}; "
                "the peer routes to the wrong trainer"
            )
        try:
            self.on_heard(str(remote))
            self.on_report(report, message.payload)
        except Exception as e:  # a bug of ours: keep it for the owner instead of losing it in the daemon
            logger.exception("handling report %s of %s failed", report.kind, report.mb_id)
            if self.handler_error is None:
                self.handler_error = e
            raise
        return {}

    async def _handle_info(self, message: Message, remote: Any) -> dict[str, Any]:
        return {"role": "trainer", "run_id": self.spec.run_id, "peer_id": self.peer_id}

    async def probe(self, peer: str, mb_ids: list[str], *, timeout_s: float) -> dict[str, Any]:
        """``INFO`` to ``peer`` listing ``mb_ids``; the reply's ``held`` names those it holds actively
        (note "liveness probes"). Raises like ``swarm.wire.protocol.call``."""
        from swarm.wire.protocol import INFO, Message, call

        return await call(
            self.p2p, peer, INFO, Message({"mb_ids": list(mb_ids)}), timeout_s=timeout_s, auth=self.auth
        )

    async def cancel(self, peer: str, mb_ids: list[str], *, timeout_s: float = 5.0) -> None:
        """Best effort: ask ``peer`` to drop what it holds of these closed attempts (``CANCEL``)."""
        from swarm.wire.protocol import CANCEL, Message, call

        with contextlib.suppress(PeerFailure, RequestError):
            await call(
                self.p2p,
                peer,
                CANCEL,
                Message({"run_id": self.spec.run_id, "mb_ids": list(mb_ids)}),
                timeout_s=timeout_s,
                auth=self.auth,
            )

    async def stage_records(self) -> list[dict[str, PeerRecord]]:
        """Current records of every stage (index = stage), only those of this spec."""
        records = await asyncio.to_thread(self.membership.all_stage_records, self.spec.num_stages)
        return [{pid: r for pid, r in st.items() if r.spec_hash == self.spec.spec_hash} for st in records]

    async def send_forward(
        self,
        *,
        route: tuple[str, ...],
        mb_id: str,
        mode: str,
        tokens: torch.Tensor,
        targets: torch.Tensor | None,
        timeout_s: float,
        counted_from: int = -1,
        window: int = -1,
        one_report: bool = False,
    ) -> dict[str, Any]:
        """Hand one micro-batch to ``route[0]``; returns its acknowledgement (raises
        ``PeerFailure`` / ``RequestError`` as ``swarm.wire.protocol.call`` does). ``counted_from``: see
        note "counted stages" (the trainer's docstring); ``one_report``: ask for stage 0's ``done`` to
        carry the loss instead of a ``loss`` report (note "one report" in swarm/wire/protocol.py)."""
        from swarm.wire.protocol import FORWARD, ForwardHeader, Message, call, pack_ids

        ids, target_ids, shifted = pack_ids(tokens, targets, self.spec.model.vocab_size)

        header = ForwardHeader(
            run_id=self.spec.run_id,
            spec_hash=self.spec.spec_hash,
            mb_id=mb_id,
            stage=0,
            route=route,
            trainer=self.peer_id,
            mode=mode,  # type: ignore[arg-type]
            batch=int(tokens.shape[0]),
            seq=int(tokens.shape[1]),
            tokens=ids,
            targets=target_ids,
            counted_from=counted_from,
            window=window,
            shifted=shifted,
            one_report=one_report,
        )
        return await call(
            self.p2p, route[0], FORWARD, Message(header.to_wire(), b""), timeout_s=timeout_s, auth=self.auth
        )

    async def close(self) -> None:
        from swarm.wire.channel import close_channels
        from swarm.wire.protocol import INFO, REPORT, unserve

        with contextlib.suppress(Exception):  # best effort: the daemon may already be gone
            await unserve(self.p2p, REPORT)
        with contextlib.suppress(Exception):
            await unserve(self.p2p, INFO)
        close_channels(self.p2p)
        with contextlib.suppress(Exception):
            await self.p2p.shutdown()
        await asyncio.to_thread(self.dht.shutdown)
