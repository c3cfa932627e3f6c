"""The model: a GPT/Llama-style decoder cut into pipeline stages, each a plain ``nn.Module``.

(Over 400 lines on purpose: the layers, their seeded init and the stage split are one definition of
the model, pinned together by the spec hash; split, a change to one would hide what the others assume.)

Stage 0 holds the token embedding, the last stage holds the final RMSNorm, the LM head and (via
:func:`lm_loss`) the loss; every stage holds its share of the transformer blocks. Blocks are pre-norm
residual (RMSNorm -> causal attention with RoPE -> residual; RMSNorm -> SwiGLU -> residual), with no
biases anywhere.

Same weights everywhere (the property the swarm relies on): each block is initialised from a seed
derived from ``(spec.seed, layer index)`` with a local ``torch.Generator`` on CPU, and the embedding
and head have their own derived seeds; the values are drawn so that they are bit-identical on every
CPU (see Note [portable init] in swarm/run/init.py). So a layer's initial weights depend neither on the machine nor
on how the layers are split into stages, and a peer that starts a stage from scratch agrees with
every other peer that does. Parameter names use the global layer index (``layers.5.attn.qkv.weight``)
so state dicts move between different stage splits unchanged.

Subspace-constrained models (``model.subspace`` in the spec, see swarm/run/subspace.py): every module that
writes into the residual stream before the last stage boundary (token embedding, attention output and
SwiGLU down projections of the layers in ``spec.constrained_layers``) is reparametrised as W = U A
with the fixed, seed-derived orthonormal basis U (d x k) and a trainable A (k x in), and the token
embedding becomes E_fix[t] + U A_emb[t] with a fixed random E_fix. See Note [subspace reparametrisation].

Try it::

    python -c "from swarm.run.spec import RunSpec; from swarm.run.model import build_model; \
m = build_model(RunSpec.from_yaml('examples/tiny.yaml')); print(sum(p.numel() for p in m.parameters()))"
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from swarm.errors import ConfigError, RequestError
from swarm.run.init import INIT_STD, derive_seed, fill_bell_
from swarm.run.spec import ModelConfig, RopeScalingConfig, RunSpec
from swarm.run.subspace import fixed_embedding, subspace_basis

__all__ = [
    "StageModule",
    "SubspaceLinear",
    "SubspaceEmbedding",
    "SwarmModel",
    "build_stage",
    "stage_shapes",
    "build_model",
    "lm_loss",
    "autocast_dtype",
    "count_parameters",
]

# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 so bf16 activations do not lose the normaliser."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., C) -> (..., C)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight.type_as(x)


class Rotary(nn.Module):
    """RoPE tables for positions 0..seq_len-1, kept as non-persistent buffers.

    Non-persistent: they are a pure function of the config, so they stay out of state dicts (and out
    of what peers send each other) yet still follow ``.to(device)``.
    """

    def __init__(self, head_dim: int, seq_len: int, theta: float, scaling: RopeScalingConfig | None = None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if scaling is not None:
            inv_freq = scaled_frequencies(inv_freq, scaling)
        positions = torch.arange(seq_len, dtype=torch.float64)
        angles = torch.outer(positions, inv_freq)  # (T_max, D/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, H, T, D) -> (B, H, T, D)
        t = x.shape[-2]
        cos = self.cos[:t].to(x.dtype)  # (T, D/2), broadcast over (B, H)
        sin = self.sin[:t].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)  # rotate the pairs (x1[i], x2[i]) by angle[t, i]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def scaled_frequencies(inv_freq: torch.Tensor, scaling: RopeScalingConfig) -> torch.Tensor:
    """RoPE frequencies after ``scaling``, by the rules of transformers' ``linear`` and ``llama3`` RoPE."""
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    assert scaling.low_freq_factor is not None and scaling.high_freq_factor is not None  # checked by the spec
    assert scaling.original_max_position_embeddings is not None
    old_len = float(scaling.original_max_position_embeddings)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / scaling.low_freq_factor, old_len / scaling.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


