"""Where the swarm's idle time is: per-micro-batch timelines of a loopback run, swarm vs torch pipelining.

Run (from the repository root; loopback, no root needed)::

    python -m benchmarks.timeline                      # bench model, 72 micro-batches, swarm + 1F1B, ~4 min
    python -m benchmarks.timeline --reps 2 --tag after # two of each, results/timeline_after.json
    python -m benchmarks.timeline --mode sync --rate 20mbit --no-pipelining   # the sync swarm, shaped
    python -m benchmarks.timeline --analyze DIR        # only analyse the peer*.jsonl timelines in DIR
    python -m benchmarks.timeline --render             # BENCHMARKS.md "Where the cycles go" from the JSON

Each stage peer records its timeline (note "timeline" in peer/timeline.py) and writes it at shutdown
(``swarm peer --timeline FILE``); ``benchmarks/timeline_analysis.py`` turns the files into per-stage busy
fractions and idle time by cause, hop latencies and the machine's view (how many cores had work).
The 1F1B ranks are measured by their CPU over wall time per optimizer step (their gloo waits sleep,
so a rank's CPU time is its compute). A Gantt chart of a few seconds of steady state goes to
``results/timeline<_tag>.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.links import Job, LinksConfig, _run_job, pipelining_spec, run_swarm
from benchmarks.netlab import open_lab
from benchmarks.pipelining_baseline import ROOT
from benchmarks.report import machine_info, machine_ticks
from benchmarks.timeline_analysis import Pass, build_passes, cores, hops, stage_table, steady_window

__all__ = ["analyse_dir", "gantt", "main", "pipelining_busy"]

RESULTS = ROOT / "benchmarks" / "results"


def load_events(directory: Path) -> list[dict[str, Any]]:
    """Every event of the ``peer*.jsonl`` timelines in ``directory`` (their header lines skipped)."""
    events: list[dict[str, Any]] = []
    for path in sorted(directory.glob("peer*.jsonl")):
        for line in path.read_text().splitlines()[1:]:
            events.append(json.loads(line))
    if not events:
        raise FileNotFoundError(f"no peer*.jsonl timelines in {directory}; run swarm peers with --timeline")
    return events


def analyse_dir(directory: Path, n_cores: int) -> tuple[dict[str, Any], list[Pass]]:
    passes = build_passes(load_events(directory))
    window = steady_window(passes)
    return {
        "window": list(window),
        "stages": {str(k): v for k, v in stage_table(passes, window).items()},
        "hops": hops(passes, window),
        "cores": cores(passes, window, n_cores),
    }, passes


def pipelining_busy(result: dict[str, Any]) -> dict[str, Any]:
    """Per rank CPU / wall after warm-up (``cpu_busy`` of ``run_pipelining``'s summary) and their sum."""
    ranks = {str(i): b for i, b in enumerate(result.get("cpu_busy") or []) if b is not None}
    return {"busy_by_rank": ranks, "busy_cores": sum(ranks.values())}


def gantt(passes: Sequence[Pass], window: tuple[float, float], path: Path, seconds: float = 3.0) -> None:
    """A Gantt chart of ``seconds`` in the middle of ``window``: per stage its tasks (forward, backward,
    the last stage's forward+backward) and, thinner, the time passes waited queued."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mid = (window[0] + window[1]) / 2
    lo, hi = mid - seconds / 2, mid + seconds / 2
    stages = sorted({p.stage for p in passes})
    last = max(stages)
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(stages) + 1.2))
    colors = {"forward": "#4c72b0", "backward": "#dd8452", "last": "#8172b2"}
    for p in passes:
        y = last - p.stage
        if p.queued is not None and p.started is not None and p.started > lo and p.queued < hi:
            ax.broken_barh([(p.queued - lo, p.started - p.queued)], (y - 0.08, 0.16), color="#bbbbbb")
        if p.ran and p.ended > lo and p.started < hi:  # type: ignore[operator]
            c = colors["last"] if p.stage == last and p.kind == "forward" else colors[p.kind]
            ax.broken_barh([(p.started - lo, p.ended - p.started)], (y - 0.35, 0.7), color=c)  # type: ignore[operator]
    ax.set_yticks([last - s for s in stages], [f"stage {s}" for s in stages])
    ax.set_xlim(0, hi - lo)
    ax.set_xlabel("seconds (steady state)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (*colors.values(), "#bbbbbb")]
    ax.legend(handles, ["forward", "backward", "last stage: forward+loss+backward", "queued"], ncol=4,
              loc="upper center", bbox_to_anchor=(0.5, 1.25), frameon=False)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cpu_times() -> tuple[int, int]:
    """The machine's (steal, total) clock ticks so far, from ``/proc/stat`` ((0, 0) where it has none).
    Steal is time the hypervisor gave this virtual machine's cores to others: on a shared host it is
    why the same work takes longer in one run than the next."""
    fields = machine_ticks()
    if not fields:
        return 0, 0
    steal = fields[7] if len(fields) > 7 else 0
    return steal, sum(fields[:8])


def steal_share(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """Stolen share of the machine's time between two :func:`cpu_times` readings."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else None


def run_once(
    lcfg: LinksConfig,
    work: Path,
    *,
    swarm: bool,
    pipelining: bool,
    mb: int,
    trainer_args: Sequence[str] = (),
    keeper: bool = True,
    rate: str = "none",
    mode: str = "async",
    codec: str = "blockwise8",
    pipelining_first: bool = False,
) -> dict[str, Any]:
    """One swarm run with timelines and/or one 1F1B run, on loopback or, with a ``rate``, in the
    network lab with every node's egress shaped to it (``keeper``: ``swarm init`` keeps stage
    snapshots, as by default). ``pipelining_first``: 1F1B runs before the swarm (the benchmark
    alternates the order between repetitions, so neither side always follows the other's load).
    Each side records the machine's stolen time share over its run (``steal``)."""
    nodes = {"boot": "boot", "trainer": "trainer", "stages": [f"s{i}" for i in range(8)]}
    n_cores = os.cpu_count() or 1
    out: dict[str, Any] = {
        "load_start": os.getloadavg(),
        "order": "1f1b first" if pipelining_first else "swarm first",
    }
    lcfg = dataclasses.replace(lcfg, throughput_mb=mb)
    names = ["boot", "trainer", *nodes["stages"]]

    def run_swarm_side(lab: Any) -> None:
        tl = work / "timelines"
        (work / "swarm").mkdir(parents=True, exist_ok=True)
        job = Job(
            kind="swarm",
            codec=codec,
            mode=mode,
            micro_batches=mb,
            purposes=("throughput",),
            rate=rate,
        )
        before = cpu_times()
        res = run_swarm(
            lab,
            lcfg,
            job,
            work / "swarm",
            nodes,
            timeline_dir=tl,
            trainer_args=trainer_args,
            keeper=keeper,
        )
        steal = steal_share(before, cpu_times())
        analysis, passes = analyse_dir(tl, n_cores)
        out["swarm"] = {
            "tokens_per_s": res.get("tokens_per_s"),
            "tokens_per_s_overall": res.get("tokens_per_s_overall"),
            "window_rates": res.get("window_rates"),  # in order: a slow stretch shows where it was
            "steal": steal,
            **analysis,
        }
        out["_passes"] = passes

    def run_pipelining_side(lab: Any) -> None:
        base = work / "base.json"
        base.parent.mkdir(parents=True, exist_ok=True)
        base.write_bytes(pipelining_spec(lcfg).canonical_bytes())
        job = Job(kind="pipelining", schedule="1f1b", micro_batches=mb, purposes=("throughput",), rate=rate)
        threads = lcfg.threads or max(1, n_cores // 4)
        before = cpu_times()
        res = _run_job(lab, lcfg, job, work / "pipe", nodes, base, threads)
        out["pipelining"] = {
            "tokens_per_s": res.get("tokens_per_s"),
            "tokens_per_s_overall": res.get("tokens_per_s_overall"),
            "steal": steal_share(before, cpu_times()),
            **pipelining_busy(res),
        }

    sides = [(swarm, run_swarm_side), (pipelining, run_pipelining_side)]
    if pipelining_first:
        sides.reverse()
    with open_lab(names, loopback=rate == "none", rate=rate) as lab:
        for wanted, side in sides:
            if wanted:
                side(lab)
    out["load_end"] = os.getloadavg()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--micro-batches", type=int, default=72)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--tag", default="", help="results/timeline_<tag>.json and .png")
    p.add_argument("--no-pipelining", action="store_true", help="swarm runs only")
    p.add_argument("--no-swarm", action="store_true", help="1F1B runs only")
    p.add_argument("--trainer-args", default="", help="more swarm train flags, e.g. '--fixed-inflight'")
    p.add_argument(
        "--no-keeper",
        action="store_true",
        help="swarm init without its keeper (no stage snapshots downloaded)",
    )
    p.add_argument(
        "--rate",
        default="none",
        help="shape every node's egress to this rate in the network lab (root), e.g. 20mbit; none = loopback",
    )
    p.add_argument("--mode", choices=("async", "sync"), default="async", help="the swarm's optimizer.mode")
    p.add_argument(
        "--pipelining-fused",
        action="store_true",
        help="the 1F1B ranks step with torch.optim.AdamW(fused=True), the stage peers' kernel",
    )
    p.add_argument("--codec", default="blockwise8", help="the swarm's activation and gradient codec")
    p.add_argument(
        "--alternate",
        action="store_true",
        help="odd repetitions run 1F1B before the swarm (even ones: the swarm first, as without it)",
    )
    p.add_argument("--analyze", type=Path, default=None, help="analyse the timelines in this directory")
    p.add_argument(
        "--render", action="store_true", help="rewrite BENCHMARKS.md 'Where the cycles go' from the JSON"
    )
    args = p.parse_args(argv)
    if args.no_swarm and args.no_pipelining:
        p.error("--no-swarm with --no-pipelining leaves nothing to run; drop one of them")
    if args.render:
        from benchmarks import overhead

        return overhead.main(["--render"])
    n_cores = os.cpu_count() or 1
    if args.analyze is not None:
        analysis, _ = analyse_dir(args.analyze, n_cores)
        print(json.dumps(analysis, indent=1))
        return 0
    name = f"timeline_{args.tag}" if args.tag else "timeline"
    lcfg = LinksConfig(
        loopback=args.rate == "none", rates=(args.rate,), pipe_fused_adamw=args.pipelining_fused
    )
    report: dict[str, Any] = {
        "machine": machine_info(),
        "micro_batches": args.micro_batches,
        "trainer_args": args.trainer_args,
        "keeper": not args.no_keeper,
        "rate": args.rate,
        "mode": args.mode,
        "codec": args.codec,
        "pipelining_fused_adamw": args.pipelining_fused,
        "allocator_env": {  # what the processes inherit (note "allocator", peer/allocator.py)
            k: v
            for k, v in os.environ.items()
            if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "SWARMPIPE_MALLOC")
        },
        "runs": [],
    }
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="timeline-") as tmp:
        for rep in range(args.reps):
            r = run_once(
                lcfg,
                Path(tmp) / f"rep{rep}",
                swarm=not args.no_swarm,
                pipelining=not args.no_pipelining,
                mb=args.micro_batches,
                trainer_args=args.trainer_args.split(),
                keeper=not args.no_keeper,
                rate=args.rate,
                mode=args.mode,
                codec=args.codec,
                pipelining_first=args.alternate and rep % 2 == 1,
            )
            passes = r.pop("_passes", None)
            if rep == 0 and passes is not None:
                gantt(passes, tuple(r["swarm"]["window"]), RESULTS / f"{name}.png")
            report["runs"].append(r)
            s, q = r.get("swarm") or {}, r.get("pipelining") or {}
            print(
                f"rep {rep} ({r['order']}): swarm {s.get('tokens_per_s') or 0:.0f} tokens/s "
                f"({s.get('tokens_per_s_overall') or 0:.0f} overall), "
                f"{s.get('cores', {}).get('busy_cores', 0):.2f} cores busy, "
                f"steal {100 * (s.get('steal') or 0):.1f}%; 1F1B {q.get('tokens_per_s') or 0:.0f} tokens/s "
                f"({q.get('tokens_per_s_overall') or 0:.0f} overall), {q.get('busy_cores', 0):.2f} cores busy, "
                f"steal {100 * (q.get('steal') or 0):.1f}%",
                flush=True,
            )
    report["wall_s"] = time.time() - t0
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=1))
    first = report["runs"][0]
    print(
        json.dumps(
            {k: v for k, v in (first.get("swarm") or first["pipelining"]).items() if k != "window"}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# ------------------------------------------------------------------------------ report

LABELS = {
    "base": "before",
    "after": "after",
    "quiet": "session 8, quiet",
    "quiet_nokeeper": "session 8, quiet, no keeper",
}
"""The result files (``results/timeline_<tag>.json``) the BENCHMARKS.md block shows, and their names."""


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def markdown_block(reports: dict[str, dict[str, Any]], reading: str = "") -> str:
    """The "Idle time" block of BENCHMARKS.md "Where the cycles go" from timeline reports by label
    (means over each report's runs)."""
    lines = [
        "### Idle time: per-micro-batch timelines",
        "",
        "`python -m benchmarks.timeline --reps 2 --tag TAG` (loopback, `examples/bench.yaml`, blockwise8 async, "
        '1 peer per stage, 72 micro-batches; note "timeline" in `peer/timeline.py`). Steady state: from '
        "stage 0's 9th forward to its 9th from the end. Means over the runs of each row.",
        "",
        "| | swarm tokens/s | 1F1B tokens/s | swarm / 1F1B | swarm cores busy (tasks running) | swarm compute CPU, cores | "
        "1F1B CPU, cores | a core idle | of that: stacked / between stages / both / too few in flight | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rep in reports.items():
        runs = rep["runs"]
        s_tps = _mean([r["swarm"]["tokens_per_s"] for r in runs])
        p_tps = _mean([(r.get("pipelining") or {}).get("tokens_per_s") for r in runs])
        ratio = _mean(
            [
                r["swarm"]["tokens_per_s"] / r["pipelining"]["tokens_per_s"]
                for r in runs
                if r.get("pipelining") and r["pipelining"].get("tokens_per_s") and r["swarm"]["tokens_per_s"]
            ]
        )
        c = [r["swarm"]["cores"] for r in runs]
        causes = ("stacked", "between stages", "both", "too few in flight")
        cause = " / ".join(_pct(_mean([x["idle_causes"][k] for x in c])) for k in causes)
        loads = ", ".join(f"{r['load_start'][0]:.1f}" for r in runs)
        lines.append(
            f"| {label} ({len(runs)} runs) | {_num(s_tps)} | {_num(p_tps)} | {_num(ratio, 2)} | "
            f"{_num(_mean([x['busy_cores'] for x in c]), 2)} | {_num(_mean([x.get('compute_cpu_cores') for x in c]), 2)} | "
            f"{_num(_mean([(r.get('pipelining') or {}).get('busy_cores') for r in runs]), 2)} | "
            f"{_pct(_mean([x['core_idle_share'] for x in c]))} | {cause} | {loads} |"
        )
    lines += [
        "",
        "Per stage (share of the steady window; idle split by what the stage waited for; core share = the "
        "worker's CPU over its running time; queued behind = mean wait of a task while another ran):",
        "",
        "| | stage | busy | core share | waiting for input | waiting for a gradient | receiving | hand-off | "
        "queued behind, ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rep in reports.items():
        runs = rep["runs"]
        for st in sorted(runs[0]["swarm"]["stages"], key=int):
            rows = [r["swarm"]["stages"][st] for r in runs if st in r["swarm"]["stages"]]

            def m(key: str, rows: list[dict[str, float]] = rows) -> float | None:
                return _mean([x.get(key, 0.0) for x in rows])

            inp = _mean(
                [x.get("waiting for the trainer", 0.0) + x.get("waiting for activations", 0.0) for x in rows]
            )
            behind = m("queued_behind_s")
            lines.append(
                f"| {label} | {st} | {_pct(m('busy'))} | {_pct(_mean([x.get('core_share') for x in rows]))} | "
                f"{_pct(inp)} | {_pct(m('waiting for a gradient'))} | {_pct(m('receiving (validate, decode)'))} | "
                f"{_pct(m('worker hand-off'))} | {_num(None if behind is None else 1000 * behind)} |"
            )
    lines += [
        "",
        "Hops (mean ms from a task's end: to the event loop's send, then to the next stage's arrival):",
        "",
    ]
    hop_names = sorted({h for rep in reports.values() for r in rep["runs"] for h in r["swarm"]["hops"]})
    lines += ["| | " + " | ".join(hop_names) + " |", "|---|" + "---|" * len(hop_names)]
    for label, rep in reports.items():
        cells = []
        for h in hop_names:
            xs = [r["swarm"]["hops"][h] for r in rep["runs"] if h in r["swarm"]["hops"]]
            a, b = _mean([x["to_loop_s"] for x in xs]), _mean([x["send_s"] for x in xs])
            cells.append("-" if a is None or b is None else f"{1000 * a:.1f} + {1000 * b:.1f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if reading:
        lines += ["", reading.rstrip()]
    return "\n".join(lines) + "\n"


def _num(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def section_block(results: Path = RESULTS) -> str:
    """The block from the result files that exist (empty if none), with ``timeline_reading.md``."""
    reports = {}
    for tag, label in LABELS.items():
        path = results / f"timeline_{tag}.json"
        if path.exists():
            reports[label] = json.loads(path.read_text())
    if not reports:
        return ""
    reading = results / "timeline_reading.md"
    block = markdown_block(reports, reading.read_text() if reading.exists() else "")
    gantt_png = [f"timeline_{t}.png" for t in LABELS if (results / f"timeline_{t}.png").exists()]
    pics = "\n\n".join(f"![{p}](benchmarks/results/{p})" for p in gantt_png)
    return block + ("\n" + pics + "\n" if pics else "")
