"""The ``swarm`` command line (``main``) and its subcommands (``commands/``); the top layer.

``python -m swarm.cli`` runs it too (``__main__``).
"""

from swarm.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
