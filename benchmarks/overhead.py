"""Where the cycles go: CPU seconds per 1,000 trained tokens, by process and thread, swarm vs torch pipelining.

Run (from the repository root; loopback, no root needed)::

    python -m benchmarks.overhead            # bench model (examples/bench.yaml): ~6 min on 2 cores
    python -m benchmarks.overhead --quick    # the links benchmark's --quick model: ~3 min
    python -m benchmarks.overhead --render   # rewrite the BENCHMARKS.md section from the JSON

The unshaped link benchmark (BENCHMARKS.md "Links") has the swarm behind torch pipelining on this
machine. Tokens/s there depend on the load; CPU seconds per token much less so, and on 2 shared cores
CPU is what a CPU-bound run spends its time on. So this benchmark counts, from ``/proc``, the CPU time
of every process of a run and of every thread in it:

- the swarm: per stage peer its compute thread, its event loop (main thread), its executor threads
  (``asyncio_*``: decoding, DHT calls), its rounds thread, the hivemind DHT/averager child processes
  and the p2pd daemon; the trainer (with its children); the bootstrap node (``swarm init``);
- torch pipelining (1F1B over gloo): each rank.

Note "marginal CPU": every configuration runs twice, with ``short_mb`` and ``long_mb`` micro-batches;
the figures are the *difference* between the two runs over the difference in tokens. Start-up
(imports, model build, DHT join), warm-up and shutdown cancel out, and what is left is the cost of
training one more token in steady state.

Thread names come from ``py-spy dump`` (``pip install py-spy``), taken once per process while it
trains; without py-spy every thread of a process is counted under the process. With ``--spy`` the
stage peers are also sampled by ``py-spy record``, and the samples of their compute threads are sorted
into kinds of work (the "Profile" table: forward/backward, optimizer, codec, other).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.links import Job, LinksConfig, _run_job, pipelining_spec, quick_config
from benchmarks.markdown import write_section
from benchmarks.netlab import LoopbackLab
from benchmarks.pipelining_baseline import ROOT
from benchmarks.report import machine_info

__all__ = ["OverheadConfig", "ThreadSampler", "role_of", "marginal", "markdown_section", "main"]

RESULTS = ROOT / "benchmarks" / "results" / "overhead.json"
SECTION = "## Where the cycles go"
_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass
class OverheadConfig:
    quick: bool = False
    short_mb: int = 24
    """Micro-batches of the shorter run of each pair (note "marginal CPU")."""
    long_mb: int = 72
    codec: str = "blockwise8"
    mode: str = "async"
    spy: bool = False
    """Also sample the stage peers with ``py-spy record`` (the "Profile" table)."""
    links: dict[str, Any] = field(default_factory=dict)
    """LinksConfig fields to override."""


# ------------------------------------------------------------------------------ /proc accounting


def _cpu_s(stat: str) -> float:
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLK  # utime + stime


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
        text = _read(f"/proc/{pid}/task/{tid}/children")
        if text:
            out += [int(c) for c in text.split()]
    return out


def role_of(cmdline: str, top: str | None) -> str:
    """The role of a process from its command line and that of its top-level ancestor (pure).

    ``top`` is None for a direct child of the benchmark: ``peer 2``, ``trainer``, ``bootstrap``,
    ``rank 1``; its descendants are ``<top> / p2pd`` or ``<top> / children`` (hivemind's DHT and
    averager processes).
    """
    words = cmdline.split()
    if top is not None:
        return f"{top} / p2pd" if words and words[0].endswith("p2pd") else f"{top} / children"
    if "--rank" in words:
        return f"rank {words[words.index('--rank') + 1]}"
    if "peer" in words and "--stage" in words:
        return f"peer {words[words.index('--stage') + 1]}"
    if "train" in words:
        return "trainer"
    if "init" in words:
        return "bootstrap"
    return "other"


class ThreadSampler:
    """Polls the CPU time of every thread of every descendant of this process (keeps each thread's
    largest value, so threads and processes that exit keep their time)."""

    def __init__(self, interval_s: float = 0.5, spy_dir: Path | None = None):
        self.interval_s = interval_s
        self.cpu: dict[tuple[int, int], float] = {}
        self.role: dict[int, str] = {}
        self.names: dict[int, str] = {}  # tid -> thread name (py-spy dump)
        self._dumped: set[int] = set()
        self._seen_at: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="overhead-sampler", daemon=True)
        self._py_spy = shutil.which("py-spy") or _venv_tool("py-spy")
        self.spy_dir = spy_dir
        self._spies: list[subprocess.Popen] = []

    def start(self) -> ThreadSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for spy in self._spies:
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        todo = [(c, None) for c in _children(os.getpid())]
        while todo:
            pid, top = todo.pop()
            cmd = (_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ")
            if not cmd:
                continue
            role = self.role.setdefault(pid, role_of(cmd, top))
            if role == "other":
                continue
            self._threads(pid)
            if top is None:
                self._name_threads(pid, role)
            todo += [(c, top or role) for c in _children(pid)]

    def _threads(self, pid: int) -> None:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return
        for tid in tids:
            stat = _read(f"/proc/{pid}/task/{tid}/stat")
            if stat:
                key = (pid, int(tid))
                self.cpu[key] = max(self.cpu.get(key, 0.0), _cpu_s(stat))

    def _name_threads(self, pid: int, role: str) -> None:
        """Name the threads of a top-level process once it has run a while (its threads exist)."""
        first = self._seen_at.setdefault(pid, time.monotonic())
        if self._py_spy is None or pid in self._dumped or time.monotonic() - first < 25.0:
            return
        self._dumped.add(pid)
        try:
            out = subprocess.run(
                [self._py_spy, "dump", "--pid", str(pid), "--json", "--nonblocking"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout
            for t in json.loads(out or "[]"):
                self.names[int(t["os_thread_id"])] = str(t.get("thread_name") or "?")
        except (subprocess.SubprocessError, ValueError, KeyError, OSError):
            return
        if self.spy_dir is not None and role.startswith("peer"):
            path = self.spy_dir / f"{role.replace(' ', '')}.txt"
            self._spies.append(
                subprocess.Popen(
                    [self._py_spy, "record", "--pid", str(pid), "--rate", "20", "--format", "raw"]
                    + ["--threads", "--nonblocking", "--output", str(path), "--duration", "600"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )

    def totals(self) -> dict[str, float]:
        """CPU seconds by ``role`` and, where a thread name is known, ``role: thread``."""
        out: dict[str, float] = defaultdict(float)
        for (pid, tid), s in self.cpu.items():
            role = self.role.get(pid, "other")
            if "/" not in role:
                role = f"{role}: {thread_kind(self.names.get(tid))}"
            out[role] += s
        return dict(out)


def thread_kind(name: str | None) -> str:
    """Group thread names into kinds (pure): ``asyncio_3`` -> ``executor``."""
    if name is None:
        return "threads"
    if name.startswith("asyncio_"):
        return "executor"
    if name.startswith("replica-rounds"):
        return "rounds"
    if name in ("MainThread", "stage-compute"):
        return "event loop" if name == "MainThread" else "compute"
    return "other threads"


def _venv_tool(name: str) -> str | None:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else None


# ------------------------------------------------------------------------------ the machine

_MATMUL = """
import time, torch
torch.set_num_threads(1)
a, w = torch.randn(1024, 512), torch.randn(512, 2048)
for _ in range(3):
    a @ w
