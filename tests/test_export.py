"""swarm export / load_model: weight layouts, checks, files, transformers equivalence, a live swarm.

Unit tests build models locally (no network). The transformers tests skip cleanly when transformers
is absent. The slow test trains a 2-stage loopback swarm for two micro-batches, exports it through
the peers' state-download path, and compares the export with the peers' weights and logits.
"""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
import torch

from swarm.errors import ConfigError, RecordError, StageUnavailableError
from swarm.run.model import build_model
from swarm.run.spec import RunSpec
from swarm.tools.export import (
    INFO_FILE,
    SPEC_FILE,
    WEIGHTS_FILE,
    ExportConfig,
    StageState,
    check_stage_states,
    dense_spec,
    dense_stage_weights,
    from_hf_state_dict,
    load_model,
    stage_state_from_download,
    to_hf_state_dict,
    write_export,
)


def small_spec(run_id: str = "exp", *, subspace: dict | None = None, rope_theta: float = 5000.0) -> RunSpec:
    model = {
        "vocab_size": 64,
        "d_model": 32,
        "n_layers": 3,
        "n_heads": 2,
        "seq_len": 16,
        "rope_theta": rope_theta,
    }
    if subspace is not None:
        model["subspace"] = subspace
    return RunSpec.from_dict(
        {
            "run_id": run_id,
            "model": model,
            "stages": 2,
            "codecs": {"activations": "none", "gradients": "none"},
            "optimizer": {"name": "adamw", "lr": 1e-2, "mode": "sync", "accumulate": 1},
            "averaging": {},
            "micro_batch_size": 2,
        }
    )


def trained_like(spec: RunSpec, seed: int = 0):
    """The spec's model with every parameter moved off its init (norm weights too), as training would."""
    model = build_model(spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() == 1 else 0.05))
    return model.eval()


def dense_of(model) -> dict[str, torch.Tensor]:
    out = {}
    for stage in model.stages:
        out.update(dense_stage_weights(stage))
    return out


def tokens_for(spec: RunSpec, batch: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(42)
    return torch.randint(0, spec.model.vocab_size, (batch, spec.model.seq_len), generator=g)


# ----------------------------------------------------------------------------- files and load_model


def test_safetensors_export_round_trips_through_load_model(tmp_path):
    spec = small_spec()
    model = trained_like(spec)
    out = write_export(tmp_path / "e", spec, dense_of(model), info={"stages": [{"stage": 0}]})
    from safetensors import safe_open

    with safe_open(str(out / WEIGHTS_FILE), framework="pt") as f:
        names = set(f.keys())
        assert f.metadata()["spec_hash"] == spec.spec_hash
    assert "layers.2.attn.qkv.weight" in names and "embed.weight" in names and "head.weight" in names
    info = json.loads((out / INFO_FILE).read_text())
    assert info["format"] == "safetensors" and info["spec_hash"] == spec.spec_hash and info["stages"]
    assert RunSpec.from_dict(json.loads((out / SPEC_FILE).read_text())).spec_hash == spec.spec_hash
    loaded = load_model(out)
    assert not loaded.training
    tokens = tokens_for(spec)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)
    # The stage split of the loaded model is the run's; every parameter came from the file.
    for a, b in zip(loaded.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_write_refuses_to_overwrite_and_load_refuses_non_exports(tmp_path):
    spec = small_spec()
    dense = dense_of(trained_like(spec))
    out = write_export(tmp_path / "e", spec, dense)
    before = (out / WEIGHTS_FILE).read_bytes()
    other = dense_of(trained_like(spec, seed=1))
    with pytest.raises(ConfigError, match="--force"):
        write_export(out, spec, other)
    assert (out / WEIGHTS_FILE).read_bytes() == before, "a refused export changes nothing"
    write_export(out, spec, other, overwrite=True)
    assert (out / WEIGHTS_FILE).read_bytes() != before
    incomplete = dict(dense)
    incomplete.pop("layers.1.ffn.up.weight")
    with pytest.raises(ConfigError, match="missing"):
        write_export(tmp_path / "f", spec, incomplete)
    assert not (tmp_path / "f").exists()
    with pytest.raises(ConfigError, match="not a swarm export"):
        load_model(tmp_path)
    (out / INFO_FILE).write_text(json.dumps({"format": "safetensors", "spec_hash": "0" * 16}))
    with pytest.raises(ConfigError, match="different exports"):
        load_model(out)


def test_hf_names_round_trip_and_missing_transformers_is_named(tmp_path, monkeypatch):
    spec = small_spec()
    dense = dense_of(trained_like(spec))
    hf = to_hf_state_dict(spec, dense)
    assert hf["model.layers.1.self_attn.k_proj.weight"].shape == (32, 32)
    assert "lm_head.weight" in hf and "model.embed_tokens.weight" in hf
    back = from_hf_state_dict(spec, hf)
    assert back.keys() == dense.keys() and all(torch.equal(back[k], dense[k]) for k in dense)
    hf.pop("model.norm.weight")
    with pytest.raises(ConfigError, match="model.norm.weight"):
        from_hf_state_dict(spec, hf)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConfigError, match="pip install transformers"):
        write_export(tmp_path / "hf", spec, dense, format="hf")
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------------- transformers equivalence


