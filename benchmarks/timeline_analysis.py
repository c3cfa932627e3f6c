"""Where a swarm's stage peers sat idle: the timelines of one run turned into figures (pure logic).

Input: the events of every stage peer of a run (note "timeline" in peer/timeline.py: ``arrived``,
``queued``, ``started``, ``ended``, ``sending``, ``sent`` per micro-batch, pass and stage). Output:

- :func:`stage_table`: per stage, the busy fraction of its worker thread in a steady-state window and
  its idle time split by cause: **waiting for input** (nothing had arrived: the forward's activations,
  from the trainer at stage 0, or the backward's gradient), **receiving** (a request had arrived and
  was being validated and decoded) and **worker hand-off** (it was queued, the worker had not taken it
  yet); plus the time passes spent queued behind another pass (a latency, not idle time).
- :func:`hops`: per hop, the seconds from the end of a task to the next stage's arrival, split into
  the hand-off to the event loop and the send itself.
- ``core_share`` (per stage) and ``compute_cpu_cores``: the worker threads' CPU seconds over their
  running time and over the window, from the CPU times at ``started``/``ended``; a running task whose
  share is below 1 waited for a core (other stages, or other processes, held it).
- :func:`cores`: the machine's view. All stage peers share ``n_cores`` cores, so what matters is how
  many tasks run at once: with fewer than ``n_cores`` running a core is idle, and each such instant is
  attributed to where the micro-batches in flight were meanwhile (queued behind a running pass on the
  same stage, between stages, or too few in flight).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Pass", "build_passes", "cores", "hops", "stage_table", "steady_window"]


@dataclass
class Pass:
    """One pass of one micro-batch at one stage, with the times of its events (None: not seen)."""

    stage: int
    mb: str
    kind: str  # "forward" or "backward"
    arrived: float | None = None
    queued: float | None = None
    started: float | None = None
    ended: float | None = None
    sending: float | None = None
    sent: float | None = None
    cpu_s: float | None = None  # the worker thread's CPU seconds from started to ended

    @property
    def core_share(self) -> float | None:
        """CPU over wall time while it ran: the share of a core it had (below 1: it shared a core)."""
        if self.cpu_s is None or not self.ran or self.ended <= self.started:  # type: ignore[operator]
            return None
        return self.cpu_s / (self.ended - self.started)  # type: ignore[operator]

    @property
    def ran(self) -> bool:
        return self.started is not None and self.ended is not None

    @property
    def ready(self) -> float | None:
        """When it could have run: queued (or arrived, or started, whichever is known first)."""
        return next((t for t in (self.queued, self.arrived, self.started) if t is not None), None)


EVENT_FIELDS = ("arrived", "queued", "started", "ended", "sending", "sent")


def build_passes(events: Iterable[dict[str, Any]]) -> list[Pass]:
    """Group timeline events (dicts with ``t``, ``mb``, ``pass``, ``event``, ``stage``) into passes;
    a repeated event keeps its first time."""
    out: dict[tuple[int, str, str], Pass] = {}
    cpu: dict[tuple[int, str, str], dict[str, float]] = defaultdict(dict)
    for e in events:
        key = (int(e["stage"]), str(e["mb"]), str(e["pass"]))
        p = out.get(key) or out.setdefault(key, Pass(*key))
        name = str(e["event"])
        if name in EVENT_FIELDS and getattr(p, name) is None:
            setattr(p, name, float(e["t"]))
            if e.get("cpu") is not None:
                cpu[key].setdefault(name, float(e["cpu"]))
    for key, c in cpu.items():
        if "started" in c and "ended" in c:
            out[key].cpu_s = max(0.0, c["ended"] - c["started"])
    return sorted(out.values(), key=lambda p: (p.started or p.ready or 0.0, p.stage))


def steady_window(passes: Sequence[Pass], skip_first: int = 8, skip_last: int = 8) -> tuple[float, float]:
    """From the start of stage 0's ``skip_first``-th forward to that of its ``skip_last``-th from the
    end: the pipeline is full there (start-up and drain left out)."""
    starts = sorted(p.started for p in passes if p.stage == 0 and p.kind == "forward" and p.ran)
    if len(starts) < skip_first + skip_last + 2:
        raise ValueError(
            f"stage 0 ran {len(starts)} forwards; a steady window needs more than "
            f"skip_first + skip_last + 1 = {skip_first + skip_last + 1}: run more micro-batches"
        )
    return starts[skip_first], starts[len(starts) - 1 - skip_last]


def _clip(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def stage_table(passes: Sequence[Pass], window: tuple[float, float]) -> dict[int, dict[str, float]]:
    """Per stage: ``busy`` (fraction of the window its worker ran a task), the idle fractions by cause
    (note at the top of the module) and ``queued_behind_s`` (mean seconds a task waited while another
    pass ran), ``tasks`` (tasks started in the window)."""
    lo, hi = window
    span = hi - lo
    if span <= 0:
        raise ValueError(f"window {window} is empty")
    by_stage: dict[int, list[Pass]] = defaultdict(list)
    for p in passes:
        if p.ran:
            by_stage[p.stage].append(p)
    out: dict[int, dict[str, float]] = {}
    for stage, tasks in sorted(by_stage.items()):
        tasks.sort(key=lambda p: p.started)  # type: ignore[arg-type,return-value]
        row = defaultdict(float)
        behind, n_in, cpu, wall = 0.0, 0, 0.0, 0.0
        for i, b in enumerate(tasks):
            row["busy"] += _clip(b.started, b.ended, lo, hi)  # type: ignore[arg-type]
            if lo <= b.started < hi:  # type: ignore[operator]
                n_in += 1
                if b.cpu_s is not None:
                    cpu += b.cpu_s
                    wall += b.ended - b.started  # type: ignore[operator]
                if i > 0 and b.queued is not None:
                    behind += max(0.0, min(b.started, tasks[i - 1].ended) - b.queued)  # type: ignore[arg-type,type-var]
            if i == 0:
                continue
            a_end = tasks[i - 1].ended
            assert a_end is not None and b.started is not None
            arrived = b.arrived if b.arrived is not None else b.ready
            queued = b.queued if b.queued is not None else arrived
            t1 = max(a_end, min(arrived or b.started, b.started))
            t2 = max(t1, min(queued or b.started, b.started))
            wait = (
                "waiting for the trainer"
                if b.kind == "forward" and stage == 0
                else "waiting for activations"
                if b.kind == "forward"
                else "waiting for a gradient"
            )
            row[wait] += _clip(a_end, t1, lo, hi)
            row["receiving (validate, decode)"] += _clip(t1, t2, lo, hi)
            row["worker hand-off"] += _clip(t2, b.started, lo, hi)
        out[stage] = {k: v / span for k, v in row.items()}
        out[stage]["idle"] = 1.0 - out[stage]["busy"]
        out[stage]["queued_behind_s"] = behind / max(1, n_in)
        out[stage]["tasks"] = float(n_in)
        if wall > 0:
            out[stage]["core_share"] = cpu / wall  # CPU per wall second while it ran
    return out


def hops(passes: Sequence[Pass], window: tuple[float, float]) -> dict[str, dict[str, float]]:
    """Per hop ``s->s+1`` (forward) and ``s->s-1`` (backward) started in the window: mean seconds from
    the task's end to the event loop's send (``to_loop_s``), from there to the next stage's arrival
    (``send_s``), and in all (``hop_s``)."""
    lo, hi = window
    index = {(p.stage, p.mb, p.kind): p for p in passes}
    acc: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for p in passes:
        if not p.ran or not lo <= p.ended < hi:  # type: ignore[operator]
            continue
        nxt_stage = p.stage + 1 if p.kind == "forward" else p.stage - 1
        nxt = index.get((nxt_stage, p.mb, p.kind))
        if nxt is None and p.kind == "forward":  # the last stage's forward task ran the backward too
            nxt = index.get((p.stage - 1, p.mb, "backward"))
            nxt_stage = p.stage - 1
        sending = p.sending
        if sending is None and p.kind == "forward" and (own := index.get((p.stage, p.mb, "backward"))):
            sending = own.sending  # the last stage's gradient send is marked under its backward pass
        if nxt is None or nxt.arrived is None or sending is None:
            continue
        acc[f"{p.stage}->{nxt_stage}"].append((sending - p.ended, nxt.arrived - sending))  # type: ignore[operator]
    out = {}
    for k, v in sorted(acc.items()):
        a = np.asarray(v)
        out[k] = {
            "to_loop_s": float(a[:, 0].mean()),
            "send_s": float(a[:, 1].mean()),
            "hop_s": float(a.sum(axis=1).mean()),
            "n": float(len(v)),
        }
    return out


def _segments(passes: Sequence[Pass]) -> dict[str, list[tuple[float, float, int]]]:
    """Intervals (start, end, stage) of each state of the passes: running, queued, receiving, and
    transit (from a task's end to the next stage's arrival)."""
    index = {(p.stage, p.mb, p.kind): p for p in passes}
    seg: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for p in passes:
        if p.ran:
            seg["running"].append((p.started, p.ended, p.stage))  # type: ignore[arg-type]
        if p.queued is not None and p.started is not None:
            seg["queued"].append((p.queued, p.started, p.stage))
        if p.arrived is not None and p.queued is not None:
            seg["receiving"].append((p.arrived, p.queued, p.stage))
        nxt = index.get((p.stage + (1 if p.kind == "forward" else -1), p.mb, p.kind))
        if nxt is None and p.kind == "forward":
            nxt = index.get((p.stage - 1, p.mb, "backward"))
        if p.ended is not None and nxt is not None and nxt.arrived is not None:
            seg["transit"].append((p.ended, nxt.arrived, nxt.stage))
    return seg


def _count(intervals: Iterable[tuple[float, float, int]], lo: float, dt: float, n: int) -> np.ndarray:
    """How many of ``intervals`` cover each of ``n`` grid points ``lo + (i + 0.5) * dt``."""
    d = np.zeros(n + 1)
    for a, b, _ in intervals:
        i, j = int(np.ceil((a - lo) / dt - 0.5)), int(np.ceil((b - lo) / dt - 0.5))
        i, j = max(0, i), min(n, j)
        if j > i:
            d[i] += 1
            d[j] -= 1
    return np.cumsum(d)[:n]


def cores(
    passes: Sequence[Pass], window: tuple[float, float], n_cores: int, dt: float = 0.001
) -> dict[str, Any]:
    """The machine's view (module note): ``busy_cores`` (mean of min(running tasks, n_cores)),
    ``running_hist`` (fraction of the window with k tasks running), the share of the window with a
    core idle and, of that, ``idle_causes``: ``stacked`` (work queued behind a running pass while a
    core was free), ``between stages`` (work in transit or being received), ``both``, ``too few in
    flight`` (neither); and the mean number of micro-batches in each state meanwhile."""
    lo, hi = window
    n = max(1, int((hi - lo) / dt))
    seg = _segments(passes)
    running_by_stage = {}
    stages = sorted({s for *_, s in seg["running"]})
    for s in stages:
        running_by_stage[s] = np.minimum(1, _count([x for x in seg["running"] if x[2] == s], lo, dt, n))
    running = sum(running_by_stage.values()) if stages else np.zeros(n)
    stacked = np.zeros(n)
    for s in stages:  # queued at a stage that is running something else
        q = _count([x for x in seg["queued"] if x[2] == s], lo, dt, n)
        stacked += np.where(running_by_stage[s] > 0, q, 0)
    between = _count(seg["transit"], lo, dt, n) + _count(seg["receiving"], lo, dt, n)
    idle = running < n_cores
    frac_idle = float(idle.mean())
    cause = {
        "stacked": float((idle & (stacked > 0) & (between == 0)).mean()),
        "between stages": float((idle & (stacked == 0) & (between > 0)).mean()),
        "both": float((idle & (stacked > 0) & (between > 0)).mean()),
        "too few in flight": float((idle & (stacked == 0) & (between == 0)).mean()),
    }
    hist = {str(k): float((running == k).mean()) for k in range(len(stages) + 1)}
    sel = idle if idle.any() else np.ones(n, bool)
    inside = [p for p in passes if p.ran and p.cpu_s is not None and lo <= p.started < hi]  # type: ignore[operator]
    return {
        "n_cores": n_cores,
        "busy_cores": float(np.minimum(running, n_cores).mean()),
        # the compute threads' CPU per second: below busy_cores when running tasks shared cores
        "compute_cpu_cores": sum(p.cpu_s for p in inside) / (hi - lo) if inside else None,  # type: ignore[misc]
        "running_hist": hist,
        "core_idle_share": frac_idle,
        "idle_causes": cause,
        "while_idle_mean": {
            "running": float(running[sel].mean()),
            "stacked": float(stacked[sel].mean()),
            "between stages": float(between[sel].mean()),
        },
        "window_s": hi - lo,
    }
