"""``swarm status`` (per-stage table of a run) and ``swarm runs`` (the runs of a swarm).

    swarm status --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/PEERID --run tiny
    swarm status --initial-peers ... --json          # every run in the registry, as JSON
    swarm status --initial-peers ... --run mine --secret-file mine.secret   # check a private run's peers
    swarm runs --initial-peers ...

Both join the DHT as a client (they only read), print, and leave.
"""

from __future__ import annotations

import argparse
import json
import os

from swarm.cli.commands import add_initial_peers, add_secret_file


def _common(p: argparse.ArgumentParser) -> None:
    add_initial_peers(p)
    p.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds to wait for a run's spec to appear (default 5)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status",
        help="show each stage's peers, throughput and the run's progress",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(p)
    p.add_argument("--run", default=None, metavar="RUN", help="run id (default: every run in the registry)")
    add_secret_file(p, "join secret of the private run --run names, to hide outsiders' records")
    p.set_defaults(func=run_status)
    r = subparsers.add_parser(
        "runs",
        help="list the runs registered in a swarm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(r)
    r.set_defaults(func=run_runs)


def _open(args: argparse.Namespace):
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")  # before hivemind is imported
    from swarm.dht.network import DHTConfig, start_dht

    # A client only dials out: status works from behind NAT and stores nothing for others.
    return start_dht(DHTConfig(initial_peers=tuple(args.initial_peers), client_mode=True))


def run_status(args: argparse.Namespace) -> int:
    from swarm.dht.auth import load_secret
    from swarm.dht.membership import Membership
    from swarm.errors import ConfigError
    from swarm.tools.status import gather_run_status, render_run_status

    secret = load_secret(args.secret_file)
    if args.secret_file and not args.run:
        raise ConfigError(
            f"--secret-file {args.secret_file} needs --run RUN: a join secret belongs to one private run"
        )
    dht = _open(args)
    try:
        registry = Membership(dht, None)
        run_ids = [args.run] if args.run else sorted({e.run_id for e in registry.list_runs()})
        statuses = [
            gather_run_status(
                registry.for_run(r), spec_timeout_s=args.timeout_s, secret=secret if args.run else None
            )
            for r in run_ids
        ]
        if args.json:
            print(json.dumps({"runs": [s.to_json() for s in statuses]}, indent=2))
        elif not statuses:
            print("no runs registered in this swarm (start one with `swarm init RUN.yaml`)")
        else:
            print("\n\n".join(render_run_status(s) for s in statuses))
    finally:
        dht.shutdown()
    return 0


def run_runs(args: argparse.Namespace) -> int:
    from swarm.dht.membership import Membership
    from swarm.tools.status import render_runs

    dht = _open(args)
    try:
        entries = Membership(dht, None).list_runs()
        if args.json:
            print(
                json.dumps(
                    {"runs": [{k: getattr(e, k) for k in e.__dataclass_fields__} for e in entries]}, indent=2
                )
            )
        else:
            print(render_runs(entries))
    finally:
        dht.shutdown()
    return 0
