"""Demo throughput, A/B: ``swarm demo`` (2 stages x 2 peers, async, blockwise8) of an older commit
against this checkout, run back to back in alternating order so that the machine's load hits both
sides alike.

    python -m benchmarks.demo_throughput                      # 3 pairs: base 7d961c3, then this code
    python -m benchmarks.demo_throughput --pairs 2 --variants paced fixed4
    python -m benchmarks.demo_throughput --variants base paced recompute   # recompute: as before session 8
    python -m benchmarks.demo_throughput --render             # the table from the JSON

The base commit is checked out in a detached git worktree (``--base-dir``, made if missing) and run
with ``PYTHONPATH`` pointing at it, so both sides use this venv's packages. Issue 13's target: the
demo's tokens/s no lower than the code before issue 13 (7d961c3) minus 10%.

Results: ``benchmarks/results/demo_throughput.json`` (every run, with its load average) and the
table on stdout (BENCHMARKS.md "Demo throughput").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "demo_throughput.json"

# variant -> (which code, extra demo flags, overrides of this checkout's examples/demo.yaml)
VARIANTS: dict[str, tuple[str, list[str], dict[str, Any]]] = {
    "base": ("base", [], {}),
    "paced": ("this", ["--no-reference"], {}),
    "fixed4": ("this", ["--no-reference", "--max-inflight", "4"], {}),
    # the demo as it ran before it kept activations (session 8): the forward again at every backward
    "recompute": ("this", ["--no-reference"], {"optimizer": {"recompute": True}}),
}


def _spec_flags(overrides: dict[str, Any], tmp: Path) -> list[str]:
    """``--spec FILE``: this checkout's demo spec with ``overrides`` merged in (none: no flag)."""
    if not overrides:
        return []
    import yaml

    spec = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
    for section, values in overrides.items():
        spec.setdefault(section, {}).update(values)
    path = tmp / "demo_variant.yaml"
    path.write_text(yaml.safe_dump(spec))
    return ["--spec", str(path)]


def _rev(repo: Path, what: str) -> str:
    out = subprocess.run(["git", "-C", str(repo), "rev-parse", what], capture_output=True, text=True)
    return out.stdout.strip()


def _checkout(base: str, base_dir: Path) -> Path:
    if not (base_dir / "swarm").is_dir():
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(base_dir), base], check=True
        )
    want, head = (_rev(REPO, f"{base}^{{commit}}"), _rev(base_dir, "HEAD"))
    if want != head:
        raise SystemExit(f"--base-dir {base_dir} holds {head[:10]}, not {base}: remove it or pick another")
    return base_dir


def _run_demo(code_dir: Path, flags: list[str], timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="demo-ab-") as tmp:
        out = Path(tmp) / "out"
        env = dict(os.environ, PYTHONPATH=str(code_dir))
        load = os.getloadavg()
        t0 = time.time()
        proc = subprocess.run(
            [sys.executable, "-m", "swarm.cli", "demo", "--out", str(out), "--quiet", *flags],
            cwd=code_dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"demo in {code_dir} exited {proc.returncode}: {proc.stderr[-2000:]}")
        s = json.loads((out / "summary.json").read_text())
        curve = eval_curve(out / "metrics.jsonl")
    return {
        "tokens_per_s": s.get("tokens_per_s"),
        "eval_loss_last": s.get("eval_loss_last"),
        "applied_staleness": s.get("applied_staleness"),
        "inflight": s.get("inflight"),
        "steps": s.get("steps"),
        "tokens": s.get("tokens"),
        "wall_s": round(time.time() - t0, 1),
        "load_at_start": [round(x, 2) for x in load],
        "eval_curve": curve,
    }


def eval_curve(metrics: Path) -> list[list[float]]:
    """``[seconds, tokens, held-out loss]`` of every evaluation in a demo's metrics.jsonl."""
    rows = []
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if r.get("type") == "eval" and r.get("eval_loss") is not None:
            rows.append([float(r["time"]), float(r["tokens"]), float(r["eval_loss"])])
    return rows


