"""What the compute worker thread runs for a queued FORWARD or BACKWARD, and what it sends on.

Runs only in the worker thread of ``peer/runtime.py`` (one model per process: a process that serves a stage holds no other model); every
network send goes back to the event loop through the ``Outbox`` (peer/sends.py). Any failure of a
task becomes a ``failed`` report to the trainer, never silence.

Per-hop stats keys added to headers and reports (all floats): ``fwd_compute_s_<s>``,
``fwd_queue_s_<s>``, ``fwd_bytes_<s>`` (bytes sent to stage s+1), ``bwd_compute_s_<s>``,
``bwd_queue_s_<s>``, ``bwd_bytes_<s>`` (bytes sent to stage s-1), ``version_<s>`` (forward
version) and ``staleness_<s>`` (versions elapsed until backward). The forward keys travel with the
FORWARDs and reach the trainer in the last stage's ``loss`` report; the BACKWARDs and stage 0's ``done``
report carry only the backward keys (the trainer merges both reports' stats), not the forward keys again.
When the forward header asks for ``one_report`` (note "one report" in swarm/wire/protocol.py), the last
stage sends no ``loss`` report and the FORWARDs carry no stats: each stage keeps its forward keys until
its backward and adds them to the BACKWARD it sends (the last stage with its loss), so every key crosses
each link at most once, and stage 0's ``done`` carries everything.

``WorkerTasks`` is one of ``StagePeer``'s parts (peer/server.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from typing import Any

import torch

from peer.compute import ForwardResult, StageCompute
from peer.stash import VersionEvicted
from swarm.errors import Failure, RequestError
from swarm.wire.protocol import BACKWARD, FORWARD, BackwardHeader, ForwardHeader, Report

__all__ = ["WorkerTasks"]

logger = logging.getLogger(__name__)

PER_MB_KEPT = 4096  # forward facts kept per micro-batch until its backward (oldest forgotten first)


def _remember(kept: OrderedDict[str, Any], mb_id: str, value: Any) -> None:
    """Keep ``value`` for ``mb_id`` until its backward pops it; forget the oldest beyond PER_MB_KEPT (a
    backward that never comes must not grow the map)."""
    kept[mb_id] = value
    while len(kept) > PER_MB_KEPT:
        kept.popitem(last=False)


class WorkerTasks:
    """Forward and backward tasks of the worker thread (a part of ``StagePeer``: see peer/server.py)."""

    def _forward_task(
        self,
        compute: StageCompute,
        h: ForwardHeader,
        x: torch.Tensor,
        tokens: torch.Tensor,
        targets: torch.Tensor | None,
        waited: float,
    ) -> None:
        """Worker thread: run one forward; any failure becomes a ``failed`` report, never silence."""
        try:
            if self._trainers.abandoned(h.trainer, h.mb_id):
                return  # cancelled, or its trainer is gone: nobody waits for it
            t0 = time.perf_counter()
            self._run_forward(compute, h, x, tokens, targets, waited)
            if h.mode == "train" and self._rate is not None:
                spent = time.perf_counter() - t0
                if compute.is_last:  # the last stage's forward task runs the backward too
                    self._rate.add(h.batch * h.seq, spent)
                else:
                    _remember(self._fwd_s, h.mb_id, spent)
        except (ValueError, RuntimeError) as e:  # RequestError, CodecError; RuntimeError: e.g. CUDA OOM
            compute.drop(h.mb_id)
            if not isinstance(e, RequestError):
                logger.exception("forward of %s failed on stage %d", h.mb_id, compute.stage)
            reason = str(e) if isinstance(e, RequestError) else f"compute error: {type(e).__name__}: {e}"
            self._outbox.report_failed(
                h, stage=compute.stage, peer=self.peer_id, reason=reason, failure=_failure_of(e)
            )
        finally:
            self._outbox.unhold(h.mb_id)

    def _run_forward(
        self,
        compute: StageCompute,
        h: ForwardHeader,
        x: torch.Tensor,
        tokens: torch.Tensor,
        targets: torch.Tensor | None,
        waited: float,
    ) -> None:
        s = compute.stage
        if self.config.slowdown_s > 0:
            time.sleep(self.config.slowdown_s)  # the documented artificial straggler delay
        count = h.counted_from < 0 or s < h.counted_from  # a retry's gradient is added once per stage
        res = compute.forward(h.mb_id, x, h.mode, targets=targets, tokens=tokens, context=h, count=count)
        self.counters["forwards"] += 1
        stats = dict(h.stats)
        stats[f"fwd_compute_s_{s}"] = res.compute_s
        stats[f"fwd_queue_s_{s}"] = waited
        stats[f"version_{s}"] = float(res.version)
        if compute.is_last and h.mode == "train":  # its backward ran too: see _run_backward
            stats[f"applied_staleness_{s}"] = float(compute.optimizer.staleness)
        if not compute.is_last:
            nxt = h.route[s + 1]
            payload = self._codecs[0].encode(res.output, stream=(nxt, s, "act"))
            stats[f"fwd_bytes_{s}"] = float(len(payload))
            if h.mode == "train" and h.one_report:  # note "one report": they go down with the backward
                _remember(self._fwd_stats, h.mb_id, stats)
                stats = {}
            header = dataclasses.replace(h, stage=s + 1, stats=stats, sent_at=time.time())
            # if the hop fails the route broke downstream: its backward never comes, so free the stash entry
            self._outbox.send(
                self._outbox.deliver(FORWARD, nxt, h, header, payload, drop_from=compute), hold=h.mb_id
            )
            return
        self._finish_last_stage(compute, h, res, stats)

    def _finish_last_stage(
        self, compute: StageCompute, h: ForwardHeader, res: ForwardResult, stats: dict[str, float]
    ) -> None:
        """The last stage: the loss, then the backward (train) or the result (eval/generate)."""
        s = compute.stage

        def report(kind: str) -> Report:
            return Report(
                run_id=h.run_id,
                mb_id=h.mb_id,
                kind=kind,  # type: ignore[arg-type]
                stage=s,
                peer=self.peer_id,
                loss=res.loss,
                n_tokens=res.n_tokens,
                version=res.version,
                stats=stats,
            )

        if h.mode == "train" and h.one_report:  # note "one report": loss and forward stats go down
            self.counters["backwards"] += 1
            self._after_backward(compute, h, res.grad_input, stats, loss=res.loss, n_tokens=res.n_tokens)
        elif h.mode == "train":
            self._outbox.send(self._outbox.report(h.trainer, report("loss")), hold=h.mb_id)
            self.counters["backwards"] += 1
            self._after_backward(compute, h, res.grad_input, {})  # the loss report has the forward stats
        elif h.mode == "eval":
            self._outbox.send(self._outbox.report(h.trainer, report("result")), hold=h.mb_id)
        else:
            from compression import get_codec

            logits = get_codec("none").encode(res.logits_last.float())  # (B, vocab)
            self._outbox.send(self._outbox.report(h.trainer, report("result"), logits), hold=h.mb_id)

    def _backward_task(
        self, compute: StageCompute, h: BackwardHeader, fwd: ForwardHeader, grad: torch.Tensor, waited: float
    ) -> None:
        """Worker thread: run one backward; any failure becomes a ``failed`` report, never silence."""
        try:
            if self._trainers.abandoned(fwd.trainer, h.mb_id):
                compute.drop(h.mb_id)
                return
            t0 = time.perf_counter()
            self._run_backward(compute, h, fwd, grad, waited)
            if self._rate is not None:
                fwd_s = self._fwd_s.pop(h.mb_id, None)
                if fwd_s is not None:
                    self._rate.add(fwd.batch * fwd.seq, fwd_s + time.perf_counter() - t0)
        except (ValueError, RuntimeError) as e:  # VersionEvicted, RequestError, CodecError, CUDA OOM
            if isinstance(e, VersionEvicted):
                self.counters["version_evicted"] += 1
            elif not isinstance(e, RequestError):
                logger.exception("backward of %s failed on stage %d", h.mb_id, compute.stage)
            reason = str(e) if isinstance(e, RequestError) else f"compute error: {type(e).__name__}: {e}"
            self._outbox.report_failed(
                fwd,
                stage=compute.stage,
                peer=self.peer_id,
                reason=reason,
                failure=_failure_of(e),
                counted_from=compute.stage + 1,
            )
        finally:
            self._outbox.unhold(h.mb_id)

    def _run_backward(
        self, compute: StageCompute, h: BackwardHeader, fwd: ForwardHeader, grad: torch.Tensor, waited: float
    ) -> None:
        s = compute.stage
        res = compute.backward(h.mb_id, grad)
        self.counters["backwards"] += 1
        stats = dict(h.stats)
        stats.update(self._fwd_stats.pop(h.mb_id, {}))  # note "one report": this stage's forward stats
        stats[f"bwd_compute_s_{s}"] = res.compute_s
        stats[f"bwd_queue_s_{s}"] = waited
        stats[f"staleness_{s}"] = float(res.staleness)
        # the EMA of versions between forward and the step that applies the gradient, which for a
        # replica includes the wait for its round (note "applied staleness" in peer/compute.py)
        stats[f"applied_staleness_{s}"] = float(compute.optimizer.staleness)
        self._after_backward(compute, fwd, res.grad_input, stats, loss=h.loss, n_tokens=h.n_tokens)

    def _after_backward(
        self,
        compute: StageCompute,
        fwd: ForwardHeader,
        grad_input: torch.Tensor | None,
        stats: dict[str, float],
        *,
        loss: float | None = None,
        n_tokens: int = 0,
    ) -> None:
        """Send the input gradient to the previous stage, or report ``done`` from stage 0. ``loss``: the
        last stage's, on its way to the trainer (note "one report" in swarm/wire/protocol.py)."""
        s = compute.stage
        if s == 0:
            done = Report(
                run_id=fwd.run_id,
                mb_id=fwd.mb_id,
                kind="done",
                stage=0,
                peer=self.peer_id,
                loss=loss,
                n_tokens=n_tokens,
                version=compute.version,
                stats=stats,
            )
            self._outbox.send(self._outbox.report(fwd.trainer, done), hold=fwd.mb_id)
            return
        prev = fwd.route[s - 1]
        payload = self._codecs[1].encode(grad_input, stream=(prev, s, "grad"))
        stats[f"bwd_bytes_{s}"] = float(len(payload))
        header = BackwardHeader(
            run_id=fwd.run_id,
            spec_hash=fwd.spec_hash,
            mb_id=fwd.mb_id,
            stage=s - 1,
            stats=stats,
            loss=loss,
            n_tokens=n_tokens,
        )
        self._outbox.send(
            self._outbox.deliver(BACKWARD, fwd.route[header.stage], fwd, header, payload, drop_from=None),
            hold=fwd.mb_id,
        )


def _failure_of(e: Exception) -> Failure:
    """The failure code of an exception raised by this peer's own forward or backward: a refusal's
    own code (``version_evicted``), else ``error`` (note "failure codes" in swarm/wire/protocol.py)."""
    return (e.failure if isinstance(e, RequestError) else None) or Failure.ERROR
