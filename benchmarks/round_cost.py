"""What one gradient round of two replicas costs in CPU, and what one DHT store and read cost.

    python -m benchmarks.round_cost                  # buffers of 1,000 and 400,000 values, 30 rounds each
    python -m benchmarks.round_cost --sizes 1000 --rounds 10

Two hivemind DHT nodes (each with its own p2pd) and two ``StageAverager`` processes in this process tree
run ``rounds`` gradient rounds back to back (``StageAverager.combine`` in two threads, a group of 2, as
two replicas of a stage do); the CPU of every process of the tree (utime + stime from psutil) is read
before and after. A round's CPU at a small buffer is the fixed part (hivemind's matchmaking through the
DHT and the all-reduce's streams); the growth with the buffer is the part compression could shrink. Then
``ops`` DHT stores and reads of one small value, for scale. Loopback only; no timed assertions.

Results: ``benchmarks/results/round_cost.json``; BENCHMARKS.md "Demo throughput" reads them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "round_cost.json"


def _tree_cpu() -> float:
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            continue
    return total


def _rounds(dhts: list[Any], size: int, rounds: int) -> dict[str, Any]:
    import torch

    from peer.averaging import StageAverager

    averagers = []
    for dht in dhts:
        shapes = [torch.zeros(size)]
        averagers.append(
            StageAverager.create(
                dht,
                run_id=f"roundcost{size}",
                spec_hash="0",
                stage=0,
                shapes=shapes,
                grad_shapes=[s.shape for s in shapes],
                state_fn=lambda shapes=shapes: ({}, shapes),
            )
        )
    for a in averagers:
        a.wait_ready(30)
    done = [0, 0]

    def member(i: int, n: int) -> None:
        grads = [torch.randn(size)]
        for k in range(n):
            out = averagers[i].combine(grads, 2, group_size=2, gather={"version": k}, timeout_s=10)
            done[i] += out is not None

    def both(n: int) -> None:
        threads = [threading.Thread(target=member, args=(i, n)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    try:
        both(1)  # the first round also warms up both averagers' connections
        done[:] = [0, 0]
        cpu0, t0 = _tree_cpu(), time.perf_counter()
        both(rounds)
        cpu1, t1 = _tree_cpu(), time.perf_counter()
    finally:
        for a in averagers:
            a.shutdown()
    return {
        "values": size,
        "rounds": rounds,
        "completed": done,
        "cpu_ms_per_round_both_members": round(1000 * (cpu1 - cpu0) / rounds, 1),
        "wall_ms_per_round": round(1000 * (t1 - t0) / rounds, 1),
    }


def _dht_ops(dht: Any, ops: int) -> dict[str, float]:
    from hivemind.utils import get_dht_time

    out = {}
    for name, op in (
        ("store", lambda k: dht.store(f"roundcost_key{k}", True, get_dht_time() + 30, subkey=b"x")),
        ("get", lambda k: dht.get(f"roundcost_key{k}", latest=True)),
    ):
        cpu0 = _tree_cpu()
        for k in range(ops):
            op(k)
        out[f"dht_{name}_cpu_ms"] = round(1000 * (_tree_cpu() - cpu0) / ops, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.round_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 400_000], help="buffer values per round")
    p.add_argument("--rounds", type=int, default=30, help="rounds per size")
    p.add_argument("--ops", type=int, default=50, help="DHT stores and reads")
    p.add_argument("--out", type=Path, default=RESULTS, help="the JSON written")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.ops < 1 or min(args.sizes) < 1:
        p.error("--rounds, --ops and every --sizes value must be at least 1")
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")
    logging.getLogger("hivemind").setLevel(logging.ERROR)
    from swarm.dht.network import DHTConfig, start_dht

    first = start_dht(DHTConfig())
    second = start_dht(DHTConfig(initial_peers=tuple(str(a) for a in first.get_visible_maddrs())))
    result: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load": os.getloadavg(),
    }
    try:
        result["rounds"] = []
        for size in args.sizes:
            r = _rounds([first, second], size, args.rounds)
            print(
                f"{size} values: {r['cpu_ms_per_round_both_members']} ms CPU per round (both members), "
                f"{r['wall_ms_per_round']} ms wall; completed {r['completed']}",
                flush=True,
            )
            result["rounds"].append(r)
        result.update(_dht_ops(second, args.ops))
        print(
            f"DHT store {result['dht_store_cpu_ms']} ms CPU, get {result['dht_get_cpu_ms']} ms CPU",
            flush=True,
        )
    finally:
        second.shutdown()
        first.shutdown()
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
