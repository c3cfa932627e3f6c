"""``swarm generate``: sample text from a run's current model, through the swarm.

swarm generate --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID --run demo --prompt "def "
swarm generate --initial-peers ... --run demo --prompt "import " --max-new-tokens 200 --temperature 0.5
swarm generate --initial-peers ... --run mine --prompt "def " --secret-file mine.secret   # a private run
"""

from __future__ import annotations

import argparse
import os
import sys

from swarm.cli.commands import add_initial_peers, add_secret_file


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="sample text from the swarm's current model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_initial_peers(p)
    p.add_argument("--run", required=True, metavar="RUN", help="run id")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="text to continue")
    p.add_argument(
        "--max-new-tokens", type=int, default=64, metavar="N", help="tokens to sample (default 64)"
    )
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K most likely")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="local tokenizer.json or checkpoint directory (default: bytes; a --from-pretrained run's own "
        "tokenizer, remembered on this machine)",
    )
    add_secret_file(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")  # before hivemind is imported
    from swarm.dht.auth import load_secret
    from swarm.tools.generation import GenerateConfig, generate

    cfg = GenerateConfig(
        initial_peers=tuple(args.initial_peers),
        run_id=args.run,
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        tokenizer=args.tokenizer,
        secret=load_secret(args.secret_file),
    )
    sys.stdout.write(args.prompt)
    sys.stdout.flush()

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    generate(cfg, on_text=show)
    sys.stdout.write("\n")
    return 0
