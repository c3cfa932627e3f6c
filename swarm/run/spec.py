"""The run spec: everything a peer needs to join a run, as typed, frozen, validated dataclasses.

A run is defined once by whoever starts it, in a YAML file (see ``examples/tiny.yaml`` for a fully
commented one), and then travels through the DHT as canonical JSON. Every peer rebuilds the same
``RunSpec`` from it and checks ``spec_hash``, so two peers agree on a run exactly when their hashes do.

Layout of a spec (YAML or dict)::

    run_id: tiny                     # 1-64 chars of [A-Za-z0-9_-]
    seed: 0                          # every weight is derived from it (see swarm/run/model.py)
    model: {vocab_size, d_model, n_layers, n_heads, seq_len, ffn_hidden?, rope_theta?, norm_eps?,
            subspace?: {rank: k} or {ratio: r},   # see swarm/run/subspace.py
            n_kv_heads?, rope_scaling?: {type, factor, ...}, tie_embeddings?}
    stages: 2                        # or explicit half-open layer ranges: [[0, 3], [3, 8]]
    codecs: {activations: blockwise8, gradients: blockwise8}
    optimizer: {name?, lr?, schedule?, warmup_steps?, total_steps?, min_lr_ratio?, weight_decay?,
                betas?, momentum?, accumulate?, clip_norm?, mode?, max_versions?, recompute?}
    averaging: {timeout_s?}
    micro_batch_size: 8
    autocast: auto                   # auto | none | bf16 | fp16
    stash_ttl_s: 120
    access?: {private, secret_check?, allow?, deny?}          # see swarm/dht/auth.py
    pretrained?: {source, stage_digests, tokenizer?}          # see swarm/run/pretrained.py

Keys marked ``?`` (and whole ``optimizer`` / ``averaging`` sections, ``seed``, ``autocast``,
``stash_ttl_s``) are optional. Unknown keys are rejected with the list of valid ones, so a typo never
silently falls back to a default. Each config validates itself once in ``__post_init__`` and raises
:class:`swarm.errors.ConfigError` naming the field path (``optimizer.lr``), the value, the rule and
the next step.

Importing this module does not import torch; only the codec check (``compression.get_codec``) may.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from swarm.errors import ConfigError
from swarm.run.fields import check_fields, check_float, check_int, flag, integer, number, one_of, reject

__all__ = [
    "RunSpec",
    "ModelConfig",
    "SubspaceConfig",
    "CodecsConfig",
    "OptimizerConfig",
    "AveragingConfig",
    "AccessConfig",
    "RopeScalingConfig",
    "PretrainedConfig",
    "split_layers",
    "read_spec_yaml",
    "MAX_SPEC_BYTES",
]

# A spec travels through the DHT, where a value of ~45 KB crashes the DHT process
# (docs/HIVEMIND.md, "DHT"). Real specs are well under 2 KB; refuse anything above this cap before
# parsing it, so a hostile or broken spec cannot get near the crash size.
MAX_SPEC_BYTES = 16 * 1024
# A commented YAML file is larger than its canonical JSON; this only guards against reading a wrong file.
MAX_YAML_FILE_BYTES = 256 * 1024

# Upper bounds that keep a published spec from asking every joining peer for an absurd model.
# They are far above anything this project trains; raise them here if a real run needs more.
MAX_VOCAB_SIZE = 1 << 20
MAX_D_MODEL = 1 << 16
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_SEQ_LEN = 1 << 20
MAX_MICRO_BATCH = 1 << 16
MAX_VERSIONS_CAP = 64

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
OPTIMIZERS = ("adamw", "nesterov", "muon")
MUON_MOMENTUM = 0.8
"""Muon's momentum when ``optimizer.muon_momentum`` is left out. The Muon paper and code use 0.95; at
the demo's size 0.8 trained better, in one process and asynchronously (BENCHMARKS.md, "Async replay")."""
MUON_LR_RATIO = 3.0
"""Muon's peak lr when ``optimizer.muon_lr`` is left out: this many times ``lr`` (3e-3 -> 9e-3; at the
demo's size 0.005-0.01 trained best with lr 3e-3)."""
SCHEDULES = ("constant", "cosine")
MODES = ("async", "sync")
AUTOCAST_CHOICES = ("auto", "none", "bf16", "fp16")


# Field metadata key: a field whose value is None is left out of ``to_dict`` (and so of the canonical
# bytes and the hash). Used for options added after runs existed, so that a spec that does not use
# the option keeps the hash it had before the option was added.
_OMIT_IF_NONE = "omit_if_none"
# Same for a field whose value equals its default (a flag added later, e.g. ``model.tie_embeddings``).
_OMIT_IF_DEFAULT = "omit_if_default"


