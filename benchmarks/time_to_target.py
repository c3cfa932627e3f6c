"""Time to quality, measured: how long torch pipelining (1F1B) and the swarm take to reach one loss.

Run (from the repository root, as root for the network lab; ``--loopback`` anywhere)::

    python -m benchmarks.time_to_target                      # full run (~30 min on 2 idle cores):
                                                             # results/time_to_target.json, a plot and
                                                             # the "Time to quality (measured)" section
    python -m benchmarks.time_to_target --quick              # small model, one rate (~4 min)
    python -m benchmarks.time_to_target --rates 100mbit 20mbit --swarms blockwise8:async ss32+blockwise8:async
    python -m benchmarks.time_to_target --render time_to_target   # rewrite the section from the JSON
    python -m benchmarks.time_to_target --plan               # print what would run, run nothing

Protocol (:func:`plan`, :func:`run_all`):

1. The target. The single-process reference (``benchmarks/single_process.py``: the model of the links
   benchmark, ``torch.optim.AdamW``, ``accumulate`` micro-batches per optimizer step, per-stage
   clipping) trains ``target_mb`` micro-batches (N tokens, trainer seed 0); its held-out loss at N is the
   target L. Held-out loss everywhere = the mean loss over ``eval_batches`` fixed, evenly spaced
   held-out micro-batches (``TokenData.eval_batches``: the windows a swarm trainer's evaluation,
   ``swarm.train.reference.held_out_loss`` and ``benchmarks/convergence.py`` use), the same windows for
   every run. A run has reached the target at its first evaluation <= L x (1 + ``tolerance``) (the
   tolerance only absorbs float rounding: 1F1B computes the reference's training in another order).
2. At each rate (egress of every node shaped with tbf, ``benchmarks/netlab.py``), torch pipelining 1F1B
   (``benchmarks/pipelining_baseline.py``, ``n_micro = accumulate``, the same data and initial weights)
   trains and evaluates through its pipeline every ``eval_every`` optimizer steps
   (``benchmarks/pipe_heldout.py``) until it reaches L or a cap. Its clock is its training time from its
   first step: evaluation time is *excluded* (``train_s``); the time with evaluations is kept as well.
3. At each rate, every swarm configuration (``--swarms CODEC:MODE`` or ``ssR+CODEC:MODE`` for the
   subspace model with ratio R) trains with the same data, seed and optimizer step size; its trainer
   evaluates through the swarm every ``eval_every`` steps (``swarm train --eval-every``, the trainer's own
   held-out evaluation: the held-out micro-batches in inference mode through the pipeline, a
   ``{"type": "eval"}`` record in metrics.jsonl) and is stopped (SIGTERM) at the first evaluation <= L or
   at a cap. Its clock runs from the trainer's first micro-batch to the *end* of that evaluation. In
   async mode its evaluations overlap training and cannot be taken out, so they are *included*
   (conservative against the swarm); in sync mode training waits for each evaluation round, as 1F1B's
   does between its steps (note "evaluation between windows" in swarm/train/steps.py), and the rounds'
   time is taken out as 1F1B's is (the time with them is kept as well). Activations cross with the
   configuration's codec in the evaluation as well.
4. Start-up (process starts, gloo rendezvous, DHT discovery) is excluded on both sides. Caps: a run
   stops at ``max_factor`` x N tokens or ``max_train_s`` seconds of its clock; then it has "not reached"
   the target, and the report says so with its best loss.

Report (:mod:`benchmarks.time_to_target_report`): per rate, seconds and tokens to the target of 1F1B
and each swarm configuration, and the ratio 1F1B seconds / the best configuration's seconds; the
target is >= 3 at 20mbit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.links import (
    QUICK_MODEL,
    Job,
    LinksConfig,
    _first_send,
    base_spec_dict,
    run_swarm,
    socket_prefix,
    start_bootstrap,
)
from benchmarks.markdown import MARKDOWN, write_section
from benchmarks.netlab import LabError, format_rate, lab_unavailable_reason, open_lab
from benchmarks.pipelining_baseline import ROOT, PipeConfig, run_pipelining
from benchmarks.report import machine_info
from benchmarks.single_process import SingleConfig, run_single
from swarm.dht.processes import remove_stale_sockets
from swarm.errors import ConfigError, SwarmError

__all__ = ["TargetConfig", "SwarmSetup", "parse_swarm", "plan", "run_all", "quick_config", "main"]

RESULTS_DIR = ROOT / "benchmarks" / "results"
DEFAULT_SWARMS = ("lowrank:sync", "blockwise8:sync", "blockwise8:async", "ss32+blockwise8:async")
"""The fastest configuration measured so far first (BENCHMARKS.md "Time to quality", session 16), then the
project's default codec in both modes and the subspace model."""


