"""``swarm init [RUN.yaml]``: start a bootstrap node for a new run and print how to join it.

    swarm init examples/tiny.yaml                 # loopback only: peers on this machine
    swarm init examples/tiny.yaml --public --host-maddrs /ip4/0.0.0.0/tcp/31337 \\
        --announce-maddrs /ip4/<PUBLIC_IP>/tcp/31337 --identity bootstrap.key
    swarm init                                     # a plain entry point, no run

It runs until Ctrl-C or SIGTERM, printing a status line every ``--status-interval-s`` seconds and
re-publishing the run before its DHT records expire; it shuts the DHT down on the way out.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "init",
        help="start a bootstrap node for a new run and print the commands that join it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "spec", nargs="?", metavar="RUN.yaml", help="run spec file (omit for a plain bootstrap node)"
    )
    p.add_argument(
        "--initial-peers",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="join an existing swarm instead of starting a new one (multiaddrs with /p2p/)",
    )
    p.add_argument(
        "--host-maddrs",
        nargs="+",
        default=None,
        metavar="MADDR",
        help="where to listen (default /ip4/127.0.0.1/tcp/0: this machine only)",
    )
    p.add_argument(
        "--announce-maddrs",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="addresses others should dial, e.g. /ip4/<PUBLIC_IP>/tcp/31337 behind NAT (fixed port)",
    )
    p.add_argument(
        "--identity",
        dest="identity_path",
        default=None,
        metavar="PATH",
        help="RSA identity file for a stable address (created if missing)",
    )
    p.add_argument("--public", action="store_true", help="listen on all interfaces (/ip4/0.0.0.0/tcp/0)")
    p.add_argument(
        "--status-interval-s",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between status lines (default 10)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault(
        "HIVEMIND_LOGLEVEL", "WARNING"
    )  # before hivemind is imported: keep the output readable
    from swarm.bootstrap import Bootstrap, BootstrapConfig
    from swarm.network import DHTConfig, reachability_warning
    from swarm.spec import RunSpec

    spec = RunSpec.from_yaml(args.spec) if args.spec else None
    dht_cfg_kwargs = {}
    if args.host_maddrs is not None:
        dht_cfg_kwargs["host_maddrs"] = tuple(args.host_maddrs)
    cfg = BootstrapConfig(
        dht=DHTConfig(
            initial_peers=tuple(args.initial_peers),
            announce_maddrs=tuple(args.announce_maddrs),
            identity_path=args.identity_path,
            public=args.public,
            **dht_cfg_kwargs,
        ),
        spec=spec,
        status_interval_s=args.status_interval_s,
    )

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    boot = Bootstrap(cfg)
    try:
        boot.start()
        maddrs = boot.maddrs
        if spec is not None:
            print(f"run {spec.run_id} (spec {spec.spec_hash}, {spec.num_stages} stages) is published.")
        else:
            print("bootstrap node started (no run).")
        print("initial peers: " + " ".join(maddrs))
        warning = reachability_warning(cfg.dht.initial_peers, list(cfg.dht.announce_maddrs) or maddrs)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        print("join with:")
        for command in boot.join_commands():
            print(f"  {command}")
        print("Ctrl-C stops this node.", flush=True)
        boot.serve(stop, out=lambda line: print(line, flush=True))
    finally:
        boot.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("bootstrap node stopped.", flush=True)
    return 0