def seconds_to(curve: list[list[float]], target: float) -> float | None:
    """Training seconds until the held-out loss first reaches ``target``, interpolated linearly between
    the two evaluations around the crossing (the first evaluation's time when it is already there); None
    when it never does."""
    prev: list[float] | None = None
    for point in curve:
        t, _tokens, loss = point
        if loss <= target:
            if prev is None:
                return t
            # prev is above the target (else it would have returned), so prev[2] > loss
            return prev[0] + (t - prev[0]) * (prev[2] - target) / (prev[2] - loss)
        prev = point
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    base_dir = _checkout(args.base, Path(args.base_dir))
    result: dict[str, Any] = {
        "name": "demo_throughput",
        "base": args.base,
        "this": _rev(REPO, "HEAD")[:7],
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m benchmarks.demo_throughput " + " ".join(sys.argv[1:]),
        "runs": [],
    }
    for pair in range(args.pairs):
        for variant in args.variants:
            code, flags, overrides = VARIANTS[variant]
            code_dir = base_dir if code == "base" else REPO
            print(f"pair {pair + 1}/{args.pairs}: {variant} ...", flush=True)
            with tempfile.TemporaryDirectory(prefix="demo-variant-") as tmp:
                r = _run_demo(code_dir, [*flags, *_spec_flags(overrides, Path(tmp))], args.timeout_s)
            r.update(variant=variant, pair=pair)
            result["runs"].append(r)
            print(
                f"  {r['tokens_per_s']} tokens/s, held-out {r['eval_loss_last']}, load {r['load_at_start']}",
                flush=True,
            )
            RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _times(runs: list[dict[str, Any]], target: float | None, *, own_end: bool) -> tuple[list, float | None]:
    """Each run's seconds to ``target`` (None: never, or no curve) and their mean when every run has one.
    ``own_end``: a base run's own time to its quality instead, its training seconds to its last evaluation
    (its curve is noisy, and half of its runs end above the mean of their last losses)."""
    times = [
        (r["eval_curve"][-1][0] if own_end else seconds_to(r["eval_curve"], target))
        if r.get("eval_curve") and target
        else None
        for r in runs
    ]
    return times, (statistics.mean(times) if times and None not in times else None)


def render(result: dict[str, Any]) -> str:
    by: dict[str, list[dict[str, Any]]] = {}
    for r in result["runs"]:
        by.setdefault(r["variant"], []).append(r)
    base_runs = by.get("base", [])
    base = statistics.mean(r["tokens_per_s"] for r in base_runs) if base_runs else None
    # the quality the old demo ends at: the mean of its runs' last held-out loss
    target = statistics.mean(r["eval_loss_last"] for r in base_runs) if base_runs else None
    base_s = _times(base_runs, target, own_end=True)[1]
    lines = [
        "| code | runs | tokens/s (each run) | mean | vs base | held-out loss | applied staleness (stage 0 / 1) "
        "| s to the base's final held-out loss (each run; base: its training time) | base s / this s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, runs in by.items():
        tps = [r["tokens_per_s"] for r in runs]
        mean = statistics.mean(tps)
        losses = [r["eval_loss_last"] for r in runs if r["eval_loss_last"] is not None]
        stale = [r["applied_staleness"] for r in runs if r.get("applied_staleness")]
        stale_s = ", ".join(f"{s.get('0', 0):.2f} / {s.get('1', 0):.2f}" for s in stale) or "-"
        label = f"base ({result['base']})" if variant == "base" else f"{variant} ({result['this']})"
        vs_base = f"{mean / base:.2f}" if base else "-"
        loss_s = f"{min(losses):.2f}-{max(losses):.2f}" if losses else "-"
        each = ", ".join(f"{t:.0f}" for t in tps)
        reach, mean_s = _times(runs, target, own_end=variant == "base")
        reach_s = ", ".join("-" if x is None else f"{x:.0f}" for x in reach) if target else "-"
        speed = f"{base_s / mean_s:.2f}" if base_s and mean_s else "-"
        lines.append(
            f"| {label} | {len(runs)} | {each} | {mean:.0f} | {vs_base} | {loss_s} | {stale_s} | {reach_s} | {speed} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.demo_throughput", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--base", default="7d961c3", help="the older commit (default: the code before issue 13)")
    p.add_argument(
        "--base-dir", default="/tmp/demo-throughput-base", help="where the base commit is checked out"
    )
    p.add_argument("--pairs", type=int, default=3, help="rounds of the variants, run in order each round")
    p.add_argument("--variants", nargs="+", default=["base", "paced"], choices=sorted(VARIANTS))
    p.add_argument("--timeout-s", type=float, default=900.0, help="per demo run")
    p.add_argument("--render", action="store_true", help="print the table of the last results and exit")
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error(f"--pairs = {args.pairs} is invalid: at least 1 round is needed")
    result = json.loads(RESULTS.read_text()) if args.render else run(args)
    print(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
