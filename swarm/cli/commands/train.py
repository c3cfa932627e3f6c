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
from swarm.cli.flags import Flag, add_flags, flag_values

SUMMARY = "train a run: send micro-batches of data through the swarm's stages"

# Flags of TrainerConfig's fields; --out, --resume and --seed have CLI defaults of None because their
# value depends on each other (see config_from_args).
FLAGS = (
    Flag("run_id", "--run", metavar="RUN"),
    Flag("max_inflight", "--max-inflight", metavar="K"),
    Flag(
        "pacing",
        "--fixed-inflight",
        const=False,
        help="keep exactly --max-inflight micro-batches in flight instead of pacing them to the swarm",
    ),
    Flag("max_attempts", "--max-attempts", metavar="N"),
    Flag("eval_every", "--eval-every", metavar="N"),
    Flag("eval_batches", "--eval-batches", metavar="N"),
    Flag(
        "seed",
        "--seed",
        default=None,
        type=int,
        help="data sampling and routing seed (default 0; on --resume, the run's)",
    ),
    Flag("out_dir", "--out", metavar="DIR", help="output directory (default runs/RUN)"),
    Flag("trainer_id", "--trainer-id", metavar="NAME"),
    Flag("host_maddrs", "--host-maddrs", nargs="+", metavar="MADDR"),
    Flag("quiet", "--quiet"),
    Flag("log", "--log", nargs="+", choices=("tensorboard", "wandb")),
)
LENGTH_FLAGS = (  # exclusive with each other
    Flag("steps", "--steps", metavar="N"),
    Flag("tokens", "--tokens", metavar="N"),
)
# DataConfig's; --max-data-bytes defaults to None so that DataConfig's own default applies.
DATA_FLAGS = (
    Flag(
        "source",
        "--data",
        metavar="SOURCE",
        help="text file, directory of text files, .jsonl with a 'text' field, or hf:LOCAL_PATH "
        "(default: this machine's Python standard library sources)",
    ),
    Flag(
        "tokenizer",
        "--tokenizer",
        metavar="PATH",
        help="local tokenizer.json or checkpoint directory (default: bytes; a --from-pretrained run's own "
        "tokenizer, remembered on this machine)",
    ),
    Flag("max_bytes", "--max-data-bytes", dest="max_data_bytes", default=None, metavar="N"),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    from swarm.train.data import DataConfig
    from swarm.train.trainer import TrainerConfig

    p = subparsers.add_parser(
        "train", help=SUMMARY, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_initial_peers(p)
    add_flags(p, DataConfig, DATA_FLAGS)
    add_flags(p.add_mutually_exclusive_group(), TrainerConfig, LENGTH_FLAGS)
    add_flags(p, TrainerConfig, FLAGS)
    p.add_argument(
        "--resume",
        default=None,
        metavar="OUT",
        help="continue the trainer whose output directory is OUT (its step, tokens, data position, metrics)",
    )
    add_secret_file(p)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    """The ``TrainerConfig`` these flags describe (raises ``ConfigError`` on bad values)."""
    from swarm.dht.auth import load_secret
    from swarm.errors import ConfigError
    from swarm.train.data import DataConfig
    from swarm.train.trainer import TrainerConfig, read_resume_state

    out = args.out_dir if args.out_dir is not None else os.path.join("runs", args.run_id)
    if args.resume is not None:
        if args.out_dir is not None and os.path.abspath(args.out_dir) != os.path.abspath(args.resume):
            raise ConfigError(
                f"--out {args.out_dir} and --resume {args.resume} name different directories; a resumed "
                "trainer writes where it wrote before: drop --out"
            )
        state = read_resume_state(args.resume, run_id=args.run_id)  # reads only: a bad OUT fails here
        if args.seed is not None and args.seed != state.seed:
            raise ConfigError(
                f"--seed {args.seed} differs from the seed {state.seed} of the trainer in {args.resume}; a "
                "resume continues that trainer's data stream: drop --seed"
            )
        out = args.resume

    data = {k: v for k, v in flag_values(args, DATA_FLAGS).items() if k != "max_bytes" or v is not None}
    return TrainerConfig(
        initial_peers=tuple(args.initial_peers),
        data=DataConfig(**data),
        **flag_values(args, LENGTH_FLAGS),
        **flag_values(args, FLAGS) | {"seed": args.seed if args.seed is not None else 0, "out_dir": out},
        resume=args.resume is not None,
        secret=load_secret(getattr(args, "secret_file", None)),
    )


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")  # before hivemind is imported
    from swarm.train.trainer import Trainer

    summary = Trainer(config_from_args(args)).train()
    mb = summary.get("micro_batches", {})
    return 0 if mb.get("completed", 0) > 0 else 1
