"""``swarm export``: download the current weights of every stage and write one model to a directory.

    swarm export --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/PEERID --run tiny --out exports/tiny
    swarm export --initial-peers ... --run tiny --out exports/tiny-hf --format hf
    swarm export --initial-peers ... --run mine --out exports/mine --secret-file mine.secret   # private run
    python -c "from swarm import load_model; print(load_model('exports/tiny'))"

``--format hf`` (needs ``pip install transformers``) writes a checkpoint that
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads. The export joins the DHT as a client,
downloads each stage from one of its online peers (as a joining peer would), checks that the stages
run the same spec and are within ``--max-step-lag`` optimizer steps of each other, and writes
``model.safetensors``, ``run_spec.json`` and ``export.json``.
"""

from __future__ import annotations

import argparse
import os

from swarm.cli.commands import add_initial_peers, add_secret_file


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="download every stage's weights from the swarm and write one model (safetensors or HF)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_initial_peers(p)
    p.add_argument("--run", required=True, metavar="RUN", help="run id to export")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write (created if missing)")
    p.add_argument(
        "--format",
        choices=("safetensors", "hf"),
        default="safetensors",
        help="safetensors: the project's names (load with swarm.load_model); hf: transformers' Llama "
        "layout + config.json (default safetensors)",
    )
    p.add_argument(
        "--spec-hash", default=None, metavar="HASH", help="expected spec hash (see `swarm status`)"
    )
    p.add_argument(
        "--max-step-lag",
        type=int,
        default=16,
        metavar="N",
        help="most optimizer steps a stage may be behind the most advanced one (default 16)",
    )
    p.add_argument(
        "--state-timeout-s",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds one stage's download may take (default 60)",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds to wait for the run's spec (default 30)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing export in --out")
    add_secret_file(p)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    """The ``ExportConfig`` these flags describe (raises ``ConfigError`` on bad values)."""
    from swarm.dht.auth import load_secret
    from swarm.dht.network import DHTConfig
    from swarm.tools.export import ExportConfig

    return ExportConfig(
        dht=DHTConfig(initial_peers=tuple(args.initial_peers), client_mode=True),
        run_id=args.run,
        out_dir=args.out,
        format=args.format,
        spec_hash=args.spec_hash,
        max_step_lag=args.max_step_lag,
        spec_timeout_s=args.timeout_s,
        state_timeout_s=args.state_timeout_s,
        secret=load_secret(getattr(args, "secret_file", None)),
        overwrite=args.force,
    )


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")  # before hivemind is imported
    from swarm.tools.export import export_run

    cfg = config_from_args(args)
    result = export_run(cfg, say=lambda line: print(line, flush=True))
    for note in result.notes:
        print(f"note: {note}")
    n_params = sum(t.numel() for s in result.stages for t in s.params.values())
    print(
        f"wrote {result.out_dir} ({cfg.format}, {n_params:,} parameters, "
        f"{len(result.stages)} stages) in {result.seconds:.1f} s"
    )
    if cfg.format == "hf":
        print(f"load it with: transformers.AutoModelForCausalLM.from_pretrained({str(result.out_dir)!r})")
    else:
        print(f"load it with: swarm.load_model({str(result.out_dir)!r})")
    return 0
