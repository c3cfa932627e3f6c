"""What one micro-batch costs a stage peer's compute path against plain torch, in one process, no network.

Run (from the repository root)::

    python -m benchmarks.stage_cost                       # examples/bench.yaml, every stage, ~2 min on 2 cores
    python -m benchmarks.stage_cost --stages 1 --micro-batches 8 --repeats 1   # a quick look

The unshaped throughput gap to torch pipelining (BENCHMARKS.md, "Where the cycles go") could be the
peer's own compute path (``peer.compute.StageCompute``: functional weight versions, the stash, the
boundary encoding, ``swarm.run.optimizer.StageOptimizer``'s out-of-place steps) or everything around it
(daemons, DHT, trainer, keeper). This benchmark takes the first out of the question or puts a number
on it: per stage it trains the same micro-batches

- ``peer``: through ``StageCompute.forward``/``backward`` (the last stage: loss and backward at once),
  stepping every ``optimizer.accumulate`` micro-batches, as a stage peer's worker thread does;
- ``plain``: the same stage module (``swarm.run.model.build_stage``) with ``module(x).backward(g)`` and
  ``torch.optim.AdamW`` plus ``clip_grad_norm_`` every ``accumulate`` micro-batches, as a
  pipelining rank does (benchmarks/pipelining_baseline.py), once with the default AdamW and once with
  ``fused=True`` (the kernel the peer's optimizer steps with where torch has one),

and reports CPU seconds per micro-batch (``time.process_time``: this process, one torch thread by
default) and their ratio, the best of ``--repeats`` runs each (the two alternate, so load drift hits
both). Gradients from the next stage are fixed random tensors; the loss does not matter here.
Results: ``benchmarks/results/stage_cost.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "stage_cost.json"

__all__ = ["measure_stage", "main"]


def _inputs(spec: Any, stage: int) -> tuple[Any, Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(stage)
    b, t, d = spec.micro_batch_size, spec.model.seq_len, spec.model.d_model
    tokens = torch.randint(0, spec.model.vocab_size, (b, t), generator=gen)
    x = torch.randn(b, t, d, generator=gen)
    grad = torch.randn(b, t, d, generator=gen) * 1e-3
    return tokens, x, grad


def _peer_run(spec: Any, stage: int, n: int) -> float:
    from peer.compute import StageCompute

    tokens, x, grad = _inputs(spec, stage)
    comp = StageCompute(spec, stage)
    inp = tokens if comp.is_first else comp.net.boundary.encode_activation(x, tokens).float()
    out_grad = grad if comp.net.width == spec.model.d_model else grad[..., : comp.net.width]
    t0 = time.process_time()
    for i in range(n):
        comp.forward(f"mb{i}", inp, "train", targets=tokens if comp.is_last else None, tokens=tokens)
        if not comp.is_last:
            comp.backward(f"mb{i}", out_grad)
    return (time.process_time() - t0) / n


def _plain_run(spec: Any, stage: int, n: int, fused: bool = False) -> float:
    import torch

    from swarm.run.model import build_stage, lm_loss

    tokens, x, grad = _inputs(spec, stage)
    module = build_stage(spec, stage)
    ocfg = spec.optimizer
    opt = torch.optim.AdamW(
        module.parameters(), lr=ocfg.lr, betas=ocfg.betas, weight_decay=ocfg.weight_decay, fused=fused or None
    )
    first, last = stage == 0, stage == spec.num_stages - 1
    t0 = time.process_time()
    for i in range(n):
        inp = tokens if first else x.detach().requires_grad_(True)
        out = module(inp)
        if last:
            lm_loss(out, tokens).backward()
        else:
            out.backward(grad)
        if (i + 1) % ocfg.accumulate == 0:
            if ocfg.clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), ocfg.clip_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return (time.process_time() - t0) / n


def measure_stage(spec: Any, stage: int, *, micro_batches: int, repeats: int) -> dict[str, Any]:
    """CPU seconds per micro-batch of ``stage`` on the peer's path and on plain torch, with the default
    ``torch.optim.AdamW`` and with ``fused=True`` (the kernel the peer's optimizer uses where torch has
    one); best of ``repeats`` each."""
    peer, plain, fused = [], [], []
    for _ in range(repeats):
        plain.append(_plain_run(spec, stage, micro_batches))
        fused.append(_plain_run(spec, stage, micro_batches, fused=True))
        peer.append(_peer_run(spec, stage, micro_batches))
    return {
        "stage": stage,
        "peer_cpu_s": min(peer),
        "plain_cpu_s": min(plain),
        "plain_fused_cpu_s": min(fused),
        "ratio": min(peer) / min(plain),
        "ratio_fused": min(peer) / min(fused),
        "peer_runs": peer,
        "plain_runs": plain,
        "plain_fused_runs": fused,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--spec", default="examples/bench.yaml")
    p.add_argument("--accumulate", type=int, default=4, help="micro-batches per step on both paths")
    p.add_argument("--micro-batches", type=int, default=24, help="per run (a multiple of --accumulate)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--stages", type=int, nargs="*", default=None, help="default: every stage")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (one per stage process, as the benchmarks)"
    )
    p.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="set glibc's thresholds first, as a stage peer's process does (note 'allocator', "
        "peer/allocator.py); both paths run in this process, so both get them",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    allocator = "the C library's defaults (not asked to keep freed memory)"
    if args.keep_freed_memory:
        from peer.allocator import keep_freed_memory

        allocator = keep_freed_memory()
    if args.micro_batches < 1 or args.micro_batches % args.accumulate:
        p.error(
            f"--micro-batches {args.micro_batches} must be a positive multiple of --accumulate {args.accumulate}"
        )
    import torch

    from benchmarks.report import machine_info
    from swarm.run.spec import RunSpec

    torch.set_num_threads(args.threads)
    base = RunSpec.from_yaml(args.spec)
    data = base.to_dict()
    data["optimizer"]["accumulate"] = args.accumulate
    spec = RunSpec.from_dict(data)
    stages = args.stages if args.stages else list(range(spec.num_stages))
    rows = []
    for s in stages:
        row = measure_stage(spec, s, micro_batches=args.micro_batches, repeats=args.repeats)
        rows.append(row)
        print(
            f"stage {s}: peer {row['peer_cpu_s'] * 1e3:.1f} ms, plain {row['plain_cpu_s'] * 1e3:.1f} ms, "
            f"plain with fused AdamW {row['plain_fused_cpu_s'] * 1e3:.1f} ms per micro-batch (CPU), "
            f"peer / plain {row['ratio']:.3f}, peer / plain fused {row['ratio_fused']:.3f}",
            flush=True,
        )
    report = {
        "machine": machine_info(),
        "spec": args.spec,
        "optimizer": spec.optimizer.name,
        "accumulate": args.accumulate,
        "micro_batches": args.micro_batches,
        "repeats": args.repeats,
        "threads": args.threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "allocator": allocator,
        "stages": rows,
        "ratio_all": sum(r["peer_cpu_s"] for r in rows) / sum(r["plain_cpu_s"] for r in rows),
        "ratio_all_fused": sum(r["peer_cpu_s"] for r in rows) / sum(r["plain_fused_cpu_s"] for r in rows),
    }
    print(
        f"all stages: peer / plain {report['ratio_all']:.3f}, peer / plain fused {report['ratio_all_fused']:.3f}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
