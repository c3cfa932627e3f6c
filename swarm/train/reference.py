"""The run's model trained in one process, the way its stage peers train it: the yardstick of a swarm.

A swarm exists to train a model as well as ordinary training does. :func:`train_reference` trains the
same model (``swarm.run.model.build_model``: the stages chained, the same initial weights) on the same
micro-batches a trainer with the same seed draws (``TokenData.stream``), with the run's *own*
optimizer: one ``swarm.run.optimizer.StageOptimizer`` per stage, each fed like a stage peer feeds it (the
gradients of ``accumulate`` micro-batches, then a step; clipping and the LR schedule per stage). The
only thing missing is the distribution, so ``swarm held-out loss / reference held-out loss`` at equal
tokens is the price of training through the swarm (1.0 = none).

:func:`held_out_loss` evaluates a model on the fixed, evenly spaced held-out windows of ``TokenData``
(the ones a trainer's evaluation and ``benchmarks/convergence.py`` use).

``swarm demo`` prints its held-out loss next to this reference's; ``benchmarks/single_process.py``
and ``benchmarks/convergence.py`` build on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.func import functional_call

from swarm.run.model import build_model, lm_loss
from swarm.run.spec import RunSpec
from swarm.train.data import TokenData

__all__ = ["StageOptimizers", "held_out_loss", "train_reference"]


class StageOptimizers:
    """The spec's optimizer, one ``StageOptimizer`` per stage of ``model``, driven as stage peers drive
    theirs: each micro-batch's parameter gradients are accumulated, and a stage steps once it holds
    ``accumulate`` (the spec's unless given)."""

    def __init__(self, model: Any, spec: RunSpec, accumulate: int | None = None):
        from swarm.run.optimizer import StageOptimizer

        ocfg = (
            spec.optimizer
            if accumulate is None
            else dataclasses.replace(spec.optimizer, accumulate=accumulate)
        )
        self.stages = list(model.stages)
        self.opts = [StageOptimizer(dict(s.named_parameters()), ocfg) for s in self.stages]
        for stage in self.stages:
            stage.requires_grad_(False)  # the trained tensors are the optimizers' (functional_call)
        self._leaves: list[dict[str, torch.Tensor]] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        self._leaves = []
        x = tokens
        for stage, opt in zip(self.stages, self.opts, strict=True):
            params = {n: t.detach().requires_grad_(True) for n, t in opt.served().items()}
            self._leaves.append(params)
            x = functional_call(stage, params, (x,))
        return x

    def after_backward(self) -> None:
        for opt, params in zip(self.opts, self._leaves, strict=True):
            opt.accumulate({n: p.grad for n, p in params.items()})
            if opt.ready:
                opt.step()

    def load_into_model(self) -> None:
        """Copy each stage's base parameters (what ``swarm export`` writes) into the modules."""
        with torch.no_grad():
            for stage, opt in zip(self.stages, self.opts, strict=True):
                for name, p in stage.named_parameters():
                    p.copy_(opt.params[name])


def train_reference(
    spec: RunSpec,
    data: TokenData,
    *,
    micro_batches: int,
    seed: int,
    on_micro_batch: Callable[[int, float], None] | None = None,
) -> Any:
    """Train ``spec``'s model on the first ``micro_batches`` of ``data.stream(micro_batch_size, seed)``;
    returns the model holding the trained base parameters. ``on_micro_batch(i, loss)`` reports progress."""
    model = build_model(spec)
    opts = StageOptimizers(model, spec)
    stream: Iterator[tuple[torch.Tensor, torch.Tensor]] = data.stream(spec.micro_batch_size, seed=seed)
    model.train()
    for i in range(micro_batches):
        tokens, targets = next(stream)  # (B, T), (B, T)
        loss = lm_loss(opts.forward(tokens), targets)
        loss.backward()
        opts.after_backward()
        if on_micro_batch is not None:
            on_micro_batch(i, float(loss.detach()))
    opts.load_into_model()
    model.eval()
    return model


def held_out_loss(model: Any, data: TokenData, *, batch: int, tokens: int) -> tuple[float, int]:
    """Mean loss of ``model`` (token ids (B, T) -> logits (B, T, V)) on ``data``'s fixed held-out windows:
    ``ceil(tokens / (batch * seq_len))`` micro-batches of ``batch`` windows; returns (loss, tokens used)."""
    n_batches = max(1, -(-tokens // (batch * data.seq_len)))
    total = 0.0
    with torch.no_grad():
        for x, y in data.eval_batches(batch, n_batches):  # (B, T), (B, T)
            total += float(lm_loss(model(x), y))
    return total / n_batches, n_batches * batch * data.seq_len
