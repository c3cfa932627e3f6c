"""Async replay: does asynchronous pipeline training cost quality, and does the stage optimizer matter?

Run (from the repository root)::

    python -m benchmarks.async_replay --skip "single adamw"   # demo shape, 600 micro-batches, 3 seeds
    python -m benchmarks.async_replay --micro-batches 40 --seeds 0 --no-markdown --out /tmp/r.json  # quick look
    python -m benchmarks.async_replay --seeds 0 --modes sync async --no-markdown --out /tmp/lr.json \\
        --optimizer adamw:lr=1e-3 --optimizer muon:muon_lr=0.01,muon_momentum=0.8   # an lr sweep point

On 2 shared cores one run of 600 micro-batches at the demo's size takes 1.5-4 minutes.

A swarm with one peer per stage, replayed in one process on CPU with no network: one
``peer.compute.StageCompute`` per stage (the peers' own forward/backward, weight versions, stash and
``StageOptimizer``), driven through the schedule a trainer and its peers would produce, on the
micro-batches a trainer with the same seed would send. Per seed and optimizer, the modes:

- ``sync``: ``optimizer.mode: sync`` and the trainer's sync rule (``accumulate`` micro-batches, wait for
  all, next ``accumulate``): every gradient of a step is computed on the same weight version.
- ``async``: ``optimizer.mode: async``, the pipeline kept ``--inflight`` deep (default: the trainer's
  staleness cap for one peer per stage, :func:`trainer_inflight`) by :func:`steady_schedule`: a new
  micro-batch's forwards run before the oldest one's backwards, so every stage before the last
  computes each gradient on weights ``(inflight - 1) / accumulate`` versions old (1 at the default
  accumulate 2 and 3 in flight): the most staleness the cap lets through.
- ``async-sim``: the same, scheduled by :func:`simulated_schedule`: the trainer refills the pipeline
  when stage 0 reports a micro-batch done, and each peer runs one task at a time, backwards first (as
  peer/runtime.py), with unit costs (forward 1, backward 2 or 3 with recompute, last stage's
  forward+backward 3) and ``--latency`` units per message. Stage 0 then waits on its own backwards
  and about half the gradients are fresh (mean staleness ~0.5 version).
- ``single``: the model of ``swarm.run.model.build_model`` trained in one process on the same micro-batches,
  with the project's optimizer (one ``StageOptimizer`` per stage, clipping per stage as the peers do)
  or, for ``torch-adamw``, ``torch.optim.AdamW`` (clipping per stage too, as swarm/train/reference.py).

Schedules are data (note "replayed schedule"): lists of actions in start order (``0F3``: stage 0,
forward, micro-batch 3; ``1L3``: last stage, loss and backward at once; ``0B3``: stage 0, backward).
Executing them in that order gives every stage exactly the sequence of forwards, backwards and
steps it would see. Boundaries are exact (float32) unless ``--wire-codecs`` applies the spec's
codecs both ways.

Held-out loss: ``--eval-batches`` fixed micro-batches of the held-out tail of the data (default 64 x 8 x
128 = 65,536 tokens), evaluated on the base weights of every stage at equal tokens. Ratios are taken
per seed against the ``--reference`` runs (default: single-process ``torch-adamw`` and single-process
``muon``), then summarised as mean, min and max over seeds. Results: ``benchmarks/results/async_replay.json``
and the "Async replay" section of BENCHMARKS.md (``--no-markdown`` leaves it alone).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import platform
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from benchmarks.markdown import MARKDOWN, write_section
from swarm.errors import ConfigError
from swarm.run.spec import OptimizerConfig, RunSpec

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "async_replay.json"
SECTION = "## Async replay"
TORCH_ADAMW = "torch-adamw"
MODES = ("single", "sync", "async", "async-sim")
ASYNC_MODES = ("async", "async-sim")  # steady_schedule, simulated_schedule
ASYNC_WITHIN = 1.02  # async may end at most 2% above sync (issue 13)
SINGLE_WITHIN = 1.01  # the default optimizer in one process within 1% of torch AdamW (issue 13)
TRAINER_MAX_INFLIGHT = 8  # swarm.train.trainer.TrainerConfig.max_inflight's default

Kind = Literal["F", "B", "L"]
Batch = tuple[torch.Tensor, torch.Tensor]  # (tokens, targets), both (B, T) long


# ---------------------------------------------------------------------------------------------
# The schedule (note "replayed schedule")
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """One task of one stage: ``F`` forward, ``B`` backward, ``L`` last stage's loss + backward."""

    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def trainer_inflight(opt: OptimizerConfig, num_stages: int, max_inflight: int = TRAINER_MAX_INFLIGHT) -> int:
    """Micro-batches a trainer keeps in a swarm of one peer per stage, in async mode: the trainer's
    ``max_inflight``, or less where ``swarm.client.routing.staleness_caps`` caps a stage (note "staleness cap")."""
    from swarm.client.routing import staleness_caps

    one_peer = [{"replay": _OnlinePeer()} for _ in range(num_stages)]
    caps = staleness_caps(one_peer, accumulate=opt.accumulate, max_versions=opt.max_versions, sync=False)
    return min([max_inflight] + [c for c in caps if c is not None])


