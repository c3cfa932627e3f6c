"""The background loops of a stage peer, each started through its ``TaskOwner`` (peer/tasks.py).

What a crash of each loop means (``SUPERVISION``; the crash is always logged at ERROR with its
traceback and the loop's name):

- ``announce`` (record + rebalancing, a tick every ~5 s, jittered; an unchanged record is stored every
  few ticks: peer/announcements.py), ``expiry`` (stash expiry, probes of
  quiet trainers), ``authorized`` (a private run's peer set for the averager) and ``checkpoint``:
  restarted, at most 3 times in a row with a doubling backoff; then the peer stops (announces
  leaving and shuts down). DHT and disk errors are expected and handled inside each loop; what
  escapes is a bug, and a peer that stays online without one of these loops is worse than none:
  trainers keep routing to a peer whose record ages out, whose stash never expires, that refuses
  joiners' downloads or silently stops checkpointing.
- ``replica rounds``: not restarted, the peer stops at once. A crash can leave a round half taken
  (gradients taken from the accumulator, the forward gate closed in sync mode), which a new rounds
  thread cannot repair; the stage's other replicas carry on without this one.

``Background`` is one of ``StagePeer``'s parts (peer/server.py); it also holds what the loops need:
the announced record, live replica counts, the move to another stage's pre-check, checkpoints.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from peer.checkpoint import save_checkpoint
from peer.compute import StageCompute
from peer.replicas import ReplicaRounds, RoundsConfig
from peer.tasks import Supervision
from swarm.errors import Failure, PeerFailure, RequestError, SwarmError
from swarm.wire.protocol import INFO, Message, call

__all__ = ["SUPERVISION", "Background", "watch_rounds"]

logger = logging.getLogger(__name__)

_EXPIRY_PERIOD_S = 1.0
_AUTHORIZED_PERIOD_S = 1.0
_ROUNDS_WATCH_S = 1.0  # how often the rounds thread is looked at (a crash is seen within this)
PING_TIMEOUT_S = 2.0  # an INFO call that tells a live same-stage replica from a dead one

_RESTART = Supervision(restart=True, max_restarts=3, backoff_s=1.0)
SUPERVISION = {
    "announce": _RESTART,
    "expiry": _RESTART,
    "authorized": _RESTART,
    "checkpoint": _RESTART,
    "replica rounds": Supervision(restart=False),
}


class Background:
    """The peer's background loops and what they need (a part of ``StagePeer``: see peer/server.py)."""

    def _start_loops(self) -> None:
        """The loops of an online peer (the replica rounds start with each stage: ``_start_rounds``)."""
        self._tasks.loop("announce", self._announce_loop, SUPERVISION["announce"])
        self._tasks.loop("expiry", self._expiry_loop, SUPERVISION["expiry"])
        if self.auth.gated:
            self._tasks.loop("authorized", self._authorized_loop, SUPERVISION["authorized"])
        if self.config.checkpoint_dir is not None:
            self._tasks.loop("checkpoint", self._checkpoint_loop, SUPERVISION["checkpoint"])

    # ---- announcing, rebalancing -------------------------------------------------------------

    def _record(self) -> Any:
        from swarm.dht.records import PeerRecord

        compute = self.compute
        state = self.state if self.state in ("joining", "online", "leaving") else "joining"
        return PeerRecord(
            peer_id=self.peer_id,
            run_id=self.spec.run_id,
            stage=compute.stage,
            state=state,
            throughput=float(self.throughput),
            queue=len(self._queue) if self._queue is not None else 0,
            version=compute.version,
            codecs=_decodable_codecs(),
            spec_hash=self.spec.spec_hash,
        )

    async def _announce(self) -> None:
        """Store this peer's record now (changes of state and stage are stored by their callers at once)."""
        record = self._record()
        await asyncio.to_thread(self._membership.announce, record, self._announcements.expiration_s)
        self._announcements.stored(record, time.monotonic())

    async def _announce_loop(self) -> None:
        period = self.config.announce_period_s
        while True:
            await asyncio.sleep(period * self._rng.uniform(0.8, 1.2))
            try:
                if self.state == "online":
                    await self._announce_round()
            except (SwarmError, OSError) as e:
                logger.warning("announce/rebalance round failed: %s", e)

    async def _announce_round(self) -> None:
        if self._rate is not None:
            self.throughput = self._rate.fold(time.monotonic())
        # note "announce on change" (peer/announcements.py): an unchanged record is stored every few ticks
        stored = self._announcements.reason(self._record(), time.monotonic()) is not None
        if stored:
            await self._announce()
            # the donor priority (a DHT store whenever it changes) with every few stores (note "idle
            # control plane": DONOR_PRIORITY_EVERY_STORES in peer/announcements.py)
            if self._averager is not None and self._donor_priority.due():
                self._averager.share_state(True, priority=self.compute.version)
        replicas = self._compute.replicas if self._compute is not None else 1
        if self._recount.on_tick(
            stored=stored, replicas=replicas
        ):  # note "replica recount" (peer/recount.py)
            await self._refresh_replicas()
        if self.config.rebalancing:
            await self._maybe_move()

    async def _maybe_move(self) -> None:
        from swarm.dht.placement import has_stage_mates, should_move

        # note "lone reads" (peer/announcements.py): a stage's only peer never moves
        if not self._move_reads.due(self._compute.replicas if self._compute is not None else 1):
            return
        records = await asyncio.to_thread(self._membership.all_stage_records)
        self._move_reads.read(alone=not has_stage_mates(records, self.peer_id))
        target = should_move(records, self.peer_id, margin=self.config.rebalance_margin, rng=self._rng)
        if target is not None and target != self.stage and await self._stage_restorable(target, records):
            logger.info("rebalancing: moving from stage %d to stage %d", self.stage, target)
            await self.move_to(target)

    async def _stage_restorable(self, stage: int, records: list) -> bool:
        """Whether a peer moving to ``stage`` finds state there (a live replica or a keeper's snapshot), or
        may start it from the seed (the run has not trained, or ``start_fresh``). Says why not, once."""
        from swarm.dht.snapshots import lost_state_message, training_evidence

        live = [pid for pid, r in records[stage].items() if pid != self.peer_id and r.state == "online"]
        if live or (self.config.start_fresh and self._initial_source(stage)[1] is None):
            return True
        indexes = await asyncio.to_thread(self._membership.snapshot_indexes)
        if any(stage < len(i.versions) and i.versions[stage] >= 0 for i in indexes):
            return True
        evidence = training_evidence(records, await asyncio.to_thread(self._membership.progress), indexes)
        if evidence is None and self._initial_source(stage)[1] is None:
            return True
        if stage not in self._move_refused:
            self._move_refused.add(stage)
            why = self._initial_source(stage)[1] if evidence is None else None
            logger.warning(
                "not moving to stage %d: %s",
                stage,
                why or lost_state_message(self.spec.run_id, stage, evidence),
            )
        return False

    # ---- replicas ---------------------------------------------------------------------------------

    async def _live_replicas(self, stage: int) -> int:
        """Replicas of ``stage``, this peer included, whose records say online and who answer an INFO
        call for that stage (a SIGKILLed peer's record outlives it by up to its TTL; its connection
        fails at once)."""
        records = await asyncio.to_thread(self._membership.stage_records, stage)
        others = [pid for pid, r in records.items() if pid != self.peer_id and r.state == "online"]
        answers = await asyncio.gather(*(self._serves_stage(pid, stage) for pid in others))
        return 1 + sum(answers)

    async def _ping(self, peer: str) -> Any:
        """An INFO call to ``peer``: its answer, or ``PeerFailure``/``RequestError``."""
        return await call(self._p2p, peer, INFO, Message({}), timeout_s=PING_TIMEOUT_S, auth=self.auth)

    async def _serves_stage(self, peer: str, stage: int) -> bool:
        try:
            info = await self._ping(peer)
        except (PeerFailure, RequestError):
            return False
        return info.get("stage") == stage and info.get("state") == "online"

    async def _refresh_replicas(self) -> bool:
        """Count the stage's live replicas and tell the compute; True when the count changed."""
        compute = self._compute
        if compute is None:
            return False
        live = await self._live_replicas(compute.stage)
        changed = live != compute.replicas
        if changed:
            logger.info("stage %d: %d live replica(s) now (was %d)", compute.stage, live, compute.replicas)
        await asyncio.to_thread(compute.set_replicas, live)
        return changed

    def _stage_hint(self) -> None:
        """Another peer downloaded this peer's state (called from any thread): count the replicas again
        soon, a joiner of this stage goes online a moment later (note "replica recount", peer/recount.py)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._start_recounts)

    def _start_recounts(self) -> None:
        if self._recount.hint(time.monotonic()):
            self._tasks.spawn("replica recount", self._recounts())

    async def _recounts(self) -> None:
        """The counts due after a hint, until one finds a change (``Recount``)."""
        try:
            while (at := self._recount.next_at()) is not None:
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                if self.state != "online" or self._compute is None:
                    break
                try:
                    changed = await self._refresh_replicas()
                except (SwarmError, OSError) as e:
                    logger.info("counting the replicas after a state download failed: %s", e)
                    changed = False
                self._recount.counted(time.monotonic(), changed=changed)
        except BaseException:
            self._recount.clear()  # a later hint starts the counts again
            raise
        self._recount.clear()

    def _start_rounds(self, compute: StageCompute) -> None:
        """Start the stage's gradient rounds (peer/replicas.py) and watch their thread."""
        stage = compute.stage
        rounds = ReplicaRounds(
            compute,
            self._averager,
            peer_id=self.peer_id,
            config=RoundsConfig(
                timeout_s=self.spec.averaging.timeout_s,
                max_failed_rounds=self.config.max_failed_rounds,
            ),
            replicas_fn=lambda: self._on_loop(self._live_replicas(stage), timeout_s=10.0),
            catch_up=self._catch_up,
        )
        self._rounds = rounds
        rounds.start()
        self._tasks.loop("replica rounds", lambda: watch_rounds(rounds), SUPERVISION["replica rounds"])

    async def _stop_rounds(self) -> None:
        if self._rounds is not None:
            await asyncio.to_thread(self._rounds.stop, self.spec.averaging.timeout_s + 5)
            for k, v in self._rounds.counters.items():
                self._round_counters[k] += v
            self._rounds = None

    def _on_loop(self, coro: Coroutine[Any, Any, Any], *, timeout_s: float) -> Any:
        """Run ``coro`` on the peer's event loop from another thread and wait for its result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    # ---- stash expiry, the authorized set, checkpoints -----------------------------------------------

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(_EXPIRY_PERIOD_S)
            compute = self._compute
            if compute is None:
                continue
            if self._p2p is not None:
                self._trainers.check()
            for entry in compute.expire():
                self.counters["expired"] += 1
                self._outbox.report_failed(
                    entry.context,
                    stage=compute.stage,
                    peer=self.peer_id,
                    reason=f"stash expired: no backward within {self.spec.stash_ttl_s:.0f} s",
                    failure=Failure.STASH_EXPIRED,
                )

    async def _refresh_authorized(self) -> None:
        """Tell the averager which peer ids may download state or average with us: the stage peers of
        the run whose DHT records carry valid join proofs (Membership already dropped the rest)."""
        if self.auth is None or not self.auth.gated or self._averager is None:
            return
        records = await asyncio.to_thread(self._membership.all_stage_records)
        allowed = {pid for stage in records for pid in stage} | {self.peer_id}
        averager = self._averager
        if averager is not None:
            averager.set_authorized(sorted(allowed))

    async def _authorized_loop(self) -> None:
        # every second: a joiner announces itself (with its proof) just before it asks for state
        while True:
            await asyncio.sleep(_AUTHORIZED_PERIOD_S)
            try:
                await self._refresh_authorized()
            except (SwarmError, OSError) as e:
                logger.warning("refreshing the authorized peers failed: %s", e)

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.checkpoint_period_s)
            try:
                await asyncio.to_thread(self._save_checkpoint)
            except OSError as e:
                logger.error("periodic checkpoint to %s failed: %s", self.config.checkpoint_dir, e)

    def _save_checkpoint(self) -> None:
        save_checkpoint(self.config.checkpoint_dir, self._as_checkpoint(self.compute))


async def watch_rounds(rounds: ReplicaRounds) -> None:
    """Return when the rounds thread ends; raise what it crashed with, if it did."""
    while rounds.alive:
        await asyncio.sleep(_ROUNDS_WATCH_S)
    if rounds.error is not None:
        raise rounds.error


def _decodable_codecs() -> tuple[str, ...]:
    """Names of every codec this build decodes (what the record's ``codecs`` field announces)."""
    from compression import available_codecs

    return tuple(name for name, _, _ in available_codecs())[:16]
