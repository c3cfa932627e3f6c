"""CPU of every process in one whole state download, donor to receiver, over hivemind on loopback.

    python -m benchmarks.state_download                 # a 77 MB state (one stage of examples/bench.yaml)
    python -m benchmarks.state_download --mb 8 --rounds 3

Two DHT nodes (each with its libp2p daemon) and two of our stage averagers (peer/averaging.py), one the
donor of a flat float32 state of ``--mb`` MB, the other downloading it, as a keeper or a joiner does.
Each round downloads it once by each path, alternating which goes first:

- ``stock``: hivemind's own ``rpc_download_state`` and ``_load_state_from_peers`` (64 KiB parts, each
  copied several times; before session 21);
- ``stream``: ours (note "state stream" in peer/state_stream.py: 1 MiB parts, one copy out of protobuf
  straight into shared memory).

For each: wall time and the CPU seconds of the host process (the donor's export and the receiver's
hand-over), the donor's and the receiver's averager process and both daemons; medians over the rounds
go to ``benchmarks/results/state_download.json``. Each download's contents are checked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _cpu(pids: dict[int, str]) -> dict[str, float]:
    import psutil

    out: dict[str, float] = {}
    for pid, name in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[name] = out.get(name, 0.0) + t.user + t.system
    return out


def _stock_class() -> type:
    """Our averager class with hivemind's own download code on both sides."""
    from hivemind.averaging import DecentralizedAverager

    from peer.averaging import _make_averager_class

    base = _make_averager_class()

    class Stock(base):
        async def rpc_download_state(self, _request, _context):  # noqa: ANN001 -- hivemind's names
            async for item in DecentralizedAverager.rpc_download_state(self, _request, _context):
                yield item

        async def _load_state_from_peers(self, future, timeout=None):  # noqa: ANN001
            await DecentralizedAverager._load_state_from_peers(self, future, timeout)

    Stock.rpc_download_state.__annotations__ = base.rpc_download_state.__annotations__
    return Stock


def _pair(dht_donor: Any, dht_receiver: Any, state: Any, name: str, cls: type | None) -> tuple[Any, Any]:
    """A donor of ``state`` and a receiver, stage averagers of class ``cls`` (None: ours as it is)."""
    from unittest import mock

    import torch

    from peer.averaging import StageAverager

    made = []
    with mock.patch("peer.averaging._make_averager_class", lambda: cls) if cls else contextlib.nullcontext():
        for dht in (dht_donor, dht_receiver):
            made.append(
                StageAverager.create(
                    dht,
                    run_id=f"bench-{name}",
                    spec_hash="0" * 8,
                    stage=0,
                    shapes=[torch.Size([state.numel()])],
                    grad_shapes=[],
                    state_fn=lambda: ({"version": 1}, [state]),
                )
            )
    return made[0], made[1]


def run(mb: float, rounds: int) -> dict[str, Any]:
    import hivemind
    import psutil
    import torch

    numel = int(mb * 2**20) // 4
    state = torch.randn(numel)
    dht_a = hivemind.DHT(start=True)
    dht_b = hivemind.DHT(initial_peers=dht_a.get_visible_maddrs(), start=True)
    pairs = {
        "stream": _pair(dht_a, dht_b, state, "stream", None),
        "stock": _pair(dht_a, dht_b, state, "stock", _stock_class()),
    }
    got: dict[str, dict[str, list[float]]] = {way: {} for way in pairs}
    try:
        for donor, receiver in pairs.values():
            donor.wait_ready()
            receiver.wait_ready()
            donor.share_state(True, 1.0)
        me = os.getpid()
        names = {me: "host"}
        for donor, receiver in pairs.values():
            names[donor._averager.pid] = "donor averager"
            names[receiver._averager.pid] = "receiver averager"
        for child in psutil.Process(me).children(recursive=True):
            if child.name() == "p2pd":
                names[child.pid] = "daemons"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(r.load_state(10) is None for _, r in pairs.values()):
            time.sleep(1)  # until both donors' declarations are in the DHT
        for r in range(rounds):
            for way in pairs if r % 2 == 0 else reversed(list(pairs)):
                _, receiver = pairs[way]
                c0, w0 = _cpu(names), time.perf_counter()
                loaded = receiver.load_state(60)
                wall = time.perf_counter() - w0
                c1 = _cpu(names)
                if loaded is None or not torch.equal(loaded[1][0], state):
                    raise RuntimeError(f"the {way} download did not bring the donor's state back")
                del loaded
                rec = got[way]
                rec.setdefault("wall_s", []).append(wall)
                for k in c1:
                    rec.setdefault(f"{k}_s", []).append(c1[k] - c0.get(k, 0.0))
                rec.setdefault("all_cpu_s", []).append(sum(c1.values()) - sum(c0.values()))
                print(f"round {r} {way}: wall {wall:.2f} s, CPU {rec['all_cpu_s'][-1]:.2f} s", flush=True)
    finally:
        for donor, receiver in pairs.values():
            for a in (donor, receiver):
                a._averager.shutdown()
        dht_b.shutdown()
        dht_a.shutdown()
    medians = {way: {k: statistics.median(v) for k, v in rec.items()} for way, rec in got.items()}
    return {"state_mb": numel * 4 / 2**20, "rounds": rounds, "medians": medians, "all": got}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=77.0, help="state size in MB (default: one bench.yaml stage)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(HERE / "results" / "state_download.json"))
    args = p.parse_args(argv)
    res = run(args.mb, args.rounds)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    for way, m in res["medians"].items():
        parts = ", ".join(f"{k[:-2]} {v:.2f}" for k, v in m.items() if k not in ("wall_s", "all_cpu_s"))
        print(f"{way}: wall {m['wall_s']:.2f} s, CPU {m['all_cpu_s']:.2f} s ({parts})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
