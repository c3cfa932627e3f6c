"""Tests of swarm/run/subspace.py and the subspace option of swarm/run/spec.py and swarm/run/model.py.

The central claims: at every stage boundary of a constrained model, k numbers per token rebuild the
hidden state exactly, and k numbers per token of gradient give exactly the unsplit model's parameter
gradients; U and E_fix are the same on every machine.
"""

from __future__ import annotations

import hashlib
import math
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from compression import decode_any, get_codec
from swarm.errors import ConfigError, RequestError
from swarm.run.init import INIT_STD
from swarm.run.model import SubspaceEmbedding, SubspaceLinear, build_model, build_stage, lm_loss
from swarm.run.spec import RunSpec, SubspaceConfig
from swarm.run.subspace import (
    FIXED_EMBED_STD,
    IdentityBoundary,
    SubspaceBoundary,
    fixed_embedding,
    make_boundary,
    subspace_basis,
)

# sha256 prefix of U's and E_fix's bytes for spec(); see test_basis_recipe_is_pinned.
GOLDEN_SUBSPACE = "152f19e76dc55c56"
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
# spec_hash of examples/tiny.yaml: the subspace option left it as it was ("d01619ef1267d0ce"); it changed
# on purpose when replicas started to step as one (averaging.every_steps removed, timeout_s 20 -> 5), and
# when muon became the default optimizer (tiny.yaml names the default).
TINY_HASH = "47f40003d87cdf87"


def spec_dict(subspace=None, *, stages=3, d_model=64, seed=0) -> dict:
    model = {"vocab_size": 256, "d_model": d_model, "n_layers": 4, "n_heads": 4, "seq_len": 32}
    if subspace is not None:
        model["subspace"] = subspace
    return {
        "run_id": "sub",
        "seed": seed,
        "model": model,
        "stages": stages,
        "codecs": {"activations": "fp16", "gradients": "fp16"},
        "micro_batch_size": 2,
    }


def spec(subspace=None, **kw) -> RunSpec:
    return RunSpec.from_dict(spec_dict({"rank": 4} if subspace is None else subspace, **kw))


def tokens(b=2, t=32, seed=0) -> torch.Tensor:
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def off_subspace(h: torch.Tensor, toks: torch.Tensor, s: RunSpec) -> float:
    """Relative size of the part of h - E_fix[tokens] outside span(U)."""
    u, e = subspace_basis(s, dtype=torch.float64), fixed_embedding(s).double()
    r = h.double() - e[toks]
    return ((r - r @ u @ u.T).norm() / r.norm()).item()


def train_steps(model: torch.nn.Module, steps: int, seed: int = 1) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = tokens(4, 33, seed=seed)
    for _ in range(steps):
        opt.zero_grad()
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()


# ---- the spec option --------------------------------------------------------------------------------


def test_rank_and_ratio_resolve_to_k():
    assert spec({"rank": 4}).model.subspace_rank == 4
    assert spec({"ratio": 32}).model.subspace_rank == 2
    assert spec({"ratio": 3}).model.subspace_rank == 21  # floor(64 / 3)
    assert spec({"ratio": 2.56}, d_model=256).model.subspace_rank == 100  # not 99 (float floor division)
    assert spec({"rank": 64}).model.subspace_rank == 64  # k = d is allowed (a pure reparametrisation)
    assert RunSpec.from_dict(spec_dict()).model.subspace_rank is None
    assert spec({"rank": 4}).model.subspace == SubspaceConfig(rank=4)


def test_specs_without_subspace_keep_their_hash():
    plain = RunSpec.from_dict(spec_dict())
    assert "subspace" not in plain.to_dict()["model"]
    assert b"subspace" not in plain.canonical_bytes()
    assert RunSpec.from_dict({**spec_dict(), "model": {**spec_dict()["model"], "subspace": None}}) == plain
    assert RunSpec.from_yaml(EXAMPLES / "tiny.yaml").spec_hash == TINY_HASH


def test_subspace_is_part_of_the_hash_and_round_trips():
    plain, a, b = RunSpec.from_dict(spec_dict()), spec({"rank": 4}), spec({"ratio": 16})
    assert len({plain.spec_hash, a.spec_hash, b.spec_hash}) == 3
    assert a.to_dict()["model"]["subspace"] == {"rank": 4}
    assert b.to_dict()["model"]["subspace"] == {"ratio": 16.0}
    for s in (a, b):
        assert RunSpec.from_json(s.canonical_bytes()) == s
    assert spec({"ratio": 16}).spec_hash == spec({"ratio": 16.0}).spec_hash


