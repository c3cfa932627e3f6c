"""The control plane's bytes per token, by source, on the wire of the network lab.

Run (from the repository root, as root for the network lab)::

    python -m benchmarks.control_plane --variant after            # 24 and 128 micro-batches, both models
    python -m benchmarks.control_plane --variant before --rates none 20mbit --micro-batches 24 --out old.json
    python -m benchmarks.control_plane --merge old.json --variant before --table "..."  # fold them in
    python -m benchmarks.control_plane --render                   # the "Control plane" section of BENCHMARKS.md

What runs: the links benchmark's swarm (``benchmarks/links.py``, ``run_swarm``: a bootstrap node, one
stage peer per stage and the trainer, each in its own namespace) on the benchmark's model
(``examples/bench.yaml``), async, once with blockwise8 activations and once with the subspace d/32 model
(coefficients in blockwise8). Each run keeps its peers up ``idle_s`` seconds after the trainer ended.

What it measures, per trained token:

- ``payload``: activation and gradient bytes, as the trainer's metrics count them (the links benchmark's
  "payload bytes/token");
- ``wire``: every node's tx counter over the run (frames with IP/TCP headers, every byte of libp2p, DHT,
  averager); ``overhead`` = wire - payload, and the target ratio ``overhead / payload``;
- in-process, what the processes serialised (``swarm/traffic.py``; the peers log it when they stop, the
  trainer writes it to summary.json): FORWARD / BACKWARD headers and payloads, REPORTs, INFO / CANCEL
  probes, the replies served, the DHT values stored by record kind and the DHT reads;
- ``background``: the nodes' tx rate while nothing trains (after the trainer ended) x the seconds
  measured, per token: what DHT refreshes and the averagers' announcements cost at this run's length.
  ``framing`` = wire - payload - the serialised data-plane messages - background: libp2p/yamux/noise
  framing, TCP/IP headers and ACKs, the DHT's own RPC framing of the trainer's reads.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.control_plane_report import SECTION, TARGETS, markdown_section
from benchmarks.links import (
    RESULTS_DIR,
    Job,
    LinksConfig,
    base_spec_dict,
    run_swarm,
    socket_prefix,
    start_bootstrap,
)
from benchmarks.markdown import write_section
from benchmarks.netlab import format_rate, lab_unavailable_reason, open_lab
from benchmarks.report import machine_info
from swarm.dht.processes import remove_stale_sockets
from swarm.errors import SwarmError
from swarm.traffic import from_stats, per_token

__all__ = ["breakdown", "peer_traffic", "markdown_section", "main", "TARGETS"]

RESULTS = RESULTS_DIR / "control_plane.json"
STREAMS = RESULTS_DIR / "stream_cost.json"
_COUNTERS = re.compile(r"stopping: .*counters (\{.*\})\s*$", re.M)
DATA_KINDS = ("forward", "backward", "report", "info", "cancel")


def peer_traffic(log_text: str) -> dict[str, dict[str, int]]:
    """A stage peer's traffic counters from its log (the last "stopping: ... counters {...}" line)."""
    found = _COUNTERS.findall(log_text)
    if not found:
        raise SwarmError("the peer log has no 'stopping: ... counters' line: did the peer stop cleanly?")
    return from_stats(json.loads(found[-1]))


def _sum(d: dict[str, dict[str, float]], kinds: list[str], field: str) -> float:
    return sum(d.get(k, {}).get(field, 0.0) for k in kinds)


