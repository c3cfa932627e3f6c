"""Subspace convergence benchmark: does a subspace-constrained model train as well as an ordinary one?

Run (from the repository root)::

    python -m benchmarks.subspace_convergence --jobs 3         # ~5 min on 2 idle cores
    python -m benchmarks.subspace_convergence --steps 40 --no-markdown --out /tmp/s.json   # quick look

``--jobs 3`` trains the three modes in three processes with one torch thread each; on a machine
shared with other jobs this is much faster than one process with torch's default threads (OpenMP
threads spin waiting for each other when the cores are busy). Results differ only by float rounding.

Trains, in one process on the same data with the same seed and token budget, three versions of one
byte-level decoder (d_model 256, 4 layers, one layer per stage):

- ``full``: the ordinary model (boundaries would send all d_model numbers per token);
- ``k=d/32`` and ``k=d/100``: ``model.subspace`` with ``ratio`` 32 and 100 (k = 8 and 2 at d = 256).

Every training step runs the way the swarm runs it: stage by stage, each boundary crossing through
``swarm.run.subspace.make_boundary`` (encode, the ``--codec`` codec, decode; the identity boundary for
``full``) forward and backward, one AdamW per stage with the stage's own gradient clipping. With the
default ``--codec none`` the boundaries are exact, so the constrained runs measure the constraint
alone. Data: bytes of the Python standard library's ``.py`` sources (``sysconfig.get_paths()["stdlib"]``),
read in sorted order; the last 5% is held out for evaluation.

Reported (``benchmarks/results/subspace_convergence.json``, a PNG plot next to it, and the
"Subspace compression" section of BENCHMARKS.md): held-out loss vs tokens per mode, final loss
ratio to ``full``, tokens each mode needs to reach the target (``full``'s held-out loss at 75% of the
budget), and bytes per token per boundary crossing for several codecs, measured by encoding the
trained models' real boundary tensors.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

import torch

from benchmarks.markdown import MARKDOWN, write_section
from compression import decode_any, get_codec
from swarm.run.model import build_model, lm_loss
from swarm.run.spec import RunSpec
from swarm.run.subspace import Boundary, make_boundary

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "subspace_convergence.json"
SECTION = "## Subspace compression"
MODES: dict[str, dict | None] = {"full": None, "k=d/32": {"ratio": 32}, "k=d/100": {"ratio": 100}}
BYTE_CODECS = ("none", "fp16", "bf16", "blockwise8")
TARGET_WITHIN = 0.03  # the target: k = d/32 ends within 3% of full's loss


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def load_corpus(max_bytes: int) -> torch.Tensor:
    """Bytes of the stdlib's .py files in sorted path order (deterministic on one Python), as int64."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    raw = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def batches(train: torch.Tensor, steps: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """(steps, batch, seq_len + 1) windows at seeded random offsets: the same for every mode."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(train) - seq_len - 1, (steps, batch), generator=gen)
    return train[starts[..., None] + torch.arange(seq_len + 1)]


# ---------------------------------------------------------------------------------------------
# One mode: an in-process pipeline whose boundaries go through encode / codec / decode
# ---------------------------------------------------------------------------------------------