def test_example_spec_loads():
    s = RunSpec.from_yaml(EXAMPLES / "subspace.yaml")
    assert s.model.subspace_rank is not None and s.num_stages >= 2


@pytest.mark.parametrize(
    ("subspace", "kw", "message"),
    [
        ({}, {}, r"model\.subspace = .* exactly one of rank and ratio"),
        ({"rank": 2, "ratio": 4}, {}, "exactly one of rank and ratio"),
        ({"rank": 0}, {}, r"model\.subspace\.rank = 0 is invalid: it must be >= 1"),
        ({"rank": 65}, {}, r"model\.subspace\.rank = 65 .* 1 <= k <= model\.d_model \(64\)"),
        ({"rank": True}, {}, "must be an integer"),
        ({"ratio": 0.5}, {}, r"model\.subspace\.ratio = 0\.5 is invalid: it must be >= 1"),
        ({"ratio": 100}, {}, r"ratio = 100\.0 .* k = floor\(64 / 100\.0\) = 0"),
        ({"rnak": 4}, {}, r"unknown key\(s\) model\.subspace\.rnak .* Did you mean model\.subspace\.rank"),
        (8, {}, r"model\.subspace = 8 .* must be a mapping such as \{rank: 16\}"),
        ({"rank": 4}, {"stages": 1}, r"needs at least 2 stages.* Split the model into stages"),
    ],
)
def test_bad_subspace_is_explained(subspace, kw, message):
    with pytest.raises(ConfigError, match=message):
        RunSpec.from_dict(spec_dict(subspace, **kw))


def test_constrained_layers_and_parameter_counts():
    s = spec({"rank": 4})  # 4 layers in 3 stages: (0, 2), (2, 3), (3, 4)
    assert s.constrained_layers == (0, 3)
    assert RunSpec.from_dict(spec_dict()).constrained_layers == (0, 0)
    model = build_model(s)
    for i in range(3):
        assert sum(p.numel() for p in model.stages[i].parameters()) == s.n_params(i)
    assert sum(p.numel() for p in model.parameters()) == s.n_params()
    assert s.n_params() < RunSpec.from_dict(spec_dict()).n_params()


# ---- U and E_fix --------------------------------------------------------------------------------


def test_basis_is_orthonormal_and_spread():
    for d, k in ((64, 4), (64, 64), (96, 5), (256, 2)):  # d is always even (RoPE head size)
        u = subspace_basis(spec({"rank": k}, d_model=d), dtype=torch.float64)
        assert u.shape == (d, k)
        assert torch.allclose(u.T @ u, torch.eye(k, dtype=torch.float64), atol=1e-13), (d, k)
        # Every column reaches (nearly) every coordinate: not a few axes in disguise.
        assert (u.abs() > 1e-6).float().mean() > 0.9, (d, k)
    assert subspace_basis(spec()).dtype == torch.float32


def test_fixed_embedding_statistics():
    e = fixed_embedding(spec())
    assert e.shape == (256, 64) and e.dtype == torch.float32
    assert e.std().item() == pytest.approx(FIXED_EMBED_STD, rel=0.05)
    assert torch.linalg.matrix_rank(e.double()).item() == 64  # full rank: every direction is used


def test_basis_and_fixed_embedding_depend_on_seed_only():
    a, b = spec(), spec(seed=1)
    assert torch.equal(subspace_basis(a), subspace_basis(spec(stages=2)))
    assert not torch.equal(subspace_basis(a), subspace_basis(b))
    assert not torch.equal(fixed_embedding(a), fixed_embedding(b))
    torch.manual_seed(5)
    before = torch.get_rng_state()
    subspace_basis(a), fixed_embedding(a)
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG is neither read nor advanced
    with pytest.raises(ValueError, match="has no model.subspace"):
        subspace_basis(RunSpec.from_dict(spec_dict()))


