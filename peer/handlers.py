"""The data-plane request handlers of a stage peer: FORWARD, BACKWARD, INFO and CANCEL.

**A FORWARD is validated here** (``RequestHandlers._on_forward``), after the access gate
(``peer/admission.py``, before any payload byte is read) and ``ForwardHeader.from_wire`` (field
types and sizes, ``swarm/wire/protocol.py``): the checks against this peer (run, spec hash, stage,
route, sequence length, tokens, payload decoding and its RMS bound). A BACKWARD is checked the same
way against the stash entry of its forward. Refused requests answer ``ok: False`` (``RequestError``)
and never reach the compute queue; accepted ones are queued under the admission caps, and the reply
is the ack with the queue length.

``RequestHandlers`` is one of ``StagePeer``'s parts (peer/server.py); it reads the peer's spec,
config, state and compute and hands accepted work to ``WorkerTasks`` (peer/work.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable
from typing import Any

import torch

from peer.compute import StageCompute
from swarm.errors import Failure, RequestError
from swarm.wire.protocol import BackwardHeader, ForwardHeader, Message, listed_ids

__all__ = ["PoisonError", "RequestHandlers"]

logger = logging.getLogger(__name__)

_PEER_ID_RE = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,128}")  # base58, as in swarm/dht/records.py


class PoisonError(RequestError):
    """A tensor from a peer holds NaN/Inf or absurd magnitudes."""


class RequestHandlers:
    """The handlers ``StagePeer.start`` serves (a part of ``StagePeer``: see peer/server.py)."""

    def _check_common(self, run_id: str, spec_hash: str, stage: int, what: str) -> StageCompute:
        if run_id != self.spec.run_id or spec_hash != self.spec.spec_hash:
            raise RequestError(
                f"{what} for run {run_id!r} spec {spec_hash} reached a peer of run {self.spec.run_id!r} "
                f"spec {self.spec.spec_hash}; refresh the route from the DHT"
            )
        compute = self._compute
        if compute is None or stage != compute.stage:
            mine = "none" if compute is None else compute.stage
            raise RequestError(
                f"{what} for stage {stage} reached a peer serving stage {mine}; refresh the route"
            )
        return compute

    def _decode(self, payload: bytes, shape: tuple[int, ...], what: str, max_rms: float) -> torch.Tensor:
        """Check the codec header's shape before decoding, then decode and check values (thread pool).

        Non-finite values, or a root-mean-square above ``max_rms``, raise ``PoisonError`` so that a
        caller can penalize the sender (gradients) or just refuse (activations).
        """
        from compression import CodecError, decode_any, header_info

        cap = self.config.max_payload_bytes * 8
        try:
            info = header_info(payload, max_decoded_bytes=cap)
            if tuple(info["shape"]) != shape:
                raise RequestError(
                    f"{what} payload has shape {tuple(info['shape'])}, expected {shape} (batch, seq, width): "
                    "width is d_model, or the subspace rank k in a subspace-constrained run"
                )
            tensor = decode_any(payload, max_decoded_bytes=cap)
        except CodecError as e:
            raise RequestError(f"{what} payload cannot be decoded: {e}") from None
        if not tensor.is_floating_point():
            raise RequestError(f"{what} payload has dtype {tensor.dtype}; expected floating point")
        tensor = tensor.float()
        # One pass over the values (0.07 ms for a 2x256x512 activation, against 1.4 ms for isfinite
        # and 0.2 for the square's mean): the 2-norm is NaN or Inf exactly when a value is, or when
        # finite values overflow float32 in it, which the RMS cap refuses anyway.
        norm = float(torch.linalg.vector_norm(tensor)) if tensor.numel() else 0.0
        if not math.isfinite(norm) and not torch.isfinite(tensor).all():
            raise PoisonError(f"{what} payload holds NaN or Inf values; refusing it")
        rms = norm / math.sqrt(tensor.numel()) if tensor.numel() else 0.0
        if not rms <= max_rms:  # also catches an overflow to inf in the norm
            raise PoisonError(
                f"{what} payload has root-mean-square {rms:.3g}, above this peer's cap {max_rms:g}; "
                "refusing it as absurd"
            )
        return tensor

    async def _on_cancel(self, message: Message, remote: Any) -> dict[str, Any]:
        """A trainer gave up on these attempts: drop what this peer holds of them (its own only)."""
        run_id = message.header.get("run_id")
        if run_id != self.spec.run_id:
            raise RequestError(
                f"cancel for run {str(run_id)[:60]!r} reached a peer of run {self.spec.run_id!r}"
            )
        ids = listed_ids(message.header, "cancel request")
        sender = str(remote)
        self._trainers.cancel(sender, ids)
        compute = self._compute
        if compute is None:
            return {"dropped": 0}
        with compute.lock:
            mine = [
                i
                for i in ids
                if (e := compute.stash.get(i)) is not None and getattr(e.context, "trainer", None) == sender
            ]
        dropped = await asyncio.to_thread(lambda: sum(compute.drop(i) is not None for i in mine))
        self.counters["cancelled"] += dropped
        return {"dropped": dropped}

    async def _on_info(self, message: Message, remote: Any) -> dict[str, Any]:
        compute = self._compute
        ids = listed_ids(message.header, "info request")
        if ids:  # a probe (note "liveness probes", swarm/client/liveness.py): which of these do we hold?
            self._trainers.heard(str(remote))
            held = self._outbox.held(ids)
            stashed = [] if compute is None else [i for i in ids if i in compute.stash]
            return {**self._info(), "held": held, "stashed": stashed}
        if "mb_ids" not in message.header and compute is not None and compute.replicas <= 1:
            # a stage-mate counts its replicas (peer/loops.py, ``_ping``) while we count ourselves alone:
            # count again (note "replica recount", peer/recount.py); not while we have stage-mates, whose
            # ticks ping us anyway (and our counts would ping them back)
            self._stage_hint()
        return self._info()

    def _info(self) -> dict[str, Any]:
        compute = self._compute
        return {
            "run_id": self.spec.run_id,
            "spec_hash": self.spec.spec_hash,
            "peer_id": self.peer_id,
            "stage": -1 if compute is None else compute.stage,
            "version": self.version,
            "queue": len(self._queue) if self._queue is not None else 0,
            "state": self.state,
        }

    async def _on_forward(self, message: Message, remote: Any) -> dict[str, Any]:
        """A FORWARD is validated here, completely, before it is queued (docs/ARCHITECTURE.md)."""
        arrived = time.time()
        try:
            h = ForwardHeader.from_wire(message.header)
            self.timeline.mark(h.mb_id, "forward", "arrived", at=arrived)  # note "timeline"
            compute = self._check_forward(h)
            tokens, targets, x = await self._forward_inputs(compute, h, message.payload)
            if h.mode == "train" and h.mb_id in compute.stash:
                raise RequestError(
                    f"micro-batch {h.mb_id!r} is already in flight here; every attempt needs a new mb_id"
                )
            if h.window >= 0 and h.mode == "train":
                compute.note_window(h.trainer, h.window)  # sync: a newer window closes this replica's share
            if str(remote) == h.trainer:  # the trainer itself sent it: alive, whatever we concluded before
                self._trainers.back(h.trainer)
            n = self._queue_task(
                "forward",
                h.mb_id,
                remote,
                lambda waited: self._forward_task(compute, h, x, tokens, targets, waited),
            )
        except RequestError as e:
            if remote is None:  # called without the network (tests): serve's on_refused did not count it
                self._admission.count_refusal(e)
            raise
        return {"queue": n}

    def _check_forward(self, h: ForwardHeader) -> StageCompute:
        """The header's checks against this peer: run, spec, stage, state, route, sequence length."""
        compute = self._check_common(h.run_id, h.spec_hash, h.stage, "forward")
        if self.state != "online":
            raise RequestError(f"this peer is {self.state} and takes no new forwards; route to another peer")
        bad = [p for p in (*h.route, h.trainer) if not _PEER_ID_RE.fullmatch(p)]
        if bad:
            raise RequestError(f"route/trainer entry {bad[0][:60]!r} is not a base58 libp2p peer id")
        if h.route[h.stage] != self.peer_id:
            raise RequestError(f"route names {h.route[h.stage]} for stage {h.stage}, not this peer")
        if len(h.route) != self.spec.num_stages:
            raise RequestError(f"route has {len(h.route)} hops, the run has {self.spec.num_stages} stages")
        model = self.spec.model
        if h.seq > model.seq_len:
            raise RequestError(f"sequence length {h.seq} exceeds the run's model.seq_len {model.seq_len}")
        return compute

    async def _forward_inputs(
        self, compute: StageCompute, h: ForwardHeader, payload: bytes
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Token ids, targets and the stage input (the ids, or the decoded and checked activations)."""
        model = self.spec.model
        tokens, targets = h.token_ids(model.vocab_size)
        if compute.is_last and h.mode != "generate" and targets is None:
            raise RequestError(f"mode {h.mode!r} needs targets at the last stage")
        if compute.is_first:
            if payload:
                raise RequestError("stage 0 takes token ids from the header; the payload must be empty")
            return tokens, targets, tokens
        shape = (h.batch, h.seq, compute.width)  # width = d_model, or k in a subspace run
        x = await asyncio.to_thread(self._decode, payload, shape, "forward", self.config.max_activation_rms)
        return tokens, targets, x

    def _queue_task(self, kind: str, mb_id: str, remote: Any, fn: Callable[[float], None]) -> int:
        """Admit a validated request into the compute queue; its micro-batch is held from now on."""
        timeline = self.timeline

        def timed(waited: float) -> None:  # note "timeline": when the worker ran it
            timeline.mark(mb_id, kind, "started", cpu=time.thread_time())
            try:
                fn(waited)
            finally:
                timeline.mark(mb_id, kind, "ended", cpu=time.thread_time())

        self._outbox.hold(mb_id)
        try:
            at = time.time()  # before the worker can start it
            n = self._admission.submit(kind, str(remote), timed)
            timeline.mark(mb_id, kind, "queued", at=at)
            return n
        except RequestError:
            self._outbox.unhold(mb_id)
            raise

    async def _on_backward(self, message: Message, remote: Any) -> dict[str, Any]:
        arrived = time.time()
        try:
            h = BackwardHeader.from_wire(message.header)
            self.timeline.mark(h.mb_id, "backward", "arrived", at=arrived)
            compute = self._check_common(h.run_id, h.spec_hash, h.stage, "backward")
            entry = compute.peek(h.mb_id)
            fwd: ForwardHeader = entry.context
            if h.stage + 1 < len(fwd.route) and str(remote) != fwd.route[h.stage + 1]:
                raise RequestError(
                    f"backward of {h.mb_id!r} came from {remote}, not from the route's next peer {fwd.route[h.stage + 1]}"
                )
            if not compute.versions.has(entry.version):
                compute.drop(h.mb_id)
                compute.versions.evicted_refusals += 1
                self.counters["version_evicted"] += 1
                reason = (
                    f"version evicted: weight version {entry.version} of stage {compute.stage} is gone "
                    f"(max_versions={self.spec.optimizer.max_versions})"
                )
                self._outbox.report_failed(
                    fwd,
                    stage=compute.stage,
                    peer=self.peer_id,
                    reason=reason,
                    failure=Failure.VERSION_EVICTED,
                    counted_from=compute.stage + 1,
                )
                raise RequestError(reason, failure=Failure.VERSION_EVICTED)
            try:
                grad = await asyncio.to_thread(
                    self._decode, message.payload, entry.output_shape, "backward", self.config.max_grad_rms
                )
            except PoisonError as e:
                self._admission.penalize(str(remote), e)
                raise
            n = self._queue_task(
                "backward", h.mb_id, remote, lambda waited: self._backward_task(compute, h, fwd, grad, waited)
            )
        except RequestError as e:
            if remote is None:
                self._admission.count_refusal(e)
            raise
        return {"queue": n}