def breakdown(
    result: dict[str, Any], traffic: list[dict[str, dict[str, int]]], *, tokens: int
) -> dict[str, Any]:
    """Bytes per token by source (pure): ``result`` of ``run_swarm`` (with idle rates), ``traffic`` the
    snapshots of every process (peers and trainer)."""
    pt = per_token(traffic, tokens)
    payload = float(result["payload_bytes_per_token"])
    wire = float(result["wire_bytes_per_token"])
    idle = result.get("idle_tx_bytes_per_s_by_node") or {}
    background = sum(idle.values()) * float(result["measured_s"]) / tokens if idle else None
    rows: dict[str, float] = {
        "payload (activations, gradients)": _sum(pt, ["forward", "backward"], "payload"),
        "FORWARD headers": _sum(pt, ["forward"], "header"),
        "BACKWARD headers": _sum(pt, ["backward"], "header"),
        "REPORTs to the trainer": _sum(pt, ["report"], "header") + _sum(pt, ["report"], "payload"),
        "acks (replies to FORWARD, BACKWARD, REPORT)": _sum(
            pt, ["reply.forward", "reply.backward", "reply.report"], "header"
        ),
        "probes (INFO, CANCEL and their replies)": sum(
            _sum(pt, [k, f"reply.{k}"], f) for k in ("info", "cancel") for f in ("header", "payload")
        ),
    }
    serialised = sum(rows.values()) - rows["payload (activations, gradients)"]
    stores = {k: v for k, v in pt.items() if k.startswith("dht_store.")}
    gets = {k: v for k, v in pt.items() if k.startswith("dht_get.")}
    out = {
        "tokens": tokens,
        "payload": payload,
        "wire": wire,
        "overhead": wire - payload,
        "ratio": (wire - payload) / payload if payload else None,
        "serialised": rows,
        "serialised_control": serialised,
        "dht_stored_values": {k.split(".", 1)[1]: v["header"] + v["payload"] for k, v in stores.items()},
        "dht_stores_per_1k_tokens": 1000 * sum(v["count"] for v in stores.values()),
        "dht_gets_per_1k_tokens": 1000 * sum(v["count"] for v in gets.values()),
        "messages_per_1k_tokens": {
            k: 1000 * v["count"] for k, v in pt.items() if not k.startswith(("dht_", "reply."))
        },
        "background_wire": background,
        "framing_and_rest": None
        if background is None
        else wire - rows["payload (activations, gradients)"] - serialised - background,
        "wire_by_node": result.get("wire_bytes_per_token_by_node"),
        "idle_bytes_per_s_by_node": idle,
        "measured_s": result["measured_s"],
        "keeper_snapshots": result.get("keeper_snapshot_bytes", 0) / tokens,
    }
    return out


def tcp_bytes(lab: Any, nodes: list[str]) -> dict[str, dict[str, dict[str, int]]]:
    """Bytes each node's open TCP connections sent so far (``ss``'s ``bytes_sent``: TCP payload, without
    IP/TCP headers), per destination node of the lab and per connection (``"local peer"`` addresses):
    ``{src: {dst: {connection: bytes}}}``. Kept per connection so that :func:`pair_bytes` can take each
    connection's own difference: libp2p closes duplicate connections, and a pair's sum would then fall."""
    import subprocess

    where = {lab.address(n): n for n in nodes}
    out: dict[str, dict[str, int]] = {}
    for n in nodes:
        for attempt in range(3):  # `ip netns exec` can fail on a loaded machine; an empty reading is no data
            done = subprocess.run(
                ["ip", "netns", "exec", lab.ns(n), "ss", "-tinH"], capture_output=True, text=True, check=False
            )
            if done.returncode == 0:
                break
            time.sleep(0.2 * (attempt + 1))
        else:
            print(
                f"control_plane: ss in {n}'s namespace failed 3 times: {done.stderr.strip()}", file=sys.stderr
            )
        for dst, conn, sent in parse_ss(done.stdout, where):
            if dst != n:
                out.setdefault(n, {}).setdefault(dst, {})[conn] = sent
    return out


def parse_ss(text: str, where: dict[str, str]) -> list[tuple[str, str, int]]:
    """``(destination node, connection, bytes_sent)`` for each connection in ``ss -tinH`` output whose peer
    address is one of ``where``'s (address -> node) (pure)."""
    out = []
    dst = conn = None
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 5 and ":" in fields[4] and not line[:1].isspace():
            dst, conn = where.get(fields[4].rsplit(":", 1)[0]), f"{fields[3]} {fields[4]}"
            continue
        m = re.search(r"bytes_sent:(\d+)", line)
        if m and dst is not None:
            out.append((dst, conn, int(m.group(1))))
            dst = None
    return out


