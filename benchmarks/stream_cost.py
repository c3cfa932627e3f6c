"""What one data-plane message costs on the wire: bytes and packets per call, beyond what we serialise.

Run (from the repository root, as root for the network lab)::

    python -m benchmarks.stream_cost            # into results/stream_cost.json
    python -m benchmarks.stream_cost --calls 500 --concurrency 4
    python -m benchmarks.stream_cost --channels off   # every call a stream of its own
    python -m benchmarks.stream_cost --channels small # activations on streams of their own (no bulk lane)

What runs: two nodes of the network lab (benchmarks/netlab.py), a server process in one serving a
protocol name with ``swarm.wire.protocol.serve`` (the reply is ``{"ok": True}``, like an acknowledgement)
and a client process in the other calling it ``--calls`` times with ``swarm.wire.protocol.call`` for each
message shape: every call is what a FORWARD, BACKWARD, REPORT or INFO is. With ``--channels on`` (the
default) small messages share one long-lived stream and one-part activations another (the small and the
bulk lane of swarm/wire/channel.py), which the warm-up calls opened; ``--channels small`` keeps the small
lane only; with ``--channels off`` each call is a new libp2p stream through both p2pd daemons (yamux
stream, multistream-select of the protocol name, noise frames, the request's parts, the reply, both
closes), over the connection the warm-up calls opened. Both nodes' link counters
(bytes and packets, all IP/TCP headers and ACKs included) are read around the calls and around an idle
window of the same length (what the daemons send anyway, subtracted).

Per call it reports the wire bytes and packets of both directions together, what we serialised (the
request's protobuf parts and the reply), and the difference: the fixed cost one more message per
micro-batch adds, and one fewer saves. It also reports the CPU per call of both Python processes together
and of both p2pd daemons together (``/proc`` of the two processes and their children, the idle window's
CPU subtracted): on a machine whose cores the stages share, that CPU is taken from the compute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.links import RESULTS_DIR, descendants
from benchmarks.netlab import NetLab, lab_unavailable_reason
from benchmarks.report import machine_info

__all__ = ["SHAPES", "per_call", "main"]

RESULTS = RESULTS_DIR / "stream_cost.json"
NAME = "swarmpipe.bench.stream_cost"
SHAPES: dict[str, tuple[int, int]] = {
    "INFO probe (empty header)": (0, 0),
    "REPORT-sized (300-byte header)": (300, 0),
    "subspace hop (300-byte header, 8 KiB payload)": (300, 8192),
    "activation hop (300-byte header, 256 KiB payload)": (300, 256 << 10),
}
"""Message shapes measured: name -> (header padding bytes, payload bytes)."""


def per_call(calls: dict[str, int], idle: dict[str, int], n: int) -> dict[str, float]:
    """Counter deltas (``bytes``, ``packets``) of the calls minus those of an equally long idle window,
    per call (pure)."""
    return {k: (calls[k] - idle.get(k, 0)) / n for k in calls}


# ------------------------------------------------------------------------------- lab processes


async def _serve(addr: str, maddr_file: str) -> None:
    from hivemind.p2p import P2P

    from swarm.wire.protocol import serve

    p2p = await P2P.create(host_maddrs=[f"/ip4/{addr}/tcp/0"])

    async def handler(message: Any, remote: Any) -> dict[str, Any]:
        return {}

    await serve(p2p, NAME, handler, max_payload_bytes=1 << 20)
    maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
    Path(maddr_file).write_text(json.dumps(maddrs))
    await asyncio.to_thread(sys.stdin.read)  # until the parent closes our stdin
    await p2p.shutdown()


async def _client(addr: str, maddr_file: str, calls: int, concurrency: int) -> None:
    from hivemind.p2p import P2P, PeerID

    from swarm.wire.protocol import Message, call, to_parts

    maddrs = json.loads(Path(maddr_file).read_text())
    p2p = await P2P.create(initial_peers=maddrs, host_maddrs=[f"/ip4/{addr}/tcp/0"])
    server = PeerID.from_base58(maddrs[0].rsplit("/p2p/", 1)[1])

    def message(pad: int, payload: int) -> Message:
        return Message({"pad": b"x" * pad} if pad else {}, b"y" * payload)

    async def burst(msg: Message, n: int) -> None:
        async def one() -> None:
            for _ in range(n // concurrency):
                await call(p2p, server, NAME, msg, timeout_s=30)

        await asyncio.gather(*(one() for _ in range(concurrency)))

    await burst(message(0, 0), 2 * concurrency)  # the connection and the protocol are warm
    for name, (pad, payload) in SHAPES.items():
        msg = message(pad, payload)
        serialised = sum(p.ByteSize() for p in to_parts(msg)) + 8  # + the reply's metadata {"ok": True}
        print(json.dumps({"ready": name, "serialised": serialised}), flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        t = time.perf_counter()
        await burst(msg, calls)
        print(json.dumps({"done": name, "s": time.perf_counter() - t}), flush=True)
        await asyncio.to_thread(sys.stdin.readline)
    await p2p.shutdown()


# ------------------------------------------------------------------------------------ the run


def _counters(lab: NetLab, nodes: list[str]) -> dict[str, int]:
    """Both nodes' tx bytes and packets together (every frame on the lab's links)."""
    total = {"bytes": 0, "packets": 0}
    for node in nodes:
        out = subprocess.run(
            ["ip", "-n", lab.ns(node), "-j", "-s", "link", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        tx = json.loads(out)[0]["stats64"]["tx"]
        total["bytes"] += int(tx["bytes"])
        total["packets"] += int(tx["packets"])
    return total


def _delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: b[k] - a[k] for k in a}


_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu(pids: list[int]) -> dict[str, int]:
    """CPU clock ticks of these processes and their children: ``python`` (all but the daemons) and
    ``p2pd``. Integers, so that differences are exact (float seconds left -1e-14 where there was 0)."""
    total = {"python": 0, "p2pd": 0}
    for pid in pids:
        for p in [pid, *descendants(pid)]:
            try:
                with open(f"/proc/{p}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat.rsplit(")", 1)[1].split()
            total["p2pd" if comm == "p2pd" else "python"] += int(rest[11]) + int(rest[12])
    return total


def run(*, calls: int, concurrency: int, channels: str = "on", settle_s: float = 1.0) -> list[dict[str, Any]]:
    """Every shape in :data:`SHAPES`, ``calls`` calls each, in a fresh two-node lab; ``channels`` is
    ``on`` (both lanes), ``small`` (the small lane only) or ``off``."""
    switch = {"on": "1", "small": "small", "off": "0"}[channels]
    nodes = ["srv", "cli"]
    py = [sys.executable, "-m", "benchmarks.stream_cost"]
    out = []
    with tempfile.TemporaryDirectory(prefix="swarmpipe-streams-") as tmp, NetLab(nodes) as lab:
        maddr_file = str(Path(tmp) / "maddrs.json")

        def spawn(node: str, argv: list[str]) -> subprocess.Popen:  # Lab.spawn has no stdin pipe
            return subprocess.Popen(
                ["ip", "netns", "exec", lab.ns(node), "env", f"SWARMPIPE_CHANNELS={switch}", *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )

        srv = spawn("srv", [*py, "--serve", lab.address("srv"), maddr_file])
        try:
            for _ in range(300):
                if Path(maddr_file).exists():
                    break
                time.sleep(0.1)
            cli = spawn(
                "cli", [*py, "--client", lab.address("cli"), maddr_file, str(calls), str(concurrency)]
            )
            assert cli.stdin is not None and cli.stdout is not None
            try:
                for _ in SHAPES:
                    ready = json.loads(cli.stdout.readline())
                    time.sleep(settle_s)
                    c0, u0 = _counters(lab, nodes), _cpu([srv.pid, cli.pid])
                    cli.stdin.write("\n")
                    cli.stdin.flush()
                    done = json.loads(cli.stdout.readline())
                    time.sleep(settle_s)  # the last closes and delayed ACKs
                    c1, u1 = _counters(lab, nodes), _cpu([srv.pid, cli.pid])
                    time.sleep(done["s"] + settle_s)  # an idle window as long as the calls' window
                    c2, u2 = _counters(lab, nodes), _cpu([srv.pid, cli.pid])
                    cli.stdin.write("\n")
                    cli.stdin.flush()
                    cost = per_call(_delta(c0, c1), _delta(c1, c2), calls)
                    cpu = {k: v / _TICKS for k, v in per_call(_delta(u0, u1), _delta(u1, u2), calls).items()}
                    out.append(
                        {
                            "shape": ready["ready"],
                            "calls": calls,
                            "concurrency": concurrency,
                            "channels": channels,
                            "calls_per_s": calls / done["s"],
                            "serialised_bytes_per_call": ready["serialised"],
                            "wire_bytes_per_call": cost["bytes"],
                            "packets_per_call": cost["packets"],
                            "fixed_bytes_per_call": cost["bytes"] - ready["serialised"],
                            "python_cpu_ms_per_call": 1000 * cpu["python"],
                            "p2pd_cpu_ms_per_call": 1000 * cpu["p2pd"],
                        }
                    )
                    print(
                        f"{ready['ready']}: {cost['bytes']:.0f} wire bytes and {cost['packets']:.1f} packets "
                        f"per call, {ready['serialised']} serialised; CPU per call: Python "
                        f"{1000 * cpu['python']:.2f} ms, p2pd {1000 * cpu['p2pd']:.2f} ms"
                    )
            finally:
                cli.stdin.close()
                _let_exit(cli)
                lab.stop(cli, grace_s=10.0)
        finally:
            assert srv.stdin is not None
            srv.stdin.close()
            _let_exit(srv)
            lab.stop(srv, grace_s=10.0)
    return out


def _let_exit(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """Give a node whose stdin closed the time to shut its P2P down: a SIGTERM before that leaves its
    socket file in /tmp (hivemind removes it in ``P2P.shutdown`` only)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout_s)


