"""The peer side of ``optimizer.mode``: ``SyncPolicy`` or ``AsyncPolicy``, chosen once per stage.

Every place where a stage peer behaves differently in sync and async mode asks this object
(``StageCompute.policy``), so the difference is one class each, not a branch per call site:

- async: forwards run whenever the queue has room; a replica's share is complete after ``quota``
  gradients, right after a round the next one is looked for at once (the next share is coming), and
  forwards during a round run on the step it previews (note "speculative rounds" in peer/compute.py);
- sync: a step window admits ``accumulate`` training forwards (a lone replica) and steps only once
  none of them is in flight; forwards wait while a round combines the window; a replica's share
  closes when the trainer's next window begins or, after the last window, when the stage is idle
  (note "replica rounds" in peer/replicas.py). The window's forward count lives here.

The policies hold no lock: ``StageCompute`` calls them under its own lock, except
``forward_allowed``, which reads one int without one (see ``StageCompute.forward_allowed``).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["AsyncPolicy", "StepPolicy", "SyncPolicy", "policy_for"]


class StepPolicy(Protocol):
    """What differs between the modes; the docstrings are on ``AsyncPolicy``'s methods."""

    name: str
    rounds_poll_s: float
    rounds_overlap: bool
    speculates: bool
    patient_fill_in: bool

    def forward_started(self) -> None: ...
    def release_slot(self) -> bool: ...
    def forward_allowed(self, *, round_active: bool, replicas: int) -> bool: ...
    def share_complete(self, pending: int, quota: int) -> bool: ...
    def may_step(self, in_flight: int) -> bool: ...
    def reset_window(self) -> bool: ...
    def settles_share(self) -> bool: ...
    def new_window(self, trainer: str, window: int) -> bool: ...


class AsyncPolicy:
    """``optimizer.mode: async``: nothing waits for a window."""

    name = "async"
    rounds_poll_s = 0.2  # how long the replica rounds' thread sleeps between looks at the compute
    rounds_overlap = True  # after a round that combined work, schedule the next one at once
    speculates = (
        True  # serve training forwards during a round on its previewed step (note "speculative rounds")
    )
    # a replica without traffic whose round's group is complete waits longer before it fills in with
    # less than its share (note "patient fill-in" in peer/replicas.py): the trainers keep sending, and
    # its partners' closed forward gates send the next micro-batches its way
    patient_fill_in = True

    def forward_started(self) -> None:
        """A training forward began."""

    def release_slot(self) -> bool:
        """A training forward will never complete; True when that may complete a step (look again)."""
        return False

    def forward_allowed(self, *, round_active: bool, replicas: int) -> bool:
        """The forward gate, once no complete share waits for a round."""
        return True

    def share_complete(self, pending: int, quota: int) -> bool:
        """A replica's gradients make a complete share as they come in."""
        return pending >= quota

    def may_step(self, in_flight: int) -> bool:
        """A lone replica with ``accumulate`` gradients steps now (``in_flight``: stash entries)."""
        return True

    def reset_window(self) -> bool:
        """A step happened: a new window begins. True when the forward gate may have opened."""
        return False

    def settles_share(self) -> bool:
        """An idle replica's partial share closes by itself (no next window will close it)."""
        return False

    def new_window(self, trainer: str, window: int) -> bool:
        """A training forward of ``trainer``'s ``window`` came; True when that window is new."""
        return False


class SyncPolicy:
    """``optimizer.mode: sync``: every gradient of a step is computed on the same version."""

    name = "sync"
    rounds_poll_s = 0.05
    rounds_overlap = False  # the next window may never come
    speculates = False  # forwards wait for the round anyway
    patient_fill_in = False  # once the window is sent, nothing more comes: fill in at once

    def __init__(self, accumulate: int):
        self.accumulate = accumulate
        self.window_forwards = 0  # training forwards started in the current step window
        self._windows: dict[str, int] = {}  # the newest window seen per trainer

    def forward_started(self) -> None:
        self.window_forwards += 1

    def release_slot(self) -> bool:
        if self.window_forwards > 0:
            self.window_forwards -= 1
        return True

    def forward_allowed(self, *, round_active: bool, replicas: int) -> bool:
        if round_active:
            return False
        if replicas > 1:
            return True  # a sync window is whatever the trainer sends; it closes when this replica is done
        return self.window_forwards < self.accumulate

    def share_complete(self, pending: int, quota: int) -> bool:
        return False  # a share is the whole window: the next window (or idleness) closes it

    def may_step(self, in_flight: int) -> bool:
        return in_flight == 0

    def reset_window(self) -> bool:
        self.window_forwards = 0
        return True

    def settles_share(self) -> bool:
        return True

    def new_window(self, trainer: str, window: int) -> bool:
        if window <= self._windows.get(trainer, -1):
            return False
        self._windows[trainer] = window
        return True


def policy_for(mode: str, accumulate: int) -> StepPolicy:
    """The policy of a spec's ``optimizer.mode`` (validated by the spec: ``async`` or ``sync``)."""
    return SyncPolicy(accumulate) if mode == "sync" else AsyncPolicy()