# Note [subspace reparametrisation]: a constrained projection stores only A (k x in, the parameter
# ``coef``) and computes U (A x), so W = U A lies in span(U) for every value A can take. The stage's
# optimizer steps A like any other parameter and needs to know nothing: projecting W <- U U^T W
# after each step would instead need a hook in every optimizer, in weight averaging and in state
# loading (a peer that loaded or averaged weights without projecting would silently break the
# boundary's exactness). Reparametrising also makes the projection cheaper (in*k + k*d multiply-adds
# instead of in*d) and the stage smaller. U and E_fix are non-persistent buffers: a pure function of
# the spec (swarm/run/subspace.py), so they stay out of state dicts and of what peers send each other.


class SubspaceLinear(nn.Module):
    """A bias-free linear map ``in_features -> d`` whose weight is U A: it writes only into span(U)."""

    def __init__(self, in_features: int, d_model: int, rank: int):
        super().__init__()
        self.in_features, self.d_model, self.rank = in_features, d_model, rank
        self.coef = nn.Parameter(torch.empty(rank, in_features))  # A (k, in)
        self.register_buffer("basis", torch.empty(d_model, rank), persistent=False)  # U (d, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., d)
        return F.linear(F.linear(x, self.coef), self.basis)  # U (A x), never forming U A

    def weight(self) -> torch.Tensor:
        """The effective (d, in) weight U A (for inspection and tests; forward never builds it)."""
        return self.basis @ self.coef


class SubspaceEmbedding(nn.Module):
    """Token embedding E_fix[t] + U A[t]: a fixed full-rank part plus a trained part inside span(U).

    The fixed part keeps tokens distinguishable in all d dimensions although only k are trained, and
    the receiver of a boundary can rebuild it from the token ids alone.
    """

    def __init__(self, vocab_size: int, d_model: int, rank: int):
        super().__init__()
        self.vocab_size, self.d_model, self.rank = vocab_size, d_model, rank
        self.coef = nn.Parameter(torch.empty(vocab_size, rank))  # A (V, k)
        self.register_buffer("basis", torch.empty(d_model, rank), persistent=False)  # U (d, k)
        self.register_buffer("fixed", torch.empty(vocab_size, d_model), persistent=False)  # E_fix (V, d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, C)
        trained = F.linear(F.embedding(tokens, self.coef), self.basis)  # (B, T, k) -> (B, T, C)
        return F.embedding(tokens, self.fixed).to(trained.dtype) + trained


