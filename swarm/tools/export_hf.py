"""The Hugging Face Llama layout of an export: transformers' parameter names and ``config.json``.

The model maps onto ``LlamaForCausalLM`` exactly (pre-norm RMSNorm, SwiGLU, no biases, RoPE with the
rotate-half pairing ``(x[i], x[i + D/2])`` that transformers uses, so q/k need no permutation);
``tests/test_export.py`` checks logits against transformers. ``swarm.run.pretrained`` reads the same
names when a run starts from a Llama checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from swarm.errors import ConfigError
from swarm.run.pretrained import _HF_TOP, _hf_layer_names

if TYPE_CHECKING:
    import torch

    from swarm.run.spec import RunSpec


def to_hf_state_dict(spec: RunSpec, dense: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Dense weights under transformers' ``LlamaForCausalLM`` names.

    The fused ``qkv`` (C + 2 KV, C) splits row-wise into q (C, C), k and v (KV, C) (KV = n_kv_heads *
    head_dim; C without grouped-query attention) with heads in row blocks of ``head_dim``, which is
    Llama's layout; RoPE pairs match (module docstring), so no permutation.
    """
    sizes = qkv_sizes(spec)
    out = {_HF_TOP[name]: dense[name] for name in _HF_TOP}
    for i in range(spec.model.n_layers):
        for ours, theirs in _hf_layer_names(i).items():
            out[theirs] = dense[ours]
        q, k, v = dense[f"layers.{i}.attn.qkv.weight"].split(sizes, dim=0)
        prefix = f"model.layers.{i}.self_attn."
        out[prefix + "q_proj.weight"], out[prefix + "k_proj.weight"], out[prefix + "v_proj.weight"] = (
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
        )
    return out


def qkv_sizes(spec: RunSpec) -> list[int]:
    """Rows of q, k and v in the fused ``qkv`` weight of every layer."""
    m = spec.model
    kv = m.kv_heads * m.head_dim
    return [m.d_model, kv, kv]


def from_hf_state_dict(spec: RunSpec, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_hf_state_dict` (raises ``ConfigError`` naming a missing tensor)."""
    import torch

    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise ConfigError(f"the export lacks tensor {name!r}; it is incomplete or not a swarm export")
        return hf[name]

    out = {ours: get(theirs) for ours, theirs in _HF_TOP.items()}
    for i in range(spec.model.n_layers):
        for ours, theirs in _hf_layer_names(i).items():
            out[ours] = get(theirs)
        prefix = f"model.layers.{i}.self_attn."
        out[f"layers.{i}.attn.qkv.weight"] = torch.cat(
            [get(prefix + f"{p}_proj.weight") for p in ("q", "k", "v")], dim=0
        )
    return out


def _require_transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "--format hf needs the `transformers` package, which is not installed; install it with "
            "`pip install transformers` (or export with --format safetensors)"
        ) from None
    return transformers


def hf_config_dict(spec: RunSpec) -> dict[str, Any]:
    """``config.json`` of the equivalent ``LlamaForCausalLM``, made by transformers' own ``LlamaConfig``.

    Raises ``ConfigError`` naming the pip package when transformers is missing.
    """
    import inspect

    LlamaConfig = _require_transformers().LlamaConfig  # noqa: N806 (a class)
    m = spec.model
    params = inspect.signature(LlamaConfig.__init__).parameters
    kwargs: dict[str, Any] = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.kv_heads,
        head_dim=m.head_dim,
        hidden_act="silu",
        max_position_embeddings=_max_positions(spec),
        rms_norm_eps=m.norm_eps,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        architectures=["LlamaForCausalLM"],
    )
    rope = hf_rope_parameters(spec)
    if "rope_parameters" in params:  # transformers >= 5
        kwargs["rope_parameters"] = rope
    else:
        kwargs["rope_theta"] = rope.pop("rope_theta")
        if rope["rope_type"] != "default":
            kwargs["rope_scaling"] = rope
    kwargs["dtype" if "dtype" in params else "torch_dtype"] = "float32"
    return LlamaConfig(**kwargs).to_dict()


def _max_positions(spec: RunSpec) -> int:
    """``max_position_embeddings`` of the export: the run's ``seq_len``, or for llama3 RoPE scaling at
    least the scaled context (transformers expects it above ``original_max_position_embeddings``)."""
    m = spec.model
    scaling = m.rope_scaling
    if scaling is None or scaling.type != "llama3":
        return m.seq_len
    assert scaling.original_max_position_embeddings is not None  # checked by the spec
    return max(m.seq_len, int(scaling.original_max_position_embeddings * scaling.factor))


def hf_rope_parameters(spec: RunSpec) -> dict[str, Any]:
    """transformers' ``rope_parameters`` for the run's RoPE (base and scaling)."""
    m = spec.model
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(m.rope_theta)}
    scaling = m.rope_scaling
    if scaling is not None:
        rope["rope_type"] = scaling.type
        rope["factor"] = float(scaling.factor)
        if scaling.type == "llama3":
            rope["low_freq_factor"] = float(scaling.low_freq_factor)  # type: ignore[arg-type]
            rope["high_freq_factor"] = float(scaling.high_freq_factor)  # type: ignore[arg-type]
            rope["original_max_position_embeddings"] = scaling.original_max_position_embeddings
    return rope
