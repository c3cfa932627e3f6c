"""``swarm monitor``: serve a self-refreshing web page that shows a run's stages, peers and progress.

    swarm monitor --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/PEERID --run tiny
    swarm monitor --initial-peers ... --port 9000 --host 0.0.0.0     # reachable from other machines
    curl http://127.0.0.1:8080/api/status                             # the same data as JSON
    curl http://127.0.0.1:8080/metrics                                # Prometheus text metrics

Without ``--run`` it shows every run in the swarm's registry. It joins the DHT as a client (it only
reads), runs until Ctrl-C or SIGTERM, and shuts the DHT down on the way out.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

from swarm.cli.commands import add_initial_peers, add_secret_file


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "monitor",
        help="serve a web page (and /api/status JSON) that shows a run as it trains",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_initial_peers(p)
    p.add_argument("--run", default=None, metavar="RUN", help="run id (default: every run in the registry)")
    p.add_argument("--port", type=int, default=8080, help="web server port (default 8080; 0 = any free port)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes the page)",
    )
    p.add_argument(
        "--poll-interval-s",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds between DHT reads (default 2)",
    )
    p.add_argument(
        "--refresh-s", type=float, default=3.0, metavar="S", help="seconds between page refreshes (default 3)"
    )
    p.add_argument(
        "--history", type=int, default=2000, metavar="N", help="progress samples kept per run (default 2000)"
    )
    p.add_argument("--no-prometheus", action="store_true", help="do not serve /metrics")
    add_secret_file(p, "join secret of the private run --run names, to hide outsiders' records")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    """The ``MonitorConfig`` these flags describe (raises ``ConfigError`` on bad values)."""
    from swarm.dht.auth import load_secret
    from swarm.dht.network import DHTConfig
    from swarm.tools.monitor import MonitorConfig

    return MonitorConfig(
        dht=DHTConfig(initial_peers=tuple(args.initial_peers), client_mode=True),
        run_id=args.run,
        host=args.host,
        port=args.port,
        poll_interval_s=args.poll_interval_s,
        refresh_s=args.refresh_s,
        history=args.history,
        prometheus=not args.no_prometheus,
        secret=load_secret(getattr(args, "secret_file", None)),
    )


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")  # before hivemind is imported
    from swarm.tools.monitor import Monitor

    cfg = config_from_args(args)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    monitor = Monitor(cfg)
    try:
        monitor.start()
        print(f"monitor serving {monitor.url}  (JSON: {monitor.url}api/status)", flush=True)
        if cfg.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"note: bound to {cfg.host}: anyone who can reach this port sees the page", flush=True)
        print("Ctrl-C stops it.", flush=True)
        stop.wait()
    finally:
        monitor.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("monitor stopped.", flush=True)
    return 0
