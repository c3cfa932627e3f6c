"""The stage peer's local optimizer: gradient accumulation, clipping, LR schedule, AdamW or delay-aware Nesterov.

Why not ``torch.optim``: weight stashing needs every update to produce *new* parameter tensors (an
in-flight backward still reads the old ones, and a kept autograd graph must not see its leaves
change), while ``torch.optim`` updates in place. The update rules here are the standard ones,
written out of place; ``tests/test_optimizer.py`` checks AdamW against ``torch.optim.AdamW``.

Two parameter sets (note "served weights")
-------------------------------------------
The optimizer owns the *base* parameters ``params`` (what is checkpointed, averaged and sent to
joining peers) and exposes :meth:`served`, the weights forwards and backwards run with. For AdamW
they are the same tensors. For ``nesterov`` they are the look-ahead point::

    served = params + c(tau) * velocity,   c(tau) = mu + mu^2 + ... + mu^(tau+1)

Delay-aware look-ahead (after Ajanthan et al., "Nesterov Method for Asynchronous Pipeline Parallel
Optimization", ICML 2025): a gradient that arrives here was computed on weights ``tau`` local steps
old, and by the time the peer applies it, momentum will have carried the weights further. Plain NAG
evaluates the gradient one momentum step ahead (``c = mu``); with a delay of ``tau`` steps the
weights move by roughly ``mu + ... + mu^(tau+1)`` velocities before that gradient lands, so the
forward looks that far ahead along the momentum. ``tau`` is an exponential moving average of the
measured staleness (versions elapsed between a micro-batch's forward and its backward). With
``tau = 0`` this is exactly NAG in its look-ahead form. The update itself is heavy-ball momentum on
the base parameters: ``v <- mu v - lr (g + wd * params)``; ``params <- params + v``.

Accumulation: gradients of ``accumulate`` micro-batches are summed and then averaged at the step
(the count is taken at backward completion). Clipping is by the global norm of the stage's averaged
gradient. Learning rate: ``OptimizerConfig.lr_at(step)`` (constant or cosine with warmup).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from swarm.spec import OptimizerConfig

__all__ = ["StageOptimizer", "lookahead_coefficient"]

Params = dict[str, torch.Tensor]
_ADAM_EPS = 1e-8
_STALENESS_EMA = 0.9  # weight of the old staleness estimate per backward


def lookahead_coefficient(momentum: float, staleness: float) -> float:
    """``mu + mu^2 + ... + mu^(tau+1)`` for a (possibly fractional) delay ``tau >= 0``."""
    if momentum == 0.0:
        return 0.0
    tau = max(0.0, staleness)
    return momentum * (1.0 - momentum ** (tau + 1.0)) / (1.0 - momentum)


class StageOptimizer:
    """Accumulates gradients of one stage and steps out of place.

    ``params`` maps parameter names to float32 tensors on the compute device. Not thread-safe: the
    owner (``peer/compute.py``) calls it under its weights lock.
    """

    def __init__(self, params: Params, cfg: OptimizerConfig):
        self.cfg = cfg
        self.names = list(params)
        self.params: Params = {n: p.detach().clone() for n, p in params.items()}
        self.grads: Params = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.pending = 0  # micro-batches accumulated since the last step
        self.step_count = 0  # optimizer steps taken (drives the LR schedule)
        self.staleness = 0.0  # EMA of versions elapsed between forward and backward
        self.last_grad_norm = 0.0
        self.clipped_steps = 0
        if cfg.name == "adamw":
            self.state: dict[str, Params] = {
                "exp_avg": {n: torch.zeros_like(p) for n, p in self.params.items()},
                "exp_avg_sq": {n: torch.zeros_like(p) for n, p in self.params.items()},
            }
        else:
            self.state = {"velocity": {n: torch.zeros_like(p) for n, p in self.params.items()}}
        self._served = self._compute_served()

    # ---- gradients ----------------------------------------------------------------------------

    def accumulate(self, grads: Params, *, staleness: int = 0) -> None:
        """Add one micro-batch's parameter gradients (missing names count as zero)."""
        with torch.no_grad():
            for name, g in grads.items():
                if g is not None:
                    self.grads[name].add_(g.to(self.grads[name].dtype))
        self.pending += 1
        self.staleness = _STALENESS_EMA * self.staleness + (1.0 - _STALENESS_EMA) * float(staleness)

    @property
    def ready(self) -> bool:
        """True once ``accumulate`` micro-batches have been added since the last step."""
        return self.pending >= self.cfg.accumulate

    def zero_grad(self) -> None:
        for g in self.grads.values():
            g.zero_()
        self.pending = 0

    # ---- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> Params:
        """Apply the accumulated gradients; return the new served weights (new tensors)."""
        if self.pending == 0:
            raise RuntimeError("step() without accumulated gradients")
        grads = {n: g / self.pending for n, g in self.grads.items()}  # average over micro-batches
        total_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        self.last_grad_norm = total_norm
        clip = self.cfg.clip_norm
        if clip is not None and total_norm > clip:
            scale = clip / (total_norm + 1e-6)
            grads = {n: g * scale for n, g in grads.items()}
            self.clipped_steps += 1
        lr = self.cfg.lr_at(self.step_count)
        if self.cfg.name == "adamw":
            self._adamw(grads, lr)
        else:
            self._nesterov(grads, lr)
        self.step_count += 1
        self.zero_grad()
        self._served = self._compute_served()
        return self._served

    def _adamw(self, grads: Params, lr: float) -> None:
        beta1, beta2 = self.cfg.betas
        t = self.step_count + 1
        bc1, bc2 = 1.0 - beta1**t, 1.0 - beta2**t
        wd = self.cfg.weight_decay
        new = {}
        for n, p in self.params.items():
            m, v, g = self.state["exp_avg"][n], self.state["exp_avg_sq"][n], grads[n]
            m.mul_(beta1).add_(g, alpha=1.0 - beta1)  # moments are private: in place is safe
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            denom = (v / bc2).sqrt_().add_(_ADAM_EPS)
            # decoupled weight decay, as torch.optim.AdamW: p <- p * (1 - lr * wd) - lr * m_hat / denom
            base = p * (1.0 - lr * wd) if wd else p
            new[n] = base.addcdiv(m, denom, value=-lr / bc1)  # out of place: a new tensor
        self.params = new

    def _nesterov(self, grads: Params, lr: float) -> None:
        mu, wd = self.cfg.momentum, self.cfg.weight_decay
        new = {}
        for n, p in self.params.items():
            g = grads[n] + wd * p if wd else grads[n]
            vel = self.state["velocity"][n]
            vel.mul_(mu).add_(g, alpha=-lr)
            new[n] = p + vel
        self.params = new

    def _compute_served(self) -> Params:
        if self.cfg.name == "adamw":
            return self.params
        c = lookahead_coefficient(self.cfg.momentum, self.staleness)
        vel = self.state["velocity"]
        return {n: p + c * vel[n] for n, p in self.params.items()}

    def served(self) -> Params:
        """The weights forwards run with (new tensors after every change; never mutated)."""
        return self._served

    @torch.no_grad()
    def shift(self, deltas: list[torch.Tensor], averaged: list[torch.Tensor] | None = None) -> Params:
        """Add ``deltas`` (in :meth:`state_tensors` order) to parameters and slots; return new served weights.

        Used to apply an averaging round as ``current + (averaged - sent)``, which keeps the local
        steps taken while the round ran. Parameters get new tensors (kept versions stay intact).
        Accumulated gradients are kept.

        ``exp_avg_sq`` is floored at ``min(current, averaged)`` (at 0 without ``averaged``): it decays
        between the snapshot and the apply, so ``current + (averaged - sent)`` can land near or below
        0, and a second moment near 0 turns the next update into ``m / eps`` -- a demo replica blew up
        that way. Both floor terms are genuine second moments, and when no step happened during the
        round (``current == sent``) the result is exactly ``averaged``, so replicas still agree.
        """
        if len(deltas) != len(self.state_tensors()):
            raise ValueError(f"got {len(deltas)} deltas, expected {len(self.state_tensors())}")
        k = len(self.names)
        device = next(iter(self.params.values())).device
        self.params = {n: self.params[n] + deltas[i].to(device) for i, n in enumerate(self.names)}
        for j, slot in enumerate(sorted(self.state)):
            for i, n in enumerate(self.names):
                idx = (j + 1) * k + i
                t = self.state[slot][n]
                if slot != "exp_avg_sq":
                    t.add_(deltas[idx].to(device))
                    continue
                floor = (
                    torch.zeros_like(t) if averaged is None else torch.minimum(t, averaged[idx].to(device))
                )
                t.add_(deltas[idx].to(device))
                torch.maximum(t, floor.clamp_(min=0.0), out=t)
        self._served = self._compute_served()
        return self._served

    # ---- state for checkpoints, downloads and averaging --------------------------------------

    def state_names(self) -> list[str]:
        """Names of :meth:`state_tensors`, in order: ``param/<name>`` then ``<slot>/<name>``."""
        out = [f"param/{n}" for n in self.names]
        for slot in sorted(self.state):
            out += [f"{slot}/{n}" for n in self.names]
        return out

    def state_tensors(self) -> list[torch.Tensor]:
        """Base parameters and optimizer slots, in :meth:`state_names` order (live references)."""
        out = [self.params[n] for n in self.names]
        for slot in sorted(self.state):
            out += [self.state[slot][n] for n in self.names]
        return out

    def metadata(self) -> dict[str, Any]:
        return {"step_count": self.step_count, "staleness": self.staleness, "optimizer": self.cfg.name}

    @torch.no_grad()
    def load(self, tensors: list[torch.Tensor], meta: dict[str, Any]) -> None:
        """Replace parameters and optimizer state by ``tensors`` (as from :meth:`state_tensors`).

        Shapes are checked first, so a mismatching state changes nothing (raises ``ValueError``).
        """
        current = self.state_tensors()
        names = self.state_names()
        if len(tensors) != len(current):
            raise ValueError(f"optimizer state holds {len(tensors)} tensors, expected {len(current)}")
        for name, new, old in zip(names, tensors, current, strict=True):
            if tuple(new.shape) != tuple(old.shape):
                raise ValueError(
                    f"state tensor {name} has shape {tuple(new.shape)}, expected {tuple(old.shape)}"
                )
            if not torch.isfinite(new).all():
                raise ValueError(f"state tensor {name} holds NaN or Inf")
        if meta.get("optimizer", self.cfg.name) != self.cfg.name:
            raise ValueError(
                f"state is for optimizer {meta.get('optimizer')!r}, this run uses {self.cfg.name!r}"
            )
        k = len(self.names)
        device = current[0].device
        self.params = {
            n: tensors[i].detach().to(device, torch.float32).clone() for i, n in enumerate(self.names)
        }
        for j, slot in enumerate(sorted(self.state)):
            block = tensors[(j + 1) * k : (j + 2) * k]
            self.state[slot] = {
                n: t.detach().to(device, torch.float32).clone()
                for n, t in zip(self.names, block, strict=True)
            }
        self.step_count = int(meta.get("step_count", 0))
        self.staleness = float(meta.get("staleness", 0.0))
        self.zero_grad()
        self._served = self._compute_served()
