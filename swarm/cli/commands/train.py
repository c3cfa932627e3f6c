"""``swarm train``: feed a run with data (a trainer holds data, no weights).

    swarm train --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID --run tiny --steps 200
    swarm train --initial-peers ... --run tiny --data corpus.jsonl --tokens 2000000 --out runs/mine

Metrics go to ``OUT/metrics.jsonl`` (default ``runs/RUN``), with ``loss.png`` and ``summary.json``
at the end. Several trainers may feed one run at once (give each its own ``--seed``).

A trainer that was killed (or stopped) continues where it left off with ``--resume OUT``: the same
step and token counts, the same data stream from where it stopped, the same trainer id; the metrics
file is appended to. ``--steps``/``--tokens`` are totals (default: the target it had).

    swarm train --initial-peers ... --run tiny --resume runs/tiny
"""

from __future__ import annotations

import argparse
import os

from swarm.cli.commands import add_initial_peers, add_secret_file


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a run: send micro-batches of data through the swarm's stages",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_initial_peers(p)
    p.add_argument("--run", required=True, metavar="RUN", help="run id to train")
    p.add_argument(
        "--data",
        default=None,
        metavar="SOURCE",
        help="text file, directory of text files, .jsonl with a 'text' field, or hf:LOCAL_PATH "
        "(default: this machine's Python standard library sources)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="local tokenizer.json or checkpoint directory (default: bytes; a --from-pretrained run's own "
        "tokenizer, remembered on this machine)",
    )
    p.add_argument(
        "--max-data-bytes", type=int, default=None, metavar="N", help="read at most N bytes of text"
    )
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=None, metavar="N", help="trainer steps (default 100)")
    length.add_argument("--tokens", type=int, default=None, metavar="N", help="tokens to train on")
    p.add_argument(
        "--max-inflight",
        type=int,
        default=8,
        metavar="K",
        help="the most micro-batches in the swarm at once (default 8); the trainer keeps as many as keep "
        "the swarm busy, from the number of stages up to K (async mode)",
    )
    p.add_argument(
        "--fixed-inflight",
        action="store_true",
        help="keep exactly --max-inflight micro-batches in flight instead of pacing them to the swarm",
    )
    p.add_argument(
        "--max-attempts", type=int, default=4, metavar="N", help="routes tried per micro-batch (default 4)"
    )
    p.add_argument(
        "--eval-every", type=int, default=0, metavar="N", help="held-out loss every N steps (0 = never)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="data sampling and routing seed (default 0; on --resume, the run's)",
    )
    p.add_argument("--out", default=None, metavar="DIR", help="output directory (default runs/RUN)")
    p.add_argument(
        "--resume",
        default=None,
        metavar="OUT",
        help="continue the trainer whose output directory is OUT (its step, tokens, data position, metrics)",
    )
    p.add_argument("--trainer-id", default=None, metavar="NAME", help="name shown by `swarm status`")
    p.add_argument(
        "--host-maddrs",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="where to listen for peers' reports (default: loopback only)",
    )
    add_secret_file(p)
    p.add_argument("--quiet", action="store_true", help="no progress line and no printed summary")
    p.add_argument(
        "--log",
        nargs="+",
        default=[],
        choices=["tensorboard", "wandb"],
        help="also log metrics to TensorBoard (OUT/tensorboard) and/or Weights & Biases (offline without an API key)",
    )
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    """The ``TrainerConfig`` these flags describe (raises ``ConfigError`` on bad values)."""
    from swarm.dht.auth import load_secret
    from swarm.errors import ConfigError
    from swarm.train.data import DataConfig
    from swarm.train.trainer import TrainerConfig, read_resume_state

    out = args.out if args.out is not None else os.path.join("runs", args.run)
    if args.resume is not None:
        if args.out is not None and os.path.abspath(args.out) != os.path.abspath(args.resume):
            raise ConfigError(
                f"--out {args.out} and --resume {args.resume} name different directories; a resumed trainer "
                "writes where it wrote before: drop --out"
            )
        state = read_resume_state(args.resume, run_id=args.run)  # reads only: a bad OUT fails here
        if args.seed is not None and args.seed != state.seed:
            raise ConfigError(
                f"--seed {args.seed} differs from the seed {state.seed} of the trainer in {args.resume}; a "
                "resume continues that trainer's data stream: drop --seed"
            )
        out = args.resume

    data_kwargs = {"source": args.data, "tokenizer": args.tokenizer}
    if args.max_data_bytes is not None:
        data_kwargs["max_bytes"] = args.max_data_bytes
    return TrainerConfig(
        initial_peers=tuple(args.initial_peers),
        run_id=args.run,
        data=DataConfig(**data_kwargs),
        steps=args.steps,
        tokens=args.tokens,
        max_inflight=args.max_inflight,
        pacing=not args.fixed_inflight,
        max_attempts=args.max_attempts,
        eval_every=args.eval_every,
        seed=args.seed if args.seed is not None else 0,
        out_dir=out,
        resume=args.resume is not None,
        trainer_id=args.trainer_id,
        host_maddrs=tuple(args.host_maddrs),
        quiet=args.quiet,
        log=tuple(args.log),
        secret=load_secret(getattr(args, "secret_file", None)),
    )


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")  # before hivemind is imported
    from swarm.train.trainer import Trainer

    summary = Trainer(config_from_args(args)).train()
    mb = summary.get("micro_batches", {})
    return 0 if mb.get("completed", 0) > 0 else 1
