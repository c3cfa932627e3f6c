"""The compute core without network: sync-mode gating, version eviction, last-stage train step, averaging deltas."""

import pytest
import torch

from peer.compute import StageCompute
from peer.stash import VersionEvicted
from swarm.errors import RequestError
from swarm.spec import RunSpec


def spec(**optimizer) -> RunSpec:
    return RunSpec.from_dict(
        {
            "run_id": "compute-test",
            "model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
            "stages": 2,
            "codecs": {"activations": "none", "gradients": "none"},
            "optimizer": {"lr": 1e-2} | optimizer,
            "micro_batch_size": 2,
            "stash_ttl_s": 10,
        }
    )


def tokens(seed):
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))


def grad(seed):
    return torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(seed))


def test_sync_mode_gates_forwards_until_the_step():
    comp = StageCompute(spec(mode="sync", accumulate=2), 0)
    assert comp.forward_allowed()
    comp.forward("a", tokens(0), "train")
    comp.forward("b", tokens(1), "train")
    assert not comp.forward_allowed()  # both forwards of this step are in flight
    comp.backward("a", grad(0))
    assert comp.version == 0 and not comp.forward_allowed()
    comp.backward("b", grad(1))
    assert comp.version == 1 and comp.forward_allowed()  # stepped once both backwards arrived
    comp.forward("c", tokens(2), "eval")  # eval forwards neither stash nor count
    assert len(comp.stash) == 0 and comp.forward_allowed()


def test_sync_mode_dropped_micro_batch_frees_its_slot():
    comp = StageCompute(spec(mode="sync", accumulate=2), 0)
    comp.forward("a", tokens(0), "train")
    comp.forward("b", tokens(1), "train")
    comp.backward("a", grad(0))
    comp.drop("b")  # its route failed: the step must not wait for it forever
    assert comp.forward_allowed() and comp.version == 0
    comp.forward("c", tokens(2), "train")
    comp.backward("c", grad(2))
    assert comp.version == 1


def test_async_backward_of_an_evicted_version_is_refused_and_counted():
    comp = StageCompute(spec(mode="async", accumulate=1, max_versions=1), 0)
    comp.forward("old", tokens(0), "train")
    comp.forward("new", tokens(1), "train")
    comp.backward("new", grad(1))  # step -> version 1; version 0 is evicted (max_versions=1)
    assert comp.versions.kept() == [1]
    with pytest.raises(VersionEvicted, match="version evicted"):
        comp.backward("old", grad(0))
    assert comp.versions.evicted_refusals == 1 and "old" not in comp.stash and comp.version == 1
    with pytest.raises(RequestError, match="no stashed forward"):
        comp.backward("old", grad(0))


def test_last_stage_train_forward_steps_and_returns_the_input_gradient():
    comp = StageCompute(spec(accumulate=1), 1)
    x = torch.randn(2, 16, 32)
    res = comp.forward("m", x, "train", targets=tokens(3))
    assert res.loss > 0 and res.grad_input.shape == (2, 16, 32) and res.stepped and comp.version == 1
    assert len(comp.stash) == 0
    with pytest.raises(RequestError, match="targets"):
        comp.forward("m2", x, "eval")


def test_stash_expiry_releases_entries():
    now = [0.0]
    comp = StageCompute(spec(mode="sync", accumulate=1), 0, clock=lambda: now[0])
    comp.forward("a", tokens(0), "train")
    assert not comp.forward_allowed()
    now[0] = 11.0
    assert [e.mb_id for e in comp.expire()] == ["a"]
    assert comp.forward_allowed() and comp.stash.expired == 1


def test_apply_average_keeps_local_progress():
    comp = StageCompute(spec(accumulate=1), 0)
    _, sent = comp.export_state()
    averaged = [t + 1.0 for t in sent]
    comp.forward("a", tokens(0), "train")
    comp.backward("a", grad(0))  # a local step while the round ran
    before = {n: t.clone() for n, t in comp.params().items()}
    comp.apply_average(sent, averaged)
    assert comp.version == 2
    for n, t in comp.params().items():
        torch.testing.assert_close(t, before[n] + 1.0)
