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


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "peer",
        help="serve one pipeline stage of a run",
        description="Join a run, claim a stage (or --stage N), load its weights and serve it until stopped.",
    )
    add_initial_peers(p)
    p.add_argument(
        "--run", required=True, metavar="RUN_ID", help="the run to serve (its spec comes from the DHT)"
    )
    p.add_argument(
        "--stage", default="auto", help="'auto' (weakest stage, rebalanced later) or a stage number"
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (auto = CUDA when present)")
    add_listen_addresses(p)
    p.add_argument(
        "--identity", metavar="PATH", help="RSA identity file for a stable peer id (created if missing)"
    )
    p.add_argument(
        "--checkpoint-dir", metavar="DIR", help="save state here periodically and on exit; resume from it"
    )
    p.add_argument("--public", action="store_true", help="listen on all interfaces (/ip4/0.0.0.0/tcp/0)")
    p.add_argument("--throughput", type=float, metavar="TOK_S", help="declare tokens/s instead of measuring")
    p.add_argument(
        "--slowdown",
        type=float,
        default=0.0,
        metavar="S",
        help="extra seconds per micro-batch (straggler demos)",
    )
    p.add_argument(
        "--max-queue", type=int, default=64, help="queued compute tasks before refusing (backpressure)"
    )
    p.add_argument(
        "--announce-period", type=float, default=5.0, metavar="S", help="seconds between announcements"
    )
    p.add_argument(
        "--no-rebalance",
        action="store_true",
        help="never move to another stage (default: move only with --stage auto)",
    )
    p.add_argument(
        "--request-timeout", type=float, default=30.0, metavar="S", help="timeout of one call to the next hop"
    )
    p.add_argument(
        "--start-fresh",
        action="store_true",
        help="if the stage's state is lost (no live replica, keeper snapshot or checkpoint) in a run that has "
        "trained, start it from its initial weights anyway instead of refusing (the event is reported)",
    )
    p.add_argument(
        "--weights",
        metavar="DIR",
        help="a --from-pretrained run's checkpoint directory: this stage's initial weights when no live "
        "replica or keeper sends them (only the stage's tensors are read, checked against the spec)",
    )
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
        run_id=args.run,
        stage=args.stage,
        device=args.device,
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        identity_path=args.identity,
        checkpoint_dir=args.checkpoint_dir,
        public=args.public,
        throughput=args.throughput,
        slowdown_s=args.slowdown,
        max_queue=args.max_queue,
        announce_period_s=args.announce_period,
        rebalance=False if args.no_rebalance else None,
        request_timeout_s=args.request_timeout,
        secret=load_secret(args.secret_file),
        start_fresh=args.start_fresh,
        weights_dir=args.weights,
    )
    return run_peer(config)