def make_spec(args: argparse.Namespace, subspace: dict | None) -> RunSpec:
    model = {
        "vocab_size": 256,
        "d_model": args.d_model,
        "n_layers": args.n_layers,
        "n_heads": args.n_heads,
        "seq_len": args.seq_len,
    }
    if subspace is not None:
        model["subspace"] = subspace
    return RunSpec.from_dict(
        {
            "run_id": "subspace-bench",
            "seed": args.seed,
            "model": model,
            "stages": args.stages,
            "codecs": {"activations": args.codec, "gradients": args.codec},
            "optimizer": {
                "lr": args.lr,
                "schedule": "cosine",
                "warmup_steps": min(args.warmup, args.steps // 4),
                "total_steps": args.steps,
                "weight_decay": 0.0,
            },
            "micro_batch_size": args.batch,
            "autocast": "none",
        }
    )


class Pipeline:
    """All stages of one spec in one process, with a boundary + codec round trip at every boundary."""

    def __init__(self, spec: RunSpec, device: torch.device):
        self.spec, self.device = spec, device
        self.stages = list(build_model(spec, device=device).stages)
        self.boundary: Boundary = make_boundary(spec, device=device)
        self.act_codec = get_codec(spec.codecs.activations)
        self.grad_codec = get_codec(spec.codecs.gradients)
        opt = spec.optimizer
        self.optimizers = [
            torch.optim.AdamW(s.parameters(), lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay)
            for s in self.stages
        ]

    def _send(self, x: torch.Tensor, codec, stream: object) -> torch.Tensor:
        return decode_any(codec.encode(x.detach().cpu(), stream=stream)).to(self.device)

    def train_step(self, step: int, inp: torch.Tensor, tgt: torch.Tensor) -> float:
        lr = self.spec.optimizer.lr_at(step)
        outputs, inputs = [], []
        h: torch.Tensor = inp
        # forward: stage by stage; each boundary sends encode(h) through the activation codec
        for i, stage in enumerate(self.stages):
            out = stage(h)
            outputs.append(out)
            if stage.is_last:
                break
            c = self._send(self.boundary.encode_activation(out.detach(), inp), self.act_codec, (i, "act"))
            h = self.boundary.decode_activation(c, inp).requires_grad_()
            inputs.append(h)
        loss = lm_loss(outputs[-1], tgt)
        loss.backward()
        # backward: each boundary sends encode_grad(dL/dh) back through the gradient codec
        for i in range(len(self.stages) - 2, -1, -1):
            gc = self._send(self.boundary.encode_grad(inputs[i].grad), self.grad_codec, (i, "grad"))
            outputs[i].backward(self.boundary.decode_grad(gc))
        # step: every stage clips and steps on its own, as stage peers do
        for stage, optimizer in zip(self.stages, self.optimizers, strict=True):
            if self.spec.optimizer.clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(stage.parameters(), self.spec.optimizer.clip_norm)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.item()

    @torch.no_grad()
    def boundary_tensors(self, inp: torch.Tensor) -> list[torch.Tensor]:
        """What each boundary would send forward for ``inp`` (encoded, before the codec)."""
        sent, h = [], inp
        for stage in self.stages[:-1]:
            out = stage(h)
            c = self.boundary.encode_activation(out, inp)
            sent.append(c)
            h = self.boundary.decode_activation(c, inp)
        return sent

    def boundary_grads(self, inp: torch.Tensor, tgt: torch.Tensor) -> list[torch.Tensor]:
        """What each boundary would send backward for one micro-batch (encoded, before the codec)."""
        outputs, leaves, h = [], [], inp
        for stage in self.stages:
            if not stage.is_first:
                h = h.detach().requires_grad_()
                leaves.append(h)
            h = stage(h)
            outputs.append(h)
        lm_loss(h, tgt).backward()
        grads: list[torch.Tensor] = []
        for i in range(len(leaves) - 1, -1, -1):  # exact backward chain, as in train_step
            gc = self.boundary.encode_grad(leaves[i].grad)
            grads.insert(0, gc)
            outputs[i].backward(self.boundary.decode_grad(gc))
        for stage in self.stages:
            stage.zero_grad(set_to_none=True)
        return grads

    @torch.no_grad()
    def eval_loss(self, data: torch.Tensor, chunk: int) -> float:
        total = 0.0
        for start in range(0, len(data), chunk):
            x = data[start : start + chunk].to(self.device)
            h = x[:, :-1]
            for i, stage in enumerate(self.stages):
                out = stage(h)
                if stage.is_last:
                    h = out
                    break
                c = self._send(self.boundary.encode_activation(out, x[:, :-1]), self.act_codec, (i, "eval"))
                h = self.boundary.decode_activation(c, x[:, :-1])
            total += lm_loss(h, x[:, 1:]).item() * len(x)
        return total / len(data)


def _run_mode_in_worker(
    name: str, args: argparse.Namespace, data: torch.Tensor, held_out: torch.Tensor, device: str
) -> dict:
    torch.set_num_threads(args.threads or 1)
    return run_mode(name, args, data, held_out, torch.device(device))


def run_mode(
    name: str, args: argparse.Namespace, data: torch.Tensor, held_out: torch.Tensor, device: torch.device
) -> dict:
    spec = make_spec(args, MODES[name])
    torch.manual_seed(args.seed)  # nothing here should draw from it; pinned anyway for dropout-free parity
    pipe = Pipeline(spec, device)
    tokens_per_step = args.batch * args.seq_len
    eval_steps = sorted(
        {s for s in range(args.eval_every, args.steps + 1, args.eval_every)}
        | {round(0.75 * args.steps), args.steps}
    )
    curve = [{"step": 0, "tokens": 0, "eval_loss": pipe.eval_loss(held_out, args.batch)}]
    train_losses: list[float] = []
    ema_raw, ema = 0.0, 0.0
    start = time.perf_counter()
    for step in range(args.steps):
        batch = data[step].to(device)
        loss = pipe.train_step(step, batch[:, :-1], batch[:, 1:])
        train_losses.append(loss)
        done = step + 1
        # Exponential average of the training loss, bias-corrected (as in Adam) so early values
        # are averages of the losses seen so far rather than pulled towards the first one.
        ema_raw = 0.95 * ema_raw + 0.05 * loss
        ema = ema_raw / (1 - 0.95**done)
        if done in eval_steps:
            curve.append(
                {
                    "step": done,
                    "tokens": done * tokens_per_step,
                    "eval_loss": pipe.eval_loss(held_out, args.batch),
                    "train_loss_ema": ema,
                }
            )
        if done % args.log_every == 0 or done == args.steps:
            elapsed = time.perf_counter() - start
            print(
                f"[{name:8s}] step {done:4d}/{args.steps}  tokens {done * tokens_per_step:8d}  "
                f"train(ema) {ema:.4f}  eval {curve[-1]['eval_loss']:.4f} @ {curve[-1]['step']}  "
                f"{elapsed / done:.2f} s/step",
                flush=True,
            )
    wall = time.perf_counter() - start

    # Bytes per token per boundary crossing, on the trained model's real tensors.
    probe = held_out[: args.batch].to(device)
    acts = pipe.boundary_tensors(probe[:, :-1])
    grads = pipe.boundary_grads(probe[:, :-1], probe[:, 1:])
    n_tok = probe.shape[0] * (probe.shape[1] - 1)
    bytes_per_token = {}
    for codec_name in BYTE_CODECS:
        codec = get_codec(codec_name)
        fwd = sum(len(codec.encode(a.cpu())) for a in acts) / len(acts) / n_tok
        bwd = sum(len(codec.encode(g.cpu())) for g in grads) / len(grads) / n_tok
        bytes_per_token[codec_name] = {"forward": fwd, "backward": bwd}
    return {
        "mode": name,
        "subspace": MODES[name],
        "width": pipe.boundary.width,
        "spec_hash": spec.spec_hash,
        "params": spec.n_params(),
        "curve": curve,
        "train_loss": train_losses,
        "final_eval_loss": curve[-1]["eval_loss"],
        "wall_s": wall,
        "s_per_step": wall / args.steps,
        "bytes_per_token": bytes_per_token,
    }


# ---------------------------------------------------------------------------------------------
# Summary, plot, markdown
# ---------------------------------------------------------------------------------------------


def summarise(runs: dict[str, dict], args: argparse.Namespace) -> dict:
    full = runs["full"]
    step75 = round(0.75 * args.steps)
    target = next(p["eval_loss"] for p in full["curve"] if p["step"] == step75)
    fp32_bytes = 4 * args.d_model
    for run in runs.values():
        reached = next((p for p in run["curve"] if p["eval_loss"] <= target), None)
        run["tokens_to_target"] = None if reached is None else reached["tokens"]
        run["final_loss_ratio"] = run["final_eval_loss"] / full["final_eval_loss"]
        run["reduction_vs_fp32_hidden"] = {
            c: fp32_bytes / v["forward"] for c, v in run["bytes_per_token"].items()
        }
    k32 = runs["k=d/32"]
    return {
        "target_loss": target,
        "target_definition": f"full model's held-out loss after {step75} of {args.steps} steps (75% of the budget)",
        "checks": {
            "k=d/32 final loss within 3% of full": {
                "measured_ratio": k32["final_loss_ratio"],
                "threshold": 1 + TARGET_WITHIN,
                "met": k32["final_loss_ratio"] <= 1 + TARGET_WITHIN,
            }
        },
    }


def plot(runs: dict[str, dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in runs.items():
        pts = [p for p in run["curve"] if p["step"] > 0]
        line = ax.plot(
            [p["tokens"] for p in pts],
            [p["eval_loss"] for p in pts],
            marker="o",
            ms=3,
            label=f"{name} (held-out)",
        )[0]
        ema = [p["train_loss_ema"] for p in pts]
        ax.plot([p["tokens"] for p in pts], ema, ls="--", lw=1, color=line.get_color(), alpha=0.6)
    ax.axhline(summary["target_loss"], color="grey", lw=0.8, ls=":", label="target (full @ 75%)")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("loss (nats/byte); dashed = train EMA")
    ax.set_title("Subspace-constrained vs ordinary model, same data and budget")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def markdown(report: dict) -> str:
    cfg, runs, summary = report["config"], report["runs"], report["summary"]
    m = report["machine"]
    if cfg.get("jobs", 1) > 1:
        threads = f"{cfg['jobs']} processes with {cfg.get('threads') or 1} torch thread(s) each"
    else:
        threads = f"{m['torch_threads']} torch thread(s)"
    where = m["gpu"] or f"{m['cpu']}, {m['cpu_count']} cores, {threads}"
    fp32 = 4 * cfg["d_model"]
    out = [
        SECTION,
        "",
        f"Machine: {where}, torch {m['torch']}, Python {m['python']}.",
        "",
        f"Command: `{report['command']}` (results in `benchmarks/results/subspace_convergence.json`, "
        "plot `benchmarks/results/subspace_convergence.png`).",
        "",
        f"Setup: byte-level decoder, d_model {cfg['d_model']}, {cfg['n_layers']} layers, {cfg['stages']} stages "
        f"(layers before the last boundary constrained), seq_len {cfg['seq_len']}, batch {cfg['batch']}; "
        f"{cfg['steps']} AdamW steps (lr {cfg['lr']}, {cfg.get('warmup_steps', cfg['warmup'])} warmup, cosine to 10%, "
        "clip 1.0 per stage), "
        f"{cfg['steps'] * cfg['batch'] * cfg['seq_len']:,} training tokens per mode, same data order and seed; "
        f"data = stdlib .py sources ({cfg['corpus_bytes']:,} bytes, last 5% held out, "
        f"{cfg['eval_sequences']} held-out sequences evaluated). Training goes through the boundaries "
        f"(`make_boundary`, codec `{cfg['codec']}`) forward and backward, one optimizer per stage.",
        "",
        f"Target: {summary['target_definition']} = {summary['target_loss']:.4f}.",
        "",
        "| mode | k (numbers/token) | params | final held-out loss | ratio to full | tokens to target "
        "| B/token fwd: none / fp16 / blockwise8 | vs fp32 hidden: fp16 / blockwise8 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        b = run["bytes_per_token"]
        ttt = "not reached" if run["tokens_to_target"] is None else f"{run['tokens_to_target']:,}"
        out.append(
            f"| {name} | {run['width']} | {run['params']:,} | {run['final_eval_loss']:.4f} | "
            f"{run['final_loss_ratio']:.4f} | {ttt} | {b['none']['forward']:.1f} / {b['fp16']['forward']:.1f} / "
            f"{b['blockwise8']['forward']:.1f} | {fp32 / b['fp16']['forward']:.0f}x / "
            f"{fp32 / b['blockwise8']['forward']:.0f}x |"
        )
    out += ["", "Targets from the issue, measured in this run:", ""]
    for name, c in summary["checks"].items():
        out.append(
            f"- {name}: ratio {c['measured_ratio']:.4f} vs <= {c['threshold']:.2f}: "
            f"{'met' if c['met'] else 'NOT MET'}"
        )
    out += ["", "Reading:", ""] + [f"- {line}" for line in report["reading"]]
    return "\n".join(out) + "\n"


def reading(report: dict) -> list[str]:
    runs, cfg = report["runs"], report["config"]
    full, k32, k100 = runs["full"], runs["k=d/32"], runs["k=d/100"]
    lines = [
        f"k = d/32 ({k32['width']} numbers per token) ends at {100 * (k32['final_loss_ratio'] - 1):+.2f}% of the "
        f"ordinary model's held-out loss; k = d/100 ({k100['width']} numbers) at "
        f"{100 * (k100['final_loss_ratio'] - 1):+.2f}%. One run with one seed: differences of about 1% are "
        "within what another seed could change.",
        _target_line(full, k32, k100),
        f"k = d/100 is only {k100['width']} numbers per token at d = {cfg['d_model']}: the constrained "
        "layers must pass all context to the free last stage through them. The paper's 99% compression "
        "(k = d/100) is reported for billion-parameter models, where d/100 is tens of numbers per token.",
        "The constrained projections start at the ordinary residual init std (chosen by a 150-step "
        "ablation on this setup, see `_init_` in swarm/run/model.py); queries, keys, values, SwiGLU gate/up, "
        "norms, the last stage and the head start bit-identical to the ordinary model's.",
        "Bytes are per token and per boundary crossing, headers included, measured by encoding the trained "
        "models' real boundary tensors (forward shown; backward sizes, in the JSON, are the same "
        "here). The token ids a subspace boundary needs are not counted: every route already carries "
        "them to every stage (the FORWARD header, swarm/wire/protocol.py); as raw bytes (vocab 256) they would add 1 B/token.",
        f"Compression multiplies: the boundary sends k instead of d = {cfg['d_model']} numbers, and the run's "
        "codec then shrinks each number (fp16: 2 bytes, blockwise8: ~1 byte), so no new codec was needed.",
        "Wall time per step (s): "
        + ", ".join(f"{n} {r['s_per_step']:.2f}" for n, r in runs.items())
        + " on a shared machine: compare modes within this run only.",
        'Not measured here: tokens per second over slow links. The section "Links" of this file measures '
        "subspace runs of the swarm at several link rates (throughput, bytes on the wire, wall-clock to a "
        "target loss), which is where "
        f"{full['bytes_per_token']['fp16']['forward'] / k32['bytes_per_token']['fp16']['forward']:.0f}x fewer "
        "bytes per token turn into speed.",
    ]
    return lines


def _target_line(full: dict, k32: dict, k100: dict) -> str:
    parts = []
    for name, run in (("k = d/32", k32), ("k = d/100", k100)):
        if run["tokens_to_target"] is None:
            parts.append(f"{name} does not reach it within the budget")
        else:
            parts.append(f"{name} needs {run['tokens_to_target'] / full['tokens_to_target']:.2f}x")
    return (
        f"Tokens to the target (first held-out evaluation at or below it; the ordinary model: "
        f"{full['tokens_to_target']:,}): " + "; ".join(parts) + "."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per mode")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=256, help="keep d_model / 100 >= 2 for the k=d/100 mode")
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument(
        "--stages", type=int, default=4, help="pipeline stages (layers before the last are constrained)"
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codec", default="none", help="codec at every boundary during training (none = exact)")
    p.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations")
    p.add_argument("--eval-sequences", type=int, default=64)
    p.add_argument("--corpus-bytes", type=int, default=8 << 20)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per process (0 = torch's default; 1 with --jobs > 1)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="train the three modes in this many processes at once (1 = in turn)",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON output path (the PNG goes next to it)")
    p.add_argument("--no-markdown", action="store_true", help="do not rewrite the section of BENCHMARKS.md")
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="no training: redraw the plot and rewrite the section from a results file of an earlier run",
    )
    args = p.parse_args(argv)
    if args.from_json is not None:
        report = json.loads(args.from_json.read_text())
        plot(report["runs"], report["summary"], args.from_json.with_suffix(".png"))
        if not args.no_markdown:
            write_section(markdown(report))
        print(
            f"redrew {args.from_json.with_suffix('.png')}"
            + ("" if args.no_markdown else f" and updated {MARKDOWN}")
        )
        return 0
    if args.d_model // 100 < 2:
        p.error(f"--d-model {args.d_model} gives k = d/100 < 2; use 256 or more")
    if args.steps < 4:
        p.error("--steps must be at least 4 (the target is taken at 75% of the budget)")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )

    corpus = load_corpus(args.corpus_bytes)
    split = int(len(corpus) * 0.95)
    train, held = corpus[:split], corpus[split:]
    n_eval = min(args.eval_sequences, (len(held) - 1) // (args.seq_len + 1))
    held_out = held[: n_eval * (args.seq_len + 1)].view(n_eval, args.seq_len + 1)
    data = batches(train, args.steps, args.batch, args.seq_len, args.seed)
    print(
        f"corpus {len(corpus):,} bytes ({len(train):,} train / {len(held):,} held out), "
        f"{args.steps} steps x {args.batch * args.seq_len} tokens per mode, device {device}",
        flush=True,
    )
    if args.jobs > 1:
        # One process per mode (spawned: no forked OpenMP state), one torch thread each unless told.
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
            futures = {
                name: pool.submit(_run_mode_in_worker, name, args, data, held_out, str(device))
                for name in MODES
            }
            runs = {name: f.result() for name, f in futures.items()}
    else:
        runs = {name: run_mode(name, args, data, held_out, device) for name in MODES}
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    report: dict = {
        "command": ("python -m benchmarks.subspace_convergence " + argv_text).strip(),
        "machine": machine(),
        "config": {
            **{k: v for k, v in vars(args).items() if k != "out"},
            "device": str(device),
            "warmup_steps": make_spec(args, None).optimizer.warmup_steps,
            "corpus_bytes": len(corpus),
            "eval_sequences": n_eval,
        },
        "runs": runs,
    }
    report["summary"] = summarise(runs, args)
    report["reading"] = reading(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    png = args.out.with_suffix(".png")
    plot(runs, report["summary"], png)
    print(f"wrote {args.out} and {png}")
    for name, run in runs.items():
        ttt = run["tokens_to_target"]
        print(
            f"  {name:8s} k={run['width']:4d}  final held-out {run['final_eval_loss']:.4f}  "
            f"ratio {run['final_loss_ratio']:.4f}  tokens to target {ttt if ttt is not None else 'not reached'}  "
            f"fwd B/token fp16 {run['bytes_per_token']['fp16']['forward']:.1f}"
        )
    for name, c in report["summary"]["checks"].items():
        print(
            f"  {name}: {c['measured_ratio']:.4f} (threshold {c['threshold']}) {'met' if c['met'] else 'NOT MET'}"
        )
    if not args.no_markdown:
        write_section(markdown(report))
        print(f"updated the Subspace compression section of {MARKDOWN}")
    if not math.isfinite(runs["full"]["final_eval_loss"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
