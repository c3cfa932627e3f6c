"""CPU of a keeper's snapshot writes, with the written pages kept in the page cache or dropped.

    python -m benchmarks.snapshot_write                  # 77 MB snapshots (one stage of examples/bench.yaml)
    python -m benchmarks.snapshot_write --mb 8 --rounds 2

Writes what a keeper writes (``swarm.dht.snapshots.SnapshotStore``: a snapshot of each of ``--stages``
stages per round, ``keep`` 3 per stage, the oldest deleted) into a fresh directory under ``--dir``, once
with the pages of every written file dropped from the page cache (note "write-once files" in
swarm/atomic.py, the default since session 22) and once keeping them (before), alternating which goes
first over ``--repeats``. Per write: wall time, this process's CPU (user + system) and, on Linux, the
whole machine's busy CPU (``/proc/stat``: the kernel's writeback threads included). Results go to
``benchmarks/results/snapshot_write.json``; every snapshot is read back and checked at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WAYS = ("drop", "keep")
SPEC_HASH = "0" * 16  # any spec: the store only files by it


def machine_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine since boot (``/proc/stat``), or None off Linux."""
    import os

    from benchmarks.report import machine_ticks

    ticks = machine_ticks()
    if not ticks:
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _process_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@contextlib.contextmanager
def _cache_kept(way: str) -> Iterator[None]:
    """``keep``: the store writes without dropping pages, as it did before session 22."""
    if way == "drop":
        yield
        return
    from unittest import mock

    from swarm import atomic
    from swarm.dht import snapshots

    def keeping(payload: Any, path: Path, **kw: Any) -> Path:
        return atomic.atomic_torch_save(payload, path, **kw, drop_cache=False)

    with mock.patch.object(snapshots, "atomic_torch_save", keeping):
        yield


def write_rounds(way: str, root: Path, flat: Any, *, stages: int, rounds: int) -> list[dict[str, float]]:
    """``rounds`` rounds of one snapshot per stage into a fresh store under ``root``; a row per write."""
    from swarm.dht.snapshots import Snapshot, SnapshotStore

    store = SnapshotStore(root / way, spec_hash=SPEC_HASH, keep=3)
    rows = []
    with _cache_kept(way):
        for r in range(rounds):
            for stage in range(stages):
                snap = Snapshot(
                    spec_hash=SPEC_HASH,
                    run_id="bench",
                    stage=stage,
                    version=r + 1,
                    meta={"version": r + 1},
                    flat=flat,
                    taken_at=time.time(),
                )
                m0, c0, w0 = machine_busy_s(), _process_cpu_s(), time.perf_counter()
                store.write(snap)
                wall, cpu, m1 = time.perf_counter() - w0, _process_cpu_s() - c0, machine_busy_s()
                rows.append(
                    {
                        "round": r,
                        "stage": stage,
                        "wall_s": wall,
                        "cpu_s": cpu,
                        "machine_busy_s": None if m0 is None or m1 is None else m1 - m0,
                    }
                )
    for stage in range(stages):
        got = store.newest(stage, numel=flat.numel())
        if got is None or got.version != rounds or not got.flat.equal(flat):
            raise RuntimeError(f"{way}: stage {stage}'s newest snapshot did not read back whole")
    return rows


def run(mb: float, *, stages: int, rounds: int, repeats: int, directory: str | None) -> dict[str, Any]:
    import torch

    flat = torch.randn(int(mb * 2**20) // 4)
    got: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    totals: dict[str, list[float]] = {way: [] for way in WAYS}
    # every store stays on disk until the end: deleting one frees pages that the next write reuses cheaply
    root = Path(tempfile.mkdtemp(prefix="snapshot-write-", dir=directory))
    try:
        for rep in range(repeats):
            for way in WAYS if rep % 2 == 0 else reversed(WAYS):
                rows = write_rounds(way, root / str(rep), flat, stages=stages, rounds=rounds)
                for row in rows:
                    row["repeat"] = rep
                got[way] += rows
                totals[way].append(sum(r["cpu_s"] for r in rows))
                print(f"repeat {rep} {way}: {len(rows)} writes, CPU {totals[way][-1]:.2f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def med(rows: list[dict[str, float]], key: str) -> float | None:
        vals = [r[key] for r in rows if r[key] is not None]
        return statistics.median(vals) if vals else None

    medians = {
        way: {k: med(rows, k) for k in ("wall_s", "cpu_s", "machine_busy_s")} for way, rows in got.items()
    }
    return {
        "snapshot_mb": flat.numel() * 4 / 2**20,
        "stages": stages,
        "rounds": rounds,
        "repeats": repeats,
        "medians_per_write": medians,
        "cpu_s_per_store": totals,  # every write of one store (stages x rounds)
        "median_cpu_s_per_store": {way: statistics.median(v) for way, v in totals.items()},
        "writes": got,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--mb", type=float, default=77.0, help="snapshot size in MB (default: one bench.yaml stage)"
    )
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4, help="rounds per store (the 4th deletes the 1st)")
    p.add_argument("--repeats", type=int, default=4, help="stores per way, alternating which goes first")
    p.add_argument("--dir", default=None, help="where the stores go (default: the system's temp directory)")
    p.add_argument("--out", default=str(HERE / "results" / "snapshot_write.json"))
    args = p.parse_args(argv)
    res = run(args.mb, stages=args.stages, rounds=args.rounds, repeats=args.repeats, directory=args.dir)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    n = args.stages * args.rounds
    for way, m in res["medians_per_write"].items():
        busy = m["machine_busy_s"]
        total = res["median_cpu_s_per_store"][way]
        print(
            f"{way}: {n} writes take CPU {total:.2f} s (median of {args.repeats}); per write median: "
            f"wall {m['wall_s']:.3f} s, CPU {m['cpu_s']:.3f} s"
            + (f", machine busy {busy:.3f} s" if busy is not None else "")
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
