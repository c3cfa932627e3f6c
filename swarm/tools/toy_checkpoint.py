"""A small random Llama checkpoint made locally: what tests, the fine-tuning example and the memory
benchmark start a run from, so none of them downloads anything.

    from swarm.tools.toy_checkpoint import ToyLlama, make_toy_llama
    make_toy_llama("ckpt/", ToyLlama(n_layers=4, n_kv_heads=2))

writes a Hugging Face model directory (``config.json``, ``model.safetensors`` or shards with an index,
``tokenizer.json`` + ``tokenizer_config.json``) exactly as ``save_pretrained`` does: a
``LlamaForCausalLM`` with transformers' own random init, and a byte-level BPE tokenizer trained with
``tokenizers`` on the default corpus (the standard library's sources, swarm/train/data.py). Needs the
optional ``transformers`` and ``tokenizers`` packages.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ToyLlama", "make_toy_llama", "train_tokenizer"]

EOS = "<|endoftext|>"


@dataclass(frozen=True, kw_only=True)
class ToyLlama:
    """The checkpoint's shape. ``vocab_size`` is the tokenizer's (trained to that size)."""

    vocab_size: int = 512
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 176
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_embeddings: bool = False
    seed: int = 0
    init_std: float = 0.02
    """transformers' ``initializer_range``; larger values make logits (and any mismatch) larger."""
    dtype: str = "float32"
    """``float32`` or ``bfloat16`` (how the weights are stored)."""
    max_shard_size: str | None = None
    """e.g. ``"200KB"`` to write several shards and an index; None = one file."""
    tokenizer_bytes: int = 300_000
    """Text of the default corpus the BPE is trained on."""


@functools.lru_cache(maxsize=4)
def train_tokenizer(vocab_size: int, *, max_bytes: int = 300_000) -> Any:
    """A byte-level BPE (``tokenizers.Tokenizer``) of ``vocab_size`` tokens on the default corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from swarm.train.data import stdlib_documents

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS],
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_documents(max_bytes), trainer)
    return tok


def _llama_config(shape: ToyLlama, vocab_size: int) -> Any:
    import inspect

    from transformers import LlamaConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=shape.d_model,
        intermediate_size=shape.ffn_hidden,
        num_hidden_layers=shape.n_layers,
        num_attention_heads=shape.n_heads,
        num_key_value_heads=shape.n_kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-5,
        initializer_range=shape.init_std,
        tie_word_embeddings=shape.tie_embeddings,
        eos_token_id=vocab_size - 1 if vocab_size else None,
        bos_token_id=None,
        pad_token_id=None,
    )
    rope = {"rope_type": "default", "rope_theta": shape.rope_theta} | dict(shape.rope_scaling or {})
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        kwargs["rope_parameters"] = rope
    else:
        kwargs["rope_theta"] = rope.pop("rope_theta")
        kwargs["rope_scaling"] = rope if rope["rope_type"] != "default" else None
    return LlamaConfig(**kwargs)


def make_toy_llama(out_dir: str | Path, shape: ToyLlama | None = None) -> Path:
    """Write the checkpoint to ``out_dir`` (created) and return it."""
    import torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    shape = shape or ToyLlama()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(shape.vocab_size, max_bytes=shape.tokenizer_bytes)
    vocab = tok.get_vocab_size()
    torch.manual_seed(shape.seed)
    model = LlamaForCausalLM(_llama_config(shape, vocab)).to(getattr(torch, shape.dtype))
    model.config.eos_token_id = tok.token_to_id(EOS)
    kwargs: dict[str, Any] = {} if shape.max_shard_size is None else {"max_shard_size": shape.max_shard_size}
    model.save_pretrained(str(out), **kwargs)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(str(out))
    return out
