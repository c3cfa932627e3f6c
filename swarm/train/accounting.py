"""The micro-batch ledger: every micro-batch a trainer creates ends ``completed`` or ``dropped``.

Why a separate module: "nothing disappears silently" is a promise the trainer's summary makes, and
it is only as good as the bookkeeping behind it. The ledger is pure (no clock, no network): the
trainer tells it what happened and asks what to do next, and tests drive it with hand-made reports.

Vocabulary
----------
- A *micro-batch* (``MicroBatch``, numbered by ``index``) is a piece of data the trainer wants
  applied (``train``) or evaluated (``eval``, ``generate``).
- An *attempt* (``Attempt``) is one trip of a micro-batch along one route, named by a fresh
  ``mb_id``. When a route breaks (a ``failed`` report, a refusal, a deadline passing) the attempt is
  closed and the micro-batch is either retried with a new attempt or, after ``max_attempts``,
  dropped with the reason and stage of its last failure.
- A report that names a closed attempt (e.g. the ``done`` of an attempt whose deadline already
  passed and was re-sent) is *late*: it is ignored and counted. A report naming no attempt this
  ledger ever made is *unknown*: ignored and counted.

Life of a micro-batch: ``pending`` (waiting for a route) -> ``inflight`` -> ``completed`` |
back to ``pending`` (retry) | ``dropped``. The invariant
``opened == completed + dropped + inflight + pending`` holds after every call (:meth:`Ledger.check`).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

__all__ = ["Attempt", "MicroBatch", "ReportLike", "ReportOutcome", "Ledger"]

Kind = Literal["train", "eval", "generate"]
MBState = Literal["pending", "inflight", "completed", "dropped"]
AttemptState = Literal["inflight", "completed", "failed"]


class ReportLike(Protocol):
    """The fields of ``swarm.wire.protocol.Report`` the ledger reads."""

    mb_id: str
    kind: str
    stage: int
    peer: str
    loss: float | None
    n_tokens: int
    reason: str
    stats: dict[str, float]


@dataclass
class Attempt:
    """One trip of a micro-batch along ``route``."""

    mb_id: str
    index: int
    route: tuple[str, ...]
    started: float
    deadline: float
    state: AttemptState = "inflight"
    acked: bool = False  # the stage-0 peer acknowledged (validated and queued) the micro-batch
    loss: float | None = None
    got_loss: bool = False
    stats: dict[str, float] = field(default_factory=dict)
    payload: bytes = b""  # result payload (eval/generate), e.g. encoded logits


@dataclass
class MicroBatch:
    """A unit of work and its fate; ``data`` is whatever the trainer needs to re-send it."""

    index: int
    kind: Kind
    n_tokens: int
    data: Any = None
    state: MBState = "pending"
    attempts: list[str] = field(default_factory=list)
    failures: list[tuple[str, int | None, str | None]] = field(default_factory=list)  # (reason, stage, peer)
    drop_reason: str = ""
    drop_stage: int | None = None
    loss: float | None = None
    completed_by: Attempt | None = None


@dataclass(frozen=True)
class ReportOutcome:
    """What a report meant. ``event`` is one of:

    ``loss`` (train: the last stage's loss arrived, gradients still on their way back),
    ``completed`` (the micro-batch is done; a ``done`` that carries the loss, note "one report" in
    swarm/wire/protocol.py, completes it with its loss), ``failed`` (the attempt broke; call :meth:`Ledger.fail`),
    ``late`` (names a closed attempt), ``unknown`` (names no attempt of this ledger),
    ``ignored`` (a report kind that does not fit the attempt's mode; counted as odd).
    """

    event: str
    attempt: Attempt | None = None
    micro_batch: MicroBatch | None = None


class Ledger:
    """Bookkeeping of micro-batches and their attempts for one trainer (see the module docstring)."""

    def __init__(self, *, tag: str, max_attempts: int):
        if max_attempts < 1:
            raise ValueError(f"max_attempts = {max_attempts} must be >= 1")
        self.tag = tag
        self.max_attempts = max_attempts
        self.micro_batches: dict[int, MicroBatch] = {}
        self.attempts: dict[str, Attempt] = {}
        self._inflight: dict[str, Attempt] = {}
        self._pending: dict[int, MicroBatch] = {}
        self._next_index = itertools.count()
        self.late_reports = 0
        self.unknown_reports = 0
        self.odd_reports = 0

    # ---- creating work -------------------------------------------------------------------------

    def open(self, kind: Kind, n_tokens: int, data: Any = None) -> MicroBatch:
        """Register a new micro-batch; it waits (``pending``) until :meth:`start_attempt`."""
        mb = MicroBatch(index=next(self._next_index), kind=kind, n_tokens=n_tokens, data=data)
        self.micro_batches[mb.index] = mb
        self._pending[mb.index] = mb
        return mb

    def start_attempt(self, index: int, route: tuple[str, ...], *, now: float, timeout_s: float) -> Attempt:
        """Send micro-batch ``index`` on ``route``: a new attempt with a fresh ``mb_id``."""
        mb = self._pending.pop(index)
        mb_id = f"{self.tag}-{mb.index}-{len(mb.attempts)}"
        attempt = Attempt(mb_id=mb_id, index=mb.index, route=route, started=now, deadline=now + timeout_s)
        mb.attempts.append(mb_id)
        mb.state = "inflight"
        self.attempts[mb_id] = attempt
        self._inflight[mb_id] = attempt
        return attempt

    # ---- outcomes ------------------------------------------------------------------------------

    def on_report(self, report: ReportLike) -> ReportOutcome:
        """Apply one peer report (``loss``, ``done``, ``result`` or ``failed``)."""
        attempt = self.attempts.get(report.mb_id)
        if attempt is None:
            self.unknown_reports += 1
            return ReportOutcome("unknown")
        mb = self.micro_batches[attempt.index]
        if report.kind == "loss" and attempt.state == "completed" and not attempt.got_loss:
            # the loss travelled on another connection than `done` and arrived after it: still valid
            self._take_loss(attempt, mb, report)
            return ReportOutcome("loss", attempt, mb)
        if attempt.state != "inflight":
            self.late_reports += 1
            return ReportOutcome("late", attempt, mb)
        if report.kind == "failed":
            return ReportOutcome("failed", attempt, mb)
        if report.kind == "loss" and mb.kind == "train":
            self._take_loss(attempt, mb, report)
            return ReportOutcome("loss", attempt, mb)
        if (report.kind == "done" and mb.kind == "train") or (report.kind == "result" and mb.kind != "train"):
            if report.loss is not None:  # a result's, or a ``done`` carrying the loss (one report)
                self._take_loss(attempt, mb, report)
            else:
                attempt.stats.update(report.stats)
            self._complete(attempt, mb)
            return ReportOutcome("completed", attempt, mb)
        self.odd_reports += 1
        return ReportOutcome("ignored", attempt, mb)

    def _take_loss(self, attempt: Attempt, mb: MicroBatch, report: ReportLike) -> None:
        attempt.got_loss = True
        attempt.loss = report.loss
        attempt.stats.update(report.stats)
        if attempt.state == "completed":
            mb.loss = report.loss

    def _complete(self, attempt: Attempt, mb: MicroBatch) -> None:
        attempt.state = "completed"
        del self._inflight[attempt.mb_id]
        mb.state = "completed"
        mb.loss = attempt.loss
        mb.completed_by = attempt

    def fail(self, mb_id: str, *, reason: str, stage: int | None = None, peer: str | None = None) -> str:
        """Close attempt ``mb_id`` as failed. Returns ``"retry"`` (the micro-batch is pending again),
        ``"dropped"`` (it used its ``max_attempts``) or ``"stale"`` (the attempt was already closed)."""
        attempt = self._inflight.pop(mb_id, None)
        if attempt is None:
            return "stale"
        attempt.state = "failed"
        mb = self.micro_batches[attempt.index]
        mb.failures.append((reason, stage, peer))
        if len(mb.attempts) >= self.max_attempts:
            self._drop(mb, reason=reason, stage=stage)
            return "dropped"
        mb.state = "pending"
        self._pending[mb.index] = mb
        return "retry"

    def _drop(self, mb: MicroBatch, *, reason: str, stage: int | None) -> None:
        mb.state = "dropped"
        mb.drop_reason = reason
        mb.drop_stage = stage

    def drop_pending(self, index: int, *, reason: str, stage: int | None = None) -> None:
        """Give up on a micro-batch that is waiting for a route (e.g. its stage stayed empty)."""
        self._drop(self._pending.pop(index), reason=reason, stage=stage)

    def close_all(self, *, reason: str = "shutdown") -> int:
        """Drop everything still pending or in flight (end of the run); returns how many."""
        n = 0
        for attempt in list(self._inflight.values()):
            self._inflight.pop(attempt.mb_id)
            attempt.state = "failed"
            self._drop(self.micro_batches[attempt.index], reason=reason, stage=None)
            n += 1
        for index in list(self._pending):
            self.drop_pending(index, reason=reason)
            n += 1
        return n

    # ---- queries -------------------------------------------------------------------------------

    def expired(self, now: float) -> list[Attempt]:
        """In-flight attempts whose deadline has passed."""
        return [a for a in self._inflight.values() if a.deadline <= now]

    def inflight_attempts(self) -> list[Attempt]:
        """Attempts in flight right now (a copy: callers may close them while iterating)."""
        return list(self._inflight.values())

    def inflight(self, kind: Kind | None = None) -> int:
        return sum(
            1 for a in self._inflight.values() if kind is None or self.micro_batches[a.index].kind == kind
        )

    def pending(self) -> Iterator[MicroBatch]:
        """Micro-batches waiting for a route, oldest first (retries go before new work)."""
        return iter(sorted(self._pending.values(), key=lambda mb: mb.index))

    def n_pending(self) -> int:
        return len(self._pending)

    def totals(self, kind: Kind | None = None) -> dict[str, Any]:
        """Counts for the summary; ``kind`` restricts them to one kind of micro-batch."""
        mbs = [mb for mb in self.micro_batches.values() if kind is None or mb.kind == kind]
        states = Counter(mb.state for mb in mbs)
        dropped = [mb for mb in mbs if mb.state == "dropped"]
        n_attempts = sum(len(mb.attempts) for mb in mbs)
        return {
            "opened": len(mbs),
            "completed": states["completed"],
            "dropped": states["dropped"],
            "inflight": states["inflight"],
            "pending": states["pending"],
            "attempts": n_attempts,
            "retries": sum(max(0, len(mb.attempts) - 1) for mb in mbs),
            "failed_attempts": sum(len(mb.failures) for mb in mbs),
            "dropped_by_reason": dict(Counter(mb.drop_reason for mb in dropped)),
            "dropped_by_stage": {
                str(k): v
                for k, v in Counter("?" if mb.drop_stage is None else mb.drop_stage for mb in dropped).items()
            },
            "failures_by_reason": dict(Counter(f[0] for mb in mbs for f in mb.failures)),
            "late_reports": self.late_reports,
            "unknown_reports": self.unknown_reports,
            "odd_reports": self.odd_reports,
        }

    def check(self) -> None:
        """Assert the bookkeeping invariant (our own code's bug if it fails, never user input)."""
        t = self.totals()
        assert t["opened"] == t["completed"] + t["dropped"] + t["inflight"] + t["pending"], t
        assert t["inflight"] == len(self._inflight) and t["pending"] == len(self._pending), t
