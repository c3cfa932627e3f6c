"""Held-out loss of a ``torch.distributed.pipelining`` run between its optimizer steps, on every rank.

The ranks of ``benchmarks/pipelining_baseline.py`` hold one stage each, so the model can only be
evaluated through the pipeline: :func:`pipeline_heldout` runs the fixed held-out micro-batches
(``swarm.train.data.TokenData.eval_batches``: the windows a swarm trainer's evaluation and
``swarm.train.reference.held_out_loss`` use) forward only, stage by stage, with plain point-to-point
sends of fp32 activations (a shape header first, so no rank needs to know another's shapes). The last
rank computes the mean loss (``lm_loss`` per micro-batch, then the mean over micro-batches, as
``held_out_loss`` does) and broadcasts it with the run's verdict, so that every rank stops at the same
step: ``stop`` is true when the loss is at or below ``target`` or when ``give_up`` (decided by rank 0,
e.g. a time cap) is true there.

Every rank must call it at the same steps (a collective). Its time is the caller's to count or leave out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from swarm.run.model import lm_loss

__all__ = ["pipeline_heldout"]


def _send(t: torch.Tensor, dst: int) -> None:
    dist.send(torch.tensor(t.shape, dtype=torch.long), dst)
    dist.send(t.contiguous(), dst)


def _recv(src: int, ndim: int = 3) -> torch.Tensor:
    shape = torch.empty(ndim, dtype=torch.long)
    dist.recv(shape, src)
    buf = torch.empty(tuple(int(v) for v in shape), dtype=torch.float32)
    dist.recv(buf, src)
    return buf


def pipeline_heldout(
    module: torch.nn.Module,
    rank: int,
    world: int,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
    *,
    n_batches: int,
    target: float | None,
    give_up: bool = False,
) -> tuple[float, bool]:
    """(held-out loss, stop) on every rank. ``batches``: the held-out (tokens (B, T), targets (B, T))
    micro-batches, needed on rank 0 (tokens) and the last rank (targets); ``n_batches`` their number
    (every rank needs it). ``target``: stop at or below it (None: never for the loss)."""
    if n_batches < 1:
        raise ValueError(f"n_batches = {n_batches} must be at least 1")
    if rank in (0, world - 1) and (batches is None or len(batches) != n_batches):
        raise ValueError(f"rank {rank} needs the {n_batches} held-out micro-batches, got {batches!r:.80}")
    was_training = module.training
    module.eval()
    total = 0.0
    try:
        with torch.no_grad():
            for i in range(n_batches):
                x = batches[i][0] if rank == 0 else _recv(rank - 1)  # (B, T) ids or (B, T, d)
                out = module(x)
                if rank < world - 1:
                    _send(out.float(), rank + 1)
                else:
                    total += float(lm_loss(out, batches[i][1]))
    finally:
        module.train(was_training)
    # rank 0 decides to give up, the last rank knows the loss: one broadcast each
    verdict = torch.tensor([1.0 if give_up else 0.0])
    dist.broadcast(verdict, 0)
    result = torch.tensor([total / n_batches, 0.0])
    if rank == world - 1:
        reached = target is not None and result[0].item() <= target
        result[1] = 1.0 if (reached or verdict.item() > 0) else 0.0
    dist.broadcast(result, world - 1)
    return float(result[0]), bool(result[1].item() > 0)
