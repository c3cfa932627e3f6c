"""Subspace-constrained models ("Protocol Models"): stage boundaries that send k numbers per token.

Idea (Ramasinghe et al., "Protocol Models: Scaling Decentralized Training with Communication-Efficient
Model Parallelism", arXiv 2506.01260): instead of approximating the hidden states that cross a stage
boundary, constrain the model so that they *are* low-dimensional. With ``model.subspace`` in the run
spec (``{rank: k}`` or ``{ratio: r}``, k = floor(d_model / r)), every peer derives from the run's seed

- U (d x k), a fixed orthonormal basis (:func:`subspace_basis`), and
- E_fix (V x d), a fixed random token embedding (:func:`fixed_embedding`),

and swarm/run/model.py builds every module that writes into the residual stream before the last stage
boundary inside span(U): the token embedding is E_fix[t] + U A_emb[t], and the attention output and
SwiGLU down projections of the layers in ``spec.constrained_layers`` are W = U A with trainable A
(queries, keys, values, SwiGLU gate/up and the norms stay free; positions come from RoPE inside
attention, so nothing positional is added to the stream). Hence at every boundary the hidden state
satisfies ``h - E_fix[tokens] in span(U)`` and

- forward: the sender sends ``c = U^T (h - E_fix[tokens])`` (B, T, k); the receiver rebuilds
  ``h = U c + E_fix[tokens]`` exactly (to float rounding). The token ids ride along in every route
  already, so they cost nothing extra.
- backward: the receiver sends ``U^T g`` for its input gradient g = dL/dh; the sender continues
  backward from ``U (U^T g)``. That is exact for the constrained model, with no error feedback: the
  sender's output is its input plus span(U)-valued branches (or E_fix[t] plus a span(U)-valued
  embedding on stage 0), so every parameter's derivative of the output lies in span(U), and the
  part of g orthogonal to span(U) changes neither the sender's parameter gradients nor U^T of its
  input gradient (the only thing it sends further back). tests/test_subspace.py checks both claims
  against the unsplit model's forward and parameter gradients.

The last stage's layers, the final norm and the head come after the last boundary and stay free.

Composition with codecs: the boundary turns (B, T, d) into (B, T, k) and nothing else; the peer then
sends those coefficients through the run's ordinary activation / gradient codec (``codecs`` in the
spec: fp16, blockwise8, ...), exactly as it would send full hidden states. So d/k from the subspace
multiplies with the codec's own ratio (e.g. k = d/32 with blockwise8: ~128x fewer bytes than fp32
hidden states) and compression/ needs no new codec.

What a stage peer calls (the ``Boundary`` returned by :func:`make_boundary`, one per process)::

    # forward, sender (any stage but the last)
    out = stage(x)                                         # (B, T, C)
    payload = act_codec.encode(boundary.encode_activation(out, tokens))
    # forward, receiver (any stage but the first)
    h = boundary.decode_activation(decode_any(payload), tokens).requires_grad_()   # (B, T, C)
    # backward, receiver: after out.backward(grad_out) on its own output
    grad_payload = grad_codec.encode(boundary.encode_grad(h.grad))                # (B, T, width)
    # backward, sender
    out.backward(boundary.decode_grad(decode_any(grad_payload)))

For a run without ``model.subspace`` the same calls go to an identity boundary that returns its
input unchanged (``width`` = d_model), so the peer has one code path.

Precision: U and E_fix are float32 buffers; encode/decode compute in float32 whatever the stage's
dtype. Under bf16 weights or autocast the stage's own output is only in span(U) to bf16 rounding,
and that rounding is what the boundary loses (far below what fp16 or blockwise8 codecs lose).
"""

from __future__ import annotations

import abc
import math

import torch
import torch.nn.functional as F

from swarm.errors import RequestError
from swarm.run.init import INIT_STD, derive_seed, fill_bell_
from swarm.run.spec import RunSpec

__all__ = [
    "Boundary",
    "IdentityBoundary",
    "SubspaceBoundary",
    "make_boundary",
    "subspace_basis",
    "fixed_embedding",
    "FIXED_EMBED_STD",
]

FIXED_EMBED_STD = INIT_STD
"""Std of E_fix's entries: the ordinary embedding's init std, so the constrained model's initial
hidden states have the same size as the unconstrained model's."""


# ---------------------------------------------------------------------------------------------
# U and E_fix: built identically by every peer
# ---------------------------------------------------------------------------------------------