def _hf_logits(path, tokens):
    transformers = pytest.importorskip(
        "transformers", reason="transformers is optional: pip install transformers"
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert type(hf).__name__ == "LlamaForCausalLM"
    hf.eval()
    with torch.no_grad():
        return hf(tokens).logits


def test_hf_export_gives_the_swarm_models_logits(tmp_path):
    pytest.importorskip("transformers", reason="transformers is optional: pip install transformers")
    spec = small_spec(rope_theta=5000.0)  # not the default theta: the config must carry it
    model = trained_like(spec)
    out = write_export(tmp_path / "hf", spec, dense_of(model), format="hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is False
    tokens = tokens_for(spec)
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(_hf_logits(out, tokens), ours, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(load_model(out)(tokens), ours, rtol=0, atol=0)  # hf layout loads back too

    # Negative control: had our RoPE paired neighbours (x[2i], x[2i+1], "interleaved") instead of
    # halves, q and k would need a permutation; applying one must change the logits, so the
    # equality above really pins the convention down.
    dense = dense_of(model)
    h, d = spec.model.n_heads, spec.model.head_dim
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    c = spec.model.d_model
    for i in range(spec.model.n_layers):
        w = dense[f"layers.{i}.attn.qkv.weight"].clone()
        for part in (0, 1):  # q and k
            block = w[part * c : (part + 1) * c].view(h, d, c)
            w[part * c : (part + 1) * c] = block[:, perm].reshape(c, c)
        dense[f"layers.{i}.attn.qkv.weight"] = w
    permuted = write_export(tmp_path / "perm", spec, dense, format="hf")
    assert (_hf_logits(permuted, tokens) - ours).abs().max() > 1e-2


def test_subspace_model_exports_as_dense_weights_with_the_same_outputs(tmp_path):
    spec = small_spec("sub", subspace={"rank": 8})
    model = trained_like(spec)  # perturbs the coefficients A, not U or E_fix (buffers)
    names = {n for n, _ in model.stages[0].named_parameters()}
    assert "embed.coef" in names and "layers.0.attn.proj.coef" in names
    dense = dense_of(model)
    assert dense["layers.0.attn.proj.weight"].shape == (32, 32) and dense["embed.weight"].shape == (64, 32)
    # Dense projections written by constrained layers have rank k.
    assert torch.linalg.matrix_rank(dense["layers.0.ffn.down.weight"]) == 8
    out = write_export(tmp_path / "sub", spec, dense)
    info = json.loads((out / INFO_FILE).read_text())
    assert info["subspace"] is True and info["dense"] is True
    loaded = load_model(out)
    assert "embed.weight" in dict(loaded.stages[0].named_parameters())
    tokens = tokens_for(spec)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens), rtol=1e-5, atol=1e-5)
    assert dense_spec(spec).model.subspace is None and dense_spec(spec).stages == spec.stages


# ----------------------------------------------------------------------------------- checks (pure)


def _download_like(spec: RunSpec, stage: int, **meta_over):
    """(meta, tensors, shapes, names) as a peer's StageCompute.export_state sends them."""
    from swarm.run.model import build_stage
    from swarm.run.optimizer import StageOptimizer

    module = build_stage(spec, stage)
    opt = StageOptimizer(dict(module.named_parameters()), spec.optimizer)
    meta = {
        "spec_hash": spec.spec_hash,
        "stage": stage,
        "version": 9,
        "names": opt.state_names(),
        **opt.metadata(),
    }
    meta.update(meta_over)
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    return meta, [t.clone() for t in opt.state_tensors()], shapes, opt.state_names()


def test_downloaded_state_is_validated_and_parameters_kept():
    spec = small_spec()
    meta, tensors, shapes, names = _download_like(spec, 1, step_count=4)
    state = stage_state_from_download(spec, 1, meta, tensors, expected=shapes, state_names=names)
    assert state.version == 9 and state.step_count == 4 and state.optimizer == "adamw"
    assert set(state.params) == set(shapes)  # optimizer slots are dropped
    assert "head.weight" in state.params

    def refused(match, meta=meta, tensors=tensors):
        with pytest.raises(RecordError, match=match):
            stage_state_from_download(spec, 1, meta, tensors, expected=shapes, state_names=names)

    refused("another spec", meta={**meta, "spec_hash": "f" * 16})
    refused("claims to be stage 0", meta={**meta, "stage": 0})
    refused("named differently", meta={**meta, "names": names[::-1]})
    refused("named differently", tensors=tensors[:-1])
    refused("version", meta={**meta, "version": -1})
    bad = [t.clone() for t in tensors]
    bad[0][0] = float("nan")
    refused("NaN", tensors=bad)
    bad = [t.clone() for t in tensors]
    bad[0] = torch.zeros(3)
    refused("shape", tensors=bad)


def _state(stage: int, steps: int, version: int | None = None, announced=()) -> StageState:
    return StageState(
        stage=stage,
        version=version if version is not None else steps,
        step_count=steps,
        params={},
        announced_versions=tuple(announced),
    )


def test_stages_too_far_behind_are_named():
    assert check_stage_states([_state(0, 100), _state(1, 96), _state(2, 100)], max_step_lag=4) == []
    with pytest.raises(StageUnavailableError, match=r"stage 1 at step 3 .* behind stage 0 \(step 100\)") as e:
        check_stage_states([_state(0, 100), _state(1, 3), _state(2, 99)], max_step_lag=4)
    assert "--max-step-lag 97" in str(e.value)
    with pytest.raises(StageUnavailableError, match="stage 0 at step 0 .*, stage 2 at step 1 .* are more"):
        check_stage_states([_state(0, 0), _state(1, 50), _state(2, 1)], max_step_lag=0)
    # Averaging makes versions differ between stages; only step counts are compared.
    notes = check_stage_states([_state(0, 10, version=14, announced=(14, 20)), _state(1, 10)], max_step_lag=0)
    assert len(notes) == 1 and "stage 0" in notes[0] and "version 20" in notes[0]


def test_export_config_and_cli_flags():
    from swarm.cli import build_parser
    from swarm.cli.commands.export import config_from_args

    maddr = "/ip4/127.0.0.1/tcp/4001/p2p/QmWcs14zqAdEZtLLGwoFcCRp18SE78VmhZgGqmnVBuiRhz"
    args = build_parser().parse_args(
        [
            "export",
            "--initial-peers",
            maddr,
            "--run",
            "tiny",
            "--out",
            "x",
            "--format",
            "hf",
            "--max-step-lag",
            "0",
        ]
    )
    cfg = config_from_args(args)
    assert cfg.format == "hf" and cfg.max_step_lag == 0 and cfg.dht.client_mode and not cfg.overwrite
    for kwargs, match in (
        ({"format": "onnx"}, "not one of safetensors, hf"),
        ({"spec_hash": "XYZ"}, "16 lowercase hex"),
        ({"max_step_lag": -1}, "max_step_lag"),
        ({"state_timeout_s": 0}, "state_timeout_s"),
        ({"run_id": "a.b"}, "run id"),
    ):
        with pytest.raises(ConfigError, match=match):
            ExportConfig(**({"run_id": "tiny", "out_dir": "x"} | kwargs))


# ---------------------------------------------------------------------------------- a live swarm


@pytest.mark.slow
def test_export_of_a_live_swarm_matches_its_peers(tmp_path):
    from peer import StagePeer
    from swarm.dht.network import DHTConfig
    from swarm.tools.export import export_run
    from tests.helpers import Driver, batch, peer_config, start_peers, stop_all, until

    spec = small_spec("exportlive")

    async def main():
        driver = Driver(spec)
        peers: list[StagePeer] = []
        try:
            await driver.start()
            await start_peers(driver, [peer_config(driver, 0), peer_config(driver, 1)], peers)
            route = [p.peer_id for p in peers]
            for seed in (1, 2):  # two real training steps: every stage leaves its init
                tokens, targets = batch(seed, spec)
                mb = await driver.send(route, tokens, targets)
                await driver.wait_reports(mb, {"loss", "done"})
            await until(lambda: [p.version for p in peers] == [2, 2], 10, "both stages at version 2")

            def cfg(out, **kw):
                base = dict(
                    dht=DHTConfig(initial_peers=driver.maddrs(), client_mode=True),
                    run_id=spec.run_id,
                    out_dir=str(out),
                    spec_timeout_s=10,
                    state_timeout_s=20,
                )
                return ExportConfig(**(base | kw))

            fmt = "hf" if _has_transformers() else "safetensors"
            result = await asyncio.to_thread(export_run, cfg(tmp_path / "e", format=fmt, max_step_lag=0))
            assert [(s.version, s.step_count) for s in result.stages] == [(2, 2), (2, 2)]
            ref = build_model(spec)  # the whole model with the peers' current weights
            for stage, peer in zip(ref.stages, peers, strict=True):
                stage.load_state_dict(peer.compute.params(), strict=True)
            loaded = load_model(result.out_dir)
            for name, p in loaded.named_parameters():
                torch.testing.assert_close(p, dict(ref.named_parameters())[name], rtol=0, atol=0)
            tokens = tokens_for(spec)
            with torch.no_grad():
                ours = ref(tokens)
            if fmt == "hf":
                torch.testing.assert_close(_hf_logits(result.out_dir, tokens), ours, rtol=1e-4, atol=1e-4)
            info = json.loads((result.out_dir / INFO_FILE).read_text())
            assert [s["step_count"] for s in info["stages"]] == [2, 2] and info["format"] == fmt

            # Stage 1's only peer falls back to an older point of training (as after a restart from an
            # old checkpoint): the export names it and writes nothing.
            meta, tensors = peers[1].compute.export_state()
            peers[1].compute.import_state(meta | {"step_count": 0, "version": 0}, tensors)
            with pytest.raises(
                StageUnavailableError, match=r"stage 1 at step 0 \(version 0\) is more than 1"
            ):
                await asyncio.to_thread(export_run, cfg(tmp_path / "behind", max_step_lag=1))
            assert not (tmp_path / "behind").exists()
        finally:
            await stop_all(peers, driver)

    asyncio.run(main())


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True