@dataclass(frozen=True)
class SwarmSetup:
    """One swarm configuration: codec (activations and gradients), optimizer mode, subspace ratio."""

    codec: str
    mode: str
    subspace: int | None = None

    @property
    def label(self) -> str:
        what = f"subspace d/{self.subspace} + {self.codec}" if self.subspace else self.codec
        return f"{what} {self.mode}"


def parse_swarm(text: str) -> SwarmSetup:
    """``CODEC:MODE`` or ``ssR+CODEC:MODE`` (e.g. ``blockwise8:async``, ``ss32+blockwise8:async``)."""
    from compression import available_codecs

    what, sep, mode = text.rpartition(":")
    sub = None
    if what.startswith("ss") and "+" in what:
        ratio, _, what = what.partition("+")
        sub = int(ratio[2:]) if ratio[2:].isdigit() else -1
    codecs = {row[0] for row in available_codecs()}
    if not sep or mode not in ("sync", "async") or what not in codecs or (sub is not None and sub < 1):
        raise ConfigError(
            f"swarm configuration {text!r} must be CODEC:MODE or ssR+CODEC:MODE with a codec of "
            f"{sorted(codecs)}, mode sync or async and a whole ratio R >= 1, e.g. ss32+blockwise8:async"
        )
    return SwarmSetup(what, mode, sub)


