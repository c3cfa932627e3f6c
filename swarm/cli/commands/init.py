"""``swarm init [RUN.yaml]``: start a bootstrap node for a new run and print how to join it.

    swarm init examples/tiny.yaml                 # loopback only: peers on this machine
    swarm init examples/tiny.yaml --public --host-maddrs /ip4/0.0.0.0/tcp/31337 \\
        --announce-maddrs /ip4/<PUBLIC_IP>/tcp/31337 --identity bootstrap.key
    swarm init                                     # a plain entry point, no run
    swarm init examples/tiny.yaml --private --secret-file tiny.secret   # only secret holders may join
    swarm init --from-pretrained llama-dir/ --stages 4    # continue a local Hugging Face Llama checkpoint
    swarm init finetune.yaml --from-pretrained llama-dir/ # optimizer, codecs, ... from the file

With ``--from-pretrained DIR`` the model comes from ``DIR/config.json`` (the spec file, if given, sets
everything else; its ``model`` section may give only ``seq_len``), each stage's initial weights are
digested into the spec, and the keeper serves them, so peers need no copy of the checkpoint (those
that have one pass ``swarm peer --weights DIR``). See swarm/run/pretrained.py.

A private run's join secret is printed once (with the join commands) and kept in ``--secret-file``
(mode 0600; an existing file is reused, so a restarted owner keeps the same run). Joiners pass a copy
with ``--secret-file`` or the SWARMPIPE_SECRET environment variable; see SECURITY.md.

With a run spec it also keeps recent snapshots of every stage (``swarm keeper``'s job, see
``swarm/tools/keeper.py``) in ``--keeper-dir`` (default ``snapshots/RUN_ID``), unless ``--no-keeper``.

It runs until Ctrl-C or SIGTERM, printing a status line every ``--status-interval-s`` seconds and
re-publishing the run before its DHT records expire; it shuts the DHT down on the way out.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

SUMMARY = "start a bootstrap node for a new run and print the commands that join it"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "init",
        help=SUMMARY,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "spec", nargs="?", metavar="RUN.yaml", help="run spec file (omit for a plain bootstrap node)"
    )
    _add_network_options(p)
    _add_pretrained_options(p)
    p.add_argument(
        "--private",
        action="store_true",
        help="only holders of the run's join secret may take part (needs --secret-file)",
    )
    p.add_argument(
        "--secret-file",
        default=None,
        metavar="PATH",
        help="where the join secret of a --private run is kept (created with mode 0600, or reused)",
    )
    from swarm.cli.commands.keeper import add_keeper_options
    from swarm.cli.flags import Flag, add_flags
    from swarm.tools.bootstrap import BootstrapConfig

    add_flags(p, BootstrapConfig, (Flag("status_interval_s", "--status-interval-s", metavar="S"),))

    add_keeper_options(p)
    p.add_argument(
        "--no-keeper",
        action="store_true",
        help="keep no stage snapshots (a stage that loses every replica can then only come back from a "
        "peer's --checkpoint-dir)",
    )
    p.set_defaults(func=run)


def _add_network_options(p: argparse.ArgumentParser) -> None:
    """The node's ``DHTConfig`` flags, with help for a bootstrap node (hence not ``add_listen_addresses``);
    ``run`` maps them, keeping the config's listen address when ``--host-maddrs`` is not given."""
    p.add_argument(
        "--initial-peers",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="join an existing swarm instead of starting a new one (multiaddrs with /p2p/)",
    )
    p.add_argument(
        "--host-maddrs",
        nargs="+",
        default=None,
        metavar="MADDR",
        help="where to listen (default /ip4/127.0.0.1/tcp/0: this machine only)",
    )
    p.add_argument(
        "--announce-maddrs",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="addresses others should dial, e.g. /ip4/<PUBLIC_IP>/tcp/31337 behind NAT (fixed port)",
    )
    p.add_argument(
        "--identity",
        dest="identity_path",
        default=None,
        metavar="PATH",
        help="RSA identity file for a stable address (created if missing)",
    )
    p.add_argument("--public", action="store_true", help="listen on all interfaces (/ip4/0.0.0.0/tcp/0)")