@dataclass(frozen=True)
class _OnlinePeer:
    """The one online peer of a stage, as ``staleness_caps`` reads it (swarm.client.routing.PeerInfo)."""

    peer_id: str = "replay"
    state: str = "online"
    throughput: float = 1.0
    queue: int = 0


def steady_schedule(num_stages: int, n_micro_batches: int, *, inflight: int) -> list[Action]:
    """A pipeline kept exactly ``inflight`` deep: micro-batch ``j``'s forward path (every stage), then the
    backward path of micro-batch ``j - inflight + 1``.

    So every stage but the last runs ``inflight - 1`` other backwards between a micro-batch's forward
    and its backward: the most a trainer's staleness cap lets through one peer per stage (staleness
    ``(inflight - 1) / accumulate`` versions), with every forward of a new micro-batch ahead of the
    older ones' backwards.
    """
    if num_stages < 1 or n_micro_batches < 0 or inflight < 1:
        raise ValueError(f"bad schedule: {num_stages} stages, {n_micro_batches} micro-batches, {inflight}")
    out: list[Action] = []
    for j in range(n_micro_batches):
        out += _forward_path(num_stages, j)
        if j - inflight + 1 >= 0:
            out += _backward_path(num_stages, j - inflight + 1)
    for j in range(max(0, n_micro_batches - inflight + 1), n_micro_batches):
        out += _backward_path(num_stages, j)
    return out


def sync_schedule(num_stages: int, n_micro_batches: int, *, window: int) -> list[Action]:
    """The trainer's sync rule: ``window`` (= accumulate) micro-batches forward, all their backwards, next."""
    out: list[Action] = []
    for start in range(0, n_micro_batches, window):
        group = range(start, min(start + window, n_micro_batches))
        out += [a for j in group for a in _forward_path(num_stages, j)]
        out += [a for j in group for a in _backward_path(num_stages, j)]
    return out


def _forward_path(num_stages: int, j: int) -> list[Action]:
    last = num_stages - 1
    return [Action(s, "F", j) for s in range(last)] + [Action(last, "L", j)]


def _backward_path(num_stages: int, j: int) -> list[Action]:
    return [Action(s, "B", j) for s in reversed(range(num_stages - 1))]


def staleness_profile(schedule: Sequence[Action], num_stages: int, accumulate: int) -> list[float]:
    """Mean versions between a micro-batch's forward and backward, per stage, for an async peer that
    steps after every ``accumulate`` backwards (the last stage: always 0)."""
    backs = [0] * num_stages
    seen: dict[tuple[int, int], int] = {}
    stale: list[list[int]] = [[] for _ in range(num_stages)]
    for a in schedule:
        if a.kind == "F":
            seen[(a.stage, a.mb)] = backs[a.stage] // accumulate
            continue
        before = backs[a.stage] // accumulate
        stale[a.stage].append(0 if a.kind == "L" else before - seen.pop((a.stage, a.mb)))
        backs[a.stage] += 1
    return [statistics.fmean(x) if x else 0.0 for x in stale]


