"""What a trainer tells its user: a progress line, ``metrics.jsonl``, a loss plot and a summary.

- :class:`MetricsWriter` appends one JSON object per line to ``OUT/metrics.jsonl`` and flushes it,
  so a crashed or interrupted run still leaves every finished step on disk. Record types:
  ``{"type": "step", ...}`` (see :func:`step_record`), ``{"type": "eval", ...}`` and
  ``{"type": "event", ...}`` (a peer failure, a stage waiting for peers).
- :class:`ProgressDisplay` redraws one ``\\r`` line on a terminal and prints a plain line every
  ``interval_s`` otherwise (CI logs, pipes): no tqdm dependency.
- :func:`plot_loss` draws the loss curve to a PNG with matplotlib's Agg canvas (no display, no
  global pyplot state), :func:`summarize` / :func:`format_summary` build and print the final summary.

Bytes per token per link (note "link bytes"): peers put per-hop byte counts in their report stats
(keys containing ``bytes``, e.g. ``fwd_bytes_0``); a step record holds, per such key, the bytes it
counted divided by the tokens of the step. Their sum is what the pipeline put on the wire per
token; the uncompressed reference is ``2 * (stages - 1) * d_model * 4`` (one fp32 activation and one
fp32 gradient per token on each of the ``stages - 1`` links).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

__all__ = [
    "MetricsWriter",
    "ProgressSnapshot",
    "ProgressDisplay",
    "format_progress",
    "step_record",
    "read_metrics",
    "plot_loss",
    "summarize",
    "format_summary",
    "uncompressed_bytes_per_token",
]


class MetricsWriter:
    """Append-only JSONL file of metric records; each write is flushed at once."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def write(self, record: Mapping[str, Any]) -> None:
        if self._file is None:
            raise ValueError(f"metrics file {self.path} is closed")
        self._file.write(json.dumps(_finite(record), sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _finite(value: Any) -> Any:
    """JSON has no NaN/Inf: write them as null so every line parses everywhere."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def read_metrics(path: str | os.PathLike[str], kind: str | None = None) -> list[dict[str, Any]]:
    """Records of a metrics file (optionally only those of ``type == kind``); bad lines are skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash mid-write
            if isinstance(rec, dict) and (kind is None or rec.get("type") == kind):
                out.append(rec)
    return out


def step_record(
    *,
    step: int,
    elapsed_s: float,
    loss: float | None,
    tokens: int,
    step_tokens: int,
    step_stats: Mapping[str, float],
    completed: int,
    dropped: int,
    inflight: int,
    tokens_per_s: float,
    step_micro_batches: int = 0,
) -> dict[str, Any]:
    """One ``metrics.jsonl`` line for a finished step (see note "link bytes").

    ``staleness`` maps a stage index (as a string) to the mean number of weight versions that stage
    stepped between a micro-batch's forward and its backward, over the step's ``step_micro_batches``
    completed micro-batches (0 = no staleness, as in synchronous training). ``applied_staleness``: the
    same up to the step that *applies* the gradient, as the stage's peers estimate it (for replicas it
    includes the wait for their round; the last stage is 0 unless it has replicas)."""
    per_token = {
        k: v / step_tokens for k, v in sorted(step_stats.items()) if "bytes" in k and step_tokens > 0
    }
    staleness, applied = (
        {
            k.removeprefix(prefix): round(v / step_micro_batches, 3)
            for k, v in sorted(step_stats.items())
            if k.startswith(prefix) and step_micro_batches > 0
        }
        for prefix in ("staleness_", "applied_staleness_")
    )
    return {
        "type": "step",
        "step": step,
        "time": round(elapsed_s, 3),
        "wall": round(time.time(), 3),
        "loss": loss,
        "tokens": tokens,
        "tokens_per_s": round(tokens_per_s, 1),
        "bytes_per_token": per_token,
        "bytes_per_token_total": sum(per_token.values()),
        "completed": completed,
        "dropped": dropped,
        "inflight": inflight,
        "staleness": staleness,
        "applied_staleness": applied,
    }


# ------------------------------------------------------------------------------------- progress


@dataclass(frozen=True)
class ProgressSnapshot:
    """The numbers a progress line shows."""

    tokens: int
    target_tokens: int | None
    step: int
    target_steps: int | None
    tokens_per_s: float
    loss: float | None
    inflight: int
    completed: int
    dropped: int


def format_progress(s: ProgressSnapshot, *, width: int = 24) -> str:
    """``[#####.....] 40% step 12/30 | 51.2k tok | 1.9k tok/s | loss 2.31 | in flight 4 | dropped 0``."""
    if s.target_steps:
        frac = s.step / s.target_steps
    elif s.target_tokens:
        frac = s.tokens / s.target_tokens
    else:
        frac = 0.0
    frac = min(max(frac, 0.0), 1.0)
    filled = int(round(frac * width))
    bar = "[" + "#" * filled + "." * (width - filled) + f"] {frac * 100:3.0f}%"
    step = f"step {s.step}" + (f"/{s.target_steps}" if s.target_steps else "")
    loss = "loss  -  " if s.loss is None else f"loss {s.loss:.3f}"
    return (
        f"{bar} {step} | {_si(s.tokens)} tok | {_si(s.tokens_per_s)} tok/s | {loss} | "
        f"in flight {s.inflight} | done {s.completed} | dropped {s.dropped}"
    )


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


class ProgressDisplay:
    """A self-redrawing line on a terminal; periodic plain lines elsewhere.

    ``stream`` defaults to stderr; ``is_tty`` defaults to ``stream.isatty()``; ``interval_s`` is the
    period of plain lines (terminal redraws are throttled to 5 per second).
    """

    def __init__(
        self,
        stream: IO[str] | None = None,
        *,
        is_tty: bool | None = None,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = bool(is_tty) if is_tty is not None else _isatty(self.stream)
        self.interval_s = interval_s
        self._clock = clock
        self._last = -math.inf
        self._drawn = 0  # characters of the line currently on screen (tty)

    def update(self, snapshot: ProgressSnapshot, *, force: bool = False) -> None:
        now = self._clock()
        period = 0.2 if self.is_tty else self.interval_s
        if not force and now - self._last < period:
            return
        self._last = now
        line = format_progress(snapshot)
        if self.is_tty:
            pad = " " * max(0, self._drawn - len(line))
            self.stream.write("\r" + line + pad)
            self._drawn = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """Print a line of its own (clearing the progress line first on a terminal)."""
        if self.is_tty and self._drawn:
            self.stream.write("\r" + " " * self._drawn + "\r")
            self._drawn = 0
        self.stream.write(text + "\n")
        self.stream.flush()
        self._last = -math.inf  # redraw the bar right after the message

    def close(self) -> None:
        if self.is_tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = 0


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# ----------------------------------------------------------------------------------------- plot


def plot_loss(records: Iterable[Mapping[str, Any]], path: str | os.PathLike[str], *, title: str = "") -> Path:
    """Draw training (per step) and evaluation loss against tokens to a PNG at ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = list(records)
    steps = [r for r in records if r.get("type") == "step" and r.get("loss") is not None]
    evals = [r for r in records if r.get("type") == "eval" and r.get("eval_loss") is not None]
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if steps:
        ax.plot([r["tokens"] for r in steps], [r["loss"] for r in steps], lw=1, label="train loss (per step)")
        if len(steps) >= 10:
            k = max(2, len(steps) // 20)
            smooth = _moving_average([r["loss"] for r in steps], k)
            ax.plot([r["tokens"] for r in steps][k - 1 :], smooth, lw=2, label=f"train loss ({k}-step mean)")
    if evals:
        ax.plot([r["tokens"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out loss")
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title or "swarmpipe training loss")
    ax.grid(alpha=0.3)
    if steps or evals:
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _moving_average(xs: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        if i >= k - 1:
            out.append(acc / k)
    return out


# -------------------------------------------------------------------------------------- summary


def uncompressed_bytes_per_token(num_stages: int, d_model: int) -> float:
    """Bytes per token on all links of an fp32 pipeline (see note "link bytes")."""
    return 2.0 * (num_stages - 1) * d_model * 4


def _mean_of(values: list[float], n: int, *, tail: bool) -> float | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    part = values[-n:] if tail else values[:n]
    return sum(part) / len(part)


def summarize(
    records: Iterable[Mapping[str, Any]],
    *,
    wall_s: float,
    totals: Mapping[str, Any],
    num_stages: int,
    d_model: int,
    peers_by_stage: Mapping[int, Mapping[str, int]] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The end-of-run summary (a JSON-ready dict) from the step/eval records and the ledger totals.

    ``loss_first`` / ``loss_last`` are means over the first and last 5 steps (single steps are noisy).
    """
    records = list(records)
    steps = [r for r in records if r.get("type") == "step"]
    evals = [r for r in records if r.get("type") == "eval" and r.get("eval_loss") is not None]
    losses = [r.get("loss") for r in steps]
    tokens = steps[-1]["tokens"] if steps else 0
    total_bytes = sum(
        r.get("bytes_per_token_total", 0.0) * _step_tokens(steps, i) for i, r in enumerate(steps)
    )
    bpt = total_bytes / tokens if tokens else None
    raw = uncompressed_bytes_per_token(num_stages, d_model)
    summary: dict[str, Any] = {
        "wall_s": round(wall_s, 2),
        "steps": steps[-1]["step"] if steps else 0,
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "loss_first": _mean_of(losses, 5, tail=False),
        "loss_last": _mean_of(losses, 5, tail=True),
        "eval_loss_first": evals[0]["eval_loss"] if evals else None,
        "eval_loss_last": evals[-1]["eval_loss"] if evals else None,
        "bytes_per_token": bpt,
        "uncompressed_bytes_per_token": raw,
        "compression_ratio": (raw / bpt) if bpt else None,
        "micro_batches": dict(totals),
        "peers_by_stage": {str(k): dict(v) for k, v in (peers_by_stage or {}).items()},
        "staleness": _mean_staleness(steps),
        "applied_staleness": _mean_staleness(steps, "applied_staleness"),
    }
    if extra:
        summary.update(extra)
    return _finite(summary)


def _mean_staleness(steps: list[Mapping[str, Any]], key: str = "staleness") -> dict[str, float]:
    """Per stage, the mean staleness (``key``: ``staleness`` or ``applied_staleness``) of the run's
    micro-batches (each step weighted by its tokens)."""
    sums: dict[str, float] = defaultdict(float)
    weights: dict[str, float] = defaultdict(float)
    for i, r in enumerate(steps):
        w = _step_tokens(steps, i)
        for stage, v in (r.get(key) or {}).items():
            sums[stage] += v * w
            weights[stage] += w
    return {st: round(sums[st] / weights[st], 3) for st in sorted(sums, key=int) if weights[st] > 0}


def _step_tokens(steps: list[Mapping[str, Any]], i: int) -> int:
    return steps[i]["tokens"] - (steps[i - 1]["tokens"] if i > 0 else 0)


def format_summary(summary: Mapping[str, Any]) -> str:
    """A few human lines for the end of a run. Per peer: micro-batches served and, when the summary has
    ``peer_loss``, the recent loss of micro-batches routed through it (a diverging replica stands out)."""

    def num(x: Any, fmt: str = ".3f") -> str:
        return "-" if x is None else format(x, fmt)

    mb = summary.get("micro_batches", {})
    lines = [
        f"trained {summary.get('tokens', 0)} tokens in {summary.get('steps', 0)} steps, "
        f"{num(summary.get('wall_s'), '.1f')} s ({num(summary.get('tokens_per_s'), '.0f')} tokens/s)",
        f"loss {num(summary.get('loss_first'))} -> {num(summary.get('loss_last'))} (mean of first/last 5 steps)"
        + (
            f"; held-out {num(summary.get('eval_loss_first'))} -> {num(summary.get('eval_loss_last'))}"
            if summary.get("eval_loss_last") is not None
            else ""
        ),
        f"wire: {num(summary.get('bytes_per_token'), '.0f')} bytes/token vs "
        f"{num(summary.get('uncompressed_bytes_per_token'), '.0f')} uncompressed fp32"
        + (f" ({summary['compression_ratio']:.1f}x smaller)" if summary.get("compression_ratio") else ""),
        f"micro-batches: {mb.get('completed', 0)} completed, {mb.get('dropped', 0)} dropped"
        + (f" {mb.get('dropped_by_reason')}" if mb.get("dropped") else "")
        + f", {mb.get('retries', 0)} retries, {mb.get('late_reports', 0)} late reports ignored",
    ]
    if summary.get("staleness"):
        lines.append(
            "staleness (versions between forward and backward, mean): "
            + ", ".join(f"stage {st} {v:.2f}" for st, v in summary["staleness"].items())
        )
    if any(summary.get("applied_staleness", {}).values()):
        lines.append(
            "applied staleness (versions between forward and the step applying it, peers' estimate): "
            + ", ".join(f"stage {st} {v:.2f}" for st, v in summary["applied_staleness"].items())
        )
    peer_loss = summary.get("peer_loss", {})
    for stage, peers in sorted(summary.get("peers_by_stage", {}).items(), key=lambda kv: int(kv[0])):
        losses = peer_loss.get(stage, {})
        served = ", ".join(
            f"{pid[-8:]}: {n}" + (f" (loss {losses[pid]:.2f})" if losses.get(pid) is not None else "")
            for pid, n in sorted(peers.items())
        )
        lines.append(f"stage {stage}: {served or 'no peer'}")
    return "\n".join(lines)
