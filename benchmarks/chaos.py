"""Chaos benchmark: random SIGKILLs of stage peers while a trainer runs, against a fault-free run.

Run (from the repository root)::

    python -m benchmarks.chaos                       # 2 stages x 2 peers, then 4 x 2: results/chaos.json
    python -m benchmarks.chaos --stages 2            # one layout only
    python -m benchmarks.chaos --render              # print the BENCHMARKS.md section from results/chaos.json

What runs, per layout (``swarm.tools.demo.Demo`` on loopback: a bootstrap with a keeper, ``swarm peer``
processes; the trainer is a process of its own, ``--trainer-worker``, so that it can be SIGKILLed):

1. a fault-free run of ``--steps`` trainer steps, then the held-out loss;
2. the same run with chaos: every ``--kill-every-s`` seconds (jittered) one random peer of a stage
   that still has a live stage-mate is killed with SIGKILL (the peer process only, as a crash would:
   its hivemind DHT process, averager and p2pd must exit by themselves) and a fresh peer is started
   for its stage; once, a third of the way through (once the keeper holds a snapshot), *every* replica
   of the last stage is killed at once and two fresh peers are started: they find no live replica and
   restore the keeper's snapshot (until then that stage is spared by the single kills, so that it is
   whole when the wipe is due); once the trainer has recorded half its steps, the *trainer* is
   SIGKILLed and a new trainer process continues it with ``TrainerConfig(resume=True)`` (what
   ``swarm train --resume OUT`` builds). No peer is killed while the resumed trainer has not completed
   a micro-batch yet.

Figures (each from the trainer's metrics file, its events, the peers' logs and the run's DHT records;
times on the machine's monotonic clock, which the trainer processes share):

- longest stall: the longest time between two consecutive completed trainer steps after the first
  (a step completes ``accumulate`` micro-batches; this bounds the time without a completed micro-batch),
  not counting the gap across the trainer kill (reported on its own);
- kill to re-send: for each killed peer, the time from the SIGKILL to each of its micro-batches'
  failure event (the trainer re-sends a micro-batch right there; median and max over micro-batches);
- micro-batches dropped (given up after ``max_attempts``), attempts failed;
- training lost: stage steps rolled back by the wipe (``StageEvent.lost_versions``), in tokens;
- processes left behind: live processes of a killed peer's (or trainer's) process group 10 s after its
  SIGKILL, and of every group after the demo shut down;
- trainer kill: the step it was killed at and the step and tokens the resumed trainer continued from,
  the time from the kill to the resumed trainer's first completed micro-batch (and to its setup:
  process start, imports, DHT join), stash entries the peers dropped for the dead trainer and when
  (their logs), stash entries left at the end and stash expiries (the peers' stop lines);
- held-out loss of the chaos run vs the fault-free run at equal tokens.

Replacement peers are recorded with how long they took to come online, or why they did not (a
replacement still starting when the run ends is recorded as pending, with its log's tail);
``--work-dir`` keeps every log.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "chaos.json"
REPO = Path(__file__).resolve().parent.parent

SPEC = {
    "run_id": "chaos",
    "model": {"vocab_size": 256, "d_model": 32, "n_layers": 4, "n_heads": 2, "seq_len": 32},
    "codecs": {"activations": "blockwise8", "gradients": "blockwise8"},
    "optimizer": {"lr": 1e-2, "max_versions": 16, "accumulate": 4},
    "averaging": {},
    "micro_batch_size": 4,
}


def make_spec(stages: int, run_id: str):  # type: ignore[no-untyped-def]
    from swarm.run.spec import RunSpec

    return RunSpec.from_dict(SPEC | {"stages": stages, "run_id": run_id})


def make_demo(spec, out: Path, *, snapshot_interval_s: float):  # type: ignore[no-untyped-def]
    from swarm.tools.demo import Demo, DemoConfig
    from swarm.tools.keeper import KeeperConfig

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


def trainer_config(maddr: str, run_id: str, out: Path, steps: int, *, resume: bool):  # type: ignore[no-untyped-def]
    """What the benchmark's trainer runs with (the resumed one too: ``resume=True`` is what
    ``swarm train --resume OUT`` builds)."""
    from swarm.train.trainer import TrainerConfig

    return TrainerConfig(
        initial_peers=(maddr,),
        run_id=run_id,
        steps=steps,
        out_dir=str(out),
        max_inflight=4,
        eval_every=steps,
        eval_batches=4,
        seed=0,
        quiet=True,
        refresh_every_s=0.5,
        max_attempts=8,
        resume=resume,
    )


def trainer_worker(config_path: str) -> int:
    """``--trainer-worker FILE``: one trainer process (SIGKILLed and resumed by the chaos run).

    A ``Trainer`` that also writes two events the benchmark reads: ``bench_clock`` (this session's
    ``started``, on the machine-wide monotonic clock: a record's time + started = when it happened, and
    its p2p peer id) and ``first_completed`` (when this session's first training micro-batch completed)."""
    from swarm.train.trainer import Trainer

    c = json.loads(Path(config_path).read_text())

    class BenchTrainer(Trainer):
        def _setup(self, link, data) -> None:  # type: ignore[no-untyped-def]
            super()._setup(link, data)
            self._first_done = False
            self._event(
                "bench_clock",
                started=self.started,
                monotonic=self._clock(),
                peer_id=link.peer_id,
                pid=os.getpid(),
            )

        def _completed(self, attempt, mb) -> None:  # type: ignore[no-untyped-def]
            super()._completed(attempt, mb)
            if mb.kind == "train" and not self._first_done:
                self._first_done = True
                self._event("first_completed", monotonic=self._clock(), step=self.step)

    config = trainer_config(c["maddr"], c["run_id"], Path(c["out"]), c["steps"], resume=c["resume"])
    summary = BenchTrainer(config).train()
    return 0 if summary.get("micro_batches", {}).get("completed", 0) > 0 else 1


@dataclass
class TrainerProcess:
    popen: subprocess.Popen
    log_file: Any
    spawned: float  # monotonic
    resume: bool
    killed: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid


def spawn_trainer(demo, out: Path, steps: int, *, resume: bool) -> TrainerProcess:  # type: ignore[no-untyped-def]
    """Start the trainer as its own process (its own process group, like a peer)."""
    from swarm.dht.processes import SOCKET_PREFIX_ENV

    tag = "resume" if resume else "first"
    cfg_path = out.parent / f"{out.name}-{tag}.json"
    cfg_path.write_text(
        json.dumps(
            {
                "maddr": demo.maddr,
                "run_id": demo.spec.run_id,
                "out": str(out),
                "steps": steps,
                "resume": resume,
            }
        )
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env[SOCKET_PREFIX_ENV] = demo.socket_prefix  # what a SIGKILL leaves, demo.shutdown removes
    env.setdefault("HIVEMIND_LOGLEVEL", "ERROR")
    env.setdefault("OMP_NUM_THREADS", "1")  # the trainer computes no layers; the peers need the cores
    env.setdefault("MKL_NUM_THREADS", "1")
    log_file = open(out.parent / f"{out.name}-{tag}.log", "wb")  # noqa: SIM115 (closed at the end)
    popen = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.chaos", "--trainer-worker", str(cfg_path)],
        cwd=str(REPO),
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    demo.pgids.append(popen.pid)  # demo.leftovers() and demo.shutdown() cover the trainer too
    return TrainerProcess(popen=popen, log_file=log_file, spawned=time.monotonic(), resume=resume)


def check_trainer(rc: int, out: Path) -> None:
    """A trainer that failed is the benchmark's failure, with the end of its log."""
    if rc != 0 or not (out / "summary.json").is_file():
        logs = sorted(out.parent.glob(f"{out.name}-*.log"))
        tail = "\n".join(logs[-1].read_text(errors="replace").splitlines()[-30:]) if logs else ""
        raise RuntimeError(f"the trainer writing {out} exited with code {rc}; its log ends with:\n{tail}")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file; a line a SIGKILLed trainer left half-written is skipped."""
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def with_monotonic(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each record with ``mono``: when it happened on the machine's monotonic clock (a resumed session's
    record times continue the earlier session's, so each session's ``bench_clock`` gives its base)."""
    base = None
    out = []
    for r in records:
        if r.get("type") == "event" and r.get("event") == "bench_clock":
            base = r["started"]
        if base is not None and isinstance(r.get("time"), (int, float)):
            out.append(dict(r, mono=base + r["time"]))
    return out


def current_step(path: Path) -> int:
    steps = [r["step"] for r in read_jsonl(path) if r.get("type") == "step"]
    return steps[-1] if steps else 0


def final_eval(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    evals = [r for r in records if r.get("type") == "eval"]
    return evals[-1] if evals else None


def stalls(records: list[dict[str, Any]], *, skip: list[float] = ()) -> tuple[float, float | None]:
    """The longest time between two consecutive completed trainer steps (monotonic), leaving out the
    gaps that contain a time of ``skip`` (a trainer kill); and the longest of those left out."""
    times = [r["mono"] for r in records if r.get("type") == "step"]
    kept, skipped = [], []
    for a, b in zip(times, times[1:], strict=False):
        (skipped if any(a <= t <= b for t in skip) else kept).append(b - a)
    return max(kept, default=0.0), max(skipped) if skipped else None


def resend_latencies(kills: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[float]:
    """Per killed peer, the delay from its SIGKILL to each failure event that names it."""
    failures = [r for r in records if r.get("type") == "event" and r.get("event") == "attempt_failed"]
    out = []
    for k in kills:
        later = [
            f["mono"] - k["mono"] for f in failures if f.get("peer") == k["peer"] and f["mono"] >= k["mono"]
        ]
        out.extend(later)
    return out


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_DROPPED = re.compile(r"trainer (\S+): dropped (\d+) stashed micro-batch")
_STOPPING = re.compile(r"peer \S+ stopping: stash (\d+),(?: version \d+,)? counters (\{.*\})")


def peer_log_figures(logs: Path, dead_trainer: str | None, killed_at_wall: float | None) -> dict[str, Any]:
    """From the peers' logs: stash entries they dropped for the dead trainer (and when, after its kill),
    and what their stop lines say (stash entries left at the end, stash expiries)."""
    drops, left, expired, gone, stopped = [], 0, 0, 0, 0
    for path in sorted(logs.glob("peer-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            m = _DROPPED.search(line)
            if m and dead_trainer is not None and m.group(1) == dead_trainer:
                when = _log_wall(line) if killed_at_wall is not None else None
                drops.append(
                    {
                        "peer_log": path.name,
                        "dropped": int(m.group(2)),
                        "after_kill_s": when - killed_at_wall if when else None,
                    }
                )
            m = _STOPPING.search(line)
            if m:
                stopped += 1
                left += int(m.group(1))
                counters = json.loads(m.group(2))
                expired += int(counters.get("expired", 0))
                gone += int(counters.get("trainer_gone", 0))
    return {
        "dropped_for_dead_trainer": sum(d["dropped"] for d in drops),
        "drops": drops,
        "peers_stopped": stopped,
        "stash_left_at_end": left,
        "stash_expired": expired,
        "trainer_gone_total": gone,
    }


_DHT_UP = re.compile(r"DHT node up after ([\d.]+) s")
_SERVING_LINE = re.compile(r"serving stage \d+ of run")


def _log_wall(line: str) -> float | None:
    t = _LOG_TIME.match(line)
    return datetime.datetime.strptime(t.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if t else None


def replacement_phases(entry: dict[str, Any]) -> dict[str, Any]:
    """A replacement's record with where its time went, from its log: ``process_s`` from the spawn to
    the peer's ``start()`` (interpreter, imports, flags), ``start_s`` from there to serving (DHT, stage,
    averager, state)."""
    out = {k: v for k, v in entry.items() if k not in ("started", "spawned_wall")}
    try:
        lines = Path(entry["log"]).read_text(errors="replace").splitlines()
    except (KeyError, OSError):
        return out
    began = serving = None
    for line in lines:
        m = _DHT_UP.search(line)
        wall = _log_wall(line)
        if m and wall is not None and began is None:
            began = wall - float(m.group(1))
        if _SERVING_LINE.search(line) and wall is not None and serving is None:
            serving = wall
    if began is not None:
        out["process_s"] = began - entry["spawned_wall"]
        if serving is not None:
            out["start_s"] = serving - began
    return out


def run_layout(
    stages: int,
    *,
    steps: int,
    kill_every_s: float,
    snapshot_interval_s: float,
    seed: int,
    root: Path,
    clean_run: bool = True,
):
    rng = random.Random(seed)
    spec = make_spec(stages, f"chaos{stages}")
    result: dict[str, Any] = {"stages": stages, "peers_per_stage": 2, "steps": steps, "spec": spec.to_dict()}

    if clean_run:
        result.update(
            run_clean(spec, stages, steps=steps, snapshot_interval_s=snapshot_interval_s, root=root)
        )
    else:
        result.update(clean=None, clean_stall_s=None)
    result["chaos"] = run_chaos(
        spec,
        stages,
        steps=steps,
        kill_every_s=kill_every_s,
        snapshot_interval_s=snapshot_interval_s,
        rng=rng,
        root=root,
    )
    print(f"[s{stages}] chaos: {json.dumps(result['chaos'], default=str)[:3000]}", flush=True)
    return result


def run_clean(spec, stages: int, *, steps: int, snapshot_interval_s: float, root: Path) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The fault-free run: ``{"clean": ..., "clean_stall_s": ...}``."""
    clean = make_demo(spec, root / f"s{stages}-clean", snapshot_interval_s=snapshot_interval_s)
    clean_out = root / f"s{stages}-clean-train"
    clean_out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        clean.start()
        proc = spawn_trainer(clean, clean_out, steps, resume=False)
        rc = proc.popen.wait(timeout=1800)
        proc.log_file.close()
    finally:
        clean.shutdown()
    check_trainer(rc, clean_out)
    clean_records = with_monotonic(read_jsonl(clean_out / "metrics.jsonl"))
    clean_eval = final_eval(clean_records)
    result: dict[str, Any] = {}
    result["clean"] = {
        "wall_s": time.monotonic() - t0,
        "trainer_rc": rc,
        "micro_batches": json.loads((clean_out / "summary.json").read_text())["micro_batches"],
        "eval_loss": clean_eval["eval_loss"] if clean_eval else None,
        "eval_tokens": clean_eval["tokens"] if clean_eval else None,
        "leftovers": len(clean.leftovers()),
    }
    result["clean_stall_s"] = stalls(clean_records)[0]
    print(f"[s{stages}] clean: {result['clean']}", flush=True)
    return result


def run_chaos(  # type: ignore[no-untyped-def]
    spec,
    stages: int,
    *,
    steps: int,
    kill_every_s: float,
    snapshot_interval_s: float,
    rng: random.Random,
    root: Path,
) -> dict[str, Any]:
    """The run with peer kills, a stage wipe and a trainer kill + resume."""
    from swarm.dht.processes import alive_in_groups, remove_stale_sockets

    demo = make_demo(spec, root / f"s{stages}-chaos", snapshot_interval_s=snapshot_interval_s)
    out = root / f"s{stages}-chaos-train"
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    kills: list[dict[str, Any]] = []
    orphans: list[dict[str, Any]] = []
    replacements: list[dict[str, Any]] = []  # every fresh peer: online, or why not
    fresh: list[asyncio.Task] = []  # orphan watches
    replacing: list[asyncio.Task] = []  # replacement peers coming online
    trainers: list[TrainerProcess] = []
    trainer_kill: dict[str, Any] = {}
    skipped: list[int] = []  # trainer steps at kill times that found no peer to kill (every stage short)
    t0 = time.monotonic()
    try:
        demo.start()
        trainers.append(spawn_trainer(demo, out, steps, resume=False))
        wipe_stage = stages - 1

        def trainer_done() -> bool:
            last = trainers[-1]
            return not last.killed and last.popen.poll() is not None

        def resumed_and_running() -> bool:
            """No trainer kill yet, or the resumed trainer has completed a micro-batch."""
            if not trainer_kill:
                return True
            return any(
                r.get("event") == "first_completed" and r["monotonic"] > trainer_kill["mono"]
                for r in read_jsonl(metrics)
                if r.get("type") == "event"
            )

        def live(stage: int) -> list:
            return [
                p
                for p in demo.peers
                if p.stage == stage and not p.killed and p.popen.poll() is None and p.peer_id
            ]

        async def kill(victim, what: str) -> None:
            # the peer process only: its children must follow by themselves
            os.kill(victim.pid, signal.SIGKILL)
            victim.killed = True
            kills.append(
                {
                    "mono": time.monotonic(),
                    "stage": victim.stage,
                    "peer": victim.peer_id,
                    "what": what,
                    "step": current_step(metrics),
                }
            )
            await asyncio.to_thread(victim.popen.wait)

        async def watch_orphans(pgid: int, who: str) -> None:
            t = time.monotonic()
            while alive_in_groups([pgid]) and time.monotonic() - t < 10.0:
                await asyncio.sleep(0.2)
            orphans.append(
                {"who": who, "left_after_10s": len(alive_in_groups([pgid])), "gone_s": time.monotonic() - t}
            )
            remove_stale_sockets(demo.socket_prefix)

        async def replace(stage: int, name: str) -> None:
            t = time.monotonic()
            entry: dict[str, Any] = {"stage": stage, "name": name, "started": t, "spawned_wall": time.time()}
            replacements.append(entry)
            proc = None
            try:
                proc = demo._spawn_peer(stage, len(demo.peers), suffix=f"-{name}")
                entry["log"] = str(proc.log_path)
                await demo._await_online_async([proc])
                entry["online_s"] = time.monotonic() - t
            except asyncio.CancelledError:  # the run ended first: how long it had been starting, and where
                entry["pending_s"] = time.monotonic() - t
                if proc is not None:
                    entry["log_tail"] = proc.log_tail(15)[-2000:]
                raise
            except Exception as e:  # noqa: BLE001 -- a replacement that never came online is a result
                entry["error"] = f"{type(e).__name__}: {e}"[:2000]

        async def kill_trainer() -> None:
            victim = trainers[-1]
            victim.killed = True
            trainer_kill.update(mono=time.monotonic(), wall=time.time(), step=current_step(metrics))
            os.kill(victim.pid, signal.SIGKILL)  # the trainer process only, as a crash would
            await asyncio.to_thread(victim.popen.wait)
            fresh.append(asyncio.create_task(watch_orphans(victim.pid, "trainer")))
            # a new trainer process continues it: TrainerConfig(resume=True), what `swarm train --resume OUT` runs
            trainers.append(spawn_trainer(demo, out, steps, resume=True))

        async def chaos() -> None:
            while current_step(metrics) < 1 and not trainer_done():
                await asyncio.sleep(0.2)
            wiped = False
            while not trainer_done():
                await asyncio.sleep(kill_every_s * rng.uniform(0.7, 1.3))
                if trainer_done():
                    return
                step = current_step(metrics)
                if not resumed_and_running():
                    continue  # the trainer is restarting: peer kills would have nothing to re-send
                keeper = demo.boot.keeper
                held = keeper.held[wipe_stage]
                if not wiped and step >= steps // 3 and held is not None and held.version > 0:
                    victims = live(wipe_stage)
                    if len(victims) < 2:
                        skipped.append(step)
                        continue  # a replacement is still starting: wipe when the stage is whole again
                    wiped = True
                    for v in victims:
                        await kill(v, "wipe")
                    for v in victims:
                        fresh.append(asyncio.create_task(watch_orphans(v.pid, v.peer_id)))
                        replacing.append(asyncio.create_task(replace(wipe_stage, f"w{len(kills)}")))
                    continue
                # before the wipe its stage is spared, so that it is whole (both replicas online) when due
                choices = [s for s in range(stages) if len(live(s)) >= 2 and (wiped or s != wipe_stage)]
                if not choices:
                    skipped.append(step)
                    continue
                victim = rng.choice(live(rng.choice(choices)))
                await kill(victim, "single")
                fresh.append(asyncio.create_task(watch_orphans(victim.pid, victim.peer_id)))
                replacing.append(asyncio.create_task(replace(victim.stage, f"f{len(kills)}")))

        async def trainer_monkey() -> None:
            """SIGKILL the trainer once it has recorded half its steps (polled, not on the kill ticks: a
            fast layout runs 60 steps in a few ticks)."""
            while not trainer_done():
                if current_step(metrics) >= steps // 2:
                    await kill_trainer()
                    return
                await asyncio.sleep(0.1)

        async def main() -> int:
            monkeys = [asyncio.get_running_loop().create_task(c()) for c in (chaos, trainer_monkey)]
            deadline = time.monotonic() + 1800
            try:
                while not trainer_done():
                    for monkey in monkeys:
                        if monkey.done() and monkey.exception() is not None:
                            raise monkey.exception()  # a broken chaos loop must not pass silently
                    if time.monotonic() > deadline:
                        raise TimeoutError("the chaos run's trainer did not finish within 1800 s")
                    await asyncio.sleep(0.2)
                return trainers[-1].popen.returncode
            finally:
                for monkey in monkeys:
                    monkey.cancel()
                await asyncio.gather(*monkeys, return_exceptions=True)
                for task in replacing:  # replacements still starting: recorded as pending
                    task.cancel()
                await asyncio.gather(*fresh, *replacing, return_exceptions=True)

        rc = asyncio.run(main())
        events = demo.boot.membership.events()
    finally:
        demo.shutdown()
        for tp in trainers:
            tp.log_file.close()
    check_trainer(rc, out)
    records = with_monotonic(read_jsonl(metrics))
    clocks = [r for r in records if r.get("event") == "bench_clock"]
    mono0 = clocks[0]["started"] if clocks else t0
    for k in kills:
        k["time"] = k["mono"] - mono0
    latencies = resend_latencies(kills, records)
    longest, trainer_gap = stalls(records, skip=[trainer_kill["mono"]] if trainer_kill else [])
    # two fresh peers of the wiped stage may both report the same rollback: count each (stage, lost_from) once
    rollbacks = {(e.stage, e.lost_from): e for e in events if e.kind == "rollback"}
    lost_steps = sum(e.lost_versions or 0 for e in rollbacks.values())
    summary = json.loads((out / "summary.json").read_text())
    steps_recs = [r for r in records if r.get("type") == "step"]
    if trainer_kill:
        before = [r for r in steps_recs if r["mono"] < trainer_kill["mono"]]
        starts = [r for r in records if r.get("event") == "start"]
        resumed = starts[-1] if len(starts) > 1 else {}
        firsts = [
            r
            for r in records
            if r.get("event") == "first_completed" and r["monotonic"] > trainer_kill["mono"]
        ]
        last = before[-1] if before else {}
        trainer_kill.update(
            time=trainer_kill["mono"] - mono0,
            last_step_before=last.get("step"),
            last_tokens_before=last.get("tokens"),
            last_data_position_before=last.get("data_position"),
            dropped_before=last.get("dropped", 0),
            resumed_step=resumed.get("resumed_step"),
            resumed_tokens=resumed.get("resumed_tokens"),
            restart_setup_s=(clocks[-1]["monotonic"] - trainer_kill["mono"]) if len(clocks) > 1 else None,
            kill_to_first_completed_s=(firsts[0]["monotonic"] - trainer_kill["mono"]) if firsts else None,
            outage_stall_s=trainer_gap,
            peers=peer_log_figures(
                demo.logs, clocks[0].get("peer_id") if clocks else None, trainer_kill["wall"]
            ),
        )
    mb = summary["micro_batches"]
    final = final_eval(records)
    return {
        "wall_s": time.monotonic() - t0,
        "trainer_rc": rc,
        "kills": kills,
        "trainer_kill": trainer_kill,
        "micro_batches": mb,  # of the resumed session (the killed one's: trainer_kill.dropped_before)
        "dropped_total": mb.get("dropped", 0) + trainer_kill.get("dropped_before", 0),
        "longest_stall_s": longest,
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
        "replacements": [replacement_phases(r) for r in replacements],
        "skipped_kills": skipped,
        "leftovers": len(demo.leftovers()),
        "eval_loss": final["eval_loss"] if final else None,
        "eval_tokens": final["tokens"] if final else None,
    }


def _fmt(v: float | None, unit: str = " s") -> str:
    return "n/a" if v is None else f"{v:.1f}{unit}"


def render(results: dict[str, Any]) -> str:
    lines = [
        "## Chaos",
        "",
        "`python -m benchmarks.chaos` (results in `benchmarks/results/chaos.json`): "
        f"{results['steps']} trainer steps, a random peer SIGKILLed every ~{results['kill_every_s']:.0f} s and "
        "replaced, once every replica of the last stage killed at once (the keeper's snapshot brings it back, "
        f"snapshots every {results['snapshot_interval_s']:.0f} s), and once, half-way, the trainer SIGKILLed and "
        f"continued with `--resume`; {results['machine']}.",
        "",
        "| layout | peer kills | longest stall (clean) | kill to re-send, median / max | micro-batches dropped | "
        "stage steps rolled back (tokens) | processes left (10 s after a kill / at the end) | held-out loss chaos vs clean |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["layouts"]:
        c, k = r["clean"] or {}, r["chaos"]
        rs = k["resend_s"]
        resend = (
            "n/a" if rs["median"] is None else f"{rs['median']:.1f} s / {rs['max']:.1f} s ({rs['count']})"
        )
        left = sum(o["left_after_10s"] for o in k["orphans"])
        ratio = (
            f"{k['eval_loss']:.3f} vs {c['eval_loss']:.3f} ({100 * (k['eval_loss'] / c['eval_loss'] - 1):+.1f}%)"
            if k["eval_loss"] and c.get("eval_loss")
            else "n/a"
        )
        wipes = sum(1 for x in k["kills"] if x["what"] == "wipe")
        kills = f"{len(k['kills'])}" + (f" ({wipes} in the wipe)" if wipes else " (no wipe)")
        lines.append(
            f"| {r['stages']} x {r['peers_per_stage']} | {kills} | {k['longest_stall_s']:.1f} s "
            f"({_fmt(r['clean_stall_s'])}) | {resend} | {k.get('dropped_total', k['micro_batches']['dropped'])} of "
            f"{r['steps'] * r['spec']['optimizer']['accumulate']} | {k['lost_stage_steps']} ({k['lost_tokens']}) | {left} / "
            f"{k['leftovers']} | {ratio} |"
        )
    for r in results["layouts"]:
        reps = r["chaos"].get("replacements")
        if not reps:
            continue
        online = [x for x in reps if "online_s" in x]
        line = f"{r['stages']} x {r['peers_per_stage']}: {len(online)} of {len(reps)} replacement peers came online"
        if online:
            times = sorted(x["online_s"] for x in online)
            line += f" after {statistics.median(times):.0f} s (median; {times[0]:.0f}-{times[-1]:.0f} s)"
            process = [x["process_s"] for x in online if "process_s" in x]
            start = [x["start_s"] for x in online if "start_s" in x]
            if process and start:
                line += (
                    f", of which {statistics.median(process):.0f} s until the peer's start() (interpreter and imports) "
                    f"and {statistics.median(start):.1f} s joining (DHT, stage, averager, state)"
                )
        pending = [x for x in reps if "pending_s" in x]
        failed = [x for x in reps if "error" in x]
        if pending:
            line += f"; {len(pending)} still starting when the run ended"
        if failed:
            line += f"; {len(failed)} failed: {failed[0]['error'][:200]}"
        skipped = r["chaos"].get("skipped_kills") or []
        if skipped:
            line += f"; {len(skipped)} kill time{'s' if len(skipped) != 1 else ''} found no peer to kill"
        lines += ["", line + "."]
    if any(r["chaos"].get("trainer_kill") for r in results["layouts"]):
        lines += [
            "",
            "Trainer kill + resume (`Trainer` with `resume=True`, what `swarm train --resume OUT` runs):",
            "",
            "| layout | killed at step | resumed at step (tokens) | kill to first completed micro-batch (trainer back up) | "
            "time without a step across it | stash entries peers dropped for the dead trainer (after the kill) | "
            "stash left at the end / expired | trainer processes left 10 s after |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in results["layouts"]:
            tk = r["chaos"].get("trainer_kill")
            if not tk:
                continue
            peers = tk["peers"]
            after = [d["after_kill_s"] for d in peers["drops"] if d["after_kill_s"] is not None]
            when = f" ({min(after):.1f}-{max(after):.1f} s)" if after else ""
            left = sum(o["left_after_10s"] for o in r["chaos"]["orphans"] if o["who"] == "trainer")
            lines.append(
                f"| {r['stages']} x {r['peers_per_stage']} | {tk['step']} (recorded {tk['last_step_before']}, "
                f"{tk['last_tokens_before']} tokens) | {tk['resumed_step']} ({tk['resumed_tokens']}) | "
                f"{_fmt(tk['kill_to_first_completed_s'])} ({_fmt(tk['restart_setup_s'])}) | {_fmt(tk['outage_stall_s'])} | "
                f"{peers['dropped_for_dead_trainer']}{when} | {peers['stash_left_at_end']} / {peers['stash_expired']} | {left} |"
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
    p.add_argument(
        "--chaos-only",
        action="store_true",
        help="skip the fault-free runs (to look into the chaos run; no comparison)",
    )
    p.add_argument("--trainer-worker", default=None, metavar="FILE", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trainer_worker:
        return trainer_worker(args.trainer_worker)
    if args.render:
        print(render(json.loads(Path(args.out).read_text())))
        return 0
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")
    from swarm.dht.processes import SOCKET_PREFIX_ENV, child_socket_prefix

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
                    clean_run=not args.chaos_only,
                )
            )
            Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
