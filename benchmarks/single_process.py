"""The same model trained in one process: the compute-bound limit of this machine.

No network, no pipeline: ``swarm.run.model.build_model(spec)`` (the stages chained, identical weights), the
same micro-batches as a swarm trainer with the same seed and data (``swarm.train.data``), ``accumulate``
micro-batches per optimizer step, the spec's schedule and clipping *per stage* (what each stage peer
does, so the only difference to the swarm is the distribution). Two optimizers (``--optimizer``):

- ``torch_adamw``: ``torch.optim.AdamW`` with the spec's lr, betas and weight decay (whatever
  ``optimizer.name`` says); the default, and the reference of ``benchmarks/links.py``;
- ``stage``: the spec's own optimizer through ``swarm.run.optimizer.StageOptimizer``, one per stage, fed
  exactly as a stage peer feeds it (gradients of ``accumulate`` micro-batches, then a step); the
  reference of ``benchmarks/convergence.py``.

With ``eval_tokens`` the trained model's held-out loss is measured at the end (:func:`held_out_loss`:
the fixed, evenly spaced held-out windows of ``swarm.train.data.TokenData``, the same ones an exported swarm
model is evaluated on). It uses every core unless told otherwise.

Run::

    python -m benchmarks.single_process --spec examples/bench.yaml --steps 8 --accumulate 4
    python -m benchmarks.single_process --spec examples/demo.yaml --optimizer stage --steps 50 --eval-tokens 65536

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
from swarm.train.reference import StageOptimizers, held_out_loss

__all__ = ["OPTIMIZERS", "SingleConfig", "held_out_loss", "run_single", "train_single"]

OPTIMIZERS = ("torch_adamw", "stage")


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
    """Read at most this much text (None = swarm.train.data's default)."""
    threads: int | None = None
    """torch threads; None = torch's default (every core)."""
    timeout_s: float = 1800.0
    optimizer: str = "torch_adamw"
    """``torch_adamw`` or ``stage`` (the spec's optimizer via ``StageOptimizer``); see the module docstring."""
    data_source: str | None = None
    """``swarm.train.data`` source (a trainer's ``--data``); None = the standard-library corpus."""
    held_out_fraction: float | None = None
    """Held-out fraction of the token stream (None = swarm.train.data's default). A trainer must use the same
    value to read the same training windows."""
    eval_tokens: int = 0
    """Held-out tokens evaluated after training (rounded up to whole micro-batches); 0 = no evaluation."""
    eval_every: int = 0
    """Also evaluate them every N optimizer steps (a held-out curve; the time is left out of ``wall_s``)."""
    metrics_path: str | None = None
    """Append one JSON line per optimizer step here while training (``{"type": "step", "time", "tokens",
    "loss"}``, the fields of a trainer's metrics.jsonl), for progress; None = none."""

    def __post_init__(self) -> None:
        for name in ("accumulate", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} = {getattr(self, name)} must be at least 1")
        if not 0 <= self.warmup_steps < self.steps:
            raise ConfigError(f"warmup_steps = {self.warmup_steps} must lie in [0, steps = {self.steps})")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer = {self.optimizer!r} must be one of {', '.join(OPTIMIZERS)}")
        if self.eval_tokens < 0:
            raise ConfigError(f"eval_tokens = {self.eval_tokens} must be >= 0 (0 = no evaluation)")
        if self.eval_every < 0 or (self.eval_every and not self.eval_tokens):
            raise ConfigError(
                f"eval_every = {self.eval_every} must be >= 0, and evaluating needs eval_tokens > 0"
            )


def data_config(cfg: SingleConfig):
    """The ``swarm.train.data.DataConfig`` a trainer given the same options would use."""
    from swarm.train.data import DataConfig

    kw: dict[str, Any] = {"source": cfg.data_source}
    if cfg.data_bytes is not None:
        kw["max_bytes"] = cfg.data_bytes
    if cfg.held_out_fraction is not None:
        kw["held_out_fraction"] = cfg.held_out_fraction
    return DataConfig(**kw)


def train_single(cfg: SingleConfig) -> dict[str, Any]:
    """Train in this process; per-step times and losses, peak RSS, and the held-out loss if asked."""
    import torch

    from swarm.run.model import build_model, lm_loss
    from swarm.train.data import build_data

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    spec = _load_spec(cfg.spec_path)
    model = build_model(spec)
    ocfg = spec.optimizer
    stage_opts = StageOptimizers(model, spec, cfg.accumulate) if cfg.optimizer == "stage" else None
    opt = (
        None
        if stage_opts is not None
        else torch.optim.AdamW(
            model.parameters(), lr=ocfg.lr, betas=ocfg.betas, weight_decay=ocfg.weight_decay, eps=1e-8
        )
    )
    data, _ = build_data(data_config(cfg), seq_len=spec.model.seq_len, vocab_size=spec.model.vocab_size)
    stream = data.stream(spec.micro_batch_size, seed=cfg.seed)
    tokens_per_step = cfg.accumulate * spec.micro_batch_size * spec.model.seq_len
    metrics = open(cfg.metrics_path, "a") if cfg.metrics_path else None  # noqa: SIM115 (closed in finally)
    steps = []
    t0 = time.perf_counter()
    eval_s = 0.0  # left out of wall_s

    def evaluate() -> float:
        if stage_opts is not None:
            stage_opts.load_into_model()
        model.eval()
        loss, _ = held_out_loss(model, data, batch=spec.micro_batch_size, tokens=cfg.eval_tokens)
        model.train()
        return loss

    try:
        for step in range(cfg.steps):
            ts = time.perf_counter()
            total = 0.0
            if stage_opts is not None:
                # each stage's optimizer averages its accumulated gradients, clips and steps by itself
                for _ in range(cfg.accumulate):
                    tokens, targets = next(stream)  # (B, T), (B, T)
                    loss = lm_loss(stage_opts.forward(tokens), targets)
                    loss.backward()
                    stage_opts.after_backward()
                    total += float(loss.detach())
            else:
                assert opt is not None
                for group in opt.param_groups:
                    group["lr"] = ocfg.lr_at(step)
                opt.zero_grad(set_to_none=True)
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
            rec = {
                "step": step,
                "time_s": te - ts,
                "wall_s": te - t0 - eval_s,
                "loss": total / cfg.accumulate,
                "tokens": (step + 1) * tokens_per_step,
            }
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                rec["eval_loss"] = evaluate()
                eval_s += time.perf_counter() - te
            steps.append(rec)
            if metrics is not None:
                line = {"type": "step", "step": step + 1, "time": rec["wall_s"], "tokens": rec["tokens"]}
                metrics.write(json.dumps({**line, "loss": rec["loss"]}) + "\n")
                metrics.flush()
    finally:
        if metrics is not None:
            metrics.close()
    result: dict[str, Any] = {
        "steps": steps,
        "peak_rss_bytes": peak_rss_bytes(),
        "threads": torch.get_num_threads(),
        "tokens_per_step": tokens_per_step,
        "optimizer_name": ocfg.name,
    }
    if cfg.eval_tokens:
        n = max(1, -(-cfg.eval_tokens // (spec.micro_batch_size * spec.model.seq_len)))
        result.update(eval_loss=evaluate(), held_out_tokens=n * spec.micro_batch_size * spec.model.seq_len)
        steps[-1]["eval_loss"] = result["eval_loss"]
    return result


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
        "losses": [
            {"tokens": s["tokens"], "wall_s": s["wall_s"], "loss": s["loss"]}
            | ({"eval_loss": s["eval_loss"]} if "eval_loss" in s else {})
            for s in res["steps"]
        ],
        "peak_rss_mb": res["peak_rss_bytes"] / 2**20 if res["peak_rss_bytes"] else None,
        "wall_s": time.perf_counter() - t,
        "optimizer": cfg.optimizer,
        "optimizer_name": res.get("optimizer_name"),
        "eval_loss": res.get("eval_loss"),
        "held_out_tokens": res.get("held_out_tokens"),
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
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="torch_adamw")
    parser.add_argument("--eval-tokens", type=int, default=0, help="held-out tokens evaluated at the end")
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
        optimizer=args.optimizer,
        eval_tokens=args.eval_tokens,
    )
    with tempfile.TemporaryDirectory(prefix="swarmpipe-single-") as tmp:
        summary = run_single(cfg, tmp)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    print(
        f"single process: {summary['tokens_per_s']:.0f} tokens/s (step {summary['step_s']:.2f} s, "
        f"{summary['threads']} threads), peak RSS {summary['peak_rss_mb']:.0f} MiB, "
        f"loss {summary['losses'][0]['loss']:.3f} -> {summary['losses'][-1]['loss']:.3f}"
        + (f", held-out {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
