"""A torch pipelining stage module that can emulate its compute and run on an accelerator.

:class:`BusyStage` wraps one stage of ``swarm.run.model.build_stage`` for
``benchmarks/pipelining_baseline.py``:

- **emulated compute** (``emulate_s = (F, B)``): after the real forward, sleep until the micro-batch
  has occupied the stage ``F`` seconds; after the real backward (its last parameter gradient), until
  ``B`` seconds. The same rule as a stage peer's (note "emulated compute" in ``peer/compute.py``),
  so ``benchmarks/bubbles.py`` compares schedules, not machines: sleeping leaves the CPU free, as a
  GPU kernel would, and a synchronous schedule's bubbles stay bubbles on a shared CPU.
- **device** (``cuda``, ``mps``): the stage computes there, under the spec's autocast, while what
  crosses the pipeline stays float32 on the host (pinned copies in on CUDA). gloo moves host tensors
  only and NCCL refuses several ranks on one GPU, so this is how torch pipelining shares one GPU
  between its ranks -- the same host round trip a stage peer's activations take.
- **busy seconds**: ``busy_s`` adds up the time forwards and backwards held the stage (real compute,
  copies and emulated sleep), the baseline's own utilisation count.
"""

from __future__ import annotations

import contextlib
import time

import torch

__all__ = ["BusyStage"]


class _BackwardStarts(torch.autograd.Function):
    """Identity on the stage's output whose backward runs first of the stage's: it starts the clock."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, owner: BusyStage) -> torch.Tensor:  # type: ignore[override]
        ctx.owner = owner
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        owner = ctx.owner
        owner._backward_started = time.perf_counter()
        owner._grads_left = len(owner._params)  # a partial backward before (shape inference) must not count
        return grad, None


class BusyStage(torch.nn.Module):
    """``inner`` on ``device``, float32 host tensors in and out, optional emulated busy time."""

    def __init__(
        self,
        inner: torch.nn.Module,
        *,
        device: torch.device | str = "cpu",
        autocast: torch.dtype | None = None,
        emulate_s: tuple[float, float] | None = None,
    ):
        super().__init__()
        self.device = torch.device(device)
        self.inner = inner.to(self.device)
        self.autocast = autocast
        self.emulate_s = emulate_s
        self.busy_s = 0.0
        self._backward_started: float | None = None
        self._params = [p for p in self.inner.parameters() if p.requires_grad]
        self._grads_left = len(self._params)
        for p in self._params:  # the last parameter gradient of a backward ends the stage's backward
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _in(self, x: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda" and not x.requires_grad:  # token ids: a pinned copy, asynchronous
            return x.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device)  # activations: autograd carries their gradient back to the host

    def _hold(self, since: float, seconds: float) -> None:
        left = seconds - (time.perf_counter() - since)
        if left > 0:
            time.sleep(left)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:  # torch's shape inference, when it runs on meta tensors
            return self.inner(x)
        t0 = time.perf_counter()
        ctx = (
            torch.autocast(self.device.type, dtype=self.autocast)
            if self.autocast is not None
            else contextlib.nullcontext()
        )
        with ctx:
            out = self.inner(self._in(x))
        out = out.float().to("cpu")  # waits for the device: the stage's real forward is done here
        if self.emulate_s is not None:
            self._hold(t0, self.emulate_s[0])
        self.busy_s += time.perf_counter() - t0
        return _BackwardStarts.apply(out, self) if out.requires_grad else out

    def _on_grad(self, _param: torch.Tensor) -> None:
        self._grads_left -= 1
        if self._grads_left > 0:
            return
        since, self._backward_started = self._backward_started, None
        if since is None:  # a backward that did not start at our output (none in a pipeline schedule)
            return
        if self.device.type == "cuda":  # the gradients are computed when the kernels are done
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()
        if self.emulate_s is not None:
            self._hold(since, self.emulate_s[1])
        self.busy_s += time.perf_counter() - since