_OMIT_NONE = {_OMIT_IF_NONE: True}


def _set(obj: Any, name: str, value: Any) -> None:
    """Store a normalised value on a frozen dataclass during ``__post_init__`` (and only then)."""
    object.__setattr__(obj, name, value)


def _stages_hint(n_layers: int) -> str:
    half = max(1, n_layers // 2)
    example = f"[[0, {half}], [{half}, {n_layers}]]" if n_layers > 1 else "[[0, 1]]"
    return (
        f"Give `stages` either a number of stages between 1 and model.n_layers ({n_layers}), or explicit "
        f"half-open layer ranges that cover 0..{n_layers} in order, e.g. {example}."
    )


def split_layers(n_layers: int, n_stages: int) -> tuple[tuple[int, int], ...]:
    """Split ``n_layers`` into ``n_stages`` contiguous half-open ranges as evenly as possible.

    Earlier stages get the extra layers (8 layers in 3 stages: 3, 3, 2): the last stage also holds
    the LM head, which is the heaviest single matmul for large vocabularies.
    """
    check_int("stages", n_stages, lo=1, hi=max(1, n_layers), hint=_stages_hint(n_layers))
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for i in range(n_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return tuple(ranges)


# ---------------------------------------------------------------------------------------------
# The config sections
# ---------------------------------------------------------------------------------------------


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
        None, lo=1, hi=MAX_D_MODEL, hint=_SUBSPACE_HINT, optional=True, metadata=_OMIT_NONE
    )
    """k, the subspace dimension: numbers sent per token at a boundary (1 <= k <= model.d_model)."""
    ratio: float | None = number(None, ge=1.0, hint=_SUBSPACE_HINT, optional=True, metadata=_OMIT_NONE)
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


ROPE_SCALINGS = ("linear", "llama3")
_ROPE_HINT = "Copy the values from the checkpoint's config.json (rope_scaling / rope_parameters)."
_HEX64 = re.compile(r"[0-9a-f]{64}")


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
        None, gt=0.0, le=1e6, hint=_ROPE_HINT, optional=True, metadata=_OMIT_NONE
    )
    """llama3 only (Llama 3.1 uses 1)."""
    high_freq_factor: float | None = number(
        None, gt=0.0, le=1e6, hint=_ROPE_HINT, optional=True, metadata=_OMIT_NONE
    )
    """llama3 only (Llama 3.1 uses 4); must exceed low_freq_factor."""
    original_max_position_embeddings: int | None = integer(
        None, lo=1, hi=MAX_SEQ_LEN, hint=_ROPE_HINT, optional=True, metadata=_OMIT_NONE
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
    subspace: SubspaceConfig | None = field(default=None, metadata={_OMIT_IF_NONE: True})
    """Constrain the model so stage boundaries send k numbers per token (``{rank: k}`` or
    ``{ratio: r}``, see swarm/run/subspace.py); None = an ordinary model. Needs at least 2 stages."""
    n_kv_heads: int | None = field(default=None, metadata={_OMIT_IF_NONE: True})
    """Key/value heads (grouped-query attention: each serves n_heads / n_kv_heads query heads);
    None = n_heads (ordinary multi-head attention). Must divide n_heads."""
    rope_scaling: RopeScalingConfig | None = field(default=None, metadata={_OMIT_IF_NONE: True})
    """RoPE frequency scaling of long-context checkpoints (``{type: linear, factor}`` or Llama 3's
    ``{type: llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}``);
    None = plain RoPE."""
    tie_embeddings: bool = flag(False, metadata={_OMIT_IF_DEFAULT: True})
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
            scaling = RopeScalingConfig(**_take_keys(f"{s}.rope_scaling", scaling, RopeScalingConfig))
            _set(self, "rope_scaling", scaling)
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
            sub = SubspaceConfig(**_take_keys(path, sub, SubspaceConfig))
            _set(self, "subspace", sub)
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


@dataclass(frozen=True, kw_only=True)
class CodecsConfig:
    """Codec specs (``compression.get_codec`` grammar) for tensors sent between stages."""

    _SECTION: ClassVar[str] = "codecs"

    activations: str
    """Codec of forward activations, e.g. ``blockwise8`` (~4x smaller than fp32)."""
    gradients: str
    """Codec of backward gradients w.r.t. activations, e.g. ``blockwise8``."""

    def __post_init__(self) -> None:
        for name in ("activations", "gradients"):
            _check_codec(f"{self._SECTION}.{name}", getattr(self, name))


def _check_codec(path: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip() or len(value) > 200:
        raise reject(
            path,
            value,
            "it must be a non-empty codec spec string (at most 200 chars)",
            "Use a codec such as blockwise8; `swarm codecs` lists them.",
        )
    # The `compression` package is written concurrently with this module; until it exposes
    # `get_codec`, the name is only checked for being a non-empty string. Imported lazily so that
    # loading a spec never pays for torch-heavy codec modules unless they exist.
    try:
        from compression import get_codec  # type: ignore[attr-defined]
    except ImportError:
        return
    try:
        get_codec(value)
    except ValueError as e:  # compression.CodecError is a ValueError
        raise reject(path, value, f"the codec was rejected ({e})", "Pick a codec from `swarm codecs`.") from e


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """How each stage peer updates its weights. Every field has a default suitable for small runs."""

    _SECTION: ClassVar[str] = "optimizer"

    name: str = one_of(OPTIMIZERS, "muon")
    """``muon`` (the default: Muon on the 2-D weight matrices of the transformer blocks, AdamW on
    embeddings, head and norms, with the look-ahead on; see swarm/run/optimizer.py), ``adamw``, or
    ``nesterov`` (SGD with delay-aware Nesterov momentum). Muon is the default because it trains better
    per token than AdamW in one process and loses far less to the staleness of asynchronous pipelines
    (BENCHMARKS.md, "Convergence")."""
    lr: float = number(3e-3, gt=0.0, le=10.0, hint="Use a learning rate such as 3e-3 (adamw).")
    """Peak learning rate (reached after warmup); with ``muon``, that of the AdamW part."""
    muon_lr: float | None = number(
        None,
        gt=0.0,
        le=10.0,
        hint="Use a learning rate such as 0.01, or leave it out to use optimizer.lr.",
        optional=True,
        metadata=_OMIT_NONE,
    )
    """Peak learning rate of Muon's matrices (``muon`` only; follows the same warmup and schedule as
    ``lr``); None = MUON_LR_RATIO (3) x ``lr``. Muon's update is scaled to the RMS of an AdamW update
    (0.2 per element), so the two lrs are comparable; at the demo's size 0.005-0.01 (with lr 3e-3)
    trained best in one process. Lower it if the loss spikes."""
    muon_momentum: float | None = number(
        None,
        ge=0.0,
        lt=1.0,
        hint=f"Use a value in [0, 1) such as {MUON_MOMENTUM}, or leave it out.",
        optional=True,
        metadata=_OMIT_NONE,
    )
    """Muon's momentum (Nesterov form; ``muon`` only); None = MUON_MOMENTUM (0.8; the Muon paper's 0.95
    trained worse at the demo's size, in one process and async)."""
    lookahead: float | None = number(
        None,
        ge=0.0,
        le=4.0,
        hint="Use 1.0 (extrapolate by the measured staleness), 0 (off), or leave it out.",
        optional=True,
        metadata=_OMIT_NONE,
    )
    """Delay compensation of ``adamw`` and ``muon`` (swarm/run/optimizer.py, note "extrapolated weights"):
    forwards run on ``params + lookahead * staleness * (the last step's change)``, so a gradient that
    lands ``staleness`` steps late was computed near the weights it is applied to. 0 = off (textbook
    AdamW/Muon); None = 1.0 with muon, 0 with adamw. No effect in sync mode (staleness 0)."""
    schedule: str = one_of(SCHEDULES, "constant")
    """``constant`` (after warmup) or ``cosine`` (decays to min_lr_ratio * lr at total_steps)."""
    warmup_steps: int = integer(0, lo=0, hint="Use 0 for no warmup, or a step count.")
    """Optimizer steps of linear warmup from ~0 to lr; use a few hundred if early loss spikes."""
    total_steps: int | None = integer(
        None, lo=1, hint="Give the schedule length in optimizer steps, or leave it out.", optional=True
    )
    """Length of the cosine schedule in optimizer steps; required for cosine, None = no end."""
    min_lr_ratio: float = number(0.1, ge=0.0, le=1.0, hint="Use a fraction of lr between 0 and 1, e.g. 0.1.")
    """Cosine floor as a fraction of lr."""
    weight_decay: float = number(0.0, ge=0.0, lt=1.0, hint="Use 0.0 (off) or a small value such as 0.1.")
    """Decoupled weight decay (adamw and both parts of muon, each times its own lr) or L2 decay
    (nesterov); 0 disables it."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (beta1, beta2); with ``muon``, those of the AdamW part."""
    momentum: float = number(0.9, ge=0.0, lt=1.0, hint="Use a value in [0, 1), e.g. 0.9.")
    """Momentum of ``nesterov``; ignored by adamw and muon (muon has ``muon_momentum``). Values near 0.99
    overshoot on tiny runs."""
    accumulate: int = integer(
        1,
        lo=1,
        hi=1 << 20,
        hint="Use 1 to step after every micro-batch, or the number of micro-batches per step.",
    )
    """Micro-batches whose gradients are summed into one optimizer step of a stage peer."""
    clip_norm: float | None = number(
        1.0, gt=0.0, hint="Use a positive norm such as 1.0, or null to disable clipping.", optional=True
    )
    """Clip the stage's gradient norm to this before each step; None disables clipping."""
    mode: str = one_of(MODES, "async")
    """``async``: apply updates as gradients arrive (weight stashing keeps backward exact);
    ``sync``: wait for all in-flight micro-batches of a step before updating."""
    max_versions: int = integer(
        3,
        lo=1,
        hi=MAX_VERSIONS_CAP,
        hint=f"Keep between 1 and {MAX_VERSIONS_CAP} weight versions; 3 suits most runs.",
    )
    """Weight versions a peer keeps for in-flight micro-batches; a micro-batch whose version was
    dropped is refused and retried. Raise it if you see many stale-version retries."""
    recompute: bool = flag(True)
    """Recompute the forward pass during backward instead of stashing activations (less memory)."""

    def __post_init__(self) -> None:
        s = self._SECTION
        check_fields(self, s)
        if self.schedule == "cosine" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise reject(
                f"{s}.total_steps",
                self.total_steps,
                f"a cosine schedule needs total_steps > warmup_steps ({self.warmup_steps})",
                "Set optimizer.total_steps to the planned run length, or use schedule: constant.",
            )
        betas = self.betas
        if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != 2:
            raise reject(
                f"{s}.betas", betas, "it must be a pair [beta1, beta2]", "Use e.g. betas: [0.9, 0.95]."
            )
        _set(
            self,
            "betas",
            tuple(
                check_float(f"{s}.betas[{i}]", b, ge=0.0, lt=1.0, hint="Use e.g. betas: [0.9, 0.95].")
                for i, b in enumerate(betas)
            ),
        )

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step ``step`` (0-based): linear warmup, then constant or cosine."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        assert self.total_steps is not None  # enforced in __post_init__ for cosine
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def muon_lr_at(self, step: int) -> float:
        """Muon's learning rate for step ``step``: ``lr_at(step)`` scaled by ``muon_lr / lr``."""
        scale = MUON_LR_RATIO if self.muon_lr is None else self.muon_lr / self.lr
        return self.lr_at(step) * scale

    @property
    def lookahead_scale(self) -> float:
        """``lookahead`` in effect: as given, else 1.0 for muon and 0 otherwise (nesterov has its own)."""
        if self.name == "nesterov":
            return 0.0
        if self.lookahead is not None:
            return self.lookahead
        return 1.0 if self.name == "muon" else 0.0

    @property
    def muon_beta(self) -> float:
        """Muon's momentum in effect (``muon_momentum``, or MUON_MOMENTUM when left out)."""
        return MUON_MOMENTUM if self.muon_momentum is None else self.muon_momentum


@dataclass(frozen=True, kw_only=True)
class AveragingConfig:
    """Gradient rounds among the replicas of a stage (peer/replicas.py): with several online replicas
    a stage steps once per ``optimizer.accumulate`` micro-batches *of the whole stage*, on the mean
    gradient over all of them, so every replica holds the same weights and version."""

    _SECTION: ClassVar[str] = "averaging"

    timeout_s: float = number(5.0, gt=0.0, le=3600.0, hint="Use a few seconds, e.g. 5 (more on slow links).")
    """Seconds a gradient round waits for every online replica of the stage; after that the gradients
    are kept for the next round (a replica steps alone after a few failures, the others catch up by
    download). Raise it on slow links if peers report many failed rounds."""

    def __post_init__(self) -> None:
        check_fields(self, self._SECTION)


_PEER_ID_RE = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,128}")  # base58 libp2p peer id
MAX_ACCESS_LIST = 256  # peer ids per allow/deny list: keeps the spec far below the DHT value cap


@dataclass(frozen=True, kw_only=True)
class AccessConfig:
    """Who may take part (see swarm/dht/auth.py). Left out of the spec (and its hash) when absent.

    Written by ``swarm init --private`` or by hand (``access: {deny: [PEER_ID, ...]}``); it never
    holds the join secret, only ``secret_check``, which lets joiners detect a wrong secret.
    """

    _SECTION: ClassVar[str] = "access"

    private: bool = flag(False)
    """True: only holders of the run's join secret may appear in the DHT or call any peer."""
    secret_check: str | None = field(default=None, metadata={_OMIT_IF_NONE: True})
    """16 hex chars, ``swarm.dht.auth.secret_check(secret, run_id)``; required when private."""
    allow: tuple[str, ...] = ()
    """If non-empty, only these peer ids (base58) may take part."""
    deny: tuple[str, ...] = ()
    """These peer ids may never take part (wins over ``allow``)."""

    def __post_init__(self) -> None:
        s = self._SECTION
        check_fields(self, s)
        check = self.secret_check
        if self.private and (not isinstance(check, str) or not re.fullmatch(r"[0-9a-f]{16}", check)):
            raise reject(
                f"{s}.secret_check",
                check,
                "a private run needs the 16 hex chars of swarm.dht.auth.secret_check(secret, run_id)",
                "Create private runs with `swarm init RUN.yaml --private --secret-file PATH`.",
            )
        if not self.private and check is not None:
            raise reject(f"{s}.secret_check", check, "only a private run has a secret check", "Remove it.")
        for name in ("allow", "deny"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or len(value) > MAX_ACCESS_LIST:
                raise reject(
                    f"{s}.{name}",
                    value,
                    f"it must be a list of at most {MAX_ACCESS_LIST} peer ids",
                    "Fix the list.",
                )
            for pid in value:
                if not isinstance(pid, str) or not _PEER_ID_RE.fullmatch(pid):
                    raise reject(
                        f"{s}.{name}",
                        pid,
                        "each entry must be a base58 libp2p peer id",
                        "Copy ids from `swarm status`.",
                    )
            _set(self, name, tuple(sorted(set(value))))


@dataclass(frozen=True, kw_only=True)
class PretrainedConfig:
    """Where a run's initial weights come from when it continues an existing checkpoint
    (``swarm init --from-pretrained DIR``, see swarm/run/pretrained.py). Left out of the spec (and its
    hash) when absent: the initial weights are then drawn from ``seed``."""

    _SECTION: ClassVar[str] = "pretrained"

    source: str
    """The checkpoint's name (its directory name), for people; peers check the digests, not this."""
    stage_digests: tuple[str, ...]
    """sha256 (64 hex chars) of each stage's initial weights, in stage order
    (``swarm.run.pretrained.stage_digest``): a peer starting a stage checks the weights it got against it."""
    tokenizer: str | None = field(default=None, metadata={_OMIT_IF_NONE: True})
    """sha256 of the checkpoint's tokenizer.json: trainers and ``swarm generate`` use that tokenizer
    (and refuse another file); None = the checkpoint came without one."""

    def __post_init__(self) -> None:
        s = self._SECTION
        source = self.source
        if not isinstance(source, str) or not 1 <= len(source) <= 200 or not source.isprintable():
            raise reject(
                f"{s}.source", source, "it must be 1-200 printable characters", "Name the checkpoint."
            )
        hint = "Let `swarm init --from-pretrained DIR` compute it; do not edit it by hand."
        digests = self.stage_digests
        if isinstance(digests, (str, bytes)) or not isinstance(digests, Sequence) or not digests:
            raise reject(f"{s}.stage_digests", digests, "it must be a list with one digest per stage", hint)
        for i, d in enumerate(digests):
            if not isinstance(d, str) or not _HEX64.fullmatch(d):
                raise reject(f"{s}.stage_digests[{i}]", d, "it must be 64 lowercase hex characters", hint)
        _set(self, "stage_digests", tuple(digests))
        if self.tokenizer is not None and (
            not isinstance(self.tokenizer, str) or not _HEX64.fullmatch(self.tokenizer)
        ):
            raise reject(f"{s}.tokenizer", self.tokenizer, "it must be 64 lowercase hex characters", hint)


# ---------------------------------------------------------------------------------------------
# The run spec
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One training run. Build it with :meth:`from_yaml` / :meth:`from_dict` or directly by keyword.

    ``stages`` may be given as a stage count (split as evenly as possible) or as explicit ranges;
    after construction it is always a tuple of half-open ``(first, end)`` layer ranges.
    """

    run_id: str
    """Name of the run in the DHT: 1-64 chars of [A-Za-z0-9_-] (averager prefixes forbid '.')."""
    model: ModelConfig
    stages: tuple[tuple[int, int], ...]
    """Half-open layer ranges, one per stage, covering 0..model.n_layers in order."""
    codecs: CodecsConfig
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    micro_batch_size: int = integer(
        lo=1,
        hi=MAX_MICRO_BATCH,
        hint="Use the number of sequences per micro-batch that fits a peer's memory, e.g. 8.",
    )
    """Sequences per micro-batch (one request through the pipeline)."""
    seed: int = integer(0, lo=0, hi=(1 << 63) - 1, hint="Use a non-negative integer such as 0 or 1234.")
    """Root of every derived seed: the same seed gives the same initial weights on every machine."""
    autocast: str = one_of(AUTOCAST_CHOICES, "auto")
    """``auto`` (bf16 on CUDA when supported, else full precision), ``none``, ``bf16`` or ``fp16``."""
    stash_ttl_s: float = number(120.0, gt=0.0, le=86400.0, hint="Use a timeout in seconds such as 120.")
    """Seconds a stashed forward waits for its backward before it is dropped (its micro-batch fails)."""
    access: AccessConfig | None = field(default=None, metadata={_OMIT_IF_NONE: True})
    """Private run / allow / deny lists (swarm/dht/auth.py); None = open to everyone (hash unchanged)."""
    pretrained: PretrainedConfig | None = field(default=None, metadata={_OMIT_IF_NONE: True})
    """The checkpoint the run continues (swarm/run/pretrained.py); None = initial weights from ``seed``."""

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str):
            raise reject(
                "run_id",
                self.run_id,
                f"it must be a string, not {type(self.run_id).__name__}",
                'Quote it in YAML, e.g. run_id: "2024".',
            )
        if not RUN_ID_PATTERN.fullmatch(self.run_id):
            raise reject(
                "run_id",
                self.run_id,
                "it must be 1-64 characters of letters, digits, '_' or '-' (no '.', no spaces)",
                "Rename the run, e.g. run_id: my-run_1.",
            )
        for name, cls in (
            ("model", ModelConfig),
            ("codecs", CodecsConfig),
            ("optimizer", OptimizerConfig),
            ("averaging", AveragingConfig),
        ):
            if not isinstance(getattr(self, name), cls):
                raise reject(
                    name,
                    getattr(self, name),
                    f"it must be a {cls.__name__}",
                    f"Build it with {cls.__name__}(...) or load the spec with RunSpec.from_dict.",
                )
        _set(self, "stages", _normalise_stages(self.stages, self.model.n_layers))
        if self.model.subspace is not None and len(self.stages) < 2:
            raise reject(
                "model.subspace",
                _to_plain(self.model.subspace),
                "a subspace-constrained model needs at least 2 stages: it compresses what crosses stage "
                "boundaries, and a single-stage run has none",
                "Split the model into stages (e.g. stages: 2), or leave model.subspace out.",
            )
        check_fields(self, only=("micro_batch_size", "seed", "autocast", "stash_ttl_s"))
        if self.access is not None and not isinstance(self.access, AccessConfig):
            raise reject(
                "access", self.access, "it must be an AccessConfig", "Load the spec with RunSpec.from_dict."
            )
        self._check_pretrained()

    def _check_pretrained(self) -> None:
        """One initial-weights digest per stage; a checkpoint's layers cannot be subspace-constrained."""
        pre = self.pretrained
        if pre is None:
            return
        if not isinstance(pre, PretrainedConfig):
            raise reject(
                "pretrained", pre, "it must be a PretrainedConfig", "Load the spec with RunSpec.from_dict."
            )
        if len(pre.stage_digests) != self.num_stages:
            raise reject(
                "pretrained.stage_digests",
                f"{len(pre.stage_digests)} digests",
                f"there must be one per stage ({self.num_stages})",
                "Digests belong to one stage split: run `swarm init --from-pretrained DIR --stages N` again "
                "to change the split.",
            )
        if self.model.subspace is not None:
            raise reject(
                "model.subspace",
                _to_plain(self.model.subspace),
                "a run that continues a checkpoint cannot constrain its layers to a subspace (the "
                "checkpoint's weights are not in one)",
                "Leave model.subspace out of a --from-pretrained run.",
            )

    # ---- derived quantities -------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_layers(self, stage: int) -> tuple[int, int]:
        """Half-open range ``(first, end)`` of the layers that ``stage`` holds."""
        check_int(
            "stage",
            stage,
            lo=0,
            hi=self.num_stages - 1,
            hint=f"Run {self.run_id!r} has {self.num_stages} stages, numbered 0..{self.num_stages - 1}.",
        )
        return self.stages[stage]

    @property
    def constrained_layers(self) -> tuple[int, int]:
        """Half-open range of the layers that write only into the subspace: every layer before the last
        stage boundary (the last stage's layers, final norm and head stay free). ``(0, 0)`` when the
        model has no ``subspace``."""
        if self.model.subspace is None:
            return (0, 0)
        return (0, self.stages[-1][0])

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens in one full micro-batch (micro_batch_size * seq_len)."""
        return self.micro_batch_size * self.model.seq_len

    def n_params(self, stage: int | None = None) -> int:
        """Parameters of one stage, or of the whole model when ``stage`` is None (no tied weights)."""
        m = self.model
        if stage is None:
            first, end, is_first, is_last = 0, m.n_layers, True, True
        else:
            first, end = self.stage_layers(stage)
            is_first, is_last = stage == 0, stage == self.num_stages - 1
        c_first, c_end = self.constrained_layers
        n_constrained = max(0, min(end, c_end) - max(first, c_first))
        total = (end - first - n_constrained) * m.layer_params()
        total += n_constrained * m.layer_params(constrained=True)
        if is_first:
            k = m.subspace_rank
            # token embedding (only its k-dim part is trained when the model is constrained)
            total += m.vocab_size * (m.d_model if k is None else k)
        if is_last:
            total += m.d_model + m.d_model * m.vocab_size  # final RMSNorm + LM head
        return total

    # ---- serialisation ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly dict of every field (defaults included, stages as explicit ranges)."""
        return _to_plain(self)

    def canonical_bytes(self) -> bytes:
        """Compact sorted-key JSON of :meth:`to_dict`: the bytes that are hashed and published."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

    @functools.cached_property
    def spec_hash(self) -> str:
        """First 16 hex chars of sha256 of the canonical bytes: equal hashes = the same run."""
        return hashlib.sha256(self.canonical_bytes()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSpec:
        """Build and validate a spec from a plain dict (parsed YAML or JSON); unknown keys are rejected."""
        if not isinstance(data, Mapping):
            raise reject(
                "spec", data, "a run spec must be a mapping of keys to values", "Check the spec file."
            )
        try:
            size = len(json.dumps(data, default=repr))
        except (TypeError, ValueError, RecursionError) as e:
            raise ConfigError(f"the run spec could not be measured ({e}); it must be plain data") from e
        if size > MAX_SPEC_BYTES:
            raise ConfigError(
                f"the run spec is {size} bytes as JSON, above the {MAX_SPEC_BYTES}-byte cap (a DHT value "
                "near 45 KB crashes hivemind). Real specs take 1-2 KB: look for a runaway list, e.g. "
                "`stages`, and give a stage count instead of explicit ranges."
            )
        top = _take_keys("", data, cls)
        sections = {
            "model": ModelConfig,
            "codecs": CodecsConfig,
            "optimizer": OptimizerConfig,
            "averaging": AveragingConfig,
            "access": AccessConfig,
            "pretrained": PretrainedConfig,
        }
        for name, section_cls in sections.items():
            if name in ("access", "pretrained") and top.get(name, {}) is None:
                continue  # `access:` with nothing under it: an open run
            if name in top:
                # `optimizer:` with every key commented out parses as None: treat it as "all defaults".
                value = {} if top[name] is None and name in ("optimizer", "averaging") else top[name]
                top[name] = section_cls(**_take_keys(name, value, section_cls))
        return cls(**top)

    @classmethod
    def from_json(cls, data: bytes | str) -> RunSpec:
        """Parse canonical (or any) JSON bytes, e.g. fetched from the DHT; the size is checked first."""
        if len(data) > MAX_SPEC_BYTES:
            raise ConfigError(
                f"the run spec is {len(data)} bytes, above the {MAX_SPEC_BYTES}-byte cap; refusing to "
                "parse it. Whoever published it must shrink it (give `stages` as a count)."
            )
        try:
            parsed = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"the run spec is not valid JSON ({e}); re-publish it with `swarm init`") from e
        return cls.from_dict(parsed)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> RunSpec:
        """Load a run spec file (see examples/tiny.yaml). ``3e-3`` parses as a number, as in YAML 1.2."""
        return cls.from_dict(read_spec_yaml(path))


def read_spec_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A run spec file parsed but not validated (``RunSpec.from_yaml`` validates it; ``swarm init
    --from-pretrained`` takes the sections other than ``model`` from it)."""
    import yaml  # imported here: only file loading needs PyYAML

    try:
        size = os.path.getsize(path)
        if size > MAX_YAML_FILE_BYTES:
            raise ConfigError(
                f"run spec file {os.fspath(path)!r} is {size} bytes, above {MAX_YAML_FILE_BYTES}; "
                "is this the right file? A run spec is a short YAML file like examples/tiny.yaml."
            )
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(
            f"cannot read run spec file {os.fspath(path)!r} ({e.strerror or e}); check the path, "
            "or start from examples/tiny.yaml"
        ) from e
    try:
        data = yaml.load(text, Loader=_spec_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise ConfigError(
            f"run spec file {os.fspath(path)!r} is not valid YAML: {e}. Fix the line shown above."
        ) from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise reject("spec", data, "a run spec must be a mapping of keys to values", "Check the spec file.")
    return data


# ---------------------------------------------------------------------------------------------
# Internals of (de)serialisation
# ---------------------------------------------------------------------------------------------


def _normalise_stages(stages: Any, n_layers: int) -> tuple[tuple[int, int], ...]:
    hint = _stages_hint(n_layers)
    if isinstance(stages, int) and not isinstance(stages, bool):
        return split_layers(n_layers, stages)
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not stages:
        raise reject("stages", stages, "it must be a stage count or a non-empty list of ranges", hint)
    ranges = []
    expected_start = 0
    for i, r in enumerate(stages):
        if isinstance(r, (str, bytes)) or not isinstance(r, Sequence) or len(r) != 2:
            raise reject(f"stages[{i}]", r, "each stage must be a [first, end) pair of layer indices", hint)
        first = check_int(f"stages[{i}][0]", r[0], lo=0, hint=hint)
        end = check_int(f"stages[{i}][1]", r[1], lo=0, hint=hint)
        if first != expected_start:
            raise reject(
                f"stages[{i}]",
                list(r),
                f"it must start at layer {expected_start}, where the previous stage ended "
                "(ranges are half-open, contiguous and in order)",
                hint,
            )
        if end <= first:
            raise reject(
                f"stages[{i}]", list(r), "each stage must hold at least one layer (end > first)", hint
            )
        ranges.append((first, end))
        expected_start = end
    if expected_start != n_layers:
        raise reject(
            "stages",
            [list(r) for r in ranges],
            f"the ranges end at layer {expected_start} but model.n_layers is {n_layers}",
            hint,
        )
    return tuple(ranges)


def _take_keys(section: str, data: Any, cls: type) -> dict[str, Any]:
    """Check a section's keys against ``cls``'s fields: unknown keys and missing required ones fail."""
    where = section or "the run spec"
    if not isinstance(data, Mapping):
        raise reject(
            section or "spec", data, f"{where} must be a mapping of keys to values", "Check the spec file."
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    valid = sorted(fields)
    unknown = [k for k in data if k not in fields]
    if unknown:
        prefix = f"{section}." if section else ""
        close = difflib.get_close_matches(str(unknown[0]), valid, n=1)
        suggestion = f" Did you mean {prefix}{close[0]}?" if close else ""
        names = ", ".join(f"{prefix}{k}" for k in unknown)
        raise ConfigError(
            f"unknown key(s) {names} in {where}.{suggestion} Valid keys{' of ' + section if section else ''} "
            f"are: {', '.join(valid)}."
        )
    missing = [
        name
        for name, f in fields.items()
        if name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        prefix = f"{section}." if section else ""
        raise ConfigError(
            f"{where} is missing required key(s) {', '.join(prefix + m for m in missing)}. "
            "See examples/tiny.yaml for a complete spec."
        )
    return dict(data)


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _to_plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not (f.metadata.get(_OMIT_IF_NONE) and getattr(value, f.name) is None)
            and not (f.metadata.get(_OMIT_IF_DEFAULT) and getattr(value, f.name) == f.default)
        }
    if isinstance(value, (tuple, list)):
        return [_to_plain(v) for v in value]
    return value


@functools.lru_cache(maxsize=1)
def _spec_yaml_loader() -> type:
    """A SafeLoader that reads ``3e-3`` as a float (PyYAML follows YAML 1.1, which needs ``3.0e-3``)
    and rejects duplicate keys (PyYAML silently keeps the last one, hiding typos)."""
    import yaml

    class SpecLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}; each key may appear once", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    # add_implicit_resolver copies the parent's resolver table first, so SafeLoader is unchanged.
    SpecLoader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )
    return SpecLoader
