"""The baseline a user would otherwise pick: ``torch.distributed.pipelining`` over gloo.

One process per stage (rank ``i`` holds ``swarm.run.model.build_stage(spec, i)``, so the weights are the
swarm's), the same micro-batches (``spec.micro_batch_size`` sequences of ``model.seq_len`` tokens,
drawn from the same data with the same seed as a trainer), GPipe or 1F1B schedule, ``n_micro``
micro-batches per optimizer step, AdamW with the spec's learning rate schedule and per-stage clipping
(what a stage peer does). Activations and gradients cross the links as fp32 tensors (gloo sends them
uncompressed): 2 x (stages - 1) x d_model x 4 bytes per token.

Run one baseline on its own (its own lab; ``--loopback`` without root)::

    python -m benchmarks.pipelining_baseline --spec examples/bench.yaml --schedule 1f1b --steps 6 \
        --n-micro 8 --rate 20mbit
    python -m benchmarks.pipelining_baseline --spec examples/tiny.yaml --schedule gpipe --loopback

``benchmarks/links.py`` calls :func:`run_pipelining` inside its own lab, next to the swarm runs;
``benchmarks/bubbles.py`` with emulated compute (``--emulate-compute-ms F,B``: each micro-batch holds a
stage F ms forward, B ms backward) and ``benchmarks/gpu_check.py`` with the stages on one GPU
(``--device cuda``); both through ``benchmarks/busy.py``, which also counts each rank's busy seconds.
Each rank runs ``python -m benchmarks.pipelining_baseline --worker ...`` and writes one JSON file:
per-step wall times and busy seconds, the last rank's losses, its peak resident memory (VmHWM) and,
on CUDA, its peak GPU memory. With ``eval_every`` the ranks also evaluate held-out loss through the
pipeline between steps (``benchmarks/pipe_heldout.py``) and, with ``target_loss``, stop together at the
first evaluation at or below it (``benchmarks/time_to_target.py``).

(Over 400 lines: the rank, the driver, the summary and the command line of one baseline, which share
``PipeConfig``; the held-out evaluation is a module of its own.)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.netlab import Lab, LabError, open_lab
from swarm.errors import ConfigError

__all__ = ["PipeConfig", "run_pipelining", "peak_rss_bytes", "utilisation", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b")
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, kw_only=True)
class PipeConfig:
    """One pipelining run; the same object drives the driver and (as JSON) every rank."""

    spec_path: str
    """Run spec (YAML or JSON) whose model, stages, micro-batch size and optimizer are used."""
    schedule: str = "1f1b"
    """``gpipe`` (all forwards, then all backwards) or ``1f1b`` (one forward, one backward)."""
    n_micro: int = 8
    """Micro-batches per optimizer step. Fewer leave a bigger pipeline bubble: (S-1)/(n_micro+S-1)."""
    steps: int = 6
    """Optimizer steps to run, warm-up included."""
    warmup_steps: int = 1
    """First steps left out of the throughput median (gloo connects and buffers allocate there)."""
    seed: int = 0
    """Data seed (the trainer's ``--seed``): the same micro-batches a swarm trainer with it reads."""
    data_bytes: int | None = None
    """Read at most this much text (None = swarm.train.data's default)."""
    threads: int = 1
    """torch threads per rank (OMP_NUM_THREADS); the swarm's stage peers get the same."""
    timeout_s: float = 1800.0
    """Give up (and stop every rank) after this long."""
    emulate_s: tuple[float, float] | None = None
    """(forward, backward) seconds each micro-batch occupies a stage at least, the rest slept after the
    real compute (``benchmarks/busy.py``; the stage peers' ``--emulate-compute-ms``); None = real only."""
    fused_adamw: bool = False
    """``torch.optim.AdamW(fused=True)``: the fused kernel the stage peers' optimizer uses where torch has
    one (swarm/run/optimizer.py). Off by default: the default AdamW is what a user of torch pipelining
    would pick; on, both sides step with the same kernel."""
    device: str = "cpu"
    """Where the stages compute (``cpu``, ``cuda``, ``mps``); tensors cross the pipeline on the host."""
    eval_every: int = 0
    """Held-out loss through the pipeline every N optimizer steps (``benchmarks/pipe_heldout.py``; its time
    is left out of the steps' clock, see ``train_s``); 0 = never."""
    eval_batches: int = 4
    """Held-out micro-batches per evaluation (``TokenData.eval_batches``: the swarm trainer's windows)."""
    target_loss: float | None = None
    """Stop after the first evaluation at or below this loss (``steps`` stays the cap); None = run all."""
    max_train_s: float | None = None
    """Stop at the first evaluation after this many seconds of training (evaluations excluded)."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule {self.schedule!r} is not one of {SCHEDULES}; pick gpipe or 1f1b")
        for name in ("n_micro", "steps", "threads", "eval_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} = {getattr(self, name)} must be at least 1")
        if self.emulate_s is not None:  # JSON (the ranks' copy) turns the pair into a list
            object.__setattr__(self, "emulate_s", tuple(float(v) for v in self.emulate_s))
            if len(self.emulate_s) != 2 or min(self.emulate_s) < 0:
                raise ConfigError(f"emulate_s = {self.emulate_s} must be (forward, backward) seconds >= 0")
        if not 0 <= self.warmup_steps < self.steps:
            raise ConfigError(
                f"warmup_steps = {self.warmup_steps} must lie in [0, steps = {self.steps}) so that at least "
                "one step is measured"
            )
        if self.eval_every < 0:
            raise ConfigError(f"eval_every = {self.eval_every} must be >= 0 (0 = no evaluation)")
        if (self.target_loss is not None or self.max_train_s is not None) and not self.eval_every:
            raise ConfigError(
                "target_loss / max_train_s are checked at evaluations: give eval_every >= 1 as well"
            )


def peak_rss_bytes(pid: int | None = None) -> int | None:
    """Peak resident memory (VmHWM) of a live process (default: this one), or None if unreadable."""
    try:
        with open(f"/proc/{pid or 'self'}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ------------------------------------------------------------------------------------------ rank


def _load_spec(path: str):
    from swarm.run.spec import RunSpec

    if path.endswith(".json"):
        return RunSpec.from_json(Path(path).read_bytes())
    return RunSpec.from_yaml(path)


def _worker(cfg: PipeConfig, rank: int, master: str, out: Path) -> None:
    """One rank: its stage, the schedule, ``cfg.steps`` optimizer steps; results to ``out`` (JSON)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from benchmarks.busy import BusyStage
    from benchmarks.pipe_heldout import pipeline_heldout
    from swarm.run.model import autocast_dtype, build_stage, lm_loss
    from swarm.train.data import DataConfig, build_data

    torch.set_num_threads(cfg.threads)
    spec = _load_spec(cfg.spec_path)
    world = spec.num_stages
    mcfg = spec.model
    mb, seq = spec.micro_batch_size, mcfg.seq_len
    t_start = time.perf_counter()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}",
        rank=rank,
        world_size=world,
        timeout=__import__("datetime").timedelta(seconds=cfg.timeout_s),
    )
    try:
        device = torch.device(cfg.device)
        module = BusyStage(
            build_stage(spec, rank),
            device=device,
            autocast=autocast_dtype(spec, device),
            emulate_s=cfg.emulate_s,
        )
        # Shapes are inferred at the first step (a few bytes of metadata over the link, in warm-up).
        # (Explicit input_args/output_args left the first stage without its output gradient in torch
        # 2.13, so inference it is.)
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        sched_cls = ScheduleGPipe if cfg.schedule == "gpipe" else Schedule1F1B
        schedule = sched_cls(stage, n_microbatches=cfg.n_micro, loss_fn=lm_loss)
        ocfg = spec.optimizer
        opt = torch.optim.AdamW(
            module.parameters(),
            lr=ocfg.lr,
            betas=ocfg.betas,
            weight_decay=ocfg.weight_decay,
            eps=1e-8,
            fused=cfg.fused_adamw or None,
        )

        stream = held_out = None
        if rank in (0, world - 1):
            dkw = {} if cfg.data_bytes is None else {"max_bytes": cfg.data_bytes}
            data, _ = build_data(DataConfig(**dkw), seq_len=seq, vocab_size=mcfg.vocab_size)
            stream = data.stream(mb, seed=cfg.seed)
            held_out = data.eval_batches(mb, cfg.eval_batches) if cfg.eval_every else None
        dist.barrier()  # every rank built its stage (and data): time from here
        t0 = time.perf_counter()
        eval_s = 0.0  # seconds spent in evaluations, left out of ``train_s``
        steps: list[dict[str, Any]] = []
        for step in range(cfg.steps):
            for group in opt.param_groups:
                group["lr"] = ocfg.lr_at(step)
            tokens = targets = None
            if stream is not None:
                parts = [next(stream) for _ in range(cfg.n_micro)]
                tokens = torch.cat([p[0] for p in parts])  # (n_micro * B, T)
                targets = torch.cat([p[1] for p in parts])
            ts = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            if rank == 0:
                schedule.step(tokens)
            elif rank == world - 1:
                schedule.step(target=targets, losses=losses)
            else:
                schedule.step()
            if ocfg.clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), ocfg.clip_norm)
            opt.step()
            te = time.perf_counter()
            rec: dict[str, Any] = {
                "step": step,
                "time_s": te - ts,
                "wall_s": te - t0,
                "busy_s": module.busy_s,
                "cpu_s": time.process_time(),  # this rank's CPU so far: busy fraction = CPU / wall
            }
            if losses:
                rec["loss"] = float(torch.stack([x.detach().float() for x in losses]).mean())
            rec["train_s"] = te - t0 - eval_s
            steps.append(rec)
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                give_up = cfg.max_train_s is not None and rec["train_s"] >= cfg.max_train_s
                rec["eval_loss"], stop = pipeline_heldout(
                    module,
                    rank,
                    world,
                    held_out,
                    n_batches=cfg.eval_batches,
                    target=cfg.target_loss,
                    give_up=give_up,
                )
                rec["eval_s"] = time.perf_counter() - te
                eval_s += rec["eval_s"]
                if stop:
                    break
        dist.barrier()
    finally:
        dist.destroy_process_group()
    result = {
        "rank": rank,
        "steps": steps,
        "peak_rss_bytes": peak_rss_bytes(),
        "params": sum(p.numel() for p in module.parameters()),
        "startup_s": t0 - t_start,
        "threads": torch.get_num_threads(),
        "device_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)


# ---------------------------------------------------------------------------------------- driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pipelining(
    lab: Lab, cfg: PipeConfig, nodes: Sequence[str], work_dir: str | os.PathLike[str]
) -> dict[str, Any]:
    """Run one baseline with rank ``i`` on ``nodes[i]`` of ``lab``; returns the summary dict.

    Summary: ``tokens_per_s`` (tokens per optimizer step / median step time after warm-up),
    ``step_s`` (median), ``losses`` (per step: tokens, wall seconds, loss), ``peak_rss_mb`` per rank,
    ``wire_bytes_per_token`` (link counters, lab only) and ``payload_bytes_per_token`` (fp32 tensors).
    """
    spec = _load_spec(cfg.spec_path)
    world = spec.num_stages
    if len(nodes) < world:
        raise ConfigError(f"the spec has {world} stages but only {len(nodes)} lab nodes were given")
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    port = 29517 if lab.shaped else _free_port()
    master = f"{lab.address(nodes[0])}:{port}"
    cfg_path = work / f"pipe-{cfg.schedule}.json"
    cfg_path.write_text(json.dumps(asdict(cfg)))
    tx0 = {n: lab.tx_bytes(n) for n in nodes[:world]}
    procs, outs, logs = [], [], []
    t_launch = time.perf_counter()
    try:
        for rank in range(world):
            out = work / f"pipe-{cfg.schedule}-rank{rank}.json"
            out.unlink(missing_ok=True)
            log = open(work / f"pipe-{cfg.schedule}-rank{rank}.log", "w")  # noqa: SIM115 (closed below)
            env = {
                **os.environ,
                **lab.env_for(nodes[rank]),
                "OMP_NUM_THREADS": str(cfg.threads),
                "PYTHONPATH": str(ROOT),
            }
            argv = [
                sys.executable,
                "-m",
                "benchmarks.pipelining_baseline",
                "--worker",
                str(cfg_path),
                "--rank",
                str(rank),
                "--master",
                master,
                "--out",
                str(out),
            ]
            procs.append(
                lab.spawn(nodes[rank], argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
            )
            outs.append(out)
            logs.append(log)
        deadline = time.monotonic() + cfg.timeout_s
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise LabError(f"pipelining {cfg.schedule} did not finish within {cfg.timeout_s} s")
            if any(p.returncode not in (None, 0) for p in procs):
                break  # one rank died: the others would wait for it until the gloo timeout
            time.sleep(0.2)
    finally:
        for p in procs:
            lab.stop(p, grace_s=5.0)
        for log in logs:
            log.close()
    wall = time.perf_counter() - t_launch
    bad = [r for r, p in enumerate(procs) if p.returncode != 0 or not outs[r].exists()]
    if bad:
        tail = (work / f"pipe-{cfg.schedule}-rank{bad[0]}.log").read_text()[-2000:]
        raise LabError(f"pipelining {cfg.schedule}: rank(s) {bad} failed; log of rank {bad[0]}:\n{tail}")
    ranks = [json.loads(o.read_text()) for o in outs]
    tx1 = {n: lab.tx_bytes(n) for n in nodes[:world]}
    return summarize(cfg, spec, ranks, tx0, tx1, wall_s=wall)


def summarize(
    cfg: PipeConfig, spec: Any, ranks: list[dict[str, Any]], tx0: dict, tx1: dict, *, wall_s: float
) -> dict[str, Any]:
    """Per-run figures from the ranks' JSON results (pure; see :func:`run_pipelining`)."""
    tokens_per_step = cfg.n_micro * spec.micro_batch_size * spec.model.seq_len
    # A step ends on each rank at slightly different times; the slowest rank's step is the pipeline's.
    # With a target loss the ranks stop together after fewer than ``cfg.steps`` steps.
    n_steps = min(len(r["steps"]) for r in ranks)
    step_times = [max(r["steps"][i]["time_s"] for r in ranks) for i in range(n_steps)]
    measured = step_times[cfg.warmup_steps :] or step_times
    step_s = statistics.median(measured)
    last = ranks[-1]["steps"]
    losses = [
        {"tokens": (i + 1) * tokens_per_step, "wall_s": s["wall_s"], "loss": s.get("loss")}
        | ({"train_s": s["train_s"]} if "train_s" in s else {})
        | ({"eval_loss": s["eval_loss"], "eval_s": s["eval_s"]} if "eval_loss" in s else {})
        for i, s in enumerate(last)
    ]
    total_tokens = n_steps * tokens_per_step
    wire = None
    if all(v is not None for v in tx0.values()):
        wire = sum(tx1[n] - tx0[n] for n in tx0) / total_tokens
    s = spec.num_stages
    return {
        "kind": "pipelining",
        "device": cfg.device,
        "emulate_s": cfg.emulate_s,
        "utilisation": [utilisation(r["steps"], cfg.warmup_steps) for r in ranks],
        "cpu_busy": [cpu_busy(r["steps"], cfg.warmup_steps) for r in ranks],
        "device_peak_mb": [
            r["device_peak_bytes"] / 2**20 if r.get("device_peak_bytes") else None for r in ranks
        ],
        "schedule": cfg.schedule,
        "n_micro": cfg.n_micro,
        "steps": n_steps,
        "warmup_steps": cfg.warmup_steps,
        "threads_per_rank": cfg.threads,
        "tokens_per_step": tokens_per_step,
        "step_s": step_s,
        "step_times_s": step_times,
        "tokens_per_s": tokens_per_step / step_s,
        # every step after warm-up, slow ones included (the median above leaves out a rare slow step)
        "tokens_per_s_overall": tokens_per_step * len(measured) / sum(measured),
        "losses": losses,
        "peak_rss_mb": [r["peak_rss_bytes"] / 2**20 if r["peak_rss_bytes"] else None for r in ranks],
        "wire_bytes_per_token": wire,
        "payload_bytes_per_token": 2 * (s - 1) * spec.model.d_model * 4,
        "wall_s": wall_s,
    }


def cpu_busy(steps: list[dict[str, Any]], warmup_steps: int) -> float | None:
    """A rank's CPU seconds per wall second over the steps after warm-up: the share of a core it kept
    busy (gloo's waits sleep, so on cores shared by all ranks this is its compute, not its bubbles)."""
    if len(steps) <= warmup_steps or "cpu_s" not in steps[-1]:
        return None
    before = steps[warmup_steps - 1] if warmup_steps else None
    if before is None or "cpu_s" not in before:
        return None
    wall = steps[-1]["wall_s"] - before["wall_s"]
    return (steps[-1]["cpu_s"] - before["cpu_s"]) / wall if wall > 0 else None


def utilisation(steps: list[dict[str, Any]], warmup_steps: int) -> float | None:
    """A rank's busy seconds (forwards and backwards, ``benchmarks/busy.py``) per wall second over the
    steps after warm-up (the first step also runs torch's shape inference)."""
    if "busy_s" not in steps[-1]:
        return None
    before = steps[warmup_steps - 1] if warmup_steps else {"busy_s": 0.0, "wall_s": 0.0}
    wall = steps[-1]["wall_s"] - before["wall_s"]
    return (steps[-1]["busy_s"] - before["busy_s"]) / wall if wall > 0 else None


# ------------------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pipelining_baseline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--spec", default="examples/bench.yaml")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--n-micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads per rank (default cpus/stages)"
    )
    parser.add_argument(
        "--emulate-compute-ms",
        default=None,
        metavar="F,B",
        help="emulated busy ms per micro-batch (see busy.py)",
    )
    parser.add_argument("--device", default="cpu", help="cpu | cuda | mps: where the stages compute")
    parser.add_argument("--rate", default="none", help="egress rate of every rank's link (lab only)")
    parser.add_argument("--loopback", action="store_true", help="127.0.0.1 without namespaces or rates")
    parser.add_argument("--out", default=None, help="write the summary JSON here")
    # Internal: one rank (started by run_pipelining).
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--master", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        cfg = PipeConfig(**json.loads(Path(args.worker).read_text()))
        _worker(cfg, args.rank, args.master, Path(args.out))
        return 0

    spec = _load_spec(args.spec)
    threads = args.threads or max(1, (os.cpu_count() or 1) // spec.num_stages)
    cfg = PipeConfig(
        spec_path=os.path.abspath(args.spec),
        schedule=args.schedule,
        n_micro=args.n_micro,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        threads=threads,
        emulate_s=None
        if args.emulate_compute_ms is None
        else tuple(float(v) / 1000 for v in args.emulate_compute_ms.split(",")),
        device=args.device,
    )
    nodes = [f"s{i}" for i in range(spec.num_stages)]
    import tempfile

    with (
        tempfile.TemporaryDirectory(prefix="swarmpipe-pipe-") as tmp,
        open_lab(nodes, loopback=args.loopback, rate=args.rate) as lab,
    ):
        summary = run_pipelining(lab, cfg, nodes, tmp)
    summary["rate"] = args.rate
    text = json.dumps(summary, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(
        f"{cfg.schedule}: {summary['tokens_per_s']:.0f} tokens/s (step {summary['step_s']:.2f} s), "
        f"peak RSS per rank {[round(m) for m in summary['peak_rss_mb']]} MiB, "
        f"wire bytes/token {summary['wire_bytes_per_token']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
