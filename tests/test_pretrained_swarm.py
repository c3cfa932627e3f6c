"""A run that continues a checkpoint, with real peers on loopback (swarm/run/pretrained.py).

1. In-process peers, no keeper: a peer with ``--weights`` starts its stage from the checkpoint's
   tensors (checked against the spec's digest); ``--weights`` of another checkpoint stops the peer
   with the digest error; a peer with neither a donor nor ``--weights`` refuses to start, naming
   ``--weights``; a peer without ``--weights`` joining a stage with a live replica takes its state.
2. Peers as ``swarm peer`` processes, the bootstrap's keeper serving the initial stage states: one
   peer without a copy of the checkpoint, one with ``--weights``; a trainer fine-tunes with the
   checkpoint's tokenizer (found without ``--tokenizer``) on a local text file and its held-out loss
   falls; ``swarm generate`` decodes with that tokenizer; the export loads in transformers and
   generates with the original tokenizer.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is optional: pip install transformers")
pytest.importorskip("tokenizers", reason="tokenizers is optional: pip install tokenizers")

from swarm.dht.snapshots import StageStateLost  # noqa: E402
from swarm.errors import ConfigError  # noqa: E402
from swarm.run.pretrained import read_stage_weights, remember_tokenizer, spec_from_pretrained  # noqa: E402
from swarm.tools.toy_checkpoint import ToyLlama, make_toy_llama  # noqa: E402

pytestmark = pytest.mark.slow

FINE_TUNE = {
    "codecs": {"activations": "none", "gradients": "none"},
    "optimizer": {"name": "adamw", "lr": 3e-3, "accumulate": 1},
    "micro_batch_size": 4,
}


def test_peers_start_from_weights_checked_against_the_spec(tmp_path):
    from peer import StagePeer
    from tests.helpers import Driver, peer_config, start_peers, stop_all

    ckpt = make_toy_llama(tmp_path / "ckpt", ToyLlama(n_kv_heads=2))
    other = make_toy_llama(tmp_path / "other", ToyLlama(n_kv_heads=2, seed=7))
    spec = spec_from_pretrained(ckpt, base=FINE_TUNE, stages=2, seq_len=32, run_id="pre-weights")

    async def main():
        driver = Driver(spec)
        peers: list[StagePeer] = []
        try:
            await driver.start()
            with pytest.raises(
                ConfigError, match=r"initial weights of stage 1 from --weights .* have digest"
            ):
                await start_peers(driver, [peer_config(driver, 1, weights_dir=str(other))], peers)
            with pytest.raises(StageStateLost, match=r"continues the checkpoint 'ckpt'.*--weights DIR"):
                await start_peers(driver, [peer_config(driver, 1)], peers)
            await start_peers(driver, [peer_config(driver, s, weights_dir=str(ckpt)) for s in (0, 1)], peers)
            ok = peers[-2:]
            assert [p.loaded_from for p in ok] == ["weights", "weights"]
            # a peer without a copy of the checkpoint takes the stage from its live replica first
            await start_peers(driver, [peer_config(driver, 1)], peers)
            assert peers[-1].loaded_from == "peer"
            ok.append(peers[-1])
            for p in ok:
                expected = read_stage_weights(ckpt, spec, p.stage)
                for name, value in p.compute.params().items():
                    torch.testing.assert_close(value, expected[name], rtol=0, atol=0)
        finally:
            await stop_all(peers, driver)

    asyncio.run(main())


def test_fine_tune_a_checkpoint_through_the_swarm(tmp_path, monkeypatch):
    import transformers

    from swarm.dht.network import DHTConfig
    from swarm.tools.demo import Demo, DemoConfig
    from swarm.tools.export import ExportConfig, export_run
    from swarm.tools.generation import GenerateConfig, generate
    from swarm.tools.keeper import KeeperConfig
    from swarm.train.data import DataConfig
    from swarm.train.metrics import read_metrics
    from swarm.train.trainer import Trainer, TrainerConfig

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the remembered tokenizer goes here
    ckpt = make_toy_llama(tmp_path / "ckpt", ToyLlama(n_kv_heads=2, max_shard_size="100KB"))
    spec = spec_from_pretrained(ckpt, base=FINE_TUNE, stages=2, seq_len=32, run_id="pre-swarm")
    remember_tokenizer(ckpt)  # what `swarm init --from-pretrained` does
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(3000)))
    demo = Demo(
        DemoConfig(
            spec=spec,
            peers_per_stage=1,
            out_dir=str(tmp_path / "demo"),
            peer_args=("--throughput", "20000"),
            peer_args_by_index={1: ("--weights", str(ckpt))},
            keeper=KeeperConfig(directory=str(tmp_path / "snap"), initial_weights=str(ckpt)),
            torch_threads=1,
            quiet=True,
        )
    )
    try:
        demo.start()
        logs = [p.log_path.read_text() for p in demo.peers]
        assert all("state from the keeper's snapshot (version 0)" in log for log in logs), logs
        trainer = Trainer(
            TrainerConfig(
                initial_peers=(demo.maddr,),
                run_id=spec.run_id,
                out_dir=str(tmp_path / "train"),
                steps=40,
                eval_every=20,
                max_inflight=2,
                quiet=True,
                data=DataConfig(source=str(corpus)),
            )
        )
        trainer.train()
        evals = [e["eval_loss"] for e in read_metrics(tmp_path / "train" / "metrics.jsonl", "eval")]
        assert len(evals) >= 2 and evals[-1] < evals[0] - 0.5, evals
        text = generate(
            GenerateConfig(
                initial_peers=(demo.maddr,),
                run_id=spec.run_id,
                prompt="def ",
                max_new_tokens=8,
                temperature=0,
            )
        )
        assert isinstance(text, str) and text
        result = export_run(
            ExportConfig(
                dht=DHTConfig(initial_peers=(demo.maddr,), client_mode=True),
                run_id=spec.run_id,
                out_dir=str(tmp_path / "export"),
                format="hf",
                state_timeout_s=30,
            )
        )
    finally:
        demo.shutdown()
    assert demo.leftovers() == []
    model = transformers.AutoModelForCausalLM.from_pretrained(str(result.out_dir), dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(ckpt))  # the original tokenizer
    ids = tokenizer("def f1(x):\n", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert out.shape[1] > ids.shape[1]
    assert tokenizer.decode(out[0, ids.shape[1] :])  # it generates text (greedy: may be newlines)


def test_swarm_init_from_pretrained_cli(tmp_path):
    import json
    import os
    import signal
    import subprocess
    import sys

    ckpt = make_toy_llama(tmp_path / "llama-tiny", ToyLlama())
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), HIVEMIND_LOGLEVEL="WARNING")
    cli = [sys.executable, "-m", "swarm.cli", "init", "--from-pretrained", str(ckpt), "--keeper-dir"]
    cli += [str(tmp_path / "snap"), "--status-interval-s", "1"]
    proc = subprocess.Popen(
        [*cli, "--stages", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops this node" in line:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    out = "".join(lines)
    assert "stage 0: initial weights" in out and "stage 1: initial weights" in out, out
    assert "run llama-tiny (spec " in out and "continues the checkpoint 'llama-tiny'" in out, out
    assert "--run llama-tiny" in out and (tmp_path / "cache" / "swarmpipe" / "tokenizers").is_dir()
    config = json.loads((ckpt / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (ckpt / "config.json").write_text(json.dumps(config))
    refused = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode != 0
    assert "hidden_act = 'gelu' is not supported: the SwiGLU blocks use SiLU" in refused.stderr, (
        refused.stderr
    )
