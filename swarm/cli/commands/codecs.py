"""``swarm codecs``: list the tensor codecs, their nominal ratio vs fp32 and their spec params.

Examples::

    swarm codecs                      # table of codecs
    swarm codecs --params             # and every key=value each one accepts
    swarm codecs --check "lowrank:ratio=16,factors=blockwise8,ef=1"   # validate a spec
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "codecs",
        help="list tensor codecs and their compression ratios",
        description="List the codecs usable in a run spec (codecs.activations / codecs.gradients).",
    )
    parser.add_argument("--params", action="store_true", help="also list the key=value params of each codec")
    parser.add_argument("--check", metavar="SPEC", help="validate a codec spec and print its canonical form")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from compression import CodecError, available_codecs, codec_params, get_codec
    from swarm.errors import ConfigError

    if args.check:
        try:
            codec = get_codec(args.check)
        except CodecError as e:
            raise ConfigError(f"{e}") from e
        kind = "lossy" if codec.lossy else "exact"
        print(f"{codec.spec}  ({kind}, nominal ratio {codec.nominal_ratio:.2f}x vs fp32)")
        return 0
    rows = available_codecs()
    width = max(len(name) for name, _, _ in rows)
    print(f"{'codec':<{width}}  {'ratio':>6}  summary")
    for name, ratio, summary in rows:
        print(f"{name:<{width}}  {ratio:>5.2f}x  {summary}")
        if args.params:
            for key, p in codec_params(name).items():
                values = "|".join(p.choices) if p.kind == "choice" else ("0|1" if p.kind == "bool" else "int")
                print(f"{'':<{width}}    {key}={values} (default {p.default}): {p.help}")
    print('\nspec grammar: NAME or NAME:key=value,...  e.g. "blockwise8:block=256", "int8:ef=1,sr=1"')
    return 0
