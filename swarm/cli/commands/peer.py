"""``swarm peer``: serve one pipeline stage of a run until Ctrl-C / SIGTERM.

Examples::

    swarm peer --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID --run tiny
    swarm peer --initial-peers ... --run tiny --stage 1 --device cuda:0 --checkpoint-dir ckpt/s1
    swarm peer --initial-peers ... --run mine --weights llama-dir/   # a --from-pretrained run's checkpoint
    swarm peer --initial-peers ... --run tiny --public --announce-maddrs /ip4/203.0.113.7/tcp/31337 \\
        --host-maddrs /ip4/0.0.0.0/tcp/31337 --identity peer.key

Once online it prints ``peer <peer_id> serving stage <i> of run <run_id>`` on stdout (one line,
flushed), which scripts that start peers as subprocesses wait for.
"""

from __future__ import annotations

import argparse

from swarm.cli.commands import add_initial_peers, add_listen_addresses, add_secret_file
from swarm.cli.flags import Flag, add_flags, flag_values

SUMMARY = "serve one pipeline stage of a run"


def _emulated(text: str) -> tuple[float, float]:
    """``"F,B"`` in milliseconds -> (forward, backward) seconds; PeerConfig checks the values."""
    try:
        forward, backward = (float(v) / 1000 for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not F,B in milliseconds, e.g. 40,80") from None
    return forward, backward


# PeerConfig's fields that `swarm peer` sets from a flag; defaults, types and help come from PeerConfig.
FLAGS = (
    Flag("run_id", "--run", metavar="RUN_ID"),
    Flag("stage", "--stage"),
    Flag("device", "--device"),
    Flag("identity_path", "--identity", metavar="PATH"),
    Flag("checkpoint_dir", "--checkpoint-dir", metavar="DIR"),
    Flag("public", "--public"),
    Flag("throughput", "--throughput", metavar="TOK_S"),
    Flag("slowdown_s", "--slowdown", metavar="S"),
    Flag(
        "emulate_compute_s",
        "--emulate-compute-ms",
        metavar="F,B",
        type=_emulated,
        help="benchmark knob: each micro-batch occupies the stage at least F ms forward and B ms backward "
        "(the rest slept after the real compute, like a GPU; benchmarks/bubbles.py)",
    ),
    Flag("timeline_path", "--timeline", metavar="FILE"),
    Flag("max_queue", "--max-queue", metavar="N"),
    Flag("announce_period_s", "--announce-period", metavar="S"),
    Flag(
        "rebalance",
        "--no-rebalance",
        const=False,
        help="never move to another stage (default: move only with --stage auto)",
    ),
    Flag("request_timeout_s", "--request-timeout", metavar="S"),
    Flag("start_fresh", "--start-fresh"),
    Flag("weights_dir", "--weights", metavar="DIR"),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    from peer.config import PeerConfig

    p = subparsers.add_parser(
        "peer",
        help=SUMMARY,
        description="Join a run, claim a stage (or --stage N), load its weights and serve it until stopped.",
    )
    add_initial_peers(p)
    add_listen_addresses(p)
    add_flags(p, PeerConfig, FLAGS)
    add_secret_file(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from peer.config import PeerConfig
    from peer.runner import run_peer
    from swarm.dht.auth import load_secret

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = PeerConfig(
        initial_peers=tuple(args.initial_peers),
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        secret=load_secret(args.secret_file),
        **flag_values(args, FLAGS),
    )
    return run_peer(config)
