"""The stage peer's local optimizer: gradient accumulation, clipping, LR schedule, AdamW, delay-aware
Nesterov or Muon.

Why not a ``torch.optim`` optimizer: weight stashing needs every update to produce *new* parameter
tensors (an in-flight backward still reads the old ones, and a kept autograd graph must not see its
leaves change), while ``torch.optim`` updates in place. AdamW therefore runs torch's own functional
update (``torch.optim.adamw.adamw``, fused where the device has the kernel) on copies of the
parameters; Nesterov and Muon are written out here, out of place. ``tests/test_optimizer.py`` checks
AdamW against ``torch.optim.AdamW`` (accumulated, clipped, fused and not) and Nesterov against SGD.

One scale (note "one scale"): the gradient of a step is the accumulated *sums* times one scalar, the
mean over the step's micro-batches and the clipping factor together; the fused kernel takes it as its
``grad_scale`` and the other rules multiply as they read, so no scaled copy of every gradient is made.
On ``examples/bench.yaml`` this and the fused kernel took the peer's compute path from 1.039x the CPU
per micro-batch of plain torch (a module, ``backward``, the default ``torch.optim.AdamW``) to 0.985-0.988x
(``python -m benchmarks.stage_cost``, BENCHMARKS.md "Where the cycles go").

Blank accumulators (note "blank accumulators"): a step does not zero the gradient accumulators; it
marks them blank, and the next micro-batch's gradient is *copied* into a blank one instead of added to
zeros, as ``backward`` takes over the first ``.grad`` in plain torch. Anything that reads every
accumulator (the step, handing gradients to a round, putting them back) first writes the zeros of those
still blank (a parameter no micro-batch reached). Saves a pass over every gradient per step.

Two parameter sets (note "served weights")
-------------------------------------------
The optimizer owns the *base* parameters ``params`` (what is checkpointed and sent to
joining peers) and exposes :meth:`served`, the weights forwards and backwards run with. For AdamW
and Muon they are the same tensors unless ``lookahead`` is on (note "extrapolated weights"). For
``nesterov`` they are the look-ahead point::

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

Extrapolated weights (note "extrapolated weights")
--------------------------------------------------
AdamW and Muon get the same idea in the form of weight prediction (as SpecTrain, Chen et al. 2018,
and PipeMare, Yang et al. 2021, do for pipelines): with ``lookahead`` = ``k`` > 0 (muon's default 1)::

    served = params + k * tau * delta,     delta = the last step's change of params

A micro-batch forwarded now is applied ``tau`` steps later, to weights about ``tau`` such steps
further on, so its gradient is taken at that predicted point. ``tau`` is the same staleness EMA as
above: 0 in sync mode and on the last stage (served = params, no extra copy), about
``(in flight - 1) / accumulate`` on the stages before. ``delta`` is one extra copy of the stage's
parameters, kept only while the look-ahead is on; it is not part of the state (a loaded or newly
joined peer starts without it, i.e. without look-ahead until its first step). Measured with
``benchmarks/async_replay.py`` (BENCHMARKS.md, "Async replay"; demo shape, 300 micro-batches, one
seed): stale by one version AdamW's async/sync went from 1.101 to 1.050 with it and Muon's from 1.088
to 1.060; at the simulated schedule's ~0.5 version, 1.055 to 1.023 and 1.018 to 0.998. ``k`` = 0.7
was no better than 1 over three seeds (600 micro-batches), 1.4 and 2 were worse on one.

Muon (note "muon")
------------------
``name: muon`` (Jordan et al. 2024, "Muon: MomentUm Orthogonalized by Newton-schulz") updates the 2-D
weight matrices of the transformer blocks (:func:`is_muon_matrix`) and leaves everything else
(embedding, LM head, norms, anything not 2-D) to the AdamW code above, with ``lr`` and ``betas``. Per
matrix ``W`` (rows x cols) with gradient ``G`` and momentum ``mu`` (``muon_momentum``)::

    M <- mu M + (1 - mu) G                 # the slot "muon_momentum" (an EMA, at gradient scale)
    U  = (1 - mu) G + mu M                 # Nesterov form
    O  = NS5(U)                            # ~ the orthogonal factor U V^T of U's SVD
    W <- W (1 - lr_m wd) - lr_m * 0.2 sqrt(max(rows, cols)) * O

NS5 is five steps of the quintic Newton-Schulz iteration with Jordan's coefficients (3.4445, -4.7750,
2.0315) on ``U / ||U||_F``, done on the wide orientation (rows <= cols); it pushes the singular values
into about 0.68..1.13 rather than exactly to 1, which is all the method needs. It runs in bfloat16 on
CUDA (as Jordan's code) and in float32 elsewhere (CPUs have slow bf16 matmuls).

Scale convention: ``0.2 sqrt(max(rows, cols))`` (Liu et al. 2025, "Muon is Scalable for LLM
Training") makes the update's RMS 0.2 per element for every shape, about the RMS of an AdamW update,
so ``muon_lr`` is on AdamW's scale (default 3 x ``lr``) instead of Jordan's ``max(1, rows/cols)^0.5``
with its own lr around 0.02 (0.02 there is about 0.009 here for square matrices). ``lr_m`` follows the
same warmup and schedule as ``lr`` (``OptimizerConfig.muon_lr_at``).

Subspace models (swarm/run/subspace.py): a ``SubspaceLinear``'s trained parameter is ``coef`` = A in
W = U A, and since U has orthonormal columns, orthogonalising A's gradient (``U^T dL/dW``) gives the
same update of W as orthogonalising dL/dW projected into span(U); so ``coef`` inside a block is a
matrix like any other. The ``SubspaceEmbedding``'s ``coef`` is an embedding and stays with AdamW.

Slots exist for some parameters only: AdamW's ``exp_avg``/``exp_avg_sq`` for the AdamW part, and
``muon_momentum`` for the matrices. :meth:`StageOptimizer.state_names` lists each slot's parameters in
parameter order, so ``adamw`` and ``nesterov`` keep exactly the layout they always had.

Accumulation: gradients of ``accumulate`` micro-batches are summed and then averaged at the step
(the count is taken at backward completion). Clipping is by the global norm of the stage's averaged
gradient. Learning rate: ``OptimizerConfig.lr_at(step)`` (constant or cosine with warmup).

Token-weighted steps (note "token-weighted steps"): a step may combine fewer than ``accumulate``
micro-batches -- a replica round where a replica had nothing to give (peer/replicas.py, "fill in"), a
replica stepping alone with what it holds, a peer flushing before it leaves. Such a step takes
``weight = count / accumulate`` of the scheduled learning rate (``step(weight=)``), so the learning
rate summed over a run's steps stays that of one process taking a full step every ``accumulate``
micro-batches, however the micro-batches were grouped. A step is never above the schedule's rate
(weight at most 1), so a round that combined more than ``accumulate`` keeps the full rate.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch.optim.adamw import adamw as _torch_adamw

from swarm.run.spec import OptimizerConfig

__all__ = ["StageOptimizer", "is_muon_matrix", "lookahead_coefficient", "newton_schulz"]

Params = dict[str, torch.Tensor]
_ADAM_EPS = 1e-8
_STALENESS_EMA = 0.9  # weight of the old staleness estimate per backward
_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic (note "muon")
_NS_STEPS = 5
_NS_EPS = 1e-7
_MUON_RMS = 0.2  # per-element RMS of a Muon update before lr: an AdamW update's (note "muon")
_FUSED_DEVICES = frozenset({"cpu", "cuda", "mps"})  # where torch has a fused AdamW kernel (float32)


def is_muon_matrix(name: str, shape: tuple[int, ...] | torch.Size) -> bool:
    """Whether Muon updates parameter ``name``: a 2-D weight inside a transformer block (``layers.*``).

    Embedding (``embed.*``), LM head (``head.*``), norms and anything not 2-D go to AdamW.
    """
    return name.startswith("layers.") and len(shape) == 2


def newton_schulz(g: torch.Tensor, steps: int = _NS_STEPS) -> torch.Tensor:
    """An approximate orthogonal factor of the 2-D ``g`` (quintic Newton-Schulz, note "muon"); new tensor.

    Float32 result; the iteration runs in bfloat16 on CUDA, float32 elsewhere.
    """
    a, b, c = _NS_COEFFICIENTS
    x = g.to(torch.bfloat16 if g.is_cuda else torch.float32)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.mT  # work on the wide orientation: x @ x^T is the small (rows, rows) Gram matrix
    x = x / (x.norm() + _NS_EPS)  # singular values into [0, 1], where the iteration converges
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    if tall:
        x = x.mT
    return x.float()


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
        self.grads: Params = {n: torch.empty_like(p) for n, p in self.params.items()}
        # Note "blank accumulators": the names whose accumulator counts as zero whatever it holds; the
        # next micro-batch's gradient is copied in (no zeroing pass per step, no add onto zeros).
        self._blank: set[str] = set(self.names)
        self.pending = 0  # micro-batches accumulated since the last step
        self.step_count = 0  # optimizer steps taken (drives the LR schedule)
        self.ns_steps = _NS_STEPS  # Newton-Schulz iterations per Muon step (a preview's twin takes fewer)
        self.staleness = 0.0  # EMA of versions elapsed between forward and backward
        self.last_grad_norm = 0.0
        self.clipped_steps = 0
        self.lookahead = cfg.lookahead_scale  # note "extrapolated weights"; 0 = off
        self._delta: Params | None = None  # the last step's change of params (look-ahead only)
        self._fused: bool | None = None  # whether torch's fused AdamW kernel ran here (None: not tried yet)
        # The parameters Muon updates; empty for adamw and nesterov.
        self.matrices = (
            [n for n, p in self.params.items() if is_muon_matrix(n, p.shape)] if cfg.name == "muon" else []
        )
        muon = frozenset(self.matrices)
        adam = [n for n in self.names if n not in muon]
        slots: dict[str, list[str]]  # slot -> the parameters that have it, in parameter order
        if cfg.name == "nesterov":
            slots = {"velocity": self.names}
        else:
            slots = {"exp_avg": adam, "exp_avg_sq": adam}
            if self.matrices:
                slots["muon_momentum"] = self.matrices
        self.state: dict[str, Params] = {
            slot: {n: torch.zeros_like(self.params[n]) for n in names} for slot, names in slots.items()
        }
        self._served = self._compute_served()

    # ---- gradients ----------------------------------------------------------------------------

    def accumulate(self, grads: Params, *, staleness: int | None = 0) -> None:
        """Add one micro-batch's parameter gradients (missing names count as zero). ``staleness``: the
        versions between its forward and the step that will apply it, when known now (None: told
        later, :meth:`note_staleness`)."""
        with torch.no_grad():
            for name, g in grads.items():
                if g is None:
                    continue
                if name in self._blank:
                    self.grads[name].copy_(g)  # converts the dtype as add_ would
                    self._blank.discard(name)
                else:
                    self.grads[name].add_(g.to(self.grads[name].dtype))
        self.pending += 1
        if staleness is not None:
            self.note_staleness(float(staleness), 1)

    def note_staleness(self, staleness: float, count: int) -> None:
        """``count`` micro-batches were (or will be) applied ``staleness`` versions after their forward,
        on average: the EMA that drives the look-ahead moves as if each had been noted alone."""
        keep = _STALENESS_EMA ** max(0, count)
        # max(0): a gradient taken on speculative weights (peer/compute.py, note "speculative rounds")
        # counts one version ahead; when its round fails it is applied "before" its forward
        self.staleness = keep * self.staleness + (1.0 - keep) * max(0.0, float(staleness))

    @property
    def ready(self) -> bool:
        """True once ``accumulate`` micro-batches have been added since the last step."""
        return self.pending >= self.cfg.accumulate

    def zero_grad(self) -> None:
        """Forget the accumulated gradients (lazily: note "blank accumulators")."""
        self._blank = set(self.grads)
        self.pending = 0

    def _fill_blanks(self) -> None:
        """Write the zeros of the accumulators still blank, before anything reads all of them."""
        with torch.no_grad():
            for name in self._blank:
                self.grads[name].zero_()
        self._blank = set()

    # ---- gradients combined across replicas (peer/replicas.py) -------------------------------

    def take_gradients(self) -> tuple[list[torch.Tensor], int]:
        """Hand over the accumulated gradient *sums* (in ``names`` order) and their micro-batch count;
        accumulation restarts from zero (new buffers, so backwards arriving meanwhile are kept apart)."""
        self._fill_blanks()
        taken, count = [self.grads[n] for n in self.names], self.pending
        self.grads = {n: torch.empty_like(g) for n, g in self.grads.items()}
        self.zero_grad()
        return taken, count

    def give_back_gradients(self, sums: list[torch.Tensor], count: int) -> None:
        """Undo :meth:`take_gradients` (a round that did not complete): add the sums back."""
        self._fill_blanks()
        with torch.no_grad():
            for n, g in zip(self.names, sums, strict=True):
                self.grads[n].add_(g.to(self.grads[n].device, self.grads[n].dtype))
        self.pending += count

    def step_with(self, mean_grads: list[torch.Tensor], *, weight: float = 1.0) -> Params:
        """One step with the given *mean* gradient (the replicas' combined one) instead of the local
        accumulator, which is left as it is (backwards that arrived during the round stay in it);
        ``weight`` as in :meth:`step`."""
        kept, kept_count, kept_blank = self.grads, self.pending, self._blank
        self._blank = set()  # the given mean is whole
        device = next(iter(self.params.values())).device
        self.grads = {
            n: g.to(device, torch.float32, copy=True) for n, g in zip(self.names, mean_grads, strict=True)
        }  # copies: step() zeroes them
        self.pending = 1  # step() divides by pending: the gradient is already a mean
        try:
            return self.step(weight=weight)
        finally:
            self.grads, self.pending, self._blank = kept, kept_count, kept_blank

    def twin(self, *, ns_steps: int | None = None) -> StageOptimizer:
        """A copy that can step without changing this optimizer: its own optimizer state (cloned), the
        same immutable parameter tensors. ``twin().step_with(mean)`` previews the weights a round with
        that mean gradient would serve (peer/compute.py, note "speculative rounds"); ``ns_steps`` makes
        the twin's Muon steps cheaper (fewer Newton-Schulz iterations: an approximate preview)."""
        if ns_steps is not None and ns_steps < 1:
            raise ValueError(f"ns_steps={ns_steps!r}: a Muon step needs at least one Newton-Schulz iteration")
        twin = copy.copy(self)
        twin.state = {slot: {n: t.clone() for n, t in slots.items()} for slot, slots in self.state.items()}
        twin.grads = {}  # step_with replaces it; nothing of ours is zeroed
        twin._blank = set()
        if ns_steps is not None:
            twin.ns_steps = ns_steps
        return twin

    # ---- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, *, weight: float = 1.0) -> Params:
        """Apply the accumulated gradients; return the new served weights (new tensors).

        ``weight`` in (0, 1] scales this step's learning rate (note "token-weighted steps"): a step
        on fewer than ``accumulate`` micro-batches moves the weights that fraction of a full step."""
        if self.pending == 0:
            raise RuntimeError("step() without accumulated gradients")
        if not 0.0 < weight <= 1.0:
            raise ValueError(
                f"step weight {weight!r} must be in (0, 1]: the fraction of a full step's micro-batches"
            )
        # Note "one scale": the step's gradient is the accumulated sums times one scalar (the mean over
        # micro-batches and the clipping factor together), applied where each rule reads the gradient,
        # never as a scaled copy of every gradient first.
        self._fill_blanks()  # a parameter no micro-batch reached has a zero gradient
        sums = self.grads
        total_norm = float(torch.nn.utils.get_total_norm(list(sums.values()))) / self.pending
        self.last_grad_norm = total_norm  # of the mean gradient
        scale = 1.0 / self.pending
        clip = self.cfg.clip_norm
        if clip is not None and total_norm > clip:
            scale *= clip / (total_norm + 1e-6)
            self.clipped_steps += 1
        lr = weight * self.cfg.lr_at(self.step_count)
        before = self.params
        if self.cfg.name == "nesterov":
            self._nesterov(sums, scale, lr)
        else:
            self._adamw(sums, scale, lr)  # every parameter of adamw; the non-matrices of muon
            if self.matrices:
                self._muon(sums, scale, weight * self.cfg.muon_lr_at(self.step_count))
        if self.lookahead:
            self._delta = {n: p - before[n] for n, p in self.params.items()}
        self.step_count += 1
        self.zero_grad()
        self._served = self._compute_served()
        return self._served

    def _adamw(self, sums: Params, scale: float, lr: float) -> None:
        """torch's own AdamW update (``torch.optim.adamw.adamw``, the functional ``torch.optim.AdamW``;
        fused where the device has the kernel) on *copies* of the parameters: the old tensors stay as
        they are for in-flight backwards (the module note). The moments are private: updated in place.
        The gradient is ``scale`` times the sums, which the fused kernel takes as its ``grad_scale``."""
        names = list(self.state["exp_avg"])
        if not names:
            return
        beta1, beta2 = self.cfg.betas
        new_params = [self.params[n].clone() for n in names]
        device = new_params[0].device
        grads = [sums[n] for n in names]
        moments = ([self.state["exp_avg"][n] for n in names], [self.state["exp_avg_sq"][n] for n in names])

        def update(fused: bool) -> None:
            steps = [torch.tensor(float(self.step_count), device=device) for _ in names]  # it adds 1 to each
            if fused:
                extra: dict[str, Any] = {
                    "fused": True,
                    "grad_scale": torch.tensor(1.0 / scale, device=device),
                }
                scaled = grads
            else:  # the reference implementation has no grad_scale
                extra, scaled = {}, [g * scale for g in grads]
            _torch_adamw(
                new_params,
                scaled,
                *moments,
                [],
                steps,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=lr,
                weight_decay=self.cfg.weight_decay,
                eps=_ADAM_EPS,
                maximize=False,
                **extra,
            )

        if self._fused is False or device.type not in _FUSED_DEVICES:
            update(fused=False)
        elif self._fused:
            update(fused=True)
        else:  # the first step here: does torch have the fused kernel for this device and dtype?
            try:
                update(fused=True)
                self._fused = True
            except (RuntimeError, NotImplementedError):  # raised before it changed anything
                self._fused = False
                update(fused=False)
        self.params = {**self.params, **dict(zip(names, new_params, strict=True))}

    def _muon(self, sums: Params, scale: float, lr: float) -> None:
        """Muon on ``self.matrices`` (note "muon"); new parameter tensors, momentum updated in place."""
        mu, wd = self.cfg.muon_beta, self.cfg.weight_decay
        new = dict(self.params)
        for n in self.matrices:
            p, m, g = self.params[n], self.state["muon_momentum"][n], sums[n] * scale
            m.lerp_(g, 1.0 - mu)  # private slot: in place is safe
            update = newton_schulz(g.lerp(m, mu), self.ns_steps)  # Nesterov: (1 - mu) g + mu m; (rows, cols)
            scale_m = _MUON_RMS * math.sqrt(max(p.shape))
            base = p * (1.0 - lr * wd) if wd else p
            new[n] = base.add(update, alpha=-lr * scale_m)  # out of place: a new tensor
        self.params = new

    def _nesterov(self, sums: Params, scale: float, lr: float) -> None:
        mu, wd = self.cfg.momentum, self.cfg.weight_decay
        new = {}
        for n, p in self.params.items():
            g = sums[n] * scale
            if wd:
                g.add_(p, alpha=wd)
            vel = self.state["velocity"][n]
            vel.mul_(mu).add_(g, alpha=-lr)
            new[n] = p + vel
        self.params = new

    def _compute_served(self) -> Params:
        if self.cfg.name != "nesterov":
            c = self.lookahead * self.staleness  # note "extrapolated weights"
            if c == 0.0 or self._delta is None:
                return self.params
            return {n: p + c * self._delta[n] for n, p in self.params.items()}
        c = lookahead_coefficient(self.cfg.momentum, self.staleness)
        vel = self.state["velocity"]
        return {n: p + c * vel[n] for n, p in self.params.items()}

    def served(self) -> Params:
        """The weights forwards run with (new tensors after every change; never mutated)."""
        return self._served

    # ---- state for checkpoints and downloads --------------------------------------------------

    def _slot_layout(self) -> list[tuple[str, str]]:
        """``(slot, parameter)`` pairs after the parameters: slots sorted, each in parameter order."""
        return [(slot, n) for slot in sorted(self.state) for n in self.names if n in self.state[slot]]

    def state_names(self) -> list[str]:
        """Names of :meth:`state_tensors`, in order: ``param/<name>`` for every parameter, then
        ``<slot>/<name>`` for each slot (sorted) and each parameter that has it (note "muon")."""
        return [f"param/{n}" for n in self.names] + [f"{slot}/{n}" for slot, n in self._slot_layout()]

    def state_tensors(self) -> list[torch.Tensor]:
        """Base parameters and optimizer slots, in :meth:`state_names` order (live references)."""
        return [self.params[n] for n in self.names] + [self.state[s][n] for s, n in self._slot_layout()]

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
        state: dict[str, Params] = {slot: {} for slot in self.state}
        for (slot, n), t in zip(self._slot_layout(), tensors[k:], strict=True):
            state[slot][n] = t.detach().to(device, torch.float32).clone()
        self.state = state
        self.step_count = int(meta.get("step_count", 0))
        self.staleness = float(meta.get("staleness", 0.0))
        self._delta = None  # the loaded weights were not reached by a step of ours
        self.zero_grad()
        self._served = self._compute_served()