@dataclass(frozen=True, kw_only=True)
class TargetConfig:
    """One benchmark run. Units: micro-batches (mb) and optimizer steps unless named otherwise."""

    spec_path: str = "examples/bench.yaml"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    """Replace these ``model`` fields of the spec (``--quick`` shrinks the model this way)."""
    rates: tuple[str, ...] = ("100mbit", "20mbit")
    swarms: tuple[str, ...] = DEFAULT_SWARMS
    """Swarm configurations, see :func:`parse_swarm`."""
    accumulate: int = 4
    """Micro-batches per optimizer step on every side (1F1B's ``n_micro``, the swarm's ``accumulate``)."""
    lr_warmup_steps: int = 4
    target_mb: int = 96
    """N = this many micro-batches: the reference's held-out loss there is the target."""
    eval_every: int = 2
    """Optimizer steps between held-out evaluations (every run, the reference included)."""
    eval_batches: int = 4
    """Held-out micro-batches per evaluation."""
    tolerance: float = 1e-3
    """Reached = held-out loss <= target x (1 + tolerance)."""
    max_factor: float = 3.0
    """Cap of a run: this many times N tokens."""
    max_train_s: float = 420.0
    """Cap of a run: seconds of its clock (see the module docstring)."""
    max_inflight: int = 8
    keeper: bool = True
    """Run each swarm's ``swarm init`` with its keeper (the default of a real run: stage snapshots are
    downloaded from the peers over their links while they train); False = ``--no-keeper``."""
    threads: int | None = None
    """torch threads per stage process; None = cores / stages, at least 1 (as benchmarks/links.py)."""
    loopback: bool = False
    data_bytes: int | None = None
    start_timeout_s: float = 240.0
    run_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        for name in ("accumulate", "target_mb", "eval_every", "eval_batches", "max_inflight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} = {getattr(self, name)} must be at least 1")
        if self.target_mb % self.accumulate:
            raise ConfigError(
                f"target_mb = {self.target_mb} must be a multiple of accumulate = {self.accumulate} "
                "(the reference runs whole optimizer steps)"
            )
        if not self.max_factor >= 1 or not self.max_train_s > 0 or not 0 <= self.tolerance < 0.1:
            raise ConfigError(
                f"max_factor = {self.max_factor} must be >= 1, max_train_s = {self.max_train_s} > 0 and "
                f"tolerance = {self.tolerance} in [0, 0.1)"
            )
        for r in self.rates:
            format_rate(r)
        if self.loopback and any(format_rate(r) != "none" for r in self.rates):
            raise ConfigError(f"rates {list(self.rates)} need the network lab; --loopback allows only 'none'")
        for s in self.swarms:
            parse_swarm(s)

    @property
    def cap_steps(self) -> int:
        return -(-int(self.max_factor * self.target_mb) // self.accumulate)

    def links_config(self) -> LinksConfig:
        """The links benchmark's config for the same model and swarm settings (its spec and run pieces)."""
        a = self.accumulate
        return LinksConfig(
            spec_path=self.spec_path,
            model_overrides=dict(self.model_overrides),
            rates=tuple(self.rates),
            sweep_rates=(),
            accumulate=a,
            lr_warmup_steps=self.lr_warmup_steps,
            throughput_mb=3 * a,
            warmup_mb=a,
            convergence_mb=a,
            pipe_n_micro=a,
            max_inflight=self.max_inflight,
            threads=self.threads,
            loopback=self.loopback,
            data_bytes=self.data_bytes,
            start_timeout_s=self.start_timeout_s,
            run_timeout_s=self.run_timeout_s,
        )


def plan(cfg: TargetConfig) -> list[Job]:
    """The reference first, then per rate 1F1B and every swarm configuration (pure)."""
    cap_mb = cfg.cap_steps * cfg.accumulate
    jobs = [Job("single", micro_batches=cfg.target_mb, purposes=("target",), threads=None)]
    for rate in (format_rate(r) for r in cfg.rates):
        jobs.append(Job("pipelining", rate, schedule="1f1b", micro_batches=cap_mb, purposes=("to_target",)))
        for s in map(parse_swarm, cfg.swarms):
            jobs.append(
                Job(
                    "swarm",
                    rate,
                    s.codec,
                    s.mode,
                    micro_batches=cap_mb,
                    purposes=("to_target",),
                    subspace=s.subspace,
                )
            )
    return jobs


def swarm_stop(target: float, max_train_s: float) -> Callable[[list[dict[str, Any]]], bool]:
    """``stop_when`` of a swarm run: an evaluation at or below ``target``, or the time cap reached."""

    def stop(records: list[dict[str, Any]]) -> bool:
        if any(r.get("type") == "eval" and (r.get("eval_loss") or float("inf")) <= target for r in records):
            return True
        steps = [r for r in records if r.get("type") == "step"]
        t0 = _first_send(steps)
        return bool(steps) and t0 is not None and steps[-1]["time"] - t0 >= max_train_s

    return stop


def _run_job(
    lab: Any, cfg: TargetConfig, job: Job, work: Path, nodes: dict[str, Any], base: Path, target: float | None
) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    lcfg = cfg.links_config()
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // len(nodes["stages"]))
    if job.kind == "single":
        scfg = SingleConfig(
            spec_path=str(base),
            accumulate=cfg.accumulate,
            steps=cfg.target_mb // cfg.accumulate,
            warmup_steps=0,
            data_bytes=cfg.data_bytes,
            timeout_s=cfg.run_timeout_s,
            eval_tokens=cfg.eval_batches * n_tokens_per_mb(base),
            eval_every=cfg.eval_every,
        )
        return run_single(scfg, work) | {"rate": "none"}
    if target is None:
        raise SwarmError("no target loss: the single-process reference failed (see its error above)")
    goal = target * (1 + cfg.tolerance)
    if job.kind == "pipelining":
        pcfg = PipeConfig(
            spec_path=str(base),
            schedule="1f1b",
            n_micro=cfg.accumulate,
            steps=cfg.cap_steps,
            warmup_steps=1,
            threads=threads,
            data_bytes=cfg.data_bytes,
            timeout_s=cfg.run_timeout_s,
            eval_every=cfg.eval_every,
            eval_batches=cfg.eval_batches,
            target_loss=goal,
            max_train_s=cfg.max_train_s,
        )
        return run_pipelining(lab, pcfg, nodes["stages"], work) | {"rate": job.rate}
    return run_swarm(
        lab,
        lcfg,
        job,
        work,
        nodes,
        boot_maddr=nodes.get("boot_maddr"),
        keeper=cfg.keeper,
        eval_every=cfg.eval_every,
        eval_batches=cfg.eval_batches,
        stop_when=swarm_stop(goal, cfg.max_train_s),
    )


def n_tokens_per_mb(spec_path: Path) -> int:
    from swarm.run.spec import RunSpec

    return RunSpec.from_json(spec_path.read_bytes()).tokens_per_micro_batch


def run_all(
    cfg: TargetConfig,
    jobs: list[Job],
    *,
    name: str,
    command: str,
    say: Callable[[str], None] = print,
    results_dir: Path = RESULTS_DIR,
) -> dict[str, Any]:
    """Run ``jobs`` (the reference first) in one lab; ``results/NAME.json`` after every job."""
    from benchmarks.time_to_target_report import analyse, plot
    from swarm.run.spec import RunSpec

    results_dir.mkdir(parents=True, exist_ok=True)
    base = base_spec_dict(cfg.links_config())
    base.update(run_id="ttt-base", codecs={"activations": "none", "gradients": "none"})
    spec = RunSpec.from_dict(base)
    stage_nodes = [f"s{i}" for i in range(spec.num_stages)]
    nodes: dict[str, Any] = {"boot": "boot", "trainer": "trainer", "stages": stage_nodes}
    report = _header(cfg, spec, name, command)
    out_json = results_dir / f"{name}.json"
    t0 = time.perf_counter()
    target: float | None = None
    with tempfile.TemporaryDirectory(prefix="swarmpipe-ttt-") as tmp:
        work = Path(tmp)
        base_path = work / "base.json"
        base_path.write_bytes(spec.canonical_bytes())
        with open_lab(["boot", "trainer", *stage_nodes], loopback=cfg.loopback) as lab:
            report["lab"] = getattr(lab, "tag", "loopback")
            if any(j.kind == "swarm" for j in jobs):
                _, nodes["boot_maddr"] = start_bootstrap(lab, nodes["boot"], work, cfg.start_timeout_s)
            for i, job in enumerate(jobs):
                say(f"[{i + 1}/{len(jobs)}] {job.name} ({time.perf_counter() - t0:.0f} s elapsed)")
                lab.set_rate(job.rate)
                load = os.getloadavg()[0]
                t = time.perf_counter()
                try:
                    res = _run_job(lab, cfg, job, work / f"job{i}", nodes, base_path, target)
                except (SwarmError, LabError, OSError, subprocess.SubprocessError, ValueError, KeyError) as e:
                    res = {"kind": job.kind, "rate": job.rate, "error": f"{type(e).__name__}: {e}"}
                    say(f"    FAILED: {res['error'][:800]}")
                if job.kind == "single" and res.get("eval_loss") is not None:
                    target = res["eval_loss"]
                    report["target_loss"] = target
                    say(f"    target: held-out loss {target:.4f} after {report['target_tokens']} tokens")
                res.update(
                    name=job.name,
                    codec=job.codec,
                    mode=job.mode,
                    subspace=job.subspace,
                    schedule=job.schedule,
                    load_1min=[round(load, 1), round(os.getloadavg()[0], 1)],
                    job_s=time.perf_counter() - t,
                )
                report["results"].append(res)
                report["wall_min"] = (time.perf_counter() - t0) / 60
                out_json.write_text(json.dumps(report, indent=1, default=str))
    remove_stale_sockets(socket_prefix())
    report["analysis"] = analyse(cfg, report)
    report["plots"] = plot(report, name, results_dir)
    report["wall_min"] = (time.perf_counter() - t0) / 60
    out_json.write_text(json.dumps(report, indent=1, default=str))
    return report


def _header(cfg: TargetConfig, spec: Any, name: str, command: str) -> dict[str, Any]:
    """The report's fixed part: what ran, where, on which model."""
    return {
        "name": name,
        "command": command,
        "config": asdict(cfg),
        "machine": machine_info(),
        "commit": _commit(),
        "n_params": spec.n_params(),
        "num_stages": spec.num_stages,
        "micro_batch": f"{spec.micro_batch_size}x{spec.model.seq_len}",
        "tokens_per_mb": spec.tokens_per_micro_batch,
        "target_tokens": cfg.target_mb * spec.tokens_per_micro_batch,
        "results": [],
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def quick_config(**kw: Any) -> TargetConfig:
    """``--quick``: the links benchmark's quick model (1/4 width), 20mbit only, 2 swarm configurations,
    a short budget: a few minutes, mostly process start-up."""
    base: dict[str, Any] = {
        "model_overrides": dict(QUICK_MODEL),
        "rates": ("20mbit",),
        "swarms": ("blockwise8:async", "ss32+blockwise8:async"),
        "accumulate": 4,
        "target_mb": 32,
        "eval_batches": 2,
        "max_train_s": 120.0,
        "data_bytes": 1 << 20,
    }
    base.update(kw)
    return TargetConfig(**base)


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.time_to_target_report import SECTION, analyse, markdown_section, plot

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.time_to_target",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--spec", default="examples/bench.yaml")
    parser.add_argument("--quick", action="store_true", help="small model, one rate (a few minutes)")
    parser.add_argument("--loopback", action="store_true", help="no namespaces or rate limits (not root)")
    parser.add_argument("--rates", nargs="+", default=None, help="link rates, e.g. 100mbit 20mbit")
    parser.add_argument(
        "--swarms", nargs="+", default=None, help="e.g. blockwise8:async ss32+blockwise8:async"
    )
    parser.add_argument("--target-mb", type=int, default=None, help="N in micro-batches")
    parser.add_argument(
        "--no-keeper",
        action="store_true",
        help="run the swarms' `swarm init` without its keeper (no stage snapshots over the peers' links)",
    )
    parser.add_argument("--max-train-s", type=float, default=None, help="time cap of each run")
    parser.add_argument("--name", default=None, help="results name (default time_to_target[_quick])")
    parser.add_argument("--plan", action="store_true", help="print the runs and exit")
    parser.add_argument("--no-markdown", action="store_true", help="do not touch BENCHMARKS.md")
    parser.add_argument(
        "--render", metavar="NAME", default=None, help="rewrite the section from results/NAME.json"
    )
    args = parser.parse_args(argv)
    if args.render:
        report = json.loads((RESULTS_DIR / f"{args.render}.json").read_text())
        stored = {k: tuple(v) if isinstance(v, list) else v for k, v in report["config"].items()}
        report["analysis"] = analyse(TargetConfig(**stored), report)
        report["plots"] = plot(report, args.render, RESULTS_DIR)
        reading = RESULTS_DIR / f"{args.render}_reading.md"
        if reading.exists():
            report["reading"] = reading.read_text().strip()
        write_section(markdown_section(report))
        print(f"rewrote the {SECTION!r} section of {MARKDOWN} from results/{args.render}.json")
        return 0
    kw: dict[str, Any] = {"spec_path": args.spec, "loopback": args.loopback}
    if args.rates:
        kw["rates"] = tuple(args.rates)
    elif args.loopback:
        kw["rates"] = ("none",)
    if args.swarms:
        kw["swarms"] = tuple(args.swarms)
    if args.target_mb:
        kw["target_mb"] = args.target_mb
    if args.max_train_s:
        kw["max_train_s"] = args.max_train_s
    if args.no_keeper:
        kw["keeper"] = False
    cfg = quick_config(**kw) if args.quick else TargetConfig(**kw)
    jobs = plan(cfg)
    if args.plan:
        for j in jobs:
            print(f"{j.name:50s} up to {j.micro_batches:4d} mb")
        return 0
    if not args.loopback:
        reason = lab_unavailable_reason(probe=True)
        if reason:
            print(f"cannot run the network lab: {reason}", file=sys.stderr)
            return 2
    name = args.name or (
        "time_to_target" + ("_quick" if args.quick else "") + ("_loopback" if args.loopback else "")
    )
    command = "python -m benchmarks.time_to_target " + " ".join(argv if argv is not None else sys.argv[1:])
    report = run_all(cfg, jobs, name=name, command=command.strip())
    if args.no_markdown or args.quick or args.loopback:
        print(f"results in {RESULTS_DIR / name}.json; `--render {name}` writes them to BENCHMARKS.md")
    else:
        write_section(markdown_section(report))
    print(json.dumps(report["analysis"]["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
