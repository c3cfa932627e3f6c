"""The stage optimizer: AdamW and Nesterov against torch.optim, and weight stashing across a step."""

import pytest
import torch

from peer.compute import StageCompute
from peer.optimizer import StageOptimizer, lookahead_coefficient
from swarm.model import build_stage
from swarm.spec import OptimizerConfig, RunSpec


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


def test_averaging_shift_keeps_the_second_moment_away_from_zero():
    """A shifted exp_avg_sq near 0 would turn the next AdamW update into m / eps and blow the replica up."""
    cfg = OptimizerConfig(name="adamw", lr=1e-2, clip_norm=None)
    opt = StageOptimizer(_params(), cfg)
    opt.accumulate(_grads(0))
    opt.step()
    names = opt.state_names()
    sent = [t.clone() for t in opt.state_tensors()]
    # while the round ran, the local second moment decayed to half; the group's average is a tenth
    for n, t in zip(names, opt.state_tensors(), strict=True):
        if n.startswith("exp_avg_sq/"):
            t.mul_(0.5)
    current = [t.clone() for t in opt.state_tensors()]
    averaged = [s * 0.1 if n.startswith("exp_avg_sq/") else s + 0.5 for n, s in zip(names, sent, strict=True)]
    opt.shift([a - s for a, s in zip(averaged, sent, strict=True)], averaged)
    for n, c, a, t in zip(names, current, averaged, opt.state_tensors(), strict=True):
        if n.startswith("exp_avg_sq/"):
            # current + delta = -0.4 * sent would be clamped to 0 by a plain clamp; the floor keeps it
            torch.testing.assert_close(t, torch.minimum(c, a))
            assert bool((t > 0).all())
        else:
            torch.testing.assert_close(t, c + 0.5)
    old = {n: p.clone() for n, p in opt.params.items()}
    opt.accumulate(_grads(1))
    opt.step()
    # bounded (a second moment clamped to 0 would give steps of lr * m / eps, around 1e5 here)
    assert max(float((opt.params[n] - old[n]).abs().max()) for n in old) < 1.0


def test_averaging_shift_without_local_steps_gives_exactly_the_average():
    cfg = OptimizerConfig(name="adamw", lr=1e-2)
    opt = StageOptimizer(_params(), cfg)
    opt.accumulate(_grads(0))
    opt.step()
    sent = [t.clone() for t in opt.state_tensors()]
    averaged = [s * 0.3 + 0.01 for s in sent]
    opt.shift([a - s for a, s in zip(averaged, sent, strict=True)], averaged)
    for a, t in zip(averaged, opt.state_tensors(), strict=True):
        torch.testing.assert_close(t, a)


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
