"""The time-to-target benchmark's report: what each run's evaluations say, the ratios, a plot, a section.

Every run's held-out curve becomes points ``(clock seconds, tokens, loss)`` (:func:`curve`): 1F1B's
clock is its training time without evaluations (``train_s``); a swarm's is the trainer's record time
minus its first send, at the end of each evaluation (evaluations included, see
``benchmarks/time_to_target.py``), except for rounds that training waited for (sync mode: ``paused``
records, note "evaluation between windows" in swarm/train/steps.py), whose ``eval_s`` is taken out as
1F1B's evaluations are; ``s_with_evals`` keeps them in. :func:`analyse` finds each run's first point at or below the goal
(target x (1 + tolerance)) and, per rate, the ratio of 1F1B's seconds to those of the fastest swarm
configuration that reached the goal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report import cell

__all__ = ["SECTION", "analyse", "curve", "markdown_section", "plot"]

SECTION = "## Time to quality (measured)"
TARGET_RATE, TARGET_RATIO = "20mbit", 3.0


def _label(r: dict[str, Any]) -> str:
    if r.get("kind") == "pipelining":
        return "torch pipelining 1F1B"
    if r.get("kind") == "single":
        return "single process"
    what = f"subspace d/{r['subspace']} + {r['codec']}" if r.get("subspace") else str(r.get("codec"))
    return f"swarm {what} {r.get('mode')}"


def curve(r: dict[str, Any]) -> list[dict[str, float]]:
    """Held-out points of one result: ``{"s", "tokens", "loss"}`` on the run's clock (module docstring)."""
    if r.get("error"):
        return []
    if r.get("kind") == "swarm":
        t0 = r.get("first_send_s") or 0.0
        out, paused_s = [], 0.0
        for e in r.get("evals", []):
            pt = {"s": e["wall_s"] - t0, "tokens": e["tokens"], "loss": e["eval_loss"]}
            if e.get("paused") and e.get("eval_s") is not None:
                # training waited for this round (sync: note "evaluation between windows" in
                # swarm/train/steps.py): its clock stops while rounds run, as 1F1B's does
                paused_s += e["eval_s"]
                pt["s_with_evals"] = pt["s"]
                pt["s"] -= paused_s
            out.append(pt)
        return out
    out = []
    for p in r.get("losses", []):
        if p.get("eval_loss") is None:
            continue
        s = p.get("train_s", p["wall_s"])
        pt = {"s": s, "tokens": p["tokens"], "loss": p["eval_loss"]}
        if "eval_s" in p:  # the same moment with every evaluation so far counted (1F1B)
            pt["s_with_evals"] = p["wall_s"] + p["eval_s"]
        out.append(pt)
    return out


def _reach(points: list[dict[str, float]], goal: float) -> dict[str, float] | None:
    return next((p for p in points if p["loss"] <= goal), None)


def analyse(cfg: Any, report: dict[str, Any]) -> dict[str, Any]:
    """Per run: reached or not, seconds and tokens to the goal; per rate: the 1F1B / best swarm ratio."""
    target = report.get("target_loss")
    goal = None if target is None else target * (1 + cfg.tolerance)
    runs: list[dict[str, Any]] = []
    for r in report["results"]:
        if r.get("kind") == "single":
            continue
        pts = curve(r)
        hit = _reach(pts, goal) if goal is not None else None
        runs.append(
            {
                "label": _label(r),
                "kind": r.get("kind"),
                "rate": r.get("rate"),
                "error": r.get("error"),
                "reached": hit is not None,
                "s_to_target": None if hit is None else hit["s"],
                "s_to_target_with_evals": None if hit is None else hit.get("s_with_evals", hit["s"]),
                "tokens_to_target": None if hit is None else hit["tokens"],
                "best_loss": min((p["loss"] for p in pts), default=None),
                "clock_s": pts[-1]["s"] if pts else None,
                "tokens_trained": pts[-1]["tokens"] if pts else None,
                "evaluations": len(pts),
                "tokens_per_s": r.get("tokens_per_s"),
            }
        )
    per_rate: dict[str, Any] = {}
    for rate in dict.fromkeys(x["rate"] for x in runs):
        here = [x for x in runs if x["rate"] == rate]
        pipe = next((x for x in here if x["kind"] == "pipelining"), None)
        swarms = [x for x in here if x["kind"] == "swarm" and x["reached"]]
        best = min(swarms, key=lambda x: x["s_to_target"], default=None)
        ratio = bound = None
        if best is not None and pipe is not None:
            if pipe["reached"]:
                ratio = pipe["s_to_target"] / best["s_to_target"]
            elif pipe["clock_s"]:
                bound = pipe["clock_s"] / best["s_to_target"]  # 1F1B trained this long without reaching it
        per_rate[rate] = {
            "best_swarm": None if best is None else best["label"],
            "ratio_1f1b_over_best_swarm": ratio,
            "ratio_at_least": bound,
        }
    tr = per_rate.get(TARGET_RATE, {})
    value = tr.get("ratio_1f1b_over_best_swarm") or tr.get("ratio_at_least")
    return {
        "target_loss": target,
        "goal_loss": goal,
        "runs": runs,
        "per_rate": per_rate,
        "summary": {
            "target": f"1F1B / swarm time to target at {TARGET_RATE} >= {TARGET_RATIO:g}",
            "measured": value,
            "met": None if value is None else value >= TARGET_RATIO,
            **{rate: v["ratio_1f1b_over_best_swarm"] for rate, v in per_rate.items()},
        },
    }


