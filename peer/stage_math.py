"""``StageModule``: how one stage's module runs on the tensors of a weight version. Holds no weights.

The module is only a structure for ``torch.func.functional_call``: ``StageCompute`` (peer/compute.py)
keeps the weight versions, the stash and the optimizer, and calls this with the tensors of the version
a micro-batch uses. Here: the device and autocast, the stage boundary (``swarm/run/subspace.py``: what
crosses it is ``(B, T, width)``, subspace coefficients or the hidden state itself, applied on the
compute device), and the forward and backward math. No locks: nothing here is shared state.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.func import functional_call

from peer.stash import StashEntry
from swarm.errors import RequestError
from swarm.run.model import autocast_dtype, build_stage, lm_loss
from swarm.run.spec import RunSpec

__all__ = ["ForwardResult", "Mode", "Params", "StageModule"]

Mode = Literal["train", "eval", "generate"]
Params = dict[str, torch.Tensor]


@dataclass
class ForwardResult:
    """What a forward produced. ``output``: what crosses the boundary to the next stage, ``(B, T, width)``
    float32 on CPU (the hidden state, or its subspace coefficients; not on the last stage).

    Last stage: ``loss`` (train/eval), ``logits_last`` ``(B, vocab)`` float32 (generate), and in train
    mode ``grad_input`` ``(B, T, width)`` (None when the stage is also stage 0) plus ``stepped``.
    """

    version: int
    compute_s: float
    output: torch.Tensor | None = None
    loss: float | None = None
    n_tokens: int = 0
    logits_last: torch.Tensor | None = None
    grad_input: torch.Tensor | None = None
    stepped: bool = False


class StageModule:
    """The stage's module, boundary and device: pure functions of (weights, inputs)."""

    def __init__(
        self,
        spec: RunSpec,
        stage: int,
        *,
        device: torch.device | str = "cpu",
        initial: dict[str, torch.Tensor] | None = None,
    ):
        self.spec = spec
        self.stage = stage
        self.device = torch.device(device)
        self.recompute = spec.optimizer.recompute
        self.module = build_stage(spec, stage, device=self.device, weights=initial)
        self.module.requires_grad_(False)
        self.is_first, self.is_last = self.module.is_first, self.module.is_last
        self.autocast = autocast_dtype(spec, self.device)

    @functools.cached_property
    def boundary(self) -> Any:
        """What crosses a stage boundary (see swarm/run/subspace.py): subspace coefficients (B, T, k) in a
        subspace-constrained run, the hidden state itself otherwise. Applied on the compute device. Built
        on first use, once the optimizer took the weights and ``free_weights`` ran (``StageCompute``), so
        that building a stage holds one copy of its weights at a time."""
        from swarm.run.subspace import make_boundary

        return make_boundary(self.spec, self.device)

    @property
    def width(self) -> int:
        return self.boundary.width

    def parameters(self) -> Params:
        """The module's own weights (the initial ones), for the optimizer to copy."""
        return dict(self.module.named_parameters())

    def free_weights(self) -> None:
        """The module is only a structure for functional_call from here on: free its own weights."""
        for p in self.module.parameters():
            p.data = torch.empty(0, device=self.device)

    def _autocast(self) -> Any:
        if self.autocast is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast)

    def to_device(self, x: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            # pinned host memory lets the copy run asynchronously with respect to the host
            return x.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device)

    def run(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            return functional_call(self.module, params, (x,))

    def tokens(self, tokens: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """Token ids for the boundary; only a subspace boundary reads them."""
        if tokens is None:
            if self.boundary.needs_tokens:
                raise RequestError("this run's subspace boundary needs the micro-batch's token ids")
            return like.new_zeros(like.shape[:2], dtype=torch.long)  # unused by the identity boundary
        return tokens.to(self.device)

    def decode_input(self, x: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.width:
            raise RequestError(
                f"stage {self.stage} takes (B, T, {self.width}) from the previous stage, got {tuple(x.shape)}"
            )
        return self.boundary.decode_activation(x, self.tokens(tokens, x))

    def encode_grad(self, grad_input: torch.Tensor) -> torch.Tensor:
        """Input gradient (B, T, C) -> what goes back to the previous stage (B, T, width), float32 CPU."""
        return self.boundary.encode_grad(grad_input.detach()).float().cpu()

    def forward_graph(self, params: Params, x: torch.Tensor, train: bool) -> tuple[torch.Tensor, Any]:
        """The stage's output, and in train mode without ``recompute`` the graph its backward needs."""
        if not train or self.recompute:
            with torch.no_grad():
                return self.run(params, x), None
        leaves = {n: p.detach().requires_grad_(True) for n, p in params.items()}
        x_leaf = x.detach().requires_grad_(True) if x.is_floating_point() else None
        with torch.enable_grad():
            out = self.run(leaves, x if x_leaf is None else x_leaf)
        return out, (out, x_leaf, leaves)

    def forward_result(
        self,
        out: torch.Tensor,
        version: int,
        mode: Mode,
        targets: torch.Tensor | None,
        tokens: torch.Tensor | None,
    ) -> ForwardResult:
        """What leaves the stage: the loss or last logits on the last stage, else what crosses the boundary."""
        result = ForwardResult(version=version, compute_s=0.0)
        if self.is_last:
            logits = out.float()  # (B, T, vocab)
            if targets is not None:
                result.loss = float(lm_loss(logits, targets.to(self.device)))
                result.n_tokens = int(targets.numel())
            if mode == "generate":
                result.logits_last = logits[:, -1, :].detach().cpu()  # (B, vocab)
        else:
            sent = self.boundary.encode_activation(out.detach(), self.tokens(tokens, out))
            result.output = sent.float().cpu()  # (B, T, width)
        return result

    def loss_grads(
        self, params: Params, x: torch.Tensor, targets: torch.Tensor
    ) -> tuple[float, Params, torch.Tensor | None]:
        """The last stage's train step math: the loss, the parameter gradients and the input gradient
        ``(B, T, width)`` (None when the stage is also stage 0), in one pass."""
        leaves = {n: p.detach().requires_grad_(True) for n, p in params.items()}
        x_leaf = x.detach().requires_grad_(True) if x.is_floating_point() else None
        with torch.enable_grad():
            logits = self.run(leaves, x if x_leaf is None else x_leaf)  # (B, T, vocab)
            loss = lm_loss(logits, targets.to(self.device))
            inputs = list(leaves.values()) + ([x_leaf] if x_leaf is not None else [])
            grads = torch.autograd.grad(loss, inputs, allow_unused=True)
        param_grads = dict(zip(leaves, grads[: len(leaves)], strict=True))
        grad_input = self.encode_grad(grads[-1]) if x_leaf is not None else None
        return float(loss.detach()), param_grads, grad_input

    def backward(
        self, entry: StashEntry, params: Params, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, Params]:
        """Input gradient ``(B, T, width)`` (None on stage 0) and parameter gradients for one stashed forward."""
        if entry.graph is not None:
            out, x_leaf, leaves = entry.graph
        else:  # recompute the forward with the stashed version's weights
            leaves = {n: p.detach().requires_grad_(True) for n, p in params.items()}
            x = entry.inputs
            x_leaf = x.detach().requires_grad_(True) if x.is_floating_point() else None
            with torch.enable_grad():
                out = self.run(leaves, x if x_leaf is None else x_leaf)
        if tuple(grad_output.shape) != entry.output_shape:
            raise RequestError(
                f"gradient of shape {tuple(grad_output.shape)} does not match what this stage sent, "
                f"{entry.output_shape}, for micro-batch {entry.mb_id!r}"
            )
        grad_output = self.boundary.decode_grad(self.to_device(grad_output))  # (B, T, width) -> (B, T, C)
        inputs = list(leaves.values()) + ([x_leaf] if x_leaf is not None else [])
        grads = torch.autograd.grad(out, inputs, grad_outputs=grad_output.to(out.dtype), allow_unused=True)
        param_grads = dict(zip(leaves, grads[: len(leaves)], strict=True))
        grad_input = self.encode_grad(grads[-1]) if x_leaf is not None else None
        return grad_input, param_grads
