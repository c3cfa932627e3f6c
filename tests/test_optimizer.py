"""The stage optimizer: AdamW and Nesterov against torch.optim, and weight stashing across a step."""

import pytest
import torch

from peer.compute import StageCompute
from swarm.run.model import build_stage
from swarm.run.optimizer import StageOptimizer, lookahead_coefficient
from swarm.run.spec import OptimizerConfig, RunSpec


def tiny_spec(**optimizer) -> RunSpec:
    return RunSpec.from_dict(
        {
            "run_id": "opt-test",
            "model": {"vocab_size": 64, "d_model": 32, "n_layers": 3, "n_heads": 2, "seq_len": 16},
            "stages": 3,
            "codecs": {"activations": "none", "gradients": "none"},
            "optimizer": optimizer,
            "micro_batch_size": 2,
        }
    )


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g)}


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g)}


def test_adamw_matches_torch():
    cfg = OptimizerConfig(name="adamw", lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, clip_norm=None)
    opt = StageOptimizer(_params(), cfg)
    ref = {n: torch.nn.Parameter(p.clone()) for n, p in _params().items()}
    torch_opt = torch.optim.AdamW(ref.values(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    for step in range(4):
        before = opt.served()
        opt.accumulate(_grads(step))
        new = opt.step()
        assert all(new[n] is not before[n] for n in new)  # out of place: old versions stay intact
        for n, p in ref.items():
            p.grad = _grads(step)[n]
        torch_opt.step()
        for n in ref:
            torch.testing.assert_close(new[n], ref[n].detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [None, False])
@pytest.mark.parametrize("clip", [None, 0.3])
def test_accumulated_clipped_adamw_steps_match_torch_on_the_fused_and_the_reference_path(fused, clip):
    cfg = OptimizerConfig(name="adamw", lr=1e-2, accumulate=3, weight_decay=0.1, clip_norm=clip)
    opt = StageOptimizer(_params(), cfg)
    opt._fused = fused  # None: the fused kernel where torch has one (CPU does); False: the reference loop
    ref = {n: torch.nn.Parameter(p.clone()) for n, p in _params().items()}
    torch_opt = torch.optim.AdamW(ref.values(), lr=1e-2, betas=cfg.betas, weight_decay=0.1, eps=1e-8)
    for step in range(4):
        micro = [_grads(10 * step + i) for i in range(3)]
        for g in micro:
            opt.accumulate(g)
        new = opt.step()
        for n, p in ref.items():
            p.grad = sum(g[n] for g in micro) / 3
        norm = torch.nn.utils.clip_grad_norm_(ref.values(), clip if clip is not None else float("inf"))
        torch_opt.step()
        assert opt.last_grad_norm == pytest.approx(float(norm), rel=1e-5)
        for n in ref:
            torch.testing.assert_close(new[n], ref[n].detach(), rtol=1e-5, atol=1e-6)
    assert opt.clipped_steps == (4 if clip is not None else 0)
    assert opt._fused is (fused is None)  # the CPU build has the fused kernel; False stays False


def test_nesterov_without_delay_matches_torch_nesterov_sgd():
    cfg = OptimizerConfig(name="nesterov", lr=0.05, momentum=0.9, clip_norm=None)
    opt = StageOptimizer(_params(), cfg)
    ref = {n: torch.nn.Parameter(p.clone()) for n, p in _params().items()}
    torch_opt = torch.optim.SGD(ref.values(), lr=0.05, momentum=0.9, nesterov=True)
    for step in range(5):
        opt.accumulate(_grads(step), staleness=0)
        served = opt.step()
        for n, p in ref.items():
            p.grad = _grads(step)[n]
        torch_opt.step()
        # torch's NAG iterates are the look-ahead points mu = c(0) velocities ahead of the base weights
        for n in ref:
            torch.testing.assert_close(served[n], ref[n].detach(), rtol=1e-5, atol=1e-6)


def test_delay_aware_lookahead_grows_with_staleness():
    assert lookahead_coefficient(0.9, 0) == pytest.approx(0.9)
    assert lookahead_coefficient(0.9, 2) == pytest.approx(0.9 + 0.81 + 0.729)
    assert lookahead_coefficient(0.0, 5) == 0.0
    cfg = OptimizerConfig(name="nesterov", lr=0.1, momentum=0.5, clip_norm=None)
    opt = StageOptimizer(_params(), cfg)
    for _ in range(50):
        opt.accumulate(_grads(0), staleness=3)
    opt.step()
    assert opt.staleness == pytest.approx(3 * (1 - 0.9**50))
    c = lookahead_coefficient(0.5, opt.staleness)
    vel = opt.state["velocity"]
    for n, p in opt.params.items():
        torch.testing.assert_close(opt.served()[n], p + c * vel[n])


def test_accumulation_averages_and_clipping_bounds_the_norm():
    cfg = OptimizerConfig(name="nesterov", lr=1.0, momentum=0.0, clip_norm=0.5, accumulate=2)
    p0 = _params()
    opt = StageOptimizer(p0, cfg)
    g1, g2 = _grads(1), _grads(2)
    opt.accumulate(g1)
    assert not opt.ready
    opt.accumulate(g2)
    assert opt.ready
    new = opt.step()
    mean = {n: (g1[n] + g2[n]) / 2 for n in g1}
    norm = torch.sqrt(sum((g**2).sum() for g in mean.values()))
    assert opt.last_grad_norm == pytest.approx(float(norm), rel=1e-5) and norm > 0.5
    moved = torch.sqrt(sum(((new[n] - p0[n]) ** 2).sum() for n in p0))
    assert float(moved) == pytest.approx(0.5, rel=1e-4)  # lr 1, plain SGD: the step is the clipped gradient
    assert opt.pending == 0 and opt.step_count == 1


def test_lr_schedule_is_followed():
    cfg = OptimizerConfig(
        name="nesterov",
        lr=1.0,
        momentum=0.0,
        clip_norm=None,
        warmup_steps=2,
        schedule="cosine",
        total_steps=4,
    )
    opt = StageOptimizer({"w": torch.zeros(1)}, cfg)
    moves = []
    for _ in range(4):
        before = float(opt.served()["w"])
        opt.accumulate({"w": torch.ones(1)})
        moves.append(before - float(opt.step()["w"]))
    assert moves == pytest.approx([cfg.lr_at(i) for i in range(4)])
    assert moves[0] == pytest.approx(0.5) and moves[1] == pytest.approx(1.0) and moves[3] < moves[2]


@pytest.mark.parametrize("name", ["adamw", "muon", "nesterov"])
def test_a_step_on_part_of_the_micro_batches_takes_that_part_of_the_learning_rate(name):
    # note "token-weighted steps": the same gradient at weight 1/4 moves the weights 1/4 as far
    # (no weight decay, one step from fresh moments, so the update is linear in lr)
    cfg = OptimizerConfig(name=name, lr=1e-2, momentum=0.0, weight_decay=0.0, clip_norm=None, accumulate=4)
    gen = torch.Generator().manual_seed(
        3
    )  # seeded: (p + lr g) - p loses ~1 ulp of p, within the tolerance here
    p0 = {"layers.0.w": torch.randn(8, 6, generator=gen), "b": torch.randn(5, generator=gen)}
    g = {n: torch.randn(p.shape, generator=gen) for n, p in p0.items()}
    full, part = StageOptimizer(p0, cfg), StageOptimizer(p0, cfg)
    full.accumulate(g)
    part.accumulate(g)
    moved_full, moved_part = full.step(), part.step(weight=0.25)
    for n, p in p0.items():
        torch.testing.assert_close(moved_part[n] - p, 0.25 * (moved_full[n] - p), rtol=1e-4, atol=1e-7)
    assert part.step_count == 1  # the schedule still counts it as a step
    for bad in (0.0, 1.5, -1.0):
        part.accumulate(g)
        with pytest.raises(ValueError, match="step weight"):
            part.step(weight=bad)
    assert part.step_count == 1 and part.pending == 3  # refused: nothing changed


def test_state_round_trip_and_shape_check():
    cfg = OptimizerConfig(name="adamw", lr=1e-2)
    a = StageOptimizer(_params(), cfg)
    a.accumulate(_grads(0))
    a.step()
    b = StageOptimizer(_params(1), cfg)
    b.load([t.clone() for t in a.state_tensors()], a.metadata())
    assert b.step_count == 1
    for x, y in zip(a.state_tensors(), b.state_tensors(), strict=True):
        torch.testing.assert_close(x, y)
    bad = [t.clone() for t in a.state_tensors()]
    bad[0] = torch.zeros(7)
    with pytest.raises(ValueError, match="shape"):
        b.load(bad, a.metadata())
    torch.testing.assert_close(b.params["a"], a.params["a"])  # refused: nothing changed


@pytest.mark.parametrize("recompute", [True, False])
def test_backward_after_a_step_uses_the_stashed_weights(recompute):
    # Plain SGD (nesterov with momentum 0) so the expected update is lr * gradient, computed by hand.
    lr = 0.5
    spec = tiny_spec(
        name="nesterov", lr=lr, momentum=0.0, clip_norm=None, recompute=recompute, max_versions=3
    )
    comp = StageCompute(spec, 1)  # a middle stage: hidden in, hidden out
    gen = torch.Generator().manual_seed(0)
    x_a, x_b = (torch.randn(2, 16, 32, generator=gen) for _ in range(2))
    g_a, g_b = (torch.randn(2, 16, 32, generator=gen) for _ in range(2))

    fa = comp.forward("a", x_a, "train")
    comp.forward("b", x_b, "train")
    assert fa.version == 0
    rb = comp.backward("b", g_b)
    assert rb.stepped and comp.version == 1  # the peer has stepped since "a"'s forward
    v1 = {n: t.clone() for n, t in comp.params().items()}
    ra = comp.backward("a", g_a)
    assert ra.version == 0 and ra.staleness == 1 and comp.version == 2

    # Manual computation with the version-0 weights (the deterministic initial stage).
    ref = build_stage(spec, 1)
    x = x_a.clone().requires_grad_(True)
    out = ref(x)
    torch.testing.assert_close(fa.output, out.detach())
    params = dict(ref.named_parameters())
    grads = torch.autograd.grad(out, [x, *params.values()], grad_outputs=g_a)
    torch.testing.assert_close(ra.grad_input, grads[0], rtol=1e-5, atol=1e-6)
    expected = {n: v1[n] - lr * g for n, g in zip(params, grads[1:], strict=True)}
    for n, t in comp.params().items():
        torch.testing.assert_close(t, expected[n], rtol=1e-5, atol=1e-6)

    # And the gradient at version 1 would have been different: the stash mattered.
    ref.load_state_dict(v1)
    out1 = ref(x_a.clone().requires_grad_(True))
    g1 = torch.autograd.grad(out1, list(dict(ref.named_parameters()).values()), grad_outputs=g_a)
    assert max(float((a - b).abs().max()) for a, b in zip(g1, grads[1:], strict=True)) > 1e-4


# ---- muon ----------------------------------------------------------------------------------------

MUON_SHAPES = {
    "embed.weight": (7, 4),  # 2-D but an embedding: AdamW
    "layers.0.attn_norm.weight": (4,),  # a norm: AdamW
    "layers.0.attn.qkv.weight": (6, 4),  # tall block matrix: Muon
    "layers.0.ffn.down.weight": (4, 5),  # wide block matrix: Muon
    "head.weight": (7, 4),  # the LM head: AdamW
}
MUON_MATRICES = ["layers.0.attn.qkv.weight", "layers.0.ffn.down.weight"]


def _muon_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in MUON_SHAPES.items()}


def _muon_grads(step):
    g = torch.Generator().manual_seed(200 + step)
    return {n: torch.randn(s, generator=g) for n, s in MUON_SHAPES.items()}


def _reference_orthogonalise(m: torch.Tensor) -> torch.Tensor:
    """Quintic Newton-Schulz written as the polynomial X <- a X + b (X X^T) X + c (X X^T)^2 X, in float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = m.double()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.t()
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(5):
        s = x @ x.t()
        x = a * x + b * (s @ x) + c * (s @ (s @ x))
    return (x.t() if transposed else x).float()


class ReferenceMuon:
    """Textbook Muon: heavy-ball momentum buffer B <- mu B + G, Nesterov update G + mu B, orthogonalised,
    times 0.2 sqrt(max(rows, cols)); decoupled weight decay. (The optimizer under test keeps the EMA form
    (1 - mu) times this, which the normalisation before Newton-Schulz cancels.)"""

    def __init__(self, params, lr, momentum, weight_decay):
        self.params = {n: p.clone() for n, p in params.items()}
        self.buf = {n: torch.zeros_like(p) for n, p in params.items()}
        self.lr, self.mu, self.wd = lr, momentum, weight_decay

    def step(self, grads):
        for n, p in self.params.items():
            self.buf[n] = self.mu * self.buf[n] + grads[n]
            o = _reference_orthogonalise(grads[n] + self.mu * self.buf[n])
            rows, cols = p.shape
            self.params[n] = p * (1 - self.lr * self.wd) - self.lr * 0.2 * max(rows, cols) ** 0.5 * o


def test_muon_steps_matrices_like_the_reference_and_the_rest_like_torch_adamw():
    cfg = OptimizerConfig(
        name="muon", lr=1e-2, muon_lr=0.05, muon_momentum=0.9, weight_decay=0.1, clip_norm=None
    )
    opt = StageOptimizer(_muon_params(), cfg)
    assert opt.matrices == MUON_MATRICES
    ref_muon = ReferenceMuon({n: _muon_params()[n] for n in MUON_MATRICES}, 0.05, 0.9, 0.1)
    adam_names = [n for n in MUON_SHAPES if n not in MUON_MATRICES]
    ref_adam = {n: torch.nn.Parameter(_muon_params()[n].clone()) for n in adam_names}
    torch_opt = torch.optim.AdamW(ref_adam.values(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    for step in range(5):
        before = opt.served()
        kept = {n: t.clone() for n, t in before.items()}
        opt.accumulate(_muon_grads(step))
        new = opt.step()
        assert all(new[n] is not before[n] for n in new)  # out of place: new tensors...
        for n, t in before.items():  # ...and the old version is untouched
            assert torch.equal(t, kept[n]), n
        ref_muon.step({n: _muon_grads(step)[n] for n in MUON_MATRICES})
        for n, p in ref_adam.items():
            p.grad = _muon_grads(step)[n]
        torch_opt.step()
        for n in MUON_MATRICES:
            torch.testing.assert_close(new[n], ref_muon.params[n], rtol=0, atol=1e-6)
        for n in adam_names:
            torch.testing.assert_close(new[n], ref_adam[n].detach(), rtol=1e-5, atol=1e-6)


def test_muon_update_has_the_rms_of_an_adamw_update():
    """The 0.2 sqrt(max(rows, cols)) scale: one plain step moves a matrix by lr * ~0.2 RMS, any shape."""
    shapes = {"layers.0.a.weight": (64, 256), "layers.0.b.weight": (256, 64), "layers.0.c.weight": (96, 96)}
    params = {n: torch.zeros(s) for n, s in shapes.items()}
    opt = StageOptimizer(
        params, OptimizerConfig(name="muon", lr=1.0, muon_lr=1.0, muon_momentum=0.0, clip_norm=None)
    )
    gen = torch.Generator().manual_seed(0)
    opt.accumulate({n: torch.randn(s, generator=gen) for n, s in shapes.items()})
    for n, p in opt.step().items():
        rms = float(p.pow(2).mean().sqrt())
        assert 0.15 < rms < 0.22, (n, rms)  # Newton-Schulz leaves singular values in ~0.7..1.1


def test_muon_lr_follows_the_schedule_and_defaults_to_three_times_lr():
    cfg = OptimizerConfig(name="muon", lr=1e-3, muon_lr=4e-3, warmup_steps=4)
    assert [cfg.muon_lr_at(i) for i in range(5)] == pytest.approx([4 * cfg.lr_at(i) for i in range(5)])
    plain = OptimizerConfig(name="muon", lr=1e-3)
    assert plain.muon_lr_at(7) == pytest.approx(3 * plain.lr_at(7)) and plain.muon_beta == 0.8
    # left out, the new fields stay out of the canonical bytes (older specs keep their hash)
    spec = tiny_spec(name="adamw")
    assert "muon_lr" not in spec.to_dict()["optimizer"] and "muon_momentum" not in spec.to_dict()["optimizer"]
    tuned = tiny_spec(name="muon", muon_lr=0.02, muon_momentum=0.9)
    assert RunSpec.from_json(tuned.canonical_bytes()) == tuned
    assert tuned.spec_hash != tiny_spec(name="muon").spec_hash


def test_muon_state_layout_round_trip_and_shift():
    cfg = OptimizerConfig(name="muon", lr=1e-2, muon_lr=0.02)
    a = StageOptimizer(_muon_params(), cfg)
    names = a.state_names()
    adam = [n for n in MUON_SHAPES if n not in MUON_MATRICES]
    assert names == (
        [f"param/{n}" for n in MUON_SHAPES]
        + [f"exp_avg/{n}" for n in adam]
        + [f"exp_avg_sq/{n}" for n in adam]
        + [f"muon_momentum/{n}" for n in MUON_MATRICES]
    )
    assert [tuple(t.shape) for t in a.state_tensors()] == [MUON_SHAPES[n.split("/", 1)[1]] for n in names]
    for step in range(2):
        a.accumulate(_muon_grads(step))
        a.step()
    b = StageOptimizer(_muon_params(1), cfg)
    b.load([t.clone() for t in a.state_tensors()], a.metadata())
    assert b.step_count == 2 and b.metadata()["optimizer"] == "muon"
    for x, y in zip(a.state_tensors(), b.state_tensors(), strict=True):
        torch.testing.assert_close(x, y)
    for opt in (a, b):  # the loaded copy continues exactly like the original
        opt.accumulate(_muon_grads(5))
        opt.step()
    for x, y in zip(a.state_tensors(), b.state_tensors(), strict=True):
        torch.testing.assert_close(x, y)
    # state of another optimizer is refused, and nothing changes
    adamw = StageOptimizer(_muon_params(), OptimizerConfig(name="adamw"))
    with pytest.raises(ValueError, match="expected"):
        b.load(adamw.state_tensors(), adamw.metadata())


def test_muon_on_a_stage_takes_the_block_matrices_including_subspace_coefficients():
    spec = RunSpec.from_dict(
        {
            "run_id": "opt-sub",
            "model": {
                "vocab_size": 64,
                "d_model": 32,
                "n_layers": 2,
                "n_heads": 2,
                "seq_len": 16,
                "subspace": {"rank": 4},
            },
            "stages": 2,
            "codecs": {"activations": "none", "gradients": "none"},
            "optimizer": {"name": "muon"},
            "micro_batch_size": 2,
        }
    )
    first = dict(build_stage(spec, 0).named_parameters())
    opt = StageOptimizer(first, spec.optimizer)
    assert "layers.0.attn.proj.coef" in opt.matrices and "layers.0.ffn.down.coef" in opt.matrices
    assert "embed.coef" not in opt.matrices  # the subspace embedding's coefficients: AdamW
    assert set(opt.matrices) == {n for n, p in first.items() if n.startswith("layers.") and p.dim() == 2}
    # the exporter lays the state out on the meta device (swarm/tools/export_download.py): no allocation, same names
    meta = StageOptimizer({n: torch.empty(p.shape, device="meta") for n, p in first.items()}, spec.optimizer)
    assert meta.state_names() == opt.state_names()


def test_muon_stage_backward_after_a_step_runs_on_the_stashed_version():
    spec = tiny_spec(name="muon", lr=1e-2, muon_lr=0.05, clip_norm=None)
    comp = StageCompute(spec, 1)
    gen = torch.Generator().manual_seed(0)
    x_a, x_b = (torch.randn(2, 16, 32, generator=gen) for _ in range(2))
    g_a, g_b = (torch.randn(2, 16, 32, generator=gen) for _ in range(2))
    comp.forward("a", x_a, "train")
    comp.forward("b", x_b, "train")
    v0 = {n: t.clone() for n, t in comp.versions.get(0).items()}
    assert comp.backward("b", g_b).stepped and comp.version == 1
    ra = comp.backward("a", g_a)
    assert ra.version == 0 and ra.staleness == 1 and comp.version == 2
    for n, t in comp.versions.get(0).items():  # the stashed version survived two Muon steps intact
        assert torch.equal(t, v0[n]), n
    meta, tensors = comp.export_state()
    other = StageCompute(spec, 1)
    other.import_state(meta, tensors)
    for n, t in comp.optimizer.params.items():  # the base weights travel (the look-ahead is local)
        torch.testing.assert_close(other.optimizer.params[n], t)


def test_lookahead_extrapolates_by_the_staleness_and_is_off_without_it():
    """Note "extrapolated weights": served = params + k * tau * (the last step's change)."""
    cfg = OptimizerConfig(name="muon", lr=1e-2, muon_lr=0.05, clip_norm=None)
    assert cfg.lookahead_scale == 1.0 and OptimizerConfig(name="adamw").lookahead_scale == 0.0
    assert OptimizerConfig(name="adamw", lookahead=0.5).lookahead_scale == 0.5
    assert OptimizerConfig(name="nesterov", lookahead=1.0).lookahead_scale == 0.0  # it has its own
    fresh = StageOptimizer(_muon_params(), cfg)  # sync-like: every gradient on the current version
    stale = StageOptimizer(_muon_params(), cfg)
    for step in range(3):
        before = dict(stale.params)
        fresh.accumulate(_muon_grads(step), staleness=0)
        for _ in range(10):  # drive the staleness EMA up: 1 - 0.9^10 of 1 version per step
            stale.accumulate({n: g / 10 for n, g in _muon_grads(step).items()}, staleness=1)
        assert fresh.step() is fresh.params  # no staleness: served = params, no copy
        served = stale.step()
        for n, p in stale.params.items():
            torch.testing.assert_close(served[n], p + stale.staleness * (p - before[n]))
    assert 0.9 < stale.staleness < 1.0
    # a loaded state has no last step: served = params until the first step of its own
    other = StageOptimizer(_muon_params(1), cfg)
    other.load([t.clone() for t in stale.state_tensors()], stale.metadata())
    assert other.served() is other.params
    off = StageOptimizer(_muon_params(), OptimizerConfig(name="muon", lookahead=0.0))
    off.accumulate(_muon_grads(0), staleness=5)
    assert off.step() is off.params


def test_a_twin_with_fewer_newton_schulz_iterations_changes_only_the_muon_matrices():
    torch.manual_seed(0)
    params = {"layers.0.w": torch.randn(8, 16), "embed.weight": torch.randn(4, 8)}
    opt = StageOptimizer(params, OptimizerConfig(name="muon", lr=1e-2))
    mean = [torch.randn(8, 16), torch.randn(4, 8)]
    full, cheap = opt.twin().step_with(mean), opt.twin(ns_steps=2).step_with(mean)
    assert opt.ns_steps == 5 and opt.step_count == 0  # the twins changed nothing of the optimizer
    assert not torch.equal(full["layers.0.w"], cheap["layers.0.w"])
    torch.testing.assert_close(full["embed.weight"], cheap["embed.weight"])
    with pytest.raises(ValueError, match="ns_steps=0"):
        opt.twin(ns_steps=0)


def test_blank_accumulators_count_as_zero_after_a_step_and_a_hand_over():
    """Note "blank accumulators": a step leaves old sums in the buffers; the next gradient is copied over
    them, and a parameter no micro-batch reached reads as zero in the step and in a hand-over."""
    cfg = OptimizerConfig(
        name="nesterov", lr=1.0, momentum=0.0, weight_decay=0.0, clip_norm=None, accumulate=2
    )
    opt = StageOptimizer(_params(), cfg)
    opt.accumulate(_grads(1))
    opt.accumulate(_grads(2))
    first = opt.step()
    g3 = _grads(3)
    opt.accumulate({"a": g3["a"].to(torch.bfloat16), "b": None})  # copied in, converted to float32
    opt.accumulate({"a": g3["a"]})
    second = opt.step()
    torch.testing.assert_close(second["b"], first["b"])  # no gradient reached b: it did not move
    expected_a = (g3["a"].to(torch.bfloat16).float() + g3["a"]) / 2
    torch.testing.assert_close(second["a"], first["a"] - expected_a)
    opt.accumulate({"a": g3["a"]})
    sums, count = opt.take_gradients()
    assert count == 1
    torch.testing.assert_close(sums[0], g3["a"])
    assert torch.equal(sums[1], torch.zeros(5))  # written as zeros before handing over
    opt.accumulate({"b": g3["b"]})
    opt.give_back_gradients(sums, count)  # onto a buffer that holds b's gradient and a blank a
    assert opt.pending == 2
    again, count = opt.take_gradients()
    assert count == 2
    torch.testing.assert_close(again[0], g3["a"])
    torch.testing.assert_close(again[1], g3["b"])
