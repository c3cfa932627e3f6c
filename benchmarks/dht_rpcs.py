"""Which DHT operations an idle swarm's background traffic is made of (a diagnostic, loopback).

Run (from the repository root; wrap it in ``flock /tmp/bench.lock`` on a shared machine)::

    python -m benchmarks.dht_rpcs                       # 4 stage peers of examples/bench.yaml, 60 s idle
    python -m benchmarks.dht_rpcs --seconds 120 --out benchmarks/results/dht_rpcs.json

What runs: a plain bootstrap node, the run's ``swarm init --no-keeper`` and one stage peer per stage
(``--no-rebalance``, like the control-plane benchmark's swarm; the run's bootstrap prints its status every
30 s, as there), no trainer: the swarm the control-plane benchmark's idle row measures. Every process counts the DHT RPCs its DHT node *sends*
(hivemind's ``DHTProtocol.call_find`` / ``call_store`` / ``call_ping``), each under the operation that
caused it: a ``store`` or ``get`` of a key (ours: the stage records, progress; hivemind's averager: its
donor declarations ``<prefix>.all_averagers`` and matchmaking keys), a cache store of a read's result
(hivemind's ``cache_nearest``), or anything else (routing-table maintenance, pings of new nodes). Each of
these RPCs is a unary libp2p call, a stream of its own (~1.3 KB on the wire, BENCHMARKS.md "Control
plane"); what the daemons send by themselves (identify, ping) does not show here.

The counting is a ``sitecustomize`` module put on the children's ``PYTHONPATH`` (it wraps hivemind's
classes before the DHT process forks, and each process writes its counts to a file every 2 s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_INITIAL = re.compile(r"initial peers: (\S+)")
_SERVING = re.compile(r"peer (\S+) serving stage (\d+) of run (\S+)")

_SITE = r"""
import os, sys
_DIR = os.environ.get("SWARMPIPE_RPC_COUNT_DIR")
if _DIR:
    import contextvars, json, threading, time, collections, re
    _op = contextvars.ContextVar("swarmpipe_dht_op", default="other")
    _inst = contextvars.ContextVar("swarmpipe_dht_op_instance", default=None)
    _counts = collections.Counter()
    _targets = collections.defaultdict(set)  # (label, instance) -> peers an RPC went to
    _state = {"pid": None}

    def _label(key):
        s = key if isinstance(key, str) else repr(key)
        return re.sub(r"[0-9a-f]{16,}|\b\d+\b", "#", s)

    def _writer():
        path = os.path.join(_DIR, f"{os.getpid()}.json")
        while True:
            time.sleep(2.0)
            a = sys.argv
            role = a[1] if len(a) > 1 else "?"
            if "--stage" in a:
                role += " " + a[a.index("--stage") + 1]
            elif len(a) > 2 and a[2].endswith(".yaml"):
                role += " (run)"
            per_op = collections.defaultdict(lambda: [0, 0])  # label -> [instances, distinct peers]
            for (label, _), peers in list(_targets.items()):
                per_op[label][0] += 1
                per_op[label][1] += len(peers)
            data = {"role": role, "pid": os.getpid(), "t": time.time(),
                    "counts": {"|".join(k): v for k, v in _counts.items()},
                    "targets": {k: v for k, v in per_op.items()}}
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)

    def _count(kind):
        if _state["pid"] != os.getpid():
            _state["pid"] = os.getpid()
            threading.Thread(target=_writer, daemon=True).start()
        _counts[(kind, _op.get())] += 1

    def _patch():
        from hivemind.dht.protocol import DHTProtocol
        from hivemind.dht.node import DHTNode

        def wrap_call(name):
            orig = getattr(DHTProtocol, name)
            async def call(self, *args, **kwargs):
                kind = name
                if name == "call_store" and kwargs.get("in_cache"):
                    kind = "call_store(cache)"
                _count(kind)
                inst = _inst.get()
                if inst is not None and args:
                    _targets[(_op.get(), inst)].add(str(args[0]))
                return await orig(self, *args, **kwargs)
            setattr(DHTProtocol, name, call)

        for n in ("call_find", "call_store", "call_ping"):
            wrap_call(n)

        orig_store, orig_get = DHTNode.store_many, DHTNode.get_many
        async def store_many(self, keys, *args, **kwargs):
            _op.set("store " + _label(keys[0]))
            _inst.set(object())
            _count("op store")
            return await orig_store(self, keys, *args, **kwargs)
        async def get_many(self, keys, *args, **kwargs):
            _op.set("get " + ",".join(sorted({_label(k) for k in keys})))
            _inst.set(object())
            _count("op get")
            return await orig_get(self, keys, *args, **kwargs)
        DHTNode.store_many, DHTNode.get_many = store_many, get_many

        replicas = os.environ.get("SWARMPIPE_RPC_NUM_REPLICAS")
        if replicas:  # --num-replicas: what our setting would cost with another value
            orig_create = DHTNode.create.__func__

            async def create(cls, *args, **kwargs):
                kwargs["num_replicas"] = int(replicas)
                return await orig_create(cls, *args, **kwargs)

            DHTNode.create = classmethod(create)

    try:
        _patch()
    except Exception as e:  # a diagnostic must not break the process
        print("rpc counting off:", e, file=sys.stderr)
