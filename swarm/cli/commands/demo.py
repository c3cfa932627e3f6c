"""``swarm demo``: start a bootstrap, stage peers and a trainer on this machine and train a small model.

    swarm demo
    swarm demo --stages 2 --peers-per-stage 2 --steps 60 --codec int8 --out runs/demo --chaos

Everything listens on 127.0.0.1 only and is shut down at the end (also on Ctrl-C). See swarm/tools/demo.py.
"""

from __future__ import annotations

import argparse
import os


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="train a small model with a local swarm (bootstrap, peers, trainer), then clean up",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--stages", type=int, default=None, metavar="S", help="pipeline stages (default: the spec's, 2)"
    )
    p.add_argument("--peers-per-stage", type=int, default=2, metavar="P", help="peers per stage (default 2)")
    p.add_argument("--steps", type=int, default=None, metavar="N", help="trainer steps (default 75)")
    p.add_argument(
        "--codec", default=None, metavar="NAME", help="codec for activations and gradients (swarm codecs)"
    )
    p.add_argument("--out", default="runs/demo", metavar="DIR", help="output directory (default runs/demo)")
    p.add_argument("--chaos", action="store_true", help="SIGKILL one peer mid-run and start a fresh one")
    p.add_argument("--spec", default=None, metavar="RUN.yaml", help="run spec (default examples/demo.yaml)")
    p.add_argument("--max-inflight", type=int, default=None, metavar="K", help="micro-batches in flight")
    p.add_argument("--eval-every", type=int, default=None, metavar="N", help="held-out loss every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help="skip training the same model in one process afterwards (the held-out comparison)",
    )
    p.add_argument("--quiet", action="store_true", help="print only errors")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")  # before hivemind is imported
    from swarm.tools.demo import Demo, DemoConfig

    kwargs = {"steps": args.steps} if args.steps is not None else {}
    cfg = DemoConfig(
        stages=args.stages,
        peers_per_stage=args.peers_per_stage,
        codec=args.codec,
        out_dir=args.out,
        chaos=args.chaos,
        spec_path=args.spec,
        max_inflight=args.max_inflight,
        eval_every=args.eval_every,
        seed=args.seed,
        reference=args.reference,
        quiet=args.quiet,
        **kwargs,
    )
    summary = Demo(cfg).run()
    return 0 if summary.get("micro_batches", {}).get("completed", 0) > 0 else 1
