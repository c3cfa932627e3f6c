"""The trainer's side of ``optimizer.mode``: how many micro-batches go out and when a trainer step is full.

Steps (note "trainer step")
---------------------------
A stage steps once every ``optimizer.accumulate`` micro-batches *of the stage*, whatever its number
of replicas (peer/replicas.py: replicas combine their gradients in a round and step as one); a
trainer *step* is the same amount of work seen from here: ``accumulate`` completed training
micro-batches, so trainer steps, stage versions and exported step counts agree.
``mode: async`` keeps up to ``max_inflight`` micro-batches in the swarm; ``mode: sync`` sends
exactly ``accumulate`` micro-batches, waits until every one of them is completed or dropped, and
only then sends the next ``accumulate`` (so peers step in lock-step).

One policy object is chosen per session (:func:`make_policy`); the loop (swarm/train/loop.py) asks it
and never branches on the mode itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from swarm.train.pacing import InflightPacer

if TYPE_CHECKING:
    from swarm.run.spec import RunSpec
    from swarm.train.config import TrainerConfig
    from swarm.train.steps import StepBook

__all__ = ["SyncPolicy", "AsyncPolicy", "Policy", "make_policy", "inflight_rule_of_thumb"]


def inflight_rule_of_thumb(stages: int, peers: int) -> int:
    """Micro-batches to keep in flight for ``stages`` stages served by ``peers`` peers in all."""
    return max(2 * stages, peers)


class SyncPolicy:
    """``mode: sync``: windows of ``accumulate`` micro-batches; the next opens when the last resolved."""

    lockstep = True  # peers step together: routing's staleness caps need one window only

    def __init__(self, *, accumulate: int, max_inflight: int, target_steps: int):
        self.accumulate = accumulate
        self.max_inflight = max_inflight
        self.target_steps = target_steps
        self.window_left = 0  # micro-batches of the current window still to open
        self.window_open = 0  # micro-batches of the current window opened and not yet resolved

    def inflight_target(self) -> int:
        return self.max_inflight

    def quota(self, book: StepBook, outstanding: int) -> int:
        """How many new training micro-batches may be opened now (a window opens when none is open)."""
        if self.window_open == 0 and self.window_left == 0 and book.step < self.target_steps:
            self.window_left = self.accumulate
        return self.window_left

    def opened(self, book: StepBook) -> dict[str, Any]:
        """One more of the window was opened: what its FORWARD carries besides the tokens."""
        self.window_left -= 1
        self.window_open += 1
        return {"window": book.step}  # the window being filled (peers close a replica's share on a newer one)

    def resolved(self) -> None:
        """A training micro-batch completed or was dropped."""
        self.window_open -= 1

    def step_full(self, book: StepBook) -> bool:
        """Whether the step in progress is complete: every micro-batch of its window resolved."""
        return self.window_open == 0 and self.window_left == 0 and book.cur.resolved > 0

    def done(self, book: StepBook) -> bool:
        return book.step >= self.target_steps  # dropped micro-batches are not replaced: count windows

    def track(self, now: float, inflight: int) -> None:
        """Nothing to pace: a window is always sent whole."""

    def observe(self, now: float, round_trip_s: float, inflight: int) -> dict[str, Any] | None:
        return None

    def step_fields(self) -> dict[str, Any]:
        return {}

    def summary(self) -> dict[str, Any]:
        return {"mode": "sync windows", "max": self.max_inflight}


class AsyncPolicy:
    """``mode: async``: keep the pacer's target in flight (or ``max_inflight``, without pacing: note
    "pacing" in swarm/train/pacing.py); a step is ``accumulate`` completed micro-batches."""

    lockstep = False

    def __init__(self, *, accumulate: int, max_inflight: int, target_steps: int, pacer: InflightPacer | None):
        self.accumulate = accumulate
        self.max_inflight = max_inflight
        self.target_mbs = target_steps * accumulate
        self.pacer = pacer

    def inflight_target(self) -> int:
        return self.max_inflight if self.pacer is None else self.pacer.target

    def quota(self, book: StepBook, outstanding: int) -> int:
        return max(0, self.target_mbs - book.completed_train - outstanding)

    def opened(self, book: StepBook) -> dict[str, Any]:
        return {}

    def resolved(self) -> None:
        """Drops are replaced (see ``quota``) and completions counted by the book: nothing to do."""

    def step_full(self, book: StepBook) -> bool:
        return book.cur.completed >= self.accumulate

    def done(self, book: StepBook) -> bool:
        # dropped micro-batches are replaced: count completions
        return book.completed_train >= self.target_mbs

    def track(self, now: float, inflight: int) -> None:
        if self.pacer is not None:
            self.pacer.track(now, inflight)

    def observe(self, now: float, round_trip_s: float, inflight: int) -> dict[str, Any] | None:
        """A training round trip: the fields of an ``inflight`` event when the pacer's target changed."""
        if self.pacer is None:
            return None
        self.pacer.track(now, inflight)
        if not self.pacer.observe(now, round_trip_s):
            return None
        return {
            "target": self.pacer.target,
            "queued": round(self.pacer.queued or 0.0, 3),
            "base_s": round(self.pacer.base_s, 4),
        }

    def step_fields(self) -> dict[str, Any]:
        return {"inflight_target": self.inflight_target()}  # note "pacing"

    def summary(self) -> dict[str, Any]:
        if self.pacer is None:
            return {"mode": "fixed", "max": self.max_inflight}
        return {
            "mode": "paced",
            "max": self.max_inflight,
            "floor": self.pacer.floor,
            "final": self.pacer.target,
            "changes": self.pacer.changes,
        }


Policy = SyncPolicy | AsyncPolicy


def make_policy(spec: RunSpec, config: TrainerConfig, target_steps: int) -> Policy:
    """The policy of the spec's ``optimizer.mode``."""
    accumulate = spec.optimizer.accumulate
    if spec.optimizer.mode == "sync":
        return SyncPolicy(accumulate=accumulate, max_inflight=config.max_inflight, target_steps=target_steps)
    pacer = InflightPacer(floor=spec.num_stages, ceiling=config.max_inflight) if config.pacing else None
    return AsyncPolicy(
        accumulate=accumulate, max_inflight=config.max_inflight, target_steps=target_steps, pacer=pacer
    )