t0, c0, n = time.perf_counter(), time.process_time(), 0
while time.perf_counter() - t0 < {seconds}:
    a @ w
    n += 1
print(n / (time.process_time() - c0), n / (time.perf_counter() - t0))
"""


def parallel_efficiency(seconds: float = 4.0) -> dict[str, float]:
    """Single-threaded matmuls per CPU second with one process alone and with one process per core at
    once. On a VM whose vCPUs share physical cores or memory bandwidth the second is lower: the same
    compute then costs more CPU seconds when every core is busy (as in an async swarm) than when one
    is (as in a pipeline that waits)."""
    code = _MATMUL.format(seconds=seconds)

    def run(n: int) -> list[list[float]]:
        procs = [
            subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
            for _ in range(n)
        ]
        return [[float(x) for x in p.communicate(timeout=120)[0].split()] for p in procs]

    alone = run(1)[0]
    cores = os.cpu_count() or 1
    together = run(cores)
    per_cpu_s = sum(r[0] for r in together) / cores
    return {
        "alone_per_cpu_s": alone[0],
        "alone_per_s": alone[1],
        "all_cores_per_cpu_s": per_cpu_s,
        "all_cores_per_s_total": sum(r[1] for r in together),
        "efficiency": per_cpu_s / alone[0],
        "cores": cores,
    }


# ------------------------------------------------------------------------------ runs


def _run(
    cfg: OverheadConfig, lcfg: LinksConfig, job: Job, work: Path, spy_dir: Path | None
) -> dict[str, Any]:
    nodes = {"boot": "boot", "trainer": "trainer", "stages": [f"s{i}" for i in range(8)]}
    sampler = ThreadSampler(spy_dir=spy_dir).start()
    try:
        with LoopbackLab(["boot", "trainer", *nodes["stages"]]) as lab:
            base = _base_spec(lcfg, work)
            threads = lcfg.threads or max(1, (os.cpu_count() or 1) // 4)
            result = _run_job(lab, lcfg, job, work, nodes, base, threads)
    finally:
        sampler.stop()
    sampler.sample()
    tokens = _tokens(result)
    return {
        "job": job.name,
        "micro_batches": job.micro_batches,
        "tokens": tokens,
        "cpu_s": sampler.totals(),
        "tokens_per_s": result.get("tokens_per_s"),
    }


def _base_spec(lcfg: LinksConfig, work: Path) -> Path:
    """The pipelining ranks' spec file (links.pipelining_spec). Each run of a pair has its own ``work``,
    so its keeper's snapshots (links.run_swarm keeps them there) never meet the other run's."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / "base.json"
    path.write_bytes(pipelining_spec(lcfg).canonical_bytes())
    return path


