# ~440 lines (over ~400): one check in three parts that share its spec and time budget, and their report.
"""The GPU check: a 4-stage swarm of a 152M-parameter model with every peer on one GPU, against torch
pipelining on the same GPU, and a CUDA route checked against the CPU route in float32.

Run (one command, about 5 minutes on one GPU; ``--budget-s`` bounds it)::

    python -m benchmarks.gpu_check                       # CUDA; prints a skip line and exits 0 without it
    python -m benchmarks.gpu_check --device mps          # Apple silicon, where torch supports it
    python -m benchmarks.gpu_check --device cpu --tiny   # the dry path: a tiny model, the same code

Three parts, each with its own deadline and its error recorded (one failing hides nothing else):

1. **numerics**: the same stage route -- every stage's ``StageCompute`` forward, the last stage's loss
   and backward, the backwards down to stage 0 -- in float32 with autocast off (TF32 off), once on
   the CPU and once on the device; max abs and relative (over the CPU tensor's max) differences of
   the loss, each boundary's activations and input gradients, and every parameter gradient, checked
   against a tolerance.
2. **swarm**: ``swarm.tools.demo.Demo`` with one ``swarm peer --device DEVICE`` per stage on the one
   device (the spec's ``autocast: auto``: bf16 on CUDA; inputs copied through pinned memory, as
   ``peer/compute.py`` does on CUDA; neither on MPS or CPU), a trainer in this process, 8 micro-batches
   in flight, blockwise8 codecs. Tokens/s (median window after warm-up) and each peer's peak GPU
   memory (``torch.cuda.max_memory_allocated`` in the peer process, its stop line's ``cuda_peak_bytes``).
3. **pipelining**: ``benchmarks/pipelining_baseline.py``, 1F1B, one rank per stage on the same device.
   The baseline is torch pipelining over *gloo with the stages' tensors staged through host memory*
   (``benchmarks/busy.py``: each rank computes on the GPU under the same autocast, fp32 tensors cross
   between ranks on the host): NCCL refuses several ranks on one GPU, and gloo moves host tensors, so
   this is what torch pipelining on one shared GPU can be -- the same host round trip the swarm's
   activations take. Tokens/s (median step after warm-up) and peak GPU memory per rank.

Results: ``benchmarks/results/gpu_check.json`` (the dry path: ``gpu_check_dry.json``) and, after a
run on a GPU, the "GPU check" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.markdown import write_section
from benchmarks.report import cell, machine_info

__all__ = ["check_spec", "route_numerics", "skip_reason", "run_check", "markdown_section"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SECTION = "## GPU check"
TOLERANCE = {"loss": 1e-4, "activations": 1e-4, "input_grads": 1e-3, "param_grads": 1e-3}
"""Largest relative difference (max |cpu - device| / max |cpu|) accepted per group, float32."""


def skip_reason(device: str) -> str | None:
    """Why this machine cannot run the check on ``device`` (None: it can)."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})"
    if device == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            return f"MPS is not available (torch {torch.__version__})"
    if device not in ("cpu", "mps") and not device.startswith("cuda"):
        return f"unknown device {device!r}: cuda, cuda:N, mps or cpu"
    return None


def check_spec(*, tiny: bool, autocast: str = "auto") -> Any:
    """The check's run: 152M parameters in 4 stages, or (``tiny``) the same shape of run at toy size."""
    from swarm.run.spec import RunSpec

    if tiny:
        model = {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}
        stages, batch = 2, 2
    else:
        model = {"vocab_size": 256, "d_model": 1024, "n_layers": 12, "n_heads": 16, "seq_len": 512}
        stages, batch = 4, 8
    return RunSpec.from_dict(
        {
            "run_id": "gpu-check-tiny" if tiny else "gpu-check",
            "seed": 0,
            "model": model,
            "stages": stages,
            "codecs": {"activations": "blockwise8", "gradients": "blockwise8"},
            # 4 weight versions: the staleness cap lets 2 x 4 + 1 micro-batches through a peer, so 2S fit
            "optimizer": {
                "name": "adamw",
                "lr": 3e-4,
                "clip_norm": 1.0,
                "accumulate": 4,
                "mode": "async",
                "max_versions": 4,
            },
            "micro_batch_size": batch,
            "autocast": autocast,
        }
    )


# -------------------------------------------------------------------------------------- numerics


