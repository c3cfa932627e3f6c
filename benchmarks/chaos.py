"""Chaos benchmark: random SIGKILLs of stage peers while a trainer runs, against a fault-free run.

Run (from the repository root)::

    python -m benchmarks.chaos                       # 2 stages x 2 peers, then 4 x 2: results/chaos.json
    python -m benchmarks.chaos --stages 2            # one layout only
    python -m benchmarks.chaos --render              # print the BENCHMARKS.md section from results/chaos.json

What runs, per layout (``swarm.demo.Demo`` on loopback: a bootstrap with a keeper, ``swarm peer``
processes, a ``Trainer`` in this process):

1. a fault-free run of ``--steps`` trainer steps, then the held-out loss;
2. the same run with chaos: every ``--kill-every-s`` seconds (jittered) one random peer of a stage
   that still has a live stage-mate is killed with SIGKILL (the peer process only, as a crash would:
   its hivemind DHT process, averager and p2pd must exit by themselves) and a fresh peer is started
   for its stage; once, a third of the way through (once the keeper holds a snapshot), *every* replica of the last stage is killed at once and two
   fresh peers are started: they find no live replica and restore the keeper's snapshot.

Figures (each from the trainer's metrics file, its events and the run's DHT records):

- longest stall: the longest time between two consecutive completed trainer steps after the first
  (a step completes ``accumulate`` micro-batches; this bounds the time without a completed micro-batch);
- kill to re-send: for each killed peer, the time from the SIGKILL to each of its micro-batches'
  failure event (the trainer re-sends a micro-batch right there; median and max over micro-batches);
- micro-batches dropped (given up after ``max_attempts``), attempts failed;
- training lost: stage steps rolled back by the wipe (``StageEvent.lost_versions``), in tokens;
- processes left behind: live processes of a killed peer's process group 10 s after its SIGKILL, and
  of every group after the demo shut down;
- held-out loss of the chaos run vs the fault-free run at equal tokens.

Not measured yet: a trainer kill + ``--resume`` (the trainer's resume is not in this tree yet).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "chaos.json"

SPEC = {
    "run_id": "chaos",
    "model": {"vocab_size": 256, "d_model": 32, "n_layers": 4, "n_heads": 2, "seq_len": 32},
    "codecs": {"activations": "blockwise8", "gradients": "blockwise8"},
    "optimizer": {"lr": 1e-2, "max_versions": 16, "accumulate": 4},
    "averaging": {},
    "micro_batch_size": 4,
}


def make_spec(stages: int, run_id: str):  # type: ignore[no-untyped-def]
    from swarm.spec import RunSpec

    return RunSpec.from_dict(SPEC | {"stages": stages, "run_id": run_id})


def make_demo(spec, out: Path, *, snapshot_interval_s: float):  # type: ignore[no-untyped-def]
    from swarm.demo import Demo, DemoConfig
    from swarm.keeper import KeeperConfig

    return Demo(
        DemoConfig(
            spec=spec,
            peers_per_stage=2,
            out_dir=str(out),
            peer_args=("--throughput", "20000", "--announce-period", "1"),
            torch_threads=1,
            quiet=True,
            keeper=KeeperConfig(directory=str(out / "snapshots"), interval_s=snapshot_interval_s, tick_s=1.0),
        )
    )


def make_trainer(demo, out: Path, steps: int):  # type: ignore[no-untyped-def]
    from swarm.trainer import Trainer, TrainerConfig

    return Trainer(
        TrainerConfig(
            initial_peers=(demo.maddr,),
            run_id=demo.spec.run_id,
            steps=steps,
            out_dir=str(out),
            max_inflight=4,
            eval_every=steps,
            eval_batches=4,
            seed=0,
            quiet=True,
            refresh_every_s=0.5,
            max_attempts=8,
        )
    )


def group_alive(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid`` (Linux /proc)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            alive.append(int(entry))
    return alive


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_eval(records: list[dict[str, Any]]) -> float | None:
    evals = [r for r in records if r.get("type") == "eval"]
    return evals[-1]["eval_loss"] if evals else None


def longest_stall(records: list[dict[str, Any]]) -> float:
    times = [r["time"] for r in records if r.get("type") == "step"]
    return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


def resend_latencies(kills: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[float]:
    """Per killed peer, the delay from its SIGKILL to each failure event that names it."""
    failures = [r for r in records if r.get("type") == "event" and r.get("event") == "attempt_failed"]
    out = []
    for k in kills:
        later = [
            f["time"] - k["time"] for f in failures if f.get("peer") == k["peer"] and f["time"] >= k["time"]
        ]
        out.extend(later)
    return out


def run_layout(
    stages: int, *, steps: int, kill_every_s: float, snapshot_interval_s: float, seed: int, root: Path
):
    from swarm.processes import remove_stale_sockets

    rng = random.Random(seed)
    spec = make_spec(stages, f"chaos{stages}")
    result: dict[str, Any] = {"stages": stages, "peers_per_stage": 2, "steps": steps, "spec": spec.to_dict()}

    # 1. fault-free
    clean = make_demo(spec, root / f"s{stages}-clean", snapshot_interval_s=snapshot_interval_s)
    t0 = time.monotonic()
    try:
        clean.start()
        clean_summary = make_trainer(clean, root / f"s{stages}-clean-train", steps).train()
    finally:
        clean.shutdown()
    result["clean"] = {
        "wall_s": time.monotonic() - t0,
        "micro_batches": clean_summary["micro_batches"],
        "eval_loss": final_eval(read_jsonl(root / f"s{stages}-clean-train" / "metrics.jsonl")),
        "leftovers": len(clean.leftovers()),
    }
    print(f"[s{stages}] clean: {result['clean']}", flush=True)

    # 2. chaos
    demo = make_demo(spec, root / f"s{stages}-chaos", snapshot_interval_s=snapshot_interval_s)
    kills: list[dict[str, Any]] = []
    orphans: list[dict[str, Any]] = []
    replacements: list[dict[str, Any]] = []  # every fresh peer: online, or why not
    fresh: list[asyncio.Task] = []
    t0 = time.monotonic()
    try:
        demo.start()
        trainer = make_trainer(demo, root / f"s{stages}-chaos-train", steps)
        wipe_stage = stages - 1

        def live(stage: int) -> list:
            return [
                p
                for p in demo.peers
                if p.stage == stage and not p.killed and p.popen.poll() is None and p.peer_id
            ]

        async def kill(victim, what: str) -> None:
            os.kill(
                victim.pid, signal.SIGKILL
            )  # the peer process only: its children must follow by themselves
            victim.killed = True
            now = trainer._clock() - trainer.started
            kills.append(
                {
                    "time": now,
                    "stage": victim.stage,
                    "peer": victim.peer_id,
                    "what": what,
                    "step": trainer.step,
                }
            )
            await asyncio.to_thread(victim.popen.wait)

        async def watch_orphans(victim) -> None:
            t = time.monotonic()
            while group_alive(victim.pid) and time.monotonic() - t < 10.0:
                await asyncio.sleep(0.2)
            orphans.append(
                {
                    "peer": victim.peer_id,
                    "left_after_10s": len(group_alive(victim.pid)),
                    "gone_s": time.monotonic() - t,
                }
            )
            remove_stale_sockets(demo.socket_prefix)

        async def replace(stage: int, name: str) -> None:
            t = time.monotonic()
            try:
                await demo.add_peer_async(stage, name=name)
                replacements.append({"stage": stage, "online_s": time.monotonic() - t})
            except Exception as e:  # noqa: BLE001 -- a replacement that never came online is a result
                replacements.append({"stage": stage, "error": f"{type(e).__name__}: {e}"[:500]})

        async def chaos(run: asyncio.Task) -> None:
            while getattr(trainer, "started", None) is None:
                await asyncio.sleep(0.1)
            wiped = False
            while not run.done():
                await asyncio.sleep(kill_every_s * rng.uniform(0.7, 1.3))
                if run.done():
                    return
                keeper = demo.boot.keeper
                held = keeper.held[wipe_stage]
                if not wiped and trainer.step >= steps // 3 and held is not None and held.version > 0:
                    victims = live(wipe_stage)
                    if len(victims) < 2:
                        continue  # a replacement is still starting: wipe when the stage is whole again
                    wiped = True
                    for v in victims:
                        await kill(v, "wipe")
                    for v in victims:
                        fresh.append(asyncio.create_task(watch_orphans(v)))
                        fresh.append(asyncio.create_task(replace(wipe_stage, f"w{len(kills)}")))
                    continue
                choices = [s for s in range(stages) if len(live(s)) >= 2]
                if not choices:
                    continue
                victim = rng.choice(live(rng.choice(choices)))
                await kill(victim, "single")
                fresh.append(asyncio.create_task(watch_orphans(victim)))
                fresh.append(asyncio.create_task(replace(victim.stage, f"f{len(kills)}")))

        async def main() -> dict:
            run = asyncio.get_running_loop().create_task(trainer.run())
            monkey = asyncio.get_running_loop().create_task(chaos(run))
            try:
                return await asyncio.wait_for(asyncio.shield(run), timeout=1800)
            finally:
                monkey.cancel()
                await asyncio.gather(monkey, return_exceptions=True)
                await asyncio.gather(*fresh, return_exceptions=True)

        summary = asyncio.run(main())
        events = demo.boot.membership.events()
    finally:
        demo.shutdown()
    records = read_jsonl(root / f"s{stages}-chaos-train" / "metrics.jsonl")
    latencies = resend_latencies(kills, records)
    # two fresh peers of the wiped stage may both report the same rollback: count each (stage, lost_from) once
    rollbacks = {(e.stage, e.lost_from): e for e in events if e.kind == "rollback"}
    lost_steps = sum(e.lost_versions or 0 for e in rollbacks.values())
    mb = summary["micro_batches"]
    result["chaos"] = {
        "wall_s": time.monotonic() - t0,
        "kills": kills,
        "micro_batches": mb,
        "longest_stall_s": longest_stall(records),
        "resend_s": {
            "count": len(latencies),
            "median": statistics.median(latencies) if latencies else None,
            "max": max(latencies) if latencies else None,
        },
        "events": [
            {
                "stage": e.stage,
                "kind": e.kind,
                "source": e.source,
                "version": e.version,
                "lost_from": e.lost_from,
            }
            for e in events
        ],
        "lost_stage_steps": lost_steps,
        "lost_tokens": lost_steps * spec.optimizer.accumulate * spec.tokens_per_micro_batch,
        "orphans": orphans,
        "replacements": replacements,
        "leftovers": len(demo.leftovers()),
        "eval_loss": final_eval(records),
    }
    result["clean_stall_s"] = longest_stall(read_jsonl(root / f"s{stages}-clean-train" / "metrics.jsonl"))
    print(f"[s{stages}] chaos: {json.dumps(result['chaos'], default=str)[:2000]}", flush=True)
    return result


def render(results: dict[str, Any]) -> str:
    lines = [
        "## Chaos",
        "",
        "`python -m benchmarks.chaos` (results in `benchmarks/results/chaos.json`): "
        f"{results['steps']} trainer steps, a random peer SIGKILLed every ~{results['kill_every_s']:.0f} s and "
        "replaced, and once every replica of the last stage killed at once (the keeper's snapshot brings it back, "
        f"snapshots every {results['snapshot_interval_s']:.0f} s); {results['machine']}.",
        "",
        "| layout | kills | longest stall (clean) | kill to re-send, median / max | micro-batches dropped | "
        "stage steps rolled back (tokens) | processes left (10 s after a kill / at the end) | held-out loss chaos vs clean |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["layouts"]:
        c, k = r["clean"], r["chaos"]
        rs = k["resend_s"]
        resend = (
            "n/a" if rs["median"] is None else f"{rs['median']:.1f} s / {rs['max']:.1f} s ({rs['count']})"
        )
        left = sum(o["left_after_10s"] for o in k["orphans"])
        ratio = (
            f"{k['eval_loss']:.3f} vs {c['eval_loss']:.3f} ({100 * (k['eval_loss'] / c['eval_loss'] - 1):+.1f}%)"
            if k["eval_loss"] and c["eval_loss"]
            else "n/a"
        )
        lines.append(
            f"| {r['stages']} x {r['peers_per_stage']} | {len(k['kills'])} | {k['longest_stall_s']:.1f} s "
            f"({r['clean_stall_s']:.1f} s) | {resend} | {k['micro_batches']['dropped']} of "
            f"{k['micro_batches']['opened']} | {k['lost_stage_steps']} ({k['lost_tokens']}) | {left} / "
            f"{k['leftovers']} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--kill-every-s", type=float, default=8.0)
    p.add_argument("--snapshot-interval-s", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--render", action="store_true", help="print the BENCHMARKS.md section from --out")
    p.add_argument(
        "--work-dir", default=None, help="keep the runs' logs and metrics here (default: a temporary dir)"
    )
    args = p.parse_args(argv)
    if args.render:
        print(render(json.loads(Path(args.out).read_text())))
        return 0
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")
    from swarm.network import SOCKET_PREFIX_ENV
    from swarm.processes import child_socket_prefix

    os.environ.setdefault(SOCKET_PREFIX_ENV, child_socket_prefix("chaos"))
    results = {
        "steps": args.steps,
        "kill_every_s": args.kill_every_s,
        "snapshot_interval_s": args.snapshot_interval_s,
        "seed": args.seed,
        "machine": f"{os.cpu_count()} CPU cores, Python {sys.version.split()[0]}",
        "layouts": [],
    }
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        if args.work_dir:
            tmp = args.work_dir
            Path(tmp).mkdir(parents=True, exist_ok=True)
        for stages in args.stages:
            results["layouts"].append(
                run_layout(
                    stages,
                    steps=args.steps,
                    kill_every_s=args.kill_every_s,
                    snapshot_interval_s=args.snapshot_interval_s,
                    seed=args.seed,
                    root=Path(tmp),
                )
            )
            Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
