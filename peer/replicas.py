"""Replicas of a stage train as one model: the stage's optimizer step is collective.

Note "replica rounds"
---------------------
A stage step is a property of the stage, not of one replica. ``optimizer.accumulate`` is the number
of micro-batches in one stage step, whatever the number of replicas. With ``R`` online replicas
each one accumulates its share (``ceil(accumulate / R)``, :meth:`StageCompute.quota`) and then joins
a *round* (``StageAverager.combine``): a hivemind all-reduce over exactly the ``R`` replicas
(min group size = target group size = ``R``) of the gradient sums and micro-batch counts. The
result is the stage's mean gradient over every micro-batch of the round, and every member applies
the same optimizer step to the same state, so replicas hold the same weights and the same version
numbers. A replica that gets no traffic (nothing in flight, no gradient for a while: note "quiet") joins a round
that another replica waits for (its matchmaking declaration is in the DHT) with what it holds, maybe
nothing, so a step never waits for a replica without work; a share is otherwise never sent partial.

While a round runs, an async replica keeps serving: training forwards run on the step the replica
previews from its own share (note "speculative rounds" in peer/compute.py), and backwards accumulate
into a fresh buffer for the next round. In sync mode a replica's share is everything it got of the trainer's window (it is done
once nothing is in flight and no gradient came for a moment: the trainer sends the next window only
after this one completed everywhere), and forwards wait for the round (``forward_allowed``), so
every gradient of a step is computed on the same version, as in a synchronous pipeline.

Note "pre-scheduled rounds": hivemind's matchmaking (finding the group through the DHT) took most
of a round on loopback (0.3-0.9 s against an all-reduce of tens of ms). So as soon as a share begins
(its first gradient, or in async mode right after a round that combined work, when every partner
does the same) the replica *schedules* its next round (``StageAverager.schedule``: hivemind's ``step(require_trigger=
True, wait=False)``): the group forms while the share accumulates, and the all-reduce starts when the
share is complete (``finish``). A scheduled round that no longer fits (the version changed by a
download or a solo step, the replica count changed, or its group search ended without a group) is
dropped and scheduled again; only a round that failed after its gradients were handed over counts as
failed. A replica whose group is complete but whose traffic stopped (no gradient for a while)
fills in with what it holds.

Consistency (checked on every round, from what the members ``gather``):
- a member whose version is behind the group's newest (it missed a round, or joined while the
  others stepped) contributes its gradient but does not step: it downloads the state of a replica
  at the newest version (:meth:`StageCompute.adopt_state`, which keeps its stash and its pending
  gradients) -- it catches up by download, never by diverging;
- members at the same version compare weight digests; one that differs beyond rounding
  (``DIGEST_RTOL``) from the digest most of them agree with (on a tie, the lowest peer id's) downloads
  too (``diverged`` counts it): it does not step, so the state it downloads is the group's next one
  (a round without gradients steps nobody, so until the next round that steps, the diverged replica
  keeps its weights: two replicas that both stepped alone at the end of a run stay apart);
- a round whose average reached this replica only in part (hivemind keeps its own values where a
  member's span did not arrive: note "partial rounds" in peer/round_buffer.py) is not applied and its
  share is not given back (``partial_rounds``): the partners that completed it stepped with it, and
  this replica catches up from them in its next round.

When no full group forms within ``timeout_s`` the taken gradients go back into the accumulator and
the round is retried. After ``max_failed_rounds`` failures in a row (a replica died and its record
has not expired, or a partner stopped receiving micro-batches) the replica steps alone with what it
holds (``solo_steps``); the others see the newer version in their next round and download it.
A round that waits on a member that is gone (the announce tick counted fewer replicas than its group,
or the round is slow, and a count of the round's own confirms fewer) is given up then instead of at
hivemind's chunk timeout (note "lost member" in peer/recount.py); with one replica left the replica
then steps alone with what it holds.
With one online replica there are no rounds: the stage steps locally, as without replicas.

Note "patient fill-in": a replica that fills in makes its round combine fewer than ``accumulate``
micro-batches, and the stage takes more, smaller steps than one process would (4 x 2 async runs on
2 cores exported 161-176 stage steps for 150, most of the extra on the last stage, whose stash is
empty between micro-batches). The quiet threshold (note "quiet") is capped at half the round timeout
so that a partner's group search does not time out; but once this replica's scheduled round has its
group (every member declared, the partners wait for its gradients in the all-reduce, which allows
hivemind's ``next_chunk_timeout``, ``ALLREDUCE_MARGIN_S``), an async replica may wait up to
``PATIENT_QUIET_S`` for its share: the trainers keep sending, and the partners whose shares are
complete have closed their forward gates (``StageCompute.forward_allowed``), so the router's queue
weights send the next micro-batches to this replica. In sync mode nothing more comes once the window
is sent, so the cap stays.

Note "settled share": in sync mode the trainer's next window closes a replica's share; after the last
window nothing will, so a replica with nothing in flight that got no gradient for a while closes it
itself (``StageCompute.round_due``). That wait was the quiet threshold (1-2.5 s), shorter than a window
takes with 4 replicas per stage on 2 cores (~2.4 s): a replica whose micro-batch of the window came early
closed its share mid-window, its round stepped on part of the window, and the window's later
micro-batches were applied one version late (4 x 2 sync runs: applied staleness 0.15-0.19, 185 stage steps
for 150, held-out ratio 1.041). It is now at least ``SETTLE_S``: the end of a run waits a few seconds more.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from peer.averaging import ALLREDUCE_MARGIN_S, StageAverager
from peer.compute import StageCompute
from peer.recount import MEMBER_CHECK_S, member_check_due

__all__ = ["ReplicaRounds", "RoundsConfig", "round_outcome"]

logger = logging.getLogger(__name__)

PATIENT_QUIET_S = ALLREDUCE_MARGIN_S / 2  # note "patient fill-in": well inside the all-reduce's chunk wait
SETTLE_S = ALLREDUCE_MARGIN_S / 2  # note "settled share": a sync replica's idle wait before it closes a share
DIGEST_RTOL = 1e-4  # weight digests of replicas that differ by rounding only agree far closer than this


@dataclass(frozen=True, kw_only=True)
class RoundsConfig:
    """How a replica takes part in gradient rounds."""

    timeout_s: float = 5.0
    """Seconds a round waits for a full group before the gradients go back and it is retried."""
    idle_s: float = 1.0
    """A replica with less than its share joins a round another replica waits for once no gradient
    came for this long, or for 1.5 x the longest recent gap between its gradients when that is longer
    (note "quiet" in peer/compute.py; at most half the round timeout)."""
    max_failed_rounds: int = 3
    """Failed rounds in a row after which this replica steps alone (the others catch up by download)."""
    poll_s: float = 0.25
    """How often a replica without a share asks the DHT whether another replica waits for it."""
    min_timeout_s: float = 3.0
    """Once rounds have completed, a round waits ``4 x`` the recent round time, at least this and at
    most ``timeout_s``. The limit covers the all-reduce too (a round cut short mid-all-reduce leaves
    its partners with partial sums), so it must not be tight; a dead replica costs one such wait."""
    speculate: bool = True
    """Async replicas serve training forwards during a round on the weights of the step they preview
    from their own share (note "speculative rounds" in peer/compute.py); False: on the round's version.
    The preview costs one optimizer step and a copy of the optimizer state per round."""


@dataclass
class Outcome:
    """What one completed round means for this replica."""

    step: bool  # apply the combined gradient
    catch_up: bool  # download the state of a newer (or the reference) replica
    newest: int  # the newest version in the group
    diverged: bool = False


@dataclass
class _Scheduled:
    """A round scheduled ahead (hivemind's StepControl) for this version and group size."""

    control: Any
    version: int
    group: int


def _close(a: list[float], b: list[float]) -> bool:
    return all(math.isclose(x, y, rel_tol=DIGEST_RTOL, abs_tol=1e-6) for x, y in zip(a, b, strict=True))


def _reference_digest(members: list[dict[str, Any]]) -> list[float] | None:
    """The weights' digest most of ``members`` (same version, in peer-id order) agree with; on a tie the
    first's. A replica that stepped alone (its rounds failed, or it counted itself alone) must not make
    the group's other members throw their step away for its weights."""
    digests = [list(m["digest"]) for m in members if m.get("digest") is not None]
    if not digests:
        return None
    agree = [sum(_close(d, other) for other in digests) for d in digests]
    return digests[agree.index(max(agree))]


def round_outcome(me: str, version: int, gathered: dict[str, dict[str, Any]]) -> Outcome:
    """Decide from the members' ``{"version", "digest"}`` whether ``me`` steps or catches up (pure)."""
    versions = {pid: int(g.get("version", -1)) for pid, g in gathered.items()}
    newest = max(versions.values(), default=version)
    if version < newest:
        return Outcome(step=False, catch_up=True, newest=newest)
    reference = _reference_digest([gathered[pid] for pid in sorted(versions) if versions[pid] == version])
    mine = gathered.get(me, {}).get("digest")
    if reference is not None and mine is not None and not _close(list(reference), list(mine)):
        return Outcome(step=False, catch_up=True, newest=newest, diverged=True)
    return Outcome(step=True, catch_up=False, newest=newest)


class ReplicaRounds:
    """The thread that runs a replica's gradient rounds (see the module note).

    ``replicas_fn`` returns the number of online replicas of the stage, this one included (from the
    DHT records; called after a failed round). ``catch_up(version)`` downloads and adopts the state
    of a replica at ``version`` or newer; it returns whether it did.
    """

    COUNTERS = (
        "rounds",  # completed rounds this replica stepped with
        "rounds_failed",  # no full group in time (the gradients went back and were retried)
        "solo_steps",  # steps alone: after max_failed_rounds failed rounds, or when alone with waiting shares
        "caught_up",  # state downloads after a round showed this replica behind
        "diverged",  # rounds that found this replica's weights off its group's
        "partial_rounds",  # rounds whose average arrived in part: not applied (note "partial rounds")
        "micro_batches_combined",  # stage-wide micro-batches of the rounds this replica stepped with
        "round_ms",  # milliseconds spent in completed rounds (waiting for the group included)
        "group_late",  # completed rounds whose group was still forming when this share was complete
    )

    def __init__(
        self,
        compute: StageCompute,
        averager: StageAverager,
        *,
        peer_id: str,
        config: RoundsConfig,
        replicas_fn: Callable[[], int],
        catch_up: Callable[[int], bool],
    ):
        self.compute = compute
        compute.speculate = compute.speculate and config.speculate
        self.averager = averager
        self.peer_id = peer_id
        self.config = config
        self._replicas_fn = replicas_fn
        self._catch_up = catch_up
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self.failed_in_a_row = 0
        self.last_round_size = 0
        self.round_s_ema: float | None = None  # seconds a completed round took (EMA)
        self._last_poll = -math.inf
        self._member_checked = -math.inf  # the last count a slow round made (``_member_lost``)
        self._scheduled: _Scheduled | None = None  # the next round, looking for its group (or formed)
        self.error: Exception | None = None  # what the thread crashed with, if it did
        compute.on_round_due = self._wake.set
        self._thread = threading.Thread(target=self._run, name=f"replica-rounds-{compute.stage}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if self.compute.on_round_due == self._wake.set:
            self.compute.on_round_due = lambda: None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.wait(timeout=self.compute.policy.rounds_poll_s)
                self._wake.clear()
                if self._stop.is_set():
                    break
                self._tick()
        except Exception as e:  # a bug here must not leave a peer that silently never steps
            # the peer's task owner watches ``error``: it logs the traceback and stops the peer
            # (peer/loops.py); until then the stage steps alone
            self.error = e
            self.compute.replicas = 1
        finally:
            self._drop_scheduled()

    def _tick(self) -> None:
        """One look at the compute: run a due round, fill in for a waiting one, or schedule the next."""
        compute = self.compute
        if compute.replicas <= 1:
            self._drop_scheduled()
            return
        self._check_scheduled()
        quiet = self.quiet_s()
        if compute.round_due(self.settle_s(quiet)):
            self.run_round()
        elif self._scheduled is not None:
            # our group is complete and its other members wait for us, but our traffic stopped
            if self.averager.group_formed(self._scheduled.control) and compute.can_fill_in(
                self.quiet_s(formed=True)
            ):
                self.run_round()
        elif compute.uncombined() > 0:
            self._schedule()  # a share has begun: look for its group while it accumulates
        elif compute.can_fill_in(quiet) and self._poll_due() and self.averager.others_waiting():
            self.run_round()  # less than a share (maybe nothing), but the step needs every replica

    def _schedule(self) -> None:
        compute = self.compute
        group = max(2, compute.replicas)
        version = compute.version
        gather = {"version": version, "digest": compute.digest()}
        try:
            control = self.averager.schedule(group_size=group, gather=gather, timeout_s=self.timeout_s())
        except Exception as e:  # noqa: BLE001 -- the averager process is gone or busy: retried next tick
            logger.info("stage %d: could not schedule a gradient round: %s", compute.stage, e)
            return
        self._scheduled = _Scheduled(control, version, group)

    def _check_scheduled(self) -> None:
        """Drop a scheduled round that no longer fits: the version or the replica count changed (a
        download, a solo step) or its group search ended without a group."""
        scheduled = self._scheduled
        if scheduled is None:
            return
        if (
            scheduled.control.done()
            or scheduled.version != self.compute.version
            or scheduled.group != max(2, self.compute.replicas)
        ):
            self._drop_scheduled()

    def _drop_scheduled(self) -> None:
        if self._scheduled is not None:
            self.averager.cancel(self._scheduled.control)
            self._scheduled = None

    def _poll_due(self) -> bool:
        """Ask the DHT whether another replica waits at most every ``poll_s`` (each ask is a DHT get)."""
        now = time.monotonic()
        if now - self._last_poll < self.config.poll_s:
            return False
        self._last_poll = now
        return True

    def run_round(self) -> bool:
        """One round now (blocking; the scheduled one when it still fits); True when this replica
        stepped with the combined gradient."""
        compute = self.compute
        self._check_scheduled()
        if self._scheduled is None:
            self._schedule()
        scheduled, self._scheduled = self._scheduled, None
        sums, count, version = compute.take_round()
        if scheduled is None or scheduled.version != version:  # could not schedule, or a step raced us
            if scheduled is not None:
                self.averager.cancel(scheduled.control)
            return self._failed(sums, count, version)
        late = not self.averager.group_formed(scheduled.control)
        t0 = time.perf_counter()
        started, group = time.monotonic(), scheduled.group
        result = self.averager.finish(
            scheduled.control,
            sums,
            count,
            timeout_s=self.timeout_s() + ALLREDUCE_MARGIN_S,
            abort=lambda: self._member_lost(group, started),
        )
        if result is None:
            return self._failed(sums, count, version)
        flat, mean_count, gathered, missing = result
        if missing is not None and missing >= 1.0 - 1e-9:  # nothing of the group's arrived: a failed round
            logger.info(
                "stage %d: no member's part of the round at version %d arrived", compute.stage, version
            )
            return self._failed(sums, count, version)
        if missing:  # note "partial rounds" (peer/round_buffer.py)
            return self._partial(missing, count, version)
        took = time.perf_counter() - t0
        self.counters["round_ms"] += round(1000 * took)
        self.counters["group_late"] += late
        self.round_s_ema = took if self.round_s_ema is None else 0.8 * self.round_s_ema + 0.2 * took
        logger.debug(
            "round at v%d: %d of %.0f micro-batches, %.3f s", version, count, mean_count * len(gathered), took
        )
        self.failed_in_a_row = 0
        self.last_round_size = len(gathered)
        outcome = round_outcome(self.peer_id, version, gathered)
        mean = None
        if outcome.step and mean_count > 0 and bool(torch.isfinite(flat).all()):
            mean = self._unflatten(flat / mean_count)
        elif outcome.step and mean_count > 0:
            logger.warning("stage %d: a gradient round returned NaN or Inf; not applied", compute.stage)
        combined = round(mean_count * len(gathered))
        stepped = compute.end_round(mean, version, None, combined=combined)
        if stepped:
            self.counters["rounds"] += 1
            self.counters["micro_batches_combined"] += combined
        if outcome.diverged:
            self.counters["diverged"] += 1
            logger.warning(
                "stage %d: this replica's weights differ from its group's at version %d; downloading them",
                compute.stage,
                version,
            )
        if outcome.catch_up and self._catch_up(outcome.newest):
            self.counters["caught_up"] += 1
        # The next share is on its way (async replicas keep serving), and the partners finished this
        # round at the same moment: looking for the next group now lets every member's matchmaking
        # overlap the share, instead of starting with its first gradient (a replica whose share was
        # complete first waited for the others' matchmaking, 0.3-1 s a round under load). Not after
        # an empty round (traffic stopped), nor in sync mode, where the next window may never come.
        busy = mean_count > 0 and compute.policy.rounds_overlap
        if compute.replicas > 1 and (busy or compute.uncombined() > 0) and not self._stop.is_set():
            self._schedule()
        return stepped

    def _member_lost(self, group: int, started: float) -> str | None:
        """Why a waiting round of ``group`` replicas should be given up (note "lost member" in
        peer/recount.py): a count of its own finds fewer replicas than its group. It counts when the
        announce tick already counted fewer, or when the round is slow; at most every ``MEMBER_CHECK_S``
        (a count under load can miss a live replica whose INFO times out: one low count alone never
        gives a healthy round up)."""
        now = time.monotonic()
        since = now - self._member_checked
        suspect = self.compute.replicas < group
        if since < MEMBER_CHECK_S or not (
            suspect or member_check_due(now - started, since, self.round_s_ema)
        ):
            return None
        self._member_checked = now
        try:
            live = max(1, int(self._replicas_fn()))
        except Exception:  # noqa: BLE001 -- a DHT or network hiccup: keep waiting for the round
            return None
        if live >= group:
            return None
        return f"{live} live replica(s) of stage {self.compute.stage}, the round's group has {group}"

    def quiet_s(self, *, formed: bool = False) -> float:
        """No gradient for this long means our traffic stopped (note "quiet" in peer/compute.py): at
        least ``idle_s``, and well inside the round timeout a waiting partner gives us; up to
        ``PATIENT_QUIET_S`` when our round's group is ``formed`` and the mode keeps traffic coming
        (note "patient fill-in")."""
        cap = max(self.config.idle_s, self.timeout_s() / 2)
        if formed and self.compute.policy.patient_fill_in:
            # without a gap seen yet (the run's first micro-batches, a fresh joiner) the replica has
            # no idea of its traffic's pace: the whole patient wait
            cap = max(cap, PATIENT_QUIET_S)
            return self.compute.quiet_after(self.config.idle_s, cap, unseen_s=cap)
        return self.compute.quiet_after(self.config.idle_s, cap)

    def settle_s(self, quiet_s: float) -> float:
        """Sync mode: a replica idle this long closes its share by itself (note "settled share"). Only the
        trainer's next window closes a share during training; this is for the end of the run, so it must
        be longer than a window can take on a slow machine."""
        return max(quiet_s, SETTLE_S)

    def timeout_s(self) -> float:
        """How long the next round waits for a full group (see ``RoundsConfig.min_timeout_s``)."""
        cfg = self.config
        if self.round_s_ema is None:
            return cfg.timeout_s
        return min(cfg.timeout_s, max(cfg.min_timeout_s, 4.0 * self.round_s_ema))

    def _partial(self, missing: float, count: int, version: int) -> bool:
        """A round whose average reached this replica only in part: it is not applied, and the share is
        not given back either (the partners that completed the round stepped with it; adding it again
        would count it twice). This replica catches up from them by download in its next round; when
        none completed it, the round's micro-batches are lost, and the warning says so. (A round of which
        *nothing* arrived is a failed round and its share goes back: then this replica's own span had no
        partner's part either, so every partner saw that span in part and none stepped.)"""
        compute = self.compute
        self.counters["partial_rounds"] += 1
        self.failed_in_a_row = 0
        logger.warning(
            "stage %d: the gradient round at version %d arrived in part (%.1f%% of the buffer kept this "
            "replica's own values); not applied: this replica catches up from a partner that completed "
            "it, or, if none did, the round's micro-batches (%d of them from this replica) are lost",
            compute.stage,
            version,
            100.0 * missing,
            count,
        )
        compute.end_round(None, version, None)
        if compute.replicas > 1 and not self._stop.is_set():
            self._schedule()
        return False

    def _failed(self, sums: list[torch.Tensor], count: int, version: int) -> bool:
        compute = self.compute
        self.counters["rounds_failed"] += 1
        self.failed_in_a_row += 1
        compute.end_round(None, version, (sums, count))
        try:
            live = max(1, int(self._replicas_fn()))  # replicas whose records are online and who answer
        except Exception as e:  # noqa: BLE001 -- a DHT or network hiccup: keep the count we have
            logger.info("could not refresh the replica count of stage %d: %s", compute.stage, e)
            live = compute.replicas
        if live != compute.replicas:
            logger.info("stage %d: %d live replica(s) now (was %d)", compute.stage, live, compute.replicas)
        if compute.set_replicas(live):  # alone now: steps locally at once with what it holds
            self.counters["solo_steps"] += 1
            logger.info("stage %d: alone now; stepped with the shares that waited for a round", compute.stage)
        if live <= 1:
            self.failed_in_a_row = 0
        elif self.failed_in_a_row >= self.config.max_failed_rounds:
            if compute.flush_step():
                self.counters["solo_steps"] += 1
                logger.info(
                    "stage %d: %d gradient rounds failed in a row; stepped alone (others catch up by download)",
                    compute.stage,
                    self.failed_in_a_row,
                )
            self.failed_in_a_row = 0
        return False

    def _unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        opt = self.compute.optimizer
        shapes = [opt.params[n].shape for n in opt.names]
        sizes = [s.numel() for s in shapes]
        return [p.reshape(s) for p, s in zip(flat.split(sizes), shapes, strict=True)]
