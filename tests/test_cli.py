import subprocess
import sys

import pytest

from swarm.cli import main
from swarm.version import __version__


def test_version_flag(capsys):
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert __version__ in capsys.readouterr().out


@pytest.mark.integration
def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "swarm.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and "swarmpipe" in out.stdout


# ---- flags generated from the configs (swarm/cli/flags.py) ---------------------------------------


def parse(*words):
    from swarm.cli.main import build_parser

    return build_parser(only=words[0]).parse_args(list(words))


def test_flags_left_out_give_the_configs_own_defaults(monkeypatch):
    from peer.config import PeerConfig
    from swarm.cli.commands import demo, keeper, peer, train
    from swarm.cli.flags import flag_values
    from swarm.tools.demo import DemoConfig
    from swarm.tools.keeper import KeeperConfig
    from swarm.train.data import DataConfig
    from swarm.train.trainer import TrainerConfig

    monkeypatch.delenv("SWARMPIPE_SECRET", raising=False)
    args = parse("peer", "--initial-peers", "x", "--run", "r")
    assert PeerConfig(initial_peers=("x",), **flag_values(args, peer.FLAGS)) == PeerConfig(
        initial_peers=("x",), run_id="r"
    )
    args = parse("train", "--initial-peers", "x", "--run", "r")
    assert train.config_from_args(args) == TrainerConfig(
        initial_peers=("x",), run_id="r", data=DataConfig(), out_dir="runs/r"
    )
    assert DemoConfig(**flag_values(parse("demo"), demo.FLAGS)) == DemoConfig()
    args = parse("keeper", "--initial-peers", "x", "--run", "r")
    assert keeper.keeper_config(args, "r") == KeeperConfig(directory="snapshots/r")


def test_each_flag_sets_its_config_field():
    from peer.config import PeerConfig
    from swarm.cli.commands import demo, keeper, peer, train
    from swarm.cli.flags import flag_values
    from swarm.tools.demo import DemoConfig

    args = parse(
        "peer", "--initial-peers", "x", "--run", "r", "--stage", "1", "--device", "cpu", "--identity", "id",
        "--checkpoint-dir", "ck", "--public", "--throughput", "100", "--slowdown", "0.5", "--max-queue", "8",
        "--announce-period", "2", "--no-rebalance", "--request-timeout", "3", "--start-fresh",
    )  # fmt: skip
    cfg = PeerConfig(initial_peers=("x",), **flag_values(args, peer.FLAGS))
    assert (cfg.stage, cfg.device, cfg.identity_path, cfg.checkpoint_dir, cfg.public) == (
        1,
        "cpu",
        "id",
        "ck",
        True,
    )
    assert (cfg.throughput, cfg.slowdown_s, cfg.max_queue, cfg.announce_period_s) == (100.0, 0.5, 8, 2.0)
    assert (cfg.rebalance, cfg.request_timeout_s, cfg.start_fresh) == (False, 3.0, True)
    args = parse(
        "train", "--initial-peers", "x", "--run", "r", "--tokens", "5000", "--max-inflight", "3",
        "--fixed-inflight", "--max-attempts", "2", "--eval-every", "10", "--seed", "4", "--out", "o",
        "--eval-batches", "3", "--trainer-id", "t1", "--host-maddrs", "/ip4/1.2.3.4/tcp/5", "--quiet", "--log", "wandb",
        "--max-data-bytes", "4096",
    )  # fmt: skip
    cfg = train.config_from_args(args)
    assert (cfg.tokens, cfg.max_inflight, cfg.pacing, cfg.max_attempts, cfg.eval_every) == (
        5000,
        3,
        False,
        2,
        10,
    )
    assert (cfg.seed, cfg.out_dir, cfg.trainer_id, cfg.quiet, cfg.log) == (4, "o", "t1", True, ("wandb",))
    assert cfg.eval_batches == 3
    assert cfg.host_maddrs == ("/ip4/1.2.3.4/tcp/5",) and cfg.data.max_bytes == 4096
    with pytest.raises(SystemExit):  # --steps and --tokens stay exclusive
        parse("train", "--initial-peers", "x", "--run", "r", "--steps", "1", "--tokens", "1")
    args = parse(
        "keeper", "--initial-peers", "x", "--run", "r", "--dir", "d", "--interval-s", "60", "--keep", "5"
    )
    kc = keeper.keeper_config(args, "r")
    assert (kc.directory, kc.interval_s, kc.keep) == ("d", 60.0, 5)
    args = parse("demo", "--stages", "3", "--steps", "9", "--no-reference", "--chaos", "--eval-every", "0")
    dc = DemoConfig(**flag_values(args, demo.FLAGS))
    assert (dc.stages, dc.steps, dc.reference, dc.chaos, dc.eval_every) == (3, 9, False, True, 0)


def test_help_comes_from_the_field_docstrings_and_defaults(capsys):
    with pytest.raises(SystemExit):
        parse("peer", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "Compute tasks queued at most" in text and "(default 64)" in text
    assert "Seconds between announcements and rebalancing checks (jittered by +-20 %) (default 5.0)" in text


@pytest.mark.integration
def test_a_run_of_one_command_does_not_import_the_others_configs():
    code = (
        "import sys; from swarm.cli.main import build_parser; build_parser(only='codecs');"
        "print('torch' in sys.modules, 'peer.config' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
