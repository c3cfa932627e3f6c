"""How close a replica's speculative preview lands to its round's combined step (no network, no peers).

    python -m benchmarks.preview_error                   # 2 and 4 replicas, 100 steps each
    python -m benchmarks.preview_error --replicas 2 --steps 150

A replica of an async stage previews the step its round will take from its own share of the round's
micro-batches (peer/compute.py, note "speculative rounds"). This trains the demo's model in one
process with the project's ``StageOptimizer`` (one optimizer for the whole model, ``accumulate``
micro-batches per step, stepping on their mean), and before every step it also computes the previews a
replica holding the first ``accumulate / replicas`` of them would serve: with Muon's Newton-Schulz at 5
(the optimizer's own), 3, 2 and 1 iterations, and for comparison "last delta" (the matrices moved again
by the previous step's change). Per step and for the Muon matrices (and, apart, the AdamW parameters)
it records ``|preview - combined| / |combined - before|``: 0 is a perfect preview, 1 is what serving
the old weights (no preview) costs. Results: ``benchmarks/results/preview_error.json``; BENCHMARKS.md
"Demo throughput" has the reading.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "preview_error.json"
NS_VARIANTS = (5, 3, 2, 1)
WARMUP_SKIP = 5  # the first steps (no previous delta, warmup lr) are not scored


def _relative(preview: dict, exact: dict, before: dict, names: list[str]) -> float:
    num = sum(float((preview[n] - exact[n]).pow(2).sum()) for n in names)
    den = sum(float((exact[n] - before[n]).pow(2).sum()) for n in names)
    return (num / den) ** 0.5 if den > 0 else 0.0


def measure(spec_path: Path, replicas: int, steps: int, seed: int, data_bytes: int) -> dict[str, Any]:
    import torch

    from swarm.run.model import build_model, lm_loss
    from swarm.run.optimizer import StageOptimizer
    from swarm.run.spec import RunSpec
    from swarm.train.data import DataConfig, build_data

    torch.manual_seed(seed)
    spec = RunSpec.from_yaml(spec_path)
    accumulate = spec.optimizer.accumulate
    if accumulate % replicas:
        raise SystemExit(f"--replicas {replicas} must divide the spec's optimizer.accumulate ({accumulate})")
    model = build_model(spec)
    named = dict(model.named_parameters())
    # the optimizer's names as a stage has them ("layers.i...." is what Muon updates)
    local = {n: (n.split(".", 2)[2] if ".layers." in n else n) for n in named}
    opt = StageOptimizer({local[n]: p.detach() for n, p in named.items()}, spec.optimizer)
    by_local = {v: named[k] for k, v in local.items()}
    data, _ = build_data(
        DataConfig(max_bytes=data_bytes), seq_len=spec.model.seq_len, vocab_size=spec.model.vocab_size
    )
    stream = data.stream(spec.micro_batch_size, seed=seed)
    share = accumulate // replicas
    matrices = list(opt.matrices)
    others = [n for n in opt.names if n not in set(matrices)]
    scores: dict[str, list[float]] = {f"ns{k}": [] for k in NS_VARIANTS} | {
        "last delta": [],
        "adamw part": [],
    }
    losses = []
    for step in range(steps):
        before, last_delta = dict(opt.params), opt._delta
        grads = []
        for _ in range(accumulate):
            tokens, targets = next(stream)
            for n, p in opt.served().items():
                by_local[n].data, by_local[n].grad = p, None
            loss = lm_loss(model(tokens), targets)
            loss.backward()
            grads.append({n: by_local[n].grad.detach().clone() for n in opt.names})
            losses.append(float(loss.detach()))
        own = [sum(g[n] for g in grads[:share]) / share for n in opt.names]
        mean = [sum(g[n] for g in grads) / accumulate for n in opt.names]
        previews = {}
        if step >= WARMUP_SKIP and last_delta is not None:
            for k in NS_VARIANTS:
                previews[f"ns{k}"] = opt.twin(ns_steps=k).step_with(own)
        opt.step_with(mean)
        if not previews:
            continue
        exact = opt.params
        for k in NS_VARIANTS:
            scores[f"ns{k}"].append(_relative(previews[f"ns{k}"], exact, before, matrices))
        moved = {n: before[n] + last_delta[n] for n in matrices}
        scores["last delta"].append(_relative(moved, exact, before, matrices))
        scores["adamw part"].append(_relative(previews["ns5"], exact, before, others))
    return {
        "replicas": replicas,
        "share": share,
        "accumulate": accumulate,
        "steps": steps,
        "seed": seed,
        "final_train_loss": statistics.fmean(losses[-accumulate * 10 :]),
        "relative_error": {k: statistics.fmean(v) for k, v in scores.items()},
        "relative_error_last_half": {k: statistics.fmean(v[len(v) // 2 :]) for k, v in scores.items()},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", type=Path, default=REPO / "examples" / "demo.yaml")
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-bytes", type=int, default=4 << 20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    for r in args.replicas:
        t0 = time.perf_counter()
        row = measure(args.spec, r, args.steps, args.seed, args.data_bytes)
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(
            f"{r} replicas (share {row['share']} of {row['accumulate']} micro-batches), {row['steps']} steps:"
        )
        for k, v in row["relative_error"].items():
            print(f"  {k:>10}: {v:.3f}  (last half {row['relative_error_last_half'][k]:.3f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "spec": str(args.spec.relative_to(REPO))
                if args.spec.is_relative_to(REPO)
                else str(args.spec),
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