"""


def _wait(path: Path, pattern: re.Pattern, proc: subprocess.Popen, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = pattern.search(path.read_text(errors="replace")) if path.exists() else None
        if m:
            return m
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited: {path.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"{proc.args}: no {pattern.pattern!r} in {timeout_s} s")


def _snapshot(count_dir: Path) -> dict[int, dict]:
    out = {}
    for p in count_dir.glob("*.json"):
        try:
            out[int(p.stem)] = json.loads(p.read_text())
        except (ValueError, OSError):
            pass
    return out


def diff(before: dict[int, dict], after: dict[int, dict]) -> dict[str, Counter]:
    """Per role, the counts ``after`` minus ``before`` (pure)."""
    out: dict[str, Counter] = {}
    for pid, a in after.items():
        b = before.get(pid, {"counts": {}})["counts"]
        c = Counter({k: v - b.get(k, 0) for k, v in a["counts"].items() if v - b.get(k, 0)})
        out.setdefault(a["role"], Counter()).update(c)
    return out


def distinct_peers(snapshot: dict[int, dict]) -> dict[str, dict[str, float]]:
    """Per operation, since the processes started: how many operations sent RPCs and how many distinct
    nodes each one's RPCs went to on average (pure)."""
    tot: dict[str, list[int]] = {}
    for data in snapshot.values():
        for label, (n, peers) in data.get("targets", {}).items():
            t = tot.setdefault(label, [0, 0])
            t[0] += n
            t[1] += peers
    return {k: {"operations": n, "distinct_nodes_each": round(p / n, 2)} for k, (n, p) in sorted(tot.items())}


def summarize(per_role: dict[str, Counter], seconds: float) -> dict:
    """Totals per minute: by RPC kind, by operation (pure)."""
    total: Counter = Counter()
    for c in per_role.values():
        total.update(c)
    by_kind: Counter = Counter()
    by_op: Counter = Counter()
    for k, v in total.items():
        kind, op = k.split("|", 1)
        by_kind[kind] += v
        if not kind.startswith("op "):
            by_op[op] += v
    per_min = 60.0 / seconds
    return {
        "seconds": seconds,
        "rpcs_per_min": {k: round(v * per_min, 1) for k, v in by_kind.most_common()},
        "rpcs_per_min_by_operation": {k: round(v * per_min, 1) for k, v in by_op.most_common()},
        "by_role_per_min": {
            role: {k: round(v * per_min, 1) for k, v in sorted(c.items())} for role, c in per_role.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dht_rpcs", description=__doc__)
    parser.add_argument("--spec", default=str(ROOT / "examples" / "bench.yaml"))
    parser.add_argument("--seconds", type=float, default=60.0, help="idle window counted")
    parser.add_argument(
        "--warmup-s", type=float, default=20.0, help="after every peer serves, before counting"
    )
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--num-replicas",
        type=int,
        default=None,
        help="override every node's DHT num_replicas (a lever's cost)",
    )
    args = parser.parse_args(argv)
    from swarm.run.spec import RunSpec

    spec = RunSpec.from_yaml(args.spec)
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="swarmpipe-rpcs-") as tmp:
        work = Path(tmp)
        site = work / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(_SITE)
        counts = work / "counts"
        counts.mkdir()
        env = {
            **os.environ,
            "PYTHONPATH": f"{site}:{ROOT}",
            "SWARMPIPE_RPC_COUNT_DIR": str(counts),
            "HIVEMIND_LOGLEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
        }
        if args.num_replicas:
            env["SWARMPIPE_RPC_NUM_REPLICAS"] = str(args.num_replicas)
        py = [sys.executable, "-m", "swarm.cli"]
        listen = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]

        def spawn(name: str, argv: list[str]) -> tuple[subprocess.Popen, Path]:
            log = work / f"{name}.log"
            with open(log, "wb") as f:
                p = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=str(ROOT))
            procs.append(p)
            return p, log

        try:
            boot, log = spawn("boot", [*py, "init", *listen, "--status-interval-s", "600"])
            maddr = _wait(log, _INITIAL, boot, 60).group(1)
            init, log = spawn(
                "init",
                [*py, "init", args.spec, "--initial-peers", maddr, *listen, "--no-keeper"]
                + ["--status-interval-s", "30"],
            )
            _wait(log, _INITIAL, init, 60)
            peers = [
                spawn(
                    f"peer{i}",
                    [*py, "peer", "--initial-peers", maddr, "--run", spec.run_id, "--stage", str(i)]
                    + [*listen, "--throughput", "1000", "--no-rebalance"],
                )
                for i in range(spec.num_stages)
            ]
            for p, log in peers:
                _wait(log, _SERVING, p, 180)
            time.sleep(args.warmup_s)
            before = _snapshot(counts)
            t0 = time.monotonic()
            time.sleep(args.seconds)
            time.sleep(2.5)  # the writers' period: the last counts are on disk
            after = _snapshot(counts)
            seconds = time.monotonic() - t0 - 2.5
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
    report = summarize(diff(before, after), seconds)
    report["distinct_peers_per_operation"] = distinct_peers(after)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
