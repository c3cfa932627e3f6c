"""What the trainer writes: lines and the progress line for the user, metrics.jsonl and its sinks, and
the summary (summary.json, loss.png, the printed table) at the end."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from swarm.traffic import TRAFFIC
from swarm.train.logging_sinks import make_sinks
from swarm.train.metrics import (
    MetricsWriter,
    ProgressDisplay,
    ProgressSnapshot,
    format_summary,
    plot_loss,
    read_metrics,
    summarize,
)

if TYPE_CHECKING:
    from swarm.run.spec import RunSpec
    from swarm.train.accounting import Ledger
    from swarm.train.config import TrainerConfig
    from swarm.train.policy import Policy
    from swarm.train.steps import StepBook

__all__ = ["Console", "Records", "write_summary"]


class Console:
    """The user's terminal: lines that do not break the progress line (nothing when ``quiet``)."""

    def __init__(self, out: IO[str], *, quiet: bool, interval_s: float):
        self.out = out
        self.quiet = quiet
        self.progress = None if quiet else ProgressDisplay(out, interval_s=interval_s)

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.message(text)

    def show(self, snapshot: ProgressSnapshot) -> None:
        if self.progress is not None:
            self.progress.update(snapshot)

    def close(self, last: ProgressSnapshot) -> None:
        if self.progress is not None:
            self.progress.update(last)
            self.progress.close()


class Records:
    """This session's metrics.jsonl (None without ``out_dir``) and the extra sinks of ``log``; record
    times count from ``started`` (moved back by a resumed session's time, note "resume")."""

    def __init__(
        self, config: TrainerConfig, spec: RunSpec, *, clock: Callable[[], float], started: float
    ) -> None:
        self.clock = clock
        self.started = started
        self.writer = MetricsWriter(Path(config.out_dir) / "metrics.jsonl") if config.out_dir else None
        self.sinks = (
            make_sinks(config.log, config.out_dir, spec.run_id, spec.to_dict()) if config.log else None
        )

    def elapsed(self) -> float:
        return self.clock() - self.started

    def write(self, record: dict[str, Any]) -> None:
        """A step or eval record: to the file and to the sinks."""
        if self.writer is not None:
            self.writer.write(record)
        if self.sinks is not None:
            self.sinks.write(record)

    def event(self, event: str, **fields: Any) -> None:
        """An event record: to the file only."""
        if self.writer is not None:
            self.writer.write({"type": "event", "event": event, "time": round(self.elapsed(), 3), **fields})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.sinks is not None:
            self.sinks.close()


def write_summary(
    config: TrainerConfig,
    spec: RunSpec,
    *,
    trainer_id: str,
    book: StepBook,
    ledger: Ledger,
    policy: Policy,
    wall_s: float,
    out: IO[str],
) -> dict[str, Any]:
    """Summarise the session (``summarize``, swarm/train/metrics.py), write summary.json and loss.png to
    ``out_dir`` and print the table unless ``quiet``; returns the summary."""
    records = read_metrics(Path(config.out_dir) / "metrics.jsonl") if config.out_dir else []
    summary = summarize(
        records,
        wall_s=wall_s,
        totals=ledger.totals("train"),
        num_stages=spec.num_stages,
        d_model=spec.model.d_model,
        peers_by_stage={s: dict(p) for s, p in book.peers_by_stage.items()},
        extra={
            "run_id": spec.run_id,
            "spec_hash": spec.spec_hash,
            "trainer_id": trainer_id,
            "mode": spec.optimizer.mode,
            "inflight": policy.summary(),
            "eval_micro_batches": ledger.totals("eval"),
            "peer_loss": {
                str(st): {p: round(v, 4) for p, v in d.items()} for st, d in book.peer_loss.items()
            },
            "codecs": {"activations": spec.codecs.activations, "gradients": spec.codecs.gradients},
            "traffic": TRAFFIC.snapshot(),  # what this trainer sent, by kind (swarm/traffic.py)
        },
    )
    if not records:  # no files: the summary still needs the numbers the ledger knows
        summary["tokens"] = book.tokens_done
        summary["steps"] = book.step
    if config.out_dir:
        out_dir = Path(config.out_dir)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        plot_loss(records, out_dir / "loss.png", title=f"run {spec.run_id}: training loss")
    if not config.quiet:
        print(format_summary(summary), file=out, flush=True)
        if config.out_dir:
            print(f"metrics, loss plot and summary in {os.path.abspath(config.out_dir)}", file=out)
    return summary
