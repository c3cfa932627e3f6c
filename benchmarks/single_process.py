"""The same model trained in one process: the compute-bound limit of this machine.

No network, no pipeline: ``swarm.model.build_model(spec)`` (the stages chained, identical weights), the
same micro-batches as a swarm trainer with the same seed, ``accumulate`` micro-batches per optimizer
step, AdamW with the spec's schedule and clipping *per stage* (what each stage peer does, so the only
difference to the swarm is the distribution). It uses every core unless told otherwise.

Run::

    python -m benchmarks.single_process --spec examples/bench.yaml --steps 8 --accumulate 4

``benchmarks/links.py`` calls :func:`run_single`, which starts this module as a child process so
that its peak resident memory (VmHWM) is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.pipelining_baseline import ROOT, _load_spec, peak_rss_bytes
from swarm.errors import ConfigError, SwarmError

__all__ = ["SingleConfig", "run_single", "train_single"]


@dataclass(frozen=True, kw_only=True)
class SingleConfig:
    """One single-process run."""

    spec_path: str
    """Run spec (YAML or JSON)."""
    accumulate: int = 1
    """Micro-batches per optimizer step (the swarm's ``optimizer.accumulate``)."""
    steps: int = 8
    """Optimizer steps, warm-up included."""
    warmup_steps: int = 1
    """First steps left out of the throughput median."""
    seed: int = 0
    """Data seed (a trainer's ``--seed``)."""
    data_bytes: int | None = None
    """Read at most this much text (None = swarm.data's default)."""
    threads: int | None = None
    """torch threads; None = torch's default (every core)."""
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        for name in ("accumulate", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} = {getattr(self, name)} must be at least 1")
        if not 0 <= self.warmup_steps < self.steps:
            raise ConfigError(f"warmup_steps = {self.warmup_steps} must lie in [0, steps = {self.steps})")


def train_single(cfg: SingleConfig) -> dict[str, Any]:
    """Train in this process; per-step times and losses, peak RSS."""
    import torch

    from swarm.data import DataConfig, build_data
    from swarm.model import build_model, lm_loss

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    spec = _load_spec(cfg.spec_path)
    model = build_model(spec)
    ocfg = spec.optimizer
    opt = torch.optim.AdamW(
        model.parameters(), lr=ocfg.lr, betas=ocfg.betas, weight_decay=ocfg.weight_decay, eps=1e-8
    )
    dkw = {} if cfg.data_bytes is None else {"max_bytes": cfg.data_bytes}
    data, _ = build_data(DataConfig(**dkw), seq_len=spec.model.seq_len, vocab_size=spec.model.vocab_size)
    stream = data.stream(spec.micro_batch_size, seed=cfg.seed)
    tokens_per_step = cfg.accumulate * spec.micro_batch_size * spec.model.seq_len
    steps = []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = ocfg.lr_at(step)
        ts = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(cfg.accumulate):
            tokens, targets = next(stream)  # (B, T), (B, T)
            loss = lm_loss(model(tokens), targets)
            (loss / cfg.accumulate).backward()
            total += float(loss.detach())
        if ocfg.clip_norm is not None:
            for stage in model.stages:  # per stage, as each stage peer clips its own gradient
                torch.nn.utils.clip_grad_norm_(stage.parameters(), ocfg.clip_norm)
        opt.step()
        te = time.perf_counter()
        steps.append(
            {
                "step": step,
                "time_s": te - ts,
                "wall_s": te - t0,
                "loss": total / cfg.accumulate,
                "tokens": (step + 1) * tokens_per_step,
            }
        )
    return {
        "steps": steps,
        "peak_rss_bytes": peak_rss_bytes(),
        "threads": torch.get_num_threads(),
        "tokens_per_step": tokens_per_step,
    }


def run_single(cfg: SingleConfig, work_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Run :func:`train_single` in a child process; the summary (tokens/s, losses, peak RSS)."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    cfg_path, out, log_path = work / "single.json", work / "single-result.json", work / "single.log"
    cfg_path.write_text(json.dumps(asdict(cfg)))
    out.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if cfg.threads is not None:
        env["OMP_NUM_THREADS"] = str(cfg.threads)
    t = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.single_process", "--worker", str(cfg_path), "--out", str(out)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(ROOT),
            env=env,
            timeout=cfg.timeout_s,
        )
    if proc.returncode != 0 or not out.exists():
        raise SwarmError(
            f"single-process run failed (exit {proc.returncode}):\n{log_path.read_text()[-2000:]}"
        )
    res = json.loads(out.read_text())
    times = [s["time_s"] for s in res["steps"]]
    step_s = statistics.median(times[cfg.warmup_steps :])
    return {
        "kind": "single",
        "accumulate": cfg.accumulate,
        "steps": cfg.steps,
        "warmup_steps": cfg.warmup_steps,
        "threads": res["threads"],
        "tokens_per_step": res["tokens_per_step"],
        "step_s": step_s,
        "step_times_s": times,
        "tokens_per_s": res["tokens_per_step"] / step_s,
        "losses": [{"tokens": s["tokens"], "wall_s": s["wall_s"], "loss": s["loss"]} for s in res["steps"]],
        "peak_rss_mb": res["peak_rss_bytes"] / 2**20 if res["peak_rss_bytes"] else None,
        "wall_s": time.perf_counter() - t,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.single_process",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--spec", default="examples/bench.yaml")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="write the summary JSON here")
    args = parser.parse_args(argv)
    if args.worker:
        cfg = SingleConfig(**json.loads(Path(args.worker).read_text()))
        result = train_single(cfg)
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(args.out)
        return 0
    import tempfile

    cfg = SingleConfig(
        spec_path=os.path.abspath(args.spec),
        accumulate=args.accumulate,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        threads=args.threads,
    )
    with tempfile.TemporaryDirectory(prefix="swarmpipe-single-") as tmp:
        summary = run_single(cfg, tmp)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    print(
        f"single process: {summary['tokens_per_s']:.0f} tokens/s (step {summary['step_s']:.2f} s, "
        f"{summary['threads']} threads), peak RSS {summary['peak_rss_mb']:.0f} MiB, "
        f"loss {summary['losses'][0]['loss']:.3f} -> {summary['losses'][-1]['loss']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
