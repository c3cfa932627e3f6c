"""PeerConfig validation and the cached self-benchmark (no network)."""

import json

import pytest

from peer.config import PeerConfig, resolve_device
from peer.throughput import measure_throughput
from swarm.errors import ConfigError
from swarm.run.spec import RunSpec


def cfg(**kw) -> PeerConfig:
    return PeerConfig(**({"initial_peers": (), "run_id": "r"} | kw))


def test_peer_config_checks_and_normalises():
    assert cfg(stage="2").stage == 2
    assert cfg(emulate_compute_s=[0.04, 0]).emulate_compute_s == (0.04, 0.0)
    assert cfg().rebalancing and not cfg(stage=1).rebalancing and cfg(stage=1, rebalance=True).rebalancing
    assert cfg(initial_peers="/ip4/127.0.0.1/tcp/1/p2p/x").initial_peers == ("/ip4/127.0.0.1/tcp/1/p2p/x",)
    for bad in (
        {"stage": "first"},
        {"stage": -1},
        {"stage": True},
        {"device": "tpu"},
        {"slowdown_s": -0.1},
        {"emulate_compute_s": (0.04,)},
        {"emulate_compute_s": (0.04, -1.0)},
        {"announce_period_s": 0},
        {"max_queue": 0},
        {"throughput": float("nan")},
        {"run_id": ""},
    ):
        with pytest.raises(ConfigError):
            cfg(**bad)
    assert resolve_device("cpu") == "cpu" and resolve_device("auto") in ("cpu", "cuda")


def test_throughput_is_measured_once_per_device_spec_and_stage(tmp_path):
    spec = RunSpec.from_dict(
        {
            "run_id": "bench",
            "model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
            "stages": 2,
            "codecs": {"activations": "none", "gradients": "none"},
            "micro_batch_size": 2,
        }
    )
    first = measure_throughput(spec, 1, "cpu", cache_dir=tmp_path, budget_s=0.2)
    assert first > 0
    cache = json.loads((tmp_path / "throughput.json").read_text())
    assert len(cache) == 1 and next(iter(cache)).endswith(f"|{spec.spec_hash}|1")
    assert measure_throughput(spec, 1, "cpu", cache_dir=tmp_path, budget_s=0.2) == first  # from the cache
    measure_throughput(spec, 0, "cpu", cache_dir=tmp_path, budget_s=0.2)
    assert len(json.loads((tmp_path / "throughput.json").read_text())) == 2


def test_a_bad_value_names_the_field_the_value_the_rule_and_the_next_step():
    with pytest.raises(
        ConfigError, match=r"^announce_period_s = 0\.0 is invalid: it must be > 0\.0\. Give .+\.$"
    ):
        cfg(announce_period_s=0)
    with pytest.raises(
        ConfigError, match=r"^max_queue = True is invalid: it must be an integer, not bool\. "
    ):
        cfg(max_queue=True)
    assert cfg(announce_period_s=2).announce_period_s == 2.0  # normalised to a float
    assert cfg(max_queue=8).max_queue_per_sender == 6  # the derived default still follows max_queue


def test_emulate_compute_flag_parses_milliseconds_into_seconds():
    from swarm.cli.main import build_parser

    base = ["peer", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--run", "r"]
    args = build_parser().parse_args([*base, "--emulate-compute-ms", "40,80"])
    assert args.emulate_compute_s == (0.04, 0.08)
    assert build_parser().parse_args(base).emulate_compute_s is None
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--emulate-compute-ms", "40"])
