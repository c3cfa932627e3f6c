"""The ``model`` section of a run spec: the decoder's shape, its subspace constraint and RoPE scaling.

Part of ``swarm.run.spec`` (which re-exports everything here); the field rules are declared with the
fields (``swarm/run/fields.py``), only the rules between fields are written out below.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from swarm.run.fields import (
    OMIT_DEFAULT,
    OMIT_NONE,
    check_fields,
    check_int,
    flag,
    integer,
    number,
    one_of,
    reject,
    set_field,
    take_keys,
)

__all__ = [
    "ModelConfig",
    "SubspaceConfig",
    "RopeScalingConfig",
    "ROPE_SCALINGS",
    "MAX_VOCAB_SIZE",
    "MAX_D_MODEL",
    "MAX_LAYERS",
    "MAX_HEADS",
    "MAX_SEQ_LEN",
]

# Upper bounds that keep a published spec from asking every joining peer for an absurd model.
# They are far above anything this project trains; raise them here if a real run needs more.
MAX_VOCAB_SIZE = 1 << 20
MAX_D_MODEL = 1 << 16
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_SEQ_LEN = 1 << 20

ROPE_SCALINGS = ("linear", "llama3")
_ROPE_HINT = "Copy the values from the checkpoint's config.json (rope_scaling / rope_parameters)."
_SUBSPACE_HINT = "Give model.subspace.rank (numbers per token, e.g. 16) or model.subspace.ratio (e.g. 32 for k = d_model / 32)."


@dataclass(frozen=True, kw_only=True)
class SubspaceConfig:
    """Subspace-constrained model ("Protocol Models", arXiv 2506.01260): see swarm/run/subspace.py.

    Every layer before the last stage boundary writes into the residual stream only inside a fixed,
    seed-derived k-dimensional subspace, so each boundary sends k numbers per token instead of d_model
    and reconstructs the hidden state exactly. Give exactly one of ``rank`` and ``ratio``.
    """

    _SECTION: ClassVar[str] = "model.subspace"

    rank: int | None = integer(
        None, lo=1, hi=MAX_D_MODEL, hint=_SUBSPACE_HINT, optional=True, metadata=OMIT_NONE
    )
    """k, the subspace dimension: numbers sent per token at a boundary (1 <= k <= model.d_model)."""
    ratio: float | None = number(None, ge=1.0, hint=_SUBSPACE_HINT, optional=True, metadata=OMIT_NONE)
    """Alternative to rank: k = floor(model.d_model / ratio), e.g. ratio 32 sends 1/32 of the width."""

    def __post_init__(self) -> None:
        if (self.rank is None) == (self.ratio is None):
            raise reject(
                self._SECTION,
                {"rank": self.rank, "ratio": self.ratio},
                "exactly one of rank and ratio must be given",
                _SUBSPACE_HINT + " To train without the constraint, leave model.subspace out.",
            )
        check_fields(self, self._SECTION)

    def resolve_rank(self, d_model: int) -> int:
        """The subspace dimension k for a residual stream of width ``d_model`` (not validated here)."""
        if self.rank is not None:
            return self.rank
        assert self.ratio is not None  # exactly one is set, enforced in __post_init__
        # True division is correctly rounded, so 256 / 2.56 is 100.0 (``256 // 2.56`` would be 99).
        return math.floor(d_model / self.ratio)


@dataclass(frozen=True, kw_only=True)
class RopeScalingConfig:
    """RoPE frequency scaling, as transformers' Llama applies it (``rope_type`` linear or llama3).

    ``linear`` divides every frequency by ``factor``; ``llama3`` (Llama 3.1) divides the low
    frequencies (wavelength above ``original_max_position_embeddings / low_freq_factor``) by
    ``factor``, keeps the high ones (below ``... / high_freq_factor``) and interpolates in between.
    """

    _SECTION: ClassVar[str] = "model.rope_scaling"

    type: str = one_of(ROPE_SCALINGS)
    """``linear`` or ``llama3``."""
    factor: float = number(ge=1.0, le=1e6, hint=_ROPE_HINT)
    """How much longer the context is than the one the frequencies were trained for (>= 1)."""
    low_freq_factor: float | None = number(
        None, gt=0.0, le=1e6, hint=_ROPE_HINT, optional=True, metadata=OMIT_NONE
    )
    """llama3 only (Llama 3.1 uses 1)."""
    high_freq_factor: float | None = number(
        None, gt=0.0, le=1e6, hint=_ROPE_HINT, optional=True, metadata=OMIT_NONE
    )
    """llama3 only (Llama 3.1 uses 4); must exceed low_freq_factor."""
    original_max_position_embeddings: int | None = integer(
        None, lo=1, hi=MAX_SEQ_LEN, hint=_ROPE_HINT, optional=True, metadata=OMIT_NONE
    )
    """llama3 only: the context length of the unscaled model (Llama 3.1 uses 8192)."""

    def __post_init__(self) -> None:
        s = self._SECTION
        check_fields(self, s)
        extras = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        given = [name for name in extras if getattr(self, name) is not None]
        if self.type == "linear":
            if given:
                raise reject(
                    f"{s}.{given[0]}", getattr(self, given[0]), "only llama3 scaling has it", _ROPE_HINT
                )
            return
        missing = [name for name in extras if getattr(self, name) is None]
        if missing:
            raise reject(f"{s}.{missing[0]}", None, "llama3 scaling needs it", _ROPE_HINT)
        if not self.high_freq_factor > self.low_freq_factor:  # type: ignore[operator]
            raise reject(
                f"{s}.high_freq_factor", self.high_freq_factor, "it must exceed low_freq_factor", _ROPE_HINT
            )


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A GPT/Llama-style decoder: RMSNorm, RoPE, SwiGLU, pre-norm residual blocks, no biases."""

    _SECTION: ClassVar[str] = "model"

    vocab_size: int = integer(
        lo=2,
        hi=MAX_VOCAB_SIZE,
        hint=f"Use 256 for byte-level text, or your tokenizer's vocabulary size (<= {MAX_VOCAB_SIZE}).",
    )
    """Number of token ids; 256 means raw bytes (no tokenizer needed)."""
    d_model: int = integer(lo=1, hi=MAX_D_MODEL, hint="Pick a width such as 128, 512 or 1024.")
    """Width of the residual stream (C in the shape comments); must divide by n_heads."""
    n_layers: int = integer(
        lo=1, hi=MAX_LAYERS, hint=f"Pick a number of transformer blocks between 1 and {MAX_LAYERS}."
    )
    """Number of transformer blocks, split among the stages."""
    n_heads: int = integer(lo=1, hi=MAX_HEADS, hint="Pick a head count that divides d_model.")
    """Attention heads; head size d_model / n_heads must be even (RoPE rotates pairs)."""
    seq_len: int = integer(lo=1, hi=MAX_SEQ_LEN, hint="Pick the context length in tokens, e.g. 128 or 1024.")
    """Longest sequence (tokens) a micro-batch may hold; also the RoPE cache length."""
    ffn_hidden: int | None = integer(
        None,
        lo=1,
        hi=16 * MAX_D_MODEL,
        optional=True,
        hint="Give a positive SwiGLU hidden width, or leave ffn_hidden out for the default.",
    )
    """SwiGLU hidden width; None = the multiple of 32 at or above 8/3 * d_model."""
    rope_theta: float = number(
        10000.0, gt=1.0, hint="Use 10000.0 (the usual RoPE base) unless you know you need another."
    )
    """RoPE base; larger values stretch the lowest frequency for longer contexts."""
    norm_eps: float = number(1e-5, gt=0.0, lt=1.0, hint="Use a small positive value such as 1e-5.")
    """RMSNorm epsilon; raise it (e.g. 1e-5 -> 1e-4) if bf16 runs show NaNs after a norm."""
    subspace: SubspaceConfig | None = field(default=None, metadata=OMIT_NONE)
    """Constrain the model so stage boundaries send k numbers per token (``{rank: k}`` or
    ``{ratio: r}``, see swarm/run/subspace.py); None = an ordinary model. Needs at least 2 stages."""
    n_kv_heads: int | None = field(default=None, metadata=OMIT_NONE)
    """Key/value heads (grouped-query attention: each serves n_heads / n_kv_heads query heads);
    None = n_heads (ordinary multi-head attention). Must divide n_heads."""
    rope_scaling: RopeScalingConfig | None = field(default=None, metadata=OMIT_NONE)
    """RoPE frequency scaling of long-context checkpoints (``{type: linear, factor}`` or Llama 3's
    ``{type: llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}``);
    None = plain RoPE."""
    tie_embeddings: bool = flag(False, metadata=OMIT_DEFAULT)
    """The LM head starts as a copy of the token embedding (checkpoints with tied embeddings). The
    embedding lives on stage 0 and the head on the last stage, usually different peers, so the two
    copies train separately after that (an export writes them untied)."""

    def __post_init__(self) -> None:
        s = self._SECTION
        check_fields(self, s)
        if self.d_model % self.n_heads:
            raise reject(
                f"{s}.n_heads",
                self.n_heads,
                f"it must divide model.d_model ({self.d_model})",
                "Change n_heads or d_model so that d_model / n_heads is a whole, even number.",
            )
        if (self.d_model // self.n_heads) % 2:
            raise reject(
                f"{s}.n_heads",
                self.n_heads,
                f"the head size d_model / n_heads = {self.d_model // self.n_heads} must be even for RoPE",
                "Change n_heads or d_model so that the head size is even (e.g. 32 or 64).",
            )
        self._check_subspace()
        self._check_attention_extras()

    def _check_attention_extras(self) -> None:
        """n_kv_heads divides n_heads; rope_scaling is a RopeScalingConfig (or a mapping)."""
        s = self._SECTION
        if self.n_kv_heads is not None:
            check_int(
                f"{s}.n_kv_heads",
                self.n_kv_heads,
                lo=1,
                hi=self.n_heads,
                hint=f"Give a number of key/value heads that divides n_heads ({self.n_heads}), or leave it out.",
            )
            if self.n_heads % self.n_kv_heads:
                raise reject(
                    f"{s}.n_kv_heads",
                    self.n_kv_heads,
                    f"it must divide model.n_heads ({self.n_heads})",
                    "Use a divisor of n_heads (grouped-query attention), or leave it out.",
                )
        scaling = self.rope_scaling
        if isinstance(scaling, Mapping):
            scaling = RopeScalingConfig(**take_keys(f"{s}.rope_scaling", scaling, RopeScalingConfig))
            set_field(self, "rope_scaling", scaling)
        if scaling is not None and not isinstance(scaling, RopeScalingConfig):
            raise reject(
                f"{s}.rope_scaling",
                scaling,
                "it must be a mapping such as {type: linear, factor: 2.0}",
                "Leave rope_scaling out for plain RoPE.",
            )

    def _check_subspace(self) -> None:
        """Accept ``subspace`` as a SubspaceConfig or a mapping (parsed YAML); check k against d_model."""
        path = f"{self._SECTION}.subspace"
        sub = self.subspace
        if sub is None:
            return
        if isinstance(sub, Mapping):
            sub = SubspaceConfig(**take_keys(path, sub, SubspaceConfig))
            set_field(self, "subspace", sub)
        if not isinstance(sub, SubspaceConfig):
            raise reject(
                path,
                sub,
                "it must be a mapping such as {rank: 16} or {ratio: 32}",
                "Write e.g. `subspace: {ratio: 32}` under model, or leave it out for an ordinary model.",
            )
        k = sub.resolve_rank(self.d_model)
        if not 1 <= k <= self.d_model:
            name, value = ("rank", sub.rank) if sub.rank is not None else ("ratio", sub.ratio)
            given = "" if name == "rank" else f"it gives k = floor({self.d_model} / {value}) = {k}, but "
            raise reject(
                f"{path}.{name}",
                value,
                f"{given}the subspace dimension k must satisfy 1 <= k <= model.d_model ({self.d_model})",
                f"Use a rank between 1 and {self.d_model}, or a ratio between 1 and {self.d_model}.",
            )

    @property
    def subspace_rank(self) -> int | None:
        """k, the subspace dimension, or None when the model is not subspace-constrained."""
        return None if self.subspace is None else self.subspace.resolve_rank(self.d_model)

    @property
    def head_dim(self) -> int:
        """Size of one attention head (d_model / n_heads)."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads in effect: ``n_kv_heads``, or ``n_heads`` without grouped-query attention."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_size(self) -> int:
        """The SwiGLU hidden width actually used: ``ffn_hidden`` or the default (multiple of 32 >= 8/3 C).

        8/3 keeps a SwiGLU FFN (three matrices) at the parameter count of a 4x GELU FFN (two);
        rounding to 32 keeps matmul shapes friendly to tensor cores.
        """
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return 32 * math.ceil(8 * self.d_model / 3 / 32)

    def layer_params(self, *, constrained: bool = False) -> int:
        """Parameters of one transformer block (q, k, v, o; SwiGLU gate, up, down; two norms).

        ``constrained``: the block writes into the k-dim subspace, so its attention output and SwiGLU
        down projections hold k rows instead of d_model (see swarm/run/subspace.py).
        """
        c, h = self.d_model, self.ffn_hidden_size
        out = self.subspace_rank if constrained and self.subspace_rank is not None else c
        kv = self.kv_heads * self.head_dim  # width of k and of v
        return c * c + 2 * c * kv + out * c + 2 * c * h + out * h + 2 * c