def _tokens(result: dict[str, Any]) -> int:
    if result.get("tokens"):
        return int(result["tokens"])
    losses = result.get("losses") or []
    return int(losses[-1]["tokens"]) if losses else 0


def marginal(short: dict[str, Any], long: dict[str, Any]) -> dict[str, Any]:
    """CPU seconds per 1,000 tokens of the tokens the long run trained beyond the short one (pure)."""
    dt = long["tokens"] - short["tokens"]
    if dt <= 0:
        raise ValueError(
            f"the long run trained {long['tokens']} tokens, not more than the short {short['tokens']}"
        )
    a, b = _same_rows(short["cpu_s"], long["cpu_s"]), _same_rows(long["cpu_s"], short["cpu_s"])
    keys = sorted(set(a) | set(b))
    per = {k: 1000.0 * (b.get(k, 0.0) - a.get(k, 0.0)) / dt for k in keys}
    return {"tokens": dt, "cpu_s_per_ktok": per, "total": sum(per.values())}


def _same_rows(cpu_s: dict[str, float], other: dict[str, float]) -> dict[str, float]:
    """``cpu_s`` with the threads of a process summed into ``<process>: all threads`` where the two runs
    did not name that process's threads alike (py-spy named them in one run only, e.g. a process that
    ended before it was dumped), so that a difference is never taken between differently named rows."""

    def kinds(d: dict[str, float], proc: str) -> set[str]:
        return {k for k in d if k.partition(": ")[0] == proc and ": " in k}

    out: dict[str, float] = defaultdict(float)
    for k, v in cpu_s.items():
        proc = k.partition(": ")[0]
        theirs = kinds(other, proc)
        if ": " in k and theirs and kinds(cpu_s, proc) != theirs:
            k = f"{proc}: all threads"
        out[k] += v
    return dict(out)