def simulated_schedule(
    num_stages: int,
    n_micro_batches: int,
    *,
    inflight: int,
    recompute: bool = True,
    latency: float = 0.0,
    first: Literal["B", "F"] = "B",
) -> list[Action]:
    """The actions of ``n_micro_batches`` through ``num_stages`` single-peer stages, in start order, from
    a simulation of the async trainer and its peers' worker queues.

    The trainer keeps ``inflight`` micro-batches open and sends the next one when stage 0 reports one
    done. Each stage runs one task at a time, the ``first`` lane first (peer/runtime.py: backwards);
    unit costs (see the module doc), and ``latency`` units for every message: trainer to stage 0,
    between stages, stage 0's report back.
    """
    if num_stages < 1 or n_micro_batches < 0 or inflight < 1:
        raise ValueError(f"bad schedule: {num_stages} stages, {n_micro_batches} micro-batches, {inflight}")
    last = num_stages - 1
    cost = {"F": 1.0, "B": 3.0 if recompute else 2.0, "L": 3.0}
    lanes: list[dict[str, deque[Action]]] = [{"B": deque(), "F": deque()} for _ in range(num_stages)]
    busy = [False] * num_stages
    # (time, tie-break, event, action): "finish" = a stage finished the action; "arrive" = the action's
    # input reached its stage's lane; "report" = the trainer learnt that the micro-batch is done
    events: list[tuple[float, int, str, Action]] = []
    schedule: list[Action] = []
    sent = done = 0
    now, seq = 0.0, 0

    def push(at: float, event: str, action: Action) -> None:
        nonlocal seq
        heapq.heappush(events, (at, seq, event, action))
        seq += 1

    def first_kind(stage: int) -> Kind:
        return "L" if stage == last else "F"

    def admit() -> None:
        nonlocal sent
        open_ = sent - done
        for _ in range(max(0, min(inflight - open_, n_micro_batches - sent))):
            push(now + latency, "arrive", Action(0, first_kind(0), sent))
            sent += 1

    admit()
    while done < n_micro_batches:
        for s in range(num_stages):
            lane = lanes[s][first] if lanes[s][first] else lanes[s]["F" if first == "B" else "B"]
            if not busy[s] and lane:
                action = lane.popleft()
                schedule.append(action)
                busy[s] = True
                push(now + cost[action.kind], "finish", action)
        now, _, event, a = heapq.heappop(events)
        if event == "arrive":
            lanes[a.stage]["B" if a.kind == "B" else "F"].append(a)
        elif event == "report":
            done += 1
            admit()
        else:
            busy[a.stage] = False
            if a.kind == "F":
                push(now + latency, "arrive", Action(a.stage + 1, first_kind(a.stage + 1), a.mb))
            elif a.stage > 0:  # L or B: the gradient goes back one stage
                push(now + latency, "arrive", Action(a.stage - 1, "B", a.mb))
            else:
                push(now + latency, "report", a)
    return schedule


def make_schedule(
    mode: str, spec: RunSpec, n_micro_batches: int, *, inflight: int, latency: float = 0.0
) -> list[Action]:
    """The schedule of a ``sync``, ``async`` (steady) or ``async-sim`` (simulated) run."""
    if mode == "sync":
        return sync_schedule(spec.num_stages, n_micro_batches, window=spec.optimizer.accumulate)
    if mode == "async":
        return steady_schedule(spec.num_stages, n_micro_batches, inflight=inflight)
    return simulated_schedule(
        spec.num_stages,
        n_micro_batches,
        inflight=inflight,
        recompute=spec.optimizer.recompute,
        latency=latency,
    )


# ---------------------------------------------------------------------------------------------
# Specs, data, evaluation
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimizerChoice:
    """``name[:key=value,...]`` from the command line: an optimizer and its OptimizerConfig overrides."""

    label: str
    name: str  # "adamw", "nesterov", "muon" or "torch-adamw"
    overrides: dict[str, Any]

    @classmethod
    def parse(cls, text: str) -> OptimizerChoice:
        name, _, rest = text.partition(":")
        overrides: dict[str, Any] = {}
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise ConfigError(f"--optimizer {text!r}: {item!r} is not key=value; e.g. muon:muon_lr=0.01")
            overrides[key.strip()] = _number(value.strip())
        return cls(label=text, name=name.strip(), overrides=overrides)


def _number(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def variant_spec(
    base: RunSpec, choice: OptimizerChoice, *, seed: int, mode: str, accumulate: int, warmup_steps: int
) -> RunSpec:
    """``base`` with the run's seed, the optimizer choice, the mode and the step settings."""
    d = base.to_dict()
    d["seed"] = seed
    name = "adamw" if choice.name == TORCH_ADAMW else choice.name
    d["optimizer"].update(
        name=name,
        mode="sync" if mode == "sync" else "async",
        accumulate=accumulate,
        warmup_steps=warmup_steps,
        **choice.overrides,
    )
    return RunSpec.from_dict(d)


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, eval_set: Sequence[Batch]) -> float:
    """Mean next-token loss over ``eval_set`` (equal-sized micro-batches, so also the token mean)."""
    from swarm.run.model import lm_loss

    losses = [float(lm_loss(model(tokens), targets)) for tokens, targets in eval_set]
    return sum(losses) / len(losses)