def plot(report: dict[str, Any], prefix: str, results_dir: Path) -> list[str]:
    """``PREFIX.png``: held-out loss against each run's clock, one panel per rate, the target as a line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    results = [r for r in report["results"] if not r.get("error")]
    rates = list(dict.fromkeys(r["rate"] for r in results if r.get("kind") != "single"))
    if not rates:
        return []
    fig = Figure(figsize=(6 * len(rates), 4.2))
    FigureCanvasAgg(fig)
    for i, rate in enumerate(rates):
        ax = fig.add_subplot(1, len(rates), i + 1)
        for r in results:
            if r.get("rate") != rate or r.get("kind") == "single":
                continue
            pts = curve(r)
            style = "s--" if r.get("kind") == "pipelining" else "o-"
            ax.plot([p["s"] for p in pts], [p["loss"] for p in pts], style, markersize=3, label=_label(r))
        if report.get("target_loss") is not None:
            t = report["target_loss"]
            ax.axhline(t, color="gray", linestyle=":", label="target (one process at N)")
            ax.set_ylim(t * 0.98, t * 1.25)  # the approach to the target; the first evaluations lie above
        ax.set_xlabel("seconds (training clock; see BENCHMARKS.md)")
        ax.set_ylabel("held-out loss")
        ax.set_title(f"time to target @ {rate}")
        ax.legend(fontsize=7)
    path = results_dir / f"{prefix}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return [path.name]


def markdown_section(report: dict[str, Any]) -> str:
    """The BENCHMARKS.md section (tables from the analysis; the reading from results/NAME_reading.md)."""
    a, cfg, m = report["analysis"], report["config"], report["machine"]
    single = next((r for r in report["results"] if r.get("kind") == "single"), {})
    lines = [
        SECTION,
        "",
        f"Machine: {m['cpu']}, {m['cpu_count']} cores, {m['memory_gib']:.0f} GiB, torch {m['torch']}, "
        f"hivemind {m['hivemind']}, Python {m['python']}; network namespaces, tbf egress shaping per "
        f"node (benchmarks/netlab.py). Load average at start {m['load_start']}. Commit {report.get('commit')}.",
        "",
        f"Command: `{report['command']}` ({report.get('wall_min', 0):.1f} min; results in "
        f"`benchmarks/results/{report['name']}.json`).",
        "",
        f"Model: `{cfg['spec_path']}`"
        + (f" with {cfg['model_overrides']}" if cfg["model_overrides"] else "")
        + f" ({report['n_params'] / 1e6:.1f}M parameters, {report['num_stages']} stages, micro-batch "
        f"{report['micro_batch']}), {cfg['accumulate']} micro-batches per optimizer step on every side "
        f"(1F1B n_micro, swarm accumulate), LR warm-up {cfg['lr_warmup_steps']} steps, trainer seed 0. "
        f"Target: the single process's held-out loss after N = {report['target_tokens']} tokens "
        f"({cfg['target_mb']} micro-batches) = **{cell(a['target_loss'], '.4f')}**; reached = held-out loss "
        f"<= target x (1 + {cfg['tolerance']:g}). Held-out loss: {cfg['eval_batches']} fixed held-out "
        f"micro-batches every {cfg['eval_every']} optimizer step(s), the same windows for every run. Caps: "
        f"{cfg['max_factor']:g} x N tokens or {cfg['max_train_s']:.0f} s.",
        "",
        "Clocks: start-up excluded on both sides. 1F1B: training time from its first step, its "
        "evaluations excluded (with them in brackets). Swarm: from the trainer's first micro-batch to the "
        "end of the evaluation that reached the target; its evaluations run in-band with training and "
        "are included (conservative against the swarm).",
        "",
        "| rate | run | reached | s to target | tokens to target | best held-out loss | clock s trained | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for x in a["runs"]:
        s = cell(x["s_to_target"], ".1f")
        if x["kind"] == "pipelining" and x["reached"]:
            s += f" ({x['s_to_target_with_evals']:.1f})"
        reached = "yes" if x["reached"] else ("FAILED" if x["error"] else "**not reached**")
        lines.append(
            f"| {x['rate']} | {x['label']} | {reached} | {s} | {cell(x['tokens_to_target'])} | "
            f"{cell(x['best_loss'], '.4f')} | {cell(x['clock_s'], '.0f')} | {cell(x['tokens_per_s'])} |"
        )
    lines += [
        "",
        f"Single process (the target): {cell(single.get('tokens_per_s'))} tokens/s, "
        f"{single.get('threads')} thread(s).",
        "",
        "| rate | fastest swarm configuration | 1F1B s / swarm s | target |",
        "|---|---|---|---|",
    ]
    for rate, v in a["per_rate"].items():
        ratio = v["ratio_1f1b_over_best_swarm"]
        shown = (
            cell(ratio, ".2f")
            if ratio is not None
            else (f">= {v['ratio_at_least']:.2f} (1F1B not reached)" if v["ratio_at_least"] else "-")
        )
        want = ""
        if rate == TARGET_RATE:
            met = a["summary"]["met"]
            want = f">= {TARGET_RATIO:g}: " + ("met" if met else "**missed**" if met is not None else "-")
        lines.append(f"| {rate} | {v['best_swarm'] or '-'} | {shown} | {want} |")
    lines += ["", f"![time to target](benchmarks/results/{report['name']}.png)", ""]
    if report.get("reading"):
        lines += ["### Reading", "", report["reading"], ""]
    return "\n".join(lines)