def _add_pretrained_options(p: argparse.ArgumentParser) -> None:
    """``--from-pretrained DIR`` and the options that go with it (swarm/run/pretrained.py)."""
    p.add_argument(
        "--from-pretrained",
        metavar="DIR",
        default=None,
        help="start the run from a local Hugging Face Llama checkpoint (config.json, *.safetensors, "
        "tokenizer.json)",
    )
    p.add_argument("--run-id", default=None, help="with --from-pretrained: the run id (default: DIR's name)")
    p.add_argument("--stages", type=int, default=None, help="with --from-pretrained: stages (default 2)")
    p.add_argument(
        "--seq-len", type=int, default=None, help="with --from-pretrained: training context (default <= 1024)"
    )


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault(
        "HIVEMIND_LOGLEVEL", "WARNING"
    )  # before hivemind is imported: keep the output readable
    from swarm.cli.commands.keeper import keeper_config
    from swarm.dht.network import DHTConfig
    from swarm.run.spec import RunSpec
    from swarm.tools.bootstrap import Bootstrap, BootstrapConfig

    spec = _pretrained_spec(args) if args.from_pretrained else None
    if spec is None:
        spec = RunSpec.from_yaml(args.spec) if args.spec else None
    secret, created = None, False
    if args.private:
        spec, secret, created = _make_private(spec, args.secret_file)
    dht_cfg_kwargs = {}
    if args.host_maddrs is not None:
        dht_cfg_kwargs["host_maddrs"] = tuple(args.host_maddrs)
    cfg = BootstrapConfig(
        dht=DHTConfig(
            initial_peers=tuple(args.initial_peers),
            announce_maddrs=tuple(args.announce_maddrs),
            identity_path=args.identity_path,
            public=args.public,
            **dht_cfg_kwargs,
        ),
        spec=spec,
        status_interval_s=args.status_interval_s,
        secret=secret,
        secret_file=args.secret_file,
        keeper=None
        if spec is None or args.no_keeper
        else keeper_config(args, spec.run_id, initial_weights=args.from_pretrained),
    )

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    boot = Bootstrap(cfg)
    try:
        boot.start()
        _print_started(boot, args, secret, created)
        print("Ctrl-C stops this node.", flush=True)
        boot.serve(stop, out=lambda line: print(line, flush=True))
    finally:
        boot.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("bootstrap node stopped.", flush=True)
    return 0


def _print_started(boot, args: argparse.Namespace, secret: bytes | None, created: bool) -> None:  # type: ignore[no-untyped-def]
    """What ``swarm init`` prints once its node is up: addresses, secret, checkpoint, keeper, join commands."""
    from swarm.dht.network import reachability_warning

    cfg, spec = boot.cfg, boot.cfg.spec
    maddrs = boot.maddrs
    if spec is not None:
        print(f"run {spec.run_id} (spec {spec.spec_hash}, {spec.num_stages} stages) is published.")
    else:
        print("bootstrap node started (no run).")
    print("initial peers: " + " ".join(maddrs))
    warning = reachability_warning(cfg.dht.initial_peers, list(cfg.dht.announce_maddrs) or maddrs)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    if secret is not None:
        from swarm.dht.auth import SECRET_ENV, format_secret

        state = "written to" if created else "read from"
        print(f"private run: the join secret was {state} {args.secret_file} (mode 0600).")
        print(f"  it is printed only now; give it to joiners privately: {SECRET_ENV}={format_secret(secret)}")
    if spec is not None and spec.pretrained is not None:
        weights = f"--weights {args.from_pretrained or 'DIR'}"
        where = (
            f"the keeper serves them; peers holding a copy may add {weights}"
            if boot.keeper is not None
            else f"no keeper serves them: the first peer of each stage needs {weights}"
        )
        print(
            f"it continues the checkpoint {spec.pretrained.source!r}: each stage starts from its weights ({where})"
        )
    if boot.keeper is not None:
        print(
            f"keeper: stage snapshots in {os.path.abspath(cfg.keeper.directory)} every "
            f"{cfg.keeper.interval_s:.0f} s ({cfg.keeper.keep} kept per stage); --no-keeper turns it off"
        )
    print("join with:")
    for command in boot.join_commands():
        print(f"  {command}")


def _pretrained_spec(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The run spec of ``--from-pretrained DIR`` (digesting every stage's weights, one at a time)."""
    from swarm.errors import ConfigError
    from swarm.run.pretrained import remember_tokenizer, spec_from_pretrained
    from swarm.run.spec import read_spec_yaml

    base = read_spec_yaml(args.spec) if args.spec else None
    if args.no_keeper:
        print("note: --no-keeper: every peer of this run needs --weights DIR (a copy of the checkpoint)")
    try:
        spec = spec_from_pretrained(
            args.from_pretrained,
            base=base,
            run_id=args.run_id,
            stages=args.stages,
            seq_len=args.seq_len,
            on_stage=lambda stage, digest: print(
                f"stage {stage}: initial weights {digest[:16]}...", flush=True
            ),
        )
        if remember_tokenizer(args.from_pretrained) is not None:  # trainers on this machine find it
            print("tokenizer: the checkpoint's tokenizer.json (trainers elsewhere pass --tokenizer DIR)")
    except OSError as e:
        raise ConfigError(f"cannot read the checkpoint in {args.from_pretrained!r}: {e}") from None
    return spec


def _make_private(spec, secret_file):  # type: ignore[no-untyped-def]
    """The spec with ``access.private`` set, its secret and whether the secret file was created now."""
    import dataclasses

    from swarm.dht.auth import generate_secret, read_secret_file, secret_check, write_secret_file
    from swarm.errors import ConfigError
    from swarm.run.spec import AccessConfig

    if spec is None:
        raise ConfigError("--private needs a run spec: swarm init RUN.yaml --private --secret-file PATH")
    if not secret_file:
        raise ConfigError(
            "--private needs --secret-file PATH: the join secret is stored there (mode 0600) for the owner "
            "and copied to joiners; it is never passed on a command line"
        )
    created = not os.path.exists(secret_file)
    if created:
        secret = generate_secret()
        write_secret_file(secret_file, secret)
    else:
        secret = read_secret_file(secret_file)
    old = spec.access
    access = AccessConfig(
        private=True,
        secret_check=secret_check(secret, spec.run_id),
        allow=old.allow if old else (),
        deny=old.deny if old else (),
    )
    return dataclasses.replace(spec, access=access), secret, created
