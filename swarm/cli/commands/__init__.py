"""Subcommands of ``swarm``: one module per command, each exposing ``register(subparsers)``.

Also the arguments several commands share, so their flags read the same everywhere.
"""

from __future__ import annotations

import argparse


def add_initial_peers(p: argparse.ArgumentParser) -> None:
    """``--initial-peers MADDR...`` (required): how a command finds the swarm."""
    p.add_argument(
        "--initial-peers",
        nargs="+",
        required=True,
        metavar="MADDR",
        help="any peer of the swarm, e.g. the address printed by `swarm init`",
    )


def add_listen_addresses(p: argparse.ArgumentParser) -> None:
    """``--host-maddrs`` / ``--announce-maddrs``: where a long-running process listens and what others dial."""
    p.add_argument(
        "--host-maddrs", nargs="+", default=(), metavar="MADDR", help="listen here (default loopback)"
    )
    p.add_argument(
        "--announce-maddrs",
        nargs="+",
        default=(),
        metavar="MADDR",
        help="addresses others dial (port forwarding)",
    )


def add_secret_file(p: argparse.ArgumentParser, what: str = "join secret of a private run") -> None:
    """``--secret-file PATH``: a private run's join secret (``swarm.dht.auth.load_secret`` reads it)."""
    p.add_argument(
        "--secret-file",
        default=None,
        metavar="PATH",
        help=f"{what} (default: the SWARMPIPE_SECRET environment variable)",
    )
