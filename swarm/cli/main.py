"""The ``swarm`` command line: a thin layer that parses into config dataclasses and calls the API.

Each subcommand lives in its own module under ``swarm/cli/commands/`` and exposes
``register(subparsers) -> None``; the parser it adds sets ``func`` to a callable taking the parsed
namespace and returning an exit code. Modules are imported here by name so that adding a command
needs no edit anywhere else; heavy imports (torch, hivemind) happen inside ``func``, not at import.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from swarm.errors import SwarmError
from swarm.version import __version__

# Order is the order shown in `swarm --help`.
COMMAND_MODULES = (
    "init",
    "peer",
    "keeper",
    "train",
    "demo",
    "status",
    "generate",
    "export",
    "monitor",
    "codecs",
)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``swarm`` parser. With ``only``, the other commands that set ``SUMMARY`` get just that one-line
    help: their flags come from config classes whose modules may be slow to import (``peer.config`` and
    ``swarm.train.trainer`` import torch), which a run of another command should not pay for."""
    parser = argparse.ArgumentParser(
        prog="swarm",
        description="swarmpipe: train one model together, one pipeline stage per peer.",
    )
    parser.add_argument("--version", action="version", version=f"swarmpipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"swarm.cli.commands.{name}")
        if only is not None and name != only and hasattr(module, "SUMMARY"):
            sub.add_parser(name, help=module.SUMMARY)
        else:
            module.register(sub)
    return parser


def _command_in(argv: list[str]) -> str:
    """The command named on a command line ("" if none): the first word that is not an option
    (``swarm`` itself has no option that takes a value)."""
    return next((word for word in argv if not word.startswith("-")), "")


def main(argv: list[str] | None = None) -> int:
    """Entry point. ``argv=None`` means a real process (the console script): then SIGTERM shuts down
    like Ctrl-C and, at the end, leftover children are reaped (see ``swarm/dht/processes.py``)."""
    parser = build_parser(only=_command_in(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    own_process = argv is None
    if own_process:
        from swarm.dht.processes import terminate_as_interrupt

        terminate_as_interrupt()
    try:
        return int(args.func(args) or 0)
    except SwarmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if own_process:
            from swarm.dht.processes import reap_children

            killed = reap_children()
            if killed:
                print(f"stopped {len(killed)} leftover child processes: {', '.join(killed)}", file=sys.stderr)