def run_all(cfg: OverheadConfig) -> dict[str, Any]:
    lcfg = (
        quick_config(loopback=True, rates=("none",))
        if cfg.quick
        else LinksConfig(loopback=True, rates=("none",))
    )
    lcfg = dataclasses.replace(lcfg, **cfg.links)
    out: dict[str, Any] = {"config": asdict(cfg), "machine": machine_info(), "runs": {}}
    out["parallel"] = parallel_efficiency()
    print(
        f"machine: matmul CPU efficiency with every core busy = {out['parallel']['efficiency']:.2f}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        for kind in ("swarm", "pipelining"):
            pair = []
            for mb in (cfg.short_mb, cfg.long_mb):
                lcfg = dataclasses.replace(lcfg, throughput_mb=mb)
                job = (
                    Job(
                        kind="swarm",
                        codec=cfg.codec,
                        mode=cfg.mode,
                        micro_batches=mb,
                        purposes=("throughput",),
                    )
                    if kind == "swarm"
                    else Job(kind="pipelining", schedule="1f1b", micro_batches=mb, purposes=("throughput",))
                )
                spy_dir = (
                    RESULTS.parent / "overhead_spy"
                    if cfg.spy and kind == "swarm" and mb == cfg.long_mb
                    else None
                )
                if spy_dir is not None:
                    spy_dir.mkdir(parents=True, exist_ok=True)
                print(f"{job.name}: {mb} micro-batches ...", flush=True)
                r = _run(cfg, lcfg, job, Path(tmp) / f"{kind}-{mb}", spy_dir)
                print(f"    {r['tokens']} tokens, {r['tokens_per_s'] or 0:.0f} tokens/s", flush=True)
                pair.append(r)
            out["runs"][kind] = {"short": pair[0], "long": pair[1], "marginal": marginal(*pair)}
    if cfg.spy:
        out["profile"] = profile_table(RESULTS.parent / "overhead_spy")
    return out


# ------------------------------------------------------------------------------ py-spy samples

_KINDS = (
    ("backward", ("StageModule.backward", "_engine_run_backward")),
    ("optimizer step", ("StageOptimizer.",)),
    ("codec encode/decode", ("compression/",)),
    ("forward", ("StageModule.forward", "Block.forward")),
    ("stash and queue", ("peer/stash", "peer/runtime", "peer/compute")),
)


def classify(stack: Sequence[str]) -> str:
    """The kind of work of one sampled stack of a compute thread, from its frames (pure)."""
    for kind, marks in _KINDS:
        if any(m in frame for frame in stack for m in marks):
            return kind
    return "other"


def profile_table(spy_dir: Path) -> dict[str, dict[str, float]]:
    """Share of each kind of work in the compute threads' samples, per peer."""
    out: dict[str, dict[str, float]] = {}
    for path in sorted(spy_dir.glob("peer*.txt")):
        counts: Counter[str] = Counter()
        for line in path.read_text().splitlines():
            if "stage-compute" not in line.split(";", 1)[0]:
                continue
            stack, n = line.rsplit(" ", 1)
            counts[classify(stack.split(";")[1:])] += int(n)
        total = sum(counts.values()) or 1
        out[path.stem] = {k: n / total for k, n in counts.most_common()}
    return out


# ------------------------------------------------------------------------------ report


def _group(per: dict[str, float]) -> dict[str, float]:
    """Sum the per-peer/per-rank rows by kind: ``peers: compute``, ``peers / p2pd`` ... (pure)."""
    out: dict[str, float] = defaultdict(float)
    for k, v in per.items():
        head, _, rest = k.partition(" / ") if " / " in k else k.partition(": ")
        sep = " / " if " / " in k else ": "
        if head.startswith("peer "):
            head = "stage peers"
        elif head.startswith("rank "):
            head = "ranks"
        out[f"{head}{sep}{rest}" if rest else head] += v
    return dict(out)


def markdown_section(report: dict[str, Any]) -> str:
    swarm = report["runs"]["swarm"]["marginal"]
    pipe = report["runs"]["pipelining"]["marginal"]
    cfg = report["config"]
    lines = [
        SECTION,
        "",
        f'CPU seconds per 1,000 trained tokens in steady state (note "marginal CPU" in benchmarks/overhead.py: '
        f"runs of {cfg['short_mb']} and {cfg['long_mb']} micro-batches, the difference over the difference in "
        f"tokens), loopback, {'the --quick model' if cfg['quick'] else 'examples/bench.yaml'}; swarm "
        f"{cfg['codec']} {cfg['mode']}, one peer per stage; torch pipelining 1F1B over gloo. "
        f"Machine: {report['machine'].get('cpu_count', '?')} cores, load average at the start "
        f"{report['machine'].get('load_start', '?')}.",
        "",
        "| process: thread | swarm | torch pipelining 1F1B |",
        "|---|---|---|",
    ]
    gs, gp = _group(swarm["cpu_s_per_ktok"]), _group(pipe["cpu_s_per_ktok"])
    for k in sorted(set(gs) | set(gp), key=lambda k: -(gs.get(k, 0.0) + gp.get(k, 0.0))):
        lines.append(f"| {k} | {_cell(gs.get(k))} | {_cell(gp.get(k))} |")
    lines.append(f"| **all** | **{swarm['total']:.3f}** | **{pipe['total']:.3f}** |")
    compute = gs.get("stage peers: compute")
    if compute:
        lines += [
            "",
            f"The swarm spends {swarm['total'] / compute:.2f}x its compute threads' CPU per token in all, and "
            f"{swarm['total'] / pipe['total']:.2f}x the CPU per token of torch pipelining; on a machine whose "
            "cores all stage processes share, tokens/s can be at most about the inverse of that ratio.",
        ]
    par = report.get("parallel")
    if par:
        lines += [
            "",
            f"Machine check (note in `parallel_efficiency`): one single-threaded matmul process alone does "
            f"{par['alone_per_cpu_s']:.1f} matmuls per CPU second; {par['cores']} at once (one per core) "
            f"{par['all_cores_per_cpu_s']:.1f} each, {par['efficiency']:.2f} of that, and "
            f"{par['all_cores_per_s_total'] / par['alone_per_s']:.2f}x one process's rate together.",
        ]
        for kind in ("swarm", "pipelining"):
            r = report["runs"][kind]["long"]
            used = (r.get("tokens_per_s") or 0.0) * report["runs"][kind]["marginal"]["total"] / 1000.0
            lines.append(
                f"- {kind}: {r.get('tokens_per_s') or 0:.0f} tokens/s in the long run, about {used:.2f} cores busy."
            )
    if report.get("profile"):
        lines += ["", "Compute threads of the stage peers, share of py-spy samples by kind of work:", ""]
        kinds = sorted({k for d in report["profile"].values() for k in d})
        lines += ["| peer | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
        for peer, d in report["profile"].items():
            lines.append(f"| {peer} | " + " | ".join(f"{100 * d.get(k, 0.0):.1f}%" for k in kinds) + " |")
    if report.get("reading"):
        lines += ["", report["reading"].rstrip()]
    from benchmarks.timeline import section_block  # the idle-time block (benchmarks/timeline.py)

    block = section_block()
    if block:
        lines += ["", block.rstrip()]
    return "\n".join(lines) + "\n"


def _cell(v: float | None) -> str:
    return "-" if v is None or abs(v) < 0.0005 else f"{v:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="the links benchmark's --quick model")
    p.add_argument("--short-mb", type=int, default=None)
    p.add_argument("--long-mb", type=int, default=None)
    p.add_argument("--spy", action="store_true", help="also sample the stage peers with py-spy record")
    p.add_argument("--render", action="store_true", help="rewrite the BENCHMARKS.md section from the JSON")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--no-markdown", action="store_true")
    args = p.parse_args(argv)
    if args.render:
        report = json.loads(args.out.read_text())
        for run in report["runs"].values():  # recomputed: the JSON keeps each run's raw counters
            run["marginal"] = marginal(run["short"], run["long"])
        reading = ROOT / "benchmarks" / "results" / "overhead_reading.md"
        if reading.exists():
            report["reading"] = reading.read_text()
        write_section(markdown_section(report))
        return 0
    cfg = OverheadConfig(quick=args.quick, spy=args.spy)
    if args.quick:
        cfg.short_mb, cfg.long_mb = 16, 48
    cfg.short_mb = args.short_mb or cfg.short_mb
    cfg.long_mb = args.long_mb or cfg.long_mb
    if cfg.long_mb <= cfg.short_mb:
        p.error(f"--long-mb {cfg.long_mb} must be larger than --short-mb {cfg.short_mb}")
    t0 = time.time()
    report = run_all(cfg)
    report["wall_s"] = time.time() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(markdown_section(report))
    if not args.no_markdown:
        write_section(markdown_section(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
