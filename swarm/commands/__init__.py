"""Subcommands of ``swarm``: one module per command, each exposing ``register(subparsers)``."""