def _route(spec: Any, device: str, tokens: Any, targets: Any) -> dict[str, list[Any]]:
    """One micro-batch forward through every stage and back; what crossed each boundary and the grads."""
    import torch

    from peer.compute import StageCompute

    comps = [StageCompute(spec, s, device=device) for s in range(spec.num_stages)]
    out: dict[str, list[Any]] = {"loss": [], "activations": [], "input_grads": [], "param_grads": []}
    x = tokens
    for comp in comps[:-1]:
        x = comp.forward("mb", x, "train", tokens=tokens).output  # (B, T, width), float32 on the host
        out["activations"].append(x)
    res = comps[-1].forward("mb", x, "train", targets=targets, tokens=tokens)
    out["loss"].append(torch.tensor([res.loss]))
    grad = res.grad_input
    for comp in reversed(comps[:-1]):
        out["input_grads"].append(grad)
        grad = comp.backward("mb", grad).grad_input  # None at stage 0 (token ids)
    for comp in comps:  # accumulate (> 1) kept every stage from stepping: the sums are this micro-batch's
        sums, _ = comp.optimizer.take_gradients()
        out["param_grads"] += [g.detach().cpu() for g in sums]
    return out


def route_numerics(spec: Any, device: str, *, batch: int = 2, seq: int | None = None) -> dict[str, Any]:
    """The float32 route on the CPU and on ``device``: per group max abs / relative difference, and ok."""
    import torch

    from swarm.run.spec import RunSpec

    data = spec.to_dict()
    data["autocast"] = "none"
    data["optimizer"]["accumulate"] = 1 << 10
    spec32 = RunSpec.from_dict(data)
    seq = seq or min(128, spec.model.seq_len)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.model.vocab_size, (batch, seq), generator=gen)
    targets = torch.randint(0, spec.model.vocab_size, (batch, seq), generator=gen)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        ref = _route(spec32, "cpu", tokens, targets)
        got = _route(spec32, device, tokens, targets)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    groups = {}
    for name, tol in TOLERANCE.items():
        abs_d = max(
            float((a.double() - b.double()).abs().max()) for a, b in zip(ref[name], got[name], strict=True)
        )
        scale = max(float(a.double().abs().max()) for a in ref[name])
        rel = abs_d / scale if scale > 0 else abs_d
        groups[name] = {
            "tensors": len(ref[name]),
            "max_abs": abs_d,
            "max_rel": rel,
            "tolerance": tol,
            "ok": rel <= tol,
        }
    return {
        "device": device,
        "batch": [batch, seq],
        "groups": groups,
        "ok": all(g["ok"] for g in groups.values()),
    }


# ----------------------------------------------------------------------------------- swarm, baseline