def pair_bytes(start: dict, end: dict, tokens: int) -> dict[str, float]:
    """Per token, what each node sent each other node between two :func:`tcp_bytes` readings (pure): each
    connection open at the end counts what it sent since the start (all of it if it opened later). A
    connection closed in between is not counted (its last bytes are unknown), so this is a lower bound."""
    out = {}
    for src, d in end.items():
        for dst, conns in d.items():
            before = start.get(src, {}).get(dst, {})
            delta = sum(max(0, b - before.get(c, 0)) for c, b in conns.items())
            if delta > 0:
                out[f"{src}->{dst}"] = delta / tokens
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _label(subspace: int | None) -> str:
    return f"subspace d/{subspace} + blockwise8" if subspace else "blockwise8"


def run(
    *,
    rates: list[str],
    micro_batches: list[int],
    idle_s: float,
    keeper: bool = False,
    cfg: LinksConfig | None = None,
    subspaces: tuple[int | None, ...] = (None, 32),
    say: Any = print,
) -> list[dict[str, Any]]:
    """Each model (``subspaces``: None = blockwise8 activations, r = the subspace d/r model) at every rate,
    for each run length in ``micro_batches``, in one lab; one entry per run with its breakdown. ``cfg``:
    the links benchmark's settings (spec, accumulate, timeouts); by default the benchmark's."""
    from swarm.run.spec import RunSpec

    cfg = cfg or LinksConfig(throughput_mb=max(micro_batches), warmup_mb=min(8, min(micro_batches) // 2))
    stages = RunSpec.from_dict(base_spec_dict(cfg) | {"run_id": "control-plane"}).num_stages
    stage_nodes = [f"s{i}" for i in range(stages)]
    nodes: dict[str, Any] = {"boot": "boot", "trainer": "trainer", "stages": stage_nodes}
    out = []
    with tempfile.TemporaryDirectory(prefix="swarmpipe-control-") as tmp:
        work = Path(tmp)
        with open_lab(["boot", "trainer", *stage_nodes], loopback=False) as lab:
            _, nodes["boot_maddr"] = start_bootstrap(lab, "boot", work, cfg.start_timeout_s)
            current = None
            for rate, n_mb, subspace in (
                (r, n, ss) for r in rates for n in micro_batches for ss in subspaces
            ):
                if rate != current:
                    lab.set_rate(rate)
                    current = rate
                one = _one_run(
                    lab, cfg, nodes, work, rate, n_mb, subspace, idle_s=idle_s, keeper=keeper, say=say
                )
                out.append(one)
    remove_stale_sockets(socket_prefix())
    return out


def _one_run(
    lab: Any,
    cfg: LinksConfig,
    nodes: dict[str, Any],
    work: Path,
    rate: str,
    n_mb: int,
    subspace: int | None,
    *,
    idle_s: float,
    keeper: bool,
    say: Any,
) -> dict[str, Any]:
    """One swarm run of :func:`run` and its breakdown."""
    all_nodes = [nodes["boot"], nodes["trainer"], *nodes["stages"]]
    job = Job("swarm", format_rate(rate), "blockwise8", "async", micro_batches=n_mb, subspace=subspace)
    jw = work / f"{_label(subspace).replace(' ', '_').replace('/', '')}-{rate}-{n_mb}"
    jw.mkdir()
    say(f"{job.name}: {n_mb} micro-batches, idle {idle_s:.0f} s after")
    t = time.perf_counter()
    res = run_swarm(
        lab,
        cfg,
        job,
        jw,
        nodes,
        boot_maddr=nodes["boot_maddr"],
        idle_s=idle_s,
        keeper=keeper,
        probe=lambda: tcp_bytes(lab, all_nodes),
    )
    traffic = [peer_traffic(p.read_text(errors="replace")) for p in sorted(jw.glob("*-peer*.log"))]
    summary = json.loads(next(jw.glob("*-out/summary.json")).read_text())
    traffic.append(summary.get("traffic", {}))
    b = breakdown(res, traffic, tokens=res["tokens"])
    if len(res["probes"]) >= 2:
        b["tcp_by_pair"] = pair_bytes(res["probes"][0], res["probes"][1], res["tokens"])
        b["tcp_total"] = sum(b["tcp_by_pair"].values())
    if len(res["probes"]) >= 3 and res["idle_s"] > 0:
        idle_pairs = pair_bytes(res["probes"][1], res["probes"][2], 1)
        b["idle_tcp_bytes_per_s_by_pair"] = {k: v / res["idle_s"] for k, v in idle_pairs.items()}
    say(
        f"    wire {b['wire']:.0f} B/token, payload {b['payload']:.0f}, overhead/payload "
        f"{b['ratio']:.3f} ({time.perf_counter() - t:.0f} s)"
    )
    return {
        "label": _label(subspace),
        "rate": format_rate(rate),
        "tokens_per_s": res["tokens_per_s"],
        "micro_batches": n_mb,
        "load_1min": res.get("load_1min"),
        "breakdown": b,
        "traffic": traffic,
    }


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _fold(report: dict[str, Any], name: str, variant: dict[str, Any]) -> None:
    """Put ``variant``'s runs under ``name`` in ``report``, replacing only the runs of the same rate, run
    length and model (a run without a length is the old default's, 24)."""

    def key(r: dict[str, Any]) -> tuple:
        return r["rate"], r.get("micro_batches", 24), r["label"]

    new_keys = {key(r) for r in variant["runs"]}
    old = report["variants"].get(name, {})
    keep = [r for r in old.get("runs", []) if key(r) not in new_keys]
    report["variants"][name] = {**old, **variant, "runs": keep + variant["runs"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.control_plane",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--variant", default="after", help="name of this code's runs in the results (before, after)"
    )
    parser.add_argument("--rates", nargs="+", default=["none"])
    parser.add_argument(
        "--micro-batches",
        type=int,
        nargs="+",
        default=[24, 128],
        help="run lengths: one run of each (24: the links benchmark's throughput runs)",
    )
    parser.add_argument(
        "--table", default=None, help="group this variant's runs into the table of this title (--render)"
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        default=[],
        metavar="JSON",
        help="only fold the runs of these results files (e.g. --out of an older checkout) into --variant of --out",
    )
    parser.add_argument("--idle-s", type=float, default=20.0, help="peers kept up after training, measured")
    parser.add_argument(
        "--keeper",
        action="store_true",
        help="run swarm init with its keeper (stage snapshots downloaded from the peers: not control traffic)",
    )
    parser.add_argument("--render", action="store_true", help="only rewrite the BENCHMARKS.md section")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    path = Path(args.out)
    report = json.loads(path.read_text()) if path.exists() else {"name": "control_plane", "variants": {}}
    reading = RESULTS_DIR / "control_plane_reading.md"
    if args.render:
        if reading.exists():
            report["reading"] = reading.read_text()
        streams = STREAMS.exists() and json.loads(STREAMS.read_text()) or None
        write_section(markdown_section(report, streams))
        print(f"rewrote the {SECTION!r} section from {path}")
        return 0
    if args.merge:  # into --variant (and --table): another checkout's runs, whatever it named them
        for other in args.merge:
            for v in json.loads(Path(other).read_text())["variants"].values():
                _fold(report, args.variant, v | ({"table": args.table} if args.table else {}))
        path.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"folded {len(args.merge)} file(s) into {path}")
        return 0
    reason = lab_unavailable_reason(probe=True)
    if reason:
        print(f"cannot run the network lab: {reason}", file=sys.stderr)
        return 2
    import os

    load = f"{os.getloadavg()[0]:.1f}"
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs = run(rates=args.rates, micro_batches=args.micro_batches, idle_s=args.idle_s, keeper=args.keeper)
    variant = {
        "commit": _commit(),
        "started": started,
        "load": load,
        "command": "python -m benchmarks.control_plane "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(),
        "keeper": args.keeper,
        "runs": runs,
    }
    if args.table:
        variant["table"] = args.table
    _fold(report, args.variant, variant)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"results in {path}; `python -m benchmarks.control_plane --render` writes BENCHMARKS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
