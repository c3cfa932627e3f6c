"""Deterministic, portable initialisation: the seeds and the bell-shaped fill that every stage's weights
(swarm/run/model.py) and the subspace basis (swarm/run/subspace.py) are drawn with.

Nothing here depends on the machine or on how the layers are split into stages (Note [portable init]).
"""

from __future__ import annotations

import hashlib
import math

import torch

__all__ = ["INIT_STD", "derive_seed", "fill_bell_"]

INIT_STD = 0.02
"""Standard deviation of every weight matrix at init (residual projections are scaled down further)."""


def derive_seed(seed: int, *tags: object) -> int:
    """A 63-bit seed from the run seed and tags, e.g. ``derive_seed(0, "layer", 5)``.

    Hashing (rather than ``seed + i``) keeps seeds of different parts unrelated, and never touches
    the global RNG, so building a stage cannot change anything else the process draws.
    """
    text = "/".join([str(seed), *(str(t) for t in tags)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


# Note [portable init]: ``Tensor.normal_`` on CPU runs Box-Muller with vectorised approximations of
# log/sin/cos that depend on the CPU (AVX2/AVX-512 vs ARM vs plain), so the "same" seed gives weights
# that differ in the last bits between machines (check: ATEN_CPU_CAPABILITY=default changes them).
# Instead each weight is the standardised sum of four uniforms (Irwin-Hall, a bell curve on
# [-sqrt(12), sqrt(12)] standard deviations): the uniforms come from the generator's Mersenne
# Twister by integer arithmetic, and everything after is exact or a single IEEE-rounded operation,
# so the result is bit-identical on every machine. A network does not care that its init is
# bell-shaped rather than exactly Gaussian (truncated normals are common); it cares about the std.
_INIT_CHUNK = 1 << 20  # elements drawn at a time (bounds the temporary memory; part of the recipe)


@torch.no_grad()
def fill_bell_(p: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """Fill ``p`` in place with mean-0, std-``std`` values, identically on every machine."""
    flat = p.view(-1)
    scale = std * math.sqrt(3.0)  # var(u1+u2+u3+u4) = 4/12, so sqrt(3) makes it 1
    for start in range(0, flat.numel(), _INIT_CHUNK):
        n = min(_INIT_CHUNK, flat.numel() - start)
        u = torch.rand((4, n), generator=gen).double()  # each k * 2^-24: the sums below are exact
        z = ((u[0] + u[1]) + (u[2] + u[3])) - 2.0
        flat[start : start + n] = (z * scale).to(flat.dtype)