# Note [portable basis]: QR or SVD of a seeded matrix would give a random orthonormal basis, but
# their results depend on the LAPACK/BLAS build and the CPU (reduction order, blocking), so two peers
# could hold bases that differ in the last bits, and the boundary would no longer rebuild exactly
# what the sender's layers wrote. Instead U is the first k columns of a product of random rotations
# applied to the identity, using only operations whose IEEE results are the same everywhere:
#   - a random permutation of the d coordinates (stable argsort of Mersenne Twister uniforms), then
#   - a rotation of each disjoint pair of coordinates (rows 2i, 2i+1) by an angle theta with
#     t = tan(theta / 2) uniform in [-1, 1): cos = (1 - t^2) / (1 + t^2), sin = 2t / (1 + t^2)
#     (no transcendental functions, whose vectorised versions differ between CPUs).
# Each step is elementwise float64 arithmetic (every op correctly rounded, no sums whose order could
# vary), so U is bit-identical on every machine; it is orthonormal to float64 rounding (~1e-15).
# 2 * ceil(log2 d) + 2 rounds spread every column over all d coordinates (a butterfly network needs
# log2 d rounds to connect every coordinate to every other one).


def _basis_rounds(d_model: int) -> int:
    return 2 * max(1, math.ceil(math.log2(d_model))) + 2


