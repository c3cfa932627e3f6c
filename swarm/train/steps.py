"""The trainer's books: what the step in progress accumulated, its record when the loop closes it, the
totals the progress line, DHT progress and the summary read, and the held-out evaluation rounds.

Recording and closing are apart: completions and drops are recorded as they are reacted to; the loop
(swarm/train/loop.py) closes a step when the policy says it is full (note "trainer step" in
swarm/train/policy.py).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from swarm.train.metrics import ProgressSnapshot, step_record

if TYPE_CHECKING:
    from swarm.train.accounting import Attempt, Ledger, MicroBatch
    from swarm.train.data import TokenData
    from swarm.train.resume import ResumeState

__all__ = ["StepSums", "StepBook", "Evaluation"]


@dataclass
class StepSums:
    """Accumulators of the trainer step in progress."""

    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    stats: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    resolved: int = 0  # micro-batches of this step completed or dropped
    completed: int = 0  # micro-batches of this step completed


class StepBook:
    """Steps, tokens and completions of this trainer, continued from a resumed session's (note "resume")."""

    def __init__(self, *, accumulate: int, resumed: ResumeState | None):
        self.step = 0
        self.tokens_done = 0
        self.tokens_before = 0  # tokens of earlier sessions (note "resume"): not in this session's rate
        self.completed_train = 0
        self.cur = StepSums()
        self.last_loss: float | None = None
        self.first_send: float | None = None
        self.peers_by_stage: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        # EMA of the training loss of micro-batches routed through each peer (stage -> peer -> loss)
        self.peer_loss: dict[int, dict[str, float]] = defaultdict(dict)
        if resumed is not None:
            self.step, self.tokens_done, self.tokens_before = resumed.step, resumed.tokens, resumed.tokens
            self.completed_train = resumed.step * accumulate

    def sent(self, now: float) -> None:
        if self.first_send is None:
            self.first_send = now

    def completed(self, attempt: Attempt, mb: MicroBatch) -> None:
        """A micro-batch completed on ``attempt``'s route (a training one adds to the step in progress)."""
        for stage, pid in enumerate(attempt.route):
            self.peers_by_stage[stage][pid] += 1
        if mb.kind != "train":
            return
        self.completed_train += 1
        self.tokens_done += mb.n_tokens
        self.cur.tokens += mb.n_tokens
        if mb.loss is not None and math.isfinite(mb.loss):
            self.cur.losses.append(mb.loss)
            for stage, pid in enumerate(attempt.route):  # a replica whose weights went bad shows here
                old = self.peer_loss[stage].get(pid)
                self.peer_loss[stage][pid] = mb.loss if old is None else 0.9 * old + 0.1 * mb.loss
        for k, v in attempt.stats.items():
            self.cur.stats[k] += v
        self.cur.completed += 1
        self.cur.resolved += 1

    def late_loss(self, loss: float | None) -> None:
        """A loss that arrived after its micro-batch's ``done``."""
        if loss is not None and math.isfinite(loss):
            self.cur.losses.append(loss)

    def dropped(self) -> None:
        """A training micro-batch of the step in progress was dropped."""
        self.cur.resolved += 1

    def close(self, *, elapsed_s: float, totals: dict[str, Any], tokens_per_s: float) -> dict[str, Any]:
        """Close the step in progress and return its record (``step_record``, swarm/train/metrics.py)."""
        cur = self.cur
        self.step += 1
        loss = sum(cur.losses) / len(cur.losses) if cur.losses else None
        if loss is not None:
            self.last_loss = loss
        self.cur = StepSums()
        return step_record(
            step=self.step,
            elapsed_s=elapsed_s,
            loss=loss,
            tokens=self.tokens_done,
            step_tokens=cur.tokens,
            step_stats=dict(cur.stats),
            completed=totals["completed"],
            dropped=totals["dropped"],
            inflight=totals["inflight"],
            tokens_per_s=tokens_per_s,
            step_micro_batches=cur.completed,
        )

    def snapshot(
        self, ledger: Ledger, *, now: float, target_steps: int, target_tokens: int
    ) -> ProgressSnapshot:
        """The progress line's numbers."""
        t = ledger.totals("train")
        return ProgressSnapshot(
            tokens=self.tokens_done,
            target_tokens=target_tokens,
            step=self.step,
            target_steps=target_steps,
            tokens_per_s=self.tokens_per_s(now),
            loss=self.last_loss,
            inflight=ledger.inflight(),
            completed=t["completed"],
            dropped=t["dropped"],
        )

    def tokens_per_s(self, now: float) -> float:
        """This session's training rate since its first send."""
        if self.first_send is None or now <= self.first_send:
            return 0.0
        return (self.tokens_done - self.tokens_before) / (now - self.first_send)


class Evaluation:
    """Held-out loss through the swarm every ``every`` trainer steps (and at the end): one round at a time.

    Note "evaluation between windows": in sync mode (a lockstep policy) the loop opens no new window while
    a round runs, and a round opens only after a step closed, i.e. with nothing of training in flight; so
    the round sees exactly one version of every stage (the step's), as a synchronous pipeline evaluates
    between its steps, and its time is known (``eval_s`` with ``paused: true`` in the record: training
    time is the record time minus those). In async mode rounds overlap training (``paused: false``)."""

    def __init__(self, *, every: int, batches: int, micro_batch_size: int, target_steps: int):
        self.every = every
        self.batches = batches
        self.micro_batch_size = micro_batch_size
        self.target_steps = target_steps
        self.due = False  # a round is to open at the next fill
        self.round: list[int] | None = None  # ledger indices of the round in progress
        self.step = 0  # the step whose weights the round evaluates
        self.tokens = 0
        self.opened_s = 0.0  # the session's elapsed seconds when the round opened
        self.paused = False  # training waits for the round (note "evaluation between windows")

    def step_closed(self, step: int) -> None:
        if self.every and step % self.every == 0 and step < self.target_steps:
            self.due = True  # the last step's round is the final one, after the drain

    def open(
        self,
        ledger: Ledger,
        data: TokenData,
        *,
        step: int,
        tokens: int,
        elapsed_s: float = 0.0,
        paused: bool = False,
    ) -> None:
        self.due = False
        self.step, self.tokens = step, tokens
        self.opened_s, self.paused = elapsed_s, paused
        self.round = [
            ledger.open("eval", x.numel(), data={"tokens": x, "targets": y, "avoid": set()}).index
            for x, y in data.eval_batches(self.micro_batch_size, self.batches)
        ]

    def finished(self, ledger: Ledger, *, elapsed_s: float) -> dict[str, Any] | None:
        """The round's ``eval`` record once none of its micro-batches is pending or in flight, else None."""
        if self.round is None:
            return None
        mbs = [ledger.micro_batches[i] for i in self.round]
        if any(mb.state in ("pending", "inflight") for mb in mbs):
            return None
        losses = [mb.loss for mb in mbs if mb.state == "completed" and mb.loss is not None]
        self.round = None
        return {
            "type": "eval",
            "step": self.step,
            "time": round(elapsed_s, 3),
            "tokens": self.tokens,
            "eval_loss": sum(losses) / len(losses) if losses else None,
            "eval_micro_batches": len(losses),
            "eval_s": round(max(0.0, elapsed_s - self.opened_s), 3),
            "paused": self.paused,
        }