def _mode(channels: bool | str) -> str:
    """A run's channel mode (runs before the bulk lane stored a bool: ``True`` was the small lane)."""
    return channels if isinstance(channels, str) else ("small" if channels else "off")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.stream_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--calls", type=int, default=300, help="calls per message shape")
    parser.add_argument("--concurrency", type=int, default=1, help="calls in flight at once")
    parser.add_argument(
        "--channels",
        choices=("on", "small", "off"),
        default="on",
        help="on: small messages and one-part activations each on a long-lived stream; small: the small "
        "lane only; off: every message a stream of its own",
    )
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--serve", nargs=2, metavar=("ADDR", "MADDR_FILE"), help=argparse.SUPPRESS)
    parser.add_argument("--client", nargs=4, metavar=("ADDR", "MADDR_FILE", "N", "C"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(*args.serve))
        return 0
    if args.client:
        addr, maddr_file, n, c = args.client
        asyncio.run(_client(addr, maddr_file, int(n), int(c)))
        return 0
    if args.calls < 1 or args.concurrency < 1 or args.calls % args.concurrency:
        parser.error(f"--calls {args.calls} must be a positive multiple of --concurrency {args.concurrency}")
    reason = lab_unavailable_reason(probe=True)
    if reason:
        print(f"cannot run the network lab: {reason}", file=sys.stderr)
        return 2
    channels = args.channels
    results = run(calls=args.calls, concurrency=args.concurrency, channels=channels)
    path = Path(args.out)
    report = json.loads(path.read_text()) if path.exists() else {"name": "stream_cost", "runs": []}
    report["runs"] = [
        r
        for r in report["runs"]
        if (r["concurrency"], _mode(r.get("channels", False))) != (args.concurrency, channels)
    ] + results
    report.update(
        {
            "command": "python -m benchmarks.stream_cost " + " ".join(argv or sys.argv[1:]),
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine_info(),
        }
    )
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
