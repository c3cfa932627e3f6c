"""Runs from a Hugging Face Llama checkpoint (swarm/run/pretrained.py): config mapping, refusals, per-stage
reading and digests, and the round trip checkpoint -> run -> export at version 0 -> transformers.

Every checkpoint is a small random ``LlamaForCausalLM`` made here (swarm/tools/toy_checkpoint.py): nothing
is downloaded. Skipped when the optional transformers/tokenizers packages are missing.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is optional: pip install transformers")
pytest.importorskip("tokenizers", reason="tokenizers is optional: pip install tokenizers")

from swarm.errors import ConfigError  # noqa: E402
from swarm.run.model import SwarmModel, build_stage  # noqa: E402
from swarm.run.pretrained import (  # noqa: E402
    check_stage_weights,
    model_config_from_hf,
    read_stage_weights,
    spec_from_pretrained,
    stage_digest,
    stage_tensor_names,
)
from swarm.run.spec import RunSpec  # noqa: E402
from swarm.tools.export import dense_stage_weights, write_export  # noqa: E402
from swarm.tools.toy_checkpoint import ToyLlama, make_toy_llama  # noqa: E402

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _hf(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _swarm_model(path, spec: RunSpec) -> SwarmModel:
    stages = [build_stage(spec, s, weights=read_stage_weights(path, spec, s)) for s in range(spec.num_stages)]
    return SwarmModel(stages).eval()


def _tokens(spec: RunSpec, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.model.vocab_size, (2, 48), generator=g)


CASES = {
    "dense": ToyLlama(n_kv_heads=4, init_std=0.08),
    "gqa": ToyLlama(n_kv_heads=2, init_std=0.08),
    "gqa-tied-llama3-bf16-sharded": ToyLlama(
        n_kv_heads=1,
        tie_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE,
        dtype="bfloat16",
        max_shard_size="100KB",
        init_std=0.08,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_version_0_export_gives_the_checkpoints_logits(tmp_path, case):
    """Checkpoint -> spec -> stages from the checkpoint -> export (version 0) -> transformers: <= 1e-4."""
    ckpt = make_toy_llama(tmp_path / "ckpt", CASES[case])
    spec = spec_from_pretrained(ckpt, stages=2, seq_len=64)
    tokens = _tokens(spec)
    with torch.no_grad():
        original = _hf(ckpt)(tokens).logits
        ours = _swarm_model(ckpt, spec)(tokens)
    assert original.abs().max() > 0.05  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(ours, original, rtol=0, atol=1e-4)
    dense = {}
    model = _swarm_model(ckpt, spec)
    for stage in model.stages:
        dense.update(dense_stage_weights(stage))
    out = write_export(tmp_path / "export", spec, dense, format="hf")
    with torch.no_grad():
        exported = _hf(out)(tokens).logits
    torch.testing.assert_close(exported, original, rtol=0, atol=1e-4)


def test_config_maps_onto_the_model_section(tmp_path):
    ckpt = make_toy_llama(tmp_path / "ckpt", CASES["gqa-tied-llama3-bf16-sharded"])
    spec = spec_from_pretrained(ckpt, stages=4, run_id="ft")
    m = spec.model
    assert (m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_hidden) == (64, 4, 4, 1, 176)
    assert m.tie_embeddings and m.rope_theta == 500000.0 and m.norm_eps == 1e-5
    assert m.rope_scaling is not None and m.rope_scaling.type == "llama3" and m.rope_scaling.factor == 8.0
    assert m.seq_len == 256 and m.vocab_size == json.loads((ckpt / "config.json").read_text())["vocab_size"]
    assert spec.run_id == "ft" and spec.num_stages == 4 and len(spec.pretrained.stage_digests) == 4
    assert spec.pretrained.source == "ckpt" and spec.pretrained.tokenizer is not None
    assert spec.optimizer.name == "adamw"  # fine-tuning defaults, not muon
    # the spec survives the DHT's JSON round trip with the same hash
    assert RunSpec.from_json(spec.canonical_bytes()).spec_hash == spec.spec_hash
    # a base spec sets everything but the model
    base = {"optimizer": {"name": "adamw", "lr": 3e-3}, "micro_batch_size": 2, "model": {"seq_len": 32}}
    custom = spec_from_pretrained(ckpt, base=base, stages=2)
    assert custom.optimizer.lr == 3e-3 and custom.micro_batch_size == 2 and custom.model.seq_len == 32
    with pytest.raises(ConfigError, match="only model.seq_len may be given"):
        spec_from_pretrained(ckpt, base={"model": {"d_model": 8}})


BASE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
    "max_position_embeddings": 128,
    "hidden_act": "silu",
}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, r"architecture = 'qwen2'.*Llama"),
        ({"hidden_act": "gelu"}, r"hidden_act = 'gelu' is not supported: the SwiGLU blocks use SiLU"),
        ({"attention_bias": True}, r"attention_bias = True is not supported: .*no biases"),
        ({"mlp_bias": True}, r"mlp_bias = True"),
        ({"head_dim": 32}, r"head_dim = 32 is not supported: the head size must be .* = 16"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope scaling = 'yarn' is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, r"rope scaling = 'dynamic'"),
        ({"sliding_window": 4096}, r"sliding_window = 4096 is not supported"),
        ({"quantization_config": {"bits": 4}}, r"quantization_config = .* plain float"),
        ({"num_key_value_heads": 3}, r"model.n_kv_heads = 3 is invalid: it must divide model.n_heads \(4\)"),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor = 0.5 is not supported"),
    ],
)
def test_what_the_model_cannot_represent_is_refused_by_name(change, match):
    with pytest.raises(ConfigError, match=match):
        model_config_from_hf(BASE_CONFIG | change)


def test_supported_config_variants():
    m = model_config_from_hf(BASE_CONFIG | {"num_key_value_heads": 4, "rope_theta": 5e5}, seq_len=32)
    assert m.n_kv_heads is None and m.rope_theta == 5e5 and m.seq_len == 32  # MHA: the field stays unset
    linear = model_config_from_hf(BASE_CONFIG | {"rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.rope_scaling.type == "linear" and linear.seq_len == 128


def test_a_stage_reads_only_its_own_tensors(tmp_path, monkeypatch):
    import safetensors

    ckpt = make_toy_llama(tmp_path / "ckpt", ToyLlama(max_shard_size="100KB"))
    spec = spec_from_pretrained(ckpt, stages=4)
    read: list[str] = []
    real = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.inner = real(*args, **kwargs)

        def __enter__(self):
            self.file = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_tensor(self, name):
            read.append(name)
            return self.file.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    weights = read_stage_weights(ckpt, spec, 1)
    assert sorted(read) == stage_tensor_names(spec, 1)
    assert all(n.startswith("model.layers.1.") for n in read)
    assert set(weights) == set(build_stage(spec, 1).state_dict())


def test_weights_of_another_checkpoint_fail_the_digest(tmp_path):
    a = make_toy_llama(tmp_path / "a", ToyLlama(seed=0))
    b = make_toy_llama(tmp_path / "b", ToyLlama(seed=1))
    spec = spec_from_pretrained(a, stages=2)
    check_stage_weights(spec, 1, read_stage_weights(a, spec, 1), source="a")
    with pytest.raises(
        ConfigError, match=r"initial weights of stage 1 from --weights b have digest .* Pass --weights"
    ):
        check_stage_weights(spec, 1, read_stage_weights(b, spec, 1), source="--weights b")
    w = read_stage_weights(a, spec, 0)
    assert stage_digest(w) == spec.pretrained.stage_digests[0]
    w["embed.weight"][0, 0] += 1e-3
    assert stage_digest(w) != spec.pretrained.stage_digests[0]


def test_spec_checks_digests_against_stages(tmp_path):
    ckpt = make_toy_llama(tmp_path / "ckpt", ToyLlama())
    d = spec_from_pretrained(ckpt, stages=2).to_dict()
    d["stages"] = 4
    with pytest.raises(ConfigError, match=r"pretrained.stage_digests .* one per stage \(4\)"):
        RunSpec.from_dict(d)
    d["stages"] = 2
    d["model"]["subspace"] = {"rank": 8}
    with pytest.raises(ConfigError, match="cannot constrain its layers to a subspace"):
        RunSpec.from_dict(d)


def test_keeper_initial_snapshot_is_what_a_peer_imports_at_version_0(tmp_path):
    from peer.averaging import _unflatten
    from peer.compute import StageCompute
    from swarm.run.pretrained import check_initial_state
    from swarm.tools.keeper import initial_snapshot, stage_state_numel

    ckpt = make_toy_llama(tmp_path / "ckpt", ToyLlama())
    spec = spec_from_pretrained(ckpt, stages=2)
    snap = initial_snapshot(spec, 1, str(ckpt), taken_at=0.0)
    assert snap.version == 0 and snap.flat.numel() == stage_state_numel(spec, 1)
    compute = StageCompute(spec, 1)  # drawn from the seed: not the checkpoint's weights
    shapes = [t.shape for t in compute.optimizer.state_tensors()]
    tensors = _unflatten(snap.flat, shapes)
    check_initial_state(spec, 1, snap.meta, tensors, source="the keeper")
    compute.import_state(snap.meta, tensors)
    expected = read_stage_weights(ckpt, spec, 1)
    for name, value in compute.params().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)
    tensors[0] = tensors[0] + 1.0  # a donor that sends other weights at version 0 is caught
    with pytest.raises(ConfigError, match="initial weights of stage 1 from the keeper"):
        check_initial_state(spec, 1, snap.meta, tensors, source="the keeper")
    other = make_toy_llama(tmp_path / "other", ToyLlama(seed=3))
    with pytest.raises(ConfigError, match="digest"):
        initial_snapshot(spec, 1, str(other), taken_at=0.0)


def test_the_run_uses_the_checkpoints_tokenizer(tmp_path, monkeypatch):
    from swarm.train.data import ByteTokenizer, load_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ckpt = make_toy_llama(tmp_path / "ckpt", ToyLlama())
    other = make_toy_llama(tmp_path / "other", ToyLlama(vocab_size=300))
    spec = spec_from_pretrained(ckpt, stages=2)
    vocab = spec.model.vocab_size
    with pytest.raises(ConfigError, match=r"trains with its tokenizer .* pass --tokenizer DIR"):
        load_tokenizer(None, vocab_size=vocab, pretrained=spec.pretrained)
    with pytest.raises(ConfigError, match=r"was made with the tokenizer of 'ckpt'"):
        load_tokenizer(str(other), vocab_size=vocab, pretrained=spec.pretrained)
    tok = load_tokenizer(str(ckpt), vocab_size=vocab, pretrained=spec.pretrained)  # a directory is fine
    assert not isinstance(tok, ByteTokenizer) and tok.vocab_size == vocab
    # given once, it is remembered: the default from then on (as after `swarm init --from-pretrained`)
    again = load_tokenizer(None, vocab_size=vocab, pretrained=spec.pretrained)
    assert again.encode("def f(x):") == tok.encode("def f(x):") and again.decode(tok.encode("abc")) == "abc"
    assert isinstance(load_tokenizer(None, vocab_size=256), ByteTokenizer)  # other runs: bytes


def test_specs_without_the_new_fields_keep_their_hash():
    """n_kv_heads, rope_scaling, tie_embeddings and pretrained stay out of the canonical bytes when unset
    (the hashes below are those of main before they existed)."""
    from pathlib import Path

    examples = Path(__file__).resolve().parent.parent / "examples"
    before = {
        "bench.yaml": "df98a7a5506ef47c",
        "demo.yaml": "ef3750670a2cface",  # recompute: false since; the same hash as main with that line
        "subspace.yaml": "613f721c00687c29",
        "tiny.yaml": "47f40003d87cdf87",
    }
    for name, spec_hash in before.items():
        spec = RunSpec.from_yaml(examples / name)
        assert spec.spec_hash == spec_hash, name
        keys = spec.to_dict()
        assert "pretrained" not in keys and not {"n_kv_heads", "rope_scaling", "tie_embeddings"} & set(
            keys["model"]
        )
    tied = RunSpec.from_yaml(examples / "tiny.yaml").to_dict()
    tied["model"] |= {"tie_embeddings": False, "n_kv_heads": None}
    assert RunSpec.from_dict(tied).spec_hash == before["tiny.yaml"]
    tied["model"]["tie_embeddings"] = True
    assert RunSpec.from_dict(tied).spec_hash != before["tiny.yaml"]


def test_tied_and_grouped_query_models_from_a_seed():
    """The new options work without a checkpoint too: a tied head starts equal to the embedding, and a
    grouped-query model has the parameter count the spec computes."""
    d = {
        "run_id": "gqa",
        "model": {
            "vocab_size": 64,
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "seq_len": 16,
        },
        "stages": 2,
        "codecs": {"activations": "none", "gradients": "none"},
        "micro_batch_size": 2,
    }
    d["model"]["tie_embeddings"] = True
    spec = RunSpec.from_dict(d)
    first, last = build_stage(spec, 0), build_stage(spec, 1)
    torch.testing.assert_close(last.head.weight, first.embed.weight, rtol=0, atol=0)
    n = sum(p.numel() for s in (first, last) for p in s.parameters())
    assert n == spec.n_params() and first.layers["0"].attn.qkv.weight.shape == (32 + 2 * 16, 32)
    logits = SwarmModel([first, last])(torch.randint(0, 64, (2, 16)))
    assert logits.shape == (2, 16, 64) and torch.isfinite(logits).all()