def run_swarm(spec: Any, device: str, work: Path, *, micro_batches: int, deadline: float) -> dict[str, Any]:
    """One peer per stage on ``device``, a trainer here; stops training at ``deadline`` (monotonic)."""
    from benchmarks.bubbles import peer_counters
    from benchmarks.links import swarm_figures
    from swarm.dht.processes import terminate_as_interrupt
    from swarm.tools.demo import Demo, DemoConfig
    from swarm.train.data import DataConfig
    from swarm.train.metrics import read_metrics
    from swarm.train.trainer import Trainer, TrainerConfig

    threads = max(1, (os.cpu_count() or 1) // spec.num_stages)
    demo = Demo(
        DemoConfig(
            spec=spec,
            peers_per_stage=1,
            out_dir=str(work / "swarm"),
            peer_args=("--device", device, "--throughput", "1000", "--no-rebalance"),
            torch_threads=threads,
            start_timeout_s=max(30.0, deadline - time.monotonic() - 30),
            reference=False,
            quiet=True,
        )
    )
    summary: dict[str, Any] = {}
    timed_out = False
    previous = terminate_as_interrupt((signal.SIGTERM, signal.SIGINT))
    t0 = time.monotonic()
    try:
        demo.start()
        startup_s = time.monotonic() - t0
        trainer = Trainer(
            TrainerConfig(
                initial_peers=(demo.maddr,),
                run_id=spec.run_id,
                data=DataConfig(max_bytes=4 << 20),
                steps=micro_batches // spec.optimizer.accumulate,
                max_inflight=2 * spec.num_stages,
                pacing=False,
                out_dir=str(work / "train"),
                seed=0,
                trainer_id="gpu-check",
                quiet=True,
            )
        )
        try:
            summary = asyncio.run(asyncio.wait_for(trainer.run(), max(10.0, deadline - time.monotonic())))
        except asyncio.TimeoutError:
            timed_out = True  # the metrics written so far still tell the rate
    finally:
        demo.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    fig = swarm_figures(
        read_metrics(work / "train" / "metrics.jsonl"),
        summary,
        tokens_per_mb=spec.tokens_per_micro_batch,
        warmup_mb=2 * spec.num_stages,
        window_mb=2 * spec.num_stages,
    )
    counters = peer_counters(demo.logs, spec.num_stages)
    return {
        "tokens_per_s": fig["tokens_per_s"],
        "tokens": fig["tokens"],
        "train_s": fig["train_s"],
        "startup_s": startup_s,
        "timed_out": timed_out,
        "final_loss": fig["losses"][-1]["loss"] if fig["losses"] else None,
        "device_peak_mb": [
            c.get("cuda_peak_bytes", 0) / 2**20 if c.get("cuda_peak_bytes") else None for c in counters
        ],
        "threads_per_peer": threads,
        "max_inflight": 2 * spec.num_stages,
    }


def run_pipelining(spec: Any, device: str, work: Path, *, steps: int, deadline: float) -> dict[str, Any]:
    """torch pipelining 1F1B, one rank per stage on ``device`` (gloo, host-staged: see the docstring)."""
    from benchmarks.netlab import LoopbackLab
    from benchmarks.pipelining_baseline import PipeConfig
    from benchmarks.pipelining_baseline import run_pipelining as run

    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / "spec.json"
    spec_path.write_bytes(spec.canonical_bytes())
    cfg = PipeConfig(
        spec_path=str(spec_path),
        schedule="1f1b",
        n_micro=2 * spec.num_stages,
        steps=steps,
        warmup_steps=1,
        threads=max(1, (os.cpu_count() or 1) // spec.num_stages),
        data_bytes=4 << 20,
        timeout_s=max(30.0, deadline - time.monotonic()),
        device=device,
    )
    nodes = [f"s{i}" for i in range(spec.num_stages)]
    with LoopbackLab(nodes) as lab:
        res = run(lab, cfg, nodes, work)
    return {
        "tokens_per_s": res["tokens_per_s"],
        "step_s": res["step_s"],
        "n_micro": cfg.n_micro,
        "final_loss": res["losses"][-1]["loss"],
        "device_peak_mb": res["device_peak_mb"],
        "utilisation": res["utilisation"],
    }


# ----------------------------------------------------------------------------------------- driver


def _part(report: dict[str, Any], name: str, fn: Any) -> None:
    """Run one part; its result or its error (with the time it took) into ``report[name]``."""
    t = time.monotonic()
    try:
        res = fn()
    except Exception as e:  # noqa: BLE001 -- a part's failure is a result of the check, not the end of it
        res = {"error": f"{type(e).__name__}: {e}"[:3000]}
    res["part_s"] = time.monotonic() - t
    report[name] = res
    print(f"gpu_check: {name}: " + ("FAILED " + res["error"][:300] if "error" in res else "done"), flush=True)


def run_check(
    device: str, *, tiny: bool, budget_s: float, micro_batches: int, pipe_steps: int
) -> dict[str, Any]:
    """The three parts within ``budget_s``: numerics, then the swarm (half of what is left), then pipelining."""
    import torch

    from swarm.run.model import autocast_dtype

    spec = check_spec(tiny=tiny)
    t0 = time.monotonic()
    end = t0 + budget_s
    report: dict[str, Any] = {
        "device": device,
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else device,
        "tiny": tiny,
        "machine": machine_info(),
        "cuda": torch.version.cuda,
        "n_params": spec.n_params(),
        "stages": spec.num_stages,
        "micro_batch": [spec.micro_batch_size, spec.model.seq_len],
        "autocast": str(autocast_dtype(spec, device)),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    _part(report, "numerics", lambda: route_numerics(spec, device))
    with tempfile.TemporaryDirectory(prefix="swarmpipe-gpu-check-") as tmp:
        swarm_end = time.monotonic() + (end - time.monotonic()) * 0.55
        _part(
            report,
            "swarm",
            lambda: run_swarm(
                spec, device, Path(tmp) / "swarm", micro_batches=micro_batches, deadline=swarm_end
            ),
        )
        _part(
            report,
            "pipelining",
            lambda: run_pipelining(spec, device, Path(tmp) / "pipe", steps=pipe_steps, deadline=end),
        )
    a, b = report["swarm"].get("tokens_per_s"), report["pipelining"].get("tokens_per_s")
    report["swarm_vs_pipelining"] = a / b if a and b else None
    report["wall_s"] = time.monotonic() - t0
    return report


def markdown_section(report: dict[str, Any]) -> str:
    num, sw, pipe = report["numerics"], report["swarm"], report["pipelining"]
    lines = [
        SECTION,
        "",
        f"{report['device_name']} ({report['device']}), torch {report['machine']['torch']}, CUDA {report['cuda']}; "
        f"{report['started']}, {report['wall_s'] / 60:.1f} min. Command: `{report['command']}`. "
        f"{report['n_params'] / 1e6:.0f}M parameters in {report['stages']} stages, micro-batches of "
        f"{report['micro_batch'][0]} x {report['micro_batch'][1]} tokens, autocast {report['autocast']}, every "
        "process on the one device (see the docstring of `benchmarks/gpu_check.py` for the baseline's transport).",
        "",
        "| | tokens/s | peak GPU memory per process (MiB) |",
        "| --- | --- | --- |",
    ]
    for label, part in (
        (f"swarm, blockwise8, async, {sw.get('max_inflight')} in flight", sw),
        ("torch pipelining 1F1B, gloo, host-staged", pipe),
    ):
        if "error" in part:
            lines.append(f"| {label} | failed: {part['error'][:200]} | |")
            continue
        mem = " / ".join(cell(m) for m in part.get("device_peak_mb") or [])
        lines.append(f"| {label} | {cell(part.get('tokens_per_s'))} | {mem} |")
    lines += ["", f"Swarm / pipelining tokens/s: {cell(report.get('swarm_vs_pipelining'), '.2f')}.", ""]
    if "error" in num:
        lines.append(
            f"Numerics (float32, CPU route vs {report['device']} route): failed: {num['error'][:300]}"
        )
    else:
        groups = ", ".join(
            f"{k} {g['max_rel']:.1e} ({'ok' if g['ok'] else 'OVER'} {g['tolerance']:.0e})"
            for k, g in num["groups"].items()
        )
        lines.append(
            f"Numerics (float32, autocast and TF32 off, one micro-batch of {num['batch'][0]} x {num['batch'][1]} "
            f"tokens through every stage and back; max |cpu - device| / max |cpu|): {groups}."
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--device", default="cuda", help="cuda (default), cuda:N, mps, or cpu (with --tiny: the dry path)"
    )
    parser.add_argument("--tiny", action="store_true", help="a toy model in 2 stages (the dry path)")
    parser.add_argument(
        "--budget-s", type=float, default=300.0, help="the whole check's time, start-ups included"
    )
    parser.add_argument("--micro-batches", type=int, default=128, help="the swarm trains at most this many")
    parser.add_argument("--pipe-steps", type=int, default=8, help="pipelining steps of 8 micro-batches")
    parser.add_argument(
        "--out", default=None, help="the JSON (default benchmarks/results/gpu_check[_dry].json)"
    )
    parser.add_argument("--no-markdown", action="store_true", help="do not rewrite BENCHMARKS.md")
    args = parser.parse_args(argv)
    reason = skip_reason(args.device)
    if reason is not None:
        print(f"gpu_check: skipped: {reason}; nothing to check here (--device cpu --tiny runs the dry path)")
        return 0
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    command = " ".join(["python -m benchmarks.gpu_check", *(sys.argv[1:] if argv is None else argv)])
    report = run_check(
        args.device,
        tiny=args.tiny,
        budget_s=args.budget_s,
        micro_batches=args.micro_batches,
        pipe_steps=args.pipe_steps,
    )
    dry = args.device == "cpu" or args.tiny
    report["command"] = command
    out = Path(args.out) if args.out else RESULTS_DIR / ("gpu_check_dry.json" if dry else "gpu_check.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    text = markdown_section(report)
    if not dry and not args.no_markdown:
        write_section(text)
    print(text)
    failed = [k for k in ("numerics", "swarm", "pipelining") if "error" in report[k]]
    numerics = report["numerics"]
    verdict = "failed" if "error" in numerics else "ok" if numerics["ok"] else "over tolerance"
    print(f"gpu_check: numerics {verdict}; failed parts: {', '.join(failed) or 'none'}; {out}")
    return 0 if not failed and verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
