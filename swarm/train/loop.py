"""One training session's loop: fill routes, wait for events, react, close steps; then drain and evaluate.

Each turn of :meth:`TrainLoop._pump` reacts to the events that arrived (swarm/train/events.py: reports,
acknowledgements, failed sends, probe answers, refreshed records), closing a trainer step or an
evaluation round as soon as a reaction completes one; then it fails the attempts past their deadline,
starts the probes that are due, sends the CANCELs closed attempts left, opens and sends micro-batches
while the policy (swarm/train/policy.py) allows, and sleeps until the next event or deadline. Nothing
else changes the session's state: callbacks and tasks only post events.

Counted stages (note "counted stages")
--------------------------------------
A backward that fails at stage i (its weight version was evicted, a send failed) has already added
the micro-batch's gradient at every later stage: they ran their backward first. The ``failed`` report
says so (``counted_from = i + 1``), and the retry's forward header carries ``counted_from``: those
stages run the retry's forward and backward as usual (stage i needs the gradient) but add nothing to
their optimizers, so a retry never counts one micro-batch twice and stage step counts stay equal.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.client.routing import NoPeersError, Router
from swarm.errors import Failure, PeerFailure, RequestError
from swarm.train.accounting import Attempt, Ledger, MicroBatch
from swarm.train.background import Publisher, refresh_loop
from swarm.train.events import Acked, Inbox, Probed, Refreshed, Reported, SendFailed, Tasks
from swarm.train.failures import Failures
from swarm.train.output import Console, Records, write_summary
from swarm.train.policy import make_policy
from swarm.train.probing import Prober
from swarm.train.resume import target_steps
from swarm.train.routes import Routes, service_seconds
from swarm.train.steps import Evaluation, StepBook

if TYPE_CHECKING:
    from swarm.client.link import SwarmLink
    from swarm.client.liveness import HoldCheck
    from swarm.train.config import TrainerConfig
    from swarm.train.data import TokenData
    from swarm.train.metrics import ProgressSnapshot
    from swarm.train.resume import ResumeState
    from swarm.wire.protocol import Report

__all__ = ["TrainLoop"]


class TrainLoop:
    """One session of ``Trainer.run_on`` over an open link; :meth:`run` returns its summary (also kept
    in ``summary`` when it ends with an error)."""

    def __init__(
        self,
        config: TrainerConfig,
        link: SwarmLink,
        data: TokenData,
        *,
        trainer_id: str,
        resumed: ResumeState | None,
        clock: Callable[[], float],
        console: Console,
    ) -> None:
        spec = link.spec
        self.config, self.link, self.spec, self.data = config, link, spec, data
        self.trainer_id, self.resumed, self.clock, self.console = trainer_id, resumed, clock, console
        self.target_steps = target_steps(config, spec, resumed)
        self.target_mbs = self.target_steps * spec.optimizer.accumulate
        self.seed = config.seed if resumed is None else resumed.seed
        self.policy = make_policy(spec, config, self.target_steps)
        self.ledger = Ledger(tag=f"{trainer_id}.{secrets.token_hex(3)}", max_attempts=config.max_attempts)
        self.router = Router(config.routing, clock=clock, rng=random.Random(self.seed))
        self.book = StepBook(accumulate=spec.optimizer.accumulate, resumed=resumed)
        started = clock() - (resumed.time_s if resumed is not None else 0.0)  # times continue (note "resume")
        self.records = Records(config, spec, clock=clock, started=started)
        event = self.records.event
        self.routes = Routes(config, spec, lockstep=self.policy.lockstep, say=console.say, event=event)
        checks: dict[str, HoldCheck] = {}
        self.failures = Failures(
            ledger=self.ledger,
            router=self.router,
            routes=self.routes,
            checks=checks,
            event=event,
            clock=clock,
            on_drop=self._dropped,
        )
        self.prober = Prober(
            config.liveness, ledger=self.ledger, failures=self.failures, checks=checks, link=link, clock=clock
        )
        self.evaluation = Evaluation(
            every=config.eval_every,
            batches=config.eval_batches,
            micro_batch_size=spec.micro_batch_size,
            target_steps=self.target_steps,
        )
        self.inbox = Inbox()
        self.tasks = Tasks(self.inbox.wake)
        self.publisher = Publisher(
            link, trainer_id=trainer_id, book=self.book, clock=clock, say=console.say, event=event
        )
        self.stream = data.stream(spec.micro_batch_size, seed=self.seed)
        self.data_position = 0  # micro-batches drawn from the stream (note "resume")
        for _ in range(resumed.data_position if resumed is not None else 0):  # where it stopped
            next(self.stream)
            self.data_position += 1
        # wire-byte estimate for deadlines: fp32 activation + gradient per token on each link
        self.wire_bytes = 2 * (spec.num_stages - 1) * spec.tokens_per_micro_batch * spec.model.d_model * 4
        self.summary: dict[str, Any] | None = None
        link.on_report = self._on_report
        link.on_heard = self.prober.heard

    # ---- the session ----------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        """Train to the target, drain, evaluate; everything is shut down in ``finally``."""
        self._announce()
        cfg, ledger = self.config, self.ledger
        interrupted = True
        try:
            self.routes.update(await self.link.stage_records())
            every = cfg.refresh_every_s
            self.tasks.spawn(refresh_loop(self.link, self.inbox, every_s=every, event=self.records.event))
            self.tasks.spawn(self.publisher.loop(cfg.publish_every_s))
            await self._pump(lambda: self.policy.done(self.book) and self.evaluation.round is None, show=True)
            deadline = self.clock() + cfg.drain_timeout_s  # extra work opened near the end
            await self._pump(
                lambda: not (ledger.inflight() or ledger.n_pending()) or self.clock() >= deadline, show=True
            )
            if cfg.eval_every:
                self._open_eval()
                await self._pump(lambda: self.evaluation.round is None, show=False)
            interrupted = False
        finally:
            await self._shut_down(interrupted)
        assert self.summary is not None
        return self.summary

    def _announce(self) -> None:
        cfg, resumed = self.config, self.resumed
        self.records.event(
            "start",
            run_id=self.spec.run_id,
            spec_hash=self.spec.spec_hash,
            trainer=self.trainer_id,
            target_steps=self.target_steps,
            mode=self.spec.optimizer.mode,
            seed=self.seed,
            data_source=cfg.data.source,
            **({} if resumed is None else {"resumed_step": resumed.step, "resumed_tokens": resumed.tokens}),
        )
        if resumed is not None:
            self.console.say(
                f"resuming at step {resumed.step}/{self.target_steps} ({resumed.tokens} tokens, data position "
                f"{resumed.data_position}); appending to {Path(cfg.out_dir, 'metrics.jsonl')}"
            )

    async def _shut_down(self, interrupted: bool) -> None:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(self.failures.cancel_inflight(self.link), timeout=3.0)
        left = self.ledger.close_all(reason="shutdown" if not interrupted else "interrupted")
        if left:
            self.console.say(f"{left} micro-batches still in flight or waiting were dropped at shutdown")
        await self.tasks.close()
        self.ledger.check()
        with contextlib.suppress(PeerFailure):
            await self.publisher.publish()
        self.console.close(self._snapshot())
        book = self.book
        self.summary = write_summary(
            self.config,
            self.spec,
            trainer_id=self.trainer_id,
            book=book,
            ledger=self.ledger,
            policy=self.policy,
            wall_s=self.clock() - (book.first_send or self.records.started),
            out=self.console.out,
        )
        self.records.close()

    # ---- the loop -------------------------------------------------------------------------------

    async def _pump(self, finished: Callable[[], bool], *, show: bool) -> None:
        """Turn until ``finished()``; new training micro-batches open only until the policy is done."""
        while True:
            now = self.clock()
            self._react()
            self.failures.expire(now)
            self._settle()
            if finished():
                return
            self._raise_errors()
            if self.prober.enabled and now >= self.prober.next_tick:
                self.prober.tick(now, self.tasks, self.inbox)
            self.failures.flush_cancels(self.link, self.tasks)
            self._fill(now, open_new=not self.policy.done(self.book))
            if show and self.console.progress is not None:
                self.console.show(self._snapshot())
            await self._wait(now)

    def _raise_errors(self) -> None:
        """Re-raise a crash of a background task or of the link's handlers (our bugs, never swallowed)."""
        if self.tasks.error is not None:
            raise self.tasks.error
        handler_error = getattr(self.link, "handler_error", None)
        if handler_error is not None:
            raise handler_error

    async def _wait(self, now: float) -> None:
        """Sleep until an event, the nearest deadline or the next probe tick (at most 0.5 s)."""
        timeout = 0.5
        expiring = [a.deadline for a in self.ledger.expired(math.inf)]
        if expiring:
            timeout = min(timeout, max(0.0, min(expiring) - now))
        if self.prober.enabled:
            timeout = min(timeout, max(0.0, self.prober.next_tick - now))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.inbox.wake.wait(), timeout=timeout)
        self.inbox.wake.clear()

    def _on_report(self, report: Report, payload: bytes) -> None:
        """The link's report callback: recorded for the loop, nothing else."""
        self.inbox.put(Reported(report, payload, self.clock()))

    # ---- reactions ------------------------------------------------------------------------------

    def _react(self) -> None:
        """React to every event that arrived, in order, closing what each one completes."""
        while (ev := self.inbox.take()) is not None:
            match ev:
                case Reported():
                    self._reported(ev)
                case Acked():
                    ev.attempt.acked = True
                    self.prober.acked(ev.attempt, ev.at)
                case SendFailed():
                    route = ev.attempt.route
                    self.failures.fail(
                        ev.attempt, reason=ev.failure, stage=0, peer=route[0], detail=ev.detail
                    )
                case Probed():
                    self.prober.answered(ev)
                case Refreshed():
                    self.routes.update(ev.stages)
                    now = self.clock()
                    for a in self.ledger.inflight_attempts():  # departed peers holding ours: probe them
                        self.prober.flag(self.routes.departed(a.route), now)
            self._settle()

    def _reported(self, ev: Reported) -> None:
        report = ev.report
        outcome = self.ledger.on_report(report)
        attempt, mb = outcome.attempt, outcome.micro_batch
        if outcome.event == "completed":
            assert attempt is not None and mb is not None
            attempt.payload = ev.payload
            self._completed(attempt, mb, ev.at)
        elif outcome.event == "failed":
            assert attempt is not None
            if report.counted_from >= 0:
                # note "counted stages": a retry must not add this gradient again at these stages
                data = self.ledger.micro_batches[attempt.index].data
                known = data.get("counted_from", -1)
                data["counted_from"] = report.counted_from if known < 0 else min(known, report.counted_from)
            self.failures.fail(
                attempt,
                reason=report.failure or Failure.ERROR,
                stage=report.stage,
                peer=report.peer or None,
                detail=report.reason,
            )
        elif outcome.event == "loss" and mb is not None and mb.state == "completed" and mb.kind == "train":
            self.book.late_loss(report.loss)

    def _completed(self, attempt: Attempt, mb: MicroBatch, at: float) -> None:
        train = mb.kind == "train"
        trip = at - attempt.started
        self.prober.completed(attempt, train=train, round_trip_s=trip, at=at)
        if train:
            changed = self.policy.observe(at, trip, self.ledger.inflight())  # note "pacing"
            if changed is not None:
                self.records.event("inflight", **changed)
        for stage, pid in enumerate(attempt.route):
            self.router.on_success(pid, n_tokens=mb.n_tokens, service_s=service_seconds(attempt.stats, stage))
        self.book.completed(attempt, mb)
        if train:
            self.policy.resolved()

    def _dropped(self, mb: MicroBatch) -> None:
        if mb.kind == "train":
            self.book.dropped()
            self.policy.resolved()

    def _settle(self) -> None:
        """Close the step when the policy says it is full, and the evaluation round once it resolved."""
        if self.policy.step_full(self.book):
            self._close_step()
        rec = self.evaluation.finished(self.ledger, elapsed_s=self.records.elapsed())
        if rec is not None:
            self.records.write(rec)
            if rec["eval_micro_batches"]:
                self.console.say(f"step {rec['step']}: held-out loss {rec['eval_loss']:.3f}")

    def _close_step(self) -> None:
        now = self.clock()
        rec = self.book.close(
            elapsed_s=now - self.records.started,
            totals=self.ledger.totals("train"),
            tokens_per_s=self.book.tokens_per_s(now),
        )
        rec["data_position"] = self.data_position  # note "resume"
        rec.update(self.policy.step_fields())
        self.records.write(rec)
        self.evaluation.step_closed(self.book.step)

    # ---- filling routes -------------------------------------------------------------------------

    def _fill(self, now: float, *, open_new: bool) -> None:
        if self.evaluation.due and self.evaluation.round is None:
            self._open_eval()
        if self.policy.lockstep and self.evaluation.round is not None:
            open_new = False  # note "evaluation between windows" (swarm/train/steps.py)
        self._send_more(now, open_new)
        self.policy.track(now, self.ledger.inflight())

    def _open_eval(self) -> None:
        # the weights being evaluated are those of this step
        self.evaluation.open(
            self.ledger,
            self.data,
            step=self.book.step,
            tokens=self.book.tokens_done,
            elapsed_s=self.records.elapsed(),
            paused=self.policy.lockstep,
        )

    def _next_micro_batch(self, open_new: bool) -> MicroBatch | None:
        for mb in self.ledger.pending():  # retries and evaluations first, oldest first
            return mb
        if not open_new:
            return None
        ledger = self.ledger
        outstanding = ledger.inflight("train") + sum(1 for mb in ledger.pending() if mb.kind == "train")
        if self.policy.quota(self.book, outstanding) <= 0:
            return None
        tokens, targets = next(self.stream)  # (B, T), (B, T)
        self.data_position += 1
        data = {"tokens": tokens, "targets": targets, "avoid": set(), **self.policy.opened(self.book)}
        return ledger.open("train", tokens.numel(), data=data)

    def _send_more(self, now: float, open_new: bool) -> None:
        while self.ledger.inflight() < self.policy.inflight_target():
            mb = self._next_micro_batch(open_new)
            if mb is None:
                return
            try:
                route = self.router.route(
                    self.routes.routable(now),
                    avoid=frozenset(mb.data["avoid"]),
                    max_per_peer=self.routes.max_per_peer,
                )
            except NoPeersError as e:
                if e.reason != "saturated":  # saturated: every peer has enough of ours; wait for completions
                    self.routes.unavailable(e, now)
                return
            self.routes.available(now)
            timeout = self.router.deadline_s(
                route, self.routes.stages, n_tokens=mb.n_tokens, wire_bytes=self.wire_bytes
            )
            attempt = self.ledger.start_attempt(mb.index, route, now=now, timeout_s=timeout)
            self.prober.sent(route, now)
            self.book.sent(now)
            self.tasks.spawn(self._send(attempt, mb))

    async def _send(self, attempt: Attempt, mb: MicroBatch) -> None:
        try:
            await self.link.send_forward(
                route=attempt.route,
                mb_id=attempt.mb_id,
                mode=mb.kind,
                tokens=mb.data["tokens"],
                targets=mb.data["targets"],
                timeout_s=self.config.call_timeout_s,
                counted_from=mb.data.get("counted_from", -1),
                window=mb.data.get("window", -1),
                one_report=mb.kind == "train",  # note "one report" (swarm/wire/protocol.py)
            )
        except PeerFailure as e:
            self.inbox.put(SendFailed(attempt, e.failure, str(e)))
        except RequestError as e:  # stage 0 refused it: busy, or anything else is a refusal of this one
            reason = Failure.BUSY if e.failure is Failure.BUSY else Failure.REFUSED
            self.inbox.put(SendFailed(attempt, reason, str(e)))
        else:
            self.inbox.put(Acked(attempt, self.clock()))

    def _snapshot(self) -> ProgressSnapshot:
        target_tokens = self.target_mbs * self.spec.tokens_per_micro_batch
        return self.book.snapshot(
            self.ledger, now=self.clock(), target_steps=self.target_steps, target_tokens=target_tokens
        )