class Progress:
    """Progress lines every ``every`` micro-batches, and the held-out evaluations at ``eval_every``."""

    def __init__(self, tag: str, total: int, every: int, eval_every: int, tokens_per_mb: int):
        self.tag, self.total, self.every, self.eval_every = tag, total, every, eval_every
        self.tokens_per_mb = tokens_per_mb
        self.losses: list[float] = []
        self.evals: list[dict[str, float]] = []
        self.t0 = time.perf_counter()

    def eval_due(self, done: int) -> bool:
        return done == self.total or done % self.eval_every == 0

    def record_eval(self, done: int, loss: float) -> None:
        self.evals.append({"micro_batches": done, "tokens": done * self.tokens_per_mb, "loss": loss})
        print(f"  {self.tag}: {done}/{self.total} micro-batches, held-out loss {loss:.4f}", flush=True)

    def step(self, done: int, extra: str = "") -> None:
        if done % self.every == 0 or done == self.total:
            recent = self.losses[-self.every :]
            print(
                f"  {self.tag}: {done}/{self.total} micro-batches, train loss "
                f"{sum(recent) / max(1, len(recent)):.3f}{extra}, {time.perf_counter() - self.t0:.0f} s",
                flush=True,
            )


# ---------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------


def run_pipeline(
    spec: RunSpec,
    schedule: Sequence[Action],
    batches: Sequence[Batch],
    eval_set: Sequence[Batch],
    progress: Progress,
    *,
    wire_codecs: bool = False,
) -> dict[str, Any]:
    """Execute ``schedule`` with one StageCompute per stage; held-out losses and staleness."""
    from peer.compute import StageCompute
    from swarm.run.model import build_model

    comps = [StageCompute(spec, s) for s in range(spec.num_stages)]
    model = build_model(spec)  # evaluation only: loaded from the stages' latest weights
    wire = _wire(spec) if wire_codecs else (lambda x, _stream: x)
    sent: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> what stage sent forward, (B, T, width)
    grads: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> gradient arriving there, (B, T, width)
    staleness: list[list[int]] = [[] for _ in comps]
    done = 0
    for a in schedule:
        comp, tokens, targets, mb_id = comps[a.stage], *batches[a.mb], f"mb{a.mb}"
        back: torch.Tensor | None = None
        if a.kind in ("F", "L"):
            x = tokens if a.stage == 0 else sent.pop((a.stage - 1, a.mb))
            if a.kind == "F":
                r = comp.forward(mb_id, x, "train", tokens=tokens)
                assert r.output is not None
                sent[(a.stage, a.mb)] = wire(r.output, (a.stage, "act"))
                continue
            r = comp.forward(mb_id, x, "train", targets=targets, tokens=tokens)
            assert r.loss is not None
            progress.losses.append(r.loss)
            staleness[a.stage].append(0)
            back = r.grad_input
        else:
            rb = comp.backward(mb_id, grads.pop((a.stage, a.mb)))
            staleness[a.stage].append(rb.staleness)
            back = rb.grad_input
        if a.stage > 0:
            assert back is not None
            grads[(a.stage - 1, a.mb)] = wire(back, (a.stage, "grad"))
            continue
        done += 1  # stage 0 finished this micro-batch
        progress.step(done, f", stage-0 staleness {statistics.fmean(staleness[0]):.2f}")
        if progress.eval_due(done):
            with torch.no_grad():
                for stage, c in zip(model.stages, comps, strict=True):
                    stage.load_state_dict(c.optimizer.params)  # base weights: what checkpoints hold
            progress.record_eval(done, held_out_loss(model, eval_set))
    leftover = [c.optimizer.pending for c in comps]
    assert not sent and not grads and not any(leftover), (len(sent), len(grads), leftover)
    return {
        "evals": progress.evals,
        "train_losses": progress.losses,
        "steps": [c.steps_taken for c in comps],
        "staleness_mean": [statistics.fmean(s) for s in staleness],
        "staleness_max": [max(s) for s in staleness],
        "stash_dropped": [c.stash.dropped for c in comps],
    }


