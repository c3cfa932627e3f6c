# ~490 lines (over ~400): the runs, the theory and the report of one benchmark share its config and rows.
"""Pipeline bubbles, shown honestly: GPipe, 1F1B and the swarm's sync and async modes with emulated compute.

On this machine every stage process shares 2 cores, so a synchronous schedule's idle bubbles are
filled by the other stages' work and the asynchronous schedule's advantage on real accelerators does
not show. Here each micro-batch *occupies* a stage for a fixed time instead: F ms forward, B ms
backward (``--emulate-compute-ms F,B``), slept after the real compute of a tiny model -- the stage
peers' ``PeerConfig.emulate_compute_s`` (note "emulated compute" in ``peer/compute.py``) and
``benchmarks/busy.py`` around torch pipelining's stages, the same rule on both sides. Sleeping
leaves the CPU free, as a GPU kernel would, so a stage is busy exactly while it holds a micro-batch.

For S stages and M micro-batches per optimizer step, a synchronous schedule (GPipe, 1F1B, the
swarm's ``mode: sync``) idles each stage for the fraction (S-1)/(M+S-1) of a step: its efficiency,
tokens/s over the ideal ``tokens per micro-batch / (F+B)`` of one always-busy stage, is at most
M/(M+S-1). The asynchronous swarm fills the pipeline once per run and then has no bubble: 1 in
steady state (n/(n+S-1) over a whole run of n micro-batches).

Measured per run: tokens/s (steady: after the first step; the baseline's median step, the swarm's
tokens from its first step's end to its last) and each stage's utilisation, its own busy seconds per wall
second -- the ranks count forward and backward time in ``benchmarks/busy.py`` (steps after the
first), the peers their compute queue's busy seconds (``queue_busy_s`` of their stop line: compute,
codec, sends) over the trainer's whole run (first micro-batch to last step, so the swarm's one fill
and drain are in it). One peer per stage, codecs ``none``, AdamW, loopback; the async swarm keeps
2S micro-batches in flight (and the weight versions that takes, see :func:`bubble_spec`).

Run::

    python -m benchmarks.bubbles            # S = 2, 4; M = 2, 4, 8; ~20 minutes on 2 cores
    python -m benchmarks.bubbles --quick    # S = 2, M = 2, 4 (a few minutes)

Results: ``benchmarks/results/bubbles.json`` (``bubbles_quick.json``), a plot next to it, and the
"Pipeline bubbles" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.markdown import write_section
from benchmarks.report import cell, machine_info
from swarm.errors import ConfigError

__all__ = [
    "BubblesConfig",
    "SYSTEMS",
    "bubble_fraction",
    "bubble_spec",
    "peer_counters",
    "run_all",
    "markdown_section",
]

SYSTEMS = ("gpipe", "1f1b", "swarm sync", "swarm async")
RESULTS_DIR = Path(__file__).resolve().parent / "results"
SECTION = "## Pipeline bubbles"
_STOPPING = re.compile(r"stopping: stash \d+, version \d+, counters (\{.*\})")


@dataclass(frozen=True, kw_only=True)
class BubblesConfig:
    stages: tuple[int, ...] = (2, 4)
    n_micro: tuple[int, ...] = (2, 4, 8)
    """M: micro-batches per optimizer step (a pipelining step, a swarm step's ``accumulate``)."""
    emulate_ms: tuple[float, float] = (40.0, 80.0)
    """(F, B): the emulated busy milliseconds of a micro-batch's forward and backward on a stage."""
    micro_batches: int = 48
    """Per run (a multiple of every M): the swarm trains this many, the baseline this many / M steps."""
    systems: tuple[str, ...] = SYSTEMS
    max_inflight: int | None = None
    """Micro-batches in flight in the swarm (None = max(M, 2S)); kept fixed (no pacing)."""
    start_timeout_s: float = 180.0
    run_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown:
            raise ConfigError(f"systems {sorted(unknown)} are not among {SYSTEMS}")
        for m in self.n_micro:
            if m < 1 or self.micro_batches % m or self.micro_batches // m < 2:
                raise ConfigError(
                    f"micro_batches = {self.micro_batches} must be a multiple of M = {m} and give >= 2 steps"
                )
        if min(self.stages) < 2 or min(self.emulate_ms) <= 0:
            raise ConfigError("stages must be >= 2 and both emulated times > 0 ms")


def bubble_fraction(stages: int, n_micro: int) -> float:
    """Idle fraction of each stage in a synchronous pipeline step: (S-1)/(M+S-1)."""
    return (stages - 1) / (n_micro + stages - 1)


def bubble_spec(stages: int, n_micro: int, mode: str) -> Any:
    """A tiny model (its real compute a few ms) split into ``stages``, ``accumulate = n_micro``.

    Async mode keeps 2 + ceil(2S/M) weight versions: a trainer keeps (versions - 2) x M + 1 micro-batches
    in flight through a peer (note "staleness cap", swarm/client/routing.py), so 2S fit, enough to keep
    every stage busy (the default 3 versions would cap M = 2 at 3 in flight, fewer than 4 stages)."""
    from swarm.run.spec import RunSpec

    return RunSpec.from_dict(
        {
            "run_id": f"bubbles-s{stages}-m{n_micro}-{mode}",
            "seed": 0,
            "model": {"vocab_size": 256, "d_model": 32, "n_layers": 4, "n_heads": 2, "seq_len": 16},
            "stages": stages,
            "codecs": {"activations": "none", "gradients": "none"},
            "optimizer": {
                "name": "adamw",
                "lr": 1e-3,
                "clip_norm": 1.0,
                "accumulate": n_micro,
                "mode": mode,
                "max_versions": 2 + math.ceil(2 * stages / n_micro),
            },
            "micro_batch_size": 2,
        }
    )


# ------------------------------------------------------------------------------------------ runs


def run_pipe(cfg: BubblesConfig, stages: int, n_micro: int, schedule: str, work: Path) -> dict[str, Any]:
    from benchmarks.netlab import LoopbackLab
    from benchmarks.pipelining_baseline import PipeConfig, run_pipelining

    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / "spec.json"
    spec_path.write_bytes(bubble_spec(stages, n_micro, "sync").canonical_bytes())
    pcfg = PipeConfig(
        spec_path=str(spec_path),
        schedule=schedule,
        n_micro=n_micro,
        steps=cfg.micro_batches // n_micro,
        warmup_steps=1,
        threads=1,
        data_bytes=1 << 20,
        timeout_s=cfg.run_timeout_s,
        emulate_s=(cfg.emulate_ms[0] / 1000, cfg.emulate_ms[1] / 1000),
    )
    nodes = [f"s{i}" for i in range(stages)]
    with LoopbackLab(nodes) as lab:
        res = run_pipelining(lab, pcfg, nodes, work)
    return {"tokens_per_s": res["tokens_per_s"], "utilisation": res["utilisation"], "step_s": res["step_s"]}


def run_swarm(cfg: BubblesConfig, stages: int, n_micro: int, mode: str, work: Path) -> dict[str, Any]:
    """One peer per stage (processes, ``--emulate-compute-ms``) and a trainer in this process."""
    from benchmarks.links import swarm_figures
    from swarm.dht.processes import terminate_as_interrupt
    from swarm.tools.demo import Demo, DemoConfig
    from swarm.train.data import DataConfig
    from swarm.train.metrics import read_metrics
    from swarm.train.trainer import Trainer, TrainerConfig

    spec = bubble_spec(stages, n_micro, mode)
    f_ms, b_ms = cfg.emulate_ms
    demo = Demo(
        DemoConfig(
            spec=spec,
            peers_per_stage=1,
            out_dir=str(work / "swarm"),
            peer_args=(
                "--throughput",
                "1000",
                "--no-rebalance",
                "--emulate-compute-ms",
                f"{f_ms:g},{b_ms:g}",
            ),
            torch_threads=1,
            start_timeout_s=cfg.start_timeout_s,
            reference=False,
            quiet=True,
        )
    )
    inflight = cfg.max_inflight or max(n_micro, 2 * stages)
    previous = terminate_as_interrupt((signal.SIGTERM, signal.SIGINT))  # Ctrl-C still stops the peers
    try:
        demo.start()
        trainer = Trainer(
            TrainerConfig(
                initial_peers=(demo.maddr,),
                run_id=spec.run_id,
                data=DataConfig(max_bytes=1 << 20),
                steps=cfg.micro_batches // n_micro,
                max_inflight=inflight,
                pacing=False,
                out_dir=str(work / "train"),
                seed=0,
                trainer_id="bubbles",
                quiet=True,
            )
        )
        summary = asyncio.run(asyncio.wait_for(trainer.run(), cfg.run_timeout_s))
    finally:
        demo.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    records = read_metrics(work / "train" / "metrics.jsonl")
    # steady: tokens per second from the end of the first step to the last (one window: a short one
    # can end on a burst of completions, faster than any stage can go)
    fig = swarm_figures(
        records,
        summary,
        tokens_per_mb=spec.tokens_per_micro_batch,
        warmup_mb=n_micro,
        window_mb=cfg.micro_batches + 1,
    )
    busy = [c.get("queue_busy_s") for c in peer_counters(demo.logs, stages)]
    train_s = fig["train_s"]
    return {
        "tokens_per_s": fig["tokens_per_s"],
        "tokens_per_s_overall": fig["tokens"] / train_s if train_s else None,
        "utilisation": [b / train_s if b is not None and train_s else None for b in busy],
        "train_s": train_s,
        "completed": fig["completed"],
        "dropped": fig["dropped"],
        "max_inflight": inflight,
    }


def peer_counters(logs: Path, stages: int) -> list[dict[str, float]]:
    """Each stage's counters from its peer's stop line (``peer/server.py`` logs ``stats()`` at shutdown;
    the last line of the stage's logs; {} when none was written)."""
    out: list[dict[str, float]] = []
    for s in range(stages):
        counters: dict[str, float] = {}
        for path in sorted(logs.glob(f"peer-s{s}-*.log")):
            counters = peer_stop_counters(path) or counters
        out.append(counters)
    return out


def peer_stop_counters(path: Path) -> dict[str, float]:
    """The counters of the last stop line in one peer's log ({} when it wrote none: killed, or still running)."""
    counters: dict[str, float] = {}
    for m in _STOPPING.finditer(path.read_text(errors="replace")):
        counters = json.loads(m.group(1))
    return counters


def run_all(
    cfg: BubblesConfig,
    *,
    name: str = "bubbles",
    command: str = "",
    results_dir: Path = RESULTS_DIR,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every (S, M, system); ``results/NAME.json`` rewritten after each run (partial results survive)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "name": name,
        "command": command,
        "config": asdict(cfg),
        "machine": machine_info(),
        "tokens_per_mb": bubble_spec(2, 1, "sync").tokens_per_micro_batch,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "results": [],
    }
    out = results_dir / f"{name}.json"
    jobs = [(s, m, system) for s in cfg.stages for m in cfg.n_micro for system in cfg.systems]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="swarmpipe-bubbles-") as tmp:
        for i, (s, m, system) in enumerate(jobs):
            say(f"[{i + 1}/{len(jobs)}] S={s} M={m} {system} ({time.perf_counter() - t0:.0f} s elapsed)")
            work = Path(tmp) / f"job{i}"
            t = time.perf_counter()
            try:
                if system.startswith("swarm"):
                    res = run_swarm(cfg, s, m, system.split()[1], work)
                else:
                    res = run_pipe(cfg, s, m, system, work)
            except Exception as e:  # noqa: BLE001 -- one failed run is a row of the report, not its end
                res = {"error": f"{type(e).__name__}: {e}"[:2000]}
                say(f"    FAILED: {res['error'][:500]}")
            res.update(stages=s, n_micro=m, system=system, job_s=time.perf_counter() - t)
            res.update(derived(cfg, res, report["tokens_per_mb"]))
            if not res.get("error"):
                say(
                    f"    efficiency {cell(res['efficiency'], '.2f')} (theory {res['theory_efficiency']:.2f})"
                )
            report["results"].append(res)
            out.write_text(json.dumps(report, indent=1, default=str))
    report["wall_min"] = (time.perf_counter() - t0) / 60
    report["load_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    report["plot"] = plot(report, results_dir / f"{name}.png")
    out.write_text(json.dumps(report, indent=1, default=str))
    return report


def derived(cfg: BubblesConfig, res: dict[str, Any], tokens_per_mb: int) -> dict[str, Any]:
    """Efficiency (tokens/s over one always-busy stage's) and what theory says for this run."""
    s, m = res["stages"], res["n_micro"]
    ideal = tokens_per_mb / (sum(cfg.emulate_ms) / 1000)
    tps = res.get("tokens_per_s")
    util = [u for u in res.get("utilisation") or [] if u is not None]
    # async: no bubble per step (after the first one, where the steady rate starts, the pipeline is full)
    theory = 1.0 if res["system"] == "swarm async" else 1 - bubble_fraction(s, m)
    return {
        "ideal_tokens_per_s": ideal,
        "efficiency": tps / ideal if tps else None,
        "mean_utilisation": statistics.fmean(util) if util else None,
        "theory_efficiency": theory,
        "bubble_fraction": bubble_fraction(s, m),
    }


# ---------------------------------------------------------------------------------------- report


def _find(report: dict[str, Any], s: int, m: int, system: str) -> dict[str, Any] | None:
    return next(
        (r for r in report["results"] if (r["stages"], r["n_micro"], r["system"]) == (s, m, system)), None
    )


def plot(report: dict[str, Any], path: Path) -> str | None:
    """Efficiency against M, one panel per S, theory dashed; None without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    cfg = report["config"]
    fig = Figure(figsize=(4 * len(cfg["stages"]), 3.6))
    FigureCanvasAgg(fig)
    for i, s in enumerate(cfg["stages"]):
        ax = fig.add_subplot(1, len(cfg["stages"]), i + 1)
        ms = cfg["n_micro"]
        ax.plot(ms, [1 - bubble_fraction(s, m) for m in ms], "k--", label="theory M/(M+S-1)")
        for system in cfg["systems"]:
            ys = [(_find(report, s, m, system) or {}).get("efficiency") for m in ms]
            ax.plot(ms, [float("nan") if y is None else y for y in ys], "o-", label=system)
        ax.set(
            title=f"S = {s} stages",
            xlabel="M (micro-batches per step)",
            ylabel="tokens/s / ideal",
            ylim=(0, 1.1),
        )
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    fig.axes[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def _failed(r: dict[str, Any]) -> str:
    """A failed run's cell: torch's 1F1B refuses fewer micro-batches than stages, which is no failure."""
    return (
        "n/a (M < S)" if "must be greater than or equal to the number of stages" in r["error"] else "failed"
    )


def _utils(r: dict[str, Any] | None) -> str:
    if r is None or r.get("error"):
        return _failed(r) if r else "-"
    return " / ".join(cell(u, ".2f") for u in r.get("utilisation") or [])


def markdown_section(report: dict[str, Any]) -> str:
    cfg = report["config"]
    f_ms, b_ms = cfg["emulate_ms"]
    mach = report["machine"]
    lines = [
        SECTION,
        "",
        f"Machine: {mach['cpu']}, {mach['cpu_count']} cores (load average {mach['load_start']} at the start, "
        f"{report.get('load_end', '-')} at the end: other work shared the cores), torch {mach['torch']}; "
        f"{report['started']}, {report.get('wall_min', 0):.0f} min. Command: `{report['command']}`.",
        "",
        f"Each micro-batch occupies a stage {f_ms:g} ms forward and {b_ms:g} ms backward (emulated compute: the "
        "real compute of a tiny model, the rest slept, CPU-free like a GPU; `peer/compute.py`, "
        "`benchmarks/busy.py`), so the stages do not lend each other their cores. One peer per stage, "
        f"codecs none, {cfg['micro_batches']} micro-batches of {report['tokens_per_mb']} tokens per run. "
        "Efficiency: tokens/s over the ideal of one always-busy stage (tokens per micro-batch / (F+B)); a "
        "synchronous step's theory is M/(M+S-1) (bubble (S-1)/(M+S-1)), the async swarm's 1 in steady state "
        "(it fills the pipeline once per run: n/(n+S-1) over a whole run of n micro-batches). torch's "
        "`Schedule1F1B` refuses M < S (n/a below).",
        "",
        "| S | M | bubble (S-1)/(M+S-1) | theory, sync | " + " | ".join(cfg["systems"]) + " |",
        "| --- | --- | --- | --- |" + " --- |" * len(cfg["systems"]),
    ]
    for s in cfg["stages"]:
        for m in cfg["n_micro"]:
            cells = []
            for system in cfg["systems"]:
                r = _find(report, s, m, system)
                cells.append(_failed(r) if r and r.get("error") else cell((r or {}).get("efficiency"), ".2f"))
            lines.append(
                f"| {s} | {m} | {bubble_fraction(s, m):.2f} | {1 - bubble_fraction(s, m):.2f} | "
                + " | ".join(cells)
                + " |"
            )
    lines += [
        "",
        "Utilisation per stage (busy seconds per wall second, stage 0 first; the baseline's ranks count "
        "forward and backward time after the first step, the peers their compute queue's busy time over the "
        "whole run):",
        "",
        "| S | M | " + " | ".join(cfg["systems"]) + " |",
        "| --- | --- |" + " --- |" * len(cfg["systems"]),
    ]
    for s in cfg["stages"]:
        for m in cfg["n_micro"]:
            utils = " | ".join(_utils(_find(report, s, m, system)) for system in cfg["systems"])
            lines.append(f"| {s} | {m} | {utils} |")
    if report.get("plot"):
        lines += ["", f"![efficiency against M](benchmarks/results/{Path(report['plot']).name})"]
    lines += [
        "",
        "Reading: " + reading(report),
        "",
        "What this leaves out: a real accelerator's time per micro-batch varies, and the swarm's per-hop "
        "overhead (asyncio, hivemind's p2p daemon, a process per peer) is real CPU time on shared cores, "
        "hidden here only while the real work stays below F and B; the sync swarm also waits a trainer "
        "round trip between windows, which the pipelining schedules do not have.",
    ]
    return "\n".join(lines) + "\n"


def reading(report: dict[str, Any]) -> str:
    """What the numbers say, from the numbers: each system's efficiency against its theory."""
    parts = []
    for system in report["config"]["systems"]:
        rows = [r for r in report["results"] if r["system"] == system and r.get("efficiency")]
        if not rows:
            continue
        ratios = [r["efficiency"] / r["theory_efficiency"] for r in rows]
        worst = min(rows, key=lambda r: r["efficiency"])
        parts.append(
            f"{system}: {min(ratios):.2f}-{max(ratios):.2f} x its theory (lowest efficiency "
            f"{worst['efficiency']:.2f} at S={worst['stages']}, M={worst['n_micro']})"
        )
    gains = []
    for r in report["results"]:
        one = _find(report, r["stages"], r["n_micro"], "1f1b")
        if r["system"] == "swarm async" and r.get("tokens_per_s") and one and one.get("tokens_per_s"):
            gains.append(r["tokens_per_s"] / one["tokens_per_s"])
    text = "; ".join(parts) + "."
    if gains:
        text += f" Swarm async / 1F1B tokens/s: {min(gains):.2f}-{max(gains):.2f} over the (S, M) above."
    return text


# ------------------------------------------------------------------------------------------- CLI


def quick_config(**kw: Any) -> BubblesConfig:
    """``--quick``: S = 2, M = 2 and 4, 16 micro-batches per run, 20/40 ms."""
    return BubblesConfig(
        **({"stages": (2,), "n_micro": (2, 4), "micro_batches": 16, "emulate_ms": (20.0, 40.0)} | kw)
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bubbles",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="S = 2, M = 2 and 4, short runs (a few minutes)")
    parser.add_argument("--stages", type=int, nargs="+", default=None)
    parser.add_argument("--n-micro", type=int, nargs="+", default=None)
    parser.add_argument(
        "--emulate-compute-ms", default=None, metavar="F,B", help="default 40,80 (quick: 20,40)"
    )
    parser.add_argument("--micro-batches", type=int, default=None, help="per run (a multiple of every M)")
    parser.add_argument(
        "--systems", nargs="+", default=None, help=f"a subset of {SYSTEMS} (quote the swarm's)"
    )
    parser.add_argument("--no-markdown", action="store_true", help="do not rewrite BENCHMARKS.md")
    args = parser.parse_args(argv)
    kw: dict[str, Any] = {}
    if args.stages:
        kw["stages"] = tuple(args.stages)
    if args.n_micro:
        kw["n_micro"] = tuple(args.n_micro)
    if args.emulate_compute_ms:
        kw["emulate_ms"] = tuple(float(v) for v in args.emulate_compute_ms.split(","))
    if args.micro_batches:
        kw["micro_batches"] = args.micro_batches
    if args.systems:
        kw["systems"] = tuple(args.systems)
    cfg = quick_config(**kw) if args.quick else BubblesConfig(**kw)
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    name = "bubbles_quick" if args.quick else "bubbles"
    command = "python -m benchmarks.bubbles" + (" " + " ".join(argv if argv is not None else sys.argv[1:]))
    report = run_all(cfg, name=name, command=command.strip())
    if not args.no_markdown and not args.quick:
        write_section(markdown_section(report))
    print(markdown_section(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