def subspace_basis(spec: RunSpec, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """U, the run's (d_model, k) orthonormal basis: bit-identical on every machine (Note [portable basis]).

    Raises ``ValueError`` if the spec has no ``model.subspace``.
    """
    d, k = spec.model.d_model, _rank(spec)
    gen = torch.Generator(device="cpu").manual_seed(derive_seed(spec.seed, "subspace-basis"))
    q = torch.zeros(d, k, dtype=torch.float64)
    q[:k] = torch.eye(k, dtype=torch.float64)  # start from the first k coordinate axes
    pairs = d // 2
    for _ in range(_basis_rounds(d)):
        q = q[torch.argsort(torch.rand(d, generator=gen), stable=True)]
        t = torch.rand(pairs, 1, generator=gen).double() * 2.0 - 1.0  # exact: a multiple of 2^-23
        t2 = t * t
        cos, sin = (1.0 - t2) / (1.0 + t2), (2.0 * t) / (1.0 + t2)
        a, b = q[0 : 2 * pairs : 2], q[1 : 2 * pairs : 2]  # (d/2, k) each; odd d leaves one row out
        q = q.clone()
        q[0 : 2 * pairs : 2] = cos * a - sin * b
        q[1 : 2 * pairs : 2] = sin * a + cos * b
    return q.to(dtype)


def fixed_embedding(spec: RunSpec) -> torch.Tensor:
    """E_fix, the run's (vocab_size, d_model) fixed random token embedding (float32, std FIXED_EMBED_STD).

    Drawn like every initial weight (swarm/run/init.py, Note [portable init]), so bit-identical everywhere.
    """
    _rank(spec)
    m = spec.model
    fixed = torch.empty(m.vocab_size, m.d_model)
    gen = torch.Generator(device="cpu").manual_seed(derive_seed(spec.seed, "subspace-fixed-embed"))
    fill_bell_(fixed, FIXED_EMBED_STD, gen)
    return fixed


def _rank(spec: RunSpec) -> int:
    k = spec.model.subspace_rank
    if k is None:
        raise ValueError(
            f"run {spec.run_id!r} has no model.subspace, so it has no subspace basis; "
            "use make_boundary(spec), which returns an identity boundary for such runs"
        )
    return k


# ---------------------------------------------------------------------------------------------
# Boundaries
# ---------------------------------------------------------------------------------------------


class Boundary(abc.ABC):
    """What crosses one stage boundary, and how to turn it back into a (B, T, C) hidden state.

    ``width`` is the last dimension of what ``encode_*`` return (k, or d_model for the identity);
    ``needs_tokens`` says whether ``decode_activation`` / ``encode_activation`` use the token ids.
    """

    width: int
    needs_tokens: bool

    @abc.abstractmethod
    def encode_activation(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Sender side: hidden state (B, T, C) -> what to send (B, T, width)."""

    @abc.abstractmethod
    def decode_activation(self, c: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Receiver side: what arrived (B, T, width) -> hidden state (B, T, C)."""

    @abc.abstractmethod
    def encode_grad(self, g: torch.Tensor) -> torch.Tensor:
        """Receiver side, backward: dL/dh (B, T, C) -> what to send back (B, T, width)."""

    @abc.abstractmethod
    def decode_grad(self, gc: torch.Tensor) -> torch.Tensor:
        """Sender side, backward: what arrived (B, T, width) -> gradient for its output (B, T, C)."""


class IdentityBoundary(Boundary):
    """Runs without ``model.subspace``: every method returns its input unchanged (no copy, no check;
    the stage's own ``check_input`` validates what it receives)."""

    needs_tokens = False

    def __init__(self, d_model: int):
        self.width = d_model

    def encode_activation(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return h

    def decode_activation(self, c: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return c

    def encode_grad(self, g: torch.Tensor) -> torch.Tensor:
        return g

    def decode_grad(self, gc: torch.Tensor) -> torch.Tensor:
        return gc

    def __repr__(self) -> str:
        return f"IdentityBoundary(width={self.width})"


class SubspaceBoundary(Boundary):
    """Boundary of a subspace-constrained run: sends U^T (h - E_fix[tokens]) and U^T g (module docstring).

    Everything it returns is float32 on ``device``; inputs may come on any device and in any float
    dtype (codecs decode to CPU tensors). Decoding checks shapes, token range and finiteness first
    and raises ``RequestError`` (a bad request from a peer must not reach an index on a GPU, where an
    out-of-range id kills the CUDA context).
    """

    needs_tokens = True

    def __init__(self, basis: torch.Tensor, fixed: torch.Tensor, *, device: torch.device | str | None = None):
        if basis.dim() != 2 or fixed.dim() != 2 or fixed.shape[1] != basis.shape[0]:
            raise ValueError(
                f"basis must be (d, k) and fixed (V, d); got {tuple(basis.shape)} and {tuple(fixed.shape)}"
            )
        device = torch.device(device) if device is not None else basis.device
        self.basis = basis.to(device=device, dtype=torch.float32)  # U (d, k)
        self.fixed = fixed.to(device=device, dtype=torch.float32)  # E_fix (V, d)
        self.device = device
        self.d_model, self.width = self.basis.shape
        self.vocab_size = self.fixed.shape[0]

    # ---- forward ----------------------------------------------------------------------------------

    def encode_activation(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        self._check(h, tokens, self.d_model, "hidden state to encode")
        h = h.to(device=self.device, dtype=torch.float32)
        tokens = tokens.to(self.device)
        return (h - F.embedding(tokens, self.fixed)) @ self.basis  # (B, T, C) -> (B, T, k)

    def decode_activation(self, c: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        self._check(c, tokens, self.width, "subspace coefficients")
        c = c.to(device=self.device, dtype=torch.float32)
        tokens = tokens.to(self.device)
        return c @ self.basis.T + F.embedding(tokens, self.fixed)  # (B, T, k) -> (B, T, C)

    # ---- backward ---------------------------------------------------------------------------------

    def encode_grad(self, g: torch.Tensor) -> torch.Tensor:
        self._check(g, None, self.d_model, "gradient to encode")
        return g.to(device=self.device, dtype=torch.float32) @ self.basis  # (B, T, C) -> (B, T, k)

    def decode_grad(self, gc: torch.Tensor) -> torch.Tensor:
        self._check(gc, None, self.width, "gradient coefficients")
        return gc.to(device=self.device, dtype=torch.float32) @ self.basis.T  # (B, T, k) -> (B, T, C)

    # ---- checks -----------------------------------------------------------------------------------

    def _check(self, x: torch.Tensor, tokens: torch.Tensor | None, width: int, what: str) -> None:
        if x.dim() != 3 or x.shape[-1] != width or not x.is_floating_point():
            raise RequestError(
                f"the subspace boundary expected {what} of shape (B, T, {width}) and a float dtype, got "
                f"{tuple(x.shape)} {x.dtype}; check that the sender serves the same run spec "
                f"(model.subspace gives k = {self.width}, d_model = {self.d_model})"
            )
        if not bool(torch.isfinite(x).all()):
            raise RequestError(f"the {what} contain NaN or Inf; the sender's stage diverged or is faulty")
        if tokens is None:
            return
        if tokens.shape != x.shape[:2] or tokens.dtype not in (torch.int64, torch.int32):
            raise RequestError(
                f"the subspace boundary needs the micro-batch's token ids as an int64 tensor of shape "
                f"{tuple(x.shape[:2])} (B, T) to rebuild hidden states; got {tuple(tokens.shape)} "
                f"{tokens.dtype}"
            )
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise RequestError(
                f"token ids in [{int(tokens.min())}, {int(tokens.max())}] are outside "
                f"0..{self.vocab_size - 1} (model.vocab_size); check that the trainer's tokenizer "
                "matches the run spec"
            )

    def __repr__(self) -> str:
        return f"SubspaceBoundary(width={self.width}, d_model={self.d_model}, device={self.device})"


def make_boundary(spec: RunSpec, device: torch.device | str | None = None) -> Boundary:
    """The boundary every stage of ``spec`` uses: subspace coefficients, or identity without subspace.

    One instance serves all boundaries of a process (U and E_fix are the same for every boundary);
    it holds no per-request state, so concurrent use from one compute thread is safe.
    """
    if spec.model.subspace is None:
        return IdentityBoundary(spec.model.d_model)
    return SubspaceBoundary(subspace_basis(spec), fixed_embedding(spec), device=device)