def _wire(spec: RunSpec) -> Callable[[torch.Tensor, tuple[int, str]], torch.Tensor]:
    """Encode and decode with the spec's codecs, as the sending and the receiving peer would."""
    from compression import get_codec

    codecs = {"act": get_codec(spec.codecs.activations), "grad": get_codec(spec.codecs.gradients)}

    def send(x: torch.Tensor, stream: tuple[int, str]) -> torch.Tensor:
        codec = codecs[stream[1]]
        return codec.decode(codec.encode(x, stream=stream)).float()

    return send


def run_single(
    spec: RunSpec, name: str, batches: Sequence[Batch], eval_set: Sequence[Batch], progress: Progress
) -> dict[str, Any]:
    """One process, the whole model: ``torch.optim.AdamW`` or one StageOptimizer per stage."""
    from swarm.run.model import build_model, lm_loss
    from swarm.run.optimizer import StageOptimizer

    model = build_model(spec)
    ocfg = spec.optimizer
    acc = ocfg.accumulate
    stage_params = [dict(stage.named_parameters()) for stage in model.stages]
    if name == TORCH_ADAMW:
        topt = torch.optim.AdamW(
            model.parameters(), lr=ocfg.lr, betas=ocfg.betas, weight_decay=ocfg.weight_decay
        )
    else:
        opts = [StageOptimizer(p, ocfg) for p in stage_params]
    done = 0
    for step in range(len(batches) // acc):
        for _ in range(acc):
            tokens, targets = batches[done]
            loss = lm_loss(model(tokens), targets)
            progress.losses.append(float(loss.detach()))
            if name == TORCH_ADAMW:
                (loss / acc).backward()
            else:
                flat = [p for ps in stage_params for p in ps.values()]
                gs = iter(torch.autograd.grad(loss, flat))
                for opt, ps in zip(opts, stage_params, strict=True):
                    opt.accumulate({n: next(gs) for n in ps})
            done += 1
            progress.step(done)
        if name == TORCH_ADAMW:
            if ocfg.clip_norm is not None:
                for stage in model.stages:  # per stage, as each stage peer clips its own gradient
                    torch.nn.utils.clip_grad_norm_(stage.parameters(), ocfg.clip_norm)
            for group in topt.param_groups:
                group["lr"] = ocfg.lr_at(step)
            topt.step()
            topt.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                for opt, ps in zip(opts, stage_params, strict=True):
                    new = opt.step()  # new tensors; copied into the model that computes the next loss
                    for n, p in ps.items():
                        p.copy_(new[n])
        if progress.eval_due(done):
            progress.record_eval(done, held_out_loss(model, eval_set))
    return {"evals": progress.evals, "train_losses": progress.losses, "steps": [len(batches) // acc]}


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------


def _spread(values: Sequence[float]) -> dict[str, Any]:
    return {
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "per_seed": list(values),
    }


def summarise(runs: dict[str, dict[str, dict]], references: Sequence[str], default_name: str) -> dict:
    """Final held-out losses, ratios to each reference per seed, async/sync per optimizer, the checks."""
    final = {
        label: {seed: r["evals"][-1]["loss"] for seed, r in by_seed.items()}
        for label, by_seed in runs.items()
    }
    seeds = sorted({s for by_seed in final.values() for s in by_seed})
    rows = {}
    for label, losses in final.items():
        row: dict[str, Any] = {"loss": _spread([losses[s] for s in seeds])}
        for ref in references:
            if ref in final:
                row[f"vs {ref}"] = _spread([losses[s] / final[ref][s] for s in seeds])
        rows[label] = row
    async_sync = {}  # "async muon" -> async / sync of muon, per seed
    for label in final:
        mode, _, opt = label.partition(" ")
        if mode in ASYNC_MODES and f"sync {opt}" in final:
            async_sync[label] = _spread([final[label][s] / final[f"sync {opt}"][s] for s in seeds])

    def check(r: dict[str, Any], within: float) -> dict[str, Any]:
        return {"measured": r["mean"], "worst_seed": r["max"], "met": r["mean"] <= within}

    checks = {
        f"{label} / sync {label.partition(' ')[2]} <= {ASYNC_WITHIN}": check(r, ASYNC_WITHIN)
        for label, r in async_sync.items()
    }
    adamw = next((label for label in final if label.startswith(f"single {TORCH_ADAMW}")), None)
    for label, losses in final.items():
        if (
            adamw is not None
            and label.startswith("single ")
            and not label.startswith(f"single {TORCH_ADAMW}")
        ):
            ratio = _spread([losses[s] / final[adamw][s] for s in seeds])
            checks[f"{label} / {adamw} <= {SINGLE_WITHIN}"] = check(ratio, SINGLE_WITHIN)
    return {
        "seeds": seeds,
        "rows": rows,
        "async_over_sync": async_sync,
        "checks": checks,
        "default": default_name,
    }


def markdown_table(summary: dict, references: Sequence[str]) -> list[str]:
    refs = [r for r in references if any(f"vs {r}" in row for row in summary["rows"].values())]
    head = ["run", "held-out loss: mean (min..max; per seed)", *(f"ratio to {r}" for r in refs)]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def fmt(x: dict, digits: int) -> str:
        per = ", ".join(f"{v:.{digits}f}" for v in x["per_seed"])
        return f"{x['mean']:.{digits}f} ({x['min']:.{digits}f}..{x['max']:.{digits}f}; {per})"

    for label, row in summary["rows"].items():
        cells = [
            label,
            fmt(row["loss"], 4),
            *(fmt(row[f"vs {r}"], 4) if f"vs {r}" in row else "" for r in refs),
        ]
        out.append("| " + " | ".join(cells) + " |")
    if summary["async_over_sync"]:
        out += ["", "| async run | over sync of the same optimizer: mean (min..max; per seed) |", "|---|---|"]
        out += [f"| {label} | {fmt(r, 4)} |" for label, r in summary["async_over_sync"].items()]
    return out


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def merge_reports(reports: Sequence[dict], references: Sequence[str] | None = None) -> dict:
    """One report from several of the same setup (e.g. one per seed): runs joined, summary recomputed
    against ``references`` (default: the first report's)."""
    merged = json.loads(json.dumps(reports[0]))  # a deep copy
    if references:
        merged["config"]["references"] = list(references)
    keys = ("spec", "micro_batches", "accumulate", "warmup_steps", "eval_tokens", "wire_codecs")
    for other in reports[1:]:
        if any(other["config"][k] != merged["config"][k] for k in keys):
            raise ConfigError(f"cannot merge results of different setups: compare their config {keys}")
        for label, by_seed in other["runs"].items():
            merged["runs"].setdefault(label, {}).update(by_seed)
        merged["command"] = f"{merged['command']}; {other['command']}"
        merged["config"]["optimizers"] += [
            o for o in other["config"]["optimizers"] if o not in merged["config"]["optimizers"]
        ]
    merged["summary"] = summarise(
        merged["runs"], merged["config"]["references"], merged["summary"]["default"]
    )
    return merged


def _lrs(label: str, by_seed: dict[str, dict]) -> str:
    run = next(iter(by_seed.values()))
    muon = "" if run.get("muon_lr") is None or "muon" not in label else f", muon_lr {run['muon_lr']:g}"
    return f"{label} lr {run['lr']:g}{muon}"


def markdown(report: dict) -> str:
    cfg, summary, m = report["config"], report["summary"], report["machine"]
    out = [
        SECTION,
        "",
        f"Machine: {m['cpu']}, {m['cpu_count']} cores, {m['torch_threads']} torch thread(s), torch {m['torch']}, "
        f"Python {m['python']}.",
        "",
        f"Command: `{report['command']}` (results in `{cfg['out']}`).",
        "",
        f"Setup: `{cfg['spec']}` (d_model {cfg['d_model']}, {cfg['n_layers']} layers, {cfg['stages']} stages, "
        f"micro-batch {cfg['micro_batch_size']} x {cfg['seq_len']}), one peer per stage replayed in one process; "
        f"{cfg['micro_batches']} micro-batches = {cfg['tokens']:,} training tokens per run, accumulate "
        f"{cfg['accumulate']}, warmup {cfg['warmup_steps']} steps, constant lr after warmup; async keeps "
        f"{cfg['inflight']} micro-batches in flight (mean stage-0 staleness in versions: {cfg['async_staleness']}); "
        f"boundaries {'through the spec codecs' if cfg['wire_codecs'] else 'exact (float32)'}; held-out loss "
        f"on {cfg['eval_tokens']:,} fixed held-out tokens; seeds {', '.join(map(str, summary['seeds']))} "
        "(model init and data order). Learning rates: "
        + "; ".join(_lrs(label, by_seed) for label, by_seed in report["runs"].items())
        + ".",
        "",
        *markdown_table(summary, cfg["references"]),
        "",
        "Targets (issue 13), mean over seeds:",
        "",
    ]
    for name, c in summary["checks"].items():
        out.append(
            f"- {name}: {c['measured']:.4f} (worst seed {c['worst_seed']:.4f}): {'met' if c['met'] else 'NOT MET'}"
        )
    if report.get("reading"):
        out += ["", "Reading:", ""] + [f"- {line}" for line in report["reading"]]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.async_replay",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--spec", default="examples/demo.yaml", help="run spec (model, stages, micro-batch, lr)")
    p.add_argument("--micro-batches", type=int, default=600, help="training micro-batches per run")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per step (the issue's setup: 2)")
    p.add_argument("--warmup-steps", type=int, default=20, help="optimizer steps of warmup (the issue's: 20)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--optimizer",
        action="append",
        default=None,
        help=f"name[:key=value,...], repeatable: {TORCH_ADAMW} (single only), adamw, nesterov or muon with "
        "OptimizerConfig overrides, e.g. muon:muon_lr=0.01 (default: torch-adamw, adamw, muon)",
    )
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument(
        "--skip", action="append", default=None, help="leave out this run label, e.g. 'single adamw'"
    )
    p.add_argument(
        "--reference",
        action="append",
        default=None,
        help="run label ratios are taken to (default: 'single torch-adamw' and the first 'single muon...')",
    )
    p.add_argument(
        "--inflight", type=int, default=None, help="async micro-batches in flight (default: trainer's)"
    )
    p.add_argument("--latency", type=float, default=0.0, help="async-sim: message latency (units)")
    p.add_argument("--eval-batches", type=int, default=64, help="held-out micro-batches per evaluation")
    p.add_argument(
        "--eval-every", type=int, default=None, help="micro-batches between evaluations (default: 1/4)"
    )
    p.add_argument("--log-every", type=int, default=100, help="micro-batches between progress lines")
    p.add_argument(
        "--data-bytes", type=int, default=None, help="text read at most (default: swarm.train.data's)"
    )
    p.add_argument("--wire-codecs", action="store_true", help="send boundaries through the spec's codecs")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 suits a shared machine)")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON results path")
    p.add_argument("--no-markdown", action="store_true", help="do not rewrite the section of BENCHMARKS.md")
    p.add_argument("--reading", action="append", default=None, help="a line of reading for the markdown")
    p.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        default=None,
        help="no training: merge results files (e.g. one per seed, run in parallel) into --out and rewrite "
        "the section from them (with the --reading lines given now)",
    )
    args = p.parse_args(argv)
    if args.from_json:
        reports = [json.loads(path.read_text()) for path in args.from_json]
        report = merge_reports(reports, references=args.reference)
        if args.reading:
            report["reading"] = args.reading
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
        print("\n".join(markdown_table(report["summary"], report["config"]["references"])))
        if not args.no_markdown:
            write_section(markdown(report))
            print(f"updated the Async replay section of {MARKDOWN}")
        return 0

    from swarm.train.data import DataConfig, build_data

    torch.set_num_threads(args.threads)
    base = (
        RunSpec.from_yaml(args.spec)
        if not args.spec.endswith(".json")
        else RunSpec.from_json(Path(args.spec).read_bytes())
    )
    choices = [OptimizerChoice.parse(t) for t in (args.optimizer or [TORCH_ADAMW, "adamw", "muon"])]
    skip = set(args.skip or ())
    plan = [
        (c, mode)
        for c in choices
        for mode in args.modes
        if (mode == "single" or c.name != TORCH_ADAMW) and f"{mode} {c.label}" not in skip
    ]
    labels = [f"{mode} {c.label}" for c, mode in plan]
    references = args.reference or [
        *[x for x in labels if x.startswith(f"single {TORCH_ADAMW}")][:1],
        *[x for x in labels if x.startswith("single muon")][:1],
    ]
    if args.micro_batches % args.accumulate:
        p.error(f"--micro-batches {args.micro_batches} must be a multiple of --accumulate {args.accumulate}")
    eval_every = args.eval_every or max(args.accumulate, args.micro_batches // 4)
    dkw = {} if args.data_bytes is None else {"max_bytes": args.data_bytes}
    data, _ = build_data(DataConfig(**dkw), seq_len=base.model.seq_len, vocab_size=base.model.vocab_size)
    eval_set = data.eval_batches(base.micro_batch_size, args.eval_batches)
    tokens_per_mb = base.micro_batch_size * base.model.seq_len
    print(
        f"{args.spec}: {len(labels)} runs x {len(args.seeds)} seeds, {args.micro_batches} micro-batches "
        f"({args.micro_batches * tokens_per_mb:,} tokens) each; held-out {len(eval_set) * tokens_per_mb:,} tokens",
        flush=True,
    )
    runs: dict[str, dict[str, dict]] = {label: {} for label in labels}
    inflight_used = None
    for seed in args.seeds:
        stream = data.stream(base.micro_batch_size, seed=seed)
        batches = [next(stream) for _ in range(args.micro_batches)]  # what the trainer would send, in order
        for c, mode in plan:
            label = f"{mode} {c.label}"
            spec = variant_spec(
                base, c, seed=seed, mode=mode, accumulate=args.accumulate, warmup_steps=args.warmup_steps
            )
            tag = f"seed {seed} {label}"
            progress = Progress(tag, args.micro_batches, args.log_every, eval_every, tokens_per_mb)
            t0 = time.perf_counter()
            if mode == "single":
                result = run_single(spec, c.name, batches, eval_set, progress)
            else:
                inflight = args.inflight or trainer_inflight(spec.optimizer, spec.num_stages)
                schedule = make_schedule(
                    mode, spec, args.micro_batches, inflight=inflight, latency=args.latency
                )
                result = run_pipeline(
                    spec, schedule, batches, eval_set, progress, wire_codecs=args.wire_codecs
                )
                result["inflight"] = spec.optimizer.accumulate if mode == "sync" else inflight
                if mode != "sync":
                    inflight_used = inflight
            result["wall_s"] = time.perf_counter() - t0
            result["lr"], result["muon_lr"] = spec.optimizer.lr, spec.optimizer.muon_lr
            runs[label][str(seed)] = result
            print(
                f"{tag}: final held-out loss {result['evals'][-1]['loss']:.4f} ({result['wall_s']:.0f} s)",
                flush=True,
            )
    summary = summarise(runs, references, OptimizerConfig().name)
    async_stale = {  # mode -> mean stage-0 staleness of its runs
        mode: statistics.fmean(r["staleness_mean"][0] for by in by_mode for r in by.values())
        for mode in ASYNC_MODES
        if (by_mode := [by for label, by in runs.items() if label.startswith(f"{mode} ")])
    }
    report = {
        "command": "python -m benchmarks.async_replay " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(),
        "config": {
            "spec": args.spec,
            "d_model": base.model.d_model,
            "n_layers": base.model.n_layers,
            "stages": base.num_stages,
            "micro_batch_size": base.micro_batch_size,
            "seq_len": base.model.seq_len,
            "micro_batches": args.micro_batches,
            "tokens": args.micro_batches * tokens_per_mb,
            "accumulate": args.accumulate,
            "warmup_steps": args.warmup_steps,
            "inflight": inflight_used,
            "latency": args.latency,
            "async_staleness": ", ".join(f"{m} {v:.2f}" for m, v in async_stale.items()) or "n/a",
            "wire_codecs": args.wire_codecs,
            "eval_tokens": len(eval_set) * tokens_per_mb,
            "references": references,
            "optimizers": [c.label for c in choices],
            "out": os.path.relpath(args.out, ROOT) if args.out.is_absolute() else str(args.out),
        },
        "summary": summary,
        "reading": args.reading or [],
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {args.out}\n")
    print("\n".join(markdown_table(summary, references)))
    print()
    for name, c in summary["checks"].items():
        print(
            f"{name}: {c['measured']:.4f} (worst seed {c['worst_seed']:.4f}) {'met' if c['met'] else 'NOT MET'}"
        )
    if not args.no_markdown:
        write_section(markdown(report))
        print(f"updated the Async replay section of {MARKDOWN}")
    finals = [r["evals"][-1]["loss"] for by in runs.values() for r in by.values()]
    return 0 if all(math.isfinite(x) for x in finals) else 1


if __name__ == "__main__":
    sys.exit(main())