@pytest.mark.integration
def test_same_basis_in_another_process_on_any_cpu():
    """A fresh process whose torch kernels take the plain (non-SIMD) code paths builds the same U
    and E_fix bit for bit (see Note [portable basis])."""
    s = spec()
    script = textwrap.dedent(
        f"""
        import hashlib, torch
        from swarm.run.spec import RunSpec
        from swarm.run.subspace import fixed_embedding, subspace_basis
        torch.manual_seed(4321)
        s = RunSpec.from_json({s.canonical_bytes()!r})
        h = hashlib.sha256()
        for t in (subspace_basis(s), fixed_embedding(s)):
            h.update(t.contiguous().numpy().tobytes())
        print(torch.backends.cpu.get_cpu_capability(), h.hexdigest()[:16])
        """
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    capability, value = out.stdout.split()
    assert capability == "DEFAULT"
    assert value == digest(subspace_basis(s), fixed_embedding(s))


def test_basis_recipe_is_pinned():
    """U and E_fix are part of a constrained run's identity (every peer derives them): if this fails
    the recipe changed, which breaks every existing constrained run; update only on purpose."""
    s = spec()
    assert digest(subspace_basis(s), fixed_embedding(s)) == GOLDEN_SUBSPACE


# ---- the constrained model ------------------------------------------------------------------------


def test_constrained_modules_write_into_the_subspace_and_the_rest_matches_the_plain_model():
    s, plain = spec(), RunSpec.from_dict(spec_dict())
    model, reference = build_model(s), build_model(plain)
    u = subspace_basis(s)
    first, last = model.stages[0], model.stages[-1]
    assert isinstance(first.embed, SubspaceEmbedding)
    for i in range(3):  # layers before the last boundary
        block = model.stages[0 if i < 2 else 1].layers[str(i)]
        for m in (block.attn.proj, block.ffn.down):
            assert isinstance(m, SubspaceLinear) and torch.equal(m.basis, u)
            w = m.weight().detach()
            assert torch.allclose(u @ (u.T @ w), w, atol=1e-6)
    assert not isinstance(last.layers["3"].attn.proj, SubspaceLinear)  # after the last boundary: free
    # Init: A at the ordinary residual std (see swarm/run/model.py _init_), the embedding's A at INIT_STD.
    coefs = torch.cat([model.stages[0].layers[str(i)].ffn.down.coef.detach().flatten() for i in range(2)])
    assert coefs.std().item() == pytest.approx(INIT_STD / math.sqrt(2 * 4), rel=0.1)
    assert first.embed.coef.std().item() == pytest.approx(INIT_STD, rel=0.1)
    # U and E_fix are buffers, not state: peers never send them.
    assert not any(k.endswith(("basis", "fixed")) for k in model.state_dict())
    # Free parameters draw the same values as in the unconstrained model (same generator stream).
    ref = {k.split(".", 2)[2]: v for k, v in reference.state_dict().items()}
    for name, value in model.state_dict().items():
        short = name.split(".", 2)[2]
        if not short.endswith("coef"):
            assert torch.equal(value, ref[short]), name


def test_encode_decode_is_exact_at_every_boundary_before_and_after_training():
    s = spec()
    model = build_model(s)
    boundary = make_boundary(s)
    assert isinstance(boundary, SubspaceBoundary) and boundary.width == 4 and boundary.needs_tokens
    x = tokens()
    for when in ("init", "trained"):
        if when == "trained":
            train_steps(model, 5)
        with torch.no_grad():
            h = x
            for stage in model.stages[:-1]:
                h = stage(h)  # (B, T, C)
                assert off_subspace(h, x, s) < 1e-5, (when, stage.stage)
                c = boundary.encode_activation(h, x)
                assert c.shape == (2, 32, 4) and c.dtype == torch.float32
                rebuilt = boundary.decode_activation(c, x)
                assert rebuilt.shape == h.shape
                err = (rebuilt - h).abs().max()
                assert torch.allclose(rebuilt, h, atol=1e-6, rtol=1e-5), (when, stage.stage, err)
    # Control: the unconstrained model's hidden states are nowhere near span(U) + E_fix.
    with torch.no_grad():
        h = build_stage(RunSpec.from_dict(spec_dict()), 0)(x)
    assert off_subspace(h, x, s) > 0.5
    assert (boundary.decode_activation(boundary.encode_activation(h, x), x) - h).norm() > 0.5 * h.norm()


def test_chained_stages_with_boundaries_equal_the_whole_model_forward_and_gradients():
    """In-process pipeline: every boundary sends only k numbers per token each way (the next stage
    gets decode(encode(h)) as a fresh leaf, the previous one gets decode_grad(encode_grad(dL/dh)))."""
    s = spec()
    torch.manual_seed(0)
    whole = build_model(s)
    train_steps(whole, 3)  # away from init, where some gradients are special
    split = build_model(s)
    split.load_state_dict(whole.state_dict())
    boundary = make_boundary(s)
    x = tokens(2, 33, seed=3)
    inp, tgt = x[:, :-1], x[:, 1:]

    whole.zero_grad()
    ref_loss = lm_loss(whole(inp), tgt)
    ref_loss.backward()

    split.zero_grad()
    outputs, inputs = [], []
    h: torch.Tensor = inp
    for stage in split.stages:
        out = stage(h)
        outputs.append(out)
        if stage.is_last:
            break
        c = boundary.encode_activation(out.detach(), inp)  # (B, T, k): what goes on the wire
        h = boundary.decode_activation(c, inp).requires_grad_()
        inputs.append(h)
    loss = lm_loss(outputs[-1], tgt)
    assert torch.allclose(loss, ref_loss, atol=1e-6)
    loss.backward()
    for i in range(len(split.stages) - 2, -1, -1):
        g = inputs[i].grad  # dL/dh at the input of stage i + 1, (B, T, C)
        gc = boundary.encode_grad(g)  # (B, T, k): what goes back on the wire
        assert torch.allclose(gc, g @ boundary.basis)  # = U^T g per token
        outputs[i].backward(boundary.decode_grad(gc))

    ref_grads = dict(whole.named_parameters())
    for name, p in split.named_parameters():
        ref = ref_grads[name].grad
        assert p.grad is not None and ref is not None, name
        assert torch.allclose(p.grad, ref, atol=1e-6, rtol=1e-4), (name, (p.grad - ref).abs().max())


def test_projected_gradient_is_exact_only_for_the_constrained_model():
    """Control for the test above: sending U^T g back through an *unconstrained* stage loses gradient."""
    s = spec()
    plain = build_model(RunSpec.from_dict(spec_dict()))
    boundary = make_boundary(s)
    x = tokens(2, 33, seed=3)
    out = plain.stages[0](x[:, :-1])
    h = out.detach().requires_grad_()
    lm_loss(plain.stages[2](plain.stages[1](h)), x[:, 1:]).backward()
    full = torch.autograd.grad(out, plain.stages[0].embed.weight, h.grad, retain_graph=True)[0]
    projected = torch.autograd.grad(
        out, plain.stages[0].embed.weight, boundary.decode_grad(boundary.encode_grad(h.grad))
    )[0]
    assert (projected - full).norm() > 0.5 * full.norm()


def test_boundary_with_codecs_sends_k_numbers_per_token():
    s = spec({"rank": 8})
    model = build_model(s)
    boundary = make_boundary(s)
    x = tokens()
    with torch.no_grad():
        h = model.stages[0](x)
    c = boundary.encode_activation(h, x)
    for name, per_value in (("none", 4), ("fp16", 2), ("blockwise8", 1)):
        data = get_codec(name).encode(c)
        body = 2 * 32 * 8 * per_value
        assert body <= len(data) < body * 1.2 + 200, name  # header and per-block scales on top
        rebuilt = boundary.decode_activation(decode_any(data), x)
        assert ((rebuilt - h).norm() / h.norm()).item() < (1e-6 if name == "none" else 2e-2), name


def test_boundary_moves_inputs_and_casts():
    s = spec()
    boundary = make_boundary(s, device="cpu")
    x = tokens()
    with torch.no_grad():
        h = build_stage(s, 0)(x)
    c = boundary.encode_activation(h.bfloat16(), x.int())
    assert c.dtype == torch.float32
    assert boundary.decode_activation(c.half(), x).dtype == torch.float32


def test_identity_boundary_is_a_no_op():
    s = RunSpec.from_dict(spec_dict())
    boundary = make_boundary(s)
    assert isinstance(boundary, IdentityBoundary)
    assert boundary.width == 64 and not boundary.needs_tokens
    h, x = torch.randn(2, 5, 64), tokens(2, 5)
    assert boundary.encode_activation(h, x) is h and boundary.decode_activation(h, x) is h
    assert boundary.encode_grad(h) is h and boundary.decode_grad(h) is h


def test_bad_boundary_inputs_raise_request_error():
    boundary = make_boundary(spec())
    x = tokens(2, 5)
    c = torch.zeros(2, 5, 4)
    with pytest.raises(RequestError, match=r"subspace coefficients of shape \(B, T, 4\)"):
        boundary.decode_activation(torch.zeros(2, 5, 64), x)
    with pytest.raises(RequestError, match=r"hidden state to encode of shape \(B, T, 64\)"):
        boundary.encode_activation(c, x)
    with pytest.raises(RequestError, match="NaN or Inf"):
        boundary.decode_activation(torch.full((2, 5, 4), float("nan")), x)
    with pytest.raises(RequestError, match=r"token ids .* shape \(2, 5\)"):
        boundary.decode_activation(c, tokens(2, 4))
    with pytest.raises(RequestError, match=r"token ids .* shape"):
        boundary.decode_activation(c, x.float())
    bad = x.clone()
    bad[1, 2] = 256
    with pytest.raises(RequestError, match=r"outside 0\.\.255 \(model\.vocab_size\)"):
        boundary.decode_activation(c, bad)
    with pytest.raises(RequestError, match=r"gradient coefficients of shape \(B, T, 4\)"):
        boundary.decode_grad(torch.zeros(2, 5, 3))
