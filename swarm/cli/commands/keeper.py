"""``swarm keeper``: keep recent snapshots of every stage of a run, and serve them when a stage loses
every replica (see ``swarm/tools/keeper.py``). Anyone can run one; the run's ``swarm init`` runs one too.

    swarm keeper --initial-peers MADDR --run tiny                      # snapshots/tiny, every 180 s
    swarm keeper --initial-peers MADDR --run tiny --dir /data/tiny --interval-s 60 --keep 5
    swarm keeper --initial-peers MADDR --run mine --weights llama-dir/   # also serve a --from-pretrained
                                                                         # run's initial weights

Runs until Ctrl-C or SIGTERM, printing a line per snapshot taken.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

from swarm.cli.commands import add_initial_peers, add_listen_addresses, add_secret_file
from swarm.cli.flags import Flag, add_flags, flag_values

# KeeperConfig's fields that `swarm keeper` and `swarm init` set; the dests are what init reads.
KEEPER_FLAGS = (
    Flag(
        "directory",
        "--keeper-dir",
        aliases=("--dir",),
        dest="keeper_dir",
        default=None,
        metavar="DIR",
        help="where stage snapshots are kept (default: snapshots/RUN_ID)",
    ),
    Flag(
        "interval_s",
        "--snapshot-interval-s",
        aliases=("--interval-s",),
        dest="snapshot_interval_s",
        metavar="S",
    ),
    Flag("keep", "--keep-snapshots", aliases=("--keep",), dest="keep_snapshots", metavar="N"),
    Flag("link_share", "--keeper-link-share", dest="keeper_link_share", metavar="F"),
)


SUMMARY = "keep recent snapshots of every stage of a run and serve them when a stage loses its peers"


def add_keeper_options(p: argparse.ArgumentParser) -> None:
    """``--keeper-dir``, ``--snapshot-interval-s``, ``--keep-snapshots`` (shared with ``swarm init``)."""
    from swarm.tools.keeper import KeeperConfig

    add_flags(p, KeeperConfig, KEEPER_FLAGS)


def keeper_config(args: argparse.Namespace, run_id: str, *, initial_weights: str | None = None):  # type: ignore[no-untyped-def]
    from swarm.tools.keeper import KeeperConfig

    values = flag_values(args, KEEPER_FLAGS)
    values["directory"] = values["directory"] or os.path.join("snapshots", run_id)
    return KeeperConfig(**values, initial_weights=initial_weights)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "keeper",
        help=SUMMARY,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_initial_peers(p)
    p.add_argument("--run", required=True, metavar="RUN_ID", help="the run to keep")
    add_keeper_options(p)
    add_listen_addresses(p)
    p.add_argument("--identity", metavar="PATH", help="RSA identity file for a stable peer id")
    p.add_argument("--public", action="store_true", help="listen on all interfaces (/ip4/0.0.0.0/tcp/0)")
    p.add_argument(
        "--weights",
        metavar="DIR",
        help="a --from-pretrained run's checkpoint: serve its initial stage weights (version 0) until "
        "a stage has trained",
    )
    add_secret_file(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    from swarm.dht.auth import RunAuth, load_secret
    from swarm.dht.membership import Membership
    from swarm.dht.network import DHTConfig, parse_maddrs, start_dht
    from swarm.tools.keeper import Keeper

    cfg = keeper_config(args, args.run, initial_weights=args.weights)
    dht = start_dht(
        DHTConfig(
            initial_peers=parse_maddrs(args.initial_peers, what="--initial-peers"),
            host_maddrs=tuple(args.host_maddrs) or DHTConfig().host_maddrs,
            announce_maddrs=tuple(args.announce_maddrs),
            identity_path=args.identity,
            public=args.public,
        )
    )
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    keeper = None
    try:
        membership = Membership(dht, args.run)
        spec = membership.fetch_spec(timeout_s=30.0)
        membership.set_auth(RunAuth.from_spec(spec, load_secret(args.secret_file)))
        keeper = Keeper(dht, membership, spec, cfg).start()
        print(
            f"keeper {membership.peer_id} of run {spec.run_id} (spec {spec.spec_hash}): snapshots in "
            f"{os.path.abspath(cfg.directory)}, every {cfg.interval_s:.0f} s, {cfg.keep} kept per stage",
            flush=True,
        )
        print(keeper.status(), flush=True)
        keeper.serve(stop, out=lambda line: print(line, flush=True))
    finally:
        if keeper is not None:
            keeper.close()
        dht.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("keeper stopped.", flush=True)
    return 0
