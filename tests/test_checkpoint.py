"""Checkpoints: atomic save, resume of a stage's state, refusal of another spec's checkpoint."""

import os

import pytest
import torch

from peer.checkpoint import Checkpoint, checkpoint_path, load_checkpoint, save_checkpoint
from peer.compute import StageCompute
from swarm.errors import ConfigError, RequestError
from swarm.run.spec import RunSpec


def tiny_spec(seed=0) -> RunSpec:
    return RunSpec.from_dict(
        {
            "run_id": "ckpt-test",
            "seed": seed,
            "model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
            "stages": 2,
            "codecs": {"activations": "none", "gradients": "none"},
            "micro_batch_size": 2,
        }
    )


def _trained(spec):
    comp = StageCompute(spec, 0)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    comp.forward("m", tokens, "train")
    comp.backward("m", torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)))
    assert comp.version == 1
    return comp


def _ckpt(comp):
    meta, tensors = comp.export_state()
    return Checkpoint(
        spec_hash=meta["spec_hash"],
        run_id=comp.spec.run_id,
        stage=comp.stage,
        version=comp.version,
        names=meta["names"],
        tensors=tensors,
        meta=meta,
    )


def test_save_and_resume(tmp_path):
    spec = tiny_spec()
    comp = _trained(spec)
    path = save_checkpoint(tmp_path, _ckpt(comp))
    assert path == checkpoint_path(tmp_path) and not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]
    ck = load_checkpoint(tmp_path, spec_hash=spec.spec_hash)
    assert ck.stage == 0 and ck.version == 1
    fresh = StageCompute(spec, 0)
    fresh.import_state(ck.meta, ck.tensors)
    assert fresh.version == 1 and fresh.optimizer.step_count == 1
    for n, t in comp.params().items():
        torch.testing.assert_close(fresh.params()[n], t)
    for a, b in zip(comp.optimizer.state_tensors(), fresh.optimizer.state_tensors(), strict=True):
        torch.testing.assert_close(a, b)


def test_other_spec_is_refused(tmp_path):
    comp = _trained(tiny_spec())
    save_checkpoint(tmp_path, _ckpt(comp))
    other = tiny_spec(seed=1)
    with pytest.raises(ConfigError, match="another run spec|spec hash"):
        load_checkpoint(tmp_path, spec_hash=other.spec_hash)
    assert load_checkpoint(tmp_path / "empty", spec_hash=other.spec_hash) is None


def test_state_of_another_stage_or_spec_changes_nothing():
    spec = tiny_spec()
    comp = _trained(spec)
    meta, tensors = comp.export_state()
    stage1 = StageCompute(spec, 1)
    with pytest.raises(RequestError, match="stage"):
        stage1.import_state(meta, tensors)
    other = StageCompute(tiny_spec(seed=1), 0)
    before = {n: t.clone() for n, t in other.params().items()}
    with pytest.raises(RequestError, match="run spec"):
        other.import_state(meta, tensors)
    assert other.version == 0
    for n, t in other.params().items():
        torch.testing.assert_close(t, before[n])


def test_corrupt_file_is_a_clear_error(tmp_path):
    checkpoint_path(tmp_path).write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_checkpoint(tmp_path, spec_hash="x")
