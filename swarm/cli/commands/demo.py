"""``swarm demo``: start a bootstrap, stage peers and a trainer on this machine and train a small model.

    swarm demo
    swarm demo --stages 2 --peers-per-stage 2 --steps 60 --codec int8 --out runs/demo --chaos

Everything listens on 127.0.0.1 only and is shut down at the end (also on Ctrl-C). See swarm/tools/demo.py.
"""

from __future__ import annotations

import argparse
import os

from swarm.cli.flags import Flag, add_flags, flag_values

# DemoConfig's fields that `swarm demo` sets; defaults and help come from DemoConfig.
FLAGS = (
    Flag("stages", "--stages", metavar="S"),
    Flag("peers_per_stage", "--peers-per-stage", metavar="P"),
    Flag("steps", "--steps", metavar="N"),
    Flag("codec", "--codec", metavar="NAME"),
    Flag("out_dir", "--out", metavar="DIR", help="output directory"),
    Flag("chaos", "--chaos"),
    Flag("spec_path", "--spec", metavar="RUN.yaml"),
    Flag("max_inflight", "--max-inflight", metavar="K"),
    Flag("eval_every", "--eval-every", type=int, metavar="N"),
    Flag("seed", "--seed", help="data and routing seed of the trainer"),
    Flag(
        "reference",
        "--no-reference",
        const=False,
        help="skip training the same model in one process afterwards (the held-out comparison)",
    ),
    Flag("quiet", "--quiet", help="print only errors"),
)


SUMMARY = "train a small model with a local swarm (bootstrap, peers, trainer), then clean up"


def register(subparsers: argparse._SubParsersAction) -> None:
    from swarm.tools.demo import DemoConfig

    p = subparsers.add_parser(
        "demo",
        help=SUMMARY,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(p, DemoConfig, FLAGS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")  # before hivemind is imported
    from swarm.tools.demo import Demo, DemoConfig

    summary = Demo(DemoConfig(**flag_values(args, FLAGS))).run()
    return 0 if summary.get("micro_batches", {}).get("completed", 0) > 0 else 1