class Attention(nn.Module):
    """Causal self-attention with RoPE; with ``n_kv_heads`` < ``n_heads``, grouped-query attention (the
    fused ``qkv`` then has ``d_model + 2 * n_kv_heads * head_dim`` rows: q, then k, then v)."""

    def __init__(self, cfg: ModelConfig, rank: int | None = None):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.kv_width = cfg.kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, cfg.d_model + 2 * self.kv_width, bias=False)
        self.proj: nn.Module = (
            nn.Linear(cfg.d_model, cfg.d_model, bias=False)
            if rank is None
            else SubspaceLinear(cfg.d_model, cfg.d_model, rank)
        )

    def forward(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        if self.n_kv_heads != self.n_heads:
            return self._grouped(x, rotary)
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        q, k = rotary(q), rotary(k)  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))  # (B, T, C)

    def _grouped(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        d = c // self.n_heads
        q, k, v = self.qkv(x).split([c, self.kv_width, self.kv_width], dim=-1)
        q = q.view(b, t, self.n_heads, d).transpose(1, 2)  # (B, H, T, D)
        k, v = (z.view(b, t, self.n_kv_heads, d).transpose(1, 2) for z in (k, v))  # (B, KV, T, D)
        q, k = rotary(q), rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))  # (B, T, C)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, rank: int | None = None):
        super().__init__()
        hidden = cfg.ffn_hidden_size
        self.gate = nn.Linear(cfg.d_model, hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, hidden, bias=False)
        self.down: nn.Module = (
            nn.Linear(hidden, cfg.d_model, bias=False)
            if rank is None
            else SubspaceLinear(hidden, cfg.d_model, rank)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """One pre-norm transformer block; with ``rank`` set, both residual writes stay in span(U)."""

    def __init__(self, cfg: ModelConfig, rank: int | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, rank)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg, rank)

    def forward(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        x = x + self.attn(self.attn_norm(x), rotary)
        return x + self.ffn(self.ffn_norm(x))


# ---------------------------------------------------------------------------------------------
# Deterministic initialisation
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def _init_(module: nn.Module, seed: int, *, residual_std: float) -> None:
    """Initialise every parameter of ``module`` in registration order from one local generator.

    Norm weights start at 1; matrices get std 0.02 (see Note [portable init], swarm/run/init.py), except residual-branch
    output projections (attention ``proj``, SwiGLU ``down``), which use ``residual_std`` so the
    residual stream's variance does not grow with depth (GPT-2's 1/sqrt(2 * n_layers)).

    Subspace modules draw as many values as their unconstrained counterparts and keep a slice, so
    every other parameter of a constrained layer gets exactly the values it has in the ordinary
    model (same generator stream). A constrained projection keeps k of the d rows at the ordinary
    std, so its branch writes sqrt(k / d) as much into the residual stream at init as a full
    projection. Rescaling A by sqrt(d / k) to match the full projection's output size trained worse
    (setup of benchmarks/subspace_convergence.py, d = 256, k = 8, 150 steps: held-out loss 2.339 vs
    2.225 with this init; the ordinary model reached 2.181). The trained embedding part keeps k of
    the d columns at the usual std: the fixed part E_fix already gives the embedding its full size.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in module.named_parameters():
        owner = module.get_submodule(name.rpartition(".")[0])
        if isinstance(owner, SubspaceLinear):
            full = torch.empty(owner.d_model, owner.in_features)
            fill_bell_(full, residual_std, gen)
            p.copy_(full[: owner.rank])
        elif isinstance(owner, SubspaceEmbedding):
            full = torch.empty(owner.vocab_size, owner.d_model)
            fill_bell_(full, INIT_STD, gen)
            p.copy_(full[:, : owner.rank])
        elif p.dim() == 1:  # RMSNorm weight
            p.fill_(1.0)
        elif name.endswith(("attn.proj.weight", "ffn.down.weight")):
            fill_bell_(p, residual_std, gen)
        else:
            fill_bell_(p, INIT_STD, gen)


def _seeded(
    factory: Callable[[], nn.Module],
    seed: int,
    residual_std: float,
    subspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    draw: bool = True,
) -> nn.Module:
    """``factory()`` built on the meta device, allocated on CPU, then initialised from ``seed``.

    ``subspace``: the run's ``(U, E_fix)``, copied into the buffers of any subspace module.
    ``draw=False`` leaves the module on the meta device, holding no memory: the caller assigns its
    weights (``load_state_dict(..., assign=True)``, see ``build_stage``).
    """
    with torch.device("meta"):
        module = factory()
    if not draw and subspace is None:
        return module
    module = module.to_empty(device="cpu")
    if draw:
        _init_(module, seed, residual_std=residual_std)
    for m in module.modules():
        if isinstance(m, (SubspaceLinear, SubspaceEmbedding)):
            assert subspace is not None, "a subspace module needs the run's basis"
            m.basis = subspace[0].clone()
            if isinstance(m, SubspaceEmbedding):
                m.fixed = subspace[1].clone()
    return module


# ---------------------------------------------------------------------------------------------
# Stages and the whole model
# ---------------------------------------------------------------------------------------------


class StageModule(nn.Module):
    """Layers ``[first, end)`` of the model, plus the embedding (stage 0) or norm + head (last stage).

    Input: ``LongTensor (B, T)`` token ids on stage 0, float hidden states ``(B, T, C)`` elsewhere.
    Output: hidden states ``(B, T, C)``, or logits ``(B, T, vocab)`` on the last stage.
    """

    def __init__(self, spec: RunSpec, stage: int, *, draw: bool = True):
        super().__init__()
        cfg = spec.model
        self.cfg = cfg
        self.stage = stage
        self.num_stages = spec.num_stages
        self.first_layer, self.end_layer = spec.stage_layers(stage)
        self.is_first = stage == 0
        self.is_last = stage == spec.num_stages - 1

        # Parts are created on the meta device (no memory, no draws from the global RNG, which
        # nn.Linear's default init would advance), then allocated on CPU and drawn from their seeds
        # (``draw=False``: left uninitialised, for weights loaded right after, see ``build_stage``).
        std = INIT_STD / math.sqrt(2 * cfg.n_layers)
        seed = spec.seed
        rank = cfg.subspace_rank
        self.constrained_layers = spec.constrained_layers
        c_first, c_end = self.constrained_layers
        needs_subspace = rank is not None and (self.is_first or self.first_layer < c_end)
        subspace = _subspace_tensors(spec) if needs_subspace else None
        embed_seed = derive_seed(seed, "embed")
        if not self.is_first:
            self.embed = None
        elif rank is None:
            self.embed = _seeded(
                lambda: nn.Embedding(cfg.vocab_size, cfg.d_model), embed_seed, std, draw=draw
            )
        else:
            self.embed = _seeded(
                lambda: SubspaceEmbedding(cfg.vocab_size, cfg.d_model, rank),
                embed_seed,
                std,
                subspace,
                draw=draw,
            )
        self.rotary = Rotary(cfg.head_dim, cfg.seq_len, cfg.rope_theta, cfg.rope_scaling)

        def block(i: int) -> nn.Module:
            constrained = rank is not None and c_first <= i < c_end
            factory = (lambda: Block(cfg, rank)) if constrained else (lambda: Block(cfg))
            layer_seed = derive_seed(seed, "layer", i)
            return _seeded(factory, layer_seed, std, subspace if constrained else None, draw=draw)

        # Keyed by the global layer index so names do not depend on the stage split.
        self.layers = nn.ModuleDict({str(i): block(i) for i in range(self.first_layer, self.end_layer)})
        # RMSNorm weights start at 1 and draw nothing, so the seed is irrelevant.
        self.norm = _seeded(lambda: RMSNorm(cfg.d_model, cfg.norm_eps), 0, std) if self.is_last else None
        # A tied head draws the embedding's values: the embedding's seed, the same (V, C) matrix.
        head_seed = embed_seed if cfg.tie_embeddings else derive_seed(seed, "head")
        self.head = (
            _seeded(lambda: nn.Linear(cfg.d_model, cfg.vocab_size, bias=False), head_seed, std, draw=draw)
            if self.is_last
            else None
        )

    def check_input(self, x: torch.Tensor) -> None:
        """Refuse an input this stage cannot take, before any compute (raises ``RequestError``)."""
        if self.is_first:
            if x.dim() != 2 or x.dtype not in (torch.int64, torch.int32):
                raise RequestError(
                    f"stage 0 takes token ids of shape (B, T) and dtype int64, got {tuple(x.shape)} "
                    f"{x.dtype}; send the micro-batch's token ids, not hidden states"
                )
        elif x.dim() != 3 or x.shape[-1] != self.cfg.d_model or not x.is_floating_point():
            raise RequestError(
                f"stage {self.stage} takes float hidden states of shape (B, T, {self.cfg.d_model}), got "
                f"{tuple(x.shape)} {x.dtype}; check that the sender serves the same run spec"
            )
        if x.shape[0] < 1 or not 1 <= x.shape[1] <= self.cfg.seq_len:
            raise RequestError(
                f"stage {self.stage} got batch {x.shape[0]} x length {x.shape[1]}; the run allows "
                f"1..{self.cfg.seq_len} tokens per sequence (model.seq_len) and at least one sequence"
            )
        # An out-of-range id is an IndexError on CPU but a device-side assert on CUDA, which kills the
        # whole CUDA context of the peer: one bad request must not take a GPU peer down.
        if self.is_first and (int(x.min()) < 0 or int(x.max()) >= self.cfg.vocab_size):
            raise RequestError(
                f"stage 0 got token ids in [{int(x.min())}, {int(x.max())}], outside "
                f"0..{self.cfg.vocab_size - 1} (model.vocab_size); check that the trainer's tokenizer "
                "matches the run spec"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        if self.embed is not None:
            x = self.embed(x)  # (B, T) -> (B, T, C)
        else:
            # Hidden states arrive in whatever dtype the codec decoded (e.g. bf16); the residual
            # stream stays in the parameters' dtype, as it would inside one unsplit model.
            x = x.to(self.layers[str(self.first_layer)].attn_norm.weight.dtype)  # (B, T, C)
        for block in self.layers.values():
            x = block(x, self.rotary)  # (B, T, C)
        if self.head is not None:
            x = self.head(self.norm(x))  # (B, T, C) -> (B, T, vocab)
        return x


class SwarmModel(nn.Module):
    """All stages in one process (for tests, evaluation and generation): chaining = the whole model."""

    def __init__(self, stages: list[StageModule]):
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        x = tokens
        for stage in self.stages:
            x = stage(x)
        return x


def _subspace_tensors(spec: RunSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's (U, E_fix), built where every peer builds them (swarm/run/subspace.py)."""
    return subspace_basis(spec), fixed_embedding(spec)


def build_stage(
    spec: RunSpec,
    stage: int,
    *,
    device: torch.device | str | None = None,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> StageModule:
    """Stage ``stage`` of ``spec`` with its deterministic initial weights, in float32.

    Weights are always drawn on CPU (CPU and CUDA generators differ) and then moved to ``device``.
    ``weights``: the stage's whole state dict in float32 (e.g. a checkpoint's, ``swarm.run.pretrained``),
    used instead of drawing anything: the module takes the tensors themselves (no copy, so a peer holds
    a stage's weights once while it starts); a missing, extra or misshapen tensor raises ``ConfigError``.
    """
    module = StageModule(spec, stage, draw=weights is None)
    if weights is not None:
        try:
            module.load_state_dict(weights, strict=True, assign=True)
        except RuntimeError as e:
            raise ConfigError(
                f"the weights given for stage {stage} of run {spec.run_id!r} do not fit its layers: {e}"
            ) from None
    return module.to(device) if device is not None else module


def stage_shapes(spec: RunSpec, stage: int) -> dict[str, torch.Size]:
    """The stage's parameter names and shapes, in order, without drawing or allocating its weights."""
    return {name: p.shape for name, p in StageModule(spec, stage, draw=False).named_parameters()}


def build_model(spec: RunSpec, *, device: torch.device | str | None = None) -> SwarmModel:
    """Every stage of ``spec`` chained; its weights equal those of the separately built stages."""
    model = SwarmModel([build_stage(spec, i) for i in range(spec.num_stages)])
    return model.to(device) if device is not None else model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; logits ``(B, T, V)``, targets ``(B, T)`` (already shifted).

    Computed in float32 even under autocast: a bf16 log-softmax over a large vocabulary loses digits.
    """
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def autocast_dtype(spec: RunSpec, device: torch.device | str) -> torch.dtype | None:
    """The dtype to autocast to on ``device`` for ``spec.autocast``, or None for full precision."""
    device_type = torch.device(device).type
    mode = spec.autocast
    if mode == "none":
        return None
    if mode == "auto":
        if device_type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return None
    if mode == "bf16":
        return torch.bfloat16
    # fp16
    if device_type != "cuda":
        raise ConfigError(
            f"autocast = 'fp16' is invalid on device {device_type!r}: fp16 autocast needs a CUDA GPU. "
            "Use autocast: bf16 or none for CPU peers (or auto, which picks the best per device)."
        )
    return torch.float16


def count_parameters(spec: RunSpec, stage: int | None = None) -> int:
    """Parameters of one stage or the whole model, without building it (see ``RunSpec.n_params``)."""
    return spec.n_params(stage)
